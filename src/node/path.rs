//! The agent's side of a new process's first work requests: the agent is
//! itself a krcore application (its verbs are this library's, so its VQPs
//! use the host's links and datagram tier), with one VQP per VQP a process
//! connected through it, and staging regions (memfds it made, mapped and
//! registered before any process asks: a spare or two kept ready) that it
//! passes one to each process at its `STAGE`.
//!
//! A `POST` names a range of that region: the agent's VQP READs into it
//! or WRITEs from it, and the completion goes back as `DONE` with the
//! process's token. Nothing of a process outlives its connection: its
//! VQPs are destroyed, its region deregistered and unmapped.

use super::proto::{Post, OP_CMP_AND_SWP, OP_FETCH_AND_ADD, OP_READ, OP_WRITE};
use crate::error::{Errno, Result};
use crate::meta::Key;
use crate::sys::*;
use libc::{c_int, c_void};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

// The library's own verbs (this binary links it: these are its exports).
extern "C" {
    fn ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device;
    fn ibv_free_device_list(list: *mut *mut ibv_device);
    fn ibv_get_device_name(dev: *mut ibv_device) -> *const libc::c_char;
    fn ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context;
    fn ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd;
    fn ibv_create_comp_channel(ctx: *mut ibv_context) -> *mut ibv_comp_channel;
    fn ibv_create_cq(ctx: *mut ibv_context, cqe: c_int, cq_ctx: *mut c_void, ch: *mut ibv_comp_channel, vector: c_int) -> *mut ibv_cq;
    fn ibv_get_cq_event(ch: *mut ibv_comp_channel, cq: *mut *mut ibv_cq, ctx: *mut *mut c_void) -> c_int;
    fn ibv_ack_cq_events(cq: *mut ibv_cq, n: libc::c_uint);
    fn ibv_create_qp(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp;
    fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int;
    fn ibv_reg_mr(pd: *mut ibv_pd, addr: *mut c_void, len: usize, access: c_int) -> *mut ibv_mr;
    fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int;
}

/// Work requests one agent VQP has outstanding at most (the process keeps
/// fewer in flight: `transport::agent::WINDOW`).
const SQ_DEPTH: u32 = 128;

/// The agent's device objects, made at its start (the library's runtime
/// of their PD starts then, in the background: pre-initialized).
/// Kept for the agent's life (freed at its exit).
pub struct Verbs {
    pd: *mut ibv_pd,
    channel: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
}

// SAFETY: the objects are used by the agent's one thread only; the type
// is moved into it once.
unsafe impl Send for Verbs {}

impl Verbs {
    /// Open `device` (the first when None) through the library.
    pub fn open(device: Option<&str>) -> Result<Verbs> {
        let mut n: c_int = 0;
        // SAFETY: the library's verbs; the list is freed below.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(Errno::last());
        }
        let mut ctx = std::ptr::null_mut();
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds n devices; names are NUL-terminated.
            let (dev, name) = unsafe {
                let dev = *list.add(i);
                (dev, std::ffi::CStr::from_ptr(ibv_get_device_name(dev)).to_string_lossy().into_owned())
            };
            if device.is_none_or(|d| d == name) {
                // SAFETY: a device of the live list.
                ctx = unsafe { ibv_open_device(dev) };
                break;
            }
        }
        // SAFETY: the list from above, freed once.
        unsafe { ibv_free_device_list(list) };
        if ctx.is_null() {
            return Err(Errno(libc::ENODEV));
        }
        // SAFETY: a live context; each result is checked.
        unsafe {
            let pd = ibv_alloc_pd(ctx);
            let channel = ibv_create_comp_channel(ctx);
            if pd.is_null() || channel.is_null() {
                return Err(Errno::last());
            }
            let cq = ibv_create_cq(ctx, 4096, std::ptr::null_mut(), channel, 0);
            if cq.is_null() {
                return Err(Errno::last());
            }
            let v = Verbs { pd, channel, cq };
            v.arm()?;
            Ok(v)
        }
    }

    /// The completion channel's descriptor (readable: completions).
    pub fn event_fd(&self) -> RawFd {
        // SAFETY: a live channel.
        unsafe { (*self.channel).fd }
    }

    fn arm(&self) -> Result<()> {
        // SAFETY: ibv_req_notify_cq is inline in verbs.h: the context's op.
        let r = unsafe { ((*(*self.cq).context).ops.req_notify_cq.ok_or(Errno::EINVAL)?)(self.cq, 0) };
        if r != 0 {
            return Err(Errno(r));
        }
        Ok(())
    }

    /// Every completion (wr_id, status, byte_len); after the channel was
    /// readable (`event`), its event taken and the CQ armed again first.
    pub fn completions(&self, event: bool) -> Vec<(u64, u32, u32)> {
        let mut out = Vec::new();
        if event {
            let mut cq = std::ptr::null_mut();
            let mut cq_ctx = std::ptr::null_mut();
            // SAFETY: the live channel, found readable: the event is there.
            if unsafe { ibv_get_cq_event(self.channel, &mut cq, &mut cq_ctx) } == 0 {
                // SAFETY: the CQ the event named (ours).
                unsafe { ibv_ack_cq_events(cq, 1) };
            }
            let _ = self.arm();
        }
        // SAFETY: a plain C struct array, filled by the poll.
        let mut wc: [ibv_wc; 16] = unsafe { std::mem::zeroed() };
        loop {
            // SAFETY: ibv_poll_cq is inline in verbs.h: the context's op.
            let n = unsafe { ((*(*self.cq).context).ops.poll_cq.expect("poll_cq"))(self.cq, wc.len() as c_int, wc.as_mut_ptr()) };
            if n <= 0 {
                break;
            }
            out.extend(wc[..n as usize].iter().map(|w| (w.wr_id, w.status, w.byte_len)));
        }
        out
    }
}

/// A staging region: a memfd the agent made, mapped and registered (before
/// any process asked for it), passed to one process: `len` bytes of data
/// slots (the MR), then the rings (`super::ring`, not registered).
pub struct Region {
    fd: OwnedFd,
    map: *mut u8,
    len: usize,
    mr: *mut ibv_mr,
}

// SAFETY: as `Verbs`.
unsafe impl Send for Region {}

impl Region {
    pub fn new(v: &Verbs, len: usize) -> Result<Region> {
        // SAFETY: plain syscalls; the fd is checked and then owned.
        let fd = unsafe {
            let fd = libc::memfd_create(c"krcore-staging".as_ptr(), libc::MFD_CLOEXEC);
            if fd < 0 {
                return Err(Errno::last());
            }
            <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd)
        };
        let total = len + super::ring::LEN;
        // SAFETY: our memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), total as libc::off_t) } != 0 {
            return Err(Errno::last());
        }
        // SAFETY: a shared mapping of our memfd, unmapped in Drop.
        let map =
            unsafe { libc::mmap(std::ptr::null_mut(), total, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if map == libc::MAP_FAILED {
            return Err(Errno::last());
        }
        let access = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0) as c_int;
        // SAFETY: the live PD and the mapping above.
        let mr = unsafe { ibv_reg_mr(v.pd, map, len, access) };
        if mr.is_null() {
            let e = Errno::last();
            // SAFETY: the mapping above.
            unsafe { libc::munmap(map, total) };
            return Err(e);
        }
        Ok(Region { fd, map: map.cast(), len, mr })
    }

    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The data slots' bytes (the rings follow).
    pub fn len(&self) -> usize {
        self.len
    }

    /// The rings after the data.
    pub fn rings(&self) -> super::ring::Rings {
        // SAFETY: the rings' bytes follow the data in our mapping (page
        // aligned: `len` is a multiple of the slots), for the region's life.
        unsafe { super::ring::Rings::at(self.map.add(self.len)) }
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: our MR and mapping, once.
        unsafe {
            ibv_dereg_mr(self.mr);
            libc::munmap(self.map.cast(), self.len + super::ring::LEN);
        }
    }
}

/// One process's side: its staging region, its VQPs here, and our own
/// counts of its rings (never read from the shared memory).
pub struct Staging {
    region: Region,
    qps: HashMap<u32, *mut ibv_qp>,
    next: u32,
    req_tail: u32,
    done_head: u32,
}

// SAFETY: as `Verbs`.
unsafe impl Send for Staging {}

impl Staging {
    pub fn new(region: Region) -> Staging {
        Staging { region, qps: HashMap::new(), next: 1, req_tail: 0, done_head: 0 }
    }

    /// A VQP of the agent's, connected to `key` (a `qconnect`): its handle
    /// and the endpoint it connected to.
    pub fn connect(&mut self, v: &Verbs, key: &Key) -> Result<(u32, crate::meta::Endpoint)> {
        let Key::Port { gid, port } = *key else { return Err(Errno::EINVAL) };
        // SAFETY: a plain C struct.
        let mut a: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        a.send_cq = v.cq;
        a.recv_cq = v.cq;
        a.qp_type = crate::abi::ext::KRCORE_VQP;
        a.sq_sig_all = 1;
        a.cap = ibv_qp_cap { max_send_wr: SQ_DEPTH, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        // SAFETY: the live PD.
        let qp = unsafe { ibv_create_qp(v.pd, &mut a) };
        if qp.is_null() {
            return Err(Errno::last());
        }
        // SAFETY: a VQP of ours; the GID is plain bytes.
        let r = unsafe { crate::abi::ext::qconnect(qp, ibv_gid { raw: gid }, port as c_int) };
        if r != 0 {
            // SAFETY: the QP above, not handed out.
            unsafe { ibv_destroy_qp(qp) };
            return Err(Errno(r));
        }
        let h = self.next;
        self.next = self.next.wrapping_add(1).max(1);
        self.qps.insert(h, qp);
        // SAFETY: a VQP of this library, just connected.
        let ep = unsafe { crate::obj::Qp::from_qp(qp) }.vqp.as_ref().and_then(|v| v.peer()).ok_or(Errno::EINVAL)?;
        Ok((h, ep))
    }

    /// Post `p` with wr_id `wr_id`; an errno when it cannot be (its handle
    /// unknown, its range outside the region, the VQP's queue full).
    pub fn post(&self, p: &Post, wr_id: u64) -> Result<()> {
        let qp = *self.qps.get(&p.handle).ok_or(Errno::EINVAL)?;
        let opcode = match p.opcode {
            OP_READ => ibv_wr_opcode::IBV_WR_RDMA_READ,
            OP_WRITE => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            OP_CMP_AND_SWP if p.len == 8 => ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP,
            OP_FETCH_AND_ADD if p.len == 8 => ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD,
            _ => return Err(Errno::EINVAL),
        };
        let r = &self.region;
        let end = p.offset.checked_add(p.len as u64).ok_or(Errno::EINVAL)?;
        if end > r.len as u64 {
            return Err(Errno::EINVAL);
        }
        // SAFETY: the live MR over the mapping; the range is inside it.
        let mut sge = ibv_sge { addr: r.map as u64 + p.offset, length: p.len, lkey: unsafe { (*r.mr).lkey } };
        // SAFETY: a plain C struct.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = opcode;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        if matches!(p.opcode, OP_READ | OP_WRITE) {
            wr.wr.rdma.remote_addr = p.remote;
            wr.wr.rdma.rkey = p.rkey;
        } else {
            wr.wr.atomic.remote_addr = p.remote;
            wr.wr.atomic.rkey = p.rkey;
            wr.wr.atomic.compare_add = p.compare_add;
            wr.wr.atomic.swap = p.swap;
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: ibv_post_send is inline in verbs.h: the context's op, on
        // our live VQP with a WR whose SGE lies in our MR.
        let r = unsafe { ((*(*qp).context).ops.post_send.ok_or(Errno::EINVAL)?)(qp, &mut wr, &mut bad) };
        if r != 0 {
            return Err(Errno(r));
        }
        Ok(())
    }

    /// The requests the process published since the last call; Broken
    /// when its rings are (it must go).
    pub fn take_requests(&mut self) -> std::result::Result<Vec<Post>, super::ring::Broken> {
        self.region.rings().take_requests(&mut self.req_tail)
    }

    /// Whether requests wait in the ring.
    pub fn requests_waiting(&self) -> bool {
        self.region.rings().requests_after(self.req_tail)
    }

    /// Publish a completion; whether the process's reader sleeps (ring its
    /// doorbell).
    pub fn push_done(&mut self, d: super::ring::Done) -> bool {
        self.region.rings().push_done(&mut self.done_head, d)
    }

    pub fn set_awake(&self, awake: bool) {
        self.region.rings().set_agent_awake(awake);
    }

    pub fn close(&mut self, handle: u32) {
        if let Some(qp) = self.qps.remove(&handle) {
            // SAFETY: our VQP, removed from the table.
            unsafe { ibv_destroy_qp(qp) };
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        for (_, qp) in self.qps.drain() {
            // SAFETY: our VQPs; destroy waits for what they have on the wire
            // (before the region goes: its MR is under their work).
            unsafe { ibv_destroy_qp(qp) };
        }
    }
}
