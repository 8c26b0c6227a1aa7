//! The owner-answered MR check ("ValidMR", issue 20): before a VQP posts
//! a one-sided WR with an rkey of its peer that it has not checked (or
//! whose lease ran out), it asks the peer over their link (a LINK
//! MR_CHECK header, [`super::header`]) with the rkey and the WR's remote
//! address, and the peer's runtime answers from its PD's registry
//! ([`super::mrs`]) with an MR_ANSWER: the MR's range and access if it has
//! an MR under that rkey with the address inside, else that it has none.
//! As with RC, an rkey opens nothing without an address inside its MR:
//! a check tells nothing about an MR to whoever cannot name both.
//!
//! Why not a table the peers READ, as before: whoever could READ it
//! learned every rkey of the PD, MRs it was never given included, and a
//! table keyed by the rkey itself (each entry found and decrypted only with
//! its key) does not help either: rkeys are 32 bits (on rxe an index and 8
//! random bits), so a copy of the table gives them all up to an offline
//! search in seconds. The owner answering a key and an address it is asked
//! about leaks nothing but that MR, and lets the owner bound the guessing.
//!
//! # Guessing
//!
//! A check that finds nothing is a miss; an honest peer misses only for a
//! key deregistered while it used it (or a WR that RC would fail too). Misses are bounded per source GID
//! (the GID a link's packets come from, which the NIC checks against the
//! link's path, so a process cannot claim another's): a token bucket of
//! `KRCORE_MR_CHECK_MISSES` misses a second, as many at once. A GID whose
//! bucket is empty gets every check answered BUSY, found or not (an answer
//! that depended on the key would still tell keys apart), with the time
//! until its next token; the asker waits that long and asks again. The
//! datagram tier's one-sided requests, served against the same registry,
//! take from the same budget ([`crate::transport::dgram`]). At the default
//! of 16 a second, the 2^16 keys a guess at rxe's needs take over an hour
//! per GID; with plain RC, each wrong guess costs a connection, about a
//! millisecond.
//!
//! # A reused rkey
//!
//! After `ibv_dereg_mr` the NIC may give the same rkey to a new MR. A peer
//! never checks a WR against the old MR's bounds while the key names the
//! new one: FOUND means the rkey named that MR when the owner answered,
//! after the asker sent the check; the asker trusts it for the MR lease
//! (`KRCORE_MR_LEASE_MS`) counted from when it sent the check, and the
//! owner takes a deregistered MR out of its registry first and deregisters
//! it for real only a lease (plus a margin) later
//! ([`super::runtime::mr_lease_end`]).

use super::header::{Header, LinkOp};
use super::large::Control;
use super::precheck::MrInfo;
use super::runtime::{connect_timeout, Runtime, TRANSPORT_WAIT};
use crate::clock::coarse_ms;
use crate::error::{Errno, Result};
use crate::klog;
use crate::log::Level;
use crate::rdma::Gid;
use crate::service::Link;
use crate::stats::{self, Stat};
use once_cell::sync::Lazy;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Bytes of an MR_ANSWER's payload, after its header.
pub const ANSWER_LEN: usize = 24;

/// What the owner of an rkey answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    Found(MrInfo),
    Absent,
    /// The asker's GID spent its misses: ask again in `retry_ms`.
    Busy {
        retry_ms: u32,
    },
}

const FOUND: u32 = 0;
const ABSENT: u32 = 1;
const BUSY: u32 = 2;

impl Answer {
    /// `verdict u32 | access or retry_ms u32 | addr u64 | len u64`, little-endian.
    pub fn encode(&self) -> [u8; ANSWER_LEN] {
        let (verdict, word, addr, len) = match *self {
            Answer::Found(mr) => (FOUND, mr.access, mr.addr, mr.len),
            Answer::Absent => (ABSENT, 0, 0, 0),
            Answer::Busy { retry_ms } => (BUSY, retry_ms, 0, 0),
        };
        let mut b = [0; ANSWER_LEN];
        b[0..4].copy_from_slice(&verdict.to_le_bytes());
        b[4..8].copy_from_slice(&word.to_le_bytes());
        b[8..16].copy_from_slice(&addr.to_le_bytes());
        b[16..24].copy_from_slice(&len.to_le_bytes());
        b
    }

    /// Strict: fields an answer does not use must be zero, so what decodes
    /// re-encodes to the same bytes. EBADMSG otherwise.
    pub fn decode(b: &[u8]) -> Result<Answer> {
        let b: &[u8; ANSWER_LEN] = b.try_into().map_err(|_| Errno(libc::EBADMSG))?;
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        let (word, addr, len) = (u32_at(4), u64_at(8), u64_at(16));
        match u32_at(0) {
            FOUND => Ok(Answer::Found(MrInfo { addr, len, access: word })),
            ABSENT if word == 0 && addr == 0 && len == 0 => Ok(Answer::Absent),
            BUSY if word != 0 && addr == 0 && len == 0 => Ok(Answer::Busy { retry_ms: word }),
            _ => Err(Errno(libc::EBADMSG)),
        }
    }
}

/// GIDs whose buckets are remembered; beyond, those full again are
/// forgotten first (a full bucket is what a new one would be).
const MAX_GIDS: usize = 4096;

/// Misses per source GID, a token bucket each (see the module doc).
pub struct MissBudget {
    /// Misses a second, and at once; 0: unbounded.
    rate: u32,
    /// GID -> (tokens in thousandths, when counted: ms).
    gids: FxHashMap<Gid, (u64, u64)>,
}

impl MissBudget {
    pub fn new(rate: u32) -> MissBudget {
        MissBudget { rate, gids: FxHashMap::default() }
    }

    fn full(&self) -> u64 {
        self.rate as u64 * 1000
    }

    /// The tokens of `gid` at `now_ms` (thousandths).
    fn tokens(&self, gid: &Gid, now_ms: u64) -> u64 {
        match self.gids.get(gid) {
            Some(&(t, at)) => (t + now_ms.saturating_sub(at) * self.rate as u64).min(self.full()),
            None => self.full(),
        }
    }

    /// Whether a check from `gid` may be answered at `now_ms`, else in how
    /// many ms (at least 1) it may.
    pub fn admit(&self, gid: &Gid, now_ms: u64) -> std::result::Result<(), u32> {
        if self.rate == 0 {
            return Ok(());
        }
        let t = self.tokens(gid, now_ms);
        if t >= 1000 {
            Ok(())
        } else {
            Err(((1000 - t).div_ceil(self.rate as u64)).max(1) as u32)
        }
    }

    /// A check from `gid` (admitted) found nothing.
    pub fn missed(&mut self, gid: &Gid, now_ms: u64) {
        if self.rate == 0 {
            return;
        }
        let t = self.tokens(gid, now_ms).saturating_sub(1000);
        if self.gids.len() >= MAX_GIDS && !self.gids.contains_key(gid) {
            let full = self.full();
            let rate = self.rate as u64;
            self.gids.retain(|_, &mut (t, at)| t + now_ms.saturating_sub(at) * rate < full);
        }
        if self.gids.len() < MAX_GIDS || self.gids.contains_key(gid) {
            self.gids.insert(*gid, (t, now_ms));
        }
    }

    /// Answer a check from `gid` for an rkey `lookup` resolves, at `now_ms`.
    pub fn answer(&mut self, gid: &Gid, now_ms: u64, lookup: impl FnOnce() -> Option<MrInfo>) -> Answer {
        if let Err(retry_ms) = self.admit(gid, now_ms) {
            return Answer::Busy { retry_ms };
        }
        match lookup() {
            Some(mr) => Answer::Found(mr),
            None => {
                self.missed(gid, now_ms);
                Answer::Absent
            }
        }
    }
}

/// The process's misses, one budget over every PD and transport.
static BUDGET: Lazy<Mutex<MissBudget>> = Lazy::new(|| Mutex::new(MissBudget::new(crate::config::get().mr_check_misses)));

/// Whether a one-sided request of the datagram tier from `gid` may be
/// served now (else it is dropped unanswered, and its sender retransmits:
/// the tier's BUSY). Counted when it may not.
pub fn admit(gid: &Gid) -> bool {
    let ok = BUDGET.lock().admit(gid, coarse_ms()).is_ok();
    if !ok {
        stats::inc(Stat::KRCORE_STAT_MR_CHECKS_BUSY);
    }
    ok
}

/// A one-sided request of the datagram tier from `gid` named an rkey we
/// have no MR for.
pub fn missed(gid: &Gid) {
    stats::inc(Stat::KRCORE_STAT_MR_CHECK_MISSES);
    BUDGET.lock().missed(gid, coarse_ms());
}

/// How long a check waits for its answer before asking again: an answer
/// is lost only when the owner had no room on the link for it.
const RESEND: Duration = Duration::from_secs(1);
/// Answers owed on links with no room; beyond, checks go unanswered (the
/// asker asks again).
const MAX_OWED: usize = 256;

/// A runtime's MR checks: the answers its own checks wait for, and the
/// answers it owes on links that had no room for them.
#[derive(Default)]
pub struct Checks {
    /// tag -> what was asked, and the answer once it came.
    waiting: Mutex<FxHashMap<u32, Waiting>>,
    next_tag: AtomicU32,
    /// (link QPN, the MR_ANSWER header, its payload).
    owed: Mutex<Vec<(u32, Header, [u8; ANSWER_LEN])>>,
    any_owed: AtomicBool,
}

struct Waiting {
    link_qpn: u32,
    rkey: u32,
    addr: u64,
    /// When the check was sent (coarse ms).
    sent_ms: u64,
    answer: Option<Answer>,
}

/// A check's tags, forgotten when it ends however it ends.
struct Asking<'a> {
    checks: &'a Checks,
    tags: Vec<u32>,
}

impl Drop for Asking<'_> {
    fn drop(&mut self) {
        let mut w = self.checks.waiting.lock();
        for t in &self.tags {
            w.remove(t);
        }
    }
}

impl Asking<'_> {
    /// An answer to one of the checks, and when that one was sent; a BUSY
    /// one is taken (that check is over: the next is asked anew).
    fn answered(&mut self) -> Option<(Answer, u64)> {
        let mut w = self.checks.waiting.lock();
        let (i, answer, sent_ms) =
            self.tags.iter().enumerate().find_map(|(i, t)| w.get(t).and_then(|e| Some((i, e.answer?, e.sent_ms))))?;
        if let Answer::Busy { .. } = answer {
            w.remove(&self.tags.swap_remove(i));
        }
        Some((answer, sent_ms))
    }
}

/// Ask the peer over `link` what its MR `rkey` is, for a WR at `addr` (a
/// post's pre-check, on the caller's thread, making progress): the MR and when the check that
/// found it was sent (coarse ms: its lease counts from there), or None
/// when the peer has none. A BUSY answer is waited out and asked again. ENOTCONN when
/// the link closes or fails meanwhile, ETIMEDOUT without an answer within
/// the transport's bound.
pub fn ask(rt: &Runtime, link: &Link, rkey: u32, addr: u64) -> Result<Option<(MrInfo, u64)>> {
    crate::kmark!("MR check: asking");
    let asked = Instant::now();
    let deadline = asked + connect_timeout().max(TRANSPORT_WAIT);
    let checks = &rt.mr_checks;
    let mut asking = Asking { checks, tags: Vec::new() };
    loop {
        let tag = checks.next_tag.fetch_add(1, Ordering::Relaxed);
        let sent_ms = coarse_ms();
        checks.waiting.lock().insert(tag, Waiting { link_qpn: link.qp.qpn(), rkey, addr, sent_ms, answer: None });
        asking.tags.push(tag);
        let check = Header::link(LinkOp::MrCheck, rkey, addr, tag);
        while !super::qp::post_header_with(rt, link, &check, &[], |retired| Control::Header { retired }) {
            wait_turn(rt, link, asked, deadline)?;
        }
        let resend = Instant::now() + RESEND;
        loop {
            rt.progress();
            match asking.answered() {
                Some((Answer::Found(mr), sent_ms)) => {
                    crate::kmark!("MR check: answered");
                    return Ok(Some((mr, sent_ms)));
                }
                Some((Answer::Absent, _)) => return Ok(None),
                Some((Answer::Busy { retry_ms }, _)) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    std::thread::sleep(Duration::from_millis(retry_ms as u64).min(left));
                    break;
                }
                None if Instant::now() > resend => break,
                None => wait_turn(rt, link, asked, deadline)?,
            }
        }
        // Asked again: the answer to this check or any earlier one will do.
    }
}

/// Between two looks at a check `asked` then: the link must still be
/// open, the bound not passed.
fn wait_turn(rt: &Runtime, link: &Link, asked: Instant, deadline: Instant) -> Result<()> {
    if !link.is_open() {
        return Err(Errno(libc::ENOTCONN));
    }
    if Instant::now() > deadline {
        return Err(Errno(libc::ETIMEDOUT));
    }
    rt.progress();
    super::runtime::pause(asked.elapsed());
    Ok(())
}

/// A peer's MR_CHECK on `link` (the progress lock held): answer it from
/// the PD's registry, within its GID's misses.
pub fn on_check(rt: &Runtime, link: &Link, h: &Header) {
    let pd = rt.pd;
    let inside = |mr: &MrInfo| mr.addr <= h.addr && h.addr - mr.addr <= mr.len;
    let lookup = || super::mrs::with(pd, |m| m.by_rkey(h.rkey)).filter(inside);
    let answer = BUDGET.lock().answer(&link.path.dgid, coarse_ms(), lookup);
    stats::inc(Stat::KRCORE_STAT_MR_CHECKS);
    match answer {
        Answer::Absent => stats::inc(Stat::KRCORE_STAT_MR_CHECK_MISSES),
        Answer::Busy { .. } => stats::inc(Stat::KRCORE_STAT_MR_CHECKS_BUSY),
        Answer::Found(_) => {}
    }
    klog!(Level::Debug, "vqp: MR check of rkey {:#x} from {:02x?}: {answer:?}", h.rkey, link.path.dgid);
    let reply = Header::link(LinkOp::MrAnswer, h.rkey, h.addr, h.tag());
    let payload = answer.encode();
    if !super::qp::post_header_with(rt, link, &reply, &payload, |retired| Control::Header { retired }) {
        let mut owed = rt.mr_checks.owed.lock();
        if owed.len() < MAX_OWED {
            owed.push((link.qp.qpn(), reply, payload));
            rt.mr_checks.any_owed.store(true, Ordering::Release);
        }
    }
}

/// An MR_ANSWER on link `link_qpn`: for a check of ours on that link
/// about that rkey, else dropped.
pub fn on_answer(rt: &Runtime, link_qpn: u32, h: &Header, payload: &[u8]) {
    let answer = match Answer::decode(payload) {
        Ok(a) => a,
        Err(_) => {
            klog!(Level::Debug, "vqp: an MR answer that does not decode (link QP {link_qpn})");
            return;
        }
    };
    match rt.mr_checks.waiting.lock().get_mut(&h.tag()) {
        Some(w) if (w.link_qpn, w.rkey, w.addr) == (link_qpn, h.rkey, h.addr) => w.answer = Some(answer),
        _ => klog!(Level::Debug, "vqp: an MR answer for no check of ours (tag {}, link QP {link_qpn})", h.tag()),
    }
}

/// Post the answers owed, as their links have room (each progress pass).
pub fn pump_owed(rt: &Runtime) {
    let checks = &rt.mr_checks;
    if !checks.any_owed.load(Ordering::Acquire) {
        return;
    }
    let mut owed = checks.owed.lock();
    owed.retain(|(qpn, h, payload)| match rt.svc.link_by_qpn(*qpn) {
        Some(link) if link.is_open() => !super::qp::post_header_with(rt, &link, h, payload, |retired| Control::Header { retired }),
        _ => false,
    });
    checks.any_owed.store(!owed.is_empty(), Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;

    const G1: Gid = [1; 16];
    const G2: Gid = [2; 16];
    const MR: MrInfo = MrInfo { addr: 0x7f00_0000_1000, len: 1 << 33, access: 0xf };

    #[test]
    fn answers_round_trip_and_decode_strictly() {
        for a in [Answer::Found(MR), Answer::Found(MrInfo { addr: 0, len: 0, access: 0 }), Answer::Absent, Answer::Busy { retry_ms: 63 }] {
            assert_eq!(Answer::decode(&a.encode()), Ok(a));
        }
        let bad = Errno(libc::EBADMSG);
        let mut absent = Answer::Absent.encode();
        absent[9] = 1;
        assert_eq!(Answer::decode(&absent), Err(bad));
        let mut busy = Answer::Busy { retry_ms: 1 }.encode();
        busy[4] = 0;
        assert_eq!(Answer::decode(&busy), Err(bad));
        let mut other = Answer::Absent.encode();
        other[0] = 3;
        assert_eq!(Answer::decode(&other), Err(bad));
        assert_eq!(Answer::decode(&Answer::Absent.encode()[..23]), Err(bad));
    }

    #[test]
    fn misses_are_bounded_per_gid_and_refill() {
        let mut b = MissBudget::new(4);
        for i in 0..4 {
            assert_eq!(b.answer(&G1, 1000, || None), Answer::Absent, "miss {i}");
        }
        // Spent: found or not, BUSY (no oracle), with the time to a token.
        assert_eq!(b.answer(&G1, 1000, || None), Answer::Busy { retry_ms: 250 });
        assert_eq!(b.answer(&G1, 1000, || Some(MR)), Answer::Busy { retry_ms: 250 });
        assert_eq!(b.answer(&G1, 1100, || Some(MR)), Answer::Busy { retry_ms: 150 });
        // Another GID is not held up.
        assert_eq!(b.answer(&G2, 1000, || Some(MR)), Answer::Found(MR));
        assert_eq!(b.answer(&G2, 1000, || None), Answer::Absent);
        // A token a quarter second later; never more than a second's worth.
        assert_eq!(b.answer(&G1, 1250, || Some(MR)), Answer::Found(MR));
        assert_eq!(b.answer(&G1, 1250, || None), Answer::Absent);
        assert!(b.admit(&G1, 1251).is_err());
        for i in 0..4 {
            assert_eq!(b.answer(&G1, 100_000, || None), Answer::Absent, "miss {i} after a long pause");
        }
        assert!(b.admit(&G1, 100_000).is_err());
        // Found answers cost nothing.
        for _ in 0..100 {
            assert_eq!(b.answer(&G2, 200_000, || Some(MR)), Answer::Found(MR));
        }
    }

    #[test]
    fn rate_zero_is_unbounded() {
        let mut b = MissBudget::new(0);
        for _ in 0..10_000 {
            assert_eq!(b.answer(&G1, 5, || None), Answer::Absent);
        }
        assert!(b.gids.is_empty());
    }

    #[test]
    fn remembered_gids_are_bounded() {
        let mut b = MissBudget::new(2);
        for i in 0..(MAX_GIDS as u32 + 100) {
            let mut g = [0; 16];
            g[..4].copy_from_slice(&i.to_le_bytes());
            b.missed(&g, 1000);
            assert!(b.gids.len() <= MAX_GIDS);
        }
        // All spent at 1000: a second later all are full and make room.
        b.missed(&G1, 2000);
        assert_eq!(b.gids.len(), 1);
        // One still spent is remembered past the bound.
        b.missed(&G1, 2000);
        assert!(b.admit(&G1, 2000).is_err());
    }
}
