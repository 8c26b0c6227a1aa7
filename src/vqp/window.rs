//! The receiving side of a link's window (`crate::service::credit`): a
//! VQP message is admitted within the peer's share, counted while its VQP
//! holds it, and granted back in `LINK` GRANT headers once half the window
//! is owed. The sending side waits in `post_one` (qp/send.rs).

use super::header::{Header, HEADER_LEN};
use super::large::Control;
use super::qp as vqp;
use super::runtime::Runtime;
use crate::klog;
use crate::log::Level;
use crate::service::Link;
use std::sync::Arc;

impl Runtime {
    /// A VQP's message on `link`: within the peer's share of the link's
    /// window (`crate::service::credit`), to its VQP, which holds the
    /// bytes while it holds the message.
    pub(super) fn on_vqp_message(&self, h: &Header, payload: &[u8], link: &Arc<Link>) {
        let cost = (HEADER_LEN + payload.len()) as u64;
        if !link.credit.admit(cost) {
            crate::stats::inc(crate::stats::Stat::KRCORE_STAT_MSGS_OVERRUN);
            klog!(Level::Debug, "vqp: dropped a message for VQP {:#x}: past the link's window (QP {})", h.dst, link.qp.qpn());
            return;
        }
        let held = match vqp::by_vqpn(h.dst) {
            Some(v) if v.runs_on(self) => v.on_message(h, payload, link, cost),
            Some(_) => {
                // A VQP of another PD: never reached from here.
                crate::stats::inc(crate::stats::Stat::KRCORE_STAT_MSGS_REFUSED);
                klog!(Level::Debug, "vqp: dropped a message for VQP {:#x} of another PD", h.dst);
                false
            }
            None => {
                klog!(Level::Debug, "vqp: dropped a message for VQP {:#x} (none here)", h.dst);
                false
            }
        };
        if !held {
            link.credit.release(cost);
        }
        self.grant(link);
    }

    /// Give the peer on `link` back what its messages no longer hold here,
    /// once half the window is owed (when the link has no room, at a
    /// later progress); none behind our LINK_CLOSE (`post_header_with`).
    pub fn grant(&self, link: &Link) {
        if !link.credit.grant_due() {
            return;
        }
        let n = link.credit.take_grant();
        if n > 0 && !super::qp::post_header_as(self, link, &Header::grant(n), |retired| Control::Header { retired }) {
            link.credit.ungrant(n);
        }
    }

    /// The grants due on any link (VQPs let held messages go).
    pub fn pump_grants(&self) {
        if self.svc.take_grants_due() {
            for link in self.svc.live_links() {
                self.grant(&link);
            }
        }
    }
}
