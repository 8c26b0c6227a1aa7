//! A virtual QP: what the application holds (`KRCORE_VQP`), backed by
//! software queues and, once bound or connected, by a link it shares with
//! every other VQP of this process that talks to the same peer.
//!
//! Where a work request goes: `post_send` pre-checks it (precheck.rs:
//! local MRs from mrs.rs, the peer's MRs as it answered our checks (mrcheck.rs), asked once and
//! cached), records it in the VQP's send ring, and posts it on the link
//! with a wr_id that names this VQP, its sequence number and what the
//! physical completion retires (wrid.rs). SENDs carry a 32-byte header in
//! front of the payload (header.rs); the receiver's progress finds the
//! destination VQP from it and copies the payload into the buffer the
//! application posted. Completions come back through `Runtime::progress`
//! into the send ring, which emits the application's completions in order
//! into its CQ's software queue.
//!
//! This file holds what a VQP is (its state, the VQP table, creation and
//! destruction); by concern: send.rs (posting), connect.rs (its
//! connection and what its link's fate does to it), tier.rs (link or
//! datagram tier, and the move), landing.rs (receives), popmsgs.rs
//! (`qpop_msgs`), teardown.rs (flush and destroy waiting for the wire).
//!
//! Locks: a VQP's state, then its link's send-queue accounting; progress
//! takes each of them alone, never one inside the other, and never holds
//! a VQP's lock while waiting for progress.

use super::header::{Flags, Header, LinkOp, HEADER_LEN};
use super::large::{Control, Staged};
use super::memo::{Memoized, MrMemo};
use super::mrs;
use super::precheck::{self, Caps, LocalMrs, RemoteMrs, SendWr, Verdict};
use super::queue::{Completion, RecvRing, SendEntry, SendRing};
use super::rc::{Effect, RcShadow};
use super::runtime::{CqSoft, PeerMrs, Runtime, Sink, HDR_SLOT, MAX_MSG};
use super::srq::VSrq;
use super::wrid::{SendId, WrId};
use crate::clock::coarse_ms;
use crate::error::{Errno, Result};
use crate::klog;
use crate::log::Level;
use crate::meta::Endpoint;
use crate::rdma::{self, Region};
use crate::service::{Link, Path};
use crate::sys::*;
use once_cell::sync::OnceCell;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

mod agent;
mod connect;
mod landing;
mod popmsgs;
mod send;
mod teardown;
mod tier;

use send::wc_opcode_of;
use tier::Tier;

/// Application SGEs per send: the link has one more for the header.
pub const MAX_SEND_SGE: u32 = crate::service::LINK_SEND_SGE - 1;
pub const MAX_RECV_SGE: u32 = 16;
/// Inline data a VQP accepts (copied behind the header).
pub const MAX_INLINE: u32 = 256;

/// Whether a VQP can grant these capabilities (what [`Vqp::new`] takes).
pub fn caps_fit(cap: &ibv_qp_cap) -> bool {
    cap.max_send_sge <= MAX_SEND_SGE
        && cap.max_recv_sge <= MAX_RECV_SGE
        && cap.max_inline_data <= MAX_INLINE
        && cap.max_send_wr <= super::queue::MAX_DEPTH
        && cap.max_recv_wr <= super::queue::MAX_DEPTH
}

/// The VQP table: slot -> VQP with a generation, so that a completion or
/// message for a destroyed VQP is recognised as such.
struct Slots {
    entries: Vec<(u8, Weak<Vqp>)>,
    free: Vec<u32>,
}

static SLOTS: Mutex<Slots> = Mutex::new(Slots { entries: Vec::new(), free: Vec::new() });

/// Virtual QP numbers: bit 23 set (real QPNs of rxe and mlx5 stay far
/// below), the slot's generation in bits 20-22, the slot in bits 0-19.
fn vqpn_of(slot: u32, gen: u8) -> u32 {
    0x80_0000 | (((gen & 7) as u32) << 20) | slot
}

pub fn lookup(slot: u32, gen: u8) -> Option<Arc<Vqp>> {
    let s = SLOTS.lock();
    let (g, w) = s.entries.get(slot as usize)?;
    if *g != gen {
        return None;
    }
    w.upgrade()
}

/// Every VQP alive.
pub fn live() -> Vec<Arc<Vqp>> {
    SLOTS.lock().entries.iter().filter_map(|(_, w)| w.upgrade()).collect()
}

pub fn by_vqpn(vqpn: u32) -> Option<Arc<Vqp>> {
    if vqpn & 0x80_0000 == 0 {
        return None;
    }
    let slot = vqpn & 0xf_ffff;
    let s = SLOTS.lock();
    let (g, w) = s.entries.get(slot as usize)?;
    if (g & 7) as u32 != (vqpn >> 20) & 7 {
        return None;
    }
    w.upgrade()
}

/// The application's objects a VQP was created with (wrappers).
#[derive(Clone, Copy)]
pub struct AppRefs {
    pub ctx: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    /// The real context and PD behind them.
    pub real_ctx: *mut ibv_context,
    pub real_pd: *mut ibv_pd,
}

/// Where a connected VQP sends.
struct Conn {
    /// The link it posts on; None once that link was closed (reclaim):
    /// the next post makes or finds another to the same peer process.
    link: Option<Arc<Link>>,
    peer: Endpoint,
    /// Which of the links to that peer (`KRCORE_LINKS_PER_PEER`).
    index: u16,
    /// The GIDs its links run between.
    path: Path,
    /// The peer VQP's number.
    dst: u32,
    /// Its flow on the datagram tier, once it used it (kept across moves:
    /// its sequence numbers go on if the VQP falls back to the tier).
    flow: Option<Arc<crate::transport::dgram::port::Flow>>,
}

impl Conn {
    /// Its link, while new work may go on it.
    fn open_link(&self) -> Option<&Arc<Link>> {
        self.link.as_ref().filter(|l| l.is_open())
    }

    fn is_on(&self, link: &Arc<Link>) -> bool {
        self.link.as_ref().is_some_and(|l| Arc::ptr_eq(l, link))
    }

    /// Whether `peer`, seen on GID `dgid`, is our peer's process: its
    /// service QPN and incarnation, on its home GID or our path's.
    fn is_with(&self, peer: &Endpoint, dgid: &[u8; 16]) -> bool {
        peer.qpn == self.peer.qpn && peer.incarnation == self.peer.incarnation && (peer.gid == self.peer.gid || *dgid == self.path.dgid)
    }

    /// Whether a message from `o` is our peer's.
    fn sent_by_peer(&self, o: &Origin) -> bool {
        self.is_with(&o.peer, &o.path.dgid)
    }
}

/// Who sent a message to a bound VQP, as its src_qp answers it: the
/// sending VQP and its process as the fabric shows them (the GID its
/// messages come from and its service QPN, which the NIC and the link
/// handshake vouch for) with the incarnation it claims. Another process
/// cannot pass for it, whatever it writes in its headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Sender {
    gid: [u8; 16],
    qpn: u32,
    incarnation: u64,
    vqpn: u32,
}

impl Sender {
    fn of_process(&self, peer: &Endpoint) -> bool {
        self.qpn == peer.qpn && self.incarnation == peer.incarnation
    }
}

/// The senders of a bound VQP, and how many per source GID: a stranger
/// that invents VQPs makes it make src_qps only up to
/// `KRCORE_MAX_SENDERS` (`KRCORE_MAX_SENDERS_PER_GID` of one GID).
#[derive(Default)]
struct Senders {
    all: std::collections::HashSet<Sender>,
    per_gid: HashMap<[u8; 16], usize>,
    /// Messages refused so far (the first is logged at warn level).
    refused: u64,
}

impl Senders {
    /// Whether a message of `s` is taken: a sender already known, or a
    /// new one within the bounds (then known from now on).
    fn admit(&mut self, s: Sender) -> bool {
        if self.all.contains(&s) {
            return true;
        }
        let cfg = crate::config::get();
        let of_gid = self.per_gid.get(&s.gid).copied().unwrap_or(0);
        if self.all.len() >= cfg.max_senders || of_gid >= cfg.max_senders_per_gid {
            self.refused += 1;
            return false;
        }
        self.all.insert(s);
        self.per_gid.insert(s.gid, of_gid + 1);
        true
    }

    /// `s` was reported closed, or its src_qp destroyed.
    fn forget(&mut self, s: &Sender) {
        if self.all.remove(s) {
            if let Some(n) = self.per_gid.get_mut(&s.gid) {
                *n -= 1;
                if *n == 0 {
                    self.per_gid.remove(&s.gid);
                }
            }
        }
    }
}

/// Where a received message came from: its sender's process, which of
/// the links to it and on which path, and the link it came on (None: the
/// datagram tier).
#[derive(Clone)]
struct Origin {
    peer: Endpoint,
    index: u16,
    path: Path,
    link: Option<Arc<Link>>,
}

impl Origin {
    fn of(link: &Arc<Link>) -> Origin {
        Origin { peer: link.peer, index: link.index, path: link.path, link: Some(Arc::clone(link)) }
    }

    fn is_on(&self, link: &Arc<Link>) -> bool {
        self.link.as_ref().is_some_and(|l| Arc::ptr_eq(l, link))
    }

    fn sender(&self, vqpn: u32) -> Sender {
        Sender { gid: self.path.dgid, qpn: self.peer.qpn, incarnation: self.peer.incarnation, vqpn }
    }

    /// `from`'s process, as the origin of sender `s` (a CLOSE made for it).
    fn of_sender(from: &Origin, s: Sender) -> Origin {
        let mut o = from.clone();
        o.path.dgid = s.gid;
        o
    }
}

/// A message that arrived before the application posted a receive (or
/// behind a large one still being READ).
struct Held {
    header: Header,
    payload: Vec<u8>,
    origin: Origin,
    /// Bytes of its link's window it holds (0: it came on the datagram
    /// tier, or was made here), given back when it goes.
    cost: u64,
    /// Came on the datagram tier: its bytes held against its source GID
    /// (`crate::transport::dgram::budget`), given back when it goes.
    _tier: Option<crate::transport::dgram::budget::Reservation>,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(link) = self.origin.link.as_ref().filter(|_| self.cost > 0) {
            link.credit.release(self.cost);
        }
    }
}

/// A large message being READ into a posted receive buffer.
struct Reading {
    /// Its completion, filled in but for the status of the READs.
    wc: ibv_wc,
    /// Where the payload lands (the buffer's pieces) and the next to READ.
    pieces: Vec<ibv_sge>,
    next: usize,
    /// The sender's staged payload at the next piece.
    remote: u64,
    rkey: u32,
    /// READs posted and not completed.
    inflight: u32,
    link: Arc<Link>,
    /// The receive buffer it took (given back if the message is lost).
    buf: Vec<ibv_sge>,
    /// A READ failed: the link died under it, the message is lost.
    lost: bool,
    /// The answer, sent when every READ completed (`imm`: the status).
    done: Header,
}

struct State {
    sq: SendRing,
    rq: RecvRing,
    conn: Option<Conn>,
    bound: Option<crate::meta::Key>,
    /// What `qpop_msgs` reports (bound VQPs).
    inbox: VecDeque<Inbox>,
    held: VecDeque<Held>,
    reading: Option<Reading>,
    /// VQPs connected back to senders (bound VQPs), by sender.
    src_qps: HashMap<Sender, *mut ibv_qp>,
    /// The senders a bound VQP takes messages from: each gets a src_qp
    /// at `qpop_msgs`, until it is reported closed (bounded: `senders`).
    senders: Senders,
    /// src_qps whose sender is gone, reported by the last `qpop_msgs`
    /// and destroyed at the next.
    retired: Vec<*mut ibv_qp>,
    /// The sender whose src_qp `qpop_msgs` is making (outside this lock):
    /// a link failure meanwhile reports it closed too.
    answering: Option<Sender>,
    /// What stopped the last `qpop_msgs` after it had popped messages:
    /// returned by the next call (the messages were returned first).
    pop_error: Option<Errno>,
    /// A message (SEND, WRITE_WITH_IMM) went to the connected peer: it may
    /// keep a src_qp for us, which our CLOSE at destroy releases.
    sent_msgs: bool,
    /// The MRs the last pre-checks found.
    memo: MrMemo,
    /// A transparent VQP (`KRCORE_VIRTUALIZE`): the RC QP it plays.
    rc: Option<RcShadow>,
    /// A transparent VQP's published QPN, one key per GID (unpublished at
    /// destroy).
    published: Vec<crate::meta::Key>,
    /// Its link failed: in the error state (sends and, once the messages
    /// that came before are delivered, receives are flushed).
    failed: bool,
    /// The link of its last WQE and the link's mark after it: every WQE
    /// of ours completed once the link reached it (see teardown.rs). Weak:
    /// a link that is gone (closed or failed, its QP destroyed) has
    /// nothing in flight, and a VQP must not keep it.
    wire: Option<(Weak<Link>, u64)>,
    /// Flush completions of sends held until the link completed the WQEs
    /// they report (ERR with WQEs in flight), in order.
    held_sends: Vec<Completion>,
    /// Being destroyed or reset: no new READ of a large message.
    torn_down: bool,
    /// Where the READs and atomics posted on the datagram tier land, by
    /// send sequence number, in post order.
    tier_dst: VecDeque<(u16, Vec<ibv_sge>)>,
    /// Work requests posted on the datagram tier (`KRCORE_LINK_AFTER`).
    tier_posts: u64,
    /// The link was asked for at this flow's first completion.
    link_asked: bool,
}

/// An entry of a bound VQP's inbox.
enum Inbox {
    /// A message: where it came from, the sending VQP, its completion.
    Msg(Origin, u32, ibv_wc),
    /// The sending VQP was destroyed (or its process is gone).
    Closed(Sender),
}

/// Where a VQP's header slots live: in one of the runtime's arenas, or
/// (a send queue deeper than an arena) in a registration of its own.
enum Hdrs {
    Arena { arena: Arc<super::runtime::HdrArena>, start: u32 },
    Own(Region),
}

pub struct Vqp {
    pub slot: u32,
    pub gen: u8,
    pub vqpn: u32,
    pub app: AppRefs,
    send_soft: Arc<CqSoft>,
    recv_soft: Arc<CqSoft>,
    sq_sig_all: bool,
    pub caps: Caps,
    st: Mutex<State>,
    rt: OnceCell<Arc<Runtime>>,
    /// Header slots of in-flight SENDs, one per send-ring entry.
    hdrs: OnceCell<Hdrs>,
    sq_cap: u32,
    /// The connected peer's MRStore (shared with the runtime's other VQPs).
    peer_mrs: OnceCell<Arc<Mutex<PeerMrs>>>,
    /// A VQP made by `qpop_msgs`: the bound VQP and the sender it answers.
    parent: OnceCell<(Weak<Vqp>, Sender)>,
    /// A transparent VQP's QPN as the application sees it (unique on its
    /// GID through the meta server; `vqpn` is only unique in the process).
    app_qpn: OnceCell<u32>,
    /// The virtual SRQ its receives come from, if created with one.
    srq: OnceCell<Arc<VSrq>>,
    /// `qpop_msgs` callers one at a time (a bound VQP's inbox has one
    /// consumer: a sender's src_qp is made once, before its CLOSE).
    popping: Mutex<()>,
    /// Its first work through the host's agent, until the move (agent.rs).
    agent: Mutex<Option<agent::AgentLeg>>,
    /// `agent` is set (a post looks at it only then: no lock otherwise).
    on_agent: std::sync::atomic::AtomicBool,
    /// A completion on the agent's path came (room, or the move may go on).
    agent_moved: parking_lot::Condvar,
}

// SAFETY: the raw pointers are the application's objects, only passed
// back to it; all mutable state is behind locks.
unsafe impl Send for Vqp {}
// SAFETY: as above.
unsafe impl Sync for Vqp {}

impl Vqp {
    /// A new VQP with the granted capabilities (written back into `cap`).
    pub fn new(app: AppRefs, send_soft: Arc<CqSoft>, recv_soft: Arc<CqSoft>, cap: &mut ibv_qp_cap, sq_sig_all: bool) -> Result<Arc<Vqp>> {
        if cap.max_send_sge > MAX_SEND_SGE || cap.max_recv_sge > MAX_RECV_SGE || cap.max_inline_data > MAX_INLINE {
            return Err(Errno::EINVAL);
        }
        cap.max_send_sge = cap.max_send_sge.max(1);
        cap.max_recv_sge = cap.max_recv_sge.max(1);
        let caps = Caps {
            max_send_sge: cap.max_send_sge,
            max_recv_sge: cap.max_recv_sge,
            max_inline_data: cap.max_inline_data,
            // RC's 2 GiB, lowered to the port's max_msg_sz and with atomics
            // only if the device has them once the runtime (the device) is
            // known: `dev_caps`. Messages: see post_one.
            max_msg_size: 1 << 31,
            atomics: true,
        };
        let st = State {
            sq: SendRing::new(cap.max_send_wr)?,
            rq: RecvRing::new(cap.max_recv_wr, cap.max_recv_sge)?,
            conn: None,
            bound: None,
            inbox: VecDeque::new(),
            held: VecDeque::new(),
            reading: None,
            src_qps: HashMap::new(),
            senders: Senders::default(),
            retired: Vec::new(),
            answering: None,
            pop_error: None,
            sent_msgs: false,
            memo: MrMemo::default(),
            rc: None,
            published: Vec::new(),
            failed: false,
            wire: None,
            held_sends: Vec::new(),
            torn_down: false,
            tier_dst: VecDeque::new(),
            tier_posts: 0,
            link_asked: false,
        };
        let mut slots = SLOTS.lock();
        let slot = match slots.free.pop() {
            Some(s) => s,
            None => {
                let s = slots.entries.len() as u32;
                if s >= super::wrid::MAX_SLOTS {
                    return Err(Errno::ENOMEM);
                }
                slots.entries.push((0, Weak::new()));
                s
            }
        };
        let gen = slots.entries[slot as usize].0.wrapping_add(1);
        let v = Arc::new(Vqp {
            slot,
            gen,
            vqpn: vqpn_of(slot, gen),
            app,
            send_soft,
            recv_soft,
            sq_sig_all,
            caps,
            st: Mutex::new(st),
            rt: OnceCell::new(),
            hdrs: OnceCell::new(),
            sq_cap: cap.max_send_wr,
            peer_mrs: OnceCell::new(),
            parent: OnceCell::new(),
            app_qpn: OnceCell::new(),
            srq: OnceCell::new(),
            popping: Mutex::new(()),
            agent: Mutex::new(None),
            on_agent: std::sync::atomic::AtomicBool::new(false),
            agent_moved: parking_lot::Condvar::new(),
        });
        slots.entries[slot as usize] = (gen, Arc::downgrade(&v));
        crate::stats::inc(crate::stats::Stat::KRCORE_STAT_VQPS);
        v.send_soft.add_user();
        v.recv_soft.add_user();
        Ok(v)
    }

    /// The runtime of our PD, started at the first bind or connect.
    fn runtime(&self, gid_index: Option<u32>) -> Result<&Arc<Runtime>> {
        self.rt.get_or_try_init(|| {
            // SAFETY: the application's real context and PD outlive its
            // VQPs (destroying them first fails with EBUSY).
            let rt = unsafe { Runtime::get_or_start(self.app.real_ctx, self.app.real_pd, gid_index) }?;
            self.send_soft.serve(&rt, false);
            self.recv_soft.serve(&rt, true);
            Ok(rt)
        })
    }

    /// The header slots' region and the offset of the first.
    fn hdrs<'a>(&'a self, rt: &'a Runtime) -> Result<(&'a Region, usize)> {
        let n = self.sq_cap.max(1);
        let h = self.hdrs.get_or_try_init(|| match rt.alloc_hdrs(n)? {
            Some((arena, start)) => Ok(Hdrs::Arena { arena, start }),
            None => Region::new(rt.svc.device(), n as usize * HDR_SLOT, rdma::LOCAL_WRITE).map(Hdrs::Own),
        })?;
        Ok(match h {
            Hdrs::Arena { arena, start } => (&arena.region, *start as usize * HDR_SLOT),
            Hdrs::Own(r) => (r, 0),
        })
    }

    /// The QPN the application sees.
    #[inline]
    pub fn qpn(&self) -> u32 {
        self.app_qpn.get().copied().unwrap_or(self.vqpn)
    }

    /// Take receives from `srq` instead of an own receive queue.
    pub fn set_srq(&self, srq: Arc<VSrq>) {
        let _ = self.srq.set(srq);
    }

    /// Whether no receive is posted for the next message. On an SRQ the
    /// VQP then waits for the SRQ's next post (checked and registered
    /// under the SRQ's lock: a post in between cannot miss it).
    /// Whether it belongs to `rt` (its PD's runtime): a message that came
    /// on another runtime's link or port is not for it.
    pub fn runs_on(&self, rt: &Runtime) -> bool {
        self.rt.get().is_some_and(|r| std::ptr::eq(&**r, rt))
    }

    /// Whether a link with `peer` (asked for on `path`) serves this VQP:
    /// bound (anyone may send to it), a transparent VQP before its RTR
    /// (its QPN is published: its peer may RTR first and ask, and what it
    /// sends waits for ours, which keeps only its peer's), or connected to
    /// that process.
    pub fn wants_link_with(&self, peer: &Endpoint, path: &Path) -> bool {
        let st = self.st.lock();
        st.bound.is_some() || (st.rc.is_some() && Self::awaits_peer(&st)) || st.conn.as_ref().is_some_and(|c| c.is_with(peer, &path.dgid))
    }

    /// Whether it takes a message from `peer`'s process, seen on GID
    /// `dgid`: bound, from anyone (what `qbind` means); connected, from its
    /// peer only; neither yet, held until it connects (`awaits_peer`).
    fn takes_from(st: &State, peer: &Endpoint, dgid: &[u8; 16]) -> bool {
        st.bound.is_some() || st.conn.as_ref().is_none_or(|c| c.is_with(peer, dgid))
    }

    /// Neither connected nor bound yet (a transparent VQP before RTR): what
    /// arrives waits, as an RC sender retries until its peer is ready.
    fn awaits_peer(st: &State) -> bool {
        st.bound.is_none() && st.conn.is_none() && !st.failed
    }

    fn rq_is_empty(&self, st: &State) -> bool {
        match self.srq.get() {
            Some(srq) => srq.empty_or_wait(self.slot, self.gen),
            None => st.rq.is_empty(),
        }
    }

    pub fn sq_depth(&self) -> u32 {
        self.sq_cap
    }

    pub fn rq_depth(&self) -> u32 {
        self.st.lock().rq.capacity()
    }

    pub fn sq_sig_all(&self) -> bool {
        self.sq_sig_all
    }

    pub fn is_transparent(&self) -> bool {
        self.app_qpn.get().is_some()
    }

    /// The posted receives, oldest first, taken out (a fallback to a real
    /// QP posts them there).
    pub fn take_receives(&self) -> Vec<(u64, Vec<ibv_sge>)> {
        let mut st = self.st.lock();
        let mut out = Vec::with_capacity(st.rq.len());
        while let Some(r) = st.rq.pop_front() {
            out.push((r.wr_id, r.sg_list.to_vec()));
        }
        out
    }

    /// `ibv_query_qp` on a transparent VQP: what `ibv_modify_qp` set.
    pub fn query_rc(&self) -> Option<ibv_qp_attr> {
        self.st.lock().rc.as_ref().map(RcShadow::query)
    }

    /// Whether messages of ours still need `link` (a large one being READ
    /// over it, or waiting for a receive): it cannot be closed yet.
    pub fn pins(&self, link: &Arc<Link>) -> bool {
        let st = self.st.lock();
        st.reading.as_ref().is_some_and(|r| Arc::ptr_eq(&r.link, link)) || st.held.iter().any(|h| h.origin.is_on(link))
    }

    /// Whether this VQP uses runtime `rt` (its PD's).
    /// The endpoint a connected VQP talks to: its peer's process and VQP.
    pub fn peer(&self) -> Option<Endpoint> {
        self.st.lock().conn.as_ref().map(|c| Endpoint { vqpn: c.dst, ..c.peer })
    }

    pub fn runtime_is(&self, rt: &Arc<Runtime>) -> bool {
        self.rt.get().is_some_and(|r| Arc::ptr_eq(r, rt))
    }

    pub fn is_bound(&self) -> bool {
        self.st.lock().bound.is_some()
    }

    /// Work on the send queue not completed yet (none once it is in error:
    /// what was outstanding has been reported flushed).
    pub fn sends_outstanding(&self) -> bool {
        let st = self.st.lock();
        !st.sq.is_error() && st.sq.outstanding() > 0
    }

    pub fn is_connected(&self) -> bool {
        self.st.lock().conn.is_some()
    }

    fn deliver(&self, cq: &CqSoft, c: Completion) {
        cq.push(c.to_wc(self.qpn()));
    }

    /// Tell the peer VQP that we are gone (a CLOSE header on the
    /// connection's link, or on the next one when that one closes, or a
    /// CLOSE on the datagram tier carrying our final ACKs), bounded by the
    /// connect timeout; best effort. Whether it carried the final ACKs.
    fn post_close(&self, rt: &Arc<Runtime>, h: &Header) -> bool {
        let deadline = std::time::Instant::now() + super::runtime::connect_timeout();
        while std::time::Instant::now() < deadline {
            match self.ensure_tier(rt, true) {
                Err(_) => break,
                Ok(Tier::Dgram(flow)) => {
                    if self.close_on_tier(rt, &flow) {
                        return true;
                    }
                    break;
                }
                Ok(Tier::Link) => {}
            }
            let Some(link) = self.st.lock().conn.as_ref().and_then(|c| c.open_link().cloned()) else { break };
            if post_header(rt, &link, h) {
                return false;
            }
            rt.progress();
            std::thread::yield_now();
        }
        klog!(Level::Warn, "vqp {:#x}: the peer VQP was not told of its destruction", self.vqpn);
        false
    }

    /// Destroy: unpublish a binding, flush what is outstanding, free the
    /// slot. Returns the VQPs made for senders (the caller frees them).
    pub fn destroy(&self) -> Vec<*mut ibv_qp> {
        if let Some((parent, key)) = self.parent.get() {
            // The application destroyed a src_qp itself.
            if let Some(p) = parent.upgrade() {
                let mut pst = p.st.lock();
                pst.src_qps.remove(key);
                pst.senders.forget(key);
            }
        }
        // RC's promise: once destroy returns, nothing touches the memory of
        // its WRs; they may still be on the link (teardown.rs).
        self.leave_agent();
        let unread = self.quiesce();
        let mut st = self.st.lock();
        let keys: Vec<_> = st.bound.take().into_iter().chain(std::mem::take(&mut st.published)).collect();
        // Only a VQP that bound or published asks for the meta connection
        // (which a process attached to its host's agent may not have).
        if let (false, Some(rt)) = (keys.is_empty(), self.rt.get()) {
            if let Ok(meta) = rt.meta() {
                meta.unbind_all(&keys);
            }
        }
        let mut out = Vec::new();
        st.sq.flush(&mut |c| out.push(c));
        st.rq.flush(&mut |c| out.push(c));
        let mut srcs: Vec<*mut ibv_qp> = st.src_qps.drain().map(|(_, q)| q).collect();
        srcs.append(&mut st.retired);
        // The VQP we talk to may release what it keeps for us: a src_qp,
        // made only for a sender of messages, and a flow of the datagram
        // tier, made for any work sent there (a VQP that only READ, WROTE
        // or used atomics over links has neither, and sends nothing).
        let close = match (&st.conn, self.parent.get()) {
            (Some(c), None) if st.sent_msgs || c.flow.is_some() => {
                Some(Header { flags: Flags::CLOSE, src_vqpn: self.vqpn, dst: c.dst, ..Header::default() })
            }
            _ => None,
        };
        drop(st);
        self.tell_unread(unread);
        if let Some(rt) = self.rt.get() {
            let carried = close.is_some_and(|h| self.post_close(rt, &h));
            if !carried {
                // What we received on the tier is acknowledged now.
                rt.dgram.final_acks(&**rt, self.vqpn, None);
            }
            self.detach_flow(rt, &mut self.st.lock());
            rt.dgram.forget_vqp(self.vqpn);
        }
        if let Some(Hdrs::Arena { arena, start }) = self.hdrs.get() {
            arena.free(*start, self.sq_cap.max(1));
        }
        let mut slots = SLOTS.lock();
        slots.entries[self.slot as usize].1 = Weak::new();
        slots.free.push(self.slot);
        crate::stats::sub(crate::stats::Stat::KRCORE_STAT_VQPS, 1);
        drop(slots);
        self.send_soft.remove_user();
        self.recv_soft.remove_user();
        srcs
    }
}

/// Post a bare header (DONE, CLOSE, LINK_CLOSE: inline, signaled) on
/// `link`; false when the link has no room now, or (a CLOSE: new work)
/// has started closing.
fn post_header(rt: &Runtime, link: &Link, h: &Header) -> bool {
    post_header_as(rt, link, h, |retired| Control::Header { retired })
}

/// [`post_header`], its completion doing what `control` says.
pub(super) fn post_header_as(rt: &Runtime, link: &Link, h: &Header, control: impl FnOnce(u16) -> Control) -> bool {
    post_header_with(rt, link, h, &[], control)
}

/// [`post_header_as`] with `payload` after the header (inline: at most
/// `LINK_INLINE` bytes in all). New work (a CLOSE, an MR check or answer)
/// never goes on a link that started closing.
pub(super) fn post_header_with(rt: &Runtime, link: &Link, h: &Header, payload: &[u8], control: impl FnOnce(u16) -> Control) -> bool {
    let mut sq = link.sq.lock();
    let new_work = h.flags.contains(Flags::CLOSE) || matches!(h.link_op(), Some(LinkOp::MrCheck | LinkOp::MrAnswer));
    if new_work && !link.is_open() {
        return false;
    }
    // No GRANT behind our LINK_CLOSE (checked and marked under the send
    // lock): the peer sends no new message on the link after it, and
    // destroys its end once it has it and its own LINK_CLOSE completed; a
    // GRANT that came after would find no QP there, fail
    // `IBV_WC_RETRY_EXC_ERR` some seconds later and take the peer for
    // gone (`vqp_reclaim`'s LRU case, once in CI: both ends' VQPs flushed).
    let link_close = h.link_op() == Some(LinkOp::Close);
    if h.link_op() == Some(LinkOp::Grant) && link.close_posted.load(Ordering::Acquire) {
        return false;
    }
    // A CLOSE is a message the peer's VQP holds: within the link's window.
    let cost = if h.flags.contains(Flags::CLOSE) { HEADER_LEN as u64 } else { 0 };
    if cost > 0 && !link.credit.try_send(cost) {
        return false;
    }
    let Some(d) = sq.try_post(true) else {
        link.credit.unsend(cost);
        return false;
    };
    let tag = rt.next_tag();
    rt.large.track(tag, control(d.retired));
    let mut bytes = [0u8; crate::service::LINK_INLINE as usize];
    let len = HEADER_LEN + payload.len();
    debug_assert!(len <= bytes.len());
    h.encode(bytes.first_chunk_mut().expect("LINK_INLINE holds a header"));
    bytes[HEADER_LEN..len].copy_from_slice(payload);
    let mut sge = ibv_sge { addr: bytes.as_mut_ptr() as u64, length: len as u32, lkey: 0 };
    // SAFETY: a plain C struct.
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = WrId::Control { tag }.encode();
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
    wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0 | ibv_send_flags::IBV_SEND_INLINE.0;
    // SAFETY: inline data is copied at post time; links allow LINK_INLINE.
    if let Err(e) = unsafe { link.qp.post_send(&mut wr) } {
        // The link is gone: the peer learns it from its own completions.
        klog!(Level::Warn, "vqp: cannot send a {:?} header: {e:?}", h.flags);
        rt.large.take(tag);
        link.credit.unsend(cost);
    }
    if link_close {
        link.close_posted.store(true, Ordering::Release);
    }
    true
}

/// [`post_header`], making progress while the link is full (bounded by
/// the connect timeout): for a VQP being destroyed, which cannot wait for
/// a later pump.
fn post_header_waiting(rt: &Runtime, link: &Link, h: &Header) {
    let deadline = std::time::Instant::now() + super::runtime::connect_timeout();
    while !post_header(rt, link, h) {
        if std::time::Instant::now() > deadline {
            klog!(Level::Warn, "vqp: no room on the link for a {:?} header", h.flags);
            return;
        }
        rt.progress();
        std::thread::yield_now();
    }
}

fn header_bytes(h: &Header) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    h.encode(&mut b);
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sender(gid: u8, vqpn: u32) -> Sender {
        Sender { gid: [gid; 16], qpn: 7, incarnation: 9, vqpn }
    }

    #[test]
    fn a_bound_vqp_takes_at_most_its_senders_per_gid_and_closed_ones_make_room() {
        let per_gid = crate::config::get().max_senders_per_gid as u32;
        let mut s = Senders::default();
        for v in 0..per_gid {
            assert!(s.admit(sender(1, v)));
        }
        assert!(!s.admit(sender(1, per_gid)), "one more of that GID");
        assert!(s.admit(sender(1, 0)), "a known sender is still taken");
        assert!(s.admit(sender(2, 0)), "another GID is not held up");
        s.forget(&sender(1, 3));
        s.forget(&sender(1, 3));
        assert!(s.admit(sender(1, per_gid)), "a closed sender made room");
        assert!(!s.admit(sender(1, per_gid + 1)));
        assert_eq!((s.refused, s.all.len(), s.per_gid[&[1; 16]]), (2, per_gid as usize + 1, per_gid as usize));
    }
}
