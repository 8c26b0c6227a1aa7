//! Flow control of a link's messages: what a peer can make this process
//! hold.
//!
//! A message that came over a link cannot be refused once its RC receive
//! completed (the sender's NIC has its ACK), yet a VQP with no receive
//! posted must keep it. So each side announces a window in the link
//! handshake (`LinkInfo::window`, `KRCORE_LINK_WINDOW_BYTES`): the bytes
//! of messages (header and carried bytes) its peer may have sent it and
//! not had granted back. The sender posts a message only within the
//! peer's window ([`LinkCredit::try_send`]); the receiver counts each
//! message from its arrival ([`LinkCredit::admit`]) until it leaves the
//! VQP that took it (landed, dropped, or the VQP gone:
//! [`LinkCredit::release`]) and grants the bytes back once half its
//! window is owed ([`LinkCredit::take_grant`]: a `LINK` GRANT header).
//! A message past the window is refused: only a sender that ignores the
//! protocol sends one.
//!
//! Why the receiver's count never exceeds the sender's: messages arrive
//! in the order they were sent (RC), a sender counts a message before it
//! posts it and lets it go only when a grant naming it arrives, and the
//! receiver lets the bytes go when it sends that grant, before the sender
//! sees it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// The smallest window a peer may announce: two messages of a receive
/// buffer's size and their headers (a smaller one could stall a sender
/// for good).
pub const MIN_WINDOW: u32 = 2 * (4096 + 64);

#[derive(Debug)]
pub struct LinkCredit {
    /// The peer's window (what we may send), and ours (what we hold).
    send_window: u64,
    recv_window: u64,
    /// Bytes we sent that the peer has not granted back.
    sent: AtomicU64,
    /// Bytes that came from the peer and were not granted back: held by a
    /// VQP, or owed.
    received: AtomicU64,
    /// Of `received`, the bytes no VQP holds any more.
    owed: AtomicU64,
    /// The endpoint's "a grant is due on some link" (set by `release`).
    due: Arc<AtomicBool>,
}

impl LinkCredit {
    pub fn new(send_window: u32, recv_window: u32, due: Arc<AtomicBool>) -> LinkCredit {
        LinkCredit {
            due,
            send_window: u64::from(send_window),
            recv_window: u64::from(recv_window),
            sent: AtomicU64::new(0),
            received: AtomicU64::new(0),
            owed: AtomicU64::new(0),
        }
    }

    /// Take `cost` bytes of the peer's window for a message about to be
    /// posted; false when the peer has not granted enough back.
    pub fn try_send(&self, cost: u64) -> bool {
        self.sent.fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| (s + cost <= self.send_window).then_some(s + cost)).is_ok()
    }

    /// A message counted by [`LinkCredit::try_send`] was not posted.
    pub fn unsend(&self, cost: u64) {
        // In one step: a grant (a peer's, of everything counted) may come
        // between a load and a subtraction, which would then wrap.
        let _ = self.sent.fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| Some(s.saturating_sub(cost)));
    }

    /// The peer granted `n` bytes back. False when that is more than we
    /// sent (a peer that breaks the protocol): nothing is taken.
    pub fn granted(&self, n: u64) -> bool {
        self.sent.fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| s.checked_sub(n)).is_ok()
    }

    /// Bytes we sent and the peer has not granted back.
    #[cfg(test)]
    fn outstanding(&self) -> u64 {
        self.sent.load(Ordering::Acquire)
    }

    /// A message of `cost` bytes came from the peer: counted, or false
    /// when it is past our window (refuse it).
    pub fn admit(&self, cost: u64) -> bool {
        self.received.fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| (r + cost <= self.recv_window).then_some(r + cost)).is_ok()
    }

    /// An admitted message left its VQP. Whether a grant is due (then
    /// also said in the endpoint's flag).
    pub fn release(&self, cost: u64) -> bool {
        let due = self.owed.fetch_add(cost, Ordering::AcqRel) + cost >= self.recv_window / 2;
        if due {
            self.due.store(true, Ordering::Release);
        }
        due
    }

    /// Whether a grant is due.
    pub fn grant_due(&self) -> bool {
        self.owed.load(Ordering::Acquire) >= self.recv_window / 2
    }

    /// The bytes to grant back now (all that is owed), no longer counted.
    /// The caller sends them, or gives them back with
    /// [`LinkCredit::ungrant`].
    pub fn take_grant(&self) -> u64 {
        let n = self.owed.swap(0, Ordering::AcqRel);
        self.received.fetch_sub(n, Ordering::AcqRel);
        n
    }

    /// A grant taken could not be sent: owed again.
    pub fn ungrant(&self, n: u64) {
        self.received.fetch_add(n, Ordering::AcqRel);
        self.owed.fetch_add(n, Ordering::AcqRel);
        self.due.store(true, Ordering::Release);
    }

    /// Bytes that came from the peer and were not granted back.
    #[cfg(test)]
    fn received(&self) -> u64 {
        self.received.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sender_stays_within_the_window_until_granted() {
        let c = LinkCredit::new(100, 1000, Arc::default());
        assert!(c.try_send(60));
        assert!(c.try_send(40));
        assert!(!c.try_send(1), "the window is full");
        c.unsend(40);
        assert_eq!(c.outstanding(), 60);
        assert!(!c.granted(61), "more than was sent is not a grant");
        assert!(c.granted(60));
        assert!(c.try_send(100));
        // A peer's grant of what was counted but not posted, then the
        // post fails: nothing wraps.
        assert!(c.granted(100));
        c.unsend(100);
        assert_eq!(c.outstanding(), 0);
    }

    #[test]
    fn a_receiver_counts_until_it_grants_and_refuses_past_its_window() {
        let c = LinkCredit::new(1000, 100, Arc::default());
        assert!(c.admit(30));
        assert!(c.admit(30));
        assert!(!c.release(30), "30 owed: below half the window");
        assert!(c.admit(40));
        assert!(!c.admit(1), "past the window: refused, though 30 are only owed");
        assert!(c.release(30), "60 owed: a grant is due");
        assert_eq!(c.take_grant(), 60);
        assert_eq!(c.received(), 40);
        assert!(c.admit(60));
        assert!(!c.grant_due());
        c.ungrant(0);
        assert!(!c.release(40));
        assert!(c.release(60));
        let n = c.take_grant();
        c.ungrant(n);
        assert_eq!((c.received(), c.take_grant()), (100, 100));
    }

    /// The two ends of one link direction, wired by hand: whatever the
    /// order of grants and releases, an honest sender is never refused.
    #[test]
    fn an_honest_sender_is_never_refused() {
        let (tx, rx) = (LinkCredit::new(1000, 0, Arc::default()), LinkCredit::new(0, 1000, Arc::default()));
        let mut in_flight = std::collections::VecDeque::new();
        let mut grants = std::collections::VecDeque::new();
        let mut held = std::collections::VecDeque::new();
        let mut seed = 7u64;
        for _ in 0..100_000 {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            match (seed >> 33) % 5 {
                0 => {
                    let cost = 1 + (seed >> 40) % 300;
                    if tx.try_send(cost) {
                        in_flight.push_back(cost);
                    }
                }
                1 => {
                    if let Some(cost) = in_flight.pop_front() {
                        assert!(rx.admit(cost), "an honest message refused");
                        held.push_back(cost);
                    }
                }
                2 => {
                    if let Some(cost) = held.pop_front() {
                        if rx.release(cost) {
                            grants.push_back(rx.take_grant());
                        }
                    }
                }
                3 => {
                    if let Some(n) = grants.pop_front() {
                        assert!(tx.granted(n));
                    }
                }
                _ => {}
            }
        }
    }
}
