//! The registration cache (MRRC): `ibv_reg_mr`/`ibv_dereg_mr` pairs on the
//! same buffers stop paying the kernel pin and the NIC update.
//!
//! Regions are keyed by (real PD, access flags, range). A request reuses a
//! cached region of the same PD and access flags exactly, or, for
//! local-only access, any region that covers it. A region with any
//! `REMOTE_*` (or `MW_BIND`) access is reused only on an exact match: a
//! larger region would widen what a peer may touch through the rkey.
//! Overlapping requests that are not covered get their own registration
//! (no merging), so a region never changes once created.
//!
//! Regions are reference counted; the last release makes a region idle (not
//! deregistered). The byte and entry limits bound the *idle* regions only:
//! what the application holds is its own business and never makes the cache
//! evict a region the moment it goes idle. Idle regions are evicted by the
//! MRE policy when they pass a limit, one eviction segment per batch. When
//! a real registration fails for lack of pinnable memory (ENOMEM/EAGAIN),
//! every idle region is deregistered and the registration retried once, so
//! the cache never makes a registration fail that would succeed without it. A region
//! whose memory is unmapped or replaced (monitor.rs) is dropped at the next
//! cache operation and never handed out again; if the application still
//! holds it, it is deregistered on release.
//!
//! Lock: `inner` protects every region and the policy. Memory hooks never
//! take it (they only queue ranges), so deregistering under it is safe.

use super::monitor::{Queue, Range};
use super::policy::{EntryId, Mre, MreConfig, Policy};
use super::reaper::Reaper;
use crate::error::{Errno, Result};
use crate::stats::{self, Stat};
use crate::sys::{ibv_access_flags, ibv_mr, ibv_pd};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

/// Registration primitives (real libibverbs, or a test double), plus
/// whether a range can be watched for unmaps.
pub trait Backend: Send + Sync {
    fn reg(&self, pd: *mut ibv_pd, addr: usize, len: usize, access: u32) -> Result<*mut ibv_mr>;
    fn dereg(&self, mr: *mut ibv_mr) -> Result<()>;
    /// Start watching `[start, end)`; false if the monitor cannot.
    fn watch(&self, start: usize, end: usize) -> bool;
}

/// How the cache behaves in this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// `KRCORE_MR_CACHE=0`: every registration is real.
    Off = 0,
    /// Idle regions are kept (a sound unmap monitor is running).
    Caching = 1,
    /// No sound monitor (or libibverbs fork protection is on): no reuse;
    /// each registration is real and deregistered when the application
    /// deregisters. Sharing even a held region would be unsound: glibc can
    /// unmap and reuse its memory unseen.
    HoldOnly = 2,
    /// A forked child: the parent's regions are never used or touched.
    ForkedChild = 3,
}

#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_bytes: usize,
    pub max_entries: usize,
}

struct Region {
    /// The real context, for `flush_context`.
    ctx: usize,
    pd: usize,
    access: u32,
    start: usize,
    end: usize,
    real: *mut ibv_mr,
    refs: u32,
    /// Kept when idle: watched by the monitor and never invalidated.
    keep_idle: bool,
    /// Still findable by lookups.
    valid: bool,
    /// Counted in the idle bytes and entries the limits bound.
    idle: bool,
    /// Its context was closed: the kernel already freed the MR, so it is
    /// forgotten at release instead of deregistered.
    orphan: bool,
}

// SAFETY: `real` is an MR handle of libibverbs, usable from any thread; it
// is only touched under the cache lock.
unsafe impl Send for Region {}

struct Inner {
    regions: FxHashMap<EntryId, Region>,
    /// Valid local-access regions by (pd, access, start, id) -> end, for
    /// covering lookups (remote-access regions match exactly or not at all).
    index: BTreeMap<(usize, u32, usize, EntryId), usize>,
    /// Valid regions by exact (pd, access, start, end): the common case of a
    /// buffer registered again is one hash lookup.
    exact: FxHashMap<(usize, u32, usize, usize), EntryId>,
    /// Every live region by (start, id) -> end, for invalidation.
    by_start: BTreeMap<(usize, EntryId), usize>,
    longest: usize,
    policy: Mre,
    next_id: EntryId,
    /// Bytes of every live region (held and idle).
    bytes: usize,
    /// Bytes and number of idle regions: what the limits bound.
    idle_bytes: usize,
    idle_count: usize,
    watched: Watched,
    scratch: Vec<Range>,
}

/// Ranges known to be watched by the monitor (a miss then skips the
/// registration system call). Forgetting too much only costs a call.
#[derive(Default)]
struct Watched {
    /// start -> end; ranges may overlap.
    ranges: BTreeMap<usize, usize>,
    longest: usize,
}

impl Watched {
    /// Bounds the set: past it, everything is forgotten.
    const MAX: usize = 4096;

    fn covers(&self, start: usize, end: usize) -> bool {
        self.ranges.range(start.saturating_sub(self.longest)..=start).rev().take(64).any(|(_, &e)| e >= end)
    }

    fn insert(&mut self, start: usize, end: usize) {
        if self.ranges.len() >= Self::MAX {
            self.forget(None);
        }
        let e = self.ranges.entry(start).or_insert(end);
        *e = (*e).max(end);
        self.longest = self.longest.max(end - start);
    }

    /// Forget what overlaps `unmapped` (everything for `None`).
    fn forget(&mut self, unmapped: Option<&[Range]>) {
        let Some(unmapped) = unmapped else {
            self.ranges.clear();
            self.longest = 0;
            return;
        };
        for r in unmapped {
            let from = r.start.saturating_sub(self.longest);
            let gone: Vec<usize> = self.ranges.range(from..r.end).filter(|(_, &e)| e > r.start).map(|(&s, _)| s).collect();
            for s in gone {
                self.ranges.remove(&s);
            }
        }
    }
}

impl Inner {
    /// A region stops being findable (invalidated, orphaned or dropped).
    fn unindex(&mut self, id: EntryId) {
        let Some(r) = self.regions.get_mut(&id) else { return };
        if !r.valid {
            return;
        }
        r.valid = false;
        let (pd, access, start, end) = (r.pd, r.access, r.start, r.end);
        if !is_remote(access) {
            self.index.remove(&(pd, access, start, id));
        }
        if self.exact.get(&(pd, access, start, end)) == Some(&id) {
            self.exact.remove(&(pd, access, start, end));
        }
    }

    /// Take a region out of every index and the accounting; its real MR is
    /// the caller's to deregister (or keep).
    fn forget(&mut self, id: EntryId, from_policy: bool) -> Option<Region> {
        self.unindex(id);
        self.set_idle(id, false);
        let r = self.regions.remove(&id)?;
        self.by_start.remove(&(r.start, id));
        if from_policy {
            self.policy.remove(id);
        }
        self.bytes -= r.end - r.start;
        stats::set(Stat::KRCORE_STAT_MR_CACHE_PINNED_BYTES, self.bytes as u64);
        Some(r)
    }

    /// Count a region as idle (`true`) or not; idempotent.
    fn set_idle(&mut self, id: EntryId, idle: bool) {
        let Some(r) = self.regions.get_mut(&id) else { return };
        if r.idle == idle {
            return;
        }
        r.idle = idle;
        let len = r.end - r.start;
        if idle {
            self.idle_bytes += len;
            self.idle_count += 1;
        } else {
            self.idle_bytes -= len;
            self.idle_count -= 1;
        }
        stats::set(Stat::KRCORE_STAT_MR_CACHE_IDLE_BYTES, self.idle_bytes as u64);
    }
}

pub struct Cache {
    inner: Mutex<Inner>,
    backend: Arc<dyn Backend>,
    /// Deregisters evicted regions (see reaper.rs).
    reaper: Reaper,
    queue: &'static Queue,
    limits: Limits,
    /// A `Mode` as u8; read on every operation, so no lock.
    mode: AtomicU8,
}

/// Access flags for which only exact matches may be reused.
pub fn is_remote(access: u32) -> bool {
    let remote = ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
        | ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
        | ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0
        | ibv_access_flags::IBV_ACCESS_MW_BIND.0;
    access & remote != 0
}

fn pages(len: usize) -> u64 {
    len.div_ceil(4096).max(1) as u64
}

/// What `acquire` hands back.
pub struct Lease {
    pub id: EntryId,
    pub real: *mut ibv_mr,
    pub hit: bool,
}

impl Cache {
    /// A cache that deregisters evicted regions on the caller's thread;
    /// see [`Cache::with_dereg_thread`].
    pub fn new(backend: Box<dyn Backend>, queue: &'static Queue, limits: Limits, mode: Mode) -> Cache {
        let backend: Arc<dyn Backend> = Arc::from(backend);
        let reaper = Reaper::new(Arc::clone(&backend), 0, 0);
        queue.set_watching(matches!(mode, Mode::Caching | Mode::HoldOnly));
        Cache {
            inner: Mutex::new(Inner {
                regions: FxHashMap::default(),
                index: BTreeMap::new(),
                exact: FxHashMap::default(),
                by_start: BTreeMap::new(),
                longest: 0,
                policy: Mre::new(MreConfig::default()),
                next_id: 1,
                bytes: 0,
                idle_bytes: 0,
                idle_count: 0,
                watched: Watched::default(),
                scratch: Vec::with_capacity(64),
            }),
            backend,
            reaper,
            queue,
            limits,
            mode: AtomicU8::new(mode as u8),
        }
    }

    /// Evicted regions are deregistered by a background thread, woken at
    /// `batch` queued regions or an eighth of the byte limit (see reaper.rs).
    pub fn with_dereg_thread(mut self, batch: usize) -> Cache {
        self.reaper = Reaper::new(Arc::clone(&self.backend), batch, self.limits.max_bytes / 8);
        self
    }

    /// Stop the deregistration thread (process exit).
    pub fn stop_dereg_thread(&self) {
        self.reaper.stop(std::time::Duration::from_secs(1));
    }

    pub fn mode(&self) -> Mode {
        match self.mode.load(Ordering::SeqCst) {
            0 => Mode::Off,
            1 => Mode::Caching,
            2 => Mode::HoldOnly,
            _ => Mode::ForkedChild,
        }
    }

    /// Switch modes (fork protection turned on; see `mr::check_fork_protection`).
    pub fn set_mode(&self, mode: Mode) {
        self.mode.store(mode as u8, Ordering::SeqCst);
        self.queue.set_watching(matches!(mode, Mode::Caching | Mode::HoldOnly));
        stats::set(Stat::KRCORE_STAT_MR_CACHE_MODE, mode as u64);
    }

    /// A registration of `[addr, addr+len)` on `pd` with `access`: a cached
    /// region when one fits, else a new real registration.
    pub fn acquire(&self, ctx: usize, pd: *mut ibv_pd, addr: usize, len: usize, access: u32) -> Result<Lease> {
        let mode = self.mode();
        let mut g = self.inner.lock();
        self.apply_invalidations(&mut g);
        let end = addr.checked_add(len).ok_or(Errno::EINVAL)?;
        let found = if mode == Mode::Caching { Self::lookup(&g, pd as usize, access, addr, end) } else { None };
        if let Some(id) = found {
            let r = g.regions.get_mut(&id).expect("indexed regions exist");
            r.refs += 1;
            let real = r.real;
            g.set_idle(id, false);
            g.policy.touch(id);
            stats::add_locked(Stat::KRCORE_STAT_MR_CACHE_HITS, 1);
            return Ok(Lease { id, real, hit: true });
        }
        stats::add_locked(Stat::KRCORE_STAT_MR_CACHE_MISSES, 1);
        // Watch before registering: an unmap racing with the registration
        // is then queued and drops the region at the next operation.
        self.queue.cover(addr, end);
        let keep_idle = mode == Mode::Caching && self.watch(&mut g, addr, end);
        if mode == Mode::Caching && !keep_idle {
            stats::add_locked(Stat::KRCORE_STAT_MR_CACHE_UNCACHEABLE, 1);
        }
        let real = match self.backend.reg(pd, addr, len, access) {
            Ok(r) => r,
            // Out of pinnable memory: give back everything idle, try once more.
            Err(e) if (e.errno() == libc::ENOMEM || e.errno() == libc::EAGAIN) && (g.idle_count > 0 || self.reaper.pending()) => {
                stats::add_locked(Stat::KRCORE_STAT_MR_CACHE_LIMIT_RETRIES, 1);
                self.drop_idle(&mut g);
                self.backend.reg(pd, addr, len, access)?
            }
            Err(e) => return Err(e),
        };
        let id = g.next_id;
        g.next_id += 1;
        let region =
            Region { ctx, pd: pd as usize, access, start: addr, end, real, refs: 1, keep_idle, valid: true, idle: false, orphan: false };
        if !is_remote(access) {
            g.index.insert((region.pd, access, addr, id), end);
        }
        g.exact.entry((region.pd, access, addr, end)).or_insert(id);
        g.by_start.insert((addr, id), end);
        g.longest = g.longest.max(len);
        g.regions.insert(id, region);
        g.bytes += len;
        g.policy.insert(id, pages(len));
        stats::set(Stat::KRCORE_STAT_MR_CACHE_PINNED_BYTES, g.bytes as u64);
        Ok(Lease { id, real, hit: false })
    }

    /// The application deregistered its MR: one reference less.
    pub fn release(&self, id: EntryId) -> Result<()> {
        let mut g = self.inner.lock();
        self.apply_invalidations(&mut g);
        let r = g.regions.get_mut(&id).ok_or(Errno::EINVAL)?;
        r.refs = r.refs.checked_sub(1).ok_or(Errno::EINVAL)?;
        if r.refs > 0 {
            return Ok(());
        }
        if !r.valid || !r.keep_idle || self.mode() != Mode::Caching {
            return self.drop_region(&mut g, id, true);
        }
        g.set_idle(id, true);
        self.enforce_limits(&mut g);
        Ok(())
    }

    /// Take a region out of the cache for good, if `id` is held by one MR
    /// only and spans exactly `[start, end)`: its real MR then belongs to
    /// the caller (for `ibv_rereg_mr`, which must not touch a shared region).
    pub fn detach(&self, id: EntryId, start: usize, end: usize) -> Option<*mut ibv_mr> {
        let mut g = self.inner.lock();
        self.apply_invalidations(&mut g);
        let r = g.regions.get(&id)?;
        if r.refs != 1 || r.orphan || (r.start, r.end) != (start, end) {
            return None;
        }
        g.forget(id, true).map(|r| r.real)
    }

    /// Deregister every idle region of `pd` (before `ibv_dealloc_pd`, which
    /// would otherwise fail with EBUSY because of our idle MRs).
    pub fn flush_pd(&self, pd: *mut ibv_pd) {
        let mut g = self.inner.lock();
        self.apply_invalidations(&mut g);
        let idle: Vec<EntryId> = g.regions.iter().filter(|(_, r)| r.pd == pd as usize && r.refs == 0).map(|(id, _)| *id).collect();
        self.drop_batch(&mut g, &idle, true);
        self.reaper.drain();
    }

    /// Before `ibv_close_device`: deregister the context's idle regions and
    /// orphan the held ones (closing the context frees them in the kernel;
    /// a later deregistration would hit whatever reuses their handles).
    pub fn flush_context(&self, ctx: usize) {
        let mut g = self.inner.lock();
        self.apply_invalidations(&mut g);
        let mine: Vec<EntryId> = g.regions.iter().filter(|(_, r)| r.ctx == ctx).map(|(id, _)| *id).collect();
        for id in mine {
            let r = g.regions.get_mut(&id).expect("live");
            if r.refs == 0 {
                let _ = self.drop_region(&mut g, id, true);
            } else {
                r.orphan = true;
                g.unindex(id);
                g.policy.remove(id);
            }
        }
        self.reaper.drain();
    }

    /// Deregister every idle region (no region is kept idle afterwards
    /// unless the mode still allows it).
    pub fn flush_idle(&self) {
        let mut g = self.inner.lock();
        self.apply_invalidations(&mut g);
        self.drop_idle(&mut g);
    }

    fn drop_idle(&self, g: &mut Inner) {
        let idle: Vec<EntryId> = g.regions.iter().filter(|(_, r)| r.refs == 0).map(|(id, _)| *id).collect();
        self.drop_batch(g, &idle, true);
        self.reaper.drain();
    }

    /// (regions, idle regions, bytes), checking the idle accounting.
    #[cfg(test)]
    fn usage(&self) -> (usize, usize, usize) {
        let g = self.inner.lock();
        let idle: Vec<&Region> = g.regions.values().filter(|r| r.refs == 0).collect();
        assert_eq!(idle.len(), g.idle_count, "idle count");
        assert_eq!(idle.iter().map(|r| r.end - r.start).sum::<usize>(), g.idle_bytes, "idle bytes");
        (g.regions.len(), idle.len(), g.bytes)
    }

    #[cfg(test)]
    fn idle_usage(&self) -> (usize, usize) {
        let g = self.inner.lock();
        (g.idle_count, g.idle_bytes)
    }

    fn lookup(g: &Inner, pd: usize, access: u32, addr: usize, end: usize) -> Option<EntryId> {
        if let Some(&id) = g.exact.get(&(pd, access, addr, end)) {
            return Some(id);
        }
        if is_remote(access) {
            return None;
        }
        // Covering regions start at or below addr; the nearest starts are
        // the likeliest to cover, and a bounded scan keeps lookups cheap.
        g.index.range((pd, access, 0, 0)..=(pd, access, addr, EntryId::MAX)).rev().take(64).find(|(_, &e)| e >= end).map(|(k, _)| k.3)
    }

    /// Watch `[addr, end)` unless a watched range already covers it: a
    /// userfaultfd registration lasts until its memory is unmapped or
    /// moved, and every such event reaches the queue (which is what the
    /// cache's soundness rests on), which forgets the range again.
    fn watch(&self, g: &mut Inner, addr: usize, end: usize) -> bool {
        if g.watched.covers(addr, end) {
            return true;
        }
        let ok = self.backend.watch(addr, end);
        if ok {
            g.watched.insert(addr, end);
        }
        ok
    }

    /// Drop every region that overlaps a queued unmapped range.
    fn apply_invalidations(&self, g: &mut Inner) {
        let mut ranges = std::mem::take(&mut g.scratch);
        ranges.clear();
        let all = self.queue.drain(&mut ranges).is_none();
        let mut hit: Vec<EntryId> = Vec::new();
        g.watched.forget(if all { None } else { Some(&ranges) });
        if all {
            hit.extend(g.regions.iter().filter(|(_, r)| r.valid).map(|(id, _)| *id));
        } else {
            for r in &ranges {
                let from = r.start.saturating_sub(g.longest);
                for (&(start, id), &end) in g.by_start.range((from, 0)..(r.end, 0)) {
                    if start < r.end && end > r.start && g.regions[&id].valid {
                        hit.push(id);
                    }
                }
            }
        }
        g.scratch = ranges;
        hit.sort_unstable();
        hit.dedup();
        for id in hit {
            stats::add_locked(Stat::KRCORE_STAT_MR_CACHE_INVALIDATIONS, 1);
            let idle = g.regions[&id].refs == 0;
            g.unindex(id);
            g.policy.remove(id);
            if idle {
                // Nothing refers to it: deregister now (we are not in a hook).
                let _ = self.drop_region(g, id, false);
            }
        }
    }

    /// Idle regions past a limit: evict a batch.
    fn enforce_limits(&self, g: &mut Inner) {
        if g.idle_bytes <= self.limits.max_bytes && g.idle_count <= self.limits.max_entries {
            return;
        }
        let over_bytes = g.idle_bytes.saturating_sub(self.limits.max_bytes);
        let over_entries = g.idle_count.saturating_sub(self.limits.max_entries);
        self.evict(g, over_bytes, over_entries);
    }

    /// Evict idle regions chosen by the policy (one batch).
    fn evict(&self, g: &mut Inner, bytes: usize, entries: usize) {
        let Inner { policy, regions, .. } = &mut *g;
        let victims = policy.evict(pages(bytes.min(usize::MAX / 2)), entries, &mut |id| regions.get(&id).is_some_and(|r| r.refs == 0));
        if victims.is_empty() {
            return;
        }
        stats::add_locked(Stat::KRCORE_STAT_MR_CACHE_DEREG_BATCHES, 1);
        stats::add_locked(Stat::KRCORE_STAT_MR_CACHE_EVICTIONS, victims.len() as u64);
        // The policy already forgot them; nothing can find them once
        // forgotten, so their deregistration may happen later.
        let reals: Vec<(*mut ibv_mr, usize)> =
            victims.iter().filter_map(|&id| g.forget(id, false)).filter(|r| !r.orphan).map(|r| (r.real, r.end - r.start)).collect();
        self.reaper.defer(reals);
    }

    fn drop_batch(&self, g: &mut Inner, ids: &[EntryId], from_policy: bool) {
        for &id in ids {
            if let Err(e) = self.drop_region(g, id, from_policy) {
                crate::klog!(crate::log::Level::Warn, "deregistering a cached MR failed: {e:?}");
            }
        }
    }

    /// Forget a region and deregister its real MR.
    fn drop_region(&self, g: &mut Inner, id: EntryId, from_policy: bool) -> Result<()> {
        let r = g.forget(id, from_policy).ok_or(Errno::EINVAL)?;
        if r.orphan {
            return Ok(());
        }
        self.backend.dereg(r.real)
    }
}

#[cfg(test)]
#[allow(clippy::undocumented_unsafe_blocks)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    const LOCAL: u32 = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
    const REMOTE: u32 = LOCAL | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
    const PAGE: usize = 4096;

    /// Registers fake MRs (lkey = serial) and records what is live.
    #[derive(Default)]
    struct Fake {
        next: AtomicU32,
        /// lkey -> (pd, start, end, access) of live fake MRs.
        live: parking_lot::Mutex<HashMap<u32, (usize, usize, usize, u32)>>,
        deregs: AtomicU32,
        watches: AtomicU32,
        watchable: bool,
        /// Most bytes that may be registered at once (the pinned-memory
        /// limit); 0: unlimited.
        pin_limit: usize,
        /// The deregistration thread waits while this is set (a thread the
        /// scheduler left behind).
        stall_thread: std::sync::atomic::AtomicBool,
    }

    struct Shared(Arc<Fake>);

    impl Backend for Shared {
        fn reg(&self, pd: *mut ibv_pd, addr: usize, len: usize, access: u32) -> Result<*mut ibv_mr> {
            let pinned: usize = self.0.live.lock().values().map(|(_, s, e, _)| e - s).sum();
            if self.0.pin_limit != 0 && pinned + len > self.0.pin_limit {
                return Err(Errno(libc::ENOMEM));
            }
            let lkey = self.0.next.fetch_add(1, Ordering::Relaxed) + 1;
            self.0.live.lock().insert(lkey, (pd as usize, addr, addr + len, access));
            let mut mr: ibv_mr = unsafe { std::mem::zeroed() };
            mr.lkey = lkey;
            mr.addr = addr as *mut libc::c_void;
            mr.length = len;
            Ok(Box::into_raw(Box::new(mr)))
        }
        fn dereg(&self, mr: *mut ibv_mr) -> Result<()> {
            while self.0.stall_thread.load(Ordering::SeqCst) && std::thread::current().name() == Some("krcore-dereg") {
                std::thread::yield_now();
            }
            let mr = unsafe { Box::from_raw(mr) };
            assert!(self.0.live.lock().remove(&mr.lkey).is_some(), "double deregistration of {}", mr.lkey);
            self.0.deregs.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        fn watch(&self, _: usize, _: usize) -> bool {
            self.0.watches.fetch_add(1, Ordering::Relaxed);
            self.0.watchable
        }
    }

    fn cache(max_bytes: usize, max_entries: usize, mode: Mode) -> (Cache, Arc<Fake>, &'static Queue) {
        let fake = Arc::new(Fake { watchable: true, ..Default::default() });
        let q: &'static Queue = Box::leak(Box::new(Queue::new()));
        let c = Cache::new(Box::new(Shared(fake.clone())), q, Limits { max_bytes, max_entries }, mode);
        (c, fake, q)
    }

    fn pd(n: usize) -> *mut ibv_pd {
        (n * 0x1000) as *mut ibv_pd
    }

    fn lkey(l: &Lease) -> u32 {
        unsafe { (*l.real).lkey }
    }

    #[test]
    fn local_subrange_hits_remote_needs_exact_match() {
        let (c, _, _) = cache(1 << 30, 100, Mode::Caching);
        let a = c.acquire(1, pd(1), 0x10000, 8 * PAGE, LOCAL).unwrap();
        assert!(!a.hit);
        let b = c.acquire(1, pd(1), 0x10000 + PAGE, 2 * PAGE, LOCAL).unwrap();
        assert!(b.hit && b.id == a.id, "covered local request reuses the region");
        assert!(!c.acquire(1, pd(2), 0x10000, PAGE, LOCAL).unwrap().hit, "other PD");
        assert!(!c.acquire(1, pd(1), 0x10000, PAGE, LOCAL | 0x8).unwrap().hit, "other access flags");
        let r = c.acquire(1, pd(1), 0x40000, 8 * PAGE, REMOTE).unwrap();
        assert!(!c.acquire(1, pd(1), 0x40000, 4 * PAGE, REMOTE).unwrap().hit, "remote: no sub-range reuse");
        let r2 = c.acquire(1, pd(1), 0x40000, 8 * PAGE, REMOTE).unwrap();
        assert!(r2.hit && r2.id == r.id, "remote: exact match reused");
    }

    #[test]
    fn overlapping_requests_register_separately_in_either_order() {
        for first_low in [true, false] {
            let (c, fake, _) = cache(1 << 30, 100, Mode::Caching);
            let (lo, hi) = ((0x10000, 4 * PAGE), (0x12000, 4 * PAGE));
            let (x, y) = if first_low { (lo, hi) } else { (hi, lo) };
            let a = c.acquire(1, pd(1), x.0, x.1, LOCAL).unwrap();
            let b = c.acquire(1, pd(1), y.0, y.1, LOCAL).unwrap();
            assert!(!b.hit && a.id != b.id);
            assert_eq!(fake.live.lock().len(), 2);
            // Each later request is served by a region that covers it.
            let l = c.acquire(1, pd(1), lo.0, lo.1, LOCAL).unwrap();
            let h = c.acquire(1, pd(1), hi.0, hi.1, LOCAL).unwrap();
            let live = fake.live.lock();
            let (_, s, e, _) = live[&lkey(&l)];
            assert!(s <= lo.0 && e >= lo.0 + lo.1);
            let (_, s, e, _) = live[&lkey(&h)];
            assert!(s <= hi.0 && e >= hi.0 + hi.1);
        }
    }

    #[test]
    fn release_keeps_idle_and_unmap_invalidates() {
        let (c, fake, q) = cache(1 << 30, 100, Mode::Caching);
        let a = c.acquire(1, pd(1), 0x10000, 4 * PAGE, LOCAL).unwrap();
        c.release(a.id).unwrap();
        assert_eq!(c.usage(), (1, 1, 4 * PAGE), "idle, still registered");
        let b = c.acquire(1, pd(1), 0x10000, 4 * PAGE, LOCAL).unwrap();
        assert!(b.hit);
        c.release(b.id).unwrap();
        q.push(0x11000, 0x12000); // one page in the middle goes away
        let d = c.acquire(1, pd(1), 0x10000, 4 * PAGE, LOCAL).unwrap();
        assert!(!d.hit, "an unmapped region is never handed out again");
        assert_eq!(fake.deregs.load(Ordering::Relaxed), 1, "the idle stale region was deregistered");
        // Held while invalidated: kept until released, then deregistered.
        q.push(0x10000, 0x10001);
        let e = c.acquire(1, pd(1), 0x10000, PAGE, LOCAL).unwrap();
        assert!(!e.hit);
        assert_eq!(fake.live.lock().len(), 2);
        c.release(d.id).unwrap();
        assert_eq!(fake.live.lock().len(), 1);
    }

    #[test]
    fn entry_limit_evicts_idle_regions_only() {
        let (c, fake, _) = cache(1 << 30, 4, Mode::Caching);
        let held: Vec<Lease> = (0..3).map(|i| c.acquire(1, pd(1), 0x100000 * (i + 1), PAGE, LOCAL).unwrap()).collect();
        for i in 0..10 {
            let l = c.acquire(1, pd(1), 0x10000000 + i * 0x10000, PAGE, LOCAL).unwrap();
            c.release(l.id).unwrap();
        }
        let (n, idle, _) = c.usage();
        assert!(idle <= 4, "{idle} idle regions (the limit bounds idle regions only)");
        assert_eq!(n - idle, 3, "held regions survive eviction");
        for l in &held {
            assert!(fake.live.lock().contains_key(&lkey(l)));
        }
    }

    /// The budget bounds idle regions only: a held registration larger than
    /// the whole budget does not make every other region go at release.
    #[test]
    fn held_registrations_do_not_count_against_the_budget() {
        let (c, fake, _) = cache(4 * PAGE, 100, Mode::Caching);
        let big = c.acquire(1, pd(1), 0x100000, 64 * PAGE, REMOTE).unwrap();
        let first = c.acquire(1, pd(1), 0x10000, 2 * PAGE, REMOTE).unwrap();
        c.release(first.id).unwrap();
        for _ in 0..10 {
            let l = c.acquire(1, pd(1), 0x10000, 2 * PAGE, REMOTE).unwrap();
            assert!(l.hit && l.id == first.id);
            c.release(l.id).unwrap();
        }
        assert_eq!(fake.deregs.load(Ordering::Relaxed), 0);
        assert_eq!(c.usage(), (2, 1, 66 * PAGE));
        // Idle regions past the budget are evicted; held ones never are.
        for i in 0..4 {
            let l = c.acquire(1, pd(1), 0x200000 + i * 0x10000, 2 * PAGE, LOCAL).unwrap();
            c.release(l.id).unwrap();
            let (n, bytes) = c.idle_usage();
            assert!(bytes <= 4 * PAGE && n >= 1, "idle {n} regions, {bytes} bytes");
        }
        assert!(fake.live.lock().contains_key(&lkey(&big)));
        c.release(big.id).unwrap();
        assert!(c.idle_usage().1 <= 4 * PAGE, "a released large region is evicted to fit the budget");
    }

    /// At the pinned-memory limit the idle regions are given back and the
    /// registration retried once: the cache never makes a registration
    /// fail that would succeed without it. What still does not fit fails
    /// with the provider's errno.
    #[test]
    fn pinned_limit_drops_idle_regions_and_retries() {
        let fake = Arc::new(Fake { watchable: true, pin_limit: 16 * PAGE, ..Default::default() });
        let q: &'static Queue = Box::leak(Box::new(Queue::new()));
        let c = Cache::new(Box::new(Shared(fake.clone())), q, Limits { max_bytes: 1 << 30, max_entries: 100 }, Mode::Caching);
        let held = c.acquire(1, pd(1), 0x100000, 4 * PAGE, LOCAL).unwrap();
        for i in 0..3 {
            let l = c.acquire(1, pd(1), 0x200000 + i * 0x10000, 4 * PAGE, LOCAL).unwrap();
            c.release(l.id).unwrap();
        }
        assert_eq!(c.usage(), (4, 3, 16 * PAGE), "at the limit, three idle regions");
        let l = c.acquire(1, pd(1), 0x300000, 8 * PAGE, LOCAL).expect("idle regions make room");
        assert!(!l.hit);
        assert_eq!(c.usage(), (2, 0, 12 * PAGE));
        assert!(fake.live.lock().contains_key(&lkey(&held)), "held regions are never dropped");
        let e = c.acquire(1, pd(1), 0x400000, 8 * PAGE, LOCAL).err().expect("does not fit even without the cache");
        assert_eq!(e.errno(), libc::ENOMEM);
        c.release(l.id).unwrap();
        c.release(held.id).unwrap();
    }

    /// `ibv_rereg_mr` takes a region out only when nothing else shares it.
    #[test]
    fn detach_only_an_exclusive_exact_region() {
        let (c, fake, _) = cache(1 << 30, 100, Mode::Caching);
        let a = c.acquire(1, pd(1), 0x10000, 4 * PAGE, LOCAL).unwrap();
        let sub = c.acquire(1, pd(1), 0x11000, PAGE, LOCAL).unwrap();
        assert!(sub.hit);
        assert!(c.detach(a.id, 0x10000, 0x14000).is_none(), "shared with a sub-range MR");
        c.release(sub.id).unwrap();
        assert!(c.detach(a.id, 0x11000, 0x12000).is_none(), "not the region's exact range");
        let real = c.detach(a.id, 0x10000, 0x14000).expect("sole holder, exact range");
        assert_eq!(real, a.real);
        assert_eq!(c.usage(), (0, 0, 0), "the cache forgot it");
        assert!(!c.acquire(1, pd(1), 0x10000, 4 * PAGE, LOCAL).unwrap().hit);
        assert!(c.release(a.id).is_err(), "the lease is gone");
        assert!(fake.live.lock().contains_key(&lkey(&a)), "not deregistered: the caller owns it");
    }

    /// A miss on memory already watched makes no watch call; an unmap of
    /// any part of it (or a queue overflow) makes the next one watch again.
    #[test]
    fn watched_memory_is_not_watched_again_until_unmapped() {
        let (c, fake, q) = cache(1 << 30, 1, Mode::Caching);
        let miss = |addr| {
            let l = c.acquire(1, pd(1), addr, 2 * PAGE, REMOTE).unwrap();
            assert!(!l.hit);
            c.release(l.id).unwrap();
        };
        let watches = || fake.watches.load(Ordering::Relaxed);
        for round in 0..3 {
            miss(0x10000);
            miss(0x20000); // evicts 0x10000 (one idle entry)
            assert_eq!(watches(), 2, "round {round}: each range watched once");
        }
        q.push(0x11000, 0x12000);
        miss(0x10000);
        assert_eq!(watches(), 3, "unmapped: watched again");
        miss(0x20000);
        assert_eq!(watches(), 3);
        for _ in 0..=512 {
            q.push(0x14000, 0x15000); // between the two ranges; overflows the queue
        }
        miss(0x10000);
        miss(0x20000);
        assert_eq!(watches(), 5, "after an overflow nothing is known to be watched");
    }

    #[test]
    fn hold_only_mode_never_reuses() {
        let (c, fake, _) = cache(1 << 30, 100, Mode::HoldOnly);
        let a = c.acquire(1, pd(1), 0x10000, PAGE, LOCAL).unwrap();
        let b = c.acquire(1, pd(1), 0x10000, PAGE, LOCAL).unwrap();
        assert!(!b.hit, "no sharing without a sound monitor");
        assert_eq!(fake.live.lock().len(), 2);
        c.release(a.id).unwrap();
        c.release(b.id).unwrap();
        assert!(fake.live.lock().is_empty());
    }

    #[test]
    fn closing_a_context_flushes_idle_and_orphans_held_regions() {
        let (c, fake, _) = cache(1 << 30, 100, Mode::Caching);
        let idle = c.acquire(7, pd(1), 0x10000, PAGE, LOCAL).unwrap();
        let held = c.acquire(7, pd(1), 0x20000, PAGE, LOCAL).unwrap();
        let other = c.acquire(8, pd(2), 0x10000, PAGE, LOCAL).unwrap();
        c.release(idle.id).unwrap();
        c.flush_context(7);
        assert!(!fake.live.lock().contains_key(&lkey(&idle)), "idle region deregistered before the close");
        assert!(!c.acquire(7, pd(1), 0x20000, PAGE, LOCAL).unwrap().hit, "an orphan is never handed out");
        c.release(held.id).unwrap();
        assert!(fake.live.lock().contains_key(&lkey(&held)), "an orphan is forgotten, not deregistered");
        assert!(fake.live.lock().contains_key(&lkey(&other)));
    }

    #[test]
    fn unwatchable_memory_is_kept_only_while_held() {
        let fake = Arc::new(Fake { watchable: false, ..Default::default() });
        let q: &'static Queue = Box::leak(Box::new(Queue::new()));
        let c = Cache::new(Box::new(Shared(fake.clone())), q, Limits { max_bytes: 1 << 30, max_entries: 10 }, Mode::Caching);
        let a = c.acquire(1, pd(1), 0x10000, PAGE, LOCAL).unwrap();
        c.release(a.id).unwrap();
        assert!(fake.live.lock().is_empty());
    }

    #[test]
    fn flush_pd_deregisters_that_pds_idle_regions() {
        let (c, fake, _) = cache(1 << 30, 100, Mode::Caching);
        let a = c.acquire(1, pd(1), 0x10000, PAGE, LOCAL).unwrap();
        let b = c.acquire(1, pd(2), 0x10000, PAGE, LOCAL).unwrap();
        let h = c.acquire(1, pd(1), 0x20000, PAGE, LOCAL).unwrap();
        c.release(a.id).unwrap();
        c.release(b.id).unwrap();
        c.flush_pd(pd(1));
        let live = fake.live.lock();
        assert!(!live.contains_key(&lkey(&a)));
        assert!(live.contains_key(&lkey(&b)) && live.contains_key(&lkey(&h)));
    }

    /// Thousands of random register/deregister/unmap sequences against a
    /// reference model: every lease covers its request with the right PD
    /// and access, never spans memory unmapped after it was registered,
    /// and every real MR is deregistered exactly once.
    #[test]
    fn randomized_against_reference_model() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        const PAGES: usize = 64;
        const BASE: usize = 0x7000_0000;
        for round in 0..40 {
            let (max_bytes, max_entries) = (24 * PAGE, 12);
            let (c, fake, q) = cache(max_bytes, max_entries, Mode::Caching);
            // Per page: how many times it was unmapped.
            let mut gen = [0u32; PAGES];
            // lkey -> generation snapshot of its pages when registered.
            let mut snap: HashMap<u32, Vec<u32>> = HashMap::new();
            let mut held: Vec<(Lease, usize, usize, usize, u32)> = Vec::new();
            for _ in 0..400 {
                match rnd(10) {
                    0..=4 => {
                        let p = rnd(PAGES as u64 - 1) as usize;
                        let n = 1 + rnd((PAGES - p).min(8) as u64) as usize;
                        let (addr, len) = (BASE + p * PAGE, n * PAGE);
                        let access = if rnd(2) == 0 { LOCAL } else { REMOTE };
                        let pdn = 1 + rnd(2) as usize;
                        let l = c.acquire(1, pd(pdn), addr, len, access).unwrap();
                        let k = lkey(&l);
                        let (rpd, s, e, acc) = fake.live.lock()[&k];
                        assert_eq!((rpd, acc), (pd(pdn) as usize, access), "round {round}");
                        assert!(s <= addr && e >= addr + len, "lease must cover the request");
                        if access == REMOTE {
                            assert_eq!((s, e), (addr, addr + len), "remote access: exact regions only");
                        }
                        let pages = (s - BASE) / PAGE..(e - BASE).div_ceil(PAGE);
                        if l.hit {
                            let old = &snap[&k];
                            assert!(pages.clone().zip(old).all(|(i, g)| gen[i] == *g), "round {round}: stale region {k} handed out");
                        } else {
                            snap.insert(k, pages.map(|i| gen[i]).collect());
                        }
                        held.push((l, pdn, addr, len, access));
                    }
                    5..=7 if !held.is_empty() => {
                        let i = rnd(held.len() as u64) as usize;
                        let (l, ..) = held.swap_remove(i);
                        c.release(l.id).unwrap();
                    }
                    _ => {
                        let p = rnd(PAGES as u64) as usize;
                        let n = 1 + rnd(4) as usize;
                        for g in gen.iter_mut().skip(p).take(n) {
                            *g += 1;
                        }
                        q.push(BASE + p * PAGE, BASE + (p + n).min(PAGES) * PAGE);
                    }
                }
                let (_, _, bytes) = c.usage();
                let (idle_n, idle_bytes) = c.idle_usage();
                assert!(idle_n <= max_entries && idle_bytes <= max_bytes, "round {round}: idle limits");
                let live: usize = fake.live.lock().values().map(|(_, s, e, _)| e - s).sum();
                assert_eq!(bytes, live, "pinned-bytes accounting");
            }
            for (l, ..) in held.drain(..) {
                c.release(l.id).unwrap();
            }
            c.flush_pd(pd(1));
            c.flush_pd(pd(2));
            assert!(fake.live.lock().is_empty(), "round {round}: everything deregistered once");
        }
    }

    /// Waits (bounded) until `cond` holds: the deregistration thread runs
    /// on its own schedule.
    fn eventually(what: &str, cond: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !cond() {
            assert!(std::time::Instant::now() < deadline, "timed out waiting for: {what}");
            std::thread::yield_now();
        }
    }

    /// Caches that keep one idle region and deregister on a thread in
    /// batches of `batch` (or an eighth of `max_bytes`).
    fn threaded(batch: usize, max_bytes: usize) -> (Cache, Arc<Fake>) {
        let (c, fake, _) = cache(max_bytes, 1, Mode::Caching);
        (c.with_dereg_thread(batch), fake)
    }

    /// One miss pair on buffer `i`: evicts the previous buffer's region.
    fn miss_pair(c: &Cache, i: usize, len: usize) {
        let l = c.acquire(1, pd(1), 0x100000 * (i + 1), len, REMOTE).unwrap();
        assert!(!l.hit);
        c.release(l.id).unwrap();
    }

    #[test]
    fn evictions_are_deregistered_by_the_thread_a_batch_at_a_time() {
        let (c, fake) = threaded(4, 1 << 30);
        let deregs = || fake.deregs.load(Ordering::SeqCst);
        let background = || stats::get(Stat::KRCORE_STAT_MR_CACHE_DEREG_BACKGROUND as usize).unwrap();
        let bg0 = background();
        miss_pair(&c, 0, PAGE); // kept idle, nothing evicted
        for i in 1..4 {
            miss_pair(&c, i, PAGE);
        }
        // Three evicted, below the batch: queued, still registered.
        assert_eq!(deregs(), 0);
        assert_eq!(fake.live.lock().len(), 4);
        miss_pair(&c, 4, PAGE);
        eventually("a batch of four deregistered", || deregs() == 4);
        assert_eq!(fake.live.lock().len(), 1, "only the idle region is left");
        assert!(background() >= bg0 + 4);
        // The evicted regions are gone from the cache at once: a pair on
        // one of them misses again.
        miss_pair(&c, 0, PAGE);
    }

    #[test]
    fn a_thread_a_batch_behind_makes_the_caller_deregister() {
        let (c, fake) = threaded(2, 1 << 30);
        fake.stall_thread.store(true, Ordering::SeqCst);
        miss_pair(&c, 0, PAGE); // kept idle
        for i in 1..=8 {
            miss_pair(&c, i, PAGE);
            // One idle, at most a batch in the thread's hands and one queued.
            let live = fake.live.lock().len();
            assert!(live <= 1 + 2 * 2, "{live} regions registered after {i} evictions");
        }
        // Eight evicted, at most four held back by the stalled thread.
        assert!(fake.deregs.load(Ordering::SeqCst) >= 4, "the caller deregistered the excess");
        fake.stall_thread.store(false, Ordering::SeqCst);
        // The queue was full: both batches go, only the idle region stays.
        eventually("the held-back batches deregistered", || !c.reaper.pending());
        assert_eq!(fake.live.lock().len(), 1);
    }

    #[test]
    fn a_byte_threshold_wakes_the_thread_before_the_batch_is_full() {
        // max_bytes / 8 = 2 pages: one evicted 2-page region is enough.
        let (c, fake) = threaded(1000, 16 * PAGE);
        miss_pair(&c, 0, 2 * PAGE);
        miss_pair(&c, 1, 2 * PAGE);
        eventually("the byte threshold woke the thread", || fake.deregs.load(Ordering::SeqCst) == 1);
    }

    #[test]
    fn flushes_and_the_pinned_limit_retry_wait_for_queued_deregistrations() {
        let (c, fake) = threaded(1000, 1 << 30);
        for i in 0..5 {
            miss_pair(&c, i, PAGE);
        }
        assert_eq!(fake.live.lock().len(), 5, "four queued, one idle");
        // ibv_dealloc_pd needs every MR of the PD gone when flush_pd returns.
        c.flush_pd(pd(1));
        assert!(fake.live.lock().is_empty());
        for i in 0..5 {
            miss_pair(&c, i, PAGE);
        }
        c.flush_context(1);
        assert!(fake.live.lock().is_empty());

        // Out of pinnable memory: queued regions count against the limit
        // until deregistered, so the retry must drain them too.
        let fake = Arc::new(Fake { watchable: true, pin_limit: 4 * PAGE, ..Default::default() });
        let q: &'static Queue = Box::leak(Box::new(Queue::new()));
        let limits = Limits { max_bytes: 1 << 30, max_entries: 1 };
        let c = Cache::new(Box::new(Shared(fake.clone())), q, limits, Mode::Caching).with_dereg_thread(1000);
        for i in 0..4 {
            miss_pair(&c, i, PAGE);
        }
        assert_eq!(fake.live.lock().len(), 4, "pinned memory is full");
        miss_pair(&c, 4, PAGE);
        assert!(stats::get(Stat::KRCORE_STAT_MR_CACHE_LIMIT_RETRIES as usize).unwrap() > 0);
        assert_eq!(fake.live.lock().len(), 1);
        // Nothing idle, only queued regions: the retry still happens.
        let fake = Arc::new(Fake { watchable: true, pin_limit: 4 * PAGE, ..Default::default() });
        let limits = Limits { max_bytes: 1 << 30, max_entries: 0 };
        let c = Cache::new(Box::new(Shared(fake.clone())), q, limits, Mode::Caching).with_dereg_thread(1000);
        for i in 0..4 {
            miss_pair(&c, i, PAGE);
        }
        assert_eq!((c.idle_usage().0, fake.live.lock().len()), (0, 4), "all four queued");
        miss_pair(&c, 4, PAGE);
        assert_eq!(fake.live.lock().len(), 1, "the queue was drained for the retry");
    }

    #[test]
    fn dropping_the_cache_deregisters_what_is_queued_and_stops_the_thread() {
        let (c, fake) = threaded(1000, 1 << 30);
        for i in 0..3 {
            miss_pair(&c, i, PAGE);
        }
        assert_eq!(fake.deregs.load(Ordering::SeqCst), 0);
        c.stop_dereg_thread();
        drop(c);
        assert_eq!(fake.deregs.load(Ordering::SeqCst), 2, "the two queued ones");
    }
}
