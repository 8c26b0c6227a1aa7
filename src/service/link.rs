//! A link: the RC QP pair a process keeps with one peer process, what
//! it knows of the peer (its probe target, its endpoint) and its state
//! (closing, failed, LRU use), and the table that finds links by peer, by
//! QP number and by the peer's request.

use super::credit::LinkCredit;
use crate::meta::proto::LinkInfo;
use crate::meta::Endpoint;
use crate::rdma::{Gid, Qp};
use crate::vqp::queue::PhysSq;
use parking_lot::Mutex;
use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// The two GIDs a link runs between: ours (by index) and the peer's.
/// By default our home GID and the peer endpoint's; a transparent VQP's
/// are the ones its application gave at RTR (`sgid_index`, `dgid`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Path {
    pub sgid_index: u32,
    pub dgid: Gid,
}

/// An RC connection to one peer process, shared by every VQP that talks to
/// it.
pub struct Link {
    pub qp: Qp,
    pub peer: Endpoint,
    pub index: u16,
    pub path: Path,
    /// What a liveness probe READs at the peer: (address, rkey).
    pub peer_probe: (u64, u32),
    /// We sent the request (else the peer did).
    pub initiated: bool,
    /// The peer's end can receive: ours was made by our request (the
    /// peer's end was in RTR before it replied), or the peer said so
    /// (LINK_READY, or anything it sent on the link). A packet reaching the
    /// peer's QP before its RTR is dropped and costs an RC retransmission
    /// timeout (half a second), so an accepted link is handed out only
    /// once ready, or after `ready_after_ms` (`coarse_ms`) should the
    /// peer's word be lost.
    pub(super) ready: AtomicBool,
    pub(super) ready_after_ms: u64,
    /// When it was made (`coarse_ms`).
    made_ms: u64,
    /// The PSN our side starts sending with (told to the peer).
    pub(super) psn: u32,
    /// Overflow accounting of the send queue; held while posting, so that
    /// decisions are in posting order.
    pub sq: Mutex<PhysSq>,
    /// An error completion came on it (the peer died or is unreachable):
    /// it is out of the tables that hand links out, never posted on again.
    pub(super) failed: AtomicBool,
    /// Being closed (reclaim, or a duplicate): handed out no more; VQPs
    /// move to a new link once every WQE of theirs on it completed.
    pub(super) closing: AtomicBool,
    /// Our LINK_CLOSE was posted / its completion seen / the peer's came.
    pub close_posted: AtomicBool,
    pub close_done: AtomicBool,
    pub close_heard: AtomicBool,
    /// This process posted on it since the last maintenance tick; the tick
    /// turns that into `last_used` (`coarse_ms`), for LRU reclaim: no clock
    /// read on the data path.
    pub(super) used: AtomicBool,
    pub(super) last_used: AtomicU64,
    /// The peer's use, which our posts do not show: our QP's receive PSN
    /// (every request of the peer's moves it, READs the NIC serves alone
    /// included) and when it was read (`coarse_ms`), at the last look.
    peer_seen: Mutex<(u32, u64)>,
    /// When it began closing (`coarse_ms`).
    pub(super) close_started: AtomicU64,
    /// Counted in the `links` gauge (until forgotten or dropped).
    gauged: AtomicBool,
    /// The messages' flow control, both directions (`credit`).
    pub credit: LinkCredit,
}

impl Link {
    // Every argument is a part of the link its two makers (an accept and
    // a request) know differently.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        qp: Qp,
        peer: Endpoint,
        index: u16,
        path: Path,
        theirs: &LinkInfo,
        initiated: bool,
        psn: u32,
        credit: LinkCredit,
    ) -> crate::error::Result<Link> {
        let qp_depth = qp.caps.send_wr;
        let now = crate::clock::coarse_ms();
        crate::stats::inc(crate::stats::Stat::KRCORE_STAT_LINKS);
        crate::stats::inc(crate::stats::Stat::KRCORE_STAT_LINKS_OPENED);
        Ok(Link {
            qp,
            peer,
            index,
            path,
            peer_probe: (theirs.probe_addr, theirs.probe_rkey),
            initiated,
            ready: AtomicBool::new(initiated),
            ready_after_ms: now + READY_WAIT_MS,
            made_ms: now,
            psn,
            sq: Mutex::new(PhysSq::new(qp_depth)?),
            failed: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            close_posted: AtomicBool::new(false),
            close_done: AtomicBool::new(false),
            close_heard: AtomicBool::new(false),
            used: AtomicBool::new(false),
            last_used: AtomicU64::new(now),
            peer_seen: Mutex::new((theirs.psn, now)),
            close_started: AtomicU64::new(0),
            gauged: AtomicBool::new(true),
            credit,
        })
    }

    /// Ours, made at a late reply (`Shared::on_late_reply`): handed out
    /// once the peer is heard on it (a probe READ confirms it), or after
    /// [`LATE_READY_WAIT_MS`] (by then a probe of an end that gave up
    /// failed it).
    pub(super) fn confirmed_when_heard(mut self) -> Link {
        self.ready = AtomicBool::new(false);
        self.ready_after_ms = self.made_ms + LATE_READY_WAIT_MS;
        self
    }

    /// Out of the `links` gauge (forgotten: its QP may linger a while).
    pub(super) fn ungauge(&self) {
        if self.gauged.swap(false, Ordering::AcqRel) {
            crate::stats::sub(crate::stats::Stat::KRCORE_STAT_LINKS, 1);
        }
    }

    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Whether the peer said its end receives (`LinkReady`), or we made
    /// the link: an accepted link without it may be one whose requester
    /// gave its handshake up, whose failure says nothing of the process.
    pub fn confirmed(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Whether the peer's end can receive (see `ready`).
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire) || crate::clock::coarse_ms() >= self.ready_after_ms
    }

    /// Whether a VQP may start new work on it.
    pub fn is_open(&self) -> bool {
        !self.is_closing() && !self.is_failed()
    }

    /// Whether the peer sent more on it since the last look than its
    /// liveness probes (one per maintenance tick of an idle link, its
    /// period taken to be ours; twice that and two more allowed): then it counts
    /// as used now (`last_used`). A server whose clients only READ it
    /// posts nothing on their links, and would otherwise take them for
    /// idle. A kernel call (`ibv_query_qp`): asked only of links about to
    /// be closed as idle.
    pub(super) fn peer_used(&self, now: u64) -> bool {
        let Ok(psn) = self.qp.rq_psn() else { return false };
        let every = crate::config::get().link_tick_ms();
        let mut seen = self.peer_seen.lock();
        let moved = psn.wrapping_sub(seen.0) & PSN_MASK;
        let probes = 2 + 2 * now.saturating_sub(seen.1) / every;
        *seen = (psn, now);
        if u64::from(moved) > probes {
            self.last_used.store(now, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// Milliseconds since it began closing.
    pub fn closing_for_ms(&self) -> u64 {
        crate::clock::coarse_ms().saturating_sub(self.close_started.load(Ordering::Relaxed))
    }

    /// This process posts on it (under its send lock: the line is hot).
    #[inline]
    pub fn touch(&self) {
        self.used.store(true, Ordering::Relaxed);
    }

    /// The link the two processes keep when both made one (they connected
    /// to each other at once): the one whose initiator has the smaller
    /// endpoint, a choice both sides make alike without talking.
    pub(super) fn preferred_over(&self, other: &Link, me: &Endpoint) -> bool {
        let initiator = |l: &Link| {
            let e = if l.initiated { me } else { &l.peer };
            (e.gid, e.qpn, e.incarnation)
        };
        initiator(self) < initiator(other)
    }
}

/// PSNs are 24 bits.
const PSN_MASK: u32 = 0x00ff_ffff;

/// How long an accepted link waits for its requester's word that its end
/// is in RTR before it is used anyway (RC retransmits what was too early).
pub(super) const READY_WAIT_MS: u64 = 200;

/// How long a link made at a late reply waits to be heard on before it is
/// handed out anyway: RC's retries (about 3.8 s) for a probe of an end that
/// gave up on ours to fail it, and a maintenance tick to post that probe.
const LATE_READY_WAIT_MS: u64 = 5000;

/// Links are found by the peer's endpoint, the link's index and path.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(super) struct LinkKey {
    gid: Gid,
    qpn: u32,
    incarnation: u64,
    index: u16,
    path: Path,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.ungauge();
    }
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("qpn", &self.qp.qpn())
            .field("peer", &self.peer)
            .field("index", &self.index)
            .field("initiated", &self.initiated)
            .finish()
    }
}

impl LinkKey {
    pub(super) fn of(peer: &Endpoint, index: u16, path: Path) -> LinkKey {
        LinkKey { gid: peer.gid, qpn: peer.qpn, incarnation: peer.incarnation, index, path }
    }

    /// Whether the link is with the endpoint at (`gid`, `qpn`), whatever
    /// its incarnation.
    pub(super) fn is_with(&self, gid: &Gid, qpn: u32) -> bool {
        self.gid == *gid && self.qpn == qpn
    }

    /// Whether the link is with an endpoint at `gid`.
    pub(super) fn is_from_gid(&self, gid: &Gid) -> bool {
        self.gid == *gid
    }

    pub(super) fn of_link(l: &Link) -> LinkKey {
        LinkKey::of(&l.peer, l.index, l.path)
    }
}

/// Every link, by peer and index (what a connect looks for), by QP number
/// (what a completion names: looked up once per completion) and, for the
/// links a peer asked for, by the peer's QP (what a repeated request names).
///
/// Two processes that connect to each other at the same time make two
/// links, each side's request accepted by the other. Both sides keep
/// serving new connects with the same one ([`Link::preferred_over`]); the
/// other is a duplicate, closed like an idle link (LINK_CLOSE both ways)
/// once the VQPs that were given it moved.
pub(super) struct Links {
    pub(super) by_key: FxHashMap<LinkKey, Arc<Link>>,
    pub(super) by_qpn: FxHashMap<u32, Arc<Link>>,
    /// By the requester's (incarnation, QP, PSN): a request is answered
    /// with the same link however often it is repeated.
    pub(super) accepted: FxHashMap<RequestId, Arc<Link>>,
    /// Requests whose link was retired since, the last [`MAX_RETIRED`]: a
    /// copy that comes late (retransmitted while we were slow) is dropped,
    /// not made into a link nobody uses on the other side.
    retired: crate::recent::Recent<RequestId>,
    /// The keys our own link requests are out for.
    pub(super) asking: FxHashSet<LinkKey>,
    /// The keys of the peers' requests being accepted now (until the link
    /// is in `by_key`, or refused).
    pub(super) accepting: FxHashSet<LinkKey>,
    /// Requests that crossed one of ours (see [`Links::crossed`]), the
    /// last [`MAX_RETIRED`]: their copies get the same answer.
    crossed: crate::recent::Recent<RequestId>,
}

/// A link request, as the requester's (incarnation, QP number, PSN): the
/// random PSN tells a reused QP number's new request from an old one.
pub(super) type RequestId = (u64, u32, u32);

/// Retired link requests remembered.
const MAX_RETIRED: usize = 4096;

impl Default for Links {
    fn default() -> Links {
        Links {
            by_key: FxHashMap::default(),
            by_qpn: FxHashMap::default(),
            accepted: FxHashMap::default(),
            retired: crate::recent::Recent::new(MAX_RETIRED),
            asking: FxHashSet::default(),
            accepting: FxHashSet::default(),
            crossed: crate::recent::Recent::new(MAX_RETIRED),
        }
    }
}

impl Links {
    /// Keep `link`; it serves new connects unless the one that already
    /// does is preferred. The one that serves.
    pub(super) fn insert(&mut self, key: LinkKey, link: Arc<Link>, me: &Endpoint) -> Arc<Link> {
        self.by_qpn.insert(link.qp.qpn(), Arc::clone(&link));
        match self.by_key.get(&key) {
            Some(l) if !link.preferred_over(l, me) => Arc::clone(l),
            _ => {
                self.by_key.insert(key, Arc::clone(&link));
                link
            }
        }
    }

    /// Hand `link` out no more; a live duplicate to the same peer serves
    /// its key instead.
    pub(super) fn retire(&mut self, link: &Arc<Link>) {
        let key = LinkKey::of_link(link);
        let retired = &mut self.retired;
        self.accepted.retain(|id, l| {
            let keep = !Arc::ptr_eq(l, link);
            if !keep {
                retired.insert(*id);
            }
            keep
        });
        if self.by_key.get(&key).is_some_and(|l| Arc::ptr_eq(l, link)) {
            self.by_key.remove(&key);
            let twin = self.by_qpn.values().find(|l| l.is_open() && LinkKey::of_link(l) == key);
            if let Some(twin) = twin {
                self.by_key.insert(key, Arc::clone(twin));
            }
        }
    }

    /// Whether the peer's request `id` for `key` crossed ours: both
    /// processes asked for the link at once. Only one link is made, the one
    /// the process of the lower incarnation asked for (`lower`: we are
    /// that one): the other's request is answered EALREADY, and its
    /// requester takes the link ours makes. Ours is out, or was made less
    /// than `window_ms` ago (a request is retransmitted that long: a copy
    /// sent before the peer accepted ours may come after our link is up).
    /// Copies of a crossed request get the same answer.
    pub(super) fn crossed(&mut self, id: RequestId, key: &LinkKey, lower: bool, window_ms: u64) -> bool {
        if self.crossed.contains(&id) {
            return true;
        }
        let now = crate::clock::coarse_ms();
        let ours_new = |l: &Arc<Link>| l.initiated && l.is_open() && now < l.made_ms + window_ms;
        let crossed = lower && (self.asking.contains(key) || self.by_key.get(key).is_some_and(ours_new));
        if crossed {
            self.crossed.insert(id);
        }
        crossed
    }

    /// Whether the link request `id` made a link that is retired now.
    pub(super) fn was_retired(&self, id: &RequestId) -> bool {
        self.retired.contains(id)
    }

    /// Open links that serve no key: the duplicates of simultaneous
    /// connects.
    pub(super) fn duplicates(&self) -> impl Iterator<Item = &Arc<Link>> {
        self.by_qpn.values().filter(|l| l.is_open() && !self.by_key.get(&LinkKey::of_link(l)).is_some_and(|k| Arc::ptr_eq(k, l)))
    }
}
