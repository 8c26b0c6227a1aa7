//! Shared receive queues (post_srq_recv is in ops.rs).

use super::{boundary, foreign, owner};
use crate::error::Errno;
use crate::obj::{Pd, Srq};
use crate::sys::*;
use libc::c_int;

#[no_mangle]
pub unsafe extern "C" fn ibv_create_srq(pd: *mut ibv_pd, attr: *mut ibv_srq_init_attr) -> *mut ibv_srq {
    boundary::ptr("ibv_create_srq", || {
        if !owner!(pd)? {
            return foreign!(ibv_create_srq(pd, attr));
        }
        if attr.is_null() {
            return Err(Errno::EINVAL);
        }
        // SAFETY: ours.
        // SAFETY: ours; attr is the caller's, non-NULL.
        unsafe { Srq::create(Pd::from_ibv(pd), attr) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_modify_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr, attr_mask: c_int) -> c_int {
    boundary::errno("ibv_modify_srq", || {
        if !owner!(srq)? {
            return foreign!(ibv_modify_srq(srq, attr, attr_mask));
        }
        // SAFETY: ours.
        unsafe { Srq::from_ibv(srq).modify(attr, attr_mask) }.map(|_| 0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    boundary::errno("ibv_query_srq", || {
        if !owner!(srq)? {
            return foreign!(ibv_query_srq(srq, attr));
        }
        // SAFETY: ours.
        unsafe { Srq::from_ibv(srq).query(attr) }.map(|_| 0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_srq(srq: *mut ibv_srq) -> c_int {
    boundary::errno("ibv_destroy_srq", || {
        if !owner!(srq)? {
            return foreign!(ibv_destroy_srq(srq));
        }
        // SAFETY: ours.
        unsafe { Srq::destroy(srq) }.map(|_| 0)
    })
}
