//! Progress: the links' completions turned into the VQPs' completions
//! and received messages, on whichever thread needs it, one at a time.

use super::*;

/// The VQP the last send completion went to: completions come in runs for
/// one VQP, which then skip the slot table and its lock.
#[derive(Default)]
pub(super) struct LastVqp(Option<(u32, u8, Weak<vqp::Vqp>)>);

impl LastVqp {
    fn get(&mut self, slot: u32, gen: u8) -> Option<Arc<vqp::Vqp>> {
        if let Some((s, g, w)) = &self.0 {
            if (*s, *g) == (slot, gen) {
                // A destroyed VQP fails to upgrade, as its slot would.
                return w.upgrade();
            }
        }
        let v = vqp::lookup(slot, gen)?;
        self.0 = Some((slot, gen, Arc::downgrade(&v)));
        Some(v)
    }
}

/// How long a wait for what only a peer's CPU answers (an MR check, the
/// tier's first contact) spins before it sleeps between looks.
const SPIN: Duration = Duration::from_millis(1);
/// The longest sleep between two looks.
const MAX_NAP: Duration = Duration::from_millis(2);

/// Between two looks at what a peer's process answers, `waited` into the
/// wait: a turn for the other threads while the answer may be a round
/// trip away, then naps growing with the wait (up to [`MAX_NAP`]): in a
/// burst of new processes on a few CPUs the peer is starved for seconds,
/// and a spinning asker burns the CPU the answer needs (a first GET's
/// MR check cost clients of a burst of 64 about 110 ms of CPU each).
pub(crate) fn pause(waited: Duration) {
    match nap(waited) {
        None => std::thread::yield_now(),
        Some(d) => std::thread::sleep(d),
    }
}

/// [`pause`]'s sleep `waited` into a wait (None: a yield).
fn nap(waited: Duration) -> Option<Duration> {
    (waited >= SPIN).then(|| (waited / 16).clamp(Duration::from_micros(50), MAX_NAP))
}

impl Runtime {
    /// Poll the links' completions and deliver them. Returns at once when
    /// another thread is already doing it.
    pub fn progress(&self) {
        self.progress_for(true, None);
    }

    /// Progress for a poll of an application CQ: the links' messages are
    /// taken only when it `receives` (or a large send awaits its DONE,
    /// which comes as a message); else they wait for a CQ that receives or
    /// for the service thread, which takes them while nobody polls for
    /// them (`polls` tells it).
    /// Completions for the CQ behind `sink` go into it (see [`Sink`]).
    pub fn progress_for(&self, receives: bool, mut sink: Option<&mut Sink<'_>>) {
        if self.dgram.busy() {
            self.svc.poll_datagrams();
        }
        let mut messages = receives || self.large.awaits_done();
        if messages {
            // A plain store, not a locked increment: the service thread
            // only asks whether it changed.
            self.polls.store(self.polls.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
        }
        loop {
            let mut last = match self.progress.try_lock() {
                Some(l) => l,
                None => {
                    // Flag, then try again: the holder looks at the flag
                    // after releasing, so one of the two drains.
                    self.progress_again.store(true, Ordering::SeqCst);
                    match self.progress.try_lock() {
                        Some(l) => l,
                        None => return,
                    }
                }
            };
            self.drain(&mut last, messages, sink.as_deref_mut());
            drop(last);
            // A load first: the swap is a locked instruction, rarely needed.
            if !self.progress_again.load(Ordering::SeqCst) || !self.progress_again.swap(false, Ordering::SeqCst) {
                return;
            }
            // For the other thread, which may have wanted the messages.
            messages = true;
        }
    }

    /// Deliver the messages that landed in the links' receive buffers
    /// (waiting for a thread that is delivering some now). A VQP whose link
    /// closed sends on the datagram tier once its last WQE there completed,
    /// that is once its messages landed here, not once they were taken: the
    /// tier delivers a flow's messages after this, so they cannot overtake
    /// them.
    pub(crate) fn take_link_messages(&self) {
        if self.svc.link_cqs().is_some() {
            self.progress_messages();
        }
    }

    /// The service thread's pass over the links' messages: it waits for
    /// the progress lock (the messages must be taken off the shared
    /// buffers), then, like [`Runtime::progress_for`], drains once more
    /// for a thread that found the lock held meanwhile and left its work
    /// to this one (an application arming its CQ relies on that pass for
    /// a completion that came before the links' CQ was armed).
    pub(super) fn progress_messages(&self) {
        let mut last = self.progress.lock();
        self.drain(&mut last, true, None);
        drop(last);
        if self.progress_again.load(Ordering::SeqCst) && self.progress_again.swap(false, Ordering::SeqCst) {
            self.progress_for(true, None);
        }
    }

    /// Poll the links' send (and, with `messages`, receive) completions
    /// and deliver them (the progress lock held).
    fn drain(&self, last: &mut LastVqp, messages: bool, mut sink: Option<&mut Sink<'_>>) {
        const BATCH: usize = 32;
        let mut wcs = [const { std::mem::MaybeUninit::<ibv_wc>::uninit() }; BATCH];
        // No link side yet: no link, nothing to poll.
        let both = self.svc.link_cqs();
        for cq in [both.map(|b| b.0), both.filter(|_| messages).map(|b| b.1)].into_iter().flatten() {
            loop {
                let got = match cq.poll_uninit(&mut wcs) {
                    Ok(got) => got,
                    Err(e) => {
                        klog!(Level::Warn, "vqp: polling the links: {e:?}");
                        return;
                    }
                };
                for wc in got {
                    self.dispatch(wc, last, sink.as_deref_mut());
                }
                if got.len() < BATCH {
                    break;
                }
            }
        }
        // Receivers of large messages that found no room on their link.
        for (slot, gen) in self.large.take_waiting() {
            if let Some(v) = vqp::lookup(slot, gen) {
                v.pump_large();
            }
        }
        crate::vqp::mrcheck::pump_owed(self);
        self.pump_grants();
        self.wire.check(self);
    }

    /// A fresh tag for a control WQE's wr_id.
    pub fn next_tag(&self) -> u32 {
        self.next_tag.fetch_add(1, Ordering::Relaxed)
    }

    fn dispatch(&self, wc: &ibv_wc, last: &mut LastVqp, sink: Option<&mut Sink<'_>>) {
        self.dispatch_one(wc, last, sink);
        // Any error completion of a link's send queue (the receive side's
        // are flushes of the SRQ's buffers, handled there) means its QP
        // is in ERR: every VQP on it follows.
        if wc.status != ibv_wc_status::IBV_WC_SUCCESS && !matches!(WrId::decode(wc.wr_id), Ok(WrId::Recv { .. })) {
            self.link_failed(wc.qp_num, wc.status);
        }
    }

    fn dispatch_one(&self, wc: &ibv_wc, last: &mut LastVqp, sink: Option<&mut Sink<'_>>) {
        let id = match WrId::decode(wc.wr_id) {
            Ok(id) => id,
            Err(_) => {
                klog!(Level::Warn, "vqp: a completion with a foreign wr_id {:#x}", wc.wr_id);
                return;
            }
        };
        match id {
            WrId::Recv { buf } => self.on_message(buf, wc),
            WrId::Send(s) => {
                // The VQP's own link does the accounting (one lookup less
                // per completion); a destroyed VQP's, the link by number.
                let accounted = match last.get(s.slot(), s.generation()) {
                    Some(v) => v.on_send_completion(s.seq(), wc.status, wc.qp_num, s.retired(), sink),
                    None => false,
                };
                if !accounted {
                    if let Some(link) = self.svc.link_by_qpn(wc.qp_num).filter(|l| !l.is_failed()) {
                        if let Err(e) = link.sq.lock().on_completion(s.retired()) {
                            klog!(Level::Warn, "vqp: link accounting: {e:?}");
                        }
                    }
                }
            }
            WrId::Control { tag } => match self.large.take(tag) {
                Some(Control::Fence { link_qpn }) => {
                    if let Some(link) = self.svc.link_by_qpn(link_qpn) {
                        self.link_gone(&link);
                    }
                }
                Some(c) => {
                    if let Some(link) = self.svc.link_by_qpn(wc.qp_num).filter(|l| !l.is_failed()) {
                        if let Err(e) = link.sq.lock().on_completion(c.retired()) {
                            klog!(Level::Warn, "vqp: link accounting: {e:?}");
                        }
                    }
                    match c {
                        Control::Read { slot, gen, .. } => {
                            if let Some(v) = vqp::lookup(slot, gen) {
                                v.on_large_read(wc.status);
                            }
                        }
                        Control::LinkClose { .. } => {
                            if let Some(link) = self.svc.link_by_qpn(wc.qp_num) {
                                if wc.status == ibv_wc_status::IBV_WC_SUCCESS {
                                    link.close_done.store(true, Ordering::Release);
                                    self.finish_close(&link);
                                }
                            }
                        }
                        // A READ the peer's end answered: it receives (an
                        // accepted link whose LINK_READY was lost is
                        // confirmed so).
                        Control::Probe { .. } if wc.status == ibv_wc_status::IBV_WC_SUCCESS => {
                            if let Some(link) = self.svc.link_by_qpn(wc.qp_num) {
                                self.svc.heard_on(&link);
                            }
                        }
                        Control::Header { .. } | Control::Bind { .. } | Control::Probe { .. } | Control::Fence { .. } => {}
                    }
                }
                None => klog!(Level::Warn, "vqp: a completion for no control WQE of ours (tag {tag})"),
            },
        }
    }

    /// A message landed in receive buffer `buf`.
    fn on_message(&self, buf: u32, wc: &ibv_wc) {
        if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
            // Flushed: its link went down; the buffer is gone with it.
            return;
        }
        let off = buf as usize * RECV_BUF;
        let Some(bufs) = self.recv_bufs.get() else { return };
        // SAFETY: this buffer's receive completed; it is reposted below
        // once the message is copied out.
        let bytes = unsafe { bufs.bytes(off, RECV_BUF) };
        let link = self.svc.link_by_qpn(wc.qp_num);
        if let Some(l) = &link {
            self.svc.heard_on(l);
        }
        match Header::received(bytes, wc.byte_len, MAX_MSG) {
            Ok(h) if h.flags.contains(Flags::LINK) => match (link, h.link_op()) {
                (Some(link), Some(LinkOp::Close)) => {
                    // Everything the peer sent on it came before this.
                    link.close_heard.store(true, Ordering::Release);
                    if self.svc.begin_close(&link) {
                        klog!(Level::Info, "vqp: the peer closes the link to {:02x?} (QP {})", link.peer.gid, wc.qp_num);
                    }
                    self.close_link(&link);
                }
                (Some(link), Some(LinkOp::MrCheck)) => crate::vqp::mrcheck::on_check(self, &link, &h),
                (Some(_), Some(LinkOp::MrAnswer)) => {
                    let payload = &bytes[HEADER_LEN..HEADER_LEN + h.carried_len() as usize];
                    crate::vqp::mrcheck::on_answer(self, wc.qp_num, &h, payload);
                }
                (Some(link), Some(LinkOp::Grant)) => {
                    if !link.credit.granted(h.addr) {
                        crate::stats::inc(crate::stats::Stat::KRCORE_STAT_MSGS_OVERRUN);
                        klog!(Level::Debug, "vqp: a grant of {} bytes, more than we sent on QP {}: ignored", h.addr, wc.qp_num);
                    }
                }
                _ => klog!(Level::Warn, "vqp: a {:?} message on no link of ours (QP {})", h.link_op(), wc.qp_num),
            },
            Ok(h) if h.flags.contains(Flags::DONE) => match self.large.on_done(h.addr, wc.qp_num) {
                Some((slot, gen, seq)) => {
                    if let Some(v) = vqp::lookup(slot, gen) {
                        v.on_large_done(seq, h.imm);
                    }
                }
                None => klog!(Level::Warn, "vqp: dropped a DONE for no message of ours ({:#x})", h.addr),
            },
            Ok(h) => {
                // Exactly what arrived (checked by `received`).
                let payload = &bytes[HEADER_LEN..HEADER_LEN + h.carried_len() as usize];
                match link {
                    Some(link) => self.on_vqp_message(&h, payload, &link),
                    None => klog!(Level::Debug, "vqp: dropped a message on no link of ours (QP {})", wc.qp_num),
                }
            }
            Err(e) => {
                // A header that does not decode, or whose length is not
                // what arrived: delivering it would hand the application
                // stale bytes of this shared buffer. Its sender broke the
                // protocol; nothing more it sends can be trusted.
                crate::stats::inc(crate::stats::Stat::KRCORE_STAT_MSGS_MALFORMED);
                klog!(
                    Level::Warn,
                    "vqp: dropped a malformed message of {} bytes on QP {} ({e:?}): failing its link",
                    wc.byte_len,
                    wc.qp_num
                );
                self.link_failed(wc.qp_num, ibv_wc_status::IBV_WC_LOC_PROT_ERR);
            }
        }
        if let Err(e) = self.post_recv_buf(bufs, buf) {
            klog!(Level::Warn, "vqp: cannot repost a receive buffer: {e:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_spins_a_millisecond_then_naps_longer_up_to_two() {
        assert_eq!(nap(Duration::ZERO), None);
        assert_eq!(nap(Duration::from_micros(999)), None);
        assert_eq!(nap(SPIN), Some(Duration::from_nanos(62_500)));
        assert_eq!(nap(Duration::from_millis(16)), Some(Duration::from_millis(1)));
        assert_eq!(nap(Duration::from_secs(5)), Some(MAX_NAP));
    }
}
