//! Memory registration: the registration cache, its eviction policy and
//! the memory-event monitor that keeps it from ever handing out a stale
//! registration.

pub mod cache;
pub mod monitor;
pub mod policy;
mod reaper;

use crate::call_real;
use crate::error::Result;
use crate::klog;
use crate::log::Level;
use crate::obj::{non_null, ok_or_errno};
use crate::stats::{self, Stat};
use crate::sys::{ibv_mr, ibv_pd};
use cache::{Backend, Cache, Limits, Mode};
use monitor::{Queue, Uffd};
use once_cell::sync::Lazy;
use std::sync::atomic::{AtomicBool, Ordering};

/// Ranges unmapped or replaced, from the memory hooks and the uffd reader.
pub static QUEUE: Queue = Queue::new();

/// Set in a forked child (by the atfork handler, which takes no lock): the
/// child never uses or deregisters the parent's cached regions.
static FORKED: AtomicBool = AtomicBool::new(false);

struct RealBackend {
    uffd: Option<Uffd>,
}

impl Backend for RealBackend {
    fn reg(&self, pd: *mut ibv_pd, addr: usize, len: usize, access: u32) -> Result<*mut ibv_mr> {
        non_null(call_real!(ibv_reg_mr_iova2(pd, addr as *mut libc::c_void, len, addr as u64, access))?)
    }

    fn dereg(&self, mr: *mut ibv_mr) -> Result<()> {
        ok_or_errno(call_real!(ibv_dereg_mr(mr))?)
    }

    fn watch(&self, start: usize, end: usize) -> bool {
        match &self.uffd {
            Some(u) => match u.watch(start, end) {
                Ok(()) => true,
                Err(e) => {
                    klog!(Level::Debug, "cannot watch {start:#x}..{end:#x} ({e}): kept only while held");
                    false
                }
            },
            None => false,
        }
    }
}

extern "C" fn in_forked_child() {
    FORKED.store(true, Ordering::SeqCst);
    QUEUE.set_watching(false);
}

/// Whether the kernel exempts this process from `RLIMIT_MEMLOCK` when it
/// pins memory (`CAP_IPC_LOCK` in the effective set; root has it).
fn has_cap_ipc_lock() -> bool {
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    const CAP_IPC_LOCK: u32 = 14;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut hdr = Header { version: LINUX_CAPABILITY_VERSION_3, pid: 0 };
    let mut data = [Data::default(); 2];
    // SAFETY: capget fills one header and two data words for version 3.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut hdr as *mut Header, data.as_mut_ptr()) };
    rc == 0 && data[0].effective & (1 << CAP_IPC_LOCK) != 0
}

/// The idle budget: `KRCORE_MR_CACHE_BYTES` as given; by default 1 GiB,
/// or half of a finite `RLIMIT_MEMLOCK` for a process the kernel holds to
/// that limit, so that new registrations still fit beside idle regions
/// (and if they do not, the cache gives its idle regions back; see cache.rs).
fn default_limits() -> Limits {
    let cfg = crate::config::get();
    let max_bytes = cfg.mr_cache_bytes.unwrap_or_else(|| {
        let mut memlock = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes one rlimit.
        let finite = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut memlock) } == 0 && memlock.rlim_cur != libc::RLIM_INFINITY;
        let cap = if finite && !has_cap_ipc_lock() { (memlock.rlim_cur / 2) as usize } else { usize::MAX };
        (1usize << 30).min(cap)
    });
    Limits { max_bytes, max_entries: cfg.mr_cache_entries }
}

static CACHE: Lazy<Option<Cache>> = Lazy::new(|| {
    crate::kmark!("MR cache: starting");
    let cfg = crate::config::get();
    if !cfg.mr_cache {
        stats::set(Stat::KRCORE_STAT_MR_CACHE_MODE, Mode::Off as u64);
        return None;
    }
    let (uffd, mode) = match Uffd::start(&QUEUE) {
        Ok(u) => (Some(u), Mode::Caching),
        Err(e) => {
            klog!(Level::Warn, "MR cache: no sound unmap monitor ({e}); every registration is real (no reuse)");
            (None, Mode::HoldOnly)
        }
    };
    // SAFETY: registers a handler that only stores two atomics.
    unsafe { libc::pthread_atfork(None, None, Some(in_forked_child)) };
    let limits = default_limits();
    klog!(Level::Info, "MR cache: {mode:?}, {} bytes, {} entries", limits.max_bytes, limits.max_entries);
    let mut cache = Cache::new(Box::new(RealBackend { uffd }), &QUEUE, limits, mode);
    if cfg.mr_dereg_batch > 0 {
        cache = cache.with_dereg_thread(cfg.mr_dereg_batch);
    }
    stats::set(Stat::KRCORE_STAT_MR_CACHE_MODE, mode as u64);
    crate::kmark!("MR cache: started");
    Some(cache)
});

/// First use of the cache: also honour fork protection enabled from the
/// environment (RDMAV_FORK_SAFE) before any region is kept idle.
static FORK_CHECKED: once_cell::sync::OnceCell<()> = once_cell::sync::OnceCell::new();

/// libibverbs' fork protection (`ibv_fork_init` on a kernel without
/// copy-on-fork for pinned pages) marks registered ranges MADV_DONTFORK
/// until deregistration. An idle cached region would keep that mark after
/// the application deregistered, and a child would miss memory it expects:
/// with fork protection on, the cache stops reusing registrations.
pub fn check_fork_protection() {
    const IBV_FORK_ENABLED: libc::c_uint = 1;
    let Some(cache) = CACHE.as_ref() else { return };
    if cache.mode() == Mode::Caching && call_real!(ibv_is_fork_initialized()).ok() == Some(IBV_FORK_ENABLED) {
        klog!(Level::Info, "MR cache: fork protection is on; every registration is real (no reuse)");
        cache.set_mode(Mode::HoldOnly);
        cache.flush_idle();
    }
}

/// The process's registration cache, unless it is off or this is a forked
/// child.
pub fn cache() -> Option<&'static Cache> {
    if FORKED.load(Ordering::Relaxed) {
        stats::set(Stat::KRCORE_STAT_MR_CACHE_MODE, Mode::ForkedChild as u64);
        return None;
    }
    FORK_CHECKED.get_or_init(check_fork_protection);
    CACHE.as_ref()
}

/// Process exit: stop the deregistration thread (what it has not
/// deregistered yet, the exit reclaims). A forked child has no such thread
/// and never touches the parent's queue.
pub fn shutdown() {
    if FORKED.load(Ordering::Relaxed) {
        return;
    }
    if let Some(Some(cache)) = Lazy::get(&CACHE) {
        cache.stop_dereg_thread();
    }
}
