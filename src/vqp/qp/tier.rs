//! Which transport a connected VQP's work goes on, and the VQP's side of
//! the datagram tier (`src/transport/dgram/`).
//!
//! A connection whose peer has no open link (first contact, or its link
//! was closed by reclaim) posts on its flow of the datagram tier at once
//! (`KRCORE_DGRAM`, on by default), and asks for the link in the background
//! (`KRCORE_LINK_AFTER`). The move: once the link serves that peer and
//! everything the VQP posted on the tier has completed (acknowledged or
//! answered by the peer), the connection takes the link; a post that
//! finds the link up while work is still outstanding on the tier waits
//! for it (one round trip at most, bounded). So nothing sent on the link
//! can overtake what was sent on the tier, and the peer delivered every
//! message of the tier before it acknowledged it.
//!
//! On the tier the target checks the remote side of one-sided requests
//! (an unknown rkey completes with `IBV_WC_REM_ACCESS_ERR` and the VQP
//! enters the error state, as on RC); the VQP checks the local side as on
//! a link. `IBV_WR_RDMA_WRITE_WITH_IMM`, `IBV_SEND_SOLICITED` and READs
//! above [`port::MAX_READ`] wait for the link.

use super::*;
use crate::transport::dgram::port::{self, Arrived, Flow, Host, Op, Peer, Source};
use crate::transport::dgram::reliable::{self, Atomic, Outcome};
use crate::transport::dgram::wire::{Route, SendOp};

/// What a connection sends on now.
pub(super) enum Tier {
    Link,
    Dgram(Arc<Flow>),
}

/// Work requests on the tier between two asks for the link.
const ASK_AGAIN: u64 = 64;

/// How long the transparent VQP that does not ask first waits for its
/// peer's link before asking itself (its peer may post nothing: a passive
/// target of one-sided work asks for no link), and how long a `qconnect`
/// waits for a first completion on the tier before asking anyway. Beyond
/// a handshake's time on a busy host; should both ask, the duplicate is
/// closed.
pub(super) const ASK_LATE: std::time::Duration = std::time::Duration::from_millis(200);

/// Ids of the tier's work that is not the application's (a CLOSE).
const CONTROL_ID: u64 = 1 << 32;

/// The remote side as the tier sees it: the target checks it.
struct TargetChecks;

impl precheck::RemoteMrs for TargetChecks {
    fn remote(&self, _rkey: u32) -> Option<precheck::MrInfo> {
        use crate::sys::ibv_access_flags as A;
        let access = A::IBV_ACCESS_REMOTE_READ.0 | A::IBV_ACCESS_REMOTE_WRITE.0 | A::IBV_ACCESS_REMOTE_ATOMIC.0;
        Some(precheck::MrInfo { addr: 0, len: u64::MAX, access })
    }
}

/// Whether the tier can carry `w` (else it waits for the link).
pub(super) fn tier_carries(w: &ibv_send_wr, total: u32) -> bool {
    crate::config::get().dgram
        && w.opcode != ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
        && w.send_flags & ibv_send_flags::IBV_SEND_SOLICITED.0 == 0
        && total <= port::MAX_MSG
}

impl Vqp {
    /// Make sure the connection can send: on its open link, on a link that
    /// serves its peer now (the move, once the tier is drained), or on the
    /// datagram tier when `tier_ok` (else a new link, waited for). A
    /// closing link's WQEs complete first (the fence of a link close). Ok
    /// also when the VQP is not connected or failed: the caller looks
    /// again. An error when the peer cannot be reached.
    pub(super) fn ensure_tier(&self, rt: &Arc<Runtime>, tier_ok: bool) -> Result<Tier> {
        let started = std::time::Instant::now();
        let deadline = started + crate::vqp::runtime::connect_timeout().max(crate::vqp::runtime::TRANSPORT_WAIT);
        loop {
            let (peer, index, path, dst, old, flow) = {
                let st = self.st.lock();
                match &st.conn {
                    Some(c) if c.open_link().is_none() => (c.peer, c.index, c.path, c.dst, c.link.clone(), c.flow.clone()),
                    _ => return Ok(Tier::Link),
                }
            };
            // A failed link: its VQPs enter the error state (progress);
            // a closing one: its WQEs complete first (the fence).
            let busy = |l: &Arc<Link>| l.is_failed() || l.sq.lock().outstanding() > 0;
            let waiting_tier = flow.as_ref().is_some_and(|f| f.outstanding() > 0);
            if old.as_ref().is_some_and(busy) {
                self.wait_a_little(rt, started, deadline)?;
                continue;
            }
            if old.is_some() {
                // Closed, and done with: let it go (what the link close's
                // fence waited for).
                let mut st = self.st.lock();
                if let Some(c) = st.conn.as_mut().filter(|c| c.link.as_ref().map(Arc::as_ptr) == old.as_ref().map(Arc::as_ptr)) {
                    c.link = None;
                }
                continue;
            }
            if let Some(link) = rt.svc.link_to(peer.incarnation, index, path).filter(|l| l.is_open()) {
                if waiting_tier {
                    // The move waits for the tier to drain.
                    self.wait_a_little(rt, started, deadline)?;
                    continue;
                }
                self.take_link(old.as_ref(), link);
                continue;
            }
            if rt.peer_gone(peer.incarnation) {
                return Err(Errno(libc::ECONNRESET));
            }
            if tier_ok && crate::config::get().dgram {
                let flow = match flow {
                    Some(f) => f,
                    None => match self.open_flow(rt, peer, path, dst) {
                        Err(e) if e.0 == libc::EAGAIN => {
                            self.wait_a_little(rt, started, deadline)?;
                            continue;
                        }
                        r => r?,
                    },
                };
                return Ok(Tier::Dgram(flow));
            }
            if waiting_tier {
                self.wait_a_little(rt, started, deadline)?;
                continue;
            }
            let new = rt.make_link(&peer, index, path, false)?;
            self.take_link(old.as_ref(), new);
        }
    }

    /// Progress, and give the other threads a turn (a wait `started` then:
    /// [`crate::vqp::runtime::pause`]); ETIMEDOUT past `deadline`.
    fn wait_a_little(&self, rt: &Runtime, started: std::time::Instant, deadline: std::time::Instant) -> Result<()> {
        if std::time::Instant::now() > deadline {
            return Err(Errno(libc::ETIMEDOUT));
        }
        rt.progress();
        crate::vqp::runtime::pause(started.elapsed());
        Ok(())
    }

    /// The connection goes on `new` (if it still is where it was: on `old`).
    fn take_link(&self, old: Option<&Arc<Link>>, new: Arc<Link>) {
        let mut st = self.st.lock();
        if let Some(c) = st.conn.as_mut().filter(|c| c.link.as_ref().map(Arc::as_ptr) == old.map(Arc::as_ptr)) {
            move_onto(self.vqpn, c, new);
        }
    }

    /// `link` was made for this VQP's peer: the connection takes it now if
    /// it waits for it with nothing outstanding on the tier (the move).
    pub fn move_if_idle(&self, link: &Arc<Link>) {
        let mut st = self.st.lock();
        let Some(c) = st.conn.as_mut() else { return };
        let waits = c.link.is_none()
            && c.peer.incarnation == link.peer.incarnation
            && c.index == link.index
            && c.path == link.path
            && c.flow.as_ref().is_none_or(|f| f.outstanding() == 0);
        if waits {
            move_onto(self.vqpn, c, Arc::clone(link));
        }
    }

    /// Whether this VQP asks for its link at first contact. Only one side
    /// of a connection does, so that the two do not make a link each (a
    /// duplicate to close): the one that called `qconnect`, and of two
    /// transparent VQPs the one of the lower incarnation. The other (a
    /// src_qp answering a sender, the other transparent VQP) moves onto
    /// the link its peer made, and asks only after [`ASK_AGAIN`] work
    /// requests on the tier (its peer may be at its link limit).
    pub(super) fn asks_first(&self, rt: &Runtime, peer: &Endpoint) -> bool {
        self.parent.get().is_none() && (self.st.lock().rc.is_none() || rt.svc.endpoint().incarnation < peer.incarnation)
    }

    /// The connection's flow on the datagram tier; its link is asked for
    /// in the background (`KRCORE_LINK_AFTER` 0: now).
    fn open_flow(&self, rt: &Arc<Runtime>, peer: Endpoint, path: Path, dst: u32) -> Result<Arc<Flow>> {
        let route =
            Route { src_incarnation: rt.svc.endpoint().incarnation, dst_incarnation: peer.incarnation, src_vqpn: self.vqpn, dst_vqpn: dst };
        let to = Peer { sgid_index: path.sgid_index, dgid: path.dgid, qpn: peer.qpn, qkey: peer.qkey };
        let flow = rt.dgram.open(route, to)?;
        crate::kmark!("vqp: a flow on the datagram tier opened");
        let mut st = self.st.lock();
        match st.conn.as_mut() {
            Some(c) if c.flow.is_none() => c.flow = Some(Arc::clone(&flow)),
            Some(c) => return Ok(c.flow.clone().unwrap_or(flow)),
            None => return Err(Errno(libc::EAGAIN)),
        }
        // (At first contact the link is asked for once the flow's first
        // work request completed: `on_tier_completion`.)
        st.link_asked = false;
        Ok(flow)
    }

    /// Post `w` on the datagram tier (the VQP's lock not held; `sw` its
    /// checked view). `Ok(false)`: the connection changed meanwhile, look
    /// again.
    ///
    /// # Safety
    /// `w` and its SGE list are the application's valid WR.
    pub(super) unsafe fn post_on_tier(&self, rt: &Arc<Runtime>, flow: &Arc<Flow>, w: &ibv_send_wr, sw: &SendWr<'_>) -> Result<bool> {
        mrs::with(self.app.real_pd as usize, |local| precheck::check_send(sw, &self.dev_caps(), local, &TargetChecks)).map_err(
            |v| match v {
                Verdict::Reject(r) => {
                    klog!(Level::Debug, "vqp {:#x}: rejected a work request: {r}", self.vqpn);
                    r.errno()
                }
                Verdict::NeedRemote { .. } => Errno::EINVAL,
            },
        )?;
        crate::kmark!("vqp: on the tier, local side checked");
        let total: u32 = sw.sge.iter().map(|s| s.length).sum();
        let signaled = self.sq_sig_all || w.send_flags & ibv_send_flags::IBV_SEND_SIGNALED.0 != 0;
        let is_send = matches!(w.opcode, ibv_wr_opcode::IBV_WR_SEND | ibv_wr_opcode::IBV_WR_SEND_WITH_IMM);
        // The payload of a SEND or WRITE is copied now, as inline data.
        let data: Vec<u8> = if is_send || w.opcode == ibv_wr_opcode::IBV_WR_RDMA_WRITE {
            let mut d = Vec::with_capacity(total as usize);
            for s in sw.sge.iter().filter(|s| s.length > 0) {
                // SAFETY: the application's memory, checked against its MRs
                // (or inline data, read at post time as verbs does).
                d.extend_from_slice(unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.length as usize) });
            }
            d
        } else {
            Vec::new()
        };
        let mut guard = self.st.lock();
        let st = &mut *guard;
        if !st.conn.as_ref().and_then(|c| c.flow.as_ref()).is_some_and(|f| Arc::ptr_eq(f, flow))
            || st.conn.as_ref().is_some_and(|c| c.link.is_some())
        {
            return Ok(false);
        }
        if st.sq.outstanding() >= self.sq_cap as usize {
            return Err(Errno::ENOMEM);
        }
        let entry = SendEntry { wr_id: w.wr_id, signaled, opcode: wc_opcode_of(w.opcode), byte_len: total, awaits_done: false };
        let seq = st.sq.push(entry)?;
        let id = u64::from(seq);
        // SAFETY: the union members the opcode names.
        let op = unsafe {
            match w.opcode {
                ibv_wr_opcode::IBV_WR_SEND => Op::Send { id, opcode: SendOp::Send, imm: 0, data: &data },
                ibv_wr_opcode::IBV_WR_SEND_WITH_IMM => {
                    Op::Send { id, opcode: SendOp::SendImm, imm: w.imm_data_invalidated_rkey_union.imm_data, data: &data }
                }
                ibv_wr_opcode::IBV_WR_RDMA_WRITE => Op::Write { id, rkey: w.wr.rdma.rkey, addr: w.wr.rdma.remote_addr, data: &data },
                ibv_wr_opcode::IBV_WR_RDMA_READ => Op::Read { id, rkey: w.wr.rdma.rkey, addr: w.wr.rdma.remote_addr, len: total },
                ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP => Op::Atomic {
                    id,
                    atomic: Atomic::CmpSwp { compare: w.wr.atomic.compare_add, swap: w.wr.atomic.swap },
                    rkey: w.wr.atomic.rkey,
                    addr: w.wr.atomic.remote_addr,
                },
                _ => Op::Atomic {
                    id,
                    atomic: Atomic::FetchAdd { add: w.wr.atomic.compare_add },
                    rkey: w.wr.atomic.rkey,
                    addr: w.wr.atomic.remote_addr,
                },
            }
        };
        if matches!(op, Op::Read { .. } | Op::Atomic { .. }) {
            st.tier_dst.push_back((seq, sw.sge.to_vec()));
        }
        st.sent_msgs |= is_send;
        klog!(Level::Debug, "vqp {:#x}: post opcode {} len {total} seq {seq} on the datagram tier", self.vqpn, w.opcode);
        match rt.dgram.post(&**rt, flow, op) {
            Ok(()) => {}
            // The flow failed: the completion that failed it (on its way)
            // flushes this one too.
            Err(e) if e.0 == libc::ENOTCONN => {}
            Err(e) => self.link_refused(&mut st.sq, seq, e),
        }
        let posted = st.conn.as_ref().is_some_and(|c| c.link.is_none());
        st.tier_posts += 1;
        let (tier_posts, conn) = (st.tier_posts, st.conn.as_ref().map(|c| (c.peer, c.index, c.path)));
        drop(guard);
        if let (true, Some((peer, index, path))) = (posted, conn) {
            // At KRCORE_LINK_AFTER posts on the tier (ASK_AGAIN more when
            // the peer asks first), and every ASK_AGAIN after (a link that
            // could not be made, or was not for KRCORE_MAX_LINKS).
            let asks_first = self.asks_first(rt, &peer);
            let first = match (asks_first, crate::config::get().link_after) {
                // The first completion asked (on_tier_completion).
                (true, 0) => 1 + ASK_AGAIN,
                (true, n) => n,
                (false, n) => n.max(1) + ASK_AGAIN,
            };
            if tier_posts >= first && (tier_posts - first) % ASK_AGAIN == 0 {
                rt.want_link_at(std::time::Instant::now(), peer, index, path);
            }
            // (A src_qp's sender asked at its first contact: only the other
            // of two transparent VQPs of two processes asks late.)
            let own = peer.incarnation == rt.svc.endpoint().incarnation;
            if tier_posts == 1 && !asks_first && !own && self.parent.get().is_none() && crate::config::get().link_after == 0 {
                let weak = rt.weak_self();
                rt.svc.defer(
                    std::time::Instant::now() + ASK_LATE,
                    Box::new(move || {
                        // Nothing when the link is up or being made.
                        if let Some(rt) = weak.upgrade() {
                            Runtime::want_link(&rt, peer, index, path);
                        }
                    }),
                );
            }
        }
        Ok(true)
    }

    /// A work request of this VQP's flow finished (progress): a READ's data
    /// or an atomic's value lands in its buffer, then it completes as on
    /// RC; an error puts the VQP in the error state.
    fn on_tier_completion(&self, rt: &Runtime, route: &Route, c: reliable::Completion) {
        if c.id >= CONTROL_ID {
            return;
        }
        let mut guard = self.st.lock();
        let st = &mut *guard;
        if !st.conn.as_ref().and_then(|c| c.flow.as_ref()).is_some_and(|f| f.route == *route) || st.sq.is_error() {
            return;
        }
        let seq = c.id as u16;
        let dst = match st.tier_dst.front() {
            Some((s, _)) if *s == seq => st.tier_dst.pop_front().map(|(_, sges)| sges),
            _ => None,
        };
        let status = c.outcome.wc_status();
        match (&c.outcome, dst) {
            (Outcome::Read(data), Some(sges)) => scatter(data, &sges),
            (Outcome::Atomic(v), Some(sges)) => scatter(&v.to_le_bytes(), &sges),
            _ => {}
        }
        // The first completion on the flow: the link can be made now
        // without competing with that round trip (first contact).
        let ask = (!st.link_asked && status == ibv_wc_status::IBV_WC_SUCCESS && crate::config::get().link_after == 0)
            .then(|| st.conn.as_ref().filter(|c| c.link.is_none()).map(|c| (c.peer, c.index, c.path)))
            .flatten();
        st.link_asked |= ask.is_some();
        let mut sends = Vec::new();
        let _ = st.sq.complete(seq, status, &mut |c| sends.push(c));
        let mut recvs = Vec::new();
        if status != ibv_wc_status::IBV_WC_SUCCESS {
            klog!(Level::Info, "vqp {:#x}: a work request on the datagram tier failed (status {status}): error state", self.vqpn);
            st.failed = true;
            if let Some(rc) = st.rc.as_mut() {
                rc.fail();
            }
            self.detach_flow(rt, st);
            st.conn = None;
            self.flush_receives_if_failed(st, &mut recvs);
        }
        drop(guard);
        sends.into_iter().for_each(|c| self.deliver(&self.send_soft, c));
        recvs.into_iter().for_each(|c| self.deliver(&self.recv_soft, c));
        if let Some((peer, index, path)) = ask.filter(|(peer, ..)| self.asks_first(rt, peer)) {
            rt.want_link_at(std::time::Instant::now(), peer, index, path);
        }
    }

    /// The send queue was flushed or the connection ends: its flow
    /// completes nothing more (its work was reported flushed).
    pub(super) fn detach_flow(&self, rt: &Runtime, st: &mut State) {
        st.tier_dst.clear();
        if let Some(flow) = st.conn.as_mut().and_then(|c| c.flow.take()) {
            rt.dgram.close(&flow);
        }
    }

    /// Tell the peer VQP on the tier that we are gone (a CLOSE, carrying
    /// our final ACKs of what that process sent us): the flow lingers in
    /// the port until the CLOSE is acknowledged or the flow fails, without
    /// holding up the destruction. Whether it was posted.
    pub(super) fn close_on_tier(&self, rt: &Runtime, flow: &Flow) -> bool {
        let acks = rt.dgram.final_acks(rt, self.vqpn, Some(flow.route.dst_incarnation));
        let op = Op::Send { id: CONTROL_ID, opcode: SendOp::Close, imm: 0, data: &acks };
        if rt.dgram.post(rt, flow, op).is_err() {
            return false;
        }
        rt.dgram.linger(flow);
        true
    }
}

/// Connection `c` of VQP `vqpn` goes on link `new` (counted as a move when
/// it was on its flow of the tier).
fn move_onto(vqpn: u32, c: &mut Conn, new: Arc<Link>) {
    let from_tier = c.link.is_none() && c.flow.is_some();
    klog!(Level::Debug, "vqp {vqpn:#x}: moves to link QP {}{}", new.qp.qpn(), if from_tier { " from the datagram tier" } else { "" });
    if from_tier {
        crate::stats::inc(crate::stats::Stat::KRCORE_STAT_DGRAM_MOVES);
    }
    c.link = Some(new);
}

/// `data` into the buffers `sges` (checked against the application's MRs
/// at post time), in order.
fn scatter(data: &[u8], sges: &[ibv_sge]) {
    let mut at = 0;
    for s in sges {
        let n = (s.length as usize).min(data.len() - at);
        // SAFETY: the application's buffer of the WR, checked at post.
        unsafe { std::ptr::copy_nonoverlapping(data[at..].as_ptr(), s.addr as *mut u8, n) };
        at += n;
    }
}

/// The datagram tier's view of the runtime: the endpoint that sends and
/// wakes, and the VQPs behind the flows.
impl Host for Runtime {
    fn send(&self, to: &Peer, bytes: &[u8]) {
        let loss = crate::config::get().test_dgram_loss;
        if loss > 0 {
            // One in `loss` at random (a fixed period could line up with
            // the retransmissions and drop the same packet every time).
            static SENT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = SENT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut z = n.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            z = (z ^ (z >> 31)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            if (z ^ (z >> 29)) % loss == 0 {
                return;
            }
        }
        if let Err(e) = self.svc.send_datagram(Path { sgid_index: to.sgid_index, dgid: to.dgid }, to.qpn, to.qkey, bytes) {
            klog!(Level::Debug, "vqp: a datagram of the tier was not sent: {e:?}");
        }
    }

    fn wake_at(&self, at: std::time::Instant) {
        let weak = self.weak_self();
        self.svc.defer(
            at,
            Box::new(move || {
                if let Some(rt) = weak.upgrade() {
                    rt.dgram.on_timer(&*rt);
                }
            }),
        );
    }

    fn admit(&self, route: &Route, from: &Source) -> Option<(usize, Peer)> {
        if route.dst_incarnation != self.svc.endpoint().incarnation {
            return None;
        }
        let v = by_vqpn(route.dst_vqpn)?;
        if !v.runs_on(self) {
            return None;
        }
        let peer = Endpoint { gid: from.gid, qpn: from.qpn, qkey: crate::rdma::QKEY, incarnation: route.src_incarnation, vqpn: 0 };
        if !Vqp::takes_from(&v.st.lock(), &peer, &from.gid) {
            super::landing::refused(v.vqpn, &from.gid, from.qpn);
            return None;
        }
        let sgid_index = self.svc.gid_index_of(&from.to_gid).ok()?;
        // The flow's ACKs go out under the VQP's lock (Host::messages): its
        // address handle is made here, before anything was delivered.
        self.svc.prepare_path(Path { sgid_index, dgid: from.gid }).ok()?;
        Some((v.app.real_pd as usize, Peer { sgid_index, dgid: from.gid, qpn: from.qpn, qkey: crate::rdma::QKEY }))
    }

    fn messages(&self, route: &Route, from: &Peer, batch: Vec<Arrived>, answers: &[Vec<u8>]) {
        let send_ack = || answers.iter().for_each(|a| self.send(from, a));
        let Some(v) = by_vqpn(route.dst_vqpn) else { return send_ack() };
        self.take_link_messages();
        let batch = batch
            .into_iter()
            .map(|m| {
                let mut h = Header { src_vqpn: route.src_vqpn, dst: route.dst_vqpn, len: m.data.len() as u32, ..Header::default() };
                match m.opcode {
                    SendOp::Send => {}
                    SendOp::SendImm => {
                        h.flags |= Flags::HAS_IMM;
                        h.imm = m.imm;
                    }
                    SendOp::Close => h.flags |= Flags::CLOSE,
                }
                (h, m.data, m.held)
            })
            .collect();
        let peer = Endpoint { gid: from.dgid, qpn: from.qpn, qkey: from.qkey, incarnation: route.src_incarnation, vqpn: 0 };
        let path = Path { sgid_index: from.sgid_index, dgid: from.dgid };
        v.on_messages_from(batch, &Origin { peer, index: 0, path, link: None }, send_ack);
    }

    fn completed(&self, route: &Route, c: reliable::Completion) {
        if let Some(v) = by_vqpn(route.src_vqpn) {
            v.on_tier_completion(self, route, c);
        }
    }

    fn doubt(&self, incarnation: u64, peer: &Peer) -> bool {
        self.doubt_process(incarnation, peer)
    }
}
