//! Small wrapped objects: protection domains, address handles, memory
//! windows, XRC domains.

use super::{non_null, ok_or_errno, real_of, wrapper, Context, Mr};
use crate::call_real;
use crate::error::{Errno, Result};
use crate::real_ctx_op;
use crate::stats::{self, Stat};
use crate::sys::*;
use std::sync::atomic::Ordering;

/// Is `p` (an object with a `context` field) NULL or an object of `ctx`?
/// Objects of a wrapped context carry the wrapped context pointer; a real
/// object carries a real one, so the comparison tells them apart.
macro_rules! check_owner {
    ($p:expr, $ctx:expr) => {
        // SAFETY: a non-NULL verbs object pointer handed to a verb is live.
        $p.is_null() || unsafe { (*$p).context } == $ctx
    };
}
pub(crate) use check_owner;

#[repr(C)]
pub struct Pd {
    pub ibv: ibv_pd,
    pub real: *mut ibv_pd,
}
wrapper!(Pd, ibv_pd);
real_of!(Pd, ibv_pd);

impl Pd {
    pub fn alloc(ctx: &mut Context) -> Result<*mut ibv_pd> {
        let real = non_null(call_real!(ibv_alloc_pd(ctx.real))?)?;
        crate::vqp::registry::prestart(ctx.real, real);
        Ok(Pd::wrap(ctx, real))
    }

    pub fn import(ctx: &mut Context, handle: u32) -> Result<*mut ibv_pd> {
        let real = non_null(call_real!(ibv_import_pd(ctx.real, handle))?)?;
        Ok(Pd::wrap(ctx, real))
    }

    fn wrap(ctx: &mut Context, real: *mut ibv_pd) -> *mut ibv_pd {
        stats::inc(Stat::KRCORE_STAT_PDS_ALLOCATED);
        // SAFETY: real is a live PD just returned by libibverbs.
        let handle = unsafe { (*real).handle };
        Box::new(Pd { ibv: ibv_pd { context: ctx.as_ibv(), handle }, real }).into_ibv()
    }

    /// # Safety
    /// `p` is a PD of this library.
    pub unsafe fn dealloc(p: *mut ibv_pd) -> Result<()> {
        // SAFETY: caller contract.
        let pd = unsafe { Pd::from_ibv(p) };
        // The VQP runtime's objects and idle cached MRs of this PD would
        // make the real dealloc fail.
        crate::vqp::runtime::release_pd(pd.real)?;
        if let Some(cache) = crate::mr::cache() {
            cache.flush_pd(pd.real);
        }
        ok_or_errno(call_real!(ibv_dealloc_pd(pd.real))?).inspect_err(|e| {
            crate::klog!(crate::log::Level::Debug, "ibv_dealloc_pd: the real verb failed ({e:?}): objects are left on the PD");
        })?;
        // SAFETY: the real PD is gone; nobody may use the wrapper now.
        unsafe { Pd::free(p) };
        Ok(())
    }

    /// # Safety
    /// `p` is a PD of this library.
    pub unsafe fn unimport(p: *mut ibv_pd) -> Result<()> {
        // SAFETY: caller contract.
        let pd = unsafe { Pd::from_ibv(p) };
        if let Some(cache) = crate::mr::cache() {
            cache.flush_pd(pd.real);
        }
        call_real!(ibv_unimport_pd(pd.real))?;
        // SAFETY: as in dealloc.
        unsafe { Pd::free(p) };
        Ok(())
    }
}

#[repr(C)]
pub struct Ah {
    pub ibv: ibv_ah,
    pub real: *mut ibv_ah,
}
wrapper!(Ah, ibv_ah);

impl Ah {
    /// # Safety
    /// Pointer arguments are NULL where the verb allows it, or valid verbs
    /// objects and attribute structs of the caller.
    pub unsafe fn create(pd: &mut Pd, attr: *mut ibv_ah_attr) -> Result<*mut ibv_ah> {
        let real = non_null(call_real!(ibv_create_ah(pd.real, attr))?)?;
        Ok(Ah::wrap(pd, real))
    }

    /// # Safety
    /// Pointer arguments are NULL where the verb allows it, or valid verbs
    /// objects and attribute structs of the caller.
    pub unsafe fn create_from_wc(pd: &mut Pd, wc: *mut ibv_wc, grh: *mut ibv_grh, port: u8) -> Result<*mut ibv_ah> {
        let real = non_null(call_real!(ibv_create_ah_from_wc(pd.real, wc, grh, port))?)?;
        Ok(Ah::wrap(pd, real))
    }

    fn wrap(pd: &mut Pd, real: *mut ibv_ah) -> *mut ibv_ah {
        stats::inc(Stat::KRCORE_STAT_AHS_CREATED);
        // SAFETY: real is a live AH just returned by libibverbs.
        let handle = unsafe { (*real).handle };
        let ibv = ibv_ah { context: pd.ibv.context, pd: pd.as_ibv(), handle };
        Box::new(Ah { ibv, real }).into_ibv()
    }

    /// # Safety
    /// `p` is an AH of this library.
    pub unsafe fn destroy(p: *mut ibv_ah) -> Result<()> {
        // SAFETY: caller contract.
        let ah = unsafe { Ah::from_ibv(p) };
        ok_or_errno(call_real!(ibv_destroy_ah(ah.real))?)?;
        // SAFETY: the real AH is gone.
        unsafe { Ah::free(p) };
        Ok(())
    }
}

#[repr(C)]
pub struct Mw {
    pub ibv: ibv_mw,
    pub real: *mut ibv_mw,
}
wrapper!(Mw, ibv_mw);

impl Mw {
    pub fn alloc(pd: &mut Pd, ty: ibv_mw_type::Type) -> Result<*mut ibv_mw> {
        // SAFETY: pd.ibv.context is our live context.
        let ctx = unsafe { Context::from_ibv(pd.ibv.context) };
        // SAFETY: ctx.real is a live real context.
        let alloc = unsafe { (*ctx.real).ops.alloc_mw }.ok_or(Errno::EOPNOTSUPP)?;
        // SAFETY: real PD of the same real context.
        let real = non_null(unsafe { alloc(pd.real, ty) })?;
        ctx.mws.fetch_add(1, Ordering::Relaxed);
        stats::inc(Stat::KRCORE_STAT_MWS_ALLOCATED);
        // SAFETY: real is a live MW.
        let r = unsafe { &*real };
        let ibv = ibv_mw { context: ctx.as_ibv(), pd: pd.as_ibv(), rkey: r.rkey, handle: r.handle, type_: r.type_ };
        Ok(Box::new(Mw { ibv, real }).into_ibv())
    }

    /// # Safety
    /// `p` is a MW of this library.
    pub unsafe fn dealloc(p: *mut ibv_mw) -> Result<()> {
        // SAFETY: caller contract.
        let mw = unsafe { Mw::from_ibv(p) };
        // SAFETY: the MW's context is our live context.
        let ctx = unsafe { Context::from_ibv(mw.ibv.context) };
        // SAFETY: the real context is live.
        let dealloc = unsafe { (*ctx.real).ops.dealloc_mw }.ok_or(Errno::EOPNOTSUPP)?;
        // SAFETY: real MW of that context.
        ok_or_errno(unsafe { dealloc(mw.real) })?;
        ctx.mws.fetch_sub(1, Ordering::Relaxed);
        // SAFETY: the real MW is gone.
        unsafe { Mw::free(p) };
        Ok(())
    }

    /// `ibv_bind_mw`: translate the QP, the MW and the bound MR.
    ///
    /// # Safety
    /// `qp` is a QP of this library; `bind` is a valid bind request.
    pub unsafe fn bind(&mut self, qp: *mut ibv_qp, real_qp: *mut ibv_qp, bind: *mut ibv_mw_bind) -> Result<()> {
        // SAFETY: our MW's context is our live context.
        let ctx = unsafe { Context::from_ibv(self.ibv.context) };
        // SAFETY: bind is valid (caller contract); copied so the caller's
        // struct keeps its own MR pointer.
        let mut b = unsafe { std::ptr::read(bind) };
        let mr = b.bind_info.mr;
        if !check_owner!(mr, ctx.as_ibv()) || !check_owner!(qp, ctx.as_ibv()) {
            return Err(Errno::EINVAL);
        }
        // A virtual QP (KRCORE_VQP, KRCORE_VIRTUALIZE) has no real QP to
        // post the bind on: memory windows are not offered there.
        if real_qp.is_null() {
            return Err(Errno::EOPNOTSUPP);
        }
        if !mr.is_null() {
            // SAFETY: owned by our context, hence one of our MRs.
            b.bind_info.mr = unsafe { Mr::from_ibv(mr) }.real;
        }
        // SAFETY: the real context is live.
        let bind_fn = unsafe { (*ctx.real).ops.bind_mw }.ok_or(Errno::EOPNOTSUPP)?;
        // SAFETY: all real objects of one real context.
        ok_or_errno(unsafe { bind_fn(real_qp, self.real, &mut b) })?;
        // SAFETY: the provider updated the real MW's rkey.
        self.ibv.rkey = unsafe { (*self.real).rkey };
        Ok(())
    }

    /// The real MW behind `p` when it belongs to `ctx`, else `p` unchanged.
    ///
    /// # Safety
    /// `p` is NULL or a live MW pointer.
    #[inline]
    pub unsafe fn real_or_same(p: *mut ibv_mw, ctx: *mut ibv_context) -> *mut ibv_mw {
        if !p.is_null() && check_owner!(p, ctx) {
            // SAFETY: owned by ctx, hence ours.
            unsafe { Mw::from_ibv(p) }.real
        } else {
            p
        }
    }
}

#[repr(C)]
pub struct Xrcd {
    pub ibv: ibv_xrcd,
    pub real: *mut ibv_xrcd,
}
wrapper!(Xrcd, ibv_xrcd);
real_of!(Xrcd, ibv_xrcd);

impl Xrcd {
    /// # Safety
    /// Pointer arguments are NULL where the verb allows it, or valid verbs
    /// objects and attribute structs of the caller.
    pub unsafe fn open(ctx: &mut Context, attr: *mut ibv_xrcd_init_attr) -> Result<*mut ibv_xrcd> {
        let open = real_ctx_op!(ctx.real, open_xrcd).ok_or(Errno::EOPNOTSUPP)?;
        // SAFETY: real context and the caller's attribute struct.
        let real = non_null(unsafe { open(ctx.real, attr) })?;
        Ok(Box::new(Xrcd { ibv: ibv_xrcd { context: ctx.as_ibv() }, real }).into_ibv())
    }

    /// # Safety
    /// `p` is an XRCD of this library.
    pub unsafe fn close(p: *mut ibv_xrcd) -> Result<()> {
        // SAFETY: caller contract.
        let x = unsafe { Xrcd::from_ibv(p) };
        // SAFETY: our context is live.
        let ctx = unsafe { Context::from_ibv(x.ibv.context) };
        let close = real_ctx_op!(ctx.real, close_xrcd).ok_or(Errno::EOPNOTSUPP)?;
        // SAFETY: the real XRCD.
        ok_or_errno(unsafe { close(x.real) })?;
        // SAFETY: the real XRCD is gone.
        unsafe { Xrcd::free(p) };
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::undocumented_unsafe_blocks)]
mod tests {
    use super::*;
    use crate::obj::zeroed;
    use std::ptr::null_mut;

    #[test]
    fn struct_sizes_match_rdma_core_44() {
        use std::mem::size_of;
        assert_eq!(size_of::<ibv_pd>(), 16);
        assert_eq!(size_of::<ibv_ah>(), 24);
        assert_eq!(size_of::<ibv_mw>(), 32);
        assert_eq!(size_of::<ibv_send_wr>(), 128);
        assert_eq!(size_of::<ibv_recv_wr>(), 32);
        assert_eq!(size_of::<ibv_wc>(), 48);
        assert_eq!(size_of::<ibv_mw_bind>(), 48);
        assert_eq!(std::mem::offset_of!(ibv_send_wr, wr), 40);
        assert_eq!(std::mem::offset_of!(ibv_send_wr, bind_mw_tso_union), 80);
    }

    #[test]
    fn owner_check_tells_wrapped_from_real() {
        let mut ctx_a: ibv_context = unsafe { zeroed() };
        let mut ctx_b: ibv_context = unsafe { zeroed() };
        let mut pd = Pd { ibv: ibv_pd { context: &mut ctx_a, handle: 1 }, real: 0x1000 as *mut ibv_pd };
        let p = pd.as_ibv();
        assert_eq!(unsafe { Pd::real_of(p, &mut ctx_a) }.unwrap() as usize, 0x1000);
        assert_eq!(unsafe { Pd::real_of(p, &mut ctx_b) }.unwrap_err(), Errno::EINVAL);
        assert!(unsafe { Pd::real_of(null_mut(), &mut ctx_b) }.unwrap().is_null());
    }
}
