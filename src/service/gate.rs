//! One cold connect at a time *per link key*: a second connect to the same
//! (peer, link number, path) waits for the first and then finds its link,
//! instead of making a duplicate; connects to different peers run side by
//! side (a full mesh is not serialised behind one lock).

use crate::error::{Errno, Result};
use parking_lot::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The keys being connected now: a few at most (one per peer being
/// connected at this moment), so a list, not a hash set (no hashing on the
/// connect path).
pub struct Gate<K> {
    busy: Mutex<Vec<K>>,
    done: Condvar,
}

/// The right to connect `key`, until dropped.
pub struct Pass<'a, K: Eq + Copy> {
    gate: &'a Gate<K>,
    key: K,
}

impl<K: Eq + Copy> Gate<K> {
    pub fn new() -> Gate<K> {
        Gate { busy: Mutex::new(Vec::new()), done: Condvar::new() }
    }

    /// Wait until nobody connects `key` (ETIMEDOUT after `timeout`), then
    /// hold it. The caller looks for a link made meanwhile before it
    /// connects. The clock is read only when there is a wait (a clock
    /// read costs microseconds under emulation).
    pub fn enter(&self, key: K, timeout: Duration) -> Result<Pass<'_, K>> {
        let mut busy = self.busy.lock();
        let mut deadline = None;
        while busy.contains(&key) {
            let until = *deadline.get_or_insert_with(|| Instant::now() + timeout);
            if self.done.wait_until(&mut busy, until).timed_out() && busy.contains(&key) {
                return Err(Errno(libc::ETIMEDOUT));
            }
        }
        busy.push(key);
        Ok(Pass { gate: self, key })
    }

    /// Keys held now.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.busy.lock().len()
    }
}

impl<K: Eq + Copy> Drop for Pass<'_, K> {
    fn drop(&mut self) {
        self.gate.busy.lock().retain(|k| *k != self.key);
        self.gate.done.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Arc};

    fn soon() -> Duration {
        Duration::from_secs(10)
    }

    #[test]
    fn different_keys_are_held_at_once() {
        let g = Gate::new();
        let a = g.enter(1u32, soon()).unwrap();
        // Entered at once although key 1 is held: a connect to another
        // peer does not wait for the one in progress.
        let b = g.enter(2u32, Duration::ZERO).unwrap();
        assert_eq!(g.held(), 2);
        drop(a);
        drop(b);
        assert_eq!(g.held(), 0);
    }

    #[test]
    fn the_same_key_waits_for_its_holder() {
        let g = Arc::new(Gate::new());
        let first = g.enter(7u32, soon()).unwrap();
        let (tx, rx) = mpsc::channel();
        let released = Arc::new(AtomicBool::new(false));
        let (g2, r2) = (Arc::clone(&g), Arc::clone(&released));
        let t = std::thread::spawn(move || {
            let _p = g2.enter(7u32, soon()).unwrap();
            // Only after the first holder let go.
            tx.send(r2.load(Ordering::SeqCst)).unwrap();
        });
        // The waiter has not entered while the key is held.
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
        released.store(true, Ordering::SeqCst);
        drop(first);
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), "entered before the holder released the key");
        t.join().unwrap();
        assert_eq!(g.held(), 0);
    }

    #[test]
    fn a_wait_is_bounded() {
        let g = Gate::new();
        let _held = g.enter(3u32, soon()).unwrap();
        let t0 = Instant::now();
        let e = g.enter(3u32, Duration::from_millis(50)).err();
        assert_eq!(e, Some(Errno(libc::ETIMEDOUT)));
        assert!(t0.elapsed() >= Duration::from_millis(50));
        assert_eq!(g.held(), 1);
    }
}
