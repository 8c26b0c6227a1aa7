//! One runtime per protection domain: where it is found, started (once,
//! also in the background from the process's first `ibv_alloc_pd`) and
//! torn down before the PD goes.

use super::qp as vqp;
use super::runtime::{connect_timeout, Runtime, TRANSPORT_WAIT};
use crate::error::{Errno, Result};
use crate::klog;
use crate::log::Level;
use crate::sys::*;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The runtime of each real PD (by address).
static RUNTIMES: Mutex<Option<HashMap<usize, Arc<Runtime>>>> = Mutex::new(None);
/// One start at a time per PD, without holding `RUNTIMES` (a start takes
/// milliseconds; other PDs' lookups must not wait for it).
static STARTS: Mutex<Option<HashMap<usize, Arc<Mutex<()>>>>> = Mutex::new(None);
/// Starts in the background (`KRCORE_PRESTART`): PD -> (context, process,
/// thread, set when the PD goes: a start still waiting to be needed does
/// not begin). A forked child does not join its parent's thread.
static PRESTARTS: Mutex<Option<HashMap<usize, Prestart>>> = Mutex::new(None);
type Prestart = (usize, libc::pid_t, std::thread::JoinHandle<()>, Arc<AtomicBool>);

/// The runtime of real `pd`, if started.
pub fn of(pd: usize) -> Option<Arc<Runtime>> {
    RUNTIMES.lock().as_ref().and_then(|m| m.get(&pd).cloned())
}

/// Every runtime started.
pub fn all() -> Vec<Arc<Runtime>> {
    RUNTIMES.lock().as_ref().map(|m| m.values().cloned().collect()).unwrap_or_default()
}

impl Runtime {
    /// The runtime of the application's real `pd` on real `ctx`, started
    /// at the first need (or taken from the start in progress) with our
    /// GID at `gid_index`.
    ///
    /// # Safety
    /// `ctx` and `pd` are live real objects that outlive the runtime.
    pub unsafe fn get_or_start(ctx: *mut ibv_context, pd: *mut ibv_pd, gid_index: Option<u32>) -> Result<Arc<Runtime>> {
        if let Some(rt) = of(pd as usize) {
            return Ok(rt);
        }
        // Needed now: a start in the background stops giving way to the
        // first work through the agent, or waiting to be needed.
        crate::transport::agent::runtime_needed();
        // SAFETY: caller contract.
        unsafe { Runtime::get_or_start_in_background(ctx, pd, gid_index) }
    }

    /// [`Self::get_or_start`] on a thread of our own: the start gives way
    /// to the first work through the agent (`transport::agent::give_way`).
    ///
    /// # Safety
    /// As [`Self::get_or_start`].
    unsafe fn get_or_start_in_background(ctx: *mut ibv_context, pd: *mut ibv_pd, gid_index: Option<u32>) -> Result<Arc<Runtime>> {
        if let Some(rt) = of(pd as usize) {
            return Ok(rt);
        }
        let gate = Arc::clone(STARTS.lock().get_or_insert_with(HashMap::new).entry(pd as usize).or_default());
        let _one_start = gate.lock();
        if let Some(rt) = of(pd as usize) {
            return Ok(rt);
        }
        // SAFETY: caller contract.
        let rt = unsafe { Runtime::start(ctx, pd, gid_index) }?;
        RUNTIMES.lock().get_or_insert_with(HashMap::new).insert(pd as usize, Arc::clone(&rt));
        Ok(rt)
    }
}

/// After the process's first `ibv_alloc_pd` (real `ctx`, `pd`), with
/// `KRCORE_META` set and `KRCORE_PRESTART` on: start that PD's runtime
/// (whose meta-server connection is made on a thread of its own) on a
/// thread, so that they overlap the application's own set-up instead of
/// standing in front of its first connect (which takes the runtime, or
/// waits for its start, and then for the meta connection).
pub fn prestart(ctx: *mut ibv_context, pd: *mut ibv_pd) {
    static FIRST: AtomicBool = AtomicBool::new(true);
    let cfg = crate::config::get();
    if !cfg.prestart || cfg.meta.is_none() || !FIRST.swap(false, Ordering::AcqRel) {
        return;
    }
    start_soon(ctx, pd);
}

/// Start the runtime of real `pd` on a thread, unless it is started or
/// its start is under way (a VQP on the agent's path moves onto it).
/// A process attached to the host's agent opens its path to the agent
/// there, and starts the runtime only when it needs one
/// (`transport::agent::wait_until_needed`): its first operations go
/// through the agent, and one that ends soon after never pays for a
/// runtime of its own.
pub fn start_soon(ctx: *mut ibv_context, pd: *mut ibv_pd) {
    let (c, p) = (ctx as usize, pd as usize);
    // Held until the start is recorded: one start per PD.
    let mut starts = PRESTARTS.lock();
    if of(p).is_some() || starts.as_ref().is_some_and(|m| m.contains_key(&p)) {
        return;
    }
    let cancel = Arc::new(AtomicBool::new(false));
    let cancelled = Arc::clone(&cancel);
    let body = move || {
        // A transparent QP needs the runtime at its creation: no waiting.
        let deferred = crate::config::get().virtualize == crate::config::Virtualize::Off
            && crate::node::client::attach()
            && crate::transport::agent::AgentPath::get().is_some();
        if deferred {
            crate::kmark!("runtime: its start waits until it is needed");
            if !crate::transport::agent::wait_until_needed(&cancelled) {
                return;
            }
        }
        // SAFETY: the PD and its context outlive this thread:
        // ibv_dealloc_pd and ibv_close_device join it first.
        match unsafe { Runtime::get_or_start_in_background(c as *mut ibv_context, p as *mut ibv_pd, None) } {
            Ok(_) => {
                crate::stats::inc(crate::stats::Stat::KRCORE_STAT_RUNTIMES_PRESTARTED);
                crate::kmark!("runtime: started in the background");
            }
            Err(e) => klog!(Level::Info, "vqp: the runtime's start in the background: {e:?} (tried again at the first extended verb)"),
        }
    };
    match std::thread::Builder::new().name("krcore-prestart".into()).spawn(body) {
        Ok(t) => {
            // SAFETY: getpid has no preconditions.
            let pid = unsafe { libc::getpid() };
            starts.get_or_insert_with(HashMap::new).insert(p, (c, pid, t, cancel));
        }
        Err(e) => klog!(Level::Info, "vqp: no thread to start the runtime at ibv_alloc_pd: {e}"),
    }
}

/// Wait for the background start of real `pd`, if any (one still waiting
/// to be needed does not begin).
fn join_prestart(pd: usize) {
    let t = PRESTARTS.lock().as_mut().and_then(|m| m.remove(&pd));
    if let Some((_, pid, t, cancel)) = t {
        cancel.store(true, Ordering::Release);
        crate::transport::agent::wake_deferred();
        // SAFETY: getpid has no preconditions.
        if pid == unsafe { libc::getpid() } {
            let _ = t.join();
        }
    }
}

/// Before `ibv_dealloc_pd` of real `pd`: tear its runtime down (service
/// endpoint, links, receive buffers, meta client), which holds objects on
/// the PD. EBUSY while a VQP of the PD is alive, as the real verb with
/// QPs on the PD.
pub fn release_pd(pd: *mut ibv_pd) -> Result<()> {
    // The map's reference is the only one when no VQP holds the runtime;
    // the service thread and CQ polls hold it while they work, which is
    // waited out (without the map's lock, which they may take), as long
    // as a link's work may take (a link failing under that work), and a
    // background link's handshake in flight (bounded by the connect
    // timeout from its own start) after it. A start in the background
    // (prestart) makes objects on the PD too: it ends first.
    join_prestart(pd as usize);
    if let Some(m) = STARTS.lock().as_mut() {
        m.remove(&(pd as usize));
    }
    let deadline = Instant::now() + 2 * connect_timeout().max(TRANSPORT_WAIT);
    let rt = loop {
        let mut g = RUNTIMES.lock();
        let Some(map) = g.as_mut() else { return Ok(()) };
        let Some(rt) = map.get(&(pd as usize)) else { return Ok(()) };
        if Arc::strong_count(rt) == 1 {
            break map.remove(&(pd as usize)).expect("present");
        }
        let rt = Arc::clone(rt);
        drop(g);
        let used = vqp::live().iter().any(|v| v.runtime_is(&rt));
        if used || Instant::now() > deadline {
            if used {
                klog!(Level::Debug, "vqp: ibv_dealloc_pd: a VQP of the PD is alive: EBUSY");
            } else {
                // Not expected: something held the runtime for the whole wait.
                klog!(
                    Level::Warn,
                    "vqp: ibv_dealloc_pd: the PD's runtime is still held ({} references, no VQP among them)",
                    Arc::strong_count(&rt)
                );
            }
            return Err(Errno(libc::EBUSY));
        }
        drop(rt);
        std::thread::sleep(Duration::from_millis(1));
    };
    rt.teardown();
    // The runtime's objects must be gone when the real verb runs, so the
    // last reference is dropped here: a thread that upgraded its weak
    // reference since the count above (the progress thread's deferred work
    // or a timer, a background link) would otherwise drop it after the
    // real `ibv_dealloc_pd`, which then fails with EBUSY. Once unwrapped
    // no weak reference upgrades any more.
    let mut rt = rt;
    loop {
        match Arc::try_unwrap(rt) {
            Ok(last) => {
                drop(last);
                return Ok(());
            }
            Err(held) if Instant::now() > deadline => {
                klog!(
                    Level::Warn,
                    "vqp: ibv_dealloc_pd: the PD's runtime is still held at its teardown ({} references)",
                    Arc::strong_count(&held)
                );
                RUNTIMES.lock().get_or_insert_with(HashMap::default).insert(pd as usize, held);
                return Err(Errno(libc::EBUSY));
            }
            Err(held) => {
                rt = held;
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// Before `ibv_close_device` of real `ctx`: tear down the runtimes of its
/// PDs that no VQP uses any more (closing the device frees the rest in the
/// kernel).
pub fn release_context(ctx: *mut ibv_context) {
    let starting: Vec<usize> = PRESTARTS
        .lock()
        .as_ref()
        .map(|m| m.iter().filter(|(_, (c, _, _, _))| *c == ctx as usize).map(|(pd, _)| *pd).collect())
        .unwrap_or_default();
    starting.into_iter().for_each(join_prestart);
    let pds: Vec<usize> = RUNTIMES
        .lock()
        .as_ref()
        .map(|m| m.iter().filter(|(_, rt)| rt.svc.device().ctx == ctx).map(|(pd, _)| *pd).collect())
        .unwrap_or_default();
    for pd in pds {
        let _ = release_pd(pd as *mut ibv_pd);
    }
}
