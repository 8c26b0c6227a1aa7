//! Where a received message lands: a small one is copied into the next
//! posted receive, a large one is READ from the sender's staging (one at a
//! time per VQP) and answered with DONE; a READ lost with its link gives
//! the message up as RC would.

use super::*;
use crate::transport::dgram::budget::Reservation;

impl Vqp {
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
    /// It holds `cost` bytes of the link's window (`crate::service::credit`)
    /// until it leaves this VQP; whether it is held still (else the bytes
    /// are the caller's to give back).
    pub fn on_message(&self, h: &Header, payload: &[u8], link: &Arc<Link>, cost: u64) -> bool {
        let mut st = self.st.lock();
        self.take_message(&mut st, h, payload, Origin::of(link), cost, None)
    }

    /// Messages of one datagram-tier flow, in its order (progress).
    /// `before` runs first under the VQP's lock, so that what it does (send
    /// the flow's ACK of them) happens before the application can see any
    /// of them and before anything the sender sends after it can land.
    /// Each holds its reservation of its source GID's budget while it is
    /// held here.
    pub(super) fn on_messages_from(&self, batch: Vec<(Header, Vec<u8>, Option<Reservation>)>, origin: &Origin, before: impl FnOnce()) {
        let mut st = self.st.lock();
        before();
        for (h, payload, tier) in batch {
            self.take_message(&mut st, &h, &payload, origin.clone(), 0, tier);
        }
    }

    /// Whether the message is held (it then keeps its `cost` and `tier`
    /// reservation; else they are given back).
    fn take_message(&self, st: &mut State, h: &Header, payload: &[u8], origin: Origin, cost: u64, tier: Option<Reservation>) -> bool {
        klog!(Level::Debug, "vqp {:#x}: message from {:#x}, {} bytes, {:?}", self.vqpn, h.src_vqpn, h.len, h.flags);
        if !Self::takes_from(st, &origin.peer, &origin.path.dgid) {
            refused(self.vqpn, &origin.path.dgid, origin.peer.qpn);
            return false;
        }
        if h.flags.contains(Flags::CLOSE) {
            if st.bound.is_none() {
                // A connected VQP keeps its own state; peer death is reported
                // by the link.
                return false;
            }
            if st.held.is_empty() && st.reading.is_none() {
                st.inbox.push_back(Inbox::Closed(origin.sender(h.src_vqpn)));
                return false;
            }
            st.held.push_back(Held { header: *h, payload: Vec::new(), origin, cost, _tier: tier });
            return true;
        }
        if st.bound.is_some() && !st.senders.admit(origin.sender(h.src_vqpn)) {
            crate::stats::inc(crate::stats::Stat::KRCORE_STAT_SENDERS_REFUSED);
            klog!(
                if st.senders.refused == 1 { Level::Warn } else { Level::Debug },
                "vqp {:#x}: dropped a message of a new sender from {:02x?}: it takes messages from KRCORE_MAX_SENDERS senders ({} of that GID at most: KRCORE_MAX_SENDERS_PER_GID)",
                self.vqpn,
                origin.path.dgid,
                crate::config::get().max_senders_per_gid
            );
            return false;
        }
        // Behind held messages or a large one being READ: RC order. Not
        // connected yet: held until it is, which keeps only its peer's.
        if !st.held.is_empty() || st.reading.is_some() || Self::awaits_peer(st) || self.rq_is_empty(st) {
            st.held.push_back(Held { header: *h, payload: payload.to_vec(), origin, cost, _tier: tier });
            return true;
        }
        self.land(st, h, payload, &origin);
        false
    }

    /// Land held messages while there are receive buffers (and no large
    /// message is being READ).
    pub fn deliver_held(&self) {
        let mut st = self.st.lock();
        let had = st.held.len();
        self.drain_held(&mut st);
        let released = st.held.len() < had;
        let mut out = Vec::new();
        self.flush_receives_if_failed(&mut st, &mut out);
        drop(st);
        out.into_iter().for_each(|c| self.deliver(&self.recv_soft, c));
        if let Some(rt) = self.rt.get().filter(|_| released) {
            // Their bytes of the links' windows: the senders may wait.
            rt.pump_grants();
        }
    }

    /// In the error state (moved to ERR, or its link failed) once every
    /// message that arrived before is delivered: the posted receives are
    /// flushed, as RC flushes its receive queue.
    pub(super) fn flush_receives_if_failed(&self, st: &mut State, out: &mut Vec<Completion>) {
        let in_error = st.failed || st.rc.as_ref().is_some_and(|rc| rc.state() == ibv_qp_state::IBV_QPS_ERR);
        if in_error && st.held.is_empty() && st.reading.is_none() && self.srq.get().is_none() {
            st.rq.flush(&mut |c| out.push(c));
        }
    }

    pub(super) fn drain_held(&self, st: &mut State) {
        while st.reading.is_none() {
            let Some(front) = st.held.front() else { break };
            let closing = front.header.flags.contains(Flags::CLOSE);
            if !closing && (Self::awaits_peer(st) || self.rq_is_empty(st)) {
                break;
            }
            let Some(m) = st.held.pop_front() else { break };
            if closing {
                st.inbox.push_back(Inbox::Closed(m.origin.sender(m.header.src_vqpn)));
            } else {
                self.land(st, &m.header, &m.payload, &m.origin);
            }
        }
    }

    /// Complete a message into the next posted receive: copy a small one,
    /// start READing a large one.
    pub(super) fn land(&self, st: &mut State, h: &Header, payload: &[u8], origin: &Origin) {
        let mut srq = self.srq.get().map(|s| s.ring());
        let r = match srq.as_mut() {
            Some(ring) => ring.pop_front(),
            None => st.rq.pop_front(),
        };
        let Some(r) = r else { return };
        // SAFETY: ibv_wc is plain C data.
        let mut wc: ibv_wc = unsafe { crate::obj::zeroed() };
        wc.wr_id = r.wr_id;
        wc.qp_num = self.qpn();
        wc.src_qp = h.src_vqpn;
        wc.byte_len = h.len;
        wc.opcode = ibv_wc_opcode::IBV_WC_RECV;
        wc.status = ibv_wc_status::IBV_WC_SUCCESS;
        if h.flags.contains(Flags::HAS_IMM) {
            wc.imm_data_invalidated_rkey_union.imm_data = h.imm;
            wc.wc_flags = ibv_wc_flags::IBV_WC_WITH_IMM.0;
        }
        if h.flags.contains(Flags::WRITE_IMM) {
            wc.opcode = ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM;
        } else if let (true, Some(link)) = (h.flags.contains(Flags::LARGE), origin.link.as_ref()) {
            let mut done = self.done_for(h);
            let buf = r.sg_list.to_vec();
            let pieces = match r.scatter(h.len) {
                Ok(p) => p.collect(),
                Err(status) => {
                    wc.status = status;
                    done.imm = status;
                    Vec::new()
                }
            };
            drop(srq);
            st.reading = Some(Reading {
                wc,
                pieces,
                next: 0,
                remote: h.addr,
                rkey: h.rkey,
                inflight: 0,
                link: Arc::clone(link),
                done,
                buf,
                lost: false,
            });
            self.pump(st);
            return;
        } else {
            match r.scatter(payload.len() as u32) {
                Ok(pieces) => {
                    let mut at = 0;
                    for s in pieces {
                        // SAFETY: the application's posted buffer, checked
                        // against its MR at post time.
                        unsafe {
                            std::ptr::copy_nonoverlapping(payload[at..].as_ptr(), s.addr as *mut u8, s.length as usize);
                        }
                        at += s.length as usize;
                    }
                }
                Err(status) => wc.status = status,
            }
        }
        drop(srq);
        self.complete_recv(st, wc, origin);
    }

    pub(super) fn complete_recv(&self, st: &mut State, wc: ibv_wc, origin: &Origin) {
        if st.bound.is_some() {
            st.inbox.push_back(Inbox::Msg(origin.clone(), wc.src_qp, wc));
        } else {
            self.recv_soft.push(wc);
        }
    }

    /// Progress of the large message being READ: post its READs and then
    /// its DONE as the link has room, and complete it when both are done.
    pub(super) fn pump(&self, st: &mut State) {
        let Some(rt) = self.rt.get() else { return };
        if st.torn_down {
            // Destroyed or reset: its READs in flight are waited for, the
            // message is given up (teardown.rs).
            return;
        }
        let Some(rd) = st.reading.as_mut() else { return };
        while rd.next < rd.pieces.len() {
            let mut sq = rd.link.sq.lock();
            let Some(d) = sq.try_post(true) else {
                rt.large.wait_for_room(self.slot, self.gen);
                return;
            };
            let n = (rd.pieces.len() - rd.next).min(crate::service::LINK_SEND_SGE as usize);
            let chunk = &mut rd.pieces[rd.next..rd.next + n];
            let len: u64 = chunk.iter().map(|s| u64::from(s.length)).sum();
            let tag = rt.next_tag();
            rt.large.track(tag, Control::Read { slot: self.slot, gen: self.gen, retired: d.retired });
            // SAFETY: a plain C struct.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = WrId::Control { tag }.encode();
            wr.sg_list = chunk.as_mut_ptr();
            wr.num_sge = n as i32;
            wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
            wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
            wr.wr.rdma.remote_addr = rd.remote;
            wr.wr.rdma.rkey = rd.rkey;
            // SAFETY: READ into the application's posted buffer (checked
            // against its MRs at post_recv) from the sender's staging.
            if let Err(e) = unsafe { rd.link.qp.post_send(&mut wr) } {
                klog!(Level::Warn, "vqp {:#x}: cannot READ a large message: {e:?}", self.vqpn);
                rt.large.take(tag);
                rd.wc.status = ibv_wc_status::IBV_WC_LOC_QP_OP_ERR;
                rd.done.imm = rd.wc.status;
                rd.next = rd.pieces.len();
                break;
            }
            rd.next += n;
            rd.remote += len;
            rd.inflight += 1;
        }
        if rd.inflight > 0 {
            return;
        }
        if rd.lost {
            self.lose_reading(st);
            return;
        }
        if !post_header(rt, &rd.link, &rd.done) {
            rt.large.wait_for_room(self.slot, self.gen);
            return;
        }
        let Some(rd) = st.reading.take() else { return };
        self.complete_recv(st, rd.wc, &Origin::of(&rd.link));
        self.drain_held(st);
    }

    /// The large message being READ is lost: a READ failed, so its link
    /// died under it (RC moved the QP to ERR) and its sender's send never
    /// completed either. As with RC, a message that did not arrive is not
    /// completed: its receive goes back in front of the queue, for the
    /// next message, and the messages its sender sent after it, held
    /// behind it, are dropped (no gap in that sender's order). The link's
    /// failure then does the rest (a connected VQP's receives are flushed;
    /// a bound VQP reports the sender closed).
    pub(super) fn lose_reading(&self, st: &mut State) {
        let Some(rd) = st.reading.take() else { return };
        let src = rd.wc.src_qp;
        klog!(Level::Info, "vqp {:#x}: a large message from VQP {src:#x} was lost with its link", self.vqpn);
        let back = match self.srq.get() {
            Some(srq) => srq.ring().push_front(rd.wc.wr_id, &rd.buf),
            None => st.rq.push_front(rd.wc.wr_id, &rd.buf),
        };
        if back.is_err() {
            // The queue was filled meanwhile: the receive is reported
            // flushed instead.
            let mut wc = rd.wc;
            wc.status = ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
            wc.byte_len = 0;
            self.complete_recv(st, wc, &Origin::of(&rd.link));
        }
        st.held.retain(|m| !(m.origin.is_on(&rd.link) && m.header.src_vqpn == src && !m.header.flags.contains(Flags::CLOSE)));
        self.drain_held(st);
    }

    /// The DONE that answers the LARGE message `h` (status 0: landed).
    pub(super) fn done_for(&self, h: &Header) -> Header {
        Header { flags: Flags::DONE, src_vqpn: self.vqpn, dst: h.src_vqpn, len: h.len, rkey: h.rkey, addr: h.addr, imm: 0 }
    }

    /// The link had room again (progress).
    pub fn pump_large(&self) {
        let mut st = self.st.lock();
        self.pump(&mut st);
    }

    /// One READ of the large message being received completed.
    pub fn on_large_read(&self, status: u32) {
        let mut st = self.st.lock();
        let Some(rd) = st.reading.as_mut() else { return };
        rd.inflight = rd.inflight.saturating_sub(1);
        if status != ibv_wc_status::IBV_WC_SUCCESS {
            klog!(Level::Debug, "vqp {:#x}: READing a large message failed with status {status}", self.vqpn);
            rd.lost = true;
            rd.next = rd.pieces.len();
        }
        self.pump(&mut st);
    }

    /// The receiver's DONE for our large message `seq`: `status` 0 when it
    /// landed, else the receiver's status.
    pub fn on_large_done(&self, seq: u16, status: u32) {
        let mut st = self.st.lock();
        let mut out = Vec::new();
        let r = if status == ibv_wc_status::IBV_WC_SUCCESS {
            st.sq.done(seq, &mut |c| out.push(c))
        } else {
            // What RC reports to the sender when the receiver cannot take it.
            let mine = if status == ibv_wc_status::IBV_WC_LOC_LEN_ERR {
                ibv_wc_status::IBV_WC_REM_INV_REQ_ERR
            } else {
                ibv_wc_status::IBV_WC_REM_OP_ERR
            };
            st.sq.complete(seq, mine, &mut |c| out.push(c))
        };
        drop(st);
        if r.is_err() {
            klog!(Level::Debug, "vqp {:#x}: a DONE for a WR no longer outstanding", self.vqpn);
        }
        for c in out {
            self.deliver(&self.send_soft, c);
        }
    }
}

/// A message for a connected VQP from another process than its peer (a
/// bound VQP takes messages from anyone; a connected one, as an RC QP,
/// only from the QP it is connected to): dropped and counted.
pub(super) fn refused(vqpn: u32, gid: &[u8; 16], qpn: u32) {
    crate::stats::inc(crate::stats::Stat::KRCORE_STAT_MSGS_REFUSED);
    klog!(Level::Debug, "vqp {vqpn:#x}: dropped a message from {gid:02x?} (QP {qpn}), not its peer");
}
