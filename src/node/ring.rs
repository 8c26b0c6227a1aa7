//! The rings of a staging region: a process's work requests to the agent
//! and their completions back, in shared memory after the region's data
//! slots, so that neither side makes a system call per work request while
//! the other is awake.
//!
//! Layout (from the end of the data, [`LEN`] bytes, each field its own
//! cache line): 0 the requests' head (u32, the process writes it), 64
//! `agent_awake` (u32, the agent: 1 while it looks at the rings), 128 the
//! completions' head (u32, the agent), 192 `reader_asleep` (u32, the
//! process: 1 while nothing of its reads the completions); 256 [`SLOTS`]
//! requests of 64 bytes (token, handle, opcode, length, rkey (u32 each),
//! pad, offset in the region, remote address, an atomic's compare/add and
//! swap (u64 each), pad); then [`SLOTS`]
//! completions of 16 bytes (token, status, byte_len (u32 each), pad).
//!
//! Each side keeps its own tail (never read from the shared memory), so a
//! process that writes anything there harms only itself: the agent checks
//! that a head is at most [`SLOTS`] ahead of its tail, and every request
//! as it checked a `POST` message. A ring cannot overflow while each
//! request holds one of the region's [`SLOTS`] slots until its completion
//! is taken.
//!
//! Sleeping and waking: a side that is about to sleep says so (its flag),
//! then looks at the ring once more; a side that published an entry then
//! reads the other's flag (both with a full fence between), and rings the
//! doorbell (a `RING` message on the socket) only when the other sleeps.
//! Either the sleeper sees the entry or the publisher sees the flag.

use super::proto::Post;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

/// Entries of each ring: the staging region's slots.
pub const SLOTS: usize = 64;
const REQ_AT: usize = 256;
const REQ_LEN: usize = 64;
const DONE_AT: usize = REQ_AT + SLOTS * REQ_LEN;
const DONE_LEN: usize = 16;
/// The rings' bytes, after the region's data.
pub const LEN: usize = 8192;
const _: () = assert!(DONE_AT + SLOTS * DONE_LEN <= LEN);

/// Where one ring lies: its head, its entries and their length.
struct RingAt {
    head: usize,
    entries: usize,
    len: usize,
}
const REQUESTS: RingAt = RingAt { head: 0, entries: REQ_AT, len: REQ_LEN };
const DONES: RingAt = RingAt { head: 128, entries: DONE_AT, len: DONE_LEN };
const AGENT_AWAKE: usize = 64;
const READER_ASLEEP: usize = 192;

/// A completion: the request's token, the work completion's status and
/// byte_len.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Done {
    pub token: u32,
    pub status: u32,
    pub byte_len: u32,
}

/// The other side broke the rings' rules (a head beyond its bound).
#[derive(Debug, PartialEq, Eq)]
pub struct Broken;

/// A view of the rings at a mapping's address.
#[derive(Clone, Copy)]
pub struct Rings {
    at: *mut u8,
}

// SAFETY: a view of shared memory accessed only through atomics.
unsafe impl Send for Rings {}
// SAFETY: as above.
unsafe impl Sync for Rings {}

impl Rings {
    /// # Safety
    /// `at` is the start of [`LEN`] mapped, writable bytes, 64-byte
    /// aligned, that outlive every use of the view.
    pub unsafe fn at(at: *mut u8) -> Rings {
        debug_assert_eq!(at as usize % 64, 0);
        Rings { at }
    }

    fn u32(&self, off: usize) -> &AtomicU32 {
        // SAFETY: `off` is inside the rings and 4-aligned (the layout);
        // shared memory is only accessed through atomics.
        unsafe { &*(self.at.add(off) as *const AtomicU32) }
    }

    fn u64(&self, off: usize) -> &AtomicU64 {
        // SAFETY: as `u32`, 8-aligned.
        unsafe { &*(self.at.add(off) as *const AtomicU64) }
    }

    /// Publish entry number `*head` of `ring` (written by `write` at its
    /// offset); whether the other side's flag at `flag_at` says it sleeps
    /// (`sleeps_when`).
    fn publish(&self, ring: &RingAt, head: &mut u32, flag_at: usize, sleeps_when: u32, write: impl FnOnce(usize)) -> bool {
        write(ring.entries + (*head as usize % SLOTS) * ring.len);
        *head = head.wrapping_add(1);
        self.u32(ring.head).store(*head, Ordering::Release);
        fence(Ordering::SeqCst);
        self.u32(flag_at).load(Ordering::Relaxed) == sleeps_when
    }

    /// The entries of `ring` after `*tail` (at most [`SLOTS`]), each read
    /// by `read` at its offset.
    fn take<T>(&self, ring: &RingAt, tail: &mut u32, read: impl Fn(usize) -> T) -> Result<Vec<T>, Broken> {
        let head = self.u32(ring.head).load(Ordering::Acquire);
        let n = head.wrapping_sub(*tail) as usize;
        if n > SLOTS {
            return Err(Broken);
        }
        let out = (0..n).map(|k| read(ring.entries + (tail.wrapping_add(k as u32) as usize % SLOTS) * ring.len)).collect();
        *tail = head;
        Ok(out)
    }

    /// The process: publish `p` as request number `*head` (its own
    /// count). Whether the agent sleeps (ring the doorbell).
    pub fn push_request(&self, head: &mut u32, p: &Post) -> bool {
        self.publish(&REQUESTS, head, AGENT_AWAKE, 0, |e| {
            for (i, v) in [p.token, p.handle, p.opcode, p.len, p.rkey].into_iter().enumerate() {
                self.u32(e + 4 * i).store(v, Ordering::Relaxed);
            }
            for (i, v) in [p.offset, p.remote, p.compare_add, p.swap].into_iter().enumerate() {
                self.u64(e + 24 + 8 * i).store(v, Ordering::Relaxed);
            }
        })
    }

    /// The agent: the requests after `*tail` (its own count), at most
    /// [`SLOTS`].
    pub fn take_requests(&self, tail: &mut u32) -> Result<Vec<Post>, Broken> {
        self.take(&REQUESTS, tail, |e| {
            let f = |i: usize| self.u32(e + 4 * i).load(Ordering::Relaxed);
            let g = |i: usize| self.u64(e + 24 + 8 * i).load(Ordering::Relaxed);
            Post {
                token: f(0),
                handle: f(1),
                opcode: f(2),
                len: f(3),
                rkey: f(4),
                offset: g(0),
                remote: g(1),
                compare_add: g(2),
                swap: g(3),
            }
        })
    }

    /// The agent: publish `d` as completion number `*head`. Whether the
    /// process's reader sleeps (ring the doorbell).
    pub fn push_done(&self, head: &mut u32, d: Done) -> bool {
        self.publish(&DONES, head, READER_ASLEEP, 1, |e| {
            for (i, v) in [d.token, d.status, d.byte_len].into_iter().enumerate() {
                self.u32(e + 4 * i).store(v, Ordering::Relaxed);
            }
        })
    }

    /// The process: the completions after `*tail`.
    pub fn take_done(&self, tail: &mut u32) -> Result<Vec<Done>, Broken> {
        self.take(&DONES, tail, |e| {
            let f = |i: usize| self.u32(e + 4 * i).load(Ordering::Relaxed);
            Done { token: f(0), status: f(1), byte_len: f(2) }
        })
    }

    /// Whether requests after `tail` wait.
    pub fn requests_after(&self, tail: u32) -> bool {
        self.u32(REQUESTS.head).load(Ordering::Acquire) != tail
    }

    /// Whether completions after `tail` wait.
    pub fn done_after(&self, tail: u32) -> bool {
        self.u32(DONES.head).load(Ordering::Acquire) != tail
    }

    /// The agent looks at the rings (`true`) or is about to sleep.
    pub fn set_agent_awake(&self, awake: bool) {
        self.u32(AGENT_AWAKE).store(awake as u32, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// The process's reader is about to sleep (`true`) or reads again.
    pub fn set_reader_asleep(&self, asleep: bool) {
        self.u32(READER_ASLEEP).store(asleep as u32, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(C, align(64))]
    struct Mem([u8; LEN]);

    fn rings(m: &mut Mem) -> Rings {
        // SAFETY: LEN bytes, 64-aligned, outliving the test's use.
        unsafe { Rings::at(m.0.as_mut_ptr()) }
    }

    fn post(token: u32) -> Post {
        // Every field distinct, the atomic's operands at their extremes.
        let opcode = super::super::proto::OP_CMP_AND_SWP;
        Post {
            token,
            handle: 3,
            opcode,
            len: 8,
            rkey: 9,
            offset: 16 << 10,
            remote: u64::MAX - token as u64,
            compare_add: u64::MAX,
            swap: 1 << 63 | token as u64,
        }
    }

    #[test]
    fn requests_and_completions_go_round_in_order() {
        let mut m = Mem([0; LEN]);
        let r = rings(&mut m);
        let (mut head, mut tail, mut dhead, mut dtail) = (u32::MAX - 70, u32::MAX - 70, 5u32.wrapping_neg(), 5u32.wrapping_neg());
        for round in 0..5u32 {
            r.set_agent_awake(round % 2 == 0);
            for k in 0..SLOTS as u32 {
                assert_eq!(r.push_request(&mut head, &post(round * 100 + k)), round % 2 == 1, "doorbell when the agent sleeps");
            }
            assert!(r.requests_after(tail));
            let got = r.take_requests(&mut tail).expect("within bounds");
            assert_eq!(got, (0..SLOTS as u32).map(|k| post(round * 100 + k)).collect::<Vec<_>>());
            assert!(!r.requests_after(tail));
            r.set_reader_asleep(round % 2 == 1);
            for p in &got[..3] {
                assert_eq!(r.push_done(&mut dhead, Done { token: p.token, status: 0, byte_len: 8 }), round % 2 == 1);
            }
            assert!(r.done_after(dtail));
            let done = r.take_done(&mut dtail).expect("within bounds");
            assert_eq!(done.iter().map(|d| d.token).collect::<Vec<_>>(), got[..3].iter().map(|p| p.token).collect::<Vec<_>>());
            assert!(r.take_done(&mut dtail).expect("none").is_empty());
        }
    }

    #[test]
    fn a_head_beyond_its_bound_is_broken_and_takes_nothing() {
        let mut m = Mem([0; LEN]);
        let r = rings(&mut m);
        // What a process may write into its own rings: any head at all.
        r.u32(REQUESTS.head).store(SLOTS as u32 + 1, Ordering::Relaxed);
        let mut tail = 0;
        assert_eq!(r.take_requests(&mut tail), Err(Broken));
        assert_eq!(tail, 0);
        r.u32(REQUESTS.head).store(u32::MAX, Ordering::Relaxed);
        assert_eq!(r.take_requests(&mut tail), Err(Broken), "behind the tail is far ahead");
        r.u32(DONES.head).store(SLOTS as u32 + 1, Ordering::Relaxed);
        assert_eq!(r.take_done(&mut tail), Err(Broken));
    }
}
