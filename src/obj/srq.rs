//! Shared receive queues.

use super::{misc::Xrcd, non_null, ok_or_errno, real_of, wrapper, zeroed, Context, Cq, Pd};
use crate::call_real;
use crate::error::{Errno, Result};
use crate::real_ctx_op;
use crate::stats::{self, Stat};
use crate::sys::*;
use crate::vqp::srq::{Mode, VSrq};
use libc::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::Arc;

pub type PostSrqRecvFn = unsafe extern "C" fn(*mut ibv_srq, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

#[repr(C)]
pub struct Srq {
    pub ibv: ibv_srq,
    pub real: *mut ibv_srq,
    /// The real provider's post_srq_recv, cached for the hot path.
    pub post_recv: Option<PostSrqRecvFn>,
    /// With `KRCORE_VIRTUALIZE`: the receive queue the SRQ's VQPs share
    /// (its first QP decides whether it is used, see `vqp::srq`).
    pub virt: Option<Arc<VSrq>>,
}
wrapper!(Srq, ibv_srq);
real_of!(Srq, ibv_srq);

impl Srq {
    fn empty() -> Box<Srq> {
        // SAFETY: ibv_srq is plain C data.
        Box::new(Srq { ibv: unsafe { zeroed() }, real: null_mut(), post_recv: None, virt: None })
    }

    /// # Safety
    /// Pointer arguments are NULL where the verb allows it, or valid verbs
    /// objects and attribute structs of the caller.
    pub unsafe fn create(pd: &mut Pd, attr: *mut ibv_srq_init_attr) -> Result<*mut ibv_srq> {
        // SAFETY: attr is the caller's valid attribute struct.
        let mut a = unsafe { *attr };
        let user_ctx = a.srq_context;
        let mut srq = Srq::empty();
        a.srq_context = (&mut *srq as *mut Srq).cast();
        let real = non_null(call_real!(ibv_create_srq(pd.real, &mut a))?)?;
        // SAFETY: attr is valid for writes (the granted limits go back).
        unsafe { (*attr).attr = a.attr };
        srq.fill(pd.ibv.context, pd.as_ibv(), real, user_ctx);
        srq.virt = Srq::virtual_queue(pd.real, &a.attr)?;
        Ok(srq.into_ibv())
    }

    /// # Safety
    /// Pointer arguments are NULL where the verb allows it, or valid verbs
    /// objects and attribute structs of the caller.
    pub unsafe fn create_ex(ctx: &mut Context, attr: *mut ibv_srq_init_attr_ex) -> Result<*mut ibv_srq> {
        let create = real_ctx_op!(ctx.real, create_srq_ex).ok_or(Errno::EOPNOTSUPP)?;
        let me = ctx.as_ibv();
        // SAFETY: attr is the caller's valid attribute struct.
        let mut a = unsafe { *attr };
        let (user_ctx, pd) = (a.srq_context, a.pd);
        // SAFETY: pointers from the caller's attr; each is checked to be ours.
        unsafe {
            if a.comp_mask & ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_PD.0 != 0 {
                a.pd = Pd::real_of(a.pd, me)?;
            }
            if a.comp_mask & ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_XRCD.0 != 0 {
                a.xrcd = Xrcd::real_of(a.xrcd, me)?;
            }
            if a.comp_mask & ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_CQ.0 != 0 {
                a.cq = Cq::real_of(a.cq, me)?;
            }
        }
        let mut srq = Srq::empty();
        a.srq_context = (&mut *srq as *mut Srq).cast();
        // SAFETY: real context, translated attribute struct.
        let real = non_null(unsafe { create(ctx.real, &mut a) })?;
        // SAFETY: attr is valid for writes.
        unsafe { (*attr).attr = a.attr };
        srq.fill(me, pd, real, user_ctx);
        let basic = a.comp_mask & ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_TYPE.0 == 0 || a.srq_type == ibv_srq_type::IBV_SRQT_BASIC;
        if basic && !a.pd.is_null() {
            srq.virt = Srq::virtual_queue(a.pd, &a.attr)?;
        }
        Ok(srq.into_ibv())
    }

    /// The virtual side of a new basic SRQ when QPs may be virtualized.
    fn virtual_queue(real_pd: *mut ibv_pd, granted: &ibv_srq_attr) -> Result<Option<Arc<VSrq>>> {
        let cfg = crate::config::get();
        if cfg.virtualize == crate::config::Virtualize::Off || cfg.meta.is_none() {
            return Ok(None);
        }
        // VQPs' bound (precheck::Caps::on_device): RC's 2 GiB lowered to
        // the port's max_msg_sz, on the port their runtime uses.
        // SAFETY: a live real PD (our object's), and its live context.
        let max_msg_sz = unsafe { crate::rdma::query_port((*real_pd).context) }?.max_msg_sz.min(1 << 31);
        Ok(Some(Arc::new(VSrq::new(real_pd as usize, granted.max_wr, granted.max_sge, max_msg_sz)?)))
    }

    /// `ibv_post_srq_recv`: into the virtual queue until the SRQ is real.
    ///
    /// # Safety
    /// `wr` is the caller's valid list, `bad` valid for writes.
    pub unsafe fn post(&mut self, mut wr: *mut ibv_recv_wr, bad: *mut *mut ibv_recv_wr) -> c_int {
        if let Some(v) = self.virt.clone() {
            let mut rc = 0;
            while !wr.is_null() {
                // SAFETY: caller contract.
                let w = unsafe { &*wr };
                let sges: &[ibv_sge] = match (w.num_sge, w.sg_list.is_null()) {
                    (0, _) => &[],
                    (n, false) if n > 0 => {
                        // SAFETY: num_sge entries of the caller's list.
                        unsafe { std::slice::from_raw_parts(w.sg_list, n as usize) }
                    }
                    _ => {
                        rc = libc::EINVAL;
                        break;
                    }
                };
                match v.post(w.wr_id, sges) {
                    Ok(true) => wr = w.next,
                    // Real since: the rest goes there.
                    Ok(false) => break,
                    Err(e) => {
                        rc = e.0;
                        break;
                    }
                }
            }
            v.wake();
            if rc != 0 {
                // SAFETY: caller contract.
                unsafe { *bad = wr };
                return rc;
            }
            if wr.is_null() {
                return 0;
            }
        }
        match self.post_recv {
            // SAFETY: the real SRQ with the caller's list.
            Some(f) => unsafe { f(self.real, wr, bad) },
            None => {
                // SAFETY: bad is the caller's.
                unsafe { *bad = wr };
                libc::EOPNOTSUPP
            }
        }
    }

    /// A real QP is created on this SRQ: what was posted to the virtual
    /// queue moves to the real SRQ first. EINVAL if VQPs use it.
    pub fn attach_real(&mut self) -> Result<()> {
        let Some(v) = &self.virt else { return Ok(()) };
        let (real, post) = (self.real, self.post_recv.ok_or(Errno::EOPNOTSUPP)?);
        v.attach(false, |wr_id, sges| {
            let mut list = sges.to_vec();
            // SAFETY: a plain C struct.
            let mut w: ibv_recv_wr = unsafe { zeroed() };
            w.wr_id = wr_id;
            w.sg_list = list.as_mut_ptr();
            w.num_sge = list.len() as c_int;
            let mut bad = null_mut();
            // SAFETY: the real SRQ; w and its list live across the call.
            ok_or_errno(unsafe { post(real, &mut w, &mut bad) })
        })
        .inspect_err(|_| crate::klog!(crate::log::Level::Warn, "an SRQ that virtual QPs use cannot serve a real QP too"))
    }

    /// Whether VQPs may take their receives from this SRQ.
    pub fn serves_virtual(&self) -> bool {
        self.virt.as_ref().is_some_and(|v| v.mode() != Mode::Real)
    }

    fn fill(&mut self, ctx: *mut ibv_context, pd: *mut ibv_pd, real: *mut ibv_srq, user_ctx: *mut c_void) {
        stats::inc(Stat::KRCORE_STAT_SRQS_CREATED);
        self.real = real;
        // SAFETY: real is a live SRQ of a live real context.
        unsafe {
            self.post_recv = (*(*real).context).ops.post_srq_recv;
            self.ibv.handle = (*real).handle;
        }
        self.ibv.context = ctx;
        self.ibv.pd = pd;
        self.ibv.srq_context = user_ctx;
    }

    /// # Safety
    /// `attr` is valid for the fields `mask` names.
    pub unsafe fn modify(&mut self, attr: *mut ibv_srq_attr, mask: c_int) -> Result<()> {
        if self.serves_virtual() {
            // Neither the limit event nor a resize is kept for the virtual
            // queue (documented).
            crate::klog!(crate::log::Level::Warn, "ibv_modify_srq on an SRQ of virtual QPs is not supported");
            return Err(Errno::EOPNOTSUPP);
        }
        ok_or_errno(call_real!(ibv_modify_srq(self.real, attr, mask))?)
    }

    /// # Safety
    /// `attr` is valid for writes.
    pub unsafe fn query(&mut self, attr: *mut ibv_srq_attr) -> Result<()> {
        ok_or_errno(call_real!(ibv_query_srq(self.real, attr))?)
    }

    /// # Safety
    /// `num` is valid for writes.
    pub unsafe fn srq_num(&mut self, num: *mut u32) -> Result<()> {
        // SAFETY: our SRQ's context is our live context.
        let ctx = unsafe { Context::from_ibv(self.ibv.context) };
        let get = real_ctx_op!(ctx.real, get_srq_num).ok_or(Errno::EOPNOTSUPP)?;
        // SAFETY: the real SRQ; num valid (caller contract).
        ok_or_errno(unsafe { get(self.real, num) })
    }

    /// # Safety
    /// `p` is an SRQ of this library.
    pub unsafe fn destroy(p: *mut ibv_srq) -> Result<()> {
        // SAFETY: caller contract.
        let srq = unsafe { Srq::from_ibv(p) };
        ok_or_errno(call_real!(ibv_destroy_srq(srq.real))?)?;
        // SAFETY: the real SRQ is gone.
        unsafe { Srq::free(p) };
        Ok(())
    }
}
