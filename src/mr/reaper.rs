//! Batched, deferred deregistration: the real `ibv_dereg_mr` of regions the
//! cache evicts runs on one background thread, a batch at a time, so the
//! application's `ibv_dereg_mr` that pushed the cache past its limit does
//! not also pay for deregistering someone else's region (a kernel unpin and
//! a NIC update, about as much as the registration that missed), nor, but
//! once per batch, for waking the thread.
//!
//! Evicted regions are already out of every cache index when they are
//! queued: nothing can hand them out again. The thread is woken when
//! `batch` regions, or `batch_bytes`, are queued. While that full batch
//! waits for the thread (it has not been scheduled yet, or is still busy
//! with the previous one), further victims are deregistered on the caller's
//! thread: back-pressure, so the limits are exceeded by at most two batches
//! (one being deregistered, one queued) however late the thread runs.
//! Whoever needs the regions really gone
//! (before `ibv_dealloc_pd` or `ibv_close_device`, or when a registration
//! failed for lack of pinnable memory) calls [`Reaper::drain`], which
//! deregisters what is queued on the caller's thread and waits for the
//! thread's batch in progress.
//!
//! The thread sleeps on a condition variable (no polling) and never takes
//! the cache lock; the cache calls in with its lock held, so the order is
//! always cache lock, then reaper lock. It is started at the first
//! eviction; `KRCORE_MR_DEREG_THREAD=0`, or a failure to start it,
//! deregisters on the caller's thread instead. A forked child never uses the
//! parent's cache (see `mr::cache`), so it never touches this queue.

use super::cache::Backend;
use crate::klog;
use crate::log::Level;
use crate::stats::{self, Stat};
use crate::sys::ibv_mr;
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// An MR handle on its way to the thread.
struct Victim(*mut ibv_mr);

// SAFETY: an MR handle of libibverbs may be deregistered from any thread;
// a queued one is referenced by nothing else.
unsafe impl Send for Victim {}

#[derive(Default)]
struct State {
    queue: Vec<Victim>,
    queued_bytes: usize,
    /// A batch is ready: the thread should take the queue.
    full: bool,
    /// The thread is deregistering a batch of this many regions taken
    /// from the queue (0: idle).
    busy: usize,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Work queued, or stop.
    wake: Condvar,
    /// A batch finished.
    done: Condvar,
    backend: Arc<dyn Backend>,
}

pub struct Reaper {
    shared: Arc<Shared>,
    /// `None` until the first deferral; stays `None` when disabled or the
    /// thread could not start.
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Wake the thread at this many queued regions (0: no thread)...
    batch: usize,
    /// ... or at this many queued bytes.
    batch_bytes: usize,
}

impl Reaper {
    /// `batch == 0`: every deregistration on the caller's thread.
    pub fn new(backend: Arc<dyn Backend>, batch: usize, batch_bytes: usize) -> Reaper {
        let shared = Arc::new(Shared { state: Mutex::default(), wake: Condvar::new(), done: Condvar::new(), backend });
        Reaper { shared, thread: Mutex::new(None), batch, batch_bytes: batch_bytes.max(1) }
    }

    /// Deregister `(mr, length)`s: by the thread when it runs, else here.
    pub fn defer(&self, mrs: impl IntoIterator<Item = (*mut ibv_mr, usize)>) {
        if !self.running() {
            dereg_here(&*self.shared.backend, mrs.into_iter().map(|(mr, _)| mr));
            return;
        }
        let mut inline = Vec::new();
        let mut st = self.shared.state.lock();
        for (mr, len) in mrs {
            if st.full {
                // The thread is a full batch behind: do not queue more.
                inline.push(mr);
                continue;
            }
            st.queue.push(Victim(mr));
            st.queued_bytes += len;
            if st.queue.len() >= self.batch || st.queued_bytes >= self.batch_bytes {
                st.full = true;
                self.shared.wake.notify_one();
            }
        }
        st.publish_pending();
        drop(st);
        dereg_here(&*self.shared.backend, inline);
    }

    /// Whether evicted regions wait for deregistration.
    pub fn pending(&self) -> bool {
        let st = self.shared.state.lock();
        !st.queue.is_empty() || st.busy > 0
    }

    /// Deregister everything queued, here, and wait for the thread's batch
    /// in progress: afterwards every region handed to `defer` is gone.
    pub fn drain(&self) {
        let queued = {
            let mut st = self.shared.state.lock();
            st.queued_bytes = 0;
            st.full = false;
            std::mem::take(&mut st.queue)
        };
        dereg_here(&*self.shared.backend, queued.into_iter().map(|v| v.0));
        let mut st = self.shared.state.lock();
        while st.busy > 0 {
            self.shared.done.wait(&mut st);
        }
        st.publish_pending();
    }

    /// Whether deferred work goes to the thread (starting it if needed).
    fn running(&self) -> bool {
        if self.batch == 0 {
            return false;
        }
        let mut t = self.thread.lock();
        if t.is_none() {
            let shared = Arc::clone(&self.shared);
            match std::thread::Builder::new().name("krcore-dereg".into()).spawn(move || worker(&shared)) {
                Ok(h) => *t = Some(h),
                Err(e) => {
                    klog!(Level::Warn, "MR cache: cannot start the deregistration thread ({e}); deregistering inline");
                    return false;
                }
            }
        }
        true
    }

    /// Stop the thread: it finishes its batch (bounded by `grace`) and what
    /// is still queued stays registered, which process exit reclaims.
    pub fn stop(&self, grace: Duration) {
        let Some(h) = self.thread.lock().take() else { return };
        let deadline = Instant::now() + grace;
        let mut st = self.shared.state.lock();
        st.stop = true;
        self.shared.wake.notify_one();
        while st.busy > 0 {
            if self.shared.done.wait_until(&mut st, deadline).timed_out() {
                return; // Stuck in the driver: leave it to the exit.
            }
        }
        drop(st);
        let _ = h.join();
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        self.drain();
        self.stop(Duration::from_secs(10));
    }
}

impl State {
    /// Evicted regions still registered: queued or being deregistered.
    fn publish_pending(&self) {
        stats::set(Stat::KRCORE_STAT_MR_CACHE_DEREG_PENDING, (self.queue.len() + self.busy) as u64);
    }
}

/// Deregister on the calling thread (counted as such).
fn dereg_here(backend: &dyn Backend, mrs: impl IntoIterator<Item = *mut ibv_mr>) {
    for mr in mrs {
        dereg(backend, mr);
        stats::inc(Stat::KRCORE_STAT_MR_CACHE_DEREG_INLINE);
    }
}

fn dereg(backend: &dyn Backend, mr: *mut ibv_mr) {
    if let Err(e) = backend.dereg(mr) {
        klog!(Level::Warn, "deregistering an evicted MR failed: {e:?}");
    }
}

fn worker(shared: &Shared) {
    let mut st = shared.state.lock();
    loop {
        while !st.full && !st.stop {
            shared.wake.wait(&mut st);
        }
        if st.stop {
            return;
        }
        let batch = std::mem::take(&mut st.queue);
        st.queued_bytes = 0;
        st.full = false;
        st.busy = batch.len();
        drop(st);
        for v in &batch {
            dereg(&*shared.backend, v.0);
        }
        stats::add(Stat::KRCORE_STAT_MR_CACHE_DEREG_BACKGROUND, batch.len() as u64);
        st = shared.state.lock();
        st.busy = 0;
        st.publish_pending();
        shared.done.notify_all();
    }
}
