//! The cost of a registration-cache hit on the host: `Cache::acquire` of a
//! range that an idle cached region serves, then `Cache::release` of it,
//! with a test-double backend (no libibverbs, no kernel: a hit never calls
//! the backend, so this is the whole of what the cache adds to a hit; the
//! interposed `ibv_reg_mr`/`ibv_dereg_mr` add their own `ibv_mr` wrapper on
//! top). With 1, 1,000 and 10,000 idle regions in the cache, so that the
//! cost of the lookup shows; each iteration takes the next region in a
//! scrambled order, so consecutive lookups do not touch the same entries.
//!
//! - `remote/N`: access with REMOTE_READ|REMOTE_WRITE (what bench/reg_mr.c
//!   registers): only a region with exactly the requested range serves it;
//! - `local/N`: LOCAL_WRITE only, a request for a sub-range (the second
//!   page) of a two-page region: served by the covering-region scan.
//!
//! - `mr_miss/remote/evict1`: a miss that evicts one idle region, the
//!   bookkeeping a miss adds to the real registration.
//!
//! `cargo bench --bench mr_hit` (add `-- --quick` for a short run).

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use krcore::error::Result;
use krcore::mr::cache::{Backend, Cache, Limits, Mode};
use krcore::mr::monitor::Queue;
use krcore::sys::{ibv_access_flags, ibv_mr, ibv_pd};
use std::sync::atomic::{AtomicU32, Ordering};

const PAGE: usize = 4096;
const BASE: usize = 0x7000_0000_0000;
const LOCAL: u32 = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
const REMOTE: u32 = LOCAL | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0 | ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;

/// Registers fake MRs (heap `ibv_mr`s with a serial lkey); every range is
/// watchable, so released regions stay idle in the cache.
#[derive(Default)]
struct Fake {
    next: AtomicU32,
}

impl Backend for Fake {
    fn reg(&self, _pd: *mut ibv_pd, addr: usize, len: usize, _access: u32) -> Result<*mut ibv_mr> {
        // SAFETY: ibv_mr is a plain C struct; all zeroes is a valid value.
        let mut mr: ibv_mr = unsafe { std::mem::zeroed() };
        mr.lkey = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        mr.addr = addr as *mut libc::c_void;
        mr.length = len;
        Ok(Box::into_raw(Box::new(mr)))
    }
    fn dereg(&self, mr: *mut ibv_mr) -> Result<()> {
        // SAFETY: every MR handed out came from Box::into_raw in reg.
        drop(unsafe { Box::from_raw(mr) });
        Ok(())
    }
    fn watch(&self, _: usize, _: usize) -> bool {
        true
    }
}

/// A caching-mode cache holding `n` idle regions of two pages each, at
/// `BASE + i * 4 pages` (gaps between them), all with `access`.
fn filled(n: usize, access: u32) -> Cache {
    let queue: &'static Queue = Box::leak(Box::new(Queue::new()));
    let limits = Limits { max_bytes: usize::MAX, max_entries: usize::MAX };
    let cache = Cache::new(Box::new(Fake::default()), queue, limits, Mode::Caching);
    for i in 0..n {
        let lease = cache.acquire(1, pd(), BASE + i * 4 * PAGE, 2 * PAGE, access).expect("fake registration");
        assert!(!lease.hit);
        cache.release(lease.id).expect("release");
    }
    cache
}

fn pd() -> *mut ibv_pd {
    0x1000 as *mut ibv_pd
}

/// Region indices in a scrambled order (a full cycle: a stride coprime
/// with n).
fn order(n: usize) -> Vec<usize> {
    let stride = (1..).map(|k| 7919 * k).find(|s| gcd(*s, n) == 1).unwrap_or(1);
    (0..n).map(|i| (i * stride) % n).collect()
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn hit(c: &mut Criterion) {
    let mut g = c.benchmark_group("mr_hit");
    for n in [1usize, 1_000, 10_000] {
        for (name, access, offset, len) in [("remote", REMOTE, 0, 2 * PAGE), ("local", LOCAL, PAGE, PAGE)] {
            let cache = filled(n, access);
            let addrs: Vec<usize> = order(n).into_iter().map(|i| BASE + i * 4 * PAGE + offset).collect();
            // Every request is a hit (checked once, outside the timing).
            for &a in &addrs {
                let l = cache.acquire(1, pd(), a, len, access).unwrap();
                assert!(l.hit, "{name}/{n}: {a:#x} missed");
                cache.release(l.id).unwrap();
            }
            let mut k = 0usize;
            g.bench_function(BenchmarkId::new(name, n), |b| {
                b.iter(|| {
                    let a = addrs[k];
                    k = if k + 1 == addrs.len() { 0 } else { k + 1 };
                    let lease = cache.acquire(1, pd(), black_box(a), len, access).unwrap();
                    cache.release(black_box(lease.id)).unwrap();
                })
            });
        }
    }
    g.finish();
}

/// A miss with one eviction: the bookkeeping a miss adds to the real
/// registration (the fake backend's reg/dereg are a heap allocation each).
/// A one-entry cache cycling over 16 ranges: each acquire registers, each
/// release evicts the previous idle region.
fn miss(c: &mut Criterion) {
    let queue: &'static Queue = Box::leak(Box::new(Queue::new()));
    let limits = Limits { max_bytes: usize::MAX, max_entries: 1 };
    let cache = Cache::new(Box::new(Fake::default()), queue, limits, Mode::Caching);
    let mut k = 0usize;
    c.bench_function("mr_miss/remote/evict1", |b| {
        b.iter(|| {
            k = (k + 1) % 16;
            let lease = cache.acquire(1, pd(), black_box(BASE + k * 4 * PAGE), 2 * PAGE, REMOTE).unwrap();
            assert!(!lease.hit);
            cache.release(black_box(lease.id)).unwrap();
        })
    });
}

criterion_group!(benches, hit, miss);
criterion_main!(benches);
