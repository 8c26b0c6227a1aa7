//! The library's own RDMA objects: real libibverbs objects that the
//! application never sees (the meta server and its clients, service
//! endpoints, links). Each type owns one real object and destroys it on
//! drop; none of them is ever wrapped, so every call goes to the real
//! library through `call_real!` or the real context's ops.
//!
//! Objects hold an `Arc` of their parent, so a parent outlives its
//! children whatever order the owner drops them in.

use crate::call_real;
use crate::error::{Errno, Result};
use crate::obj::{non_null, ok_or_errno};
use crate::sys::ibv_access_flags as A;
use crate::sys::ibv_qp_attr_mask as M;
use crate::sys::*;
use libc::{c_int, c_void};
use std::net::Ipv4Addr;
use std::ptr::null_mut;
use std::sync::Arc;
use std::time::Duration;

pub type Gid = [u8; 16];

/// `IBV_LINK_LAYER_ETHERNET` of verbs.h (a macro, not in the bindings).
const LINK_LAYER_ETHERNET: u8 = 2;

/// `IBV_GID_TYPE_SYSFS_ROCE_V2` of rdma-core's driver.h: what
/// `ibv_query_gid_type` reports for a RoCE v2 GID (not `enum ibv_gid_type`,
/// where RoCE v2 is 2).
const GID_TYPE_ROCE_V2: u32 = 1;

/// The RoCE v2 GID of an IPv4 address (`::ffff:a.b.c.d`).
pub fn ipv4_gid(ip: Ipv4Addr) -> Gid {
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12..].copy_from_slice(&ip.octets());
    g
}

/// An open device context with one protection domain, on one port.
pub struct Device {
    pub ctx: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub port: u8,
    pub port_attr: ibv_port_attr,
    pub dev_attr: ibv_device_attr,
    pub name: String,
    /// What goes with it.
    owns: Owns,
}

/// What a [`Device`] made, and so releases on drop.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Owns {
    /// The application's context and PD (left alone).
    Nothing,
    /// A PD of its own on the application's context.
    Pd,
    /// A context it opened and its PD.
    All,
}

// SAFETY: libibverbs contexts and PDs may be used from any thread.
unsafe impl Send for Device {}
// SAFETY: as above; the fields are never changed after open.
unsafe impl Sync for Device {}

/// The port a runtime's links (and so its VQPs) use on their device.
pub const PORT: u8 = 1;

/// [`PORT`]'s attributes on a real context (`max_msg_sz` bounds every
/// virtual message, SRQ receives included).
///
/// # Safety
/// `ctx` is a live real context.
pub unsafe fn query_port(ctx: *mut ibv_context) -> Result<ibv_port_attr> {
    // SAFETY: a plain C struct, filled by the query.
    let mut a: ibv_port_attr = unsafe { std::mem::zeroed() };
    ok_or_errno(call_real!(ibv_query_port(ctx, PORT, &mut a))?)?;
    Ok(a)
}

/// The name of a real device (empty if it has none).
fn device_name(dev: *mut ibv_device) -> String {
    call_real!(ibv_get_device_name(dev))
        .ok()
        .filter(|p| !p.is_null())
        // SAFETY: a NUL-terminated name owned by the device.
        .map(|p| unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned())
        .unwrap_or_default()
}

impl Device {
    /// Open the device named `name` (the first one when `None`), port 1.
    pub fn open(name: Option<&str>) -> Result<Arc<Device>> {
        let mut n: c_int = 0;
        let list = call_real!(ibv_get_device_list(&mut n))?;
        if list.is_null() {
            return Err(Errno::last());
        }
        let mut found = None;
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds n devices.
            let dev = unsafe { *list.add(i) };
            let dname = device_name(dev);
            if name.is_none_or(|w| w == dname) {
                found = Some((dev, dname));
                break;
            }
        }
        let opened = found.map(|(dev, dname)| (call_real!(ibv_open_device(dev)), dname));
        let _ = call_real!(ibv_free_device_list(list));
        let (ctx, dname) = opened.ok_or(Errno(libc::ENODEV))?;
        let ctx = non_null(ctx?)?;
        let close = |e| {
            let _ = call_real!(ibv_close_device(ctx));
            e
        };
        let pd = call_real!(ibv_alloc_pd(ctx)).and_then(non_null).map_err(close)?;
        Device::describe(ctx, pd, dname, Owns::All).inspect_err(|_| {
            let _ = call_real!(ibv_dealloc_pd(pd));
            let _ = call_real!(ibv_close_device(ctx));
        })
    }

    /// The application's real context and PD, which the library's objects
    /// then share (their lkeys are the application's). Never closed here.
    ///
    /// # Safety
    /// `ctx` and `pd` are live real objects that outlive the result.
    pub unsafe fn borrow(ctx: *mut ibv_context, pd: *mut ibv_pd) -> Result<Arc<Device>> {
        // SAFETY: a live real context (caller contract).
        Device::describe(ctx, pd, device_name(unsafe { (*ctx).device }), Owns::Nothing)
    }

    /// The application's real context with a PD of our own (deallocated
    /// on drop), for objects that must not hold the application's PD.
    ///
    /// # Safety
    /// `ctx` is a live real context that outlives the result.
    pub unsafe fn with_own_pd(ctx: *mut ibv_context) -> Result<Arc<Device>> {
        let pd = call_real!(ibv_alloc_pd(ctx)).and_then(non_null)?;
        // SAFETY: a live real context (caller contract).
        Device::describe(ctx, pd, device_name(unsafe { (*ctx).device }), Owns::Pd).inspect_err(|_| {
            let _ = call_real!(ibv_dealloc_pd(pd));
        })
    }

    fn describe(ctx: *mut ibv_context, pd: *mut ibv_pd, name: String, owns: Owns) -> Result<Arc<Device>> {
        // SAFETY: a plain C struct, filled by the query.
        let mut dev_attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        let port = PORT;
        // SAFETY: the live real context describe is given.
        let port_attr = unsafe { query_port(ctx) }?;
        ok_or_errno(call_real!(ibv_query_device(ctx, &mut dev_attr))?)?;
        Ok(Arc::new(Device { ctx, pd, port, port_attr, dev_attr, name, owns }))
    }

    /// The GID at `index` of our port.
    pub fn gid(&self, index: u32) -> Result<Gid> {
        // SAFETY: a plain C union.
        let mut g: ibv_gid = unsafe { std::mem::zeroed() };
        ok_or_errno(call_real!(ibv_query_gid(self.ctx, self.port, index as c_int, &mut g))?)?;
        // SAFETY: every bit pattern is a valid byte array.
        Ok(unsafe { g.raw })
    }

    fn gid_table_len(&self) -> u32 {
        self.port_attr.gid_tbl_len.max(0) as u32
    }

    /// The index of `gid` in our port's GID table (EADDRNOTAVAIL if absent).
    pub fn gid_index(&self, gid: &Gid) -> Result<u32> {
        // On RoCE a GID is listed once per type: the usable (v2) entry,
        // the one links are made on, so that a path named by a GID is the
        // same path whichever way it was learnt (a datagram's GRH, qbind).
        let at = |i: u32| self.gid(i).is_ok_and(|g| &g == gid);
        let mut all = 0..self.gid_table_len();
        all.clone().find(|&i| at(i) && self.gid_usable(i)).or_else(|| all.find(|&i| at(i))).ok_or(Errno(libc::EADDRNOTAVAIL))
    }

    /// The first usable GID: the first RoCE v2 one on Ethernet, the first
    /// non-zero one on InfiniBand.
    pub fn default_gid_index(&self) -> Result<u32> {
        (0..self.gid_table_len()).find(|&i| self.gid_usable(i)).ok_or(Errno(libc::EADDRNOTAVAIL))
    }

    /// Whether the GID at `index` can carry a link: non-zero, and RoCE v2
    /// on Ethernet (the type the library's links use).
    fn gid_usable(&self, index: u32) -> bool {
        let ethernet = self.port_attr.link_layer == LINK_LAYER_ETHERNET;
        let nonzero = self.gid(index).is_ok_and(|g| g != [0; 16]);
        nonzero && (!ethernet || self.gid_type(index) == Some(GID_TYPE_ROCE_V2))
    }

    /// Every distinct usable GID of the port, in table order.
    pub fn usable_gids(&self) -> Vec<Gid> {
        let mut out: Vec<Gid> = Vec::new();
        for i in (0..self.gid_table_len()).filter(|&i| self.gid_usable(i)) {
            match self.gid(i) {
                Ok(g) if !out.contains(&g) => out.push(g),
                _ => {}
            }
        }
        out
    }

    /// The usable GID the kernel would send to `addr` from: the source
    /// address of its route (a UDP socket's `connect` sends nothing), as a
    /// RoCE v2 GID of our port. None when that address is not on this port.
    pub fn route_gid_index(&self, addr: &std::net::SocketAddr) -> Option<u32> {
        let any: std::net::SocketAddr = if addr.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().ok()?;
        let sock = std::net::UdpSocket::bind(any).ok()?;
        sock.connect(addr).ok()?;
        let gid = match sock.local_addr().ok()?.ip() {
            std::net::IpAddr::V4(ip) => ipv4_gid(ip),
            std::net::IpAddr::V6(ip) => ip.to_ipv4_mapped().map_or(ip.octets(), ipv4_gid),
        };
        (0..self.gid_table_len()).find(|&i| self.gid(i).is_ok_and(|g| g == gid) && self.gid_usable(i))
    }

    fn gid_type(&self, index: u32) -> Option<u32> {
        let mut t: u32 = 0;
        let rc = call_real!(ibv_query_gid_type(self.ctx, self.port, index, &mut t)).ok()?;
        (rc == 0).then_some(t)
    }

    /// The largest `max_rd_atomic` worth asking for.
    fn rd_atomic(&self) -> u8 {
        self.dev_attr.max_qp_rd_atom.clamp(1, 16) as u8
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if self.owns != Owns::Nothing {
            let _ = call_real!(ibv_dealloc_pd(self.pd));
        }
        if self.owns == Owns::All {
            let _ = call_real!(ibv_close_device(self.ctx));
        }
    }
}

/// Page-aligned memory registered on a device.
pub struct Region {
    pub mr: *mut ibv_mr,
    buf: *mut u8,
    len: usize,
    _dev: Arc<Device>,
}

// SAFETY: the memory and the MR handle may be used from any thread; the
// owner synchronises access to the bytes.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    /// `len` zeroed bytes, registered with `access`.
    pub fn new(dev: &Arc<Device>, len: usize, access: u32) -> Result<Region> {
        let page = 4096;
        let size = len.max(1).div_ceil(page) * page;
        // SAFETY: page-aligned allocation of a non-zero size.
        let buf = unsafe { libc::aligned_alloc(page, size) }.cast::<u8>();
        if buf.is_null() {
            return Err(Errno::ENOMEM);
        }
        // SAFETY: buf holds size bytes.
        unsafe { std::ptr::write_bytes(buf, 0, size) };
        let mr = call_real!(ibv_reg_mr(dev.pd, buf.cast::<c_void>(), len.max(1), access as c_int)).and_then(non_null);
        match mr {
            Ok(mr) => Ok(Region { mr, buf, len, _dev: Arc::clone(dev) }),
            Err(e) => {
                // SAFETY: allocated above, never registered.
                unsafe { libc::free(buf.cast()) };
                Err(e)
            }
        }
    }

    pub fn addr(&self) -> u64 {
        self.buf as u64
    }
    pub fn ptr(&self) -> *mut u8 {
        self.buf
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn lkey(&self) -> u32 {
        // SAFETY: a live MR.
        unsafe { (*self.mr).lkey }
    }
    pub fn rkey(&self) -> u32 {
        // SAFETY: a live MR.
        unsafe { (*self.mr).rkey }
    }

    /// The bytes. The NIC may write them at any time the region is the
    /// target of posted work: read them only after the completion.
    ///
    /// # Safety
    /// No work request writing into `[off, off+len)` is outstanding, and
    /// no other thread writes that range meanwhile.
    pub unsafe fn bytes(&self, off: usize, len: usize) -> &[u8] {
        assert!(off.checked_add(len).is_some_and(|e| e <= self.len), "range out of the region");
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts(self.buf.add(off), len) }
    }

    /// # Safety
    /// As [`Region::bytes`], and no work request reads the range meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, off: usize, len: usize) -> &mut [u8] {
        assert!(off.checked_add(len).is_some_and(|e| e <= self.len), "range out of the region");
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.buf.add(off), len) }
    }

    /// One SGE over `[off, off+len)`.
    pub fn sge(&self, off: usize, len: usize) -> ibv_sge {
        debug_assert!(off + len <= self.len);
        ibv_sge { addr: self.addr() + off as u64, length: len as u32, lkey: self.lkey() }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let _ = call_real!(ibv_dereg_mr(self.mr));
        // SAFETY: allocated in new, no longer registered.
        unsafe { libc::free(self.buf.cast()) };
    }
}

/// A type 2 memory window of the real library: remote READ of part of a
/// region through an rkey valid only on the one QP its bind was posted on
/// ([`Window::bind_wr`]); another QP in the PD presenting it gets a remote
/// access error. Deallocated (so revoked) on drop. Its owner drops it
/// before the region under it (an MR with a window bound cannot be
/// deregistered: `ibv_dereg_mr` fails and the memory would stay open) and
/// before the QP it is bound on (rxe's QP destroy waits out a timeout,
/// about 50 s, for the window's reference).
pub struct Window {
    mw: *mut ibv_mw,
    /// The key its bind gives it (`ibv_inc_rkey` of the allocated one).
    rkey: u32,
    _dev: Arc<Device>,
}

// SAFETY: a window handle may be used from any thread.
unsafe impl Send for Window {}
// SAFETY: as above; it is never changed after allocation.
unsafe impl Sync for Window {}

impl Window {
    pub fn new(dev: &Arc<Device>) -> Result<Window> {
        // `ibv_alloc_mw` is inline in verbs.h: the real context's op.
        // SAFETY: a live real PD of a live real context.
        let mw = unsafe {
            let alloc = (*(*dev.pd).context).ops.alloc_mw.ok_or(Errno::EOPNOTSUPP)?;
            alloc(dev.pd, ibv_mw_type::IBV_MW_TYPE_2)
        };
        let mw = non_null(mw)?;
        // SAFETY: a live MW.
        let allocated = unsafe { (*mw).rkey };
        let rkey = (allocated & !0xff) | (allocated.wrapping_add(1) & 0xff);
        Ok(Window { mw, rkey, _dev: Arc::clone(dev) })
    }

    /// The rkey that opens it once bound.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// A signaled bind of the window to all of `region` for remote READ.
    /// Post it once, on the QP whose peer alone may READ through it; RC
    /// executes it before any WQE posted behind it on that QP.
    pub fn bind_wr(&self, region: &Region, wr_id: u64) -> ibv_send_wr {
        // SAFETY: a plain C struct.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.bind_mw_tso_union.bind_mw = bind_mw_t {
            mw: self.mw,
            rkey: self.rkey,
            bind_info: ibv_mw_bind_info {
                mr: region.mr,
                addr: region.addr(),
                length: region.len().max(1) as u64,
                mw_access_flags: REMOTE_READ,
            },
        };
        wr
    }
}

impl Window {
    /// Deallocate it now: Err when the library refused, and the window
    /// may still be bound (its region must then stay allocated).
    pub fn dealloc(mut self) -> Result<()> {
        let r = self.release();
        self.mw = null_mut();
        r
    }

    fn release(&mut self) -> Result<()> {
        if self.mw.is_null() {
            return Ok(());
        }
        // SAFETY: a live MW of the real library, deallocated once (`mw`
        // is cleared after).
        let rc = unsafe {
            match (*(*self.mw).context).ops.dealloc_mw {
                Some(dealloc) => dealloc(self.mw),
                None => libc::EOPNOTSUPP,
            }
        };
        ok_or_errno(rc)
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            crate::klog!(crate::log::Level::Warn, "rdma: deallocating a memory window: {e:?}");
        }
    }
}

/// A completion queue with its own completion channel: its owner sleeps on
/// the channel's fd (never busy-polls) when there is nothing to do.
pub struct Cq {
    pub cq: *mut ibv_cq,
    pub channel: *mut ibv_comp_channel,
    _dev: Arc<Device>,
}

// SAFETY: CQs and channels may be used from any thread.
unsafe impl Send for Cq {}
// SAFETY: as above; polling is serialised by the provider's own lock.
unsafe impl Sync for Cq {}

impl Cq {
    pub fn new(dev: &Arc<Device>, cqe: u32) -> Result<Cq> {
        let channel = call_real!(ibv_create_comp_channel(dev.ctx)).and_then(non_null)?;
        let cq = call_real!(ibv_create_cq(dev.ctx, cqe as c_int, null_mut(), channel, 0)).and_then(non_null);
        let cq = match cq {
            Ok(cq) => cq,
            Err(e) => {
                let _ = call_real!(ibv_destroy_comp_channel(channel));
                return Err(e);
            }
        };
        let me = Cq { cq, channel, _dev: Arc::clone(dev) };
        // Non-blocking fd: `wait` polls it with a timeout.
        // SAFETY: a live channel's fd.
        unsafe {
            let fd = (*channel).fd;
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        me.arm()?;
        Ok(me)
    }

    /// Poll up to `wc.len()` completions.
    pub fn poll(&self, wc: &mut [ibv_wc]) -> Result<usize> {
        // SAFETY: ibv_wc and MaybeUninit<ibv_wc> have the same layout; the
        // provider only writes entries.
        let out = unsafe { &mut *(wc as *mut [ibv_wc] as *mut [std::mem::MaybeUninit<ibv_wc>]) };
        Ok(self.poll_uninit(out)?.len())
    }

    /// [`Cq::poll`] into an uninitialised array (a hot path need not clear
    /// it first): the completions written, at its start.
    pub fn poll_uninit<'a>(&self, wc: &'a mut [std::mem::MaybeUninit<ibv_wc>]) -> Result<&'a [ibv_wc]> {
        // SAFETY: a live CQ of the real library; its context's ops are set.
        let n = unsafe {
            let poll = (*(*self.cq).context).ops.poll_cq.ok_or(Errno::EOPNOTSUPP)?;
            poll(self.cq, wc.len() as c_int, wc.as_mut_ptr().cast())
        };
        if n < 0 {
            return Err(Errno(libc::EIO));
        }
        // SAFETY: the provider wrote the first n entries.
        Ok(unsafe { std::slice::from_raw_parts(wc.as_ptr().cast::<ibv_wc>(), n as usize) })
    }

    /// Ask for an event at the next completion.
    pub fn arm(&self) -> Result<()> {
        // SAFETY: a live CQ of the real library.
        let rc = unsafe {
            let notify = (*(*self.cq).context).ops.req_notify_cq.ok_or(Errno::EOPNOTSUPP)?;
            notify(self.cq, 0)
        };
        ok_or_errno(rc)
    }

    /// Take and acknowledge the channel's pending event, if any, without
    /// arming again.
    pub fn consume_event(&self) -> Result<()> {
        let mut cq = null_mut();
        let mut ctx = null_mut();
        if call_real!(ibv_get_cq_event(self.channel, &mut cq, &mut ctx))? == 0 {
            call_real!(ibv_ack_cq_events(cq, 1))?;
        }
        Ok(())
    }

    /// Sleep until the channel has an event or `timeout` passes; consume
    /// and acknowledge the event and re-arm. Returns whether an event came.
    /// Completions may be pending either way: poll after it.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<bool> {
        // SAFETY: a live channel.
        let fd = unsafe { (*self.channel).fd };
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as c_int);
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc < 0 {
            let e = Errno::last();
            return if e.0 == libc::EINTR { Ok(false) } else { Err(e) };
        }
        if rc == 0 {
            return Ok(false);
        }
        let mut cq = null_mut();
        let mut ctx = null_mut();
        if call_real!(ibv_get_cq_event(self.channel, &mut cq, &mut ctx))? == 0 {
            call_real!(ibv_ack_cq_events(cq, 1))?;
        }
        self.arm()?;
        Ok(true)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        let _ = call_real!(ibv_destroy_cq(self.cq));
        let _ = call_real!(ibv_destroy_comp_channel(self.channel));
    }
}

/// Queue sizes of a QP.
#[derive(Clone, Copy, Debug)]
pub struct Caps {
    pub send_wr: u32,
    pub recv_wr: u32,
    pub send_sge: u32,
    pub recv_sge: u32,
    pub inline: u32,
}

/// What an RC QP needs to know of its peer to reach RTR.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RcPeer {
    pub gid: Gid,
    pub qpn: u32,
    pub psn: u32,
}

/// A shared receive queue of the real library.
pub struct Srq {
    pub srq: *mut ibv_srq,
    _dev: Arc<Device>,
}

// SAFETY: SRQs may be posted to from any thread (the provider locks).
unsafe impl Send for Srq {}
// SAFETY: as above.
unsafe impl Sync for Srq {}

impl Srq {
    pub fn new(dev: &Arc<Device>, max_wr: u32, max_sge: u32) -> Result<Srq> {
        // SAFETY: a plain C struct.
        let mut a: ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        a.attr.max_wr = max_wr;
        a.attr.max_sge = max_sge;
        let srq = call_real!(ibv_create_srq(dev.pd, &mut a)).and_then(non_null)?;
        Ok(Srq { srq, _dev: Arc::clone(dev) })
    }

    /// # Safety
    /// As [`Qp::post_recv`].
    pub unsafe fn post_recv(&self, wr: *mut ibv_recv_wr) -> Result<()> {
        let mut bad = null_mut();
        // SAFETY: a live SRQ of the real library; the chain is the caller's.
        let rc = unsafe {
            let post = (*(*self.srq).context).ops.post_srq_recv.ok_or(Errno::EOPNOTSUPP)?;
            post(self.srq, wr, &mut bad)
        };
        ok_or_errno(rc)
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        let _ = call_real!(ibv_destroy_srq(self.srq));
    }
}

/// A QP of the real library (RC or UD).
pub struct Qp {
    pub qp: *mut ibv_qp,
    pub caps: Caps,
    dev: Arc<Device>,
    _cqs: (Arc<Cq>, Arc<Cq>),
    _srq: Option<Arc<Srq>>,
}

/// A send CQ for [`Qp::with_send_cq`]: one of ours, or a real CQ that
/// someone else owns (and keeps alive longer than the QP).
pub enum SendCq<'a> {
    Ours(&'a Arc<Cq>),
    Foreign(*mut ibv_cq),
}

// SAFETY: QPs may be posted to from any thread (the provider locks).
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

pub const LOCAL_WRITE: u32 = A::IBV_ACCESS_LOCAL_WRITE.0;
pub const REMOTE_READ: u32 = A::IBV_ACCESS_REMOTE_READ.0;
/// The MR may have memory windows bound to it ([`Window`]).
pub const MW_BIND: u32 = A::IBV_ACCESS_MW_BIND.0;

/// Access flags the library's RC QPs accept from their peers.
pub const REMOTE_ALL: u32 =
    A::IBV_ACCESS_LOCAL_WRITE.0 | A::IBV_ACCESS_REMOTE_WRITE.0 | A::IBV_ACCESS_REMOTE_READ.0 | A::IBV_ACCESS_REMOTE_ATOMIC.0;

impl Qp {
    /// A QP of `qp_type` (RC or UD), in RESET.
    pub fn new(dev: &Arc<Device>, qp_type: u32, send_cq: &Arc<Cq>, recv_cq: &Arc<Cq>, caps: Caps) -> Result<Qp> {
        Qp::with_srq(dev, qp_type, send_cq, recv_cq, None, caps)
    }

    /// A QP whose receives come from `srq` (when given).
    pub fn with_srq(
        dev: &Arc<Device>,
        qp_type: u32,
        send_cq: &Arc<Cq>,
        recv_cq: &Arc<Cq>,
        srq: Option<&Arc<Srq>>,
        caps: Caps,
    ) -> Result<Qp> {
        Qp::with_send_cq(dev, qp_type, SendCq::Ours(send_cq), recv_cq, srq, caps)
    }

    /// A QP whose send completions go to `send_cq`.
    pub fn with_send_cq(
        dev: &Arc<Device>,
        qp_type: u32,
        send_cq: SendCq<'_>,
        recv_cq: &Arc<Cq>,
        srq: Option<&Arc<Srq>>,
        caps: Caps,
    ) -> Result<Qp> {
        // SAFETY: a plain C struct.
        let mut a: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        a.send_cq = match send_cq {
            SendCq::Ours(c) => c.cq,
            SendCq::Foreign(c) => c,
        };
        a.recv_cq = recv_cq.cq;
        a.srq = srq.map_or(null_mut(), |s| s.srq);
        a.qp_type = qp_type;
        a.cap.max_send_wr = caps.send_wr;
        a.cap.max_recv_wr = caps.recv_wr;
        a.cap.max_send_sge = caps.send_sge;
        a.cap.max_recv_sge = caps.recv_sge;
        a.cap.max_inline_data = caps.inline;
        let qp = call_real!(ibv_create_qp(dev.pd, &mut a)).and_then(non_null)?;
        let granted = Caps {
            send_wr: a.cap.max_send_wr,
            recv_wr: a.cap.max_recv_wr,
            send_sge: a.cap.max_send_sge,
            recv_sge: a.cap.max_recv_sge,
            inline: a.cap.max_inline_data,
        };
        let kept_send = match send_cq {
            SendCq::Ours(c) => Arc::clone(c),
            SendCq::Foreign(_) => Arc::clone(recv_cq),
        };
        Ok(Qp { qp, caps: granted, dev: Arc::clone(dev), _cqs: (kept_send, Arc::clone(recv_cq)), _srq: srq.cloned() })
    }

    pub fn qpn(&self) -> u32 {
        // SAFETY: a live QP.
        unsafe { (*self.qp).qp_num }
    }

    fn modify(&self, attr: &mut ibv_qp_attr, mask: u32) -> Result<()> {
        ok_or_errno(call_real!(ibv_modify_qp(self.qp, attr, mask as c_int))?)
    }

    /// RESET -> INIT (an RC QP accepts every remote access its MRs allow).
    pub fn to_init(&self) -> Result<()> {
        // SAFETY: a plain C struct.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = self.dev.port;
        let mut mask = M::IBV_QP_STATE.0 | M::IBV_QP_PKEY_INDEX.0 | M::IBV_QP_PORT.0;
        // SAFETY: a live QP.
        if unsafe { (*self.qp).qp_type } == ibv_qp_type::IBV_QPT_UD {
            a.qkey = QKEY;
            mask |= M::IBV_QP_QKEY.0;
        } else {
            a.qp_access_flags = REMOTE_ALL;
            mask |= M::IBV_QP_ACCESS_FLAGS.0;
        }
        self.modify(&mut a, mask)
    }

    /// INIT -> RTR -> RTS towards `peer`, from our GID at `sgid_index`.
    pub fn rc_connect(&self, sgid_index: u32, my_psn: u32, peer: &RcPeer) -> Result<()> {
        self.to_rtr(sgid_index, peer)?;
        self.to_rts(my_psn)
    }

    /// INIT -> RTR towards `peer`, from our GID at `sgid_index`: the QP
    /// receives and answers (ACKs, READ responses, atomics) from here on.
    pub fn to_rtr(&self, sgid_index: u32, peer: &RcPeer) -> Result<()> {
        // SAFETY: a plain C struct.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = self.dev.port_attr.active_mtu;
        a.dest_qp_num = peer.qpn;
        a.rq_psn = peer.psn;
        a.max_dest_rd_atomic = self.dev.rd_atomic();
        a.min_rnr_timer = 12;
        a.ah_attr = self.ah_attr(sgid_index, &peer.gid);
        self.modify(
            &mut a,
            M::IBV_QP_STATE.0
                | M::IBV_QP_AV.0
                | M::IBV_QP_PATH_MTU.0
                | M::IBV_QP_DEST_QPN.0
                | M::IBV_QP_RQ_PSN.0
                | M::IBV_QP_MAX_DEST_RD_ATOMIC.0
                | M::IBV_QP_MIN_RNR_TIMER.0,
        )
    }

    /// RTR -> RTS, sending from PSN `my_psn`.
    pub fn to_rts(&self, my_psn: u32) -> Result<()> {
        // SAFETY: a plain C struct.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        // 537 ms per try: rxe under load (a busy emulated CPU) can leave a
        // live peer unanswered for a good part of a second, which must not
        // pass for its death.
        a.timeout = 17;
        // 6, not 7: rxe takes 7 for "retry forever" (as rnr_retry), and a
        // dead peer must fail the QP: (6 + 1) x 537 ms of transport time.
        a.retry_cnt = 6;
        // Infinite RNR retry: a receiver out of buffers slows the sender
        // down instead of failing the link.
        a.rnr_retry = 7;
        a.sq_psn = my_psn;
        a.max_rd_atomic = self.dev.rd_atomic();
        self.modify(
            &mut a,
            M::IBV_QP_STATE.0
                | M::IBV_QP_TIMEOUT.0
                | M::IBV_QP_RETRY_CNT.0
                | M::IBV_QP_RNR_RETRY.0
                | M::IBV_QP_SQ_PSN.0
                | M::IBV_QP_MAX_QP_RD_ATOMIC.0,
        )
    }

    /// The device's view of a connected QP's path: its source GID index
    /// and destination GID (`ibv_query_qp`).
    pub fn path(&self) -> Result<(u32, Gid)> {
        let a = self.query(M::IBV_QP_AV.0)?;
        // SAFETY: a GID is 16 bytes whichever way it is read.
        Ok((a.ah_attr.grh.sgid_index.into(), unsafe { a.ah_attr.grh.dgid.raw }))
    }

    /// The PSN a connected QP expects next from its peer (`ibv_query_qp`'s
    /// `rq_psn`, live on rxe and mlx5): every request the peer sends, a
    /// READ served by the NIC alone included, moves it.
    pub fn rq_psn(&self) -> Result<u32> {
        Ok(self.query(M::IBV_QP_RQ_PSN.0)?.rq_psn)
    }

    /// `ibv_query_qp` of the attributes in `mask`.
    fn query(&self, mask: u32) -> Result<ibv_qp_attr> {
        // SAFETY: plain C structs, filled by the provider.
        let (mut a, mut init): (ibv_qp_attr, ibv_qp_init_attr) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        ok_or_errno(call_real!(ibv_query_qp(self.qp, &mut a, mask as c_int, &mut init))?)?;
        Ok(a)
    }

    /// A UD QP: INIT -> RTR -> RTS.
    pub fn ud_ready(&self) -> Result<()> {
        self.to_init()?;
        // SAFETY: a plain C struct.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        self.modify(&mut a, M::IBV_QP_STATE.0)?;
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = 0;
        self.modify(&mut a, M::IBV_QP_STATE.0 | M::IBV_QP_SQ_PSN.0)
    }

    /// Move to ERR: outstanding work completes with flush errors.
    pub fn to_error(&self) -> Result<()> {
        // SAFETY: a plain C struct.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut a, M::IBV_QP_STATE.0)
    }

    pub fn ah_attr(&self, sgid_index: u32, dgid: &Gid) -> ibv_ah_attr {
        // SAFETY: a plain C struct.
        let mut ah: ibv_ah_attr = unsafe { std::mem::zeroed() };
        ah.is_global = 1;
        ah.grh.dgid.raw = *dgid;
        ah.grh.sgid_index = sgid_index as u8;
        ah.grh.hop_limit = 64;
        ah.port_num = self.dev.port;
        ah
    }

    /// Post a chain of send work requests.
    ///
    /// # Safety
    /// The chain and its SGEs are valid; the memory they name stays
    /// registered until the work completes.
    pub unsafe fn post_send(&self, wr: *mut ibv_send_wr) -> Result<()> {
        let mut bad = null_mut();
        // SAFETY: a live QP of the real library; the chain is the caller's.
        let rc = unsafe {
            let post = (*(*self.qp).context).ops.post_send.ok_or(Errno::EOPNOTSUPP)?;
            post(self.qp, wr, &mut bad)
        };
        ok_or_errno(rc)
    }

    /// Post a chain of receive work requests.
    ///
    /// # Safety
    /// As [`Qp::post_send`].
    pub unsafe fn post_recv(&self, wr: *mut ibv_recv_wr) -> Result<()> {
        let mut bad = null_mut();
        // SAFETY: a live QP of the real library; the chain is the caller's.
        let rc = unsafe {
            let post = (*(*self.qp).context).ops.post_recv.ok_or(Errno::EOPNOTSUPP)?;
            post(self.qp, wr, &mut bad)
        };
        ok_or_errno(rc)
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        let _ = call_real!(ibv_destroy_qp(self.qp));
    }
}

/// Where a UD receive came from: the GRH's source and destination GIDs
/// (RoCE v2 over IPv4 puts an IPv4 header in the GRH's last 20 bytes: the
/// GIDs are then the addresses, IPv4-mapped).
pub fn grh_gids(grh: &[u8]) -> Option<(Gid, Gid)> {
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    if grh.first()? >> 4 == 6 {
        src.copy_from_slice(grh.get(8..24)?);
        dst.copy_from_slice(grh.get(24..40)?);
    } else if grh.get(20)? >> 4 == 4 {
        src[10..12].copy_from_slice(&[0xff, 0xff]);
        dst[10..12].copy_from_slice(&[0xff, 0xff]);
        src[12..].copy_from_slice(grh.get(32..36)?);
        dst[12..].copy_from_slice(grh.get(36..40)?);
    } else {
        return None;
    }
    Some((src, dst))
}

/// Whether `gid` is an IPv4 address (IPv4-mapped: a RoCE v2 GID of an
/// IPv4 address).
pub fn is_ipv4_gid(gid: &Gid) -> bool {
    gid[..10] == [0; 10] && gid[10..12] == [0xff, 0xff]
}

/// The length of the GRH a UD receive buffer starts with.
pub const GRH_LEN: usize = 40;

/// The Q_Key of the library's UD QPs.
pub const QKEY: u32 = 0x4b52_0001;

/// An address handle of the real library.
pub struct Ah {
    pub ah: *mut ibv_ah,
    _dev: Arc<Device>,
}

// SAFETY: AHs may be used from any thread.
unsafe impl Send for Ah {}
// SAFETY: as above.
unsafe impl Sync for Ah {}

impl Ah {
    pub fn new(dev: &Arc<Device>, attr: &mut ibv_ah_attr) -> Result<Ah> {
        let ah = call_real!(ibv_create_ah(dev.pd, attr)).and_then(non_null)?;
        Ok(Ah { ah, _dev: Arc::clone(dev) })
    }
}

impl Drop for Ah {
    fn drop(&mut self) {
        let _ = call_real!(ibv_destroy_ah(self.ah));
    }
}

/// A random 24-bit PSN.
pub fn random_psn() -> u32 {
    random_u64() as u32 & 0x00ff_ffff
}

/// 64 random bits from the kernel (incarnations, PSNs).
pub fn random_u64() -> u64 {
    let mut v = 0u64;
    // SAFETY: getrandom writes at most 8 bytes into v.
    let n = unsafe { libc::getrandom((&mut v as *mut u64).cast(), 8, 0) };
    if n != 8 {
        // No entropy source: time and pid still separate incarnations.
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        v = t.as_nanos() as u64 ^ ((std::process::id() as u64) << 40);
    }
    v
}
