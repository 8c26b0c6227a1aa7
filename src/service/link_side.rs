//! What only links need: their completion queues, the shared receive queue
//! and the 8 bytes peers READ over them to see us alive. Built when the first link is
//! made or accepted (or in the background after the start), not in front
//! of a process's first operation, which goes on the datagram tier.

use crate::error::Result;
use crate::rdma::{self, Cq, Device, Region, Srq};
use std::sync::Arc;

/// Bytes of [`LinkSide::probe`]: what one probe READs.
pub const PROBE_LEN: usize = 8;

pub(super) struct LinkSide {
    /// The links' send completions.
    pub link_cq: Arc<Cq>,
    /// The links' receive completions (messages, in the SRQ's buffers):
    /// always armed, so that messages reach their VQPs, and the buffers
    /// are reposted, while the application is not polling (a real QP's
    /// NIC places data without the application's help).
    pub recv_cq: Arc<Cq>,
    pub srq: Arc<Srq>,
    /// What a peer's liveness probe READs: nothing in it (zeroes), and
    /// nothing else registered for remote access by the library in the
    /// PD but large messages' staging (`src/vqp/large.rs`). Whether a peer
    /// may use an rkey of the application's it asks us
    /// (`src/vqp/mrcheck.rs`): no table of them is readable.
    probe: Region,
}

impl LinkSide {
    pub fn new(dev: &Arc<Device>, srq_wr: u32) -> Result<LinkSide> {
        let link_cq = Arc::new(Cq::new(dev, 4096)?);
        let recv_cq = Arc::new(Cq::new(dev, srq_wr.max(64))?);
        // Both armed from the start: the receive CQ always is, and the
        // send CQ raises one event for work an application asleep on its
        // completion channel already waits for (the handler re-arms it
        // only while events are wanted).
        recv_cq.arm()?;
        link_cq.arm()?;
        let srq = Arc::new(Srq::new(dev, srq_wr, 1)?);
        crate::kmark!("service: link CQs and SRQ made");
        let probe = Region::new(dev, PROBE_LEN, rdma::LOCAL_WRITE | rdma::REMOTE_READ)?;
        Ok(LinkSide { link_cq, recv_cq, srq, probe })
    }

    /// What peers probe: (address, rkey).
    pub fn probe(&self) -> (u64, u32) {
        (self.probe.addr(), self.probe.rkey())
    }

    /// The channels' fds: (send, receive).
    pub fn fds(&self) -> (libc::c_int, libc::c_int) {
        // SAFETY: live channels, owned by the CQs.
        unsafe { ((*self.link_cq.channel).fd, (*self.recv_cq.channel).fd) }
    }
}
