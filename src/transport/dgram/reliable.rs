//! One flow of the datagram tier: a src VQP -> dst VQP, its [`Sender`] at
//! the source and its [`Receiver`] at the destination.
//!
//! Every DATA segment and REQUEST packet of a flow takes the next sequence
//! number (u64, from 0: it never wraps) and a random nonce. The sender
//! keeps at most `window` packets (at most [`WINDOW`]) past the oldest one
//! not finished; the receiver delivers packets once each and in order,
//! buffering up to [`WINDOW`] ahead, and acknowledges cumulatively (plus a
//! bitmap of what it holds beyond the gap), echoing the nonce of the last
//! packet it acknowledges, so that only who saw that packet can
//! acknowledge it. A REQUEST is finished by its RESPONSE, which also
//! acknowledges everything up to it; a lost response is recovered by
//! retransmitting the request (the target answers a duplicate from its
//! cache, see [`super::serve`]).
//!
//! Timers are computed from the `now` (µs, any monotonic origin) the
//! caller passes; [`Sender::next_deadline`] and [`Receiver::next_deadline`]
//! say when to call again. Retransmission starts at `rto_initial_us`,
//! doubles per timeout without progress up to `rto_max_us`, and after
//! `retry_limit` such timeouts the flow fails as RC does: the oldest
//! unfinished work request completes with `IBV_WC_RETRY_EXC_ERR`, the rest
//! flushed.
//!
//! A receiver with a source ([`Receiver::with_source`]) admits a message
//! at its first segment only within what that GID may make the process
//! hold ([`super::budget`], `hold_bytes`); a segment it cannot take yet is
//! answered with an RNR ACK, and its sender waits a timeout and sends it
//! again without counting a retry (the peer answered: it is alive), as
//! an RC sender waits out RNR NAKs.

use super::budget::Reservation;
use super::wire::{self, Ack, Data, Message, OneSided, Request, Response, Route, SendOp, Status, ATOMIC_LEN};
use crate::error::{Errno, Result};
use std::collections::{BTreeMap, VecDeque};

/// The most packets in flight per flow: the receiver's reordering buffer,
/// the ACK's bitmap (64 bits past the gap) and the target's cache of
/// answers are all sized for it.
pub const WINDOW: u64 = 64;

/// The longest wait of a sender refused with RNR before it sends again.
const RNR_MAX_US: u64 = 10_000;

/// A flow's parameters (both ends must agree on none of them but
/// [`WINDOW`]).
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Largest datagram (UD payload, GRH excluded) of the path:
    /// [`wire::MIN_MTU`]..=[`wire::MAX_MTU`].
    pub mtu: usize,
    /// Packets in flight, 1..=[`WINDOW`].
    pub window: u64,
    /// Work requests posted and not completed (the send queue's depth):
    /// one more is ENOMEM, as a full send queue.
    pub max_queued: usize,
    /// The largest two-sided message the receiver reassembles (a larger
    /// one is malformed): the VQP's `max_msg_size`.
    pub max_message: u32,
    /// The timeout before the first round trip was measured.
    pub rto_initial_us: u64,
    /// The smallest timeout a measured round trip may give.
    pub rto_min_us: u64,
    pub rto_max_us: u64,
    /// Timeouts in a row without progress before the flow fails.
    pub retry_limit: u32,
    /// The receiver acknowledges at the latest this long after delivering
    /// (below `rto_initial_us`), or after `ack_every` packets, or at once
    /// when asked or on a gap or a duplicate.
    pub ack_delay_us: u64,
    pub ack_every: u32,
    /// A flow whose peer never answered fails this long after its first
    /// packet left (0: only `retry_limit` bounds it): first contact with
    /// a process that is gone or stopped ends as a handshake would.
    pub first_contact_us: u64,
    /// A flow out of retries (or past first contact) goes on while its
    /// peer is vouched for ([`Sender::vouch`]: alive as its host finds
    /// out, but slow to answer, e.g. starved of CPU), or while a proof
    /// asked for ([`Sender::take_doubt`]) may still come (`proof_wait_us`),
    /// and at most this long after it first ran out (0: it fails at once).
    pub live_bound_us: u64,
    pub proof_wait_us: u64,
    /// What the messages of one source GID may hold in this process
    /// (bytes; 0: no bound), for receivers with a source.
    pub hold_bytes: u64,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            mtu: 1024,
            window: 32,
            max_queued: 256,
            max_message: 1 << 30,
            rto_initial_us: 2_000,
            rto_min_us: 100,
            rto_max_us: 100_000,
            retry_limit: 7,
            ack_delay_us: 200,
            ack_every: 8,
            first_contact_us: 0,
            live_bound_us: 0,
            proof_wait_us: 0,
            hold_bytes: 0,
        }
    }
}

impl Config {
    fn valid(&self) -> bool {
        (wire::MIN_MTU..=wire::MAX_MTU).contains(&self.mtu)
            && (1..=WINDOW).contains(&self.window)
            && self.max_queued > 0
            && self.rto_initial_us > 0
            && self.rto_min_us > 0
            && self.rto_max_us >= self.rto_initial_us
            && self.rto_max_us >= self.rto_min_us
            && self.ack_every > 0
            // A delayed ACK must beat the first retransmission.
            && self.ack_delay_us < self.rto_initial_us
    }
}

/// Nonces: splitmix64 over a secret seed, so that a node off the path
/// cannot guess them (not against one that sees the traffic).
#[derive(Debug)]
struct Nonces(u64);

impl Nonces {
    fn next(&mut self) -> u64 {
        loop {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            // 0 is the ACK's "no packet".
            if z != 0 {
                return z;
            }
        }
    }
}

/// A seed from the OS's randomness (std's hasher keys), for [`Sender::new`].
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x6b72_636f_7265);
    h.finish()
}

/// What an atomic does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Atomic {
    CmpSwp { compare: u64, swap: u64 },
    FetchAdd { add: u64 },
}

/// How a work request ended; [`Outcome::wc_status`] is its
/// `ibv_wc_status`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A SEND or WRITE, acknowledged.
    Done,
    /// A READ's data.
    Read(Vec<u8>),
    /// An atomic's original value.
    Atomic(u64),
    /// The target refused the request.
    Remote(Status),
    /// No progress after `retry_limit` retransmissions.
    RetryExceeded,
    /// Posted behind a failed one.
    Flushed,
}

impl Outcome {
    pub fn wc_status(&self) -> u32 {
        use crate::sys::ibv_wc_status as S;
        match self {
            Outcome::Done | Outcome::Read(_) | Outcome::Atomic(_) => S::IBV_WC_SUCCESS,
            Outcome::Remote(s) => s.wc_status(),
            Outcome::RetryExceeded => S::IBV_WC_RETRY_EXC_ERR,
            Outcome::Flushed => S::IBV_WC_WR_FLUSH_ERR,
        }
    }
}

/// A finished work request, in post order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The caller's id (its `wr_id`).
    pub id: u64,
    pub outcome: Outcome,
}

#[derive(Debug)]
struct Packet {
    seq: u64,
    nonce: u64,
    /// Encoded; its ACK_REQ flag is set per transmission.
    bytes: Vec<u8>,
    sent: bool,
    /// When it was first sent (µs), and whether it was sent again: only a
    /// packet sent once gives a round-trip sample (Karn).
    sent_at: u64,
    resent: bool,
    /// Held by the receiver past its gap (from an ACK's bitmap).
    sacked: bool,
    /// A RESPONSE finishes it (READ, atomics, a WRITE's last segment).
    needs_response: bool,
    answered: bool,
}

#[derive(Debug)]
enum Pending {
    Send,
    Write,
    Read { seg: u32, data: Vec<u8>, got: Vec<bool>, missing: usize },
    Atomic(OneSided),
}

#[derive(Debug)]
struct Work {
    id: u64,
    /// The sequence number of its last packet.
    last_seq: u64,
    pending: Pending,
    outcome: Option<Outcome>,
}

/// What a sender or receiver refused, for the caller's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Drops {
    /// Not this flow's route (another incarnation, a forged source).
    pub wrong_route: u64,
    /// An ACK or RESPONSE whose nonce or sequence matches nothing
    /// outstanding: a forgery, or a late copy (the answer of a request
    /// retransmitted after its first answer was only delayed).
    pub unmatched: u64,
    /// A packet already delivered (a retransmission).
    pub duplicate: u64,
    /// Too far ahead of the receiver's window.
    pub out_of_window: u64,
    /// Well-formed messages that break the protocol (a segment out of
    /// its message, a READ segment off its grid).
    pub malformed: u64,
    /// Receiver: packets answered RNR (their source's budget was spent).
    /// Sender: RNR ACKs taken (the peer was not ready).
    pub rnr: u64,
}

/// The source end of a flow.
#[derive(Debug)]
pub struct Sender {
    cfg: Config,
    /// Our packets' route (the peer's ACKs and RESPONSEs come reversed).
    route: Route,
    nonces: Nonces,
    next_seq: u64,
    next_msg: u32,
    /// Unfinished packets from the oldest, in sequence order.
    packets: VecDeque<Packet>,
    /// (seq, nonce) of the last packet that left `packets`.
    last_finished: Option<(u64, u64)>,
    /// Everything below was acknowledged.
    acked_to: u64,
    work: VecDeque<Work>,
    done: VecDeque<Completion>,
    rto_us: u64,
    /// The timeout after progress: the smoothed round trip plus four
    /// deviations (RFC 6298), within `rto_initial_us..=rto_max_us`, so
    /// that a slow path (a loaded host) does not retransmit on the first
    /// try.
    base_rto_us: u64,
    srtt_us: Option<u64>,
    rttvar_us: u64,
    retries: u32,
    deadline: Option<u64>,
    /// When the first packet left, while the peer has not answered yet.
    unanswered_since: Option<u64>,
    /// When the peer last answered (µs).
    heard_at: Option<u64>,
    /// The peer refused our oldest packet for now (RNR): the next timeout
    /// resends it without counting a retry.
    rnr_wait: bool,
    /// Since the peer last moved: when the flow first ran out of retries
    /// (`live_bound_us` counts from there), when the current doubt began
    /// (a proof is due within `proof_wait_us`), whether the port asked
    /// for that proof, and until when the peer is vouched for.
    out_of_retries_at: Option<u64>,
    doubt_since: Option<u64>,
    doubt_told: bool,
    vouched_until: u64,
    failed: bool,
    pub drops: Drops,
}

impl Sender {
    /// A flow on `route` (ours to the peer VQP); `seed` keys its nonces
    /// ([`random_seed`]). EINVAL for a config out of its ranges.
    pub fn new(cfg: Config, route: Route, seed: u64) -> Result<Sender> {
        if !cfg.valid() {
            return Err(Errno::EINVAL);
        }
        Ok(Sender {
            cfg,
            route,
            nonces: Nonces(seed),
            next_seq: 0,
            next_msg: 0,
            packets: VecDeque::new(),
            last_finished: None,
            acked_to: 0,
            work: VecDeque::new(),
            done: VecDeque::new(),
            rto_us: cfg.rto_initial_us,
            base_rto_us: cfg.rto_initial_us,
            srtt_us: None,
            rttvar_us: 0,
            retries: 0,
            deadline: None,
            unanswered_since: None,
            heard_at: None,
            rnr_wait: false,
            out_of_retries_at: None,
            doubt_since: None,
            doubt_told: false,
            vouched_until: 0,
            failed: false,
            drops: Drops::default(),
        })
    }

    /// Whether the flow failed (then every work request posted completes
    /// flushed, as on an RC QP in the error state; requests posted before
    /// a refused one still get their answers).
    pub fn failed(&self) -> bool {
        self.failed
    }

    /// When the peer last answered (µs, the clock `now` is read from).
    pub fn heard_at(&self) -> Option<u64> {
        self.heard_at
    }

    /// Work requests posted and not completed.
    pub fn outstanding(&self) -> usize {
        self.work.len()
    }

    /// A SEND (`opcode`, `imm`) of `data`. ENOMEM when `max_queued` work
    /// requests are outstanding, EINVAL when `data` is longer than 2^32-1.
    pub fn post_send(&mut self, id: u64, opcode: SendOp, imm: u32, data: &[u8]) -> Result<()> {
        let total_len = self.admit(data.len())?;
        if self.flush_if_failed(id) {
            return Ok(());
        }
        let imm = if opcode == SendOp::SendImm { imm } else { 0 };
        let room = self.cfg.mtu - wire::DATA_HDR;
        let nsegs = data.len().div_ceil(room).max(1) as u32;
        let msg = self.next_msg;
        self.next_msg = msg.wrapping_add(1);
        for seg in 0..nsegs {
            let payload = data.chunks(room).nth(seg as usize).unwrap_or(&[]);
            let (seq, nonce) = self.number();
            let m = Data { route: self.route, seq, nonce, ack_req: false, msg, total_len, seg, nsegs, opcode, imm, payload };
            self.push(seq, nonce, Message::Data(m).to_vec(), false);
        }
        self.queue(id, Pending::Send);
        Ok(())
    }

    /// A READ of `len` bytes at `remote_addr` under `rkey`.
    pub fn post_read(&mut self, id: u64, rkey: u32, remote_addr: u64, len: u32) -> Result<()> {
        self.admit(len as usize)?;
        if self.flush_if_failed(id) {
            return Ok(());
        }
        let seg = (self.cfg.mtu - wire::RESPONSE_HDR) as u32;
        let segs = (len.div_ceil(seg) as usize).max(1);
        let (seq, nonce) = self.number();
        let r = Request { resp_seg: seg, ..self.request(seq, nonce, OneSided::Read, rkey, remote_addr, len) };
        self.push(seq, nonce, Message::Request(r).to_vec(), true);
        self.queue(id, Pending::Read { seg, data: vec![0; len as usize], got: vec![false; segs], missing: segs });
        Ok(())
    }

    /// A WRITE of `data` to `remote_addr` under `rkey`.
    pub fn post_write(&mut self, id: u64, rkey: u32, remote_addr: u64, data: &[u8]) -> Result<()> {
        let length = self.admit(data.len())?;
        if self.flush_if_failed(id) {
            return Ok(());
        }
        let room = self.cfg.mtu - wire::REQUEST_HDR;
        let nsegs = data.len().div_ceil(room).max(1);
        for i in 0..nsegs {
            let payload = data.chunks(room).nth(i).unwrap_or(&[]);
            let (seq, nonce) = self.number();
            let r = Request { offset: (i * room) as u32, payload, ..self.request(seq, nonce, OneSided::Write, rkey, remote_addr, length) };
            self.push(seq, nonce, Message::Request(r).to_vec(), i + 1 == nsegs);
        }
        self.queue(id, Pending::Write);
        Ok(())
    }

    /// An 8-byte atomic at `remote_addr` under `rkey` (the target checks
    /// its alignment).
    pub fn post_atomic(&mut self, id: u64, atomic: Atomic, rkey: u32, remote_addr: u64) -> Result<()> {
        self.admit(0)?;
        if self.flush_if_failed(id) {
            return Ok(());
        }
        let (seq, nonce) = self.number();
        let base = |op| self.request(seq, nonce, op, rkey, remote_addr, ATOMIC_LEN);
        let r = match atomic {
            Atomic::CmpSwp { compare, swap } => Request { compare_add: compare, swap, ..base(OneSided::CmpSwp) },
            Atomic::FetchAdd { add } => Request { compare_add: add, ..base(OneSided::FetchAdd) },
        };
        self.push(seq, nonce, Message::Request(r).to_vec(), true);
        self.queue(id, Pending::Atomic(r.op));
        Ok(())
    }

    fn admit(&self, len: usize) -> Result<u32> {
        if self.work.len() >= self.cfg.max_queued {
            return Err(Errno::ENOMEM);
        }
        u32::try_from(len).map_err(|_| Errno::EINVAL)
    }

    /// After a failure a new work request completes flushed at once.
    fn flush_if_failed(&mut self, id: u64) -> bool {
        if self.failed {
            self.done.push_back(Completion { id, outcome: Outcome::Flushed });
        }
        self.failed
    }

    fn number(&mut self) -> (u64, u64) {
        let seq = self.next_seq;
        self.next_seq += 1;
        (seq, self.nonces.next())
    }

    fn request(&self, seq: u64, nonce: u64, op: OneSided, rkey: u32, remote_addr: u64, length: u32) -> Request<'static> {
        Request::new(self.route, seq, nonce, op, rkey, remote_addr, length)
    }

    fn push(&mut self, seq: u64, nonce: u64, bytes: Vec<u8>, needs_response: bool) {
        self.packets.push_back(Packet {
            seq,
            nonce,
            bytes,
            sent: false,
            sent_at: 0,
            resent: false,
            sacked: false,
            needs_response,
            answered: false,
        });
    }

    fn queue(&mut self, id: u64, pending: Pending) {
        self.work.push_back(Work { id, last_seq: self.next_seq - 1, pending, outcome: None });
    }

    /// The timeout the measured round trips give (None before any), for
    /// the first timeout of a new flow to the same place.
    pub fn measured_rto(&self) -> Option<u64> {
        self.srtt_us.map(|_| self.base_rto_us)
    }

    /// When [`Sender::poll`] must run again (a retransmission timer).
    pub fn next_deadline(&self) -> Option<u64> {
        self.deadline
    }

    /// The datagrams to send now: retransmissions if the timer expired,
    /// then new packets the window admits (the last of a burst asks for an
    /// ACK).
    pub fn poll(&mut self, now: u64) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        if self.deadline.is_some_and(|d| d <= now) {
            self.timeout(now, &mut out);
        }
        let Some(base) = self.packets.front().map(|p| p.seq) else { return out };
        let first_new = out.len();
        for p in self.packets.iter_mut().take_while(|p| p.seq < base + self.cfg.window).filter(|p| !p.sent) {
            p.sent = true;
            p.sent_at = now;
            wire::set_ack_req(&mut p.bytes, false);
            out.push(p.bytes.clone());
        }
        if let Some(last) = out.get_mut(first_new..).and_then(|s| s.last_mut()) {
            wire::set_ack_req(last, true);
        }
        if out.len() > first_new {
            if self.heard_at.is_none() && self.unanswered_since.is_none() {
                self.unanswered_since = Some(now);
            }
            if self.deadline.is_none() {
                self.arm(now);
            }
        }
        out
    }

    /// The next timeout, `rto_us` from `now`, and at the latest the end
    /// of first contact.
    fn arm(&mut self, now: u64) {
        let mut at = now + self.rto_us;
        if let (Some(since), true) = (self.unanswered_since, self.cfg.first_contact_us > 0) {
            // (Once over, a first contact that goes on times out as any.)
            if since + self.cfg.first_contact_us > now {
                at = at.min(since + self.cfg.first_contact_us);
            }
        }
        self.deadline = Some(at);
    }

    /// The timer expired: fail after `retry_limit` timeouts in a row, else
    /// resend what the peer has not shown it has, and back off.
    fn timeout(&mut self, now: u64, out: &mut Vec<Vec<u8>>) {
        let rnr = std::mem::take(&mut self.rnr_wait);
        if !rnr {
            self.retries += 1;
        }
        let first_contact_over =
            self.cfg.first_contact_us > 0 && self.unanswered_since.is_some_and(|t| now >= t + self.cfg.first_contact_us);
        if (self.retries > self.cfg.retry_limit || first_contact_over) && !self.goes_on(now) {
            self.fail(Outcome::RetryExceeded);
            return;
        }
        let acked_to = self.acked_to;
        for p in self.packets.iter_mut().filter(|p| p.sent) {
            let resend = if p.seq < acked_to { p.needs_response && !p.answered } else { p.seq == acked_to || !p.sacked };
            if resend {
                p.resent = true;
                wire::set_ack_req(&mut p.bytes, true);
                out.push(p.bytes.clone());
            }
        }
        // Not ready is not lost: look again soon (RC's RNR timer).
        let cap = if rnr { RNR_MAX_US.max(self.base_rto_us) } else { self.cfg.rto_max_us };
        self.rto_us = (self.rto_us * 2).min(cap);
        self.arm(now);
    }

    /// Out of retries: whether to go on (see `Config::live_bound_us`).
    fn goes_on(&mut self, now: u64) -> bool {
        if self.cfg.live_bound_us == 0 || now >= *self.out_of_retries_at.get_or_insert(now) + self.cfg.live_bound_us {
            return false;
        }
        if now < self.vouched_until {
            return true;
        }
        now < *self.doubt_since.get_or_insert(now) + self.cfg.proof_wait_us
    }

    /// Whether the flow began doubting its peer since this was last asked
    /// (once per doubt): the port then asks for a proof of life.
    pub fn take_doubt(&mut self) -> bool {
        let new = self.doubt_since.is_some() && !self.doubt_told && !self.failed;
        self.doubt_told |= new;
        new
    }

    /// The peer is alive as far as its host can tell, until `until` (µs):
    /// the flow goes on retrying meanwhile. None: no proof (its binding is
    /// gone, or nothing can tell): a flow in doubt fails now.
    pub fn vouch(&mut self, until: Option<u64>) {
        match until {
            Some(t) => {
                self.vouched_until = t;
                self.doubt_since = None;
                self.doubt_told = false;
            }
            None if self.doubt_since.is_some() && !self.failed => self.fail(Outcome::RetryExceeded),
            None => {}
        }
    }

    /// The oldest unfinished work request ends with `first`, the rest are
    /// flushed; the flow sends nothing more.
    fn fail(&mut self, first: Outcome) {
        self.failed = true;
        self.packets.clear();
        self.deadline = None;
        let mut first = Some(first);
        for w in self.work.iter_mut().filter(|w| w.outcome.is_none()) {
            w.outcome = Some(first.take().unwrap_or(Outcome::Flushed));
        }
        self.complete();
    }

    /// An ACK or RESPONSE that came on the reverse of our route.
    pub fn on_message(&mut self, now: u64, m: &Message) {
        if *m.route() != self.route.reverse() {
            self.drops.wrong_route += 1;
            return;
        }
        match m {
            Message::Ack(a) => self.on_ack(now, a),
            Message::Response(r) => self.on_response(now, r),
            // A flow's own kinds go to the peer's receiver, not here.
            Message::Data(_) | Message::Request(_) => self.drops.unmatched += 1,
        }
    }

    /// A round-trip sample from packet `seq`'s answer, if it was sent once.
    fn sample(&mut self, now: u64, seq: u64) {
        let Some(front) = self.packets.front().map(|p| p.seq) else { return };
        let Some(p) = seq.checked_sub(front).and_then(|i| self.packets.get(i as usize)) else { return };
        if !p.sent || p.resent {
            return;
        }
        let r = now.saturating_sub(p.sent_at);
        let (srtt, var) = match self.srtt_us {
            None => (r, r / 2),
            Some(s) => ((7 * s + r) / 8, (3 * self.rttvar_us + s.abs_diff(r)) / 4),
        };
        self.srtt_us = Some(srtt);
        self.rttvar_us = var;
        self.base_rto_us = (srtt + 4 * var).clamp(self.cfg.rto_min_us, self.cfg.rto_max_us);
    }

    fn nonce_of(&self, seq: u64) -> Option<u64> {
        match self.packets.front() {
            Some(front) if seq >= front.seq => self.packets.get((seq - front.seq) as usize).map(|p| p.nonce),
            _ => self.last_finished.filter(|&(s, _)| s == seq).map(|(_, n)| n),
        }
    }

    fn on_ack(&mut self, now: u64, a: &Ack) {
        if a.next < self.acked_to {
            // Overtaken by a later ACK or a response: nothing to learn.
            return;
        }
        let sent_to = self.packets.iter().rev().find(|p| p.sent).map_or(self.acked_to, |p| p.seq + 1);
        let genuine = a.next == 0 || (a.next <= sent_to && self.nonce_of(a.next - 1) == Some(a.nonce));
        if !genuine {
            self.drops.unmatched += 1;
            return;
        }
        if a.rnr {
            // Only who saw packet `next` can refuse it.
            let refused = self.packets.iter().find(|p| p.seq == a.next).is_some_and(|p| p.sent && p.nonce == a.sack);
            if !refused {
                self.drops.unmatched += 1;
                return;
            }
            self.drops.rnr += 1;
            self.acked(now, a.next);
            // Alive but not ready: wait a timeout (backing off as for a
            // loss), then send it again; no retry is counted.
            self.retries = 0;
            self.trusted_again();
            self.heard_at = Some(now);
            self.unanswered_since = None;
            self.rnr_wait = true;
            self.rto_us = self.rto_us.min(RNR_MAX_US.max(self.base_rto_us));
            self.arm(now);
            return;
        }
        for p in self.packets.iter_mut().filter(|p| p.seq > a.next && p.seq <= a.next + 64) {
            p.sacked |= a.sack >> (p.seq - a.next - 1) & 1 != 0;
        }
        if a.next > self.acked_to {
            self.sample(now, a.next - 1);
        }
        self.acked(now, a.next);
    }

    /// Everything below `to` arrived.
    fn acked(&mut self, now: u64, to: u64) {
        if to > self.acked_to {
            self.acked_to = to;
            self.progress(now);
        }
    }

    /// The peer moved: no more doubt.
    fn trusted_again(&mut self) {
        self.out_of_retries_at = None;
        self.doubt_since = None;
        self.doubt_told = false;
    }

    /// The peer moved: the next timeout starts afresh.
    fn progress(&mut self, now: u64) {
        self.retries = 0;
        self.trusted_again();
        self.heard_at = Some(now);
        self.unanswered_since = None;
        self.rto_us = self.base_rto_us;
        self.complete();
        self.deadline = (!self.packets.is_empty() && self.packets.front().is_some_and(|p| p.sent)).then_some(now + self.rto_us);
    }

    fn on_response(&mut self, now: u64, r: &Response) {
        let matched = self.packets.iter().position(|p| p.seq == r.seq && p.nonce == r.nonce && p.needs_response && !p.answered);
        let work = self.work.iter().position(|w| w.last_seq >= r.seq);
        let (Some(i), Some(w)) = (matched, work) else {
            self.drops.unmatched += 1;
            return;
        };
        let kind_matches = match &self.work[w].pending {
            Pending::Read { .. } => r.op == OneSided::Read,
            Pending::Write => r.op == OneSided::Write,
            Pending::Atomic(op) => r.op == *op,
            Pending::Send => false,
        };
        if !kind_matches {
            self.drops.malformed += 1;
            return;
        }
        self.sample(now, r.seq);
        self.heard_at = Some(now);
        self.unanswered_since = None;
        if r.status != Status::Ok {
            self.packets[i].answered = true;
            self.work[w].outcome = Some(Outcome::Remote(r.status));
            // As RC: everything after the refused request is flushed.
            self.packets.retain(|p| p.seq <= r.seq);
            for later in self.work.iter_mut().skip(w + 1) {
                later.outcome = Some(Outcome::Flushed);
            }
            // Requests before it may still wait for their answers.
            self.failed = true;
            self.acked_to = self.acked_to.max(r.seq + 1);
            self.progress(now);
            return;
        }
        let finished = match &mut self.work[w].pending {
            Pending::Read { seg, data, got, missing } => {
                let at = r.offset as usize;
                let want = (data.len() - at.min(data.len())).min(*seg as usize);
                let on_grid = (at < data.len() || at == 0) && at % *seg as usize == 0;
                let ok = r.length as usize == data.len() && on_grid && r.payload.len() == want;
                if !ok {
                    self.drops.malformed += 1;
                    return;
                }
                let k = at / *seg as usize;
                if !got[k] {
                    got[k] = true;
                    *missing -= 1;
                    data[at..at + want].copy_from_slice(r.payload);
                }
                (*missing == 0).then(|| Outcome::Read(std::mem::take(data)))
            }
            Pending::Atomic(_) => Some(Outcome::Atomic(r.value)),
            Pending::Write => Some(Outcome::Done),
            Pending::Send => None,
        };
        if let Some(outcome) = finished {
            self.packets[i].answered = true;
            self.work[w].outcome = Some(outcome);
        }
        // A response means the target took every packet up to the request.
        if r.seq + 1 > self.acked_to {
            self.acked_to = r.seq + 1;
        }
        self.progress(now);
    }

    /// Drop finished packets from the front, and complete work requests
    /// in post order.
    fn complete(&mut self) {
        for w in self.work.iter_mut().filter(|w| w.outcome.is_none()) {
            if matches!(w.pending, Pending::Send) && w.last_seq < self.acked_to {
                w.outcome = Some(Outcome::Done);
            }
        }
        while let Some(p) = self.packets.front() {
            if p.seq >= self.acked_to || (p.needs_response && !p.answered) {
                break;
            }
            self.last_finished = Some((p.seq, p.nonce));
            self.packets.pop_front();
        }
        while self.work.front().is_some_and(|w| w.outcome.is_some()) {
            let w = self.work.pop_front().expect("front checked");
            self.done.push_back(Completion { id: w.id, outcome: w.outcome.expect("checked") });
        }
    }

    /// The next completion, in post order.
    pub fn pop_completion(&mut self) -> Option<Completion> {
        self.done.pop_front()
    }
}

/// What a receiver hands up, in flow order.
#[derive(Debug, PartialEq, Eq)]
pub enum Delivery {
    /// A whole two-sided message, and its bytes held against its source
    /// GID while it is held here (a receiver with a source).
    Message { opcode: SendOp, imm: u32, data: Vec<u8>, held: Option<Reservation> },
    /// A one-sided request packet, encoded ([`Delivery::request`]), for
    /// [`super::serve::Responder::serve`].
    Request(Vec<u8>),
}

impl Delivery {
    /// The request packet, if this is one.
    pub fn request(&self) -> Option<Request<'_>> {
        match self {
            Delivery::Request(b) => match Message::decode(b) {
                Ok(Message::Request(r)) => Some(r),
                _ => None,
            },
            Delivery::Message { .. } => None,
        }
    }
}

/// What [`Receiver::on_message`] did with a packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Received {
    /// Taken (delivered now or buffered until the gap before it fills).
    Taken,
    /// A request packet delivered before: answer it again
    /// ([`super::serve::Responder::serve_duplicate`]).
    DuplicateRequest,
    /// Dropped and counted in [`Receiver::drops`].
    Dropped,
    /// Not taken for now: its source's budget is spent (the next ACK says
    /// RNR; counted in `drops.rnr`).
    Rnr,
}

#[derive(Debug)]
struct Partial {
    /// Its bytes, held against its source GID (a receiver with a source).
    held: Option<Reservation>,
    msg: u32,
    opcode: SendOp,
    imm: u32,
    total_len: u32,
    nsegs: u32,
    next_seg: u32,
    data: Vec<u8>,
}

/// The destination end of a flow.
#[derive(Debug)]
pub struct Receiver {
    cfg: Config,
    /// The flow's route as its packets carry it (peer -> us).
    route: Route,
    next: u64,
    last_nonce: u64,
    /// The nonce of the flow's first packet (sequence number 0).
    first_nonce: Option<u64>,
    /// Packets past the gap, encoded.
    ahead: BTreeMap<u64, Vec<u8>>,
    partial: Option<Partial>,
    ready: VecDeque<Delivery>,
    /// The GID whose budget admits messages ([`Receiver::with_source`]).
    source: Option<[u8; 16]>,
    /// (seq, nonce) of the packet refused for now: the next ACK says RNR.
    rnr: Option<(u64, u64)>,
    unacked: u32,
    ack_now: bool,
    ack_deadline: Option<u64>,
    failed: bool,
    pub drops: Drops,
}

impl Receiver {
    /// The flow whose packets carry `route` (the peer's VQP to ours).
    pub fn new(cfg: Config, route: Route) -> Result<Receiver> {
        if !cfg.valid() {
            return Err(Errno::EINVAL);
        }
        Ok(Receiver {
            cfg,
            route,
            next: 0,
            last_nonce: 0,
            first_nonce: None,
            ahead: BTreeMap::new(),
            partial: None,
            ready: VecDeque::new(),
            source: None,
            rnr: None,
            unacked: 0,
            ack_now: false,
            ack_deadline: None,
            failed: false,
            drops: Drops::default(),
        })
    }

    /// Messages are admitted within the budget of the GID `gid` they come
    /// from ([`super::budget`], `hold_bytes`).
    pub fn with_source(mut self, gid: [u8; 16]) -> Receiver {
        self.source = Some(gid);
        self
    }

    /// A DATA or REQUEST packet of the flow.
    pub fn on_message(&mut self, now: u64, m: &Message) -> Received {
        let (seq, ack_req) = match m {
            Message::Data(d) => (d.seq, d.ack_req),
            Message::Request(r) => (r.seq, r.ack_req),
            Message::Ack(_) | Message::Response(_) => {
                self.drops.unmatched += 1;
                return Received::Dropped;
            }
        };
        if *m.route() != self.route {
            self.drops.wrong_route += 1;
            return Received::Dropped;
        }
        self.ack_now |= ack_req;
        if seq < self.next {
            self.drops.duplicate += 1;
            self.ack_now = true;
            return if matches!(m, Message::Request(_)) { Received::DuplicateRequest } else { Received::Dropped };
        }
        if self.failed {
            return Received::Dropped;
        }
        if seq >= self.next + WINDOW {
            self.drops.out_of_window += 1;
            self.ack_now = true;
            return Received::Dropped;
        }
        if seq > self.next {
            // A gap: tell the sender at once what is missing.
            self.ack_now = true;
            if self.ahead.insert(seq, m.to_vec()).is_some() {
                self.drops.duplicate += 1;
            }
            return Received::Taken;
        }
        if !self.deliver(now, m) {
            return Received::Rnr;
        }
        while let Some(bytes) = self.ahead.remove(&self.next) {
            // Encoded from a decoded message: it decodes again.
            // (Only a first segment that does not fit is not delivered.)
            if !Message::decode(&bytes).is_ok_and(|m| self.deliver(now, &m)) {
                self.ahead.insert(self.next, bytes);
                break;
            }
        }
        Received::Taken
    }

    /// Whether `m` was delivered; false when its message's first segment
    /// does not fit its source's budget (then the next ACK says RNR).
    fn deliver(&mut self, now: u64, m: &Message) -> bool {
        match m {
            Message::Data(d) => {
                let held = match (self.source, d.seg) {
                    (Some(gid), 0) => match super::budget::reserve(&gid, d.total_len.into(), self.cfg.hold_bytes) {
                        Some(r) => Some(r),
                        None => {
                            self.drops.rnr += 1;
                            self.rnr = Some((d.seq, d.nonce));
                            self.ack_now = true;
                            return false;
                        }
                    },
                    _ => None,
                };
                self.next = d.seq + 1;
                self.last_nonce = d.nonce;
                self.first_nonce.get_or_insert(d.nonce);
                self.reassemble(d, held);
            }
            Message::Request(r) => {
                self.next = r.seq + 1;
                self.last_nonce = r.nonce;
                self.first_nonce.get_or_insert(r.nonce);
                self.ready.push_back(Delivery::Request(m.to_vec()));
            }
            Message::Ack(_) | Message::Response(_) => return false,
        }
        self.unacked += 1;
        if self.unacked >= self.cfg.ack_every {
            self.ack_now = true;
        } else if self.ack_deadline.is_none() {
            self.ack_deadline = Some(now + self.cfg.ack_delay_us);
        }
        true
    }

    /// Appends a segment to its message; a message ends at its last
    /// segment with exactly its length. A segment out of place drops the
    /// message it would belong to.
    fn reassemble(&mut self, d: &Data, held: Option<Reservation>) {
        if d.seg == 0 {
            if self.partial.take().is_some() {
                self.drops.malformed += 1;
            }
            if d.total_len > self.cfg.max_message {
                self.drops.malformed += 1;
                return;
            }
            self.partial = Some(Partial {
                held,
                msg: d.msg,
                opcode: d.opcode,
                imm: d.imm,
                total_len: d.total_len,
                nsegs: d.nsegs,
                next_seg: 0,
                data: Vec::new(),
            });
        }
        let fits = self.partial.as_ref().is_some_and(|p| {
            (p.msg, p.opcode, p.imm, p.total_len, p.nsegs, p.next_seg) == (d.msg, d.opcode, d.imm, d.total_len, d.nsegs, d.seg)
                && p.data.len() + d.payload.len() <= p.total_len as usize
        });
        if !fits {
            self.drops.malformed += 1;
            self.partial = None;
            return;
        }
        let Some(p) = self.partial.as_mut() else { return };
        p.data.extend_from_slice(d.payload);
        p.next_seg += 1;
        if p.next_seg == p.nsegs {
            let p = self.partial.take().expect("just used");
            if p.data.len() == p.total_len as usize {
                self.ready.push_back(Delivery::Message { opcode: p.opcode, imm: p.imm, data: p.data, held: p.held });
            } else {
                self.drops.malformed += 1;
            }
        }
    }

    /// The next message or request, in flow order.
    pub fn pop(&mut self) -> Option<Delivery> {
        self.ready.pop_front()
    }

    /// The target refused a request: as an RC responder in the error
    /// state, deliver nothing more (duplicates of what was delivered are
    /// still answered, from the cache).
    pub fn fail(&mut self) {
        self.failed = true;
        self.ready.clear();
        self.ahead.clear();
        self.partial = None;
    }

    pub fn failed(&self) -> bool {
        self.failed
    }

    /// Request `seq` was answered: its RESPONSE tells the sender that
    /// everything up to it arrived (as an RC READ response does), so no
    /// ACK is due for what was delivered, unless something came after it
    /// or a gap waits to be reported.
    pub fn answered(&mut self, seq: u64) {
        if seq + 1 == self.next && self.ahead.is_empty() {
            self.ack_now = false;
            self.ack_deadline = None;
            self.unacked = 0;
        }
    }

    /// How far the flow was delivered: the next sequence number expected,
    /// and the nonce an ACK up to it echoes.
    pub fn position(&self) -> (u64, u64) {
        (self.next, if self.next == 0 { 0 } else { self.last_nonce })
    }

    /// Packets held past a gap.
    pub fn ahead(&self) -> usize {
        self.ahead.len()
    }

    /// Whether `m` would be held past a gap (neither delivered nor
    /// dropped as a duplicate or out of the window).
    pub fn would_hold(&self, m: &Message) -> bool {
        let seq = match m {
            Message::Data(d) => d.seq,
            Message::Request(r) => r.seq,
            Message::Ack(_) | Message::Response(_) => return false,
        };
        seq > self.next && seq < self.next + WINDOW && !self.ahead.contains_key(&seq)
    }

    /// The nonce of the flow's first packet, once delivered: a packet with
    /// sequence number 0 and another nonce starts another flow.
    pub fn first_nonce(&self) -> Option<u64> {
        self.first_nonce
    }

    /// When [`Receiver::poll_ack`] must run again (a delayed ACK).
    pub fn next_deadline(&self) -> Option<u64> {
        if self.ack_now {
            Some(0)
        } else {
            self.ack_deadline
        }
    }

    /// The ACK of everything received so far, due or not (a VQP that goes
    /// hands it to its peer inside its CLOSE).
    pub fn final_ack(&mut self) -> Vec<u8> {
        self.ack_now = true;
        self.poll_ack(0).unwrap_or_default()
    }

    /// The ACK to send now, if one is due.
    pub fn poll_ack(&mut self, now: u64) -> Option<Vec<u8>> {
        if !self.ack_now && self.ack_deadline.is_none_or(|d| d > now) {
            return None;
        }
        self.ack_now = false;
        self.ack_deadline = None;
        self.unacked = 0;
        let nonce = if self.next == 0 { 0 } else { self.last_nonce };
        if let Some((_, refused)) = self.rnr.take().filter(|&(seq, _)| seq == self.next) {
            return Some(Message::Ack(Ack { route: self.route.reverse(), next: self.next, nonce, sack: refused, rnr: true }).to_vec());
        }
        // Held packets are past `next` (the gap).
        let sack = self.ahead.keys().filter_map(|s| s.checked_sub(self.next + 1)).filter(|&i| i < 64).fold(0u64, |b, i| b | 1 << i);
        Some(Message::Ack(Ack { route: self.route.reverse(), next: self.next, nonce, sack, rnr: false }).to_vec())
    }
}

#[cfg(test)]
#[path = "reliable_tests.rs"]
mod tests;
