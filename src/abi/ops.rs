//! Functions placed in the objects we hand out: the context's `ops`, the
//! extended ops of its `verbs_context`, and the `ibv_qp_ex` / `ibv_cq_ex`
//! function pointers. verbs.h's static inline functions jump here.
//!
//! A slot is filled only when the real object has the same slot, so verbs.h
//! sees exactly the capabilities of the real provider (a NULL op makes the
//! inline wrapper return EOPNOTSUPP or take its legacy path).

use super::boundary;
use super::ctx_of;
use super::device::{query_device_ex_op, query_port_op};
use crate::error::Errno;
use crate::obj::{Context, Cq, Mw, Pd, Qp, Srq, Xrcd};
use crate::real_ctx_op;
use crate::stats::{self, Stat};
use crate::sys::*;
use crate::vqp::wr_builder::Op;
use libc::{c_int, c_void};

// ---- ibv_context_ops: the data path --------------------------------------

pub(crate) unsafe extern "C" fn post_send(qp: *mut ibv_qp, wr: *mut ibv_send_wr, bad: *mut *mut ibv_send_wr) -> c_int {
    boundary::value("post_send", libc::EIO, || {
        stats::inc(Stat::KRCORE_STAT_POST_SEND);
        // SAFETY: only our QPs reach our ops; wr/bad are the caller's.
        let q = unsafe { Qp::from_qp(qp) };
        let rc = match &q.vqp {
            // SAFETY: the caller's list.
            Some(v) => unsafe { v.post_send(wr, bad) },
            // SAFETY: as above.
            None => unsafe { q.path.post_send(wr, bad) },
        };
        if rc != 0 {
            stats::inc(Stat::KRCORE_STAT_POST_ERRORS);
        }
        rc
    })
}

pub(crate) unsafe extern "C" fn post_recv(qp: *mut ibv_qp, wr: *mut ibv_recv_wr, bad: *mut *mut ibv_recv_wr) -> c_int {
    boundary::value("post_recv", libc::EIO, || {
        stats::inc(Stat::KRCORE_STAT_POST_RECV);
        // SAFETY: only our QPs reach our ops.
        let q = unsafe { Qp::from_qp(qp) };
        let rc = match &q.vqp {
            // SAFETY: the caller's list.
            Some(v) => unsafe { v.post_recv(wr, bad) },
            // SAFETY: as above.
            None => unsafe { q.path.post_recv(wr, bad) },
        };
        if rc != 0 {
            stats::inc(Stat::KRCORE_STAT_POST_ERRORS);
        }
        rc
    })
}

pub(crate) unsafe extern "C" fn post_srq_recv(srq: *mut ibv_srq, wr: *mut ibv_recv_wr, bad: *mut *mut ibv_recv_wr) -> c_int {
    boundary::value("post_srq_recv", libc::EIO, || {
        stats::inc(Stat::KRCORE_STAT_POST_SRQ_RECV);
        // SAFETY: only our SRQs reach our ops.
        let s = unsafe { Srq::from_ibv(srq) };
        // SAFETY: the caller's list and bad pointer.
        let rc = unsafe { s.post(wr, bad) };
        if rc != 0 {
            stats::inc(Stat::KRCORE_STAT_POST_ERRORS);
        }
        rc
    })
}

pub(crate) unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int {
    boundary::value("poll_cq", -libc::EIO, || {
        stats::inc(Stat::KRCORE_STAT_POLL_CQ);
        // SAFETY: only our CQs reach our ops.
        let c = unsafe { Cq::from_cq(cq) };
        if c.soft.get().is_some() {
            // SAFETY: the caller's array of num_entries.
            return unsafe { c.poll_all(num_entries, wc) };
        }
        match c.poll {
            // SAFETY: the real CQ with the caller's array.
            Some(f) => unsafe { f(c.real, num_entries, wc) },
            None => -libc::EOPNOTSUPP,
        }
    })
}

pub(crate) unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    boundary::value("req_notify_cq", libc::EIO, || {
        stats::inc(Stat::KRCORE_STAT_REQ_NOTIFY_CQ);
        // SAFETY: only our CQs reach our ops.
        let c = unsafe { Cq::from_cq(cq) };
        // The real CQ first: arming the VQPs' side makes progress, and an
        // event it raises lands in the real CQ, which must be armed by then
        // (else that completion is queued and no event ever comes).
        let rc = match c.notify {
            // SAFETY: the real CQ.
            Some(f) => unsafe { f(c.real, solicited_only) },
            None => libc::EOPNOTSUPP,
        };
        if rc == 0 {
            c.app_armed.store(true, std::sync::atomic::Ordering::Release);
            if let Some(soft) = c.soft.get().filter(|_| c.evented()) {
                soft.arm();
            }
        }
        rc
    })
}

// ---- ibv_context_ops: memory windows --------------------------------------

unsafe extern "C" fn alloc_mw(pd: *mut ibv_pd, ty: ibv_mw_type::Type) -> *mut ibv_mw {
    // SAFETY: only our PDs reach our ops.
    boundary::ptr("ibv_alloc_mw", || Mw::alloc(unsafe { Pd::from_ibv(pd) }, ty))
}

unsafe extern "C" fn dealloc_mw(mw: *mut ibv_mw) -> c_int {
    // SAFETY: only our MWs reach our ops.
    boundary::errno("ibv_dealloc_mw", || unsafe { Mw::dealloc(mw) }.map(|_| 0))
}

unsafe extern "C" fn bind_mw(qp: *mut ibv_qp, mw: *mut ibv_mw, bind: *mut ibv_mw_bind) -> c_int {
    boundary::errno("ibv_bind_mw", || {
        if qp.is_null() || bind.is_null() {
            return Err(Errno::EINVAL);
        }
        // SAFETY: only our MWs reach our ops; the QP is checked to be of the
        // MW's context inside bind().
        let m = unsafe { Mw::from_ibv(mw) };
        // SAFETY: qp is a non-NULL QP pointer from the caller.
        if unsafe { (*qp).context } != m.ibv.context {
            return Err(Errno::EINVAL);
        }
        // SAFETY: same context, hence our QP.
        let real_qp = unsafe { Qp::from_qp(qp) }.real;
        // SAFETY: as above; bind is the caller's.
        unsafe { m.bind(qp, real_qp, bind) }.map(|_| 0)
    })
}

// ---- verbs_context extended ops ---------------------------------------------

unsafe extern "C" fn create_qp_ex(context: *mut ibv_context, attr: *mut ibv_qp_init_attr_ex) -> *mut ibv_qp {
    boundary::ptr("ibv_create_qp_ex", || {
        if attr.is_null() {
            return Err(Errno::EINVAL);
        }
        // SAFETY: attr is the caller's, non-NULL.
        let qp = unsafe { Qp::create_ex(ctx_of(context)?, attr) }?;
        // SAFETY: just created by us.
        install_qp_ex_ops(unsafe { Qp::from_qp(qp) });
        Ok(qp)
    })
}

unsafe extern "C" fn create_cq_ex(context: *mut ibv_context, attr: *mut ibv_cq_init_attr_ex) -> *mut ibv_cq_ex {
    boundary::ptr("ibv_create_cq_ex", || {
        if attr.is_null() {
            return Err(Errno::EINVAL);
        }
        // SAFETY: attr is the caller's, non-NULL.
        let cq = unsafe { Cq::create_ex(ctx_of(context)?, attr) }?;
        // SAFETY: just created by us.
        install_cq_ex_ops(unsafe { Cq::from_ibv(cq) });
        Ok(cq)
    })
}

unsafe extern "C" fn modify_cq(cq: *mut ibv_cq, attr: *mut ibv_modify_cq_attr) -> c_int {
    boundary::errno("ibv_modify_cq", || {
        // SAFETY: only our CQs reach our ops.
        let c = unsafe { Cq::from_cq(cq) };
        // SAFETY: the real CQ's context is live.
        let real_ctx = unsafe { (*c.real).context };
        let op = real_ctx_op!(real_ctx, modify_cq).ok_or(Errno::EOPNOTSUPP)?;
        // SAFETY: the real CQ with the caller's attributes.
        Ok(unsafe { op(c.real, attr) })
    })
}

unsafe extern "C" fn create_srq_ex(context: *mut ibv_context, attr: *mut ibv_srq_init_attr_ex) -> *mut ibv_srq {
    boundary::ptr("ibv_create_srq_ex", || {
        if attr.is_null() {
            return Err(Errno::EINVAL);
        }
        // SAFETY: attr is the caller's, non-NULL.
        unsafe { Srq::create_ex(ctx_of(context)?, attr) }
    })
}

unsafe extern "C" fn get_srq_num(srq: *mut ibv_srq, num: *mut u32) -> c_int {
    // SAFETY: only our SRQs reach our ops.
    boundary::errno("ibv_get_srq_num", || unsafe { Srq::from_ibv(srq).srq_num(num) }.map(|_| 0))
}

unsafe extern "C" fn open_xrcd(context: *mut ibv_context, attr: *mut ibv_xrcd_init_attr) -> *mut ibv_xrcd {
    // SAFETY: attr is the caller's.
    boundary::ptr("ibv_open_xrcd", || unsafe { Xrcd::open(ctx_of(context)?, attr) })
}

unsafe extern "C" fn close_xrcd(xrcd: *mut ibv_xrcd) -> c_int {
    // SAFETY: only our XRCDs reach our ops.
    boundary::errno("ibv_close_xrcd", || unsafe { Xrcd::close(xrcd) }.map(|_| 0))
}

/// Fill a new context's ops from what its real context supports.
pub fn install_context_ops(ctx: &mut Context) {
    let real = ctx.real;
    // SAFETY: the real context is live.
    let rops = unsafe { &(*real).ops };
    let ops = &mut ctx.vctx.context.ops;
    ops.post_send = Some(post_send);
    ops.post_recv = Some(post_recv);
    ops.post_srq_recv = Some(post_srq_recv);
    ops.poll_cq = Some(poll_cq);
    ops.req_notify_cq = Some(req_notify_cq);
    if rops.alloc_mw.is_some() {
        ops.alloc_mw = Some(alloc_mw);
        ops.dealloc_mw = Some(dealloc_mw);
        ops.bind_mw = Some(bind_mw);
    }
    let v = &mut ctx.vctx;
    macro_rules! ext {
        ($op:ident, $f:expr) => {
            if real_ctx_op!(real, $op).is_some() {
                v.$op = Some($f);
            }
        };
    }
    // query_port always: verbs.h falls back to the compat export otherwise.
    v.query_port = Some(query_port_op);
    ext!(query_device_ex, query_device_ex_op);
    ext!(create_qp_ex, create_qp_ex);
    ext!(create_cq_ex, create_cq_ex);
    ext!(modify_cq, modify_cq);
    ext!(create_srq_ex, create_srq_ex);
    ext!(get_srq_num, get_srq_num);
    ext!(open_xrcd, open_xrcd);
    ext!(close_xrcd, close_xrcd);
}

// ---- ibv_qp_ex: the ibv_wr_* builders ----------------------------------------

/// Our QP and its real `ibv_qp_ex`, with the fields the application wrote
/// directly (`wr_id`, `wr_flags`) copied over before each builder call.
///
/// # Safety
/// `qp` is one of our extended QPs.
#[inline(always)]
unsafe fn synced<'a>(qp: *mut ibv_qp_ex) -> (&'a mut Qp, &'a mut ibv_qp_ex) {
    // SAFETY: caller contract; real_ex is set whenever these ops are installed.
    unsafe {
        let q = Qp::from_ibv(qp);
        let r = &mut *q.real_ex;
        r.wr_id = q.ibv.wr_id;
        r.wr_flags = q.ibv.wr_flags;
        (q, r)
    }
}

/// `wr_fwd!(name(args) counted)`: a builder that forwards its arguments.
macro_rules! wr_fwd {
    ($name:ident ( $($a:ident : $t:ty),* ) $(-> $ret:ty)?, $count:expr) => {
        unsafe extern "C" fn $name(qp: *mut ibv_qp_ex $(, $a: $t)*) $(-> $ret)? {
            boundary::value(stringify!($name), Default::default(), || {
                if $count {
                    stats::inc(Stat::KRCORE_STAT_WR_CALLS);
                }
                // SAFETY: installed only on our extended QPs, and only when
                // the real QP has the same builder.
                unsafe {
                    let (_, r) = synced(qp);
                    (r.$name.unwrap_unchecked())(r $(, $a)*)
                }
            })
        }
    };
}

wr_fwd!(wr_atomic_cmp_swp(rkey: u32, remote_addr: u64, compare: u64, swap: u64), true);
wr_fwd!(wr_atomic_fetch_add(rkey: u32, remote_addr: u64, add: u64), true);
wr_fwd!(wr_local_inv(invalidate_rkey: u32), true);
wr_fwd!(wr_rdma_read(rkey: u32, remote_addr: u64), true);
wr_fwd!(wr_rdma_write(rkey: u32, remote_addr: u64), true);
wr_fwd!(wr_rdma_write_imm(rkey: u32, remote_addr: u64, imm_data: __be32), true);
wr_fwd!(wr_send(), true);
wr_fwd!(wr_send_imm(imm_data: __be32), true);
wr_fwd!(wr_send_inv(invalidate_rkey: u32), true);
wr_fwd!(wr_send_tso(hdr: *mut c_void, hdr_sz: u16, mss: u16), true);
wr_fwd!(wr_atomic_write(rkey: u32, remote_addr: u64, atomic_wr: *const c_void), true);
wr_fwd!(wr_set_xrc_srqn(remote_srqn: u32), false);
wr_fwd!(wr_set_inline_data(addr: *mut c_void, length: usize), false);
wr_fwd!(wr_set_inline_data_list(num_buf: usize, buf_list: *const ibv_data_buf), false);
wr_fwd!(wr_set_sge(lkey: u32, addr: u64, length: u32), false);
wr_fwd!(wr_set_sge_list(num_sge: usize, sg_list: *const ibv_sge), false);
wr_fwd!(wr_start(), false);
wr_fwd!(wr_complete() -> c_int, false);
wr_fwd!(wr_abort(), false);

unsafe extern "C" fn wr_set_ud_addr(qp: *mut ibv_qp_ex, ah: *mut ibv_ah, remote_qpn: u32, remote_qkey: u32) {
    boundary::value("wr_set_ud_addr", (), || {
        // SAFETY: installed only on our extended QPs with the real builder.
        unsafe {
            let (q, r) = synced(qp);
            let real_ah = if !ah.is_null() && (*ah).context == q.ibv.qp_base.context { crate::obj::Ah::from_ibv(ah).real } else { ah };
            (r.wr_set_ud_addr.unwrap_unchecked())(r, real_ah, remote_qpn, remote_qkey)
        }
    })
}

unsafe extern "C" fn wr_bind_mw(qp: *mut ibv_qp_ex, mw: *mut ibv_mw, rkey: u32, info: *const ibv_mw_bind_info) {
    boundary::value("wr_bind_mw", (), || {
        stats::inc(Stat::KRCORE_STAT_WR_CALLS);
        // SAFETY: installed only on our extended QPs with the real builder;
        // mw and info are the caller's live objects.
        unsafe {
            let (q, r) = synced(qp);
            let ctx = q.ibv.qp_base.context;
            let mut i = if info.is_null() { std::mem::zeroed() } else { *info };
            if !i.mr.is_null() && (*i.mr).context == ctx {
                i.mr = crate::obj::Mr::from_ibv(i.mr).real;
            }
            let real_mw = Mw::real_or_same(mw, ctx);
            let info_ptr = if info.is_null() { std::ptr::null() } else { &i as *const ibv_mw_bind_info };
            (r.wr_bind_mw.unwrap_unchecked())(r, real_mw, rkey, info_ptr)
        }
    })
}

// ---- ibv_qp_ex on a VQP: the batch of crate::vqp::wr_builder ------------------

/// Our VQP's batch, or `None` (logged) if `qp` has none.
///
/// # Safety
/// `qp` is one of our QPs (these builders are installed only on VQPs with
/// a batch).
#[inline(always)]
unsafe fn vqp_batch<'a>(qp: *mut ibv_qp_ex) -> (&'a Qp, Option<&'a crate::vqp::wr_builder::QpWr>) {
    // SAFETY: caller contract.
    let q: &Qp = unsafe { Qp::from_ibv(qp) };
    (q, q.wr.as_deref())
}

/// An opcode builder on a VQP: a new request with the `wr_id` and
/// `wr_flags` the application wrote into the `ibv_qp_ex` before this call.
///
/// # Safety
/// As [`vqp_batch`].
unsafe fn vqp_op(qp: *mut ibv_qp_ex, name: &str, op: Op) {
    boundary::value(name, (), || {
        stats::inc(Stat::KRCORE_STAT_WR_CALLS);
        // SAFETY: caller contract.
        let (q, w) = unsafe { vqp_batch(qp) };
        let (wr_id, wr_flags) = (q.ibv.wr_id, q.ibv.wr_flags);
        if let Some(w) = w {
            w.with(name, |b| b.op(wr_id, wr_flags, op));
        }
    })
}

unsafe extern "C" fn vqp_wr_send(qp: *mut ibv_qp_ex) {
    // SAFETY: installed only on our VQPs with a batch.
    unsafe { vqp_op(qp, "ibv_wr_send", Op::Send) }
}

unsafe extern "C" fn vqp_wr_send_imm(qp: *mut ibv_qp_ex, imm: __be32) {
    // SAFETY: as vqp_wr_send.
    unsafe { vqp_op(qp, "ibv_wr_send_imm", Op::SendImm(imm)) }
}

unsafe extern "C" fn vqp_wr_rdma_write(qp: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    // SAFETY: as vqp_wr_send.
    unsafe { vqp_op(qp, "ibv_wr_rdma_write", Op::Write { rkey, addr }) }
}

unsafe extern "C" fn vqp_wr_rdma_write_imm(qp: *mut ibv_qp_ex, rkey: u32, addr: u64, imm: __be32) {
    // SAFETY: as vqp_wr_send.
    unsafe { vqp_op(qp, "ibv_wr_rdma_write_imm", Op::WriteImm { rkey, addr, imm }) }
}

unsafe extern "C" fn vqp_wr_rdma_read(qp: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    // SAFETY: as vqp_wr_send.
    unsafe { vqp_op(qp, "ibv_wr_rdma_read", Op::Read { rkey, addr }) }
}

unsafe extern "C" fn vqp_wr_atomic_cmp_swp(qp: *mut ibv_qp_ex, rkey: u32, addr: u64, compare: u64, swap: u64) {
    // SAFETY: as vqp_wr_send.
    unsafe { vqp_op(qp, "ibv_wr_atomic_cmp_swp", Op::CmpSwp { rkey, addr, compare, swap }) }
}

unsafe extern "C" fn vqp_wr_atomic_fetch_add(qp: *mut ibv_qp_ex, rkey: u32, addr: u64, add: u64) {
    // SAFETY: as vqp_wr_send.
    unsafe { vqp_op(qp, "ibv_wr_atomic_fetch_add", Op::FetchAdd { rkey, addr, add }) }
}

unsafe extern "C" fn vqp_wr_set_sge(qp: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    boundary::value("ibv_wr_set_sge", (), || {
        // SAFETY: as vqp_wr_send.
        if let (_, Some(w)) = unsafe { vqp_batch(qp) } {
            w.with("ibv_wr_set_sge", |b| b.set_sge(lkey, addr, length));
        }
    })
}

unsafe extern "C" fn vqp_wr_set_sge_list(qp: *mut ibv_qp_ex, num_sge: usize, sg_list: *const ibv_sge) {
    boundary::value("ibv_wr_set_sge_list", (), || {
        // SAFETY: as vqp_wr_send.
        let (_, Some(w)) = (unsafe { vqp_batch(qp) }) else { return };
        w.with("ibv_wr_set_sge_list", |b| {
            if num_sge == 0 {
                b.set_sge_list(&[]);
            } else if num_sge > crate::vqp::wr_builder::MAX_SGE {
                // Never made into a slice: more than any VQP takes.
                b.fail_with(Errno::EINVAL, "more SGEs than the QP's max_send_sge");
            } else if sg_list.is_null() {
                b.fail_with(Errno::EINVAL, "ibv_wr_set_sge_list with a NULL list");
            } else {
                // SAFETY: the application's list of num_sge entries.
                b.set_sge_list(unsafe { std::slice::from_raw_parts(sg_list, num_sge) });
            }
        });
    })
}

unsafe extern "C" fn vqp_wr_set_inline_data(qp: *mut ibv_qp_ex, addr: *mut c_void, length: usize) {
    // SAFETY: the application's buffer (caller contract of the verb).
    unsafe { vqp_wr_set_inline_data_list(qp, 1, &ibv_data_buf { addr, length }) }
}

unsafe extern "C" fn vqp_wr_set_inline_data_list(qp: *mut ibv_qp_ex, num_buf: usize, buf_list: *const ibv_data_buf) {
    boundary::value("ibv_wr_set_inline_data(_list)", (), || {
        // SAFETY: as vqp_wr_send.
        let (_, Some(w)) = (unsafe { vqp_batch(qp) }) else { return };
        w.with("ibv_wr_set_inline_data(_list)", |b| {
            let bufs: &[ibv_data_buf] = match (num_buf, buf_list.is_null()) {
                (0, _) => &[],
                (_, true) => return b.fail_with(Errno::EINVAL, "ibv_wr_set_inline_data_list with a NULL list"),
                // SAFETY: the application's list of num_buf entries.
                _ => unsafe { std::slice::from_raw_parts(buf_list, num_buf) },
            };
            if bufs.iter().any(|d| d.length > 0 && d.addr.is_null()) {
                return b.fail_with(Errno::EINVAL, "inline data at a NULL address");
            }
            let pieces = bufs.iter().filter(|d| d.length > 0).map(|d| {
                // SAFETY: the application's buffer of that length (checked
                // non-NULL above), read during this call only.
                unsafe { std::slice::from_raw_parts(d.addr as *const u8, d.length) }
            });
            b.set_inline(pieces);
        });
    })
}

unsafe extern "C" fn vqp_wr_start(qp: *mut ibv_qp_ex) {
    boundary::value("ibv_wr_start", (), || {
        // SAFETY: as vqp_wr_send.
        if let (_, Some(w)) = unsafe { vqp_batch(qp) } {
            w.start();
        }
    })
}

unsafe extern "C" fn vqp_wr_complete(qp: *mut ibv_qp_ex) -> c_int {
    boundary::value("ibv_wr_complete", libc::EIO, || {
        // SAFETY: as vqp_wr_send.
        let (q, w) = unsafe { vqp_batch(qp) };
        let (Some(w), Some(v)) = (w, q.vqp.as_ref()) else { return libc::EINVAL };
        // SAFETY: the batch's own chain of n requests.
        let rc = w.complete(|head, n| unsafe { v.post_batch(head, n) });
        if rc != 0 {
            stats::inc(Stat::KRCORE_STAT_POST_ERRORS);
        }
        rc
    })
}

unsafe extern "C" fn vqp_wr_abort(qp: *mut ibv_qp_ex) {
    boundary::value("ibv_wr_abort", (), || {
        // SAFETY: as vqp_wr_send.
        if let (_, Some(w)) = unsafe { vqp_batch(qp) } {
            w.abort();
        }
    })
}

/// The builders of a VQP with a batch: the data setters and the batch
/// verbs always, the opcode builders its `send_ops_flags` asked for (the
/// others stay NULL, as on a provider that lacks them; creation refused
/// the ones a VQP cannot do). No UD address, XRC SRQ number, TSO, MW or
/// invalidation builders: a VQP is RC.
fn install_vqp_wr_ops(q: &mut Qp) {
    use ibv_qp_create_send_ops_flags as F;
    let Some(ops) = q.wr.as_ref().map(|w| w.send_ops) else { return };
    let o = &mut q.ibv;
    o.wr_start = Some(vqp_wr_start);
    o.wr_complete = Some(vqp_wr_complete);
    o.wr_abort = Some(vqp_wr_abort);
    o.wr_set_sge = Some(vqp_wr_set_sge);
    o.wr_set_sge_list = Some(vqp_wr_set_sge_list);
    o.wr_set_inline_data = Some(vqp_wr_set_inline_data);
    o.wr_set_inline_data_list = Some(vqp_wr_set_inline_data_list);
    let has = |f: F| ops & f.0 as u64 != 0;
    if has(F::IBV_QP_EX_WITH_SEND) {
        o.wr_send = Some(vqp_wr_send);
    }
    if has(F::IBV_QP_EX_WITH_SEND_WITH_IMM) {
        o.wr_send_imm = Some(vqp_wr_send_imm);
    }
    if has(F::IBV_QP_EX_WITH_RDMA_WRITE) {
        o.wr_rdma_write = Some(vqp_wr_rdma_write);
    }
    if has(F::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM) {
        o.wr_rdma_write_imm = Some(vqp_wr_rdma_write_imm);
    }
    if has(F::IBV_QP_EX_WITH_RDMA_READ) {
        o.wr_rdma_read = Some(vqp_wr_rdma_read);
    }
    if has(F::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP) {
        o.wr_atomic_cmp_swp = Some(vqp_wr_atomic_cmp_swp);
    }
    if has(F::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD) {
        o.wr_atomic_fetch_add = Some(vqp_wr_atomic_fetch_add);
    }
}

/// Mirror the real QP's builders onto ours (a VQP: its own builders).
pub fn install_qp_ex_ops(q: &mut Qp) {
    if q.wr.is_some() {
        install_vqp_wr_ops(q);
        return;
    }
    if q.real_ex.is_null() {
        return;
    }
    // SAFETY: real_ex is the live real ibv_qp_ex.
    let r = unsafe { &*q.real_ex };
    let o = &mut q.ibv;
    macro_rules! mirror {
        ($($f:ident),*) => { $( if r.$f.is_some() { o.$f = Some($f); } )* };
    }
    mirror!(
        wr_atomic_cmp_swp,
        wr_atomic_fetch_add,
        wr_bind_mw,
        wr_local_inv,
        wr_rdma_read,
        wr_rdma_write,
        wr_rdma_write_imm,
        wr_send,
        wr_send_imm,
        wr_send_inv,
        wr_send_tso,
        wr_set_ud_addr,
        wr_set_xrc_srqn,
        wr_set_inline_data,
        wr_set_inline_data_list,
        wr_set_sge,
        wr_set_sge_list,
        wr_start,
        wr_complete,
        wr_abort,
        wr_atomic_write
    );
}

// ---- ibv_cq_ex: the ibv_start_poll family -------------------------------------

/// Copy what the application reads directly (`status`, `wr_id`).
#[inline(always)]
fn publish(c: &mut Cq, rc: c_int) -> c_int {
    if rc == 0 {
        // SAFETY: real_ex is live whenever these ops are installed.
        let r = unsafe { &*c.real_ex };
        c.ibv.status = r.status;
        c.ibv.wr_id = r.wr_id;
    }
    rc
}

unsafe extern "C" fn start_poll(cq: *mut ibv_cq_ex, attr: *mut ibv_poll_cq_attr) -> c_int {
    boundary::value("ibv_start_poll", libc::EIO, || {
        stats::inc(Stat::KRCORE_STAT_POLL_CQ);
        // SAFETY: installed only on our extended CQs with the real op.
        unsafe {
            let c = Cq::from_ibv(cq);
            let r = c.real_ex;
            let rc = ((*r).start_poll.unwrap_unchecked())(r, attr);
            publish(c, rc)
        }
    })
}

unsafe extern "C" fn next_poll(cq: *mut ibv_cq_ex) -> c_int {
    boundary::value("ibv_next_poll", libc::EIO, || {
        // SAFETY: as start_poll.
        unsafe {
            let c = Cq::from_ibv(cq);
            let r = c.real_ex;
            let rc = ((*r).next_poll.unwrap_unchecked())(r);
            publish(c, rc)
        }
    })
}

macro_rules! cq_fwd {
    ($name:ident ( $($a:ident : $t:ty),* ) $(-> $ret:ty)?) => {
        unsafe extern "C" fn $name(cq: *mut ibv_cq_ex $(, $a: $t)*) $(-> $ret)? {
            boundary::value(stringify!($name), Default::default(), || {
                // SAFETY: installed only on our extended CQs with the real op.
                unsafe {
                    let r = Cq::from_ibv(cq).real_ex;
                    ((*r).$name.unwrap_unchecked())(r $(, $a)*)
                }
            })
        }
    };
}

cq_fwd!(end_poll());
cq_fwd!(read_opcode() -> ibv_wc_opcode::Type);
cq_fwd!(read_vendor_err() -> u32);
cq_fwd!(read_byte_len() -> u32);
cq_fwd!(read_imm_data() -> __be32);
cq_fwd!(read_qp_num() -> u32);
cq_fwd!(read_src_qp() -> u32);
cq_fwd!(read_wc_flags() -> u32);
cq_fwd!(read_slid() -> u32);
cq_fwd!(read_sl() -> u8);
cq_fwd!(read_dlid_path_bits() -> u8);
cq_fwd!(read_completion_ts() -> u64);
cq_fwd!(read_cvlan() -> u16);
cq_fwd!(read_flow_tag() -> u32);
cq_fwd!(read_tm_info(info: *mut ibv_wc_tm_info));
cq_fwd!(read_completion_wallclock_ns() -> u64);

/// Mirror the real CQ's poll functions onto ours.
pub fn install_cq_ex_ops(c: &mut Cq) {
    if c.real_ex.is_null() {
        return;
    }
    // SAFETY: real_ex is the live real ibv_cq_ex.
    let r = unsafe { &*c.real_ex };
    let o = &mut c.ibv;
    macro_rules! mirror {
        ($($f:ident),*) => { $( if r.$f.is_some() { o.$f = Some($f); } )* };
    }
    mirror!(
        start_poll,
        next_poll,
        end_poll,
        read_opcode,
        read_vendor_err,
        read_byte_len,
        read_imm_data,
        read_qp_num,
        read_src_qp,
        read_wc_flags,
        read_slid,
        read_sl,
        read_dlid_path_bits,
        read_completion_ts,
        read_cvlan,
        read_flow_tag,
        read_tm_info,
        read_completion_wallclock_ns
    );
}
