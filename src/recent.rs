//! A set that remembers only its most recent members: what a long-lived
//! process keeps about peers that come and go (retired link requests,
//! processes taken for gone) stays bounded however many pass.

use std::collections::{HashSet, VecDeque};
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

    pub fn insert(&mut self, x: T) {
        if !self.set.insert(x) {
            return;
        }
        if self.order.len() == self.cap {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        self.order.push_back(x);
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
}
