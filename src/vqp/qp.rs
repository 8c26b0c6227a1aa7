//! A virtual QP: what the application holds (`KRCORE_VQP`), backed by
//! software queues and, once bound or connected, by a link it shares with
//! every other VQP of this process that talks to the same peer.
//!
//! Where a work request goes: `post_send` pre-checks it (precheck.rs:
//! local MRs from mrs.rs, the peer's MRs from its MR table, READ once and
//! cached), records it in the VQP's send ring, and posts it on the link
//! with a wr_id that names this VQP, its sequence number and what the
//! physical completion retires (wrid.rs). SENDs carry a 32-byte header in
//! front of the payload (header.rs); the receiver's progress finds the
//! destination VQP from it and copies the payload into the buffer the
//! application posted. Completions come back through `Runtime::progress`
//! into the send ring, which emits the application's completions in order
//! into its CQ's software queue.
//!
//! Locks: a VQP's state, then its link's send-queue accounting; progress
//! takes each of them alone, never one inside the other, and never holds
//! a VQP's lock while waiting for progress.

use super::header::{Flags, Header, HEADER_LEN};
use super::large::Control;
use super::memo::{Memoized, MrMemo};
use super::mrs;
use super::precheck::{self, Caps, LocalMrs, RemoteMrs, SendWr, Verdict};
use super::queue::{Completion, RecvRing, SendEntry, SendRing};
use super::rc::{Effect, RcShadow};
use super::runtime::{coarse_ms, CqSoft, PeerMrs, Runtime, Sink, HDR_SLOT, MAX_MSG};
use super::srq::VSrq;
use super::wrid::{SendId, WrId};
use crate::error::{Errno, Result};
use crate::klog;
use crate::log::Level;
use crate::meta::mrtable::RemoteMrTable;
use crate::meta::table::Lookup;
use crate::meta::Endpoint;
use crate::rdma::{self, Region};
use crate::service::{Link, Path};
use crate::sys::*;
use once_cell::sync::OnceCell;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};

mod landing;
mod popmsgs;
mod teardown;
mod tier;

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
}

/// A message that arrived before the application posted a receive (or
/// behind a large one still being READ).
struct Held {
    header: Header,
    payload: Vec<u8>,
    origin: Origin,
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
    src_qps: HashMap<(u64, u32), *mut ibv_qp>,
    /// src_qps whose sender is gone, reported by the last `qpop_msgs`
    /// and destroyed at the next.
    retired: Vec<*mut ibv_qp>,
    /// The sender whose src_qp `qpop_msgs` is making (outside this lock):
    /// a link failure meanwhile reports it closed too.
    answering: Option<(u64, u32)>,
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
}

/// An entry of a bound VQP's inbox.
enum Inbox {
    /// A message: where it came from, the sending VQP, its completion.
    Msg(Origin, u32, ibv_wc),
    /// The sending VQP (incarnation, VQPN) was destroyed.
    Closed(u64, u32),
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
    parent: OnceCell<(Weak<Vqp>, (u64, u32))>,
    /// A transparent VQP's QPN as the application sees it (unique on its
    /// GID through the meta server; `vqpn` is only unique in the process).
    app_qpn: OnceCell<u32>,
    /// The virtual SRQ its receives come from, if created with one.
    srq: OnceCell<Arc<VSrq>>,
    /// `qpop_msgs` callers one at a time (a bound VQP's inbox has one
    /// consumer: a sender's src_qp is made once, before its CLOSE).
    popping: Mutex<()>,
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

    /// `qbind`: publish (gid, port) -> this VQP.
    pub fn bind(self: &Arc<Self>, gid: [u8; 16], port: u32) -> Result<()> {
        {
            let st = self.st.lock();
            if st.conn.is_some() || st.bound.is_some() {
                return Err(Errno::EINVAL);
            }
        }
        let dev_gid_index = {
            // SAFETY: a plain C union; the application's live real context.
            let probe = unsafe { rdma::Device::borrow(self.app.real_ctx, self.app.real_pd) }?;
            probe.gid_index(&gid)?
        };
        let rt = self.runtime(Some(dev_gid_index))?;
        let key = crate::meta::Key::Port { gid, port };
        let ep = Endpoint { vqpn: self.vqpn, ..rt.svc.endpoint() };
        rt.meta()?.bind(&key, &ep)?;
        self.st.lock().bound = Some(key);
        Ok(())
    }

    /// `qconnect`: look (gid, port) up and attach to the link to its process.
    pub fn connect(&self, gid: [u8; 16], port: u32) -> Result<()> {
        {
            let st = self.st.lock();
            if st.conn.is_some() || st.bound.is_some() || st.rc.is_some() {
                return Err(Errno::EINVAL);
            }
        }
        self.connect_to(&crate::meta::Key::Port { gid, port }, None)
    }

    /// Look `key` up and attach to the link to the process it names, from
    /// our GID at `sgid_index` to the key's GID (None: between the two
    /// processes' home GIDs).
    fn connect_to(&self, key: &crate::meta::Key, sgid_index: Option<u32>) -> Result<()> {
        let key = *key;
        let rt = self.runtime(None)?;
        let meta = rt.meta()?;
        // VQPs spread over the process's links to that peer by slot.
        let index = (self.slot % crate::config::get().links_per_peer) as u16;
        // An address (`qconnect`) may have been bound anew since it was
        // cached, by a process started after its binder died: the meta
        // server says who holds it now (one READ). A QPN key (RTR of a
        // transparent VQP) names one VQP for its life: cached.
        let fresh = matches!(key, crate::meta::Key::Port { .. });
        let first = if fresh { meta.lookup_fresh(&key) } else { meta.lookup(&key) };
        let mut ep = first?.ok_or(Errno(libc::ECONNREFUSED))?;
        let mut looked_again = false;
        loop {
            if let Some(pm) = self.peer_mrs.get() {
                // A VQP's pre-checks use one peer's MR table for its life:
                // a transparent VQP brought back from RESET reconnects only
                // to a VQP of the same process (documented limit).
                if !Arc::ptr_eq(pm, &rt.peer_mrs(ep.incarnation)) {
                    klog!(Level::Warn, "vqp {:#x}: reconnecting to another process after RESET is not supported", self.qpn());
                    return Err(Errno::EINVAL);
                }
            }
            let path = match (sgid_index, key) {
                (Some(sgid_index), crate::meta::Key::Vqpn { gid, .. }) => Path { sgid_index, dgid: gid },
                _ => rt.svc.default_path(&ep),
            };
            if crate::config::get().dgram {
                // No handshake: the first posts go on the datagram tier
                // while the link is made (tier.rs).
                self.attach_at(rt, None, ep, index, path, ep.vqpn);
                if crate::config::get().link_after == 0 {
                    Runtime::want_link(rt, ep, index, path);
                }
                return Ok(());
            }
            match rt.svc.link(&ep, index, path, super::runtime::connect_timeout()) {
                Ok(link) => {
                    self.attach(rt, link, ep, ep.vqpn);
                    return Ok(());
                }
                Err(e) if e.0 == libc::ETIMEDOUT || e.0 == libc::ECONNREFUSED => {
                    // The cached endpoint may be stale: ask the meta server
                    // again. Gone: ECONNREFUSED; another process bound
                    // there now: try it (once); the same one, bound but
                    // not answering: ETIMEDOUT.
                    meta.invalidate(&key);
                    if looked_again {
                        return Err(e);
                    }
                    looked_again = true;
                    match meta.lookup(&key)? {
                        None => return Err(Errno(libc::ECONNREFUSED)),
                        Some(now) if now == ep => return Err(Errno(libc::ETIMEDOUT)),
                        Some(now) => ep = now,
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The QPN the application sees.
    #[inline]
    pub fn qpn(&self) -> u32 {
        self.app_qpn.get().copied().unwrap_or(self.vqpn)
    }

    /// Make this new VQP a transparent RC QP (`KRCORE_VIRTUALIZE`): in
    /// RESET, with a QPN of its own, random with bit 23 set (above every
    /// real QPN of rxe and mlx5), published on the process's GID so that
    /// a peer's RTR naming it resolves here. Returns that QPN.
    /// `real_qpn`: publish that QPN instead (`KRCORE_VIRTUALIZE=auto`: the
    /// number of the real QP kept for a fallback, unique on the device).
    ///
    /// The QPN is published under every distinct usable GID of the port:
    /// the application advertises the GID of the `sgid_index` it picks at
    /// RTR, and its peer may resolve it before that (ibv_rc_pingpong's
    /// server does its RTR before it sends its own address).
    pub fn make_transparent(&self, real_qpn: Option<u32>) -> Result<u32> {
        let rt = self.runtime(None)?;
        let meta = rt.meta()?;
        let ep = Endpoint { vqpn: self.vqpn, ..rt.svc.endpoint() };
        'draw: for _ in 0..32 {
            let qpn = real_qpn.unwrap_or_else(|| 0x80_0000 | (rdma::random_u64() as u32 & 0x7f_ffff));
            let keys: Vec<_> = rt.gids().iter().map(|&gid| crate::meta::Key::Vqpn { gid, vqpn: qpn }).collect();
            match meta.bind_all(&keys, &ep) {
                Ok(()) => {}
                // Taken on a GID (by another process), or its place in the
                // table is full: draw again.
                Err(e) if real_qpn.is_none() && (e.0 == libc::EADDRINUSE || e.0 == libc::ENOSPC) => continue 'draw,
                Err(e) => return Err(e),
            }
            let mut st = self.st.lock();
            st.rc = Some(RcShadow::default());
            st.published = keys;
            let _ = self.app_qpn.set(qpn);
            return Ok(qpn);
        }
        Err(Errno(libc::EADDRINUSE))
    }

    /// Take receives from `srq` instead of an own receive queue.
    pub fn set_srq(&self, srq: Arc<VSrq>) {
        let _ = self.srq.set(srq);
    }

    /// Whether no receive is posted for the next message. On an SRQ the
    /// VQP then waits for the SRQ's next post (checked and registered
    /// under the SRQ's lock: a post in between cannot miss it).
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

    /// `ibv_modify_qp` on a transparent VQP: the RC state machine, and at
    /// RTR the attachment to the peer's VQP (looked up by its GID and
    /// QPN). A refused call changes nothing.
    pub fn modify_rc(&self, attr: &ibv_qp_attr, mask: u32) -> Result<()> {
        let mut next = {
            let st = self.st.lock();
            st.rc.as_ref().ok_or(Errno::EINVAL)?.clone()
        };
        match next.modify(attr, mask)? {
            Effect::Connect { dgid, dest_qpn, sgid_index } => {
                let key = crate::meta::Key::Vqpn { gid: dgid, vqpn: dest_qpn };
                if let Err(e) = self.connect_to(&key, Some(sgid_index)) {
                    klog!(
                        Level::Warn,
                        "vqp {:#x}: RTR: no VQP {dest_qpn:#x} on GID {dgid:02x?} resolves (its process must run krcore with KRCORE_VIRTUALIZE and the same KRCORE_META): {e:?}",
                        self.qpn()
                    );
                    return Err(e);
                }
            }
            Effect::Flush => {
                // Sends still on the link report their flush once it
                // completed them (teardown.rs); receives at once.
                let mut out = Vec::new();
                let mut st = self.st.lock();
                let held = self.flush_sends(&mut st, &mut |c| out.push((true, c)));
                st.rq.flush(&mut |c| out.push((false, c)));
                st.rc = Some(next);
                drop(st);
                for (send, c) in out {
                    self.deliver(if send { &self.send_soft } else { &self.recv_soft }, c);
                }
                if held {
                    self.watch_held();
                }
                return Ok(());
            }
            Effect::Reset => {
                // Nothing of ours may be in flight once RESET returns.
                let unread = self.quiesce();
                let mut st = self.st.lock();
                st.sq.revive();
                st.rq.flush(&mut |_| {});
                st.held.clear();
                if let Some(rt) = self.rt.get() {
                    self.detach_flow(rt, &mut st);
                }
                st.conn = None;
                st.failed = false;
                st.memo = MrMemo::default();
                st.wire = None;
                st.torn_down = false;
                st.rc = Some(next);
                drop(st);
                self.tell_unread(unread);
                return Ok(());
            }
            Effect::Ready | Effect::None => {}
        }
        self.st.lock().rc = Some(next);
        Ok(())
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

    /// Connect to `dst` on the far side of `link` (qconnect, or a VQP
    /// made for `qpop_msgs` to answer a sender).
    fn attach(&self, rt: &Runtime, link: Arc<Link>, peer: Endpoint, dst: u32) {
        let (index, path) = (link.index, link.path);
        self.attach_at(rt, Some(link), peer, index, path, dst);
    }

    /// [`Self::attach`], to link `index` of `peer`; without a link (None)
    /// the first post makes or finds one, or takes the datagram tier
    /// ([`Self::ensure_tier`]).
    fn attach_at(&self, rt: &Runtime, link: Option<Arc<Link>>, peer: Endpoint, index: u16, path: Path, dst: u32) {
        let _ = self.peer_mrs.set(rt.peer_mrs(peer.incarnation));
        self.st.lock().conn = Some(Conn { link, peer, index, path, dst, flow: None });
    }

    /// A new link to our peer could not be made: as an RC QP whose retries
    /// ran out, the VQP enters the error state.
    fn fail_unreachable(&self, e: Errno) {
        klog!(Level::Warn, "vqp {:#x}: its peer cannot be reached again ({e:?}): error state", self.vqpn);
        let mut st = self.st.lock();
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        let held = self.flush_sends(&mut st, &mut |c| sends.push(c));
        st.conn = None;
        st.failed = true;
        if let Some(rc) = st.rc.as_mut() {
            rc.fail();
        }
        self.flush_receives_if_failed(&mut st, &mut recvs);
        drop(st);
        sends.into_iter().for_each(|c| self.deliver(&self.send_soft, c));
        recvs.into_iter().for_each(|c| self.deliver(&self.recv_soft, c));
        if held {
            self.watch_held();
        }
    }

    /// Link `link` was closed (both sides done with it): a connection on
    /// it lets it go, and takes another at its next post.
    pub fn on_link_closed(&self, link: &Arc<Link>) {
        let mut st = self.st.lock();
        if let Some(c) = st.conn.as_mut().filter(|c| c.is_on(link)) {
            c.link = None;
        }
    }

    /// Whether messages of ours still need `link` (a large one being READ
    /// over it, or waiting for a receive): it cannot be closed yet.
    pub fn pins(&self, link: &Arc<Link>) -> bool {
        let st = self.st.lock();
        st.reading.as_ref().is_some_and(|r| Arc::ptr_eq(&r.link, link)) || st.held.iter().any(|h| h.origin.is_on(link))
    }

    /// Whether this VQP uses runtime `rt` (its PD's).
    pub fn runtime_is(&self, rt: &Arc<Runtime>) -> bool {
        self.rt.get().is_some_and(|r| Arc::ptr_eq(r, rt))
    }

    pub fn is_bound(&self) -> bool {
        self.st.lock().bound.is_some()
    }

    pub fn is_connected(&self) -> bool {
        self.st.lock().conn.is_some()
    }

    /// `ibv_post_send`.
    ///
    /// # Safety
    /// `wr` is a valid chain of the application's, `bad` valid for writes.
    pub unsafe fn post_send(&self, mut wr: *mut ibv_send_wr, bad: *mut *mut ibv_send_wr) -> i32 {
        while !wr.is_null() {
            // SAFETY: caller contract.
            if let Err(e) = unsafe { self.post_one(&*wr) } {
                // SAFETY: caller contract.
                unsafe { *bad = wr };
                return e.0;
            }
            // SAFETY: caller contract.
            wr = unsafe { (*wr).next };
        }
        0
    }

    /// # Safety
    /// `w` and its SGE list are the application's valid WR.
    unsafe fn post_one(&self, w: &ibv_send_wr) -> Result<()> {
        // SAFETY: caller contract.
        if let Some(done) = unsafe { self.post_one_sided_fast(w) } {
            return done;
        }
        let Some(rt) = self.rt.get() else { return Err(Errno::EINVAL) };
        // SAFETY: caller contract.
        let sw = unsafe { self.send_wr(w) }?;
        let sges = sw.sge;
        let signaled = self.sq_sig_all || w.send_flags & ibv_send_flags::IBV_SEND_SIGNALED.0 != 0;
        let total: u32 = sges.iter().map(|s| s.length).sum();
        let is_send = matches!(w.opcode, ibv_wr_opcode::IBV_WR_SEND | ibv_wr_opcode::IBV_WR_SEND_WITH_IMM);
        let wc_opcode = wc_opcode_of(w.opcode);
        let mut staged = None;
        let mut fetched = false;
        // One pass under the VQP's lock when nothing is missing; what must
        // wait (the peer's MR table, staging, room on the link) is done
        // without it, and the pass starts over.
        loop {
            let mut guard = self.st.lock();
            let st = &mut *guard;
            // A transparent VQP posts from RTS on, as a real RC QP.
            match st.rc.as_ref().map(RcShadow::state) {
                // As an RC QP in ERR: accepted, then flushed.
                Some(ibv_qp_state::IBV_QPS_ERR) => {
                    return self.accept_flushed(
                        guard,
                        SendEntry { wr_id: w.wr_id, signaled: true, opcode: wc_opcode, byte_len: total, awaits_done: false },
                    );
                }
                Some(_) if !st.rc.as_ref().is_some_and(RcShadow::can_send) => return Err(Errno::EINVAL),
                _ if st.failed => {
                    return self.accept_flushed(
                        guard,
                        SendEntry { wr_id: w.wr_id, signaled: true, opcode: wc_opcode, byte_len: total, awaits_done: false },
                    );
                }
                _ => {}
            }
            if st.conn.as_ref().is_some_and(|c| c.open_link().is_none()) {
                drop(guard);
                match self.ensure_tier(rt, tier::tier_carries(w, total)) {
                    Ok(Tier::Link) => {}
                    Ok(Tier::Dgram(flow)) => {
                        // SAFETY: caller contract.
                        if unsafe { self.post_on_tier(rt, &flow, w, &sw) }? {
                            return Ok(());
                        }
                    }
                    Err(e) => self.fail_unreachable(e),
                }
                continue;
            }
            let Some(mut guard) = self.precheck_fetching(rt, guard, &sw, &mut fetched)? else { continue };
            let st = &mut *guard;
            let Some(conn) = &st.conn else { return Err(Errno::EINVAL) };
            let Some(link) = conn.link.as_ref() else { continue };
            // Above a receive buffer the receiver READs the payload: stage
            // it (a copy into a registered buffer) outside the lock.
            if is_send && total as usize > MAX_MSG && staged.is_none() {
                let qpn = link.qp.qpn();
                drop(guard);
                staged = Some(rt.large.stage(rt.svc.device(), qpn, sges, total as usize)?);
                continue;
            }
            if st.sq.outstanding() >= self.sq_cap as usize {
                return Err(Errno::ENOMEM);
            }
            if st.sq.is_error() {
                // As an RC QP in error: accepted, then flushed.
                return self.accept_flushed(
                    guard,
                    SendEntry { wr_id: w.wr_id, signaled: true, opcode: wc_opcode, byte_len: total, awaits_done: false },
                );
            }
            let wire_link = link;
            let (link, dst) = (&**link, conn.dst);
            let mut sq = link.sq.lock();
            if !link.is_open() {
                // Closing since: nothing new goes behind its LINK_CLOSE.
                continue;
            }
            // WRITE_WITH_IMM is a WRITE and a notification SEND: two WQEs.
            let need = if w.opcode == ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM { 2 } else { 1 };
            if link.qp.caps.send_wr as usize - sq.outstanding() < need {
                drop(sq);
                drop(guard);
                rt.progress();
                std::thread::yield_now();
                continue;
            }
            let entry = SendEntry { wr_id: w.wr_id, signaled, opcode: wc_opcode, byte_len: total, awaits_done: staged.is_some() };
            let seq = st.sq.push(entry)?;
            st.sent_msgs |= is_send || w.opcode == ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
            klog!(Level::Debug, "vqp {:#x}: post opcode {} len {total} seq {seq} to {dst:#x}", self.vqpn, w.opcode);
            let large = staged.as_ref().map(|s| (s.addr(), s.rkey()));
            if let Some(s) = staged.take() {
                crate::stats::inc(crate::stats::Stat::KRCORE_STAT_LARGE_SENT);
                rt.large.sent(s, self.slot, self.gen, seq, link.qp.qpn());
            }
            let r = self.post_physical(link, &mut sq, w, sges, seq, signaled, dst, total, large);
            note_wire(&mut st.wire, wire_link, sq.mark());
            if let Err(e) = r {
                if let Some((addr, _)) = large {
                    rt.large.unsend(addr);
                }
                self.link_refused(&mut st.sq, seq, e);
            }
            return Ok(());
        }
    }

    /// Pre-check `sw` under the VQP's lock (`guard`), given back when it
    /// passes. An rkey neither the memo nor the peer's table as last read
    /// knows makes one READ of that table, without the lock: `Ok(None)`,
    /// check again; still unknown after it (`fetched`), the peer has no
    /// such MR: EINVAL.
    fn precheck_fetching<'g>(
        &self,
        rt: &Runtime,
        guard: parking_lot::MutexGuard<'g, State>,
        sw: &SendWr<'_>,
        fetched: &mut bool,
    ) -> Result<Option<parking_lot::MutexGuard<'g, State>>> {
        let Some(conn) = &guard.conn else { return Err(Errno::EINVAL) };
        match self.precheck(&guard.memo, sw) {
            Ok(()) => Ok(Some(guard)),
            Err(Verdict::Reject(r)) => {
                klog!(Level::Debug, "vqp {:#x}: rejected a work request: {r}", self.vqpn);
                Err(r.errno())
            }
            Err(Verdict::NeedRemote { rkey }) => {
                // A closing link takes no new READ: look again once the
                // connection has an open one.
                let Some(link) = conn.open_link().cloned() else { return Ok(None) };
                drop(guard);
                let known = if *fetched { Ok(false) } else { self.fetch_remote(rt, &link, rkey) };
                match known {
                    Ok(true) => {
                        *fetched = true;
                        Ok(None)
                    }
                    Ok(false) => {
                        klog!(Level::Debug, "vqp {:#x}: rkey {rkey:#x} unknown to the peer", self.vqpn);
                        Err(Errno::EINVAL)
                    }
                    // The network never fails a post. The link began
                    // closing (the post moves to the next link), the READ
                    // failed and its link with it (the VQP enters the error
                    // state: the post is flushed), or the peer's table was
                    // being rewritten: look again.
                    Err(e) if matches!(e.0, libc::ENOTCONN | libc::EIO | libc::EAGAIN) => Ok(None),
                    // No answer within the transport's retries: as an RC
                    // QP whose retries ran out.
                    Err(e) => {
                        self.fail_unreachable(e);
                        Ok(None)
                    }
                }
            }
        }
    }

    /// A WR posted to a send queue in the error state: accepted and
    /// completed at once with `IBV_WC_WR_FLUSH_ERR`, as by an RC QP.
    fn accept_flushed(&self, mut guard: parking_lot::MutexGuard<'_, State>, entry: SendEntry) -> Result<()> {
        let st = &mut *guard;
        st.sq.push(entry)?;
        let mut out = Vec::new();
        st.sq.take_flushed(&mut |c| out.push(c));
        if !st.held_sends.is_empty() {
            // Behind flushes held for the link (teardown.rs): in order.
            st.held_sends.append(&mut out);
            return Ok(());
        }
        drop(guard);
        out.into_iter().for_each(|c| self.deliver(&self.send_soft, c));
        Ok(())
    }

    /// The pre-checks' view of the application's WR; EINVAL for an SGE
    /// count beyond the caps (never made into a slice).
    ///
    /// # Safety
    /// `w` and its SGE list are the application's valid WR.
    unsafe fn send_wr<'a>(&self, w: &'a ibv_send_wr) -> Result<SendWr<'a>> {
        if w.num_sge < 0 || w.num_sge as u32 > self.caps.max_send_sge || (w.num_sge > 0 && w.sg_list.is_null()) {
            return Err(Errno::EINVAL);
        }
        // SAFETY: num_sge entries of the application's list (checked above).
        let sges: &[ibv_sge] = if w.num_sge == 0 { &[] } else { unsafe { std::slice::from_raw_parts(w.sg_list, w.num_sge as usize) } };
        // SAFETY: the union member the opcode names.
        let (remote_addr, rkey) = unsafe {
            if is_atomic(w.opcode) {
                (w.wr.atomic.remote_addr, w.wr.atomic.rkey)
            } else {
                (w.wr.rdma.remote_addr, w.wr.rdma.rkey)
            }
        };
        Ok(SendWr { opcode: w.opcode, send_flags: w.send_flags, sge: sges, remote_addr, rkey })
    }

    /// `ibv_wr_complete`: post a batch of `n` requests built by the
    /// `ibv_wr_*` builders, all or nothing as far as the pre-checks can
    /// tell. Every request is pre-checked first (the peer's MR table READ
    /// where needed) and the send queue must have room for all of them:
    /// the first failure returns its errno with nothing posted. Then the
    /// batch goes through [`Vqp::post_send`]. What the pre-checks cannot
    /// foresee (an MR the batch uses deregistered, or the queue filled by
    /// another thread's `ibv_post_send`, in between; staging memory for a
    /// message above 4 KiB not available) fails there, with the requests
    /// before the failing one posted.
    ///
    /// # Safety
    /// `head` is a valid chain of `n` requests with their SGE lists.
    pub unsafe fn post_batch(&self, head: *mut ibv_send_wr, n: usize) -> i32 {
        // One request: post_send is already all or nothing.
        if n > 1 {
            // SAFETY: caller contract.
            if let Err(e) = unsafe { self.check_batch(head, n) } {
                return e.0;
            }
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: caller contract.
        unsafe { self.post_send(head, &mut bad) }
    }

    /// The checks of [`Vqp::post_batch`], posting nothing.
    ///
    /// # Safety
    /// As [`Vqp::post_batch`].
    unsafe fn check_batch(&self, head: *mut ibv_send_wr, n: usize) -> Result<()> {
        let Some(rt) = self.rt.get() else { return Err(Errno::EINVAL) };
        {
            let st = self.st.lock();
            if st.rc.as_ref().is_some_and(|rc| rc.state() == ibv_qp_state::IBV_QPS_ERR) {
                // Accepted and flushed, each of them.
                return Ok(());
            }
            if st.rc.as_ref().is_some_and(|rc| !rc.can_send()) || st.conn.is_none() {
                return Err(Errno::EINVAL);
            }
            if st.sq.outstanding() + n > self.sq_cap as usize {
                return Err(Errno::ENOMEM);
            }
        }
        let mut wr = head;
        while !wr.is_null() {
            // SAFETY: caller contract.
            let w = unsafe { &*wr };
            // SAFETY: as above.
            let sw = unsafe { self.send_wr(w) }?;
            let mut fetched = false;
            while self.precheck_fetching(rt, self.st.lock(), &sw, &mut fetched)?.is_none() {
                match self.ensure_tier(rt, true) {
                    Ok(Tier::Link) => {}
                    // The target checks the remote side (the local one is
                    // checked at the post).
                    Ok(Tier::Dgram(_)) => break,
                    Err(e) => {
                        // Accepted, then flushed (the VQP is in error now).
                        self.fail_unreachable(e);
                        return Ok(());
                    }
                }
            }
            wr = w.next;
        }
        Ok(())
    }

    /// The common one-sided request, a READ or WRITE of one SGE without
    /// inline data, when both its MRs are known (the VQP's memo, else the
    /// registry and the peer's MRStore) and the VQP and its link have
    /// room: one short pass under the VQP's lock (the general path's
    /// bookkeeping was most of a post's cost). A new VQP's first request
    /// takes it too: under emulation, code run once per VQP is slow code.
    /// `None`: nothing was done, take the general path (which fetches an
    /// unknown remote MR, or rejects).
    ///
    /// # Safety
    /// `w` and its SGE list are the application's valid WR.
    #[inline]
    unsafe fn post_one_sided_fast(&self, w: &ibv_send_wr) -> Option<Result<()>> {
        const FLAGS: u32 = ibv_send_flags::IBV_SEND_SIGNALED.0 | ibv_send_flags::IBV_SEND_FENCE.0;
        if w.num_sge != 1
            || w.sg_list.is_null()
            || w.send_flags & !FLAGS != 0
            || !matches!(w.opcode, ibv_wr_opcode::IBV_WR_RDMA_READ | ibv_wr_opcode::IBV_WR_RDMA_WRITE)
        {
            return None;
        }
        // SAFETY: the application's one SGE (caller contract, checked above).
        let sge = unsafe { &*w.sg_list };
        // SAFETY: the union member of READ and WRITE.
        let (remote_addr, rkey) = unsafe { (w.wr.rdma.remote_addr, w.wr.rdma.rkey) };
        let mut guard = self.st.lock();
        let st = &mut *guard;
        let conn = st.conn.as_ref()?;
        if st.sq.is_error() || st.sq.outstanding() >= self.sq_cap as usize || st.rc.as_ref().is_some_and(|rc| !rc.can_send()) {
            return None;
        }
        let mrs = self.mrs(&st.memo);
        let local = mrs.local(sge.lkey)?;
        let remote = mrs.remote(rkey)?;
        if !precheck::one_sided_ok(w.opcode, sge, remote_addr, &self.dev_caps(), &local, &remote) {
            return None;
        }
        let wire_link = conn.link.as_ref()?;
        let (link, dst) = (&**wire_link, conn.dst);
        let mut sq = link.sq.lock();
        if sq.outstanding() >= link.qp.caps.send_wr as usize || !link.is_open() {
            return None;
        }
        let signaled = self.sq_sig_all || w.send_flags & ibv_send_flags::IBV_SEND_SIGNALED.0 != 0;
        let entry = SendEntry { wr_id: w.wr_id, signaled, opcode: wc_opcode_of(w.opcode), byte_len: sge.length, awaits_done: false };
        let seq = match st.sq.push(entry) {
            Ok(seq) => seq,
            Err(e) => return Some(Err(e)),
        };
        klog!(Level::Debug, "vqp {:#x}: post opcode {} len {} seq {seq} to {dst:#x}", self.vqpn, w.opcode, sge.length);
        let r = self.post_physical(link, &mut sq, w, std::slice::from_ref(sge), seq, signaled, dst, sge.length, None);
        note_wire(&mut st.wire, wire_link, sq.mark());
        if let Err(e) = r {
            self.link_refused(&mut st.sq, seq, e);
        }
        Some(Ok(()))
    }

    /// The link refused the WQE of entry `seq`: it completes in error.
    fn link_refused(&self, sq: &mut SendRing, seq: u16, e: Errno) {
        let mut emit = |c: Completion| self.deliver(&self.send_soft, c);
        let _ = sq.complete(seq, ibv_wc_status::IBV_WC_GENERAL_ERR, &mut emit);
        klog!(Level::Warn, "vqp {:#x}: posting on the link failed: {e:?}", self.vqpn);
    }

    /// Post the WQE(s) of one application WR on the link (its accounting
    /// lock held, so that decisions are in posting order).
    #[allow(clippy::too_many_arguments)]
    fn post_physical(
        &self,
        link: &Link,
        sq: &mut super::queue::PhysSq,
        w: &ibv_send_wr,
        sges: &[ibv_sge],
        seq: u16,
        signaled: bool,
        dst: u32,
        total: u32,
        large: Option<(u64, u32)>,
    ) -> Result<()> {
        link.touch();
        // SAFETY: a plain C struct.
        let mut p: ibv_send_wr = unsafe { std::mem::zeroed() };
        let mut list = [ibv_sge { addr: 0, length: 0, lkey: 0 }; crate::service::LINK_SEND_SGE as usize];
        let is_send = matches!(w.opcode, ibv_wr_opcode::IBV_WR_SEND | ibv_wr_opcode::IBV_WR_SEND_WITH_IMM);
        let inline = w.send_flags & ibv_send_flags::IBV_SEND_INLINE.0 != 0;
        if w.opcode == ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM {
            // The data first, then the notification (RC order: the data
            // lands before the receiver learns of it). A forced signal on
            // the WRITE retires what came before this WR only.
            let d = sq.try_post(false).ok_or(Errno::ENOMEM)?;
            let id = SendId::new(self.slot, self.gen, seq.wrapping_sub(1), wire_retired(&d), true)?;
            // SAFETY: a plain C struct.
            let mut write: ibv_send_wr = unsafe { std::mem::zeroed() };
            // Inline data goes behind the header's bytes of the slot: the
            // header is written there right after this post, while the NIC
            // may still be reading the WRITE's data.
            let n = self.fill_sges_at(&mut list, sges, inline, seq, &[], HEADER_LEN)?;
            write.wr_id = WrId::Send(id).encode();
            write.sg_list = list.as_mut_ptr();
            write.num_sge = n;
            write.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            write.send_flags = if d.signal { ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
            // SAFETY: the union member the opcode names.
            unsafe { write.wr.rdma = w.wr.rdma };
            // SAFETY: a WR over checked memory (pre-checks) and our header slot.
            unsafe { link.qp.post_send(&mut write) }?;
            // SAFETY: the union member the opcode names.
            let imm = unsafe { w.imm_data_invalidated_rkey_union.imm_data };
            let h = Header { flags: Flags::WRITE_IMM | Flags::HAS_IMM, src_vqpn: self.vqpn, dst, imm, len: total, ..Header::default() };
            let n = self.fill_sges(&mut list, &[], false, seq, &header_bytes(&h))?;
            p.sg_list = list.as_mut_ptr();
            p.num_sge = n;
            p.opcode = ibv_wr_opcode::IBV_WR_SEND;
        } else if is_send {
            let mut h = Header { src_vqpn: self.vqpn, dst, len: total, ..Header::default() };
            if w.opcode == ibv_wr_opcode::IBV_WR_SEND_WITH_IMM {
                h.flags |= Flags::HAS_IMM;
                // SAFETY: the union member the opcode names.
                h.imm = unsafe { w.imm_data_invalidated_rkey_union.imm_data };
            }
            if w.send_flags & ibv_send_flags::IBV_SEND_SOLICITED.0 != 0 {
                h.flags |= Flags::SOLICITED;
            }
            // A large message's payload stays behind, staged.
            let payload = match large {
                Some((addr, rkey)) => {
                    h.flags |= Flags::LARGE;
                    (h.addr, h.rkey) = (addr, rkey);
                    &[][..]
                }
                None => sges,
            };
            let n = self.fill_sges(&mut list, payload, inline, seq, &header_bytes(&h))?;
            p.sg_list = list.as_mut_ptr();
            p.num_sge = n;
            p.opcode = ibv_wr_opcode::IBV_WR_SEND;
        } else if !inline && sges.iter().all(|s| s.length > 0) {
            // One-sided over the application's SGEs as they are (pre-checked;
            // the provider reads the list during the post only).
            p.sg_list = w.sg_list;
            p.num_sge = w.num_sge;
            p.opcode = w.opcode;
            // SAFETY: rdma and atomic share the union; copy it whole.
            unsafe { std::ptr::copy_nonoverlapping(&w.wr, &mut p.wr, 1) };
        } else {
            let n = self.fill_sges(&mut list, sges, inline, seq, &[])?;
            p.sg_list = list.as_mut_ptr();
            p.num_sge = n;
            p.opcode = w.opcode;
            // SAFETY: rdma and atomic share the union; copy it whole.
            unsafe { std::ptr::copy_nonoverlapping(&w.wr, &mut p.wr, 1) };
        }
        let d = sq.try_post(signaled).ok_or(Errno::ENOMEM)?;
        p.wr_id = WrId::Send(SendId::new(self.slot, self.gen, seq, wire_retired(&d), d.forced)?).encode();
        p.send_flags = if d.signal { ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 } | (w.send_flags & ibv_send_flags::IBV_SEND_FENCE.0);
        // SAFETY: a WR over checked memory (pre-checks) and our header slot.
        unsafe { link.qp.post_send(&mut p) }
    }

    /// The physical SGE list: the header (and inline data, copied behind
    /// it) in this WR's header slot, then the application's SGEs.
    fn fill_sges(&self, list: &mut [ibv_sge], sges: &[ibv_sge], inline: bool, seq: u16, header: &[u8]) -> Result<i32> {
        self.fill_sges_at(list, sges, inline, seq, header, 0)
    }

    /// [`Vqp::fill_sges`] from `skip` bytes into the slot (a header-less
    /// WR whose slot also carries a header posted after it; the header
    /// plus `skip` must fit the slot: `skip <= HEADER_LEN`).
    fn fill_sges_at(&self, list: &mut [ibv_sge], sges: &[ibv_sge], inline: bool, seq: u16, header: &[u8], skip: usize) -> Result<i32> {
        debug_assert!(skip <= HEADER_LEN && (skip == 0 || header.is_empty()));
        let mut n = 0;
        if header.is_empty() && !inline {
            // One-sided without inline data: the application's SGEs only
            // (no header slots taken).
            for s in sges.iter().filter(|s| s.length > 0) {
                list[n] = *s;
                n += 1;
            }
            return Ok(n as i32);
        }
        let rt = self.rt.get().ok_or(Errno::EINVAL)?;
        let (hdrs, base) = self.hdrs(rt)?;
        let off = base + (seq as usize % self.sq_cap.max(1) as usize) * HDR_SLOT + skip;
        let mut used = 0;
        if !header.is_empty() {
            // SAFETY: this WR's slot: the ring holds at most sq_cap WRs, so
            // the slot's previous WR has completed.
            unsafe { hdrs.bytes_mut(off, header.len()) }.copy_from_slice(header);
            used = header.len();
        }
        if inline {
            // A zero-length SGE may have any address, NULL included: it is
            // never made into a slice.
            for s in sges.iter().filter(|s| s.length > 0) {
                // SAFETY: inline data is read from the application's
                // addresses at post time, as verbs does (non-empty here).
                let src = unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.length as usize) };
                // SAFETY: within the slot: inline total <= MAX_INLINE after
                // at most HEADER_LEN bytes (a header, or `skip`).
                unsafe { hdrs.bytes_mut(off + used, src.len()) }.copy_from_slice(src);
                used += src.len();
            }
        }
        if used > 0 {
            list[0] = hdrs.sge(off, used);
            n = 1;
        }
        if !inline {
            for s in sges.iter().filter(|s| s.length > 0) {
                list[n] = *s;
                n += 1;
            }
        }
        Ok(n as i32)
    }

    /// The pre-checks, through the VQP's memo of the MRs it used last
    /// (the VQP's lock held: the memo is part of its state).
    fn precheck(&self, memo: &MrMemo, sw: &SendWr<'_>) -> std::result::Result<(), Verdict> {
        let mrs = self.mrs(memo);
        precheck::check_send(sw, &self.dev_caps(), &mrs, &mrs)
    }

    /// The caps the pre-checks apply: the granted ones on the device of
    /// the runtime (its port's `max_msg_sz`, its `atomic_cap`).
    #[inline]
    fn dev_caps(&self) -> Caps {
        match self.rt.get() {
            Some(rt) => {
                let d = rt.svc.device();
                self.caps.on_device(d.port_attr.max_msg_sz, d.dev_attr.atomic_cap)
            }
            None => self.caps,
        }
    }

    /// The MRs as this VQP's pre-checks see them: its memo, then the
    /// process's registry and the peer's MRStore.
    #[allow(clippy::type_complexity)]
    fn mrs<'a>(
        &'a self,
        memo: &'a MrMemo,
    ) -> Memoized<'a, impl Fn(u32) -> Option<precheck::MrInfo> + 'a, impl Fn(u32) -> Option<(precheck::MrInfo, u64)> + 'a, fn() -> u64>
    {
        // Set before the connection (fetch_remote fails without it).
        let pm = self.peer_mrs.get();
        let pd = self.app.real_pd as usize;
        Memoized {
            memo,
            epoch: mrs::epoch(),
            lease_ms: crate::config::get().mr_lease_ms,
            local: move |lkey| registry_local(pd, lkey),
            remote: move |rkey| pm.and_then(|pm| peer_remote(pm, rkey)),
            now: coarse_ms,
        }
    }

    /// READ the peer's MR table entry for `rkey` into the cache; whether
    /// the peer has it.
    fn fetch_remote(&self, rt: &Runtime, link: &Link, rkey: u32) -> Result<bool> {
        let pm = self.peer_mrs.get().ok_or(Errno::EINVAL)?;
        let scratch = rt.scratch.lock();
        let (addr, trkey, slots) = link.peer_mr_table;
        let cached = pm.lock().table;
        let table = match cached {
            Some(t) => t,
            None => {
                // The link's handshake told us what the header holds: no
                // READ of it (one round trip less on the first post).
                let t = RemoteMrTable::known(slots, link.peer.incarnation)?;
                pm.lock().table = Some(t);
                t
            }
        };
        let (off, len) = table.neighborhood(rkey);
        for _ in 0..64 {
            // The lease counts from the READ's post (the owner counts from
            // its deregistration, which may come right after our READ).
            let posted = coarse_ms();
            rt.control_read(link, &scratch, addr + off, trkey, len)?;
            // SAFETY: as above.
            match table.lookup_in(unsafe { scratch.bytes(0, len) }, rkey) {
                Lookup::Found(info) => {
                    pm.lock().learn(rkey, info, posted);
                    return Ok(true);
                }
                Lookup::Absent => return Ok(false),
                Lookup::Torn => continue,
            }
        }
        Err(Errno(libc::EAGAIN))
    }

    /// A physical completion of one of our WRs (progress).
    /// Also retires `retired` WQEs of the link it came on when that is
    /// this VQP's link; whether it did.
    #[inline]
    pub fn on_send_completion(&self, seq: u16, status: u32, link_qpn: u32, retired: u16, mut sink: Option<&mut Sink<'_>>) -> bool {
        // Delivered under the VQP's lock (then the CQ's), as receives are.
        let mut st = self.st.lock();
        let accounted = match &st.conn {
            Some(Conn { link: Some(link), .. }) if link.qp.qpn() == link_qpn => {
                if let Err(e) = link.sq.lock().on_completion(retired) {
                    klog!(Level::Warn, "vqp: link accounting: {e:?}");
                }
                true
            }
            _ => false,
        };
        let qpn = self.qpn();
        let _ = st.sq.complete(seq, status, &mut |c| self.send_soft.deliver(c.to_wc(qpn), sink.as_deref_mut()));
        accounted
    }

    fn deliver(&self, cq: &CqSoft, c: Completion) {
        cq.push(c.to_wc(self.qpn()));
    }

    /// `ibv_post_recv`.
    ///
    /// # Safety
    /// As [`Vqp::post_send`].
    pub unsafe fn post_recv(&self, mut wr: *mut ibv_recv_wr, bad: *mut *mut ibv_recv_wr) -> i32 {
        while !wr.is_null() {
            // SAFETY: caller contract.
            let w = unsafe { &*wr };
            let r = (|| {
                // With an SRQ, receives are posted there (as RC: EINVAL).
                if self.srq.get().is_some()
                    || w.num_sge < 0
                    || w.num_sge as u32 > self.caps.max_recv_sge
                    || (w.num_sge > 0 && w.sg_list.is_null())
                {
                    return Err(Errno::EINVAL);
                }
                let sges: &[ibv_sge] = if w.num_sge == 0 {
                    &[]
                } else {
                    // SAFETY: num_sge entries of the application's list.
                    unsafe { std::slice::from_raw_parts(w.sg_list, w.num_sge as usize) }
                };
                mrs::with(self.app.real_pd as usize, |local| {
                    precheck::check_recv(&precheck::RecvWr { sge: sges }, &self.dev_caps(), local)
                })
                .map_err(|r| r.errno())?;
                let mut st = self.st.lock();
                match st.rc.as_ref().map(RcShadow::state) {
                    // As a real RC QP: no receives in RESET; in ERR they are
                    // taken and flushed at once (after the messages that
                    // came before the error: see `flush_receives_if_failed`).
                    Some(ibv_qp_state::IBV_QPS_RESET) => Err(Errno::EINVAL),
                    _ => {
                        st.rq.push(w.wr_id, sges)?;
                        let mut out = Vec::new();
                        self.flush_receives_if_failed(&mut st, &mut out);
                        drop(st);
                        out.into_iter().for_each(|c| self.deliver(&self.recv_soft, c));
                        Ok(())
                    }
                }
            })();
            if let Err(e) = r {
                // SAFETY: caller contract.
                unsafe { *bad = wr };
                return e.0;
            }
            wr = w.next;
        }
        self.deliver_held();
        0
    }

    /// A message for this VQP, arrived on `link` (progress).
    pub fn on_message(&self, h: &Header, payload: &[u8], link: &Arc<Link>) {
        self.on_message_from(h, payload, Origin::of(link));
    }

    /// A message for this VQP from `origin` (progress).
    fn on_message_from(&self, h: &Header, payload: &[u8], origin: Origin) {
        klog!(Level::Debug, "vqp {:#x}: message from {:#x}, {} bytes, {:?}", self.vqpn, h.src_vqpn, h.len, h.flags);
        let mut st = self.st.lock();
        if h.flags.contains(Flags::CLOSE) {
            if st.bound.is_none() {
                // A connected VQP keeps its own state; peer death is reported
                // by the link.
                return;
            }
            if st.held.is_empty() && st.reading.is_none() {
                st.inbox.push_back(Inbox::Closed(origin.peer.incarnation, h.src_vqpn));
            } else {
                st.held.push_back(Held { header: *h, payload: Vec::new(), origin });
            }
            return;
        }
        // Behind held messages or a large one being READ: RC order.
        if !st.held.is_empty() || st.reading.is_some() || self.rq_is_empty(&st) {
            st.held.push_back(Held { header: *h, payload: payload.to_vec(), origin });
            return;
        }
        self.land(&mut st, h, payload, &origin);
    }

    /// Land held messages while there are receive buffers (and no large
    /// message is being READ).
    pub fn deliver_held(&self) {
        let mut st = self.st.lock();
        self.drain_held(&mut st);
        let mut out = Vec::new();
        self.flush_receives_if_failed(&mut st, &mut out);
        drop(st);
        out.into_iter().for_each(|c| self.deliver(&self.recv_soft, c));
    }

    /// In the error state (moved to ERR, or its link failed) once every
    /// message that arrived before is delivered: the posted receives are
    /// flushed, as RC flushes its receive queue.
    fn flush_receives_if_failed(&self, st: &mut State, out: &mut Vec<Completion>) {
        let in_error = st.failed || st.rc.as_ref().is_some_and(|rc| rc.state() == ibv_qp_state::IBV_QPS_ERR);
        if in_error && st.held.is_empty() && st.reading.is_none() && self.srq.get().is_none() {
            st.rq.flush(&mut |c| out.push(c));
        }
    }

    /// The link this VQP sends on failed (its peer died or cannot be
    /// reached): as an RC QP whose retries ran out, it enters the error
    /// state. What is still outstanding on its send queue completes with
    /// `IBV_WC_WR_FLUSH_ERR` (the WR that met the error was reported with
    /// its status already), its receives are flushed once the messages
    /// that came before are delivered, and later posts are flushed. A bound
    /// VQP reports the senders of that process closed (`qpop_msgs`) and
    /// serves the others as before.
    pub fn on_link_failed(&self, link: &Arc<Link>) {
        let mut st = self.st.lock();
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        if st.conn.as_ref().is_some_and(|c| c.is_on(link)) {
            if let Some(rt) = self.rt.get() {
                self.detach_flow(rt, &mut st);
            }
            st.conn = None;
            st.failed = true;
            // The link is drained: what was held for it goes first.
            sends.append(&mut st.held_sends);
            st.sq.flush(&mut |c| sends.push(c));
            if let Some(rc) = st.rc.as_mut() {
                rc.fail();
            }
        }
        if st.reading.as_ref().is_some_and(|r| Arc::ptr_eq(&r.link, link)) {
            if let Some(mut rd) = st.reading.take() {
                rd.wc.status = ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
                self.complete_recv(&mut st, rd.wc, &Origin::of(link));
                self.drain_held(&mut st);
            }
        }
        if st.bound.is_some() {
            let incarnation = link.peer.incarnation;
            let mut gone: Vec<u32> = st.src_qps.keys().filter(|(i, _)| *i == incarnation).map(|(_, src)| *src).collect();
            // Senders of that process not answered yet: `qpop_msgs` makes
            // their src_qps when it takes their messages (waiting in the
            // inbox, held, or being taken now), so they are reported
            // closed too, after those messages.
            gone.extend(st.inbox.iter().filter_map(|e| match e {
                Inbox::Msg(o, src, _) if o.peer.incarnation == incarnation => Some(*src),
                _ => None,
            }));
            gone.extend(
                st.held
                    .iter()
                    .filter(|h| !h.header.flags.contains(Flags::CLOSE) && h.origin.peer.incarnation == incarnation)
                    .map(|h| h.header.src_vqpn),
            );
            gone.extend(st.answering.filter(|(i, _)| *i == incarnation).map(|(_, src)| src));
            gone.sort_unstable();
            gone.dedup();
            for src in gone {
                // Behind what that sender's messages still wait for.
                if st.held.is_empty() && st.reading.is_none() {
                    st.inbox.push_back(Inbox::Closed(incarnation, src));
                } else {
                    let header = Header { flags: Flags::CLOSE, src_vqpn: src, dst: self.vqpn, ..Header::default() };
                    st.held.push_back(Held { header, payload: Vec::new(), origin: Origin::of(link) });
                }
            }
        }
        self.flush_receives_if_failed(&mut st, &mut recvs);
        drop(st);
        sends.into_iter().for_each(|c| self.deliver(&self.send_soft, c));
        recvs.into_iter().for_each(|c| self.deliver(&self.recv_soft, c));
    }

    fn drain_held(&self, st: &mut State) {
        while st.reading.is_none() {
            let Some(front) = st.held.front() else { break };
            let closing = front.header.flags.contains(Flags::CLOSE);
            if !closing && self.rq_is_empty(st) {
                break;
            }
            let Some(m) = st.held.pop_front() else { break };
            if closing {
                st.inbox.push_back(Inbox::Closed(m.origin.peer.incarnation, m.header.src_vqpn));
            } else {
                self.land(st, &m.header, &m.payload, &m.origin);
            }
        }
    }

    /// Tell the peer VQP that we are gone (a CLOSE header on the
    /// connection's link, or on the next one when that one closes),
    /// bounded by the connect timeout; best effort.
    fn post_close(&self, rt: &Arc<Runtime>, h: &Header) {
        let deadline = std::time::Instant::now() + super::runtime::connect_timeout();
        while std::time::Instant::now() < deadline {
            match self.ensure_tier(rt, true) {
                Err(_) => break,
                Ok(Tier::Dgram(flow)) => {
                    if self.close_on_tier(rt, &flow) {
                        return;
                    }
                    break;
                }
                Ok(Tier::Link) => {}
            }
            let Some(link) = self.st.lock().conn.as_ref().and_then(|c| c.open_link().cloned()) else { break };
            if post_header(rt, &link, h) {
                return;
            }
            rt.progress();
            std::thread::yield_now();
        }
        klog!(Level::Warn, "vqp {:#x}: the peer VQP was not told of its destruction", self.vqpn);
    }

    /// Destroy: unpublish a binding, flush what is outstanding, free the
    /// slot. Returns the VQPs made for senders (the caller frees them).
    pub fn destroy(&self) -> Vec<*mut ibv_qp> {
        if let Some((parent, key)) = self.parent.get() {
            // The application destroyed a src_qp itself.
            if let Some(p) = parent.upgrade() {
                p.st.lock().src_qps.remove(key);
            }
        }
        // RC's promise: once destroy returns, nothing touches the memory of
        // its WRs; they may still be on the link (teardown.rs).
        let unread = self.quiesce();
        let mut st = self.st.lock();
        let keys: Vec<_> = st.bound.take().into_iter().chain(std::mem::take(&mut st.published)).collect();
        if let (false, Some(Ok(meta))) = (keys.is_empty(), self.rt.get().map(|rt| rt.meta())) {
            meta.unbind_all(&keys);
        }
        let mut out = Vec::new();
        st.sq.flush(&mut |c| out.push(c));
        st.rq.flush(&mut |c| out.push(c));
        let mut srcs: Vec<*mut ibv_qp> = st.src_qps.drain().map(|(_, q)| q).collect();
        srcs.append(&mut st.retired);
        // The VQP we talk to may release what it keeps for us (a src_qp,
        // made only for a sender of messages: a VQP that only READ, WROTE
        // or used atomics has none there, and its destroy sends nothing).
        let close = match (&st.conn, self.parent.get()) {
            (Some(c), None) if st.sent_msgs => Some(Header { flags: Flags::CLOSE, src_vqpn: self.vqpn, dst: c.dst, ..Header::default() }),
            _ => None,
        };
        drop(st);
        self.tell_unread(unread);
        if let Some(rt) = self.rt.get() {
            if let Some(h) = close {
                self.post_close(rt, &h);
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

// The registries behind a VQP's memo, out of line: inlined, their hashing
// was set up on every post, memo hit or not.
#[inline(never)]
fn registry_local(pd: usize, lkey: u32) -> Option<precheck::MrInfo> {
    mrs::with(pd, |m| m.local(lkey))
}

#[inline(never)]
fn peer_remote(pm: &Mutex<PeerMrs>, rkey: u32) -> Option<(precheck::MrInfo, u64)> {
    pm.lock().get(rkey)
}

/// Post a bare header (DONE, CLOSE, LINK_CLOSE: inline, signaled) on
/// `link`; false when the link has no room now, or (a CLOSE: new work)
/// has started closing.
fn post_header(rt: &Runtime, link: &Link, h: &Header) -> bool {
    post_header_as(rt, link, h, |retired| Control::Header { retired })
}

/// [`post_header`], its completion doing what `control` says.
pub(super) fn post_header_as(rt: &Runtime, link: &Link, h: &Header, control: impl FnOnce(u16) -> Control) -> bool {
    let mut sq = link.sq.lock();
    if h.flags.contains(Flags::CLOSE) && !link.is_open() {
        return false;
    }
    let Some(d) = sq.try_post(true) else { return false };
    let tag = rt.next_tag();
    rt.large.track(tag, control(d.retired));
    let mut bytes = header_bytes(h);
    let mut sge = ibv_sge { addr: bytes.as_mut_ptr() as u64, length: HEADER_LEN as u32, lkey: 0 };
    // SAFETY: a plain C struct.
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = WrId::Control { tag }.encode();
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
    wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0 | ibv_send_flags::IBV_SEND_INLINE.0;
    // SAFETY: inline data is copied at post time; links allow HEADER_LEN.
    if let Err(e) = unsafe { link.qp.post_send(&mut wr) } {
        // The link is gone: the peer learns it from its own completions.
        klog!(Level::Warn, "vqp: cannot send a {:?} header: {e:?}", h.flags);
        rt.large.take(tag);
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

/// `wire` (a VQP's last link and its mark) after a post on `link`, whose
/// mark is now `mark`; a new reference is taken only when it changed.
#[inline]
fn note_wire(wire: &mut Option<(Weak<Link>, u64)>, link: &Arc<Link>, mark: u64) {
    match wire {
        Some((l, m)) if std::ptr::eq(l.as_ptr(), Arc::as_ptr(link)) => *m = mark,
        _ => *wire = Some((Arc::downgrade(link), mark)),
    }
}

/// What a WQE's wr_id says it retires: the decision's count when it is
/// signaled; an unsignaled WQE shows its wr_id only when flushed after an
/// error, when the link's accounting is reset anyway.
fn wire_retired(d: &super::queue::PostDecision) -> u16 {
    if d.signal {
        d.retired
    } else {
        1
    }
}

fn header_bytes(h: &Header) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    h.encode(&mut b);
    b
}

fn is_atomic(op: u32) -> bool {
    matches!(op, ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP | ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD)
}

fn wc_opcode_of(op: u32) -> u32 {
    match op {
        ibv_wr_opcode::IBV_WR_RDMA_WRITE | ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM => ibv_wc_opcode::IBV_WC_RDMA_WRITE,
        ibv_wr_opcode::IBV_WR_RDMA_READ => ibv_wc_opcode::IBV_WC_RDMA_READ,
        ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP => ibv_wc_opcode::IBV_WC_COMP_SWAP,
        ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD => ibv_wc_opcode::IBV_WC_FETCH_ADD,
        _ => ibv_wc_opcode::IBV_WC_SEND,
    }
}
