//! `qpop_msgs` on a bound VQP: the senders' messages in arrival order,
//! each with the VQP (`src_qp`) that answers its sender, made without
//! waiting for the network; senders gone are reported closed.

use super::*;

impl Vqp {
    /// `qpop_msgs`: up to `n` (sender, completion) pairs. `make_src`
    /// creates the application object of a VQP connected back to a sender;
    /// `free_src` destroys one whose sender is gone (reported by an earlier
    /// call with `IBV_WC_WR_FLUSH_ERR`) once its own work has completed
    /// (an answer still waiting for its acknowledgement, or failing, must
    /// reach the application's CQ), and returns whether it did.
    ///
    /// Never waits for the network: a sender's src_qp goes on the link that
    /// serves its process now, or, with none (it was closed), gets one at
    /// its first post; a sender whose link failed gets a src_qp in the
    /// error state. An error after messages were taken returns them, and
    /// the error at the next call; the message it met stays first in the
    /// inbox. The only error there is `Vqp::new`'s ENOMEM: the process's
    /// VQP table full (`wrid::MAX_SLOTS`, 2^20 live VQPs: measured 1.7 GiB
    /// and 37 s of `ibv_create_qp` in the VM, beyond the 2 GiB testbed) or
    /// a queue allocation failing (where infallible allocations abort
    /// first); `make_src` does not fail.
    pub fn pop_msgs(
        self: &Arc<Self>,
        n: usize,
        make_src: &dyn Fn(&Arc<Vqp>) -> Result<*mut ibv_qp>,
        free_src: &dyn Fn(*mut ibv_qp) -> bool,
    ) -> Result<Vec<(*mut ibv_qp, ibv_wc)>> {
        let rt = self.rt.get().ok_or(Errno::EINVAL)?;
        if !self.is_bound() {
            return Err(Errno::EINVAL);
        }
        let _one = self.popping.lock();
        let (mut retired, failure) = {
            let mut st = self.st.lock();
            (std::mem::take(&mut st.retired), st.pop_error.take())
        };
        retired.retain(|&q| !free_src(q));
        self.st.lock().retired.append(&mut retired);
        if let Some(e) = failure {
            return Err(e);
        }
        rt.progress();
        let mut out = Vec::new();
        while out.len() < n {
            let mut st = self.st.lock();
            let Some(entry) = st.inbox.pop_front() else { break };
            let (origin, src, wc) = match entry {
                Inbox::Msg(origin, src, wc) => (origin, src, wc),
                Inbox::Closed(sender) => {
                    st.senders.forget(&sender);
                    // A sender we never answered has no src_qp to retire.
                    if let Some(qp) = st.src_qps.remove(&sender) {
                        st.retired.push(qp);
                        // SAFETY: ibv_wc is plain C data.
                        let mut wc: ibv_wc = unsafe { crate::obj::zeroed() };
                        wc.status = ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
                        wc.opcode = ibv_wc_opcode::IBV_WC_RECV;
                        wc.qp_num = self.qpn();
                        wc.src_qp = sender.vqpn;
                        out.push((qp, wc));
                    }
                    continue;
                }
            };
            let key = origin.sender(src);
            if let Some(&qp) = st.src_qps.get(&key) {
                out.push((qp, wc));
                continue;
            }
            st.answering = Some(key);
            drop(st);
            let made = self.answer(rt, &origin, src, make_src);
            let mut st = self.st.lock();
            st.answering = None;
            match made {
                Ok(qp) => {
                    st.src_qps.insert(key, qp);
                    out.push((qp, wc));
                }
                Err(e) => {
                    // Nothing is lost: the message waits for the next call.
                    st.inbox.push_front(Inbox::Msg(origin, src, wc));
                    if out.is_empty() {
                        return Err(e);
                    }
                    klog!(Level::Warn, "vqp {:#x}: qpop_msgs: {e:?} making a src_qp; reported at the next call", self.vqpn);
                    st.pop_error = Some(e);
                    break;
                }
            }
        }
        Ok(out)
    }

    /// A VQP connected back to sender `src` of the process its message
    /// came from (`origin`), without a link handshake (`qpop_msgs` never
    /// blocks).
    fn answer(
        self: &Arc<Self>,
        rt: &Arc<Runtime>,
        origin: &Origin,
        src: u32,
        make_src: &dyn Fn(&Arc<Vqp>) -> Result<*mut ibv_qp>,
    ) -> Result<*mut ibv_qp> {
        let (peer, index) = (origin.peer, origin.index);
        let mut cap = ibv_qp_cap { max_send_wr: 64, max_recv_wr: 64, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let v = Vqp::new(self.app, Arc::clone(&self.send_soft), Arc::clone(&self.recv_soft), &mut cap, false)?;
        let _ = v.rt.set(Arc::clone(rt));
        let _ = v.parent.set((Arc::downgrade(self), origin.sender(src)));
        match rt.svc.link_to(peer.incarnation, index, origin.path) {
            Some(link) => v.attach(rt, link, peer, src),
            // Its process is gone: as a VQP whose link failed (posts are
            // accepted and flushed); the sender is reported closed after
            // its messages (`on_link_failed`).
            None if origin.link.as_ref().is_some_and(|l| l.is_failed()) || rt.peer_gone(peer.incarnation) => {
                let mut st = v.st.lock();
                st.failed = true;
                // Empty: this puts its send queue in the error state.
                st.sq.flush(&mut |_| {});
            }
            // Closed since (link reclaim), or it came on the datagram tier:
            // the first post makes or finds a link, or takes the tier.
            None => v.attach_at(rt, None, peer, index, origin.path, src),
        }
        make_src(&v)
    }
}
