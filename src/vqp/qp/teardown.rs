//! Teardown that waits for the wire: RC's promise is that once a flush
//! completion is reported or `ibv_destroy_qp` (or a modify to RESET)
//! returned, the NIC touches none of those work requests' memory. A VQP's
//! WQEs share a link with other VQPs' and may still be on it (a 16 MiB
//! READ, work queued behind other VQPs' or behind RNR), so:
//! - ERR (and a peer found unreachable) flushes the send queue at once
//!   but holds the flush completions until the link completed the WQEs
//!   they report (later posts, flushed too, queue behind them), bounded
//!   as destroy is: past [`TRANSPORT_WAIT`] the link is failed;
//! - destroy and RESET wait until the link completed every WQE of the VQP
//!   and every READ of a large message it was receiving, bounded by
//!   [`TRANSPORT_WAIT`]: past it (a peer that does not answer, or RNR
//!   that never ends) the link is failed, as RC fails it after its
//!   retries, and its flush (every WQE done with) is waited for.
//!
//! Only then are its header slots given back (another VQP's header would
//! overwrite bytes the NIC has yet to send), and receivers of large
//! messages told to let their copies go.
//!
//! How "completed" is known: the link's send queue completes in order, so
//! the VQP keeps the link's mark after its last WQE (`State::wire`) and
//! `PhysSq::reached` says when every WQE before it completed;
//! `Runtime::fence_after` posts a signaled WQE behind an unsignaled tail
//! so that a completion comes (see wire.rs).

use super::super::runtime::{connect_timeout, Runtime, TRANSPORT_WAIT};
use super::super::wire::Waiter;
use super::{lookup, post_header_waiting, Completion, Header, Link, State, Vqp};
use crate::klog;
use crate::log::Level;
use crate::sys::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Whether every WQE of the VQP's send side completed on its link (a link
/// that is gone has nothing in flight).
fn sends_idle(st: &State) -> bool {
    wire_of(st).is_none_or(|(l, m)| l.sq.lock().reached(m))
}

/// The VQP's last link, while it exists, and its mark.
fn wire_of(st: &State) -> Option<(Arc<Link>, u64)> {
    st.wire.as_ref().and_then(|(l, m)| l.upgrade().map(|l| (l, *m)))
}

/// Whether nothing the VQP put on a link is in flight: its sends, and the
/// READs of a large message it receives.
fn wire_idle(st: &State) -> bool {
    sends_idle(st) && st.reading.as_ref().is_none_or(|r| r.inflight == 0)
}

impl Vqp {
    /// Flush the send queue (ERR, a peer unreachable): into `emit` when
    /// its WQEs are off the link, else held (true: call
    /// [`Vqp::watch_held`] once the VQP's lock is released).
    pub(super) fn flush_sends(&self, st: &mut State, emit: &mut impl FnMut(Completion)) -> bool {
        if let Some(rt) = self.rt.get() {
            self.detach_flow(rt, st);
        }
        if st.held_sends.is_empty() && sends_idle(st) {
            st.sq.flush(emit);
            return false;
        }
        let State { sq, held_sends, .. } = st;
        sq.flush(&mut |c| held_sends.push(c));
        true
    }

    /// Deliver the held flush completions once the link completed our
    /// WQEs (looked at after each progress pass).
    pub(super) fn watch_held(&self) {
        let Some(rt) = self.rt.get() else { return };
        let (slot, gen) = (self.slot, self.gen);
        let since = Instant::now();
        let w: Waiter = Box::new(move |rt: &Runtime, force: bool| match lookup(slot, gen) {
            Some(v) => v.release_held(rt, force, since),
            None => true,
        });
        rt.wire.wait(rt, w);
    }

    /// The held flush completions, delivered (under the VQP's lock, so that
    /// later ones stay behind) when the link is done with their WQEs, held
    /// `since` then. As [`Vqp::wait_wire`]: past [`TRANSPORT_WAIT`] (RNR
    /// that never ends: the WQEs would otherwise never complete, and an
    /// application waiting for its flush completions never goes on) their
    /// link is failed, and past the connect timeout more they are
    /// delivered anyway.
    fn release_held(&self, rt: &Runtime, force: bool, since: Instant) -> bool {
        let mut st = self.st.lock();
        if st.held_sends.is_empty() {
            return true;
        }
        if !force && !sends_idle(&st) {
            let held = since.elapsed();
            match wire_of(&st) {
                Some((link, mark)) if held <= TRANSPORT_WAIT => {
                    rt.fence_after(&link, mark);
                    return false;
                }
                Some((link, _)) if !link.is_failed() => {
                    // Not under the VQP's lock: failing a link visits its VQPs.
                    drop(st);
                    klog!(
                        Level::Warn,
                        "vqp {:#x}: its flushed WQEs did not complete within {TRANSPORT_WAIT:?}: failing their link",
                        self.vqpn
                    );
                    rt.link_failed(link.qp.qpn(), ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
                    return false;
                }
                _ if held <= TRANSPORT_WAIT + connect_timeout() => return false,
                _ => klog!(
                    Level::Warn,
                    "vqp {:#x}: its flushed WQEs did not complete on the link; flush completions delivered anyway",
                    self.vqpn
                ),
            }
        }
        let qpn = self.qpn();
        for c in st.held_sends.drain(..) {
            self.send_soft.push(c.to_wc(qpn));
        }
        true
    }

    /// Before destroy or RESET: no new READ of a large message, wait for
    /// everything of ours on the links, deliver what was held. Returns
    /// the large messages it will not receive (their senders are to be
    /// told: [`Vqp::tell_unread`]).
    pub(super) fn quiesce(&self) -> Vec<(Arc<Link>, Header)> {
        self.st.lock().torn_down = true;
        if let Some(rt) = self.rt.get() {
            let waited = self.wait_wire(rt);
            if waited > Duration::from_millis(1) {
                klog!(Level::Debug, "vqp {:#x}: teardown waited {waited:?} for its WQEs on the link", self.vqpn);
            }
        }
        let mut st = self.st.lock();
        let qpn = self.qpn();
        for c in st.held_sends.drain(..) {
            self.send_soft.push(c.to_wc(qpn));
        }
        let mut unread: Vec<(Arc<Link>, Header)> = st.reading.take().map(|r| (r.link, r.done)).into_iter().collect();
        let held: Vec<_> = st.held.drain(..).collect();
        for m in held.into_iter().filter(|m| m.header.flags.contains(super::Flags::LARGE)) {
            if let Some(link) = &m.origin.link {
                unread.push((Arc::clone(link), self.done_for(&m.header)));
            }
        }
        unread
    }

    /// Senders of large messages this VQP will not READ are told (a DONE
    /// with a flush status, best effort), so that their sends complete
    /// and their copies go.
    pub(super) fn tell_unread(&self, unread: Vec<(Arc<Link>, Header)>) {
        let Some(rt) = self.rt.get() else { return };
        for (link, mut done) in unread {
            done.imm = ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
            post_header_waiting(rt, &link, &done);
        }
    }

    /// Wait until nothing of ours is on a link, making progress; how long
    /// it took. Bounded by [`TRANSPORT_WAIT`], then the links concerned
    /// are failed (RC would have failed them after its retries) and their
    /// flush waited for (the connect timeout more at most).
    fn wait_wire(&self, rt: &Runtime) -> Duration {
        let start = Instant::now();
        let mut deadline = start + TRANSPORT_WAIT;
        let mut forced = false;
        loop {
            let (fence, reading) = {
                let st = self.st.lock();
                if wire_idle(&st) {
                    return start.elapsed();
                }
                (wire_of(&st), st.reading.as_ref().map(|r| Arc::clone(&r.link)))
            };
            if let Some((link, mark)) = &fence {
                rt.fence_after(link, *mark);
            }
            rt.progress();
            let now = Instant::now();
            if now > deadline {
                if forced {
                    klog!(Level::Warn, "vqp {:#x}: its WQEs did not complete on the link; torn down anyway", self.vqpn);
                    return start.elapsed();
                }
                klog!(Level::Warn, "vqp {:#x}: its WQEs did not complete within {TRANSPORT_WAIT:?}: failing their link", self.vqpn);
                for link in fence.map(|(l, _)| l).into_iter().chain(reading) {
                    rt.link_failed(link.qp.qpn(), ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
                }
                forced = true;
                deadline = now + connect_timeout();
            }
            // A transfer takes milliseconds: yield at first, then sleep.
            if now - start < Duration::from_millis(1) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }
}
