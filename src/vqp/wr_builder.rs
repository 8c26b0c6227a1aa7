//! The `ibv_wr_*` API on a VQP: a batch of work requests built between
//! `ibv_wr_start` and `ibv_wr_complete`, then posted through the VQP's
//! ordinary `post_send` (same pre-checks, overflow accounting and
//! completions as `ibv_post_send`).
//!
//! What the builders mean here (verbs leaves much of it to the provider;
//! this is what the VQP does, documented in docs/vqp.md):
//! - An opcode builder (`ibv_wr_send`, `ibv_wr_rdma_write`, ...) starts a
//!   new work request, taking `wr_id` and `wr_flags` from the `ibv_qp_ex`
//!   fields as the application set them before that call.
//! - A data setter (`ibv_wr_set_sge`, `_sge_list`, `_inline_data`,
//!   `_inline_data_list`) gives the last work request its data; a second
//!   one on the same request replaces the first. Inline data is copied at
//!   the setter call (the application may reuse its buffer at once) and
//!   makes the request inline; SGEs make it gathered by lkey, whatever
//!   `IBV_SEND_INLINE` in `wr_flags` says (as mlx5 does).
//! - Errors found while building (a setter without a request, more SGEs
//!   than `max_send_sge`, inline data above `max_inline_data`, more
//!   requests than the send queue holds) are kept, the first one wins, and
//!   `ibv_wr_complete` returns it and posts nothing, as providers do.
//! - `ibv_wr_abort` discards the batch.
//!
//! [`WrBatch`] is the pure state (host-tested); [`QpWr`] makes
//! `ibv_wr_start` .. `ibv_wr_complete` a critical section per QP, as rxe and
//! mlx5 do with their send-queue lock: another thread's `ibv_wr_start` on
//! the same QP waits. Builders called by a thread that has not started a
//! batch (or after its `ibv_wr_complete`) are ignored and logged;
//! `ibv_wr_complete` from it returns EINVAL.

use crate::error::Errno;
use crate::klog;
use crate::log::Level;
use crate::sys::*;
use parking_lot::lock_api::RawMutex as _;
use std::cell::UnsafeCell;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicUsize, Ordering};

/// SGEs a VQP's send request may have (its `max_send_sge` is at most this).
pub const MAX_SGE: usize = super::qp::MAX_SEND_SGE as usize;

/// The send ops (`ibv_qp_init_attr_ex.send_ops_flags`) a VQP carries.
pub const VQP_SEND_OPS: u64 = (ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE.0
    | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM.0
    | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_SEND.0
    | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_SEND_WITH_IMM.0
    | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_READ.0
    | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP.0
    | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD.0) as u64;

/// Why a VQP cannot offer `send_ops` (for the log), naming the first flag
/// it lacks; `None`: it offers them all.
pub fn unsupported_send_op(send_ops: u64) -> Option<&'static str> {
    use ibv_qp_create_send_ops_flags as F;
    let extra = send_ops & !VQP_SEND_OPS;
    if extra == 0 {
        return None;
    }
    let bit = (extra & extra.wrapping_neg()) as u32;
    Some(match bit {
        b if b == F::IBV_QP_EX_WITH_LOCAL_INV.0 => "its send_ops_flags ask for IBV_QP_EX_WITH_LOCAL_INV, which a VQP cannot do",
        b if b == F::IBV_QP_EX_WITH_BIND_MW.0 => "its send_ops_flags ask for IBV_QP_EX_WITH_BIND_MW, which a VQP cannot do",
        b if b == F::IBV_QP_EX_WITH_SEND_WITH_INV.0 => "its send_ops_flags ask for IBV_QP_EX_WITH_SEND_WITH_INV, which a VQP cannot do",
        b if b == F::IBV_QP_EX_WITH_TSO.0 => "its send_ops_flags ask for IBV_QP_EX_WITH_TSO, which a VQP cannot do",
        b if b == F::IBV_QP_EX_WITH_ATOMIC_WRITE.0 => "its send_ops_flags ask for IBV_QP_EX_WITH_ATOMIC_WRITE, which a VQP cannot do",
        _ => "its send_ops_flags ask for an operation unknown to this library",
    })
}

/// What an opcode builder asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Send,
    /// The immediate as given (network order).
    SendImm(u32),
    Write {
        rkey: u32,
        addr: u64,
    },
    WriteImm {
        rkey: u32,
        addr: u64,
        imm: u32,
    },
    Read {
        rkey: u32,
        addr: u64,
    },
    CmpSwp {
        rkey: u32,
        addr: u64,
        compare: u64,
        swap: u64,
    },
    FetchAdd {
        rkey: u32,
        addr: u64,
        add: u64,
    },
}

/// What one batch may hold: the VQP's granted capabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_sge: u32,
    pub max_inline: u32,
    /// Requests per batch: the send queue's depth.
    pub max_wr: u32,
}

/// Where a pending request's data is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Data {
    None,
    /// The first n entries of `sge`.
    Sge(usize),
    /// The `inline` copy.
    Inline,
}

/// One request of the batch with the storage its pointers name.
struct Pending {
    wr: ibv_send_wr,
    sge: [ibv_sge; MAX_SGE],
    data: Data,
    /// Inline data, copied (capacity kept across batches).
    inline: Vec<u8>,
}

/// The batch being built. Entries are reused from batch to batch, so a
/// steady application allocates nothing after its first batches.
pub struct WrBatch {
    limits: Limits,
    pending: Vec<Pending>,
    len: usize,
    open: bool,
    /// The first error found while building, and why (for the log).
    err: Option<(Errno, &'static str)>,
}

impl WrBatch {
    pub fn new(limits: Limits) -> WrBatch {
        WrBatch {
            limits: Limits { max_sge: limits.max_sge.min(MAX_SGE as u32), ..limits },
            pending: Vec::new(),
            len: 0,
            open: false,
            err: None,
        }
    }

    /// `ibv_wr_start`: a new, empty batch (an open one is discarded).
    pub fn start(&mut self) {
        self.len = 0;
        self.err = None;
        self.open = true;
    }

    pub fn is_open(&self) -> bool {
        self.open
    }

    /// Requests in the batch.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The error `complete` would report.
    pub fn error(&self) -> Option<Errno> {
        self.err.map(|(e, _)| e)
    }

    fn fail(&mut self, e: Errno, why: &'static str) {
        if self.err.is_none() {
            self.err = Some((e, why));
        }
    }

    /// Fail the batch (the first error wins): for what the C layer finds
    /// wrong before any data can be read (a NULL list, a count no VQP
    /// takes).
    pub fn fail_with(&mut self, e: Errno, why: &'static str) {
        if self.open {
            self.fail(e, why);
        }
    }

    /// An opcode builder: a new request with the application's `wr_id`
    /// and `wr_flags` as they are now.
    pub fn op(&mut self, wr_id: u64, wr_flags: u32, op: Op) {
        if !self.open {
            self.fail(Errno::EINVAL, "an opcode builder outside ibv_wr_start .. ibv_wr_complete");
            return;
        }
        if self.err.is_some() {
            return;
        }
        if self.len >= self.limits.max_wr as usize {
            self.fail(Errno::ENOMEM, "more work requests in the batch than the send queue holds");
            return;
        }
        if self.len == self.pending.len() {
            self.pending.push(Pending {
                // SAFETY: a plain C struct; all-zero is a valid empty WR.
                wr: unsafe { std::mem::zeroed() },
                sge: [ibv_sge { addr: 0, length: 0, lkey: 0 }; MAX_SGE],
                data: Data::None,
                inline: Vec::new(),
            });
        }
        let p = &mut self.pending[self.len];
        self.len += 1;
        // SAFETY: a plain C struct; all-zero is a valid empty WR.
        p.wr = unsafe { std::mem::zeroed() };
        p.data = Data::None;
        p.wr.wr_id = wr_id;
        // INLINE follows the data setter; anything else goes to the
        // pre-checks as given (unknown bits are refused there).
        p.wr.send_flags = wr_flags & !ibv_send_flags::IBV_SEND_INLINE.0;
        let w = &mut p.wr;
        match op {
            Op::Send => w.opcode = ibv_wr_opcode::IBV_WR_SEND,
            Op::SendImm(imm) => {
                w.opcode = ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
                w.imm_data_invalidated_rkey_union.imm_data = imm;
            }
            Op::Write { rkey, addr } => {
                w.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                w.wr.rdma = rdma_t { remote_addr: addr, rkey };
            }
            Op::WriteImm { rkey, addr, imm } => {
                w.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
                w.wr.rdma = rdma_t { remote_addr: addr, rkey };
                w.imm_data_invalidated_rkey_union.imm_data = imm;
            }
            Op::Read { rkey, addr } => {
                w.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
                w.wr.rdma = rdma_t { remote_addr: addr, rkey };
            }
            Op::CmpSwp { rkey, addr, compare, swap } => {
                w.opcode = ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP;
                w.wr.atomic = atomic_t { remote_addr: addr, compare_add: compare, swap, rkey };
            }
            Op::FetchAdd { rkey, addr, add } => {
                w.opcode = ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
                w.wr.atomic = atomic_t { remote_addr: addr, compare_add: add, swap: 0, rkey };
            }
        }
    }

    /// The request a data setter applies to.
    fn current(&mut self, what: &'static str) -> Option<&mut Pending> {
        if !self.open {
            self.fail(Errno::EINVAL, "a data setter outside ibv_wr_start .. ibv_wr_complete");
            return None;
        }
        if self.err.is_some() {
            return None;
        }
        if self.len == 0 {
            self.fail(Errno::EINVAL, what);
            return None;
        }
        Some(&mut self.pending[self.len - 1])
    }

    /// `ibv_wr_set_sge`.
    pub fn set_sge(&mut self, lkey: u32, addr: u64, length: u32) {
        self.set_sge_list(&[ibv_sge { addr, length, lkey }]);
    }

    /// `ibv_wr_set_sge_list`.
    pub fn set_sge_list(&mut self, sges: &[ibv_sge]) {
        let max = self.limits.max_sge as usize;
        let Some(p) = self.current("ibv_wr_set_sge(_list) before any opcode builder") else { return };
        if sges.len() > max {
            self.fail(Errno::EINVAL, "more SGEs than the QP's max_send_sge");
            return;
        }
        p.sge[..sges.len()].copy_from_slice(sges);
        p.data = Data::Sge(sges.len());
        p.wr.send_flags &= !ibv_send_flags::IBV_SEND_INLINE.0;
    }

    /// `ibv_wr_set_inline_data(_list)`: the pieces are copied now (two
    /// passes: the total is checked before anything is copied).
    pub fn set_inline<'a, I>(&mut self, pieces: I)
    where
        I: IntoIterator<Item = &'a [u8]>,
        I::IntoIter: Clone,
    {
        let pieces = pieces.into_iter();
        let max = self.limits.max_inline as usize;
        let Some(p) = self.current("ibv_wr_set_inline_data(_list) before any opcode builder") else { return };
        let total = pieces.clone().try_fold(0usize, |t, s| t.checked_add(s.len()));
        if total.is_none_or(|t| t > max) {
            self.fail(Errno::EINVAL, "more inline data than the QP's max_inline_data");
            return;
        }
        p.inline.clear();
        for s in pieces {
            p.inline.extend_from_slice(s);
        }
        p.data = Data::Inline;
        p.wr.send_flags |= ibv_send_flags::IBV_SEND_INLINE.0;
    }

    /// `ibv_wr_complete`: link the batch and hand it to `post` (the first
    /// request and the count), unless building failed (that error, nothing
    /// posted) or the batch is empty (0). The batch is closed either way.
    pub fn complete(&mut self, post: impl FnOnce(*mut ibv_send_wr, usize) -> i32) -> i32 {
        if !self.open {
            return libc::EINVAL;
        }
        self.open = false;
        let n = std::mem::take(&mut self.len);
        if let Some((e, why)) = self.err.take() {
            klog!(Level::Debug, "ibv_wr_complete on a VQP: {why}: nothing posted");
            return e.0;
        }
        if n == 0 {
            return 0;
        }
        let mut next: *mut ibv_send_wr = null_mut();
        for p in self.pending[..n].iter_mut().rev() {
            match p.data {
                Data::None => {
                    p.wr.sg_list = null_mut();
                    p.wr.num_sge = 0;
                }
                Data::Sge(k) => {
                    p.wr.sg_list = if k == 0 { null_mut() } else { p.sge.as_mut_ptr() };
                    p.wr.num_sge = k as i32;
                }
                Data::Inline if p.inline.is_empty() => {
                    p.wr.sg_list = null_mut();
                    p.wr.num_sge = 0;
                }
                Data::Inline => {
                    p.sge[0] = ibv_sge { addr: p.inline.as_ptr() as u64, length: p.inline.len() as u32, lkey: 0 };
                    p.wr.sg_list = p.sge.as_mut_ptr();
                    p.wr.num_sge = 1;
                }
            }
            p.wr.next = next;
            next = &mut p.wr;
        }
        post(next, n)
    }

    /// `ibv_wr_abort`: forget the batch.
    pub fn abort(&mut self) {
        self.open = false;
        self.len = 0;
        self.err = None;
    }
}

/// A VQP's builder state, one batch at a time: `start` takes the QP's
/// builder lock and `complete`/`abort` release it, as providers hold their
/// send-queue lock from `ibv_wr_start` to `ibv_wr_complete`.
pub struct QpWr {
    lock: parking_lot::RawMutex,
    /// The thread holding `lock` (its token), 0 when none.
    owner: AtomicUsize,
    batch: UnsafeCell<WrBatch>,
    /// The QP's `send_ops_flags`: which opcode builders it has.
    pub send_ops: u64,
}

// SAFETY: `batch` is only touched by the thread that holds `lock`
// (checked through `owner`); the rest is atomic or immutable.
unsafe impl Sync for QpWr {}
// SAFETY: as above; the raw pointers inside the batch point into itself.
unsafe impl Send for QpWr {}

/// A non-zero number unique to the calling thread while it lives.
fn thread_token() -> usize {
    thread_local!(static TOKEN: u8 = const { 0 });
    TOKEN.with(|t| t as *const u8 as usize)
}

impl QpWr {
    pub fn new(limits: Limits, send_ops: u64) -> QpWr {
        QpWr { lock: parking_lot::RawMutex::INIT, owner: AtomicUsize::new(0), batch: UnsafeCell::new(WrBatch::new(limits)), send_ops }
    }

    fn held(&self) -> bool {
        // Only this thread stores its own token, so equality is exact.
        self.owner.load(Ordering::Relaxed) == thread_token()
    }

    /// `ibv_wr_start`. A thread that already has a batch open on this QP
    /// starts over (its batch is discarded) instead of deadlocking.
    pub fn start(&self) {
        if self.held() {
            klog!(Level::Warn, "ibv_wr_start twice without ibv_wr_complete on a VQP: the first batch is discarded");
        } else {
            self.lock.lock();
            self.owner.store(thread_token(), Ordering::Relaxed);
        }
        // SAFETY: held by this thread.
        unsafe { &mut *self.batch.get() }.start();
    }

    /// Run a builder on the open batch of this thread; `None` (logged)
    /// when this thread has none.
    pub fn with<R>(&self, name: &str, f: impl FnOnce(&mut WrBatch) -> R) -> Option<R> {
        if !self.held() {
            klog!(Level::Debug, "{name} on a VQP without ibv_wr_start: ignored");
            return None;
        }
        // SAFETY: held by this thread: nobody else touches the batch.
        Some(f(unsafe { &mut *self.batch.get() }))
    }

    /// `ibv_wr_complete` (see [`WrBatch::complete`]); EINVAL without a
    /// batch open on this thread. The lock is released even if `post`
    /// panics.
    pub fn complete(&self, post: impl FnOnce(*mut ibv_send_wr, usize) -> i32) -> i32 {
        if !self.held() {
            return libc::EINVAL;
        }
        let _release = Release(self);
        // SAFETY: held by this thread.
        unsafe { &mut *self.batch.get() }.complete(post)
    }

    /// `ibv_wr_abort`: nothing without a batch open on this thread.
    pub fn abort(&self) {
        if !self.held() {
            return;
        }
        let _release = Release(self);
        // SAFETY: held by this thread.
        unsafe { &mut *self.batch.get() }.abort();
    }
}

/// Releases a [`QpWr`] held by this thread when dropped.
struct Release<'a>(&'a QpWr);

impl Drop for Release<'_> {
    fn drop(&mut self) {
        // SAFETY: held by this thread (checked by the caller); a panic
        // inside complete must not leave the batch open.
        unsafe {
            (*self.0.batch.get()).abort_if_open();
            self.0.owner.store(0, Ordering::Relaxed);
            self.0.lock.unlock();
        }
    }
}

impl WrBatch {
    fn abort_if_open(&mut self) {
        if self.open {
            self.abort();
        }
    }
}

#[cfg(test)]
#[allow(clippy::undocumented_unsafe_blocks)]
mod tests {
    use super::*;

    const LIM: Limits = Limits { max_sge: 3, max_inline: 64, max_wr: 8 };

    trait Inline {
        fn set_inline_s(&mut self, pieces: &[&[u8]]);
    }

    impl Inline for WrBatch {
        fn set_inline_s(&mut self, pieces: &[&[u8]]) {
            self.set_inline(pieces.iter().copied());
        }
    }
    const SIG: u32 = ibv_send_flags::IBV_SEND_SIGNALED.0;
    const INL: u32 = ibv_send_flags::IBV_SEND_INLINE.0;

    /// What a posted request carried, read back through its pointers.
    #[derive(Debug, PartialEq)]
    struct Seen {
        wr_id: u64,
        opcode: u32,
        flags: u32,
        sges: Vec<(u64, u32, u32)>,
        inline: Vec<u8>,
        imm: u32,
        remote: (u64, u32),
        atomic: (u64, u64),
    }

    fn walk(head: *mut ibv_send_wr, n: usize) -> Vec<Seen> {
        let mut out = Vec::new();
        let mut w = head;
        while !w.is_null() {
            let r = unsafe { &*w };
            let sges: &[ibv_sge] = if r.num_sge == 0 { &[] } else { unsafe { std::slice::from_raw_parts(r.sg_list, r.num_sge as usize) } };
            let inline = if r.send_flags & INL != 0 {
                sges.iter().flat_map(|s| unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.length as usize) }.to_vec()).collect()
            } else {
                Vec::new()
            };
            let atomic = matches!(r.opcode, ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP | ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD);
            out.push(Seen {
                wr_id: r.wr_id,
                opcode: r.opcode,
                flags: r.send_flags,
                sges: if r.send_flags & INL != 0 { Vec::new() } else { sges.iter().map(|s| (s.addr, s.length, s.lkey)).collect() },
                inline,
                imm: unsafe { r.imm_data_invalidated_rkey_union.imm_data },
                remote: unsafe {
                    if atomic {
                        (r.wr.atomic.remote_addr, r.wr.atomic.rkey)
                    } else {
                        (r.wr.rdma.remote_addr, r.wr.rdma.rkey)
                    }
                },
                atomic: if atomic { unsafe { (r.wr.atomic.compare_add, r.wr.atomic.swap) } } else { (0, 0) },
            });
            w = r.next;
        }
        assert_eq!(out.len(), n, "the chain holds the count posted");
        out
    }

    fn post_all(b: &mut WrBatch) -> (i32, Vec<Seen>) {
        let mut seen = Vec::new();
        let rc = b.complete(|h, n| {
            seen = walk(h, n);
            0
        });
        (rc, seen)
    }

    fn seen(wr_id: u64, opcode: u32, flags: u32) -> Seen {
        Seen { wr_id, opcode, flags, sges: vec![], inline: vec![], imm: 0, remote: (0, 0), atomic: (0, 0) }
    }

    #[test]
    fn every_opcode_with_its_fields() {
        let mut b = WrBatch::new(LIM);
        b.start();
        b.op(1, SIG, Op::Send);
        b.set_sge(7, 0x1000, 10);
        b.op(2, 0, Op::SendImm(0x04030201));
        b.set_inline_s(&[b"ab", b"", b"cde"]);
        b.op(3, SIG, Op::Write { rkey: 9, addr: 0x2000 });
        b.set_sge_list(&[ibv_sge { addr: 0x10, length: 4, lkey: 1 }, ibv_sge { addr: 0x20, length: 5, lkey: 2 }]);
        b.op(4, SIG, Op::WriteImm { rkey: 10, addr: 0x3000, imm: 0xabcd });
        b.set_sge(7, 0x1100, 3);
        b.op(5, SIG, Op::Read { rkey: 11, addr: 0x4000 });
        b.set_sge(7, 0x1200, 8);
        b.op(6, SIG, Op::CmpSwp { rkey: 12, addr: 0x5000, compare: 1, swap: 2 });
        b.set_sge(7, 0x1300, 8);
        b.op(7, SIG, Op::FetchAdd { rkey: 13, addr: 0x6000, add: 5 });
        b.set_sge(7, 0x1308, 8);
        assert_eq!(b.len(), 7);
        let (rc, s) = post_all(&mut b);
        assert_eq!(rc, 0);
        use ibv_wr_opcode::*;
        let want = vec![
            Seen { sges: vec![(0x1000, 10, 7)], ..seen(1, IBV_WR_SEND, SIG) },
            Seen { inline: b"abcde".to_vec(), imm: 0x04030201, ..seen(2, IBV_WR_SEND_WITH_IMM, INL) },
            Seen { sges: vec![(0x10, 4, 1), (0x20, 5, 2)], remote: (0x2000, 9), ..seen(3, IBV_WR_RDMA_WRITE, SIG) },
            Seen { sges: vec![(0x1100, 3, 7)], remote: (0x3000, 10), imm: 0xabcd, ..seen(4, IBV_WR_RDMA_WRITE_WITH_IMM, SIG) },
            Seen { sges: vec![(0x1200, 8, 7)], remote: (0x4000, 11), ..seen(5, IBV_WR_RDMA_READ, SIG) },
            Seen { sges: vec![(0x1300, 8, 7)], remote: (0x5000, 12), atomic: (1, 2), ..seen(6, IBV_WR_ATOMIC_CMP_AND_SWP, SIG) },
            Seen { sges: vec![(0x1308, 8, 7)], remote: (0x6000, 13), atomic: (5, 0), ..seen(7, IBV_WR_ATOMIC_FETCH_AND_ADD, SIG) },
        ];
        assert_eq!(s, want);
        assert!(!b.is_open(), "complete closes the batch");
    }

    #[test]
    fn inline_data_is_copied_at_the_setter() {
        let mut b = WrBatch::new(LIM);
        b.start();
        b.op(1, 0, Op::Send);
        let mut buf = *b"hello";
        b.set_inline_s(&[&buf]);
        buf.copy_from_slice(b"xxxxx");
        let (rc, s) = post_all(&mut b);
        assert_eq!((rc, s[0].inline.as_slice()), (0, &b"hello"[..]));
    }

    #[test]
    fn inline_flag_follows_the_data_setter() {
        let mut b = WrBatch::new(LIM);
        b.start();
        // INLINE in wr_flags with SGEs: gathered by lkey.
        b.op(1, SIG | INL, Op::Send);
        b.set_sge(3, 0x100, 4);
        // Inline data without the flag: inline.
        b.op(2, SIG, Op::Send);
        b.set_inline_s(&[b"xy"]);
        // A second setter replaces the first.
        b.op(3, SIG, Op::Send);
        b.set_inline_s(&[b"zz"]);
        b.set_sge(3, 0x200, 2);
        b.op(4, SIG | ibv_send_flags::IBV_SEND_FENCE.0 | ibv_send_flags::IBV_SEND_SOLICITED.0, Op::Send);
        let (rc, s) = post_all(&mut b);
        assert_eq!(rc, 0);
        assert_eq!(s[0].flags, SIG);
        assert_eq!(s[0].sges, vec![(0x100, 4, 3)]);
        assert_eq!((s[1].flags, s[1].inline.as_slice()), (SIG | INL, &b"xy"[..]));
        assert_eq!((s[2].flags, s[2].sges.clone()), (SIG, vec![(0x200, 2, 3)]));
        assert_eq!(s[3].flags, SIG | ibv_send_flags::IBV_SEND_FENCE.0 | ibv_send_flags::IBV_SEND_SOLICITED.0, "fence and solicited kept");
        assert!(s[3].sges.is_empty(), "no setter: no data");
    }

    #[test]
    fn building_errors_are_reported_by_complete_and_post_nothing() {
        type Case = (&'static str, fn(&mut WrBatch), i32);
        let cases: [Case; 6] = [
            (
                "too many sges",
                |b| {
                    b.op(1, 0, Op::Send);
                    b.set_sge_list(&[ibv_sge { addr: 0, length: 1, lkey: 1 }; 4]);
                },
                libc::EINVAL,
            ),
            ("setter before an opcode", |b| b.set_sge(1, 2, 3), libc::EINVAL),
            ("inline setter before an opcode", |b| b.set_inline_s(&[b"a"]), libc::EINVAL),
            (
                "inline too large",
                |b| {
                    b.op(1, 0, Op::Send);
                    b.set_inline_s(&[&[0u8; 40], &[0u8; 25]]);
                },
                libc::EINVAL,
            ),
            (
                "more requests than the queue",
                |b| {
                    for i in 0..9 {
                        b.op(i, 0, Op::Send);
                    }
                },
                libc::ENOMEM,
            ),
            (
                "the first error wins",
                |b| {
                    b.set_sge(1, 2, 3);
                    for i in 0..9 {
                        b.op(i, 0, Op::Send);
                    }
                },
                libc::EINVAL,
            ),
        ];
        for (name, build, want) in cases {
            let mut b = WrBatch::new(LIM);
            b.start();
            build(&mut b);
            let mut called = false;
            let rc = b.complete(|_, _| {
                called = true;
                0
            });
            assert_eq!(rc, want, "{name}");
            assert!(!called, "{name}: nothing posted");
            // The next batch is clean.
            b.start();
            b.op(1, SIG, Op::Send);
            let (rc, s) = post_all(&mut b);
            assert_eq!((rc, s.len()), (0, 1), "{name}: the next batch");
        }
    }

    #[test]
    fn exactly_the_limits_pass() {
        let mut b = WrBatch::new(LIM);
        b.start();
        for i in 0..8 {
            b.op(i, 0, Op::Send);
            b.set_sge_list(&[ibv_sge { addr: 0, length: 1, lkey: 1 }; 3]);
        }
        b.set_inline_s(&[&[1u8; 64]]);
        let (rc, s) = post_all(&mut b);
        assert_eq!((rc, s.len(), s[7].inline.len()), (0, 8, 64));
    }

    #[test]
    fn max_sge_is_capped_by_the_storage() {
        let mut b = WrBatch::new(Limits { max_sge: 16, ..LIM });
        b.start();
        b.op(1, 0, Op::Send);
        b.set_sge_list(&[ibv_sge { addr: 0, length: 1, lkey: 1 }; MAX_SGE + 1]);
        assert_eq!(b.error(), Some(Errno::EINVAL));
    }

    #[test]
    fn abort_and_empty_batches() {
        let mut b = WrBatch::new(LIM);
        b.start();
        b.op(1, SIG, Op::Send);
        b.abort();
        assert!(!b.is_open());
        assert_eq!(b.complete(|_, _| panic!("nothing to post")), libc::EINVAL, "complete after abort");
        b.start();
        assert_eq!(b.complete(|_, _| panic!("nothing to post")), 0, "an empty batch");
        // Outside start..complete: ignored, and forgotten at the next start.
        b.op(1, 0, Op::Send);
        b.start();
        b.op(2, 0, Op::Send);
        let (rc, s) = post_all(&mut b);
        assert_eq!((rc, s.len(), s[0].wr_id), (0, 1, 2));
    }

    #[test]
    fn the_post_errno_is_returned() {
        let mut b = WrBatch::new(LIM);
        b.start();
        b.op(1, 0, Op::Send);
        assert_eq!(b.complete(|_, n| if n == 1 { libc::ENOMEM } else { 0 }), libc::ENOMEM);
    }

    #[test]
    fn entries_are_reused_without_allocating() {
        let mut b = WrBatch::new(LIM);
        for round in 0..3 {
            b.start();
            for i in 0..4 {
                b.op(i, 0, Op::Send);
                b.set_inline_s(&[&[round as u8; 32]]);
            }
            let caps: Vec<*const u8> = b.pending.iter().map(|p| p.inline.as_ptr()).collect();
            let (rc, s) = post_all(&mut b);
            assert_eq!(rc, 0);
            assert!(s.iter().all(|x| x.inline == [round as u8; 32]));
            if round > 0 {
                assert_eq!(b.pending.len(), 4);
                let again: Vec<*const u8> = b.pending.iter().map(|p| p.inline.as_ptr()).collect();
                assert_eq!(caps, again, "inline buffers kept");
            }
        }
    }

    #[test]
    fn unsupported_send_ops_are_named() {
        use ibv_qp_create_send_ops_flags as F;
        assert_eq!(unsupported_send_op(VQP_SEND_OPS), None);
        assert_eq!(unsupported_send_op(0), None);
        let named = |ops: u64| unsupported_send_op(ops).unwrap();
        assert!(named(VQP_SEND_OPS | F::IBV_QP_EX_WITH_BIND_MW.0 as u64).contains("IBV_QP_EX_WITH_BIND_MW,"));
        assert!(named((F::IBV_QP_EX_WITH_TSO.0 | F::IBV_QP_EX_WITH_LOCAL_INV.0) as u64).contains("IBV_QP_EX_WITH_LOCAL_INV,"));
        assert!(named(F::IBV_QP_EX_WITH_ATOMIC_WRITE.0 as u64).contains("ATOMIC_WRITE"));
        assert!(named(1 << 40).contains("unknown"));
    }

    #[test]
    fn the_lock_spans_start_to_complete() {
        use std::sync::Arc;
        let w = Arc::new(QpWr::new(LIM, VQP_SEND_OPS));
        assert_eq!(w.complete(|_, _| 0), libc::EINVAL, "complete without start");
        assert!(w.with("t", |b| b.op(1, 0, Op::Send)).is_none(), "a builder without start");
        w.start();
        w.start(); // the same thread again: starts over, no deadlock
        w.with("t", |b| b.op(1, SIG, Op::Send)).unwrap();
        // Another thread waits in start until this batch completes.
        let (tx, rx) = std::sync::mpsc::channel();
        let w2 = Arc::clone(&w);
        let t = std::thread::spawn(move || {
            assert!(w2.with("t", |_| ()).is_none(), "not this thread's batch");
            assert_eq!(w2.complete(|_, _| 0), libc::EINVAL, "not this thread's batch");
            w2.start();
            tx.send(()).unwrap();
            w2.with("t", |b| b.op(2, SIG, Op::Send)).unwrap();
            let mut ids = Vec::new();
            assert_eq!(
                w2.complete(|h, n| {
                    ids = walk(h, n).iter().map(|s| s.wr_id).collect();
                    0
                }),
                0
            );
            ids
        });
        assert!(rx.recv_timeout(std::time::Duration::from_millis(100)).is_err(), "the other thread waits");
        let mut ids = Vec::new();
        assert_eq!(
            w.complete(|h, n| {
                ids = walk(h, n).iter().map(|s| s.wr_id).collect();
                0
            }),
            0
        );
        assert_eq!(ids, vec![1]);
        rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        assert_eq!(t.join().unwrap(), vec![2]);
        // A panic while posting releases the lock.
        w.start();
        w.with("t", |b| b.op(3, SIG, Op::Send)).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.complete(|_, _| panic!("boom"))));
        assert!(r.is_err());
        w.start();
        w.abort();
        w.abort(); // nothing open: nothing to do
    }
}
