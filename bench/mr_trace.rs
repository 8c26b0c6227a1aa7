//! Trace-driven simulation of the registration cache: MRE against plain LRU.
//!
//! `cargo bench --bench mr_trace` replays two synthetic traces of
//! registration requests (buffer id, pages) against a cache of a given
//! capacity in pages, for each capacity in `CACHE_PAGES` and each policy. A
//! hit costs nothing; a miss costs one registration, T(pages) = a*pages + b
//! microseconds, and inserts the buffer, evicting through the policy (one
//! call = one deregistration batch) when the capacity would be exceeded.
//! Prints a table and writes docs/mr-trace.csv (plot: bench/plot_mr_trace.py).
//! Without `--bench` (e.g. `cargo test --benches`) it runs a short smoke
//! version and writes nothing.
//!
//! The traces and the cost model are described in docs/mr-eviction.md.

use krcore::mr::policy::{EntryId, Lru, Mre, MreConfig, Policy};
use std::fmt::Write as _;
use std::time::Instant;

/// Cache sizes swept, in 4 KiB pages.
const CACHE_PAGES: [u64; 7] = [64, 128, 256, 512, 1024, 2048, 4096];

/// Per-page registration cost (µs) unless KRCORE_REG_A_US is set: 0.375 µs
/// per 4 KiB page, from Mooncake PR #855 (500 GB of pre-faulted memory
/// registered sequentially in 49.2 s, i.e. 49.2 s / 131 M pages, reading GB
/// as GiB). See docs/mr-eviction.md.
const DEFAULT_A_US: f64 = 0.375;
/// Fixed registration cost (µs) unless KRCORE_REG_B_US is set: an
/// assumption (no published figure at hand), the order of a uverbs system
/// call plus one firmware command to create the memory key.
const DEFAULT_B_US: f64 = 20.0;

/// xorshift64: deterministic, no dependencies.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Approximately standard normal (Irwin-Hall, 12 uniforms).
    fn normal(&mut self) -> f64 {
        (0..12).map(|_| self.unit()).sum::<f64>() - 6.0
    }
}

/// Draws ranks 0..n with probability proportional to 1/(rank+1)^alpha.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, alpha: f64) -> Self {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=n)
            .map(|k| {
                acc += 1.0 / (k as f64).powf(alpha);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }
    fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.unit();
        self.cdf.partition_point(|&c| c <= u).min(self.cdf.len() - 1)
    }
}

struct Trace {
    name: &'static str,
    /// Pages of buffer `id`.
    pages: Vec<u64>,
    /// Buffer ids in request order.
    requests: Vec<u32>,
    note: String,
}

/// HTTPD-like: `n` buffers of 1-32 pages, sizes roughly log-uniform (many
/// small, few large, P(s) ~ 1/s); popularity Zipf(alpha) over a ranking that
/// puts small buffers first with noise: rank by log2(s) + sigma * N(0,1).
fn httpd_trace(name: &'static str, n: usize, requests: usize, alpha: f64, sigma: f64, seed: u64) -> Trace {
    let mut rng = Rng(seed);
    let mut sizes: Vec<(f64, u64)> = (0..n)
        .map(|_| {
            let pages = (33f64.powf(rng.unit()) as u64).clamp(1, 32);
            let key = (pages as f64).log2() + sigma * rng.normal();
            (key, pages)
        })
        .collect();
    sizes.sort_by(|a, b| a.0.total_cmp(&b.0));
    // Buffer id = popularity rank.
    let pages: Vec<u64> = sizes.iter().map(|s| s.1).collect();
    let zipf = Zipf::new(n, alpha);
    let requests: Vec<u32> = (0..requests).map(|_| zipf.sample(&mut rng) as u32).collect();
    // How strongly size follows unpopularity: Pearson correlation of
    // log(size) and log(popularity rank); 0 = independent.
    let xs: Vec<f64> = pages.iter().map(|&p| (p as f64).ln()).collect();
    let ys: Vec<f64> = (1..=n).map(|k| (k as f64).ln()).collect();
    let corr = pearson(&xs, &ys);
    let footprint: u64 = pages.iter().sum();
    let note = format!(
        "{n} buffers, {footprint} pages in all, mean {:.1} pages, Zipf alpha {alpha}, size noise sigma {sigma:e}, \
         corr(log size, log popularity rank) = {corr:.2}",
        footprint as f64 / n as f64
    );
    Trace { name, pages, requests, note }
}

/// Uniform: `n` buffers of `size` pages each, uniform popularity.
fn uniform_trace(name: &'static str, n: usize, size: u64, requests: usize, seed: u64) -> Trace {
    let mut rng = Rng(seed);
    let requests = (0..requests).map(|_| (rng.next() % n as u64) as u32).collect();
    let note = format!("{n} buffers of {size} pages ({} pages in all), uniform popularity", n as u64 * size);
    Trace { name, pages: vec![size; n], requests, note }
}

fn pearson(xs: &[f64], ys: &[f64]) -> f64 {
    let n = xs.len() as f64;
    let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (x, y) in xs.iter().zip(ys) {
        sxy += (x - mx) * (y - my);
        sxx += (x - mx) * (x - mx);
        syy += (y - my) * (y - my);
    }
    sxy / (sxx * syy).sqrt()
}

#[derive(Default)]
struct Outcome {
    hits: u64,
    hit_pages: u64,
    req_pages: u64,
    reg_us: f64,
    batches: u64,
    evicted: u64,
}

fn simulate(trace: &Trace, capacity: u64, policy: &mut dyn Policy, (a, b): (f64, f64)) -> Outcome {
    let mut cached = vec![false; trace.pages.len()];
    let mut used = 0u64;
    let mut o = Outcome::default();
    for &buf in &trace.requests {
        let id = buf as usize;
        let pages = trace.pages[id];
        o.req_pages += pages;
        if cached[id] {
            o.hits += 1;
            o.hit_pages += pages;
            policy.touch(id as EntryId);
            continue;
        }
        o.reg_us += a * pages as f64 + b;
        if pages > capacity {
            continue; // registered, used and deregistered: never cached
        }
        if used + pages > capacity {
            let victims = policy.evict(used + pages - capacity, 0, &mut |_| true);
            o.batches += 1;
            for v in victims {
                cached[v as usize] = false;
                used -= trace.pages[v as usize];
                o.evicted += 1;
            }
            assert!(used + pages <= capacity, "the policy freed too little");
        }
        policy.insert(id as EntryId, pages);
        cached[id] = true;
        used += pages;
    }
    assert_eq!(policy.len(), cached.iter().filter(|&&c| c).count());
    o
}

/// Makes a fresh policy for one run.
type MakePolicy = Box<dyn Fn() -> Box<dyn Policy>>;

/// The policies compared: the two of the report first (MRE is the default
/// configuration, 0.5 and no batch padding), then ablations of MRE's two
/// parameters: batch padding to 8 entries, and the frequent fraction with
/// `batch_min` 1 (rows in the CSV, tables in the doc).
fn policies() -> Vec<(&'static str, MakePolicy)> {
    let mre = |frequent_fraction: f64, batch_min: usize| -> MakePolicy {
        Box::new(move || Box::new(Mre::new(MreConfig { frequent_fraction, batch_min })))
    };
    vec![
        ("LRU", Box::new(|| Box::new(Lru::new()))),
        ("MRE", Box::new(|| Box::new(Mre::default()))),
        ("MRE-batch8", mre(0.5, 8)),
        ("MRE-f0", mre(0.0, 1)),
        ("MRE-f0.25", mre(0.25, 1)),
        ("MRE-f0.75", mre(0.75, 1)),
        ("MRE-f1", mre(1.0, 1)),
    ]
}

fn env_f64(name: &str, default: f64) -> (f64, &'static str) {
    match std::env::var(name).ok().and_then(|v| v.parse::<f64>().ok()) {
        Some(v) => (v, "from the environment"),
        None => (default, "default"),
    }
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let requests = if full { 200_000 } else { 20_000 };
    let (a, a_src) = env_f64("KRCORE_REG_A_US", DEFAULT_A_US);
    let (b, b_src) = env_f64("KRCORE_REG_B_US", DEFAULT_B_US);
    let started = Instant::now();

    let traces = [
        httpd_trace("httpd", 4000, requests, 0.9, 1.0, 0x5EED_0001),
        uniform_trace("uniform", 1024, 8, requests, 0x5EED_0002),
        // Sensitivity: the same sizes and popularity without the inverse
        // size/popularity correlation.
        httpd_trace("httpd-nocorr", 4000, requests, 0.9, 1e9, 0x5EED_0001),
    ];
    println!("registration cost T(pages) = {a} us/page ({a_src}) * pages + {b} us ({b_src}); {requests} requests per trace");
    let mut csv =
        String::from("trace,policy,cache_pages,requests,hits,hit_ratio,byte_hit_ratio,reg_time_ms,dereg_batches,evicted_entries\n");
    for trace in &traces {
        println!("\n{}: {}", trace.name, trace.note);
        println!(
            "{:>12} {:>12} {:>9} {:>9} {:>11} {:>9} {:>9}",
            "policy", "cache_pages", "hit%", "bytehit%", "reg_ms", "batches", "evicted"
        );
        let mut by_size: Vec<(u64, f64, f64)> = Vec::new(); // (size, LRU hit, MRE hit)
        for (name, make) in policies() {
            for &cap in &CACHE_PAGES {
                let mut p = make();
                let o = simulate(trace, cap, p.as_mut(), (a, b));
                let n = trace.requests.len() as f64;
                let hit = o.hits as f64 / n;
                let byte_hit = o.hit_pages as f64 / o.req_pages as f64;
                println!(
                    "{name:>12} {cap:>12} {:>9.2} {:>9.2} {:>11.1} {:>9} {:>9}",
                    100.0 * hit,
                    100.0 * byte_hit,
                    o.reg_us / 1000.0,
                    o.batches,
                    o.evicted
                );
                let _ = writeln!(
                    csv,
                    "{},{name},{cap},{},{},{hit:.6},{byte_hit:.6},{:.3},{},{}",
                    trace.name,
                    trace.requests.len(),
                    o.hits,
                    o.reg_us / 1000.0,
                    o.batches,
                    o.evicted
                );
                match name {
                    "LRU" => by_size.push((cap, hit, 0.0)),
                    "MRE" => {
                        if let Some(e) = by_size.iter_mut().find(|e| e.0 == cap) {
                            e.2 = hit;
                        }
                    }
                    _ => {}
                }
            }
        }
        let diffs: Vec<f64> = by_size.iter().map(|e| 100.0 * (e.2 - e.1)).collect();
        let (lo, hi) = diffs.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &d| (lo.min(d), hi.max(d)));
        println!("{}: MRE - LRU hit ratio, in points: min {lo:+.2}, max {hi:+.2}", trace.name);
    }
    if full {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/mr-trace.csv");
        std::fs::write(path, csv).expect("write docs/mr-trace.csv");
        println!("\nwrote {path}");
    }
    println!("simulated in {:.1} s", started.elapsed().as_secs_f64());
}
