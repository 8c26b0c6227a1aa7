//! The service endpoint's address handles, one per path, bounded
//! (`KRCORE_MAX_AHS`): a stranger whose datagrams name ever new GIDs
//! (a host may have many addresses) must not make us hold an address
//! handle for each.
//!
//! Beyond the bound, the least recently used handle goes, but only one
//! that nobody holds and that was last used more than [`MIN_IDLE_MS`]
//! ago: a UD send names its handle until the send completes, which takes
//! microseconds. When no handle may go, the new one is refused: the
//! datagram that needed it is not sent, and the peer's retransmission
//! asks again (every datagram of ours answers or repeats one of the
//! peer's, or is retransmitted by us).

use std::collections::HashMap;
use std::hash::Hash;

/// A handle used this recently stays (its last send may be in flight).
pub const MIN_IDLE_MS: u64 = 1000;

struct Entry<V> {
    value: V,
    used_ms: u64,
}

pub struct Bounded<K, V> {
    max: usize,
    map: HashMap<K, Entry<V>>,
}

impl<K: Hash + Eq + Copy, V: Clone> Bounded<K, V> {
    pub fn new(max: usize) -> Self {
        Bounded { max: max.max(1), map: HashMap::new() }
    }

    pub fn contains(&self, k: &K) -> bool {
        self.map.contains_key(k)
    }

    /// The value of `k`, marked used at `now_ms`.
    pub fn get(&mut self, k: &K, now_ms: u64) -> Option<V> {
        let e = self.map.get_mut(k)?;
        e.used_ms = e.used_ms.max(now_ms);
        Some(e.value.clone())
    }

    /// Whether there is room for a new entry at `now_ms`, making it if
    /// needed by removing the least recently used entry that `idle` says
    /// nobody holds and that was last used [`MIN_IDLE_MS`] before.
    pub fn make_room(&mut self, now_ms: u64, idle: impl Fn(&V) -> bool) -> bool {
        if self.map.len() < self.max {
            return true;
        }
        let oldest = self
            .map
            .iter()
            .filter(|(_, e)| now_ms.saturating_sub(e.used_ms) > MIN_IDLE_MS && idle(&e.value))
            .min_by_key(|(_, e)| e.used_ms)
            .map(|(k, _)| *k);
        match oldest {
            Some(k) => {
                self.map.remove(&k);
                true
            }
            None => false,
        }
    }

    /// Add `k` (after [`Bounded::make_room`] said there is room).
    pub fn insert(&mut self, k: K, value: V, now_ms: u64) {
        self.map.insert(k, Entry { value, used_ms: now_ms });
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn idle(v: &Arc<u32>) -> bool {
        Arc::strong_count(v) == 1
    }

    #[test]
    fn the_least_recently_used_idle_entry_makes_room() {
        let mut b = Bounded::new(2);
        b.insert(1, Arc::new(1), 0);
        b.insert(2, Arc::new(2), 10);
        assert_eq!(b.get(&1, 20).as_deref(), Some(&1), "1 used last now");
        // Neither was idle for a second yet: no room.
        assert!(!b.make_room(500, idle));
        assert_eq!(b.len(), 2);
        // 2 is the least recently used.
        assert!(b.make_room(2000, idle));
        assert!(b.contains(&1) && !b.contains(&2));
        b.insert(3, Arc::new(3), 2000);
        assert_eq!(b.len(), 2);
    }

    #[test]
    fn a_held_entry_stays_whatever_its_age() {
        let mut b = Bounded::new(1);
        b.insert(1, Arc::new(1), 0);
        let held = b.get(&1, 0).expect("present");
        assert!(!b.make_room(10_000, idle), "a held value is never removed");
        drop(held);
        assert!(b.make_room(10_000, idle));
        assert_eq!(b.len(), 0);
    }

    #[test]
    fn below_the_bound_nothing_goes() {
        let mut b = Bounded::new(3);
        b.insert(1, Arc::new(1), 0);
        assert!(b.make_room(u64::MAX, idle));
        assert!(b.contains(&1));
    }
}
