//! Memory-event monitor: learns which address ranges were unmapped or had
//! their pages replaced, and queues them for the registration cache.
//!
//! Two sources feed one queue:
//! - the interposed libc calls (`munmap`, `mremap`, `madvise`, `brk`,
//!   `sbrk`, `shmdt`, `mmap(MAP_FIXED)`, see `abi/mem.rs`), which cover the
//!   application's own calls;
//! - a userfaultfd (`UFFD_USER_MODE_ONLY`, unmap/remove/remap events) on
//!   the cached ranges, which also sees glibc's internal `munmap` inside
//!   `free()` that no symbol interposition sees.
//!
//! The unmapping thread blocks until the uffd event is read, and returns as
//! soon as it is: the reader raises `pending` *before* `read()` and lowers
//! it after queuing, so a lookup that starts after the unmap returned sees
//! either the queued range or `pending != 0` (and waits for it). Nothing
//! here allocates or takes a lock other than the queue's own, which is
//! never held while calling out: the queue is safe inside memory hooks.

use crate::klog;
use crate::log::Level;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Ranges queued between two drains; past this the queue overflows and the
/// next drain invalidates everything (sound, never stale).
const QUEUE_LEN: usize = 512;

/// `[start, end)` byte range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    pub start: usize,
    pub end: usize,
}

pub struct Queue {
    ring: Mutex<([Range; QUEUE_LEN], usize)>,
    overflow: AtomicBool,
    /// Something was queued since the last drain (lets drains skip the lock).
    dirty: AtomicBool,
    /// uffd events read but not yet queued.
    pending: AtomicUsize,
    /// Off: hooks return at once (no cache, or nothing it could lose).
    watching: AtomicBool,
    /// Span of every cached range: unmaps outside it cannot matter, so a
    /// malloc-heavy program does not flood (and overflow) the queue.
    lo: AtomicUsize,
    hi: AtomicUsize,
}

impl Default for Queue {
    fn default() -> Self {
        Queue::new()
    }
}

impl Queue {
    pub const fn new() -> Queue {
        Queue {
            ring: Mutex::new(([Range { start: 0, end: 0 }; QUEUE_LEN], 0)),
            overflow: AtomicBool::new(false),
            dirty: AtomicBool::new(false),
            pending: AtomicUsize::new(0),
            watching: AtomicBool::new(false),
            lo: AtomicUsize::new(usize::MAX),
            hi: AtomicUsize::new(0),
        }
    }

    /// A range is about to be cached: widen the span hooks care about.
    /// Called before the range is watched or handed out.
    pub fn cover(&self, start: usize, end: usize) {
        // Usually already covered: plain loads, no locked instruction.
        if start < self.lo.load(Ordering::SeqCst) {
            self.lo.fetch_min(start, Ordering::SeqCst);
        }
        if end > self.hi.load(Ordering::SeqCst) {
            self.hi.fetch_max(end, Ordering::SeqCst);
        }
    }

    /// Hooks skip all work while the cache holds nothing.
    pub fn set_watching(&self, on: bool) {
        self.watching.store(on, Ordering::SeqCst);
    }

    /// Queue a range (from a memory hook or the uffd reader). No allocation.
    pub fn push(&self, start: usize, end: usize) {
        if end <= start
            || !self.watching.load(Ordering::SeqCst)
            || end <= self.lo.load(Ordering::SeqCst)
            || start >= self.hi.load(Ordering::SeqCst)
        {
            return;
        }
        let mut g = self.ring.lock();
        let (ring, n) = &mut *g;
        if *n == QUEUE_LEN {
            // Set before `dirty`, read after it: the drain that sees `dirty` sees this.
            self.overflow.store(true, Ordering::SeqCst);
        } else {
            ring[*n] = Range { start, end };
            *n += 1;
        }
        self.dirty.store(true, Ordering::SeqCst);
    }

    /// Take everything queued. Waits (yielding) while uffd events are being
    /// read, so nothing unmapped before this call is missed. Returns
    /// `None` when the queue overflowed: invalidate everything.
    pub fn drain(&self, out: &mut Vec<Range>) -> Option<()> {
        let mut spins = 0u32;
        while self.pending.load(Ordering::SeqCst) != 0 {
            spins += 1;
            if spins > 64 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        if !self.dirty.load(Ordering::SeqCst) {
            return Some(());
        }
        let mut g = self.ring.lock();
        self.dirty.store(false, Ordering::SeqCst);
        let (ring, n) = &mut *g;
        out.extend_from_slice(&ring[..*n]);
        *n = 0;
        drop(g);
        if self.overflow.swap(false, Ordering::SeqCst) {
            None
        } else {
            Some(())
        }
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.pending.load(Ordering::SeqCst) == 0 && self.ring.lock().1 == 0 && !self.overflow.load(Ordering::SeqCst)
    }
}

// ---- userfaultfd ABI (linux/userfaultfd.h) ------------------------------------

const UFFD_API: u64 = 0xAA;
const UFFD_USER_MODE_ONLY: libc::c_int = 1;
const UFFDIO_API: libc::c_ulong = 0xC018_AA3F;
const UFFDIO_REGISTER: libc::c_ulong = 0xC020_AA00;
const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
const UFFD_FEATURE_EVENT_UNMAP: u64 = 1 << 6;
const UFFDIO_REGISTER_MODE_WP: u64 = 2;
const UFFD_EVENT_REMAP: u8 = 0x14;
const UFFD_EVENT_REMOVE: u8 = 0x15;
const UFFD_EVENT_UNMAP: u8 = 0x16;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRegister {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}

/// `struct uffd_msg`: event byte, padding, then a 24-byte union.
#[repr(C)]
#[derive(Clone, Copy)]
struct UffdMsg {
    event: u8,
    _reserved: [u8; 7],
    arg: [u64; 3],
}

/// A userfaultfd watching cached ranges, with its reader thread.
pub struct Uffd {
    fd: libc::c_int,
}

impl Uffd {
    /// Open the uffd and start the reader; `Err` says why this process has
    /// no sound way to see glibc-internal unmaps.
    pub fn start(queue: &'static Queue) -> Result<Uffd, String> {
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK | UFFD_USER_MODE_ONLY;
        // SAFETY: plain syscall; returns an fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) } as libc::c_int;
        if fd < 0 {
            return Err(format!("userfaultfd: {}", std::io::Error::last_os_error()));
        }
        let mut api = UffdioApi {
            api: UFFD_API,
            features: UFFD_FEATURE_EVENT_UNMAP | UFFD_FEATURE_EVENT_REMOVE | UFFD_FEATURE_EVENT_REMAP,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API takes a struct uffdio_api.
        if unsafe { libc::ioctl(fd, UFFDIO_API, &mut api) } != 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: our fd.
            unsafe { libc::close(fd) };
            return Err(format!("UFFDIO_API with unmap/remove/remap events: {e}"));
        }
        std::thread::Builder::new()
            .name("krcore-uffd".into())
            .spawn(move || reader(fd, queue))
            .map_err(|e| format!("cannot start the uffd reader: {e}"))?;
        Ok(Uffd { fd })
    }

    /// Watch `[start, end)` (rounded out to pages). Fails for memory
    /// userfaultfd cannot watch (file-backed mappings, for instance).
    pub fn watch(&self, start: usize, end: usize) -> std::io::Result<()> {
        let page = page_size();
        let s = start & !(page - 1);
        let e = (end + page - 1) & !(page - 1);
        let mut reg = UffdioRegister { start: s as u64, len: (e - s) as u64, mode: UFFDIO_REGISTER_MODE_WP, ioctls: 0 };
        // SAFETY: UFFDIO_REGISTER takes a struct uffdio_register.
        if unsafe { libc::ioctl(self.fd, UFFDIO_REGISTER, &mut reg) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }) as usize
}

/// The reader thread: poll, announce, read, queue, retire.
fn reader(fd: libc::c_int, queue: &'static Queue) {
    let mut msgs = [UffdMsg { event: 0, _reserved: [0; 7], arg: [0; 3] }; 16];
    loop {
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, -1) };
        if rc < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            klog!(Level::Error, "uffd poll failed: {}", std::io::Error::last_os_error());
            queue.overflow.store(true, Ordering::SeqCst);
            queue.dirty.store(true, Ordering::SeqCst);
            return;
        }
        // Announce before read(): read() releases the unmapping thread.
        queue.pending.fetch_add(1, Ordering::SeqCst);
        // SAFETY: reading whole uffd_msg records into our buffer.
        let n = unsafe { libc::read(fd, msgs.as_mut_ptr().cast(), std::mem::size_of_val(&msgs)) };
        if n > 0 {
            for m in &msgs[..n as usize / std::mem::size_of::<UffdMsg>()] {
                match m.event {
                    UFFD_EVENT_UNMAP | UFFD_EVENT_REMOVE => queue.push(m.arg[0] as usize, m.arg[1] as usize),
                    UFFD_EVENT_REMAP => {
                        let (from, to, len) = (m.arg[0] as usize, m.arg[1] as usize, m.arg[2] as usize);
                        queue.push(from, from + len);
                        queue.push(to, to + len);
                    }
                    _ => {}
                }
            }
        }
        queue.pending.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_overflow_means_invalidate_everything() {
        let q = Queue::new();
        let mut out = Vec::new();
        q.push(0, 10);
        assert_eq!(q.drain(&mut out), Some(()));
        assert!(out.is_empty(), "ignored while not watching");
        q.set_watching(true);
        q.push(0, 10);
        assert_eq!(q.drain(&mut out), Some(()));
        assert!(out.is_empty(), "ignored outside the cached span");
        q.cover(0, usize::MAX);
        for i in 0..QUEUE_LEN + 1 {
            q.push(i * 4096, i * 4096 + 1);
        }
        assert_eq!(q.drain(&mut out), None);
        assert_eq!(out.len(), QUEUE_LEN);
        assert!(q.is_empty());
    }

    #[test]
    fn uffd_sees_glibc_internal_munmap_of_a_freed_block() {
        static Q: Queue = Queue::new();
        Q.set_watching(true);
        Q.cover(0, usize::MAX);
        let uffd = match Uffd::start(&Q) {
            Ok(u) => u,
            Err(e) => {
                eprintln!("skipping: no userfaultfd here ({e})");
                return;
            }
        };
        // A large malloc is mmap-backed; free() unmaps it inside glibc.
        let len = 8 << 20;
        // SAFETY: plain malloc/free of a block we own.
        let p = unsafe { libc::malloc(len) } as usize;
        assert_ne!(p, 0);
        uffd.watch(p, p + len).expect("UFFDIO_REGISTER on anonymous memory");
        // SAFETY: p came from malloc.
        unsafe { libc::free(p as *mut libc::c_void) };
        let mut out = Vec::new();
        Q.drain(&mut out).unwrap();
        assert!(out.iter().any(|r| r.start <= p && r.end >= p + 4096), "no unmap event covering {p:#x}: {out:x?}");
    }
}
