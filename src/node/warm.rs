//! The agent keeps the peers' rkeys its processes use checked
//! ([`crate::vqp::mrcheck`]): each agent VQP is new (one per process and
//! peer), and would otherwise ask the owner about an rkey whose check ran
//! out before its first READ. A thread of the agent's wakes every quarter
//! lease and checks again the rkeys looked up within [`WARM_FOR`] whose
//! lease is half over (one MR_CHECK each, over the agent's open link to
//! their owner), so a new process's first READ through the agent waits
//! for no check.

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// An rkey a process used within this long is kept checked.
pub const WARM_FOR: Duration = Duration::from_secs(10);

/// The thread, stopped (and joined) when dropped.
pub struct Warm {
    stop: Arc<(Mutex<bool>, Condvar)>,
    renewed: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Warm {
    /// None when the MR lease is 0 (checks are never trusted for long
    /// enough to keep) or no thread could be made.
    pub fn start() -> Option<Warm> {
        let lease = crate::config::get().mr_lease_ms;
        if lease == 0 {
            return None;
        }
        let every = Duration::from_millis((lease / 4).max(10));
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let s = Arc::clone(&stop);
        let renewed = Arc::new(AtomicU64::new(0));
        let count = Arc::clone(&renewed);
        let body = move || {
            let (stopped, wake) = &*s;
            let mut g = stopped.lock();
            while !*g {
                wake.wait_for(&mut g, every);
                if *g {
                    break;
                }
                drop(g);
                for rt in crate::vqp::registry::all() {
                    let n = rt.renew_mr_checks(WARM_FOR.as_millis() as u64);
                    count.fetch_add(n as u64, Ordering::Relaxed);
                    if n > 0 {
                        crate::klog!(crate::log::Level::Debug, "node: {n} rkeys checked again");
                    }
                }
                g = stopped.lock();
            }
        };
        let thread = std::thread::Builder::new().name("krcore-node-warm".into()).spawn(body).ok()?;
        Some(Warm { stop, renewed, thread: Some(thread) })
    }

    /// Checks made again so far.
    pub fn renewed(&self) -> u64 {
        self.renewed.load(Ordering::Relaxed)
    }
}

impl Drop for Warm {
    fn drop(&mut self) {
        *self.stop.0.lock() = true;
        self.stop.1.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
