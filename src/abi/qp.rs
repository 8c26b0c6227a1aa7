//! Queue pairs (the data-path ops are in ops.rs).

use super::{boundary, foreign, owner};
use crate::error::Errno;
use crate::obj::{Pd, Qp};
use crate::sys::*;
use libc::{c_int, c_uint};

#[no_mangle]
pub unsafe extern "C" fn ibv_create_qp(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    boundary::ptr("ibv_create_qp", || {
        if !owner!(pd)? {
            return foreign!(ibv_create_qp(pd, attr));
        }
        if attr.is_null() {
            return Err(Errno::EINVAL);
        }
        // SAFETY: ours.
        // SAFETY: ours; attr is the caller's, non-NULL.
        unsafe { Qp::create(Pd::from_ibv(pd), attr) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, attr_mask: c_int) -> c_int {
    boundary::errno("ibv_modify_qp", || {
        if !owner!(qp)? {
            return foreign!(ibv_modify_qp(qp, attr, attr_mask));
        }
        // SAFETY: ours; attr is the caller's.
        unsafe { Qp::from_qp(qp).modify(attr, attr_mask) }.map(|_| 0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    attr_mask: c_int,
    init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    boundary::errno("ibv_query_qp", || {
        if !owner!(qp)? {
            return foreign!(ibv_query_qp(qp, attr, attr_mask, init_attr));
        }
        // SAFETY: ours; attr and init_attr are the caller's.
        unsafe { Qp::from_qp(qp).query(attr, attr_mask, init_attr) }.map(|_| 0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    boundary::errno("ibv_destroy_qp", || {
        if !owner!(qp)? {
            return foreign!(ibv_destroy_qp(qp));
        }
        // SAFETY: ours.
        unsafe { Qp::destroy(qp) }.map(|_| 0)
    })
}

/// NULL (no errno change) unless the QP was created with send-ops flags.
#[no_mangle]
pub unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut ibv_qp) -> *mut ibv_qp_ex {
    boundary::ptr("ibv_qp_to_qp_ex", || {
        if !owner!(qp)? {
            return foreign!(ibv_qp_to_qp_ex(qp));
        }
        // SAFETY: ours.
        Ok(unsafe { Qp::from_qp(qp) }.to_qp_ex())
    })
}

/// The real QP behind `qp` (ours or foreign).
fn real_qp(qp: *mut ibv_qp) -> crate::error::Result<*mut ibv_qp> {
    if owner!(qp)? {
        // SAFETY: ours.
        let real = unsafe { Qp::from_qp(qp) }.real;
        // A virtual QP has no real one: what needs it is not offered (as
        // by a provider without it).
        if real.is_null() {
            return Err(crate::error::Errno::EOPNOTSUPP);
        }
        Ok(real)
    } else {
        crate::stats::inc(crate::stats::Stat::KRCORE_STAT_FOREIGN_CALLS);
        Ok(qp)
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_ece(qp: *mut ibv_qp, ece: *mut ibv_ece) -> c_int {
    boundary::errno("ibv_query_ece", || crate::call_real!(ibv_query_ece(real_qp(qp)?, ece)))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_set_ece(qp: *mut ibv_qp, ece: *mut ibv_ece) -> c_int {
    boundary::errno("ibv_set_ece", || crate::call_real!(ibv_set_ece(real_qp(qp)?, ece)))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp_data_in_order(qp: *mut ibv_qp, op: c_uint, flags: u32) -> c_int {
    boundary::value("ibv_query_qp_data_in_order", 0, || {
        real_qp(qp).and_then(|q| crate::call_real!(ibv_query_qp_data_in_order(q, op, flags))).unwrap_or(0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_attach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) -> c_int {
    boundary::errno("ibv_attach_mcast", || crate::call_real!(ibv_attach_mcast(real_qp(qp)?, gid, lid)))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_detach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) -> c_int {
    boundary::errno("ibv_detach_mcast", || crate::call_real!(ibv_detach_mcast(real_qp(qp)?, gid, lid)))
}
