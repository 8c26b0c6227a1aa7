//! A set (and a map) that remembers only its most recent members: what a
//! long-lived process keeps about peers that come and go (retired link
//! requests, processes taken for gone, flows closed lately) stays bounded
//! however many pass.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::Hash;

/// At most `cap` members; inserting past it forgets the oldest.
#[derive(Debug)]
pub struct Recent<T> {
    cap: usize,
    set: HashSet<T>,
    order: VecDeque<T>,
}

impl<T: Copy + Eq + Hash> Recent<T> {
    pub fn new(cap: usize) -> Recent<T> {
        Recent { cap: cap.max(1), set: HashSet::new(), order: VecDeque::new() }
    }

    /// Whether `x` is new (a member already is not moved).
    pub fn insert(&mut self, x: T) -> bool {
        if !self.set.insert(x) {
            return false;
        }
        if self.order.len() == self.cap {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        self.order.push_back(x);
        true
    }

    pub fn contains(&self, x: &T) -> bool {
        self.set.contains(x)
    }

    pub fn remove(&mut self, x: &T) {
        if self.set.remove(x) {
            self.order.retain(|y| y != x);
        }
    }

    pub fn len(&self) -> usize {
        self.set.len()
    }

    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }
}

/// A map that remembers only its most recently inserted keys.
#[derive(Debug)]
pub struct RecentMap<K, V> {
    cap: usize,
    map: HashMap<K, V>,
    order: VecDeque<K>,
}

impl<K: Copy + Eq + Hash, V> RecentMap<K, V> {
    pub fn new(cap: usize) -> RecentMap<K, V> {
        RecentMap { cap: cap.max(1), map: HashMap::new(), order: VecDeque::new() }
    }

    /// Insert or replace; past `cap` keys the oldest goes.
    pub fn insert(&mut self, k: K, v: V) {
        if self.map.insert(k, v).is_some() {
            return;
        }
        if self.order.len() == self.cap {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
        self.order.push_back(k);
    }

    pub fn get(&self, k: &K) -> Option<&V> {
        self.map.get(k)
    }

    pub fn remove(&mut self, k: &K) -> Option<V> {
        let v = self.map.remove(k)?;
        self.order.retain(|x| x != k);
        Some(v)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::Recent;

    #[test]
    fn forgets_the_oldest_past_its_bound() {
        let mut r = Recent::new(3);
        for i in 0..5 {
            r.insert(i);
        }
        assert_eq!(r.len(), 3);
        assert!(!r.contains(&0) && !r.contains(&1));
        assert!(r.contains(&2) && r.contains(&4));
    }

    #[test]
    fn a_repeated_insert_is_one_member() {
        let mut r = Recent::new(2);
        r.insert(7);
        r.insert(7);
        r.insert(8);
        assert!(r.contains(&7) && r.contains(&8));
        assert_eq!(r.len(), 2);
    }

    #[test]
    fn a_removed_member_frees_its_place() {
        let mut r = Recent::new(2);
        r.insert(1);
        r.insert(2);
        r.remove(&1);
        assert!(!r.is_empty() && !r.contains(&1));
        r.insert(3);
        assert!(r.contains(&2) && r.contains(&3));
        assert_eq!(r.len(), 2);
    }

    #[test]
    fn the_map_keeps_its_newest_keys_and_replaces_in_place() {
        let mut m = super::RecentMap::new(2);
        m.insert(1, "a");
        m.insert(2, "b");
        m.insert(1, "c"); // a replacement: 1 keeps its age
        assert_eq!(m.get(&1), Some(&"c"));
        m.insert(3, "d");
        assert_eq!((m.get(&1), m.get(&2), m.get(&3)), (None, Some(&"b"), Some(&"d")));
        assert_eq!(m.remove(&2), Some("b"));
        assert_eq!(m.len(), 1);
        m.insert(4, "e");
        m.insert(5, "f");
        assert!(m.get(&3).is_none() && !m.is_empty());
    }
}
