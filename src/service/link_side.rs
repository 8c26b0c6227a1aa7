//! What only links need: their completion queues, the shared receive queue
//! and the MR table peers READ over them. Built when the first link is
//! made or accepted (or in the background after the start), not in front
//! of a process's first operation, which goes on the datagram tier.

use crate::error::Result;
use crate::meta::mrtable::MrTable;
use crate::rdma::{self, Cq, Device, Region, Srq};
use parking_lot::Mutex;
use std::sync::Arc;

pub(super) struct LinkSide {
    /// The links' send completions.
    pub link_cq: Arc<Cq>,
    /// The links' receive completions (messages, in the SRQ's buffers):
    /// always armed, so that messages reach their VQPs, and the buffers
    /// are reposted, while the application is not polling (a real QP's
    /// NIC places data without the application's help).
    pub recv_cq: Arc<Cq>,
    pub srq: Arc<Srq>,
    /// Declared before `mr_table_mem`, whose memory it points into, so
    /// that it is dropped first.
    pub mr_table: Mutex<MrTable<'static>>,
    mr_table_mem: Region,
    mr_table_slots: u32,
}

impl LinkSide {
    pub fn new(dev: &Arc<Device>, srq_wr: u32, slots: u32, incarnation: u64) -> Result<LinkSide> {
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
        let mr_table_mem = Region::new(dev, MrTable::bytes_for(slots), rdma::LOCAL_WRITE | rdma::REMOTE_READ)?;
        let len = mr_table_mem.len();
        // SAFETY: the slice covers `mr_table_mem`'s heap allocation, which
        // never moves and outlives `mr_table` (dropped first); only
        // `mr_table` writes it, the NIC reads it.
        let mem = unsafe { std::slice::from_raw_parts_mut(mr_table_mem.ptr(), len) };
        let mr_table = Mutex::new(MrTable::init(mem, slots, incarnation)?);
        crate::kmark!("service: MR table registered");
        Ok(LinkSide { link_cq, recv_cq, srq, mr_table, mr_table_mem, mr_table_slots: slots })
    }

    /// Our MR table: (address, rkey, slots).
    pub fn mr_table_info(&self) -> (u64, u32, u32) {
        (self.mr_table_mem.addr(), self.mr_table_mem.rkey(), self.mr_table_slots)
    }

    /// The channels' fds: (send, receive).
    pub fn fds(&self) -> (libc::c_int, libc::c_int) {
        // SAFETY: live channels, owned by the CQs.
        unsafe { ((*self.link_cq.channel).fd, (*self.recv_cq.channel).fd) }
    }
}
