//! Memory regions.

use super::{boundary, foreign, owner};
use crate::error::Errno;
use crate::obj::mr::{RegKind, REREG_ERR_INPUT as IBV_REREG_MR_ERR_INPUT};
use crate::obj::{Mr, Pd};
use crate::sys::*;
use libc::{c_int, c_uint, c_void};

/// Register on one of our PDs, or pass a foreign PD through.
fn reg(name: &str, pd: *mut ibv_pd, kind: RegKind, foreign_call: impl FnOnce() -> crate::error::Result<*mut ibv_mr>) -> *mut ibv_mr {
    boundary::ptr(name, || {
        if !owner!(pd)? {
            return foreign_call();
        }
        // SAFETY: ours.
        Mr::register(unsafe { Pd::from_ibv(pd) }, kind)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr(pd: *mut ibv_pd, addr: *mut c_void, length: usize, access: c_int) -> *mut ibv_mr {
    reg("ibv_reg_mr", pd, RegKind::Plain { addr, length, access }, || foreign!(ibv_reg_mr(pd, addr, length, access)))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova(pd: *mut ibv_pd, addr: *mut c_void, length: usize, iova: u64, access: c_int) -> *mut ibv_mr {
    reg("ibv_reg_mr_iova", pd, RegKind::Iova { addr, length, iova, access }, || foreign!(ibv_reg_mr_iova(pd, addr, length, iova, access)))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova2(pd: *mut ibv_pd, addr: *mut c_void, length: usize, iova: u64, access: c_uint) -> *mut ibv_mr {
    reg("ibv_reg_mr_iova2", pd, RegKind::Iova2 { addr, length, iova, access }, || {
        foreign!(ibv_reg_mr_iova2(pd, addr, length, iova, access))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_dmabuf_mr(
    pd: *mut ibv_pd,
    offset: u64,
    length: usize,
    iova: u64,
    fd: c_int,
    access: c_int,
) -> *mut ibv_mr {
    reg("ibv_reg_dmabuf_mr", pd, RegKind::Dmabuf { offset, length, iova, fd, access }, || {
        foreign!(ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_import_mr(pd: *mut ibv_pd, mr_handle: u32) -> *mut ibv_mr {
    reg("ibv_import_mr", pd, RegKind::Import { handle: mr_handle }, || foreign!(ibv_import_mr(pd, mr_handle)))
}

/// Returns 0 or an `enum ibv_rereg_mr_err_code` (negative) with errno set,
/// like libibverbs.
#[no_mangle]
pub unsafe extern "C" fn ibv_rereg_mr(
    mr: *mut ibv_mr,
    flags: c_int,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> c_int {
    boundary::value("ibv_rereg_mr", IBV_REREG_MR_ERR_INPUT, || {
        let ours = match owner!(mr) {
            Ok(o) => o,
            Err(e) => {
                e.set();
                return IBV_REREG_MR_ERR_INPUT;
            }
        };
        if !ours {
            return foreign!(ibv_rereg_mr(mr, flags, pd, addr, length, access)).unwrap_or(IBV_REREG_MR_ERR_INPUT);
        }
        // SAFETY: ours.
        let m = unsafe { Mr::from_ibv(mr) };
        // The PD matters only with CHANGE_PD; a NULL one goes to the provider
        // as it would without the library. Another context's PD (or a
        // foreign one) cannot be translated.
        let change_pd = flags as u32 & ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_PD.0 != 0;
        // SAFETY: a non-NULL PD from the caller is live.
        if change_pd && !pd.is_null() && unsafe { (*pd).context } != m.ibv.context {
            Errno::EINVAL.set();
            return IBV_REREG_MR_ERR_INPUT;
        }
        // SAFETY: ours; pd checked to be ours, of the same context, when used.
        match unsafe { m.rereg(flags, pd, addr, length, access) } {
            Ok(()) => 0,
            Err(rc) => rc,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    boundary::errno("ibv_dereg_mr", || {
        if !owner!(mr)? {
            return foreign!(ibv_dereg_mr(mr));
        }
        // SAFETY: ours.
        unsafe { Mr::dereg(mr) }.map(|_| 0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_mr(mr: *mut ibv_mr) {
    boundary::void("ibv_unimport_mr", || {
        if !owner!(mr)? {
            return foreign!(ibv_unimport_mr(mr));
        }
        // SAFETY: ours.
        unsafe { Mr::unimport(mr) }
    })
}
