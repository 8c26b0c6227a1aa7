//! What one source GID may make this process hold through the datagram
//! tier: the bytes of the messages its flows delivered (or are
//! reassembling) that have not yet left the VQPs that took them. A link
//! has its window (`crate::service::credit`); the tier's flows from one
//! GID share this one, process-wide, so that inventing flows or VQPs buys
//! a stranger nothing.
//!
//! A message is admitted at its first segment for its whole length, if it
//! fits in what the GID has left, or if the GID holds nothing (a message
//! larger than the budget still passes, alone). A refused segment is
//! answered RNR (`super::wire::RNR`): its sender waits and sends it again,
//! as an RC sender waits out a receiver that is not ready.
//! [`Reservation`] gives the bytes back when it is dropped, wherever the
//! message ends (landed, dropped, its VQP or flow gone).

use once_cell::sync::Lazy;
use parking_lot::Mutex;
use std::collections::HashMap;

type Gid = [u8; 16];

static HELD: Lazy<Mutex<HashMap<Gid, u64>>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// Bytes of one message, held against its source GID until dropped.
#[derive(Debug, PartialEq, Eq)]
pub struct Reservation {
    gid: Gid,
    bytes: u64,
}

impl Reservation {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut held = HELD.lock();
        if let std::collections::hash_map::Entry::Occupied(mut e) = held.entry(self.gid) {
            let left = e.get().saturating_sub(self.bytes);
            if left == 0 {
                e.remove();
            } else {
                *e.get_mut() = left;
            }
        }
    }
}

/// `bytes` more for `gid`, if they fit in `limit` (0: no limit) or the
/// GID holds nothing.
pub fn reserve(gid: &Gid, bytes: u64, limit: u64) -> Option<Reservation> {
    let mut held = HELD.lock();
    let now = held.get(gid).copied().unwrap_or(0);
    if limit > 0 && now > 0 && now + bytes > limit {
        return None;
    }
    held.insert(*gid, now + bytes);
    Some(Reservation { gid: *gid, bytes })
}

/// What `gid` holds now.
pub fn held(gid: &Gid) -> u64 {
    HELD.lock().get(gid).copied().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gid_holds_at_most_its_limit_and_gets_it_back_when_messages_go() {
        let gid = [0xb0; 16];
        let a = reserve(&gid, 600, 1000).expect("fits");
        let b = reserve(&gid, 400, 1000).expect("fits exactly");
        assert!(reserve(&gid, 1, 1000).is_none(), "full");
        // Another GID is not held up.
        let other = reserve(&[0xb1; 16], 1000, 1000).expect("its own budget");
        drop(a);
        assert_eq!(held(&gid), 400);
        assert!(reserve(&gid, 601, 1000).is_none());
        let c = reserve(&gid, 600, 1000).expect("room again");
        drop((b, c, other));
        assert_eq!(held(&gid), 0);
        assert_eq!(held(&[0xb1; 16]), 0);
    }

    #[test]
    fn a_message_larger_than_the_limit_passes_alone() {
        let gid = [0xb2; 16];
        let big = reserve(&gid, 5000, 1000).expect("nothing held: passes");
        assert!(reserve(&gid, 1, 1000).is_none(), "nothing beside it");
        drop(big);
        assert!(reserve(&gid, 1, 0).is_some(), "0: no limit");
        assert_eq!(held(&gid), 0);
    }
}
