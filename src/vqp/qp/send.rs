//! Where a VQP's work request goes: `ibv_post_send` and `ibv_wr_complete`
//! (pre-checks, the send ring, the WQEs on the link), the one-sided fast
//! path, the peer's MRs (checked with it), and the link's completions of our WQEs. The
//! datagram tier's side is in tier.rs.

use super::*;

impl Vqp {
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
    pub(super) unsafe fn post_one(&self, w: &ibv_send_wr) -> Result<()> {
        // SAFETY: caller contract.
        if let Some(done) = unsafe { self.post_one_sided_fast(w) } {
            return done;
        }
        // SAFETY: caller contract.
        if let Some(done) = unsafe { self.post_via_agent(w) } {
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
        let mut fetches = 0;
        // A message's bytes of the link's window (its header, and what it
        // carries when it fits a receive buffer): the peer holds them
        // until its VQP lets the message go (`crate::service::credit`).
        let cost = if is_send && total as usize <= MAX_MSG {
            (HEADER_LEN + total as usize) as u64
        } else if is_send || w.opcode == ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM {
            HEADER_LEN as u64
        } else {
            0
        };
        let mut credit_wait: Option<std::time::Instant> = None;
        // One pass under the VQP's lock when nothing is missing; what must
        // wait (an MR check with the peer, staging, room on the link) is done
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
                crate::kmark!("vqp: no open link: link or tier?");
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
            let Some(mut guard) = self.precheck_fetching(rt, guard, &sw, &mut fetches)? else { continue };
            let st = &mut *guard;
            let Some(conn) = &st.conn else { return Err(Errno::EINVAL) };
            let Some(link) = conn.link.as_ref() else { continue };
            // Above a receive buffer the receiver READs the payload: stage
            // it (a copy into a registered buffer) outside the lock, for
            // this link's peer alone (staged for a link the VQP has left
            // since: again, for this one).
            if is_send && total as usize > MAX_MSG && !staged.as_ref().is_some_and(|s: &Staged| s.is_for(link)) {
                let link = Arc::clone(link);
                drop(guard);
                staged = None;
                match rt.large.stage(rt.svc.device(), &link, sges, total as usize) {
                    Ok(s) => staged = Some(s),
                    // Closing or failed since: the next pass moves on.
                    Err(e) if e.0 == libc::ENOTCONN => {}
                    Err(e) => return Err(e),
                }
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
            // WRITE_WITH_IMM is a WRITE and a notification SEND: two WQEs;
            // a staged payload's window bind, if not posted yet, goes first.
            let bind = staged.as_ref().is_some_and(Staged::needs_bind);
            let need = if w.opcode == ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM { 2 } else { 1 } + usize::from(bind);
            if link.qp.caps.send_wr as usize - sq.outstanding() < need {
                drop(sq);
                drop(guard);
                rt.progress();
                std::thread::yield_now();
                continue;
            }
            if cost > 0 && !link.credit.try_send(cost) {
                // The peer still holds a window's worth of our messages
                // (its VQPs have not received them): wait for its grant,
                // as an RC sender waits out RNR, bounded as the wait for
                // room on the link is; then as a full send queue.
                drop(sq);
                drop(guard);
                let since = *credit_wait.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() > super::super::runtime::connect_timeout() {
                    klog!(Level::Warn, "vqp {:#x}: the peer granted nothing back for {:?}: ENOMEM", self.vqpn, since.elapsed());
                    return Err(Errno::ENOMEM);
                }
                rt.progress();
                std::thread::yield_now();
                continue;
            }
            let entry = SendEntry { wr_id: w.wr_id, signaled, opcode: wc_opcode, byte_len: total, awaits_done: staged.is_some() };
            let seq = match st.sq.push(entry) {
                Ok(seq) => seq,
                Err(e) => {
                    link.credit.unsend(cost);
                    return Err(e);
                }
            };
            st.sent_msgs |= is_send || w.opcode == ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
            klog!(Level::Debug, "vqp {:#x}: post opcode {} len {total} seq {seq} to {dst:#x}", self.vqpn, w.opcode);
            let large = staged.as_ref().map(|s| (s.addr(), s.rkey()));
            // The bind before the header: RC executes it first, so the
            // window is open before the peer can learn its rkey.
            let bound = staged.as_ref().map_or(Ok(()), |s| s.bind(rt, &mut sq));
            if let Some(s) = staged.take() {
                crate::stats::inc(crate::stats::Stat::KRCORE_STAT_LARGE_SENT);
                rt.large.sent(s, self.slot, self.gen, seq, link.qp.qpn());
            }
            let r = bound.and_then(|()| self.post_physical(link, &mut sq, w, sges, seq, signaled, dst, total, large));
            note_wire(&mut st.wire, wire_link, sq.mark());
            if let Err(e) = r {
                if let Some((addr, _)) = large {
                    rt.large.unsend(addr);
                }
                link.credit.unsend(cost);
                self.link_refused(&mut st.sq, seq, e);
            }
            return Ok(());
        }
    }

    /// Pre-check `sw` under the VQP's lock (`guard`), given back when it
    /// passes. An rkey neither the memo nor the peer's answers so far
    /// know is checked with the peer, without the lock: `Ok(None)`,
    /// check again (`fetches` counts the checks that found it); the peer
    /// has no such MR: EINVAL. An answer slower than the MR lease finds
    /// the entry already expired (the lease counts from the check's
    /// sending): ask again, up to [`MAX_FETCHES`] times.
    pub(super) fn precheck_fetching<'g>(
        &self,
        rt: &Runtime,
        guard: parking_lot::MutexGuard<'g, State>,
        sw: &SendWr<'_>,
        fetches: &mut u32,
    ) -> Result<Option<parking_lot::MutexGuard<'g, State>>> {
        let Some(conn) = &guard.conn else { return Err(Errno::EINVAL) };
        match self.precheck(&guard.memo, sw) {
            Ok(()) => Ok(Some(guard)),
            Err(Verdict::Reject(r)) => {
                klog!(Level::Debug, "vqp {:#x}: rejected a work request: {r}", self.vqpn);
                Err(r.errno())
            }
            Err(Verdict::NeedRemote { rkey }) => {
                // A closing link takes no new check: look again once the
                // connection has an open one.
                let Some(link) = conn.open_link().cloned() else { return Ok(None) };
                drop(guard);
                let known = if *fetches >= MAX_FETCHES {
                    klog!(
                        Level::Info,
                        "vqp {:#x}: {MAX_FETCHES} answers to checks of rkey {rkey:#x} came after the MR lease (KRCORE_MR_LEASE_MS)",
                        self.vqpn
                    );
                    Err(Errno(libc::ETIMEDOUT))
                } else {
                    self.fetch_remote(rt, &link, rkey, sw.remote_addr)
                };
                match known {
                    Ok(true) => {
                        *fetches += 1;
                        Ok(None)
                    }
                    Ok(false) => {
                        klog!(Level::Debug, "vqp {:#x}: rkey {rkey:#x} unknown to the peer", self.vqpn);
                        Err(Errno::EINVAL)
                    }
                    // The network never fails a post. The link began
                    // closing (the post moves to the next link) or failed
                    // (the VQP enters the error state: the post is
                    // flushed): look again.
                    Err(e) if e.0 == libc::ENOTCONN => Ok(None),
                    // No answer within the transport's retries (or none
                    // as fast as the lease): as an RC QP whose retries ran
                    // out.
                    Err(e) => {
                        self.fail_unreachable(e);
                        Ok(None)
                    }
                }
            }
        }
    }

    /// A WR posted to a send queue in the error state: accepted and
    /// completed at once with `IBV_WC_WR_FLUSH_ERR`, as by an RC QP (the
    /// first after a peer found gone with nothing outstanding takes that
    /// error instead, see `SendRing::fail_oldest`).
    pub(super) fn accept_flushed(&self, mut guard: parking_lot::MutexGuard<'_, State>, entry: SendEntry) -> Result<()> {
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
    pub(super) unsafe fn send_wr<'a>(&self, w: &'a ibv_send_wr) -> Result<SendWr<'a>> {
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
    /// tell. Every request is pre-checked first (an rkey checked with the peer
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
    pub(super) unsafe fn check_batch(&self, head: *mut ibv_send_wr, n: usize) -> Result<()> {
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
            let mut fetches = 0;
            while self.precheck_fetching(rt, self.st.lock(), &sw, &mut fetches)?.is_none() {
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
    pub(super) unsafe fn post_one_sided_fast(&self, w: &ibv_send_wr) -> Option<Result<()>> {
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
    pub(super) fn link_refused(&self, sq: &mut SendRing, seq: u16, e: Errno) {
        let mut emit = |c: Completion| self.deliver(&self.send_soft, c);
        let _ = sq.complete(seq, ibv_wc_status::IBV_WC_GENERAL_ERR, &mut emit);
        klog!(Level::Warn, "vqp {:#x}: posting on the link failed: {e:?}", self.vqpn);
    }

    /// Post the WQE(s) of one application WR on the link (its accounting
    /// lock held, so that decisions are in posting order).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn post_physical(
        &self,
        link: &Link,
        sq: &mut crate::vqp::queue::PhysSq,
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
    pub(super) fn fill_sges(&self, list: &mut [ibv_sge], sges: &[ibv_sge], inline: bool, seq: u16, header: &[u8]) -> Result<i32> {
        self.fill_sges_at(list, sges, inline, seq, header, 0)
    }

    /// [`Vqp::fill_sges`] from `skip` bytes into the slot (a header-less
    /// WR whose slot also carries a header posted after it; the header
    /// plus `skip` must fit the slot: `skip <= HEADER_LEN`).
    pub(super) fn fill_sges_at(
        &self,
        list: &mut [ibv_sge],
        sges: &[ibv_sge],
        inline: bool,
        seq: u16,
        header: &[u8],
        skip: usize,
    ) -> Result<i32> {
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
    pub(super) fn precheck(&self, memo: &MrMemo, sw: &SendWr<'_>) -> std::result::Result<(), Verdict> {
        let mrs = self.mrs(memo);
        precheck::check_send(sw, &self.dev_caps(), &mrs, &mrs)
    }

    /// The caps the pre-checks apply: the granted ones on the device of
    /// the runtime (its port's `max_msg_sz`, its `atomic_cap`).
    #[inline]
    pub(super) fn dev_caps(&self) -> Caps {
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
    pub(super) fn mrs<'a>(
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

    /// Ask the peer what its MR `rkey` is (for a WR at `addr`), into the
    /// cache ([`crate::vqp::mrcheck`]); whether the peer has it.
    pub(super) fn fetch_remote(&self, rt: &Runtime, link: &Link, rkey: u32, addr: u64) -> Result<bool> {
        let pm = self.peer_mrs.get().ok_or(Errno::EINVAL)?;
        // The lease counts from the check's sending (the owner counts from
        // its deregistration, which may come right after its answer).
        match crate::vqp::mrcheck::ask(rt, link, rkey, addr)? {
            Some((info, asked)) => {
                pm.lock().learn(rkey, info, asked);
                Ok(true)
            }
            None => Ok(false),
        }
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
}

/// Checks with the peer for one post whose answer expired before it
/// could be used; then the peer counts as unreachable (as an RC QP whose
/// retries ran out).
const MAX_FETCHES: u32 = 8;

// The registries behind a VQP's memo, out of line: inlined, their hashing
// was set up on every post, memo hit or not.
#[inline(never)]
pub(super) fn registry_local(pd: usize, lkey: u32) -> Option<precheck::MrInfo> {
    mrs::with(pd, |m| m.local(lkey))
}

#[inline(never)]
pub(super) fn peer_remote(pm: &Mutex<PeerMrs>, rkey: u32) -> Option<(precheck::MrInfo, u64)> {
    pm.lock().get(rkey)
}

/// `wire` (a VQP's last link and its mark) after a post on `link`, whose
/// mark is now `mark`; a new reference is taken only when it changed.
#[inline]
pub(super) fn note_wire(wire: &mut Option<(Weak<Link>, u64)>, link: &Arc<Link>, mark: u64) {
    match wire {
        Some((l, m)) if std::ptr::eq(l.as_ptr(), Arc::as_ptr(link)) => *m = mark,
        _ => *wire = Some((Arc::downgrade(link), mark)),
    }
}

/// What a WQE's wr_id says it retires: the decision's count when it is
/// signaled; an unsignaled WQE shows its wr_id only when flushed after an
/// error, when the link's accounting is reset anyway.
pub(super) fn wire_retired(d: &crate::vqp::queue::PostDecision) -> u16 {
    if d.signal {
        d.retired
    } else {
        1
    }
}

pub(super) fn is_atomic(op: u32) -> bool {
    matches!(op, ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP | ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD)
}

pub(super) fn wc_opcode_of(op: u32) -> u32 {
    match op {
        ibv_wr_opcode::IBV_WR_RDMA_WRITE | ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM => ibv_wc_opcode::IBV_WC_RDMA_WRITE,
        ibv_wr_opcode::IBV_WR_RDMA_READ => ibv_wc_opcode::IBV_WC_RDMA_READ,
        ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP => ibv_wc_opcode::IBV_WC_COMP_SWAP,
        ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD => ibv_wc_opcode::IBV_WC_FETCH_ADD,
        _ => ibv_wc_opcode::IBV_WC_SEND,
    }
}
