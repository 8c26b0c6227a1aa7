//! Address handles.

use super::{boundary, foreign, is_ours, owner};
use crate::error::Errno;
use crate::obj::{Ah, Context, Pd};
use crate::sys::*;
use libc::c_int;

#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    boundary::ptr("ibv_create_ah", || {
        if !owner!(pd)? {
            return foreign!(ibv_create_ah(pd, attr));
        }
        // SAFETY: ours.
        // SAFETY: ours; attr is the caller's.
        unsafe { Ah::create(Pd::from_ibv(pd), attr) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_ah(ah: *mut ibv_ah) -> c_int {
    boundary::errno("ibv_destroy_ah", || {
        if !owner!(ah)? {
            return foreign!(ibv_destroy_ah(ah));
        }
        // SAFETY: ours.
        unsafe { Ah::destroy(ah) }.map(|_| 0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_init_ah_from_wc(
    context: *mut ibv_context,
    port_num: u8,
    wc: *mut ibv_wc,
    grh: *mut ibv_grh,
    ah_attr: *mut ibv_ah_attr,
) -> c_int {
    boundary::minus_one("ibv_init_ah_from_wc", || {
        if context.is_null() {
            return Err(Errno::EINVAL);
        }
        if !is_ours(context) {
            return foreign!(ibv_init_ah_from_wc(context, port_num, wc, grh, ah_attr));
        }
        // SAFETY: ours.
        let real = unsafe { Context::from_ibv(context) }.real;
        crate::call_real!(ibv_init_ah_from_wc(real, port_num, wc, grh, ah_attr))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah_from_wc(pd: *mut ibv_pd, wc: *mut ibv_wc, grh: *mut ibv_grh, port_num: u8) -> *mut ibv_ah {
    boundary::ptr("ibv_create_ah_from_wc", || {
        if !owner!(pd)? {
            return foreign!(ibv_create_ah_from_wc(pd, wc, grh, port_num));
        }
        // SAFETY: ours.
        // SAFETY: ours; wc and grh are the caller's.
        unsafe { Ah::create_from_wc(Pd::from_ibv(pd), wc, grh, port_num) }
    })
}
