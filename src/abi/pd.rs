//! Protection domains.

use super::{boundary, ctx_of, foreign, is_ours, owner};
use crate::obj::Pd;
use crate::sys::*;
use libc::c_int;

#[no_mangle]
pub unsafe extern "C" fn ibv_alloc_pd(context: *mut ibv_context) -> *mut ibv_pd {
    boundary::ptr("ibv_alloc_pd", || {
        if !context.is_null() && !is_ours(context) {
            return foreign!(ibv_alloc_pd(context));
        }
        Pd::alloc(ctx_of(context)?)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    boundary::errno("ibv_dealloc_pd", || {
        if !owner!(pd)? {
            return foreign!(ibv_dealloc_pd(pd));
        }
        // SAFETY: ours.
        unsafe { Pd::dealloc(pd) }.map(|_| 0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_import_pd(context: *mut ibv_context, pd_handle: u32) -> *mut ibv_pd {
    boundary::ptr("ibv_import_pd", || {
        if !context.is_null() && !is_ours(context) {
            return foreign!(ibv_import_pd(context, pd_handle));
        }
        Pd::import(ctx_of(context)?, pd_handle)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_pd(pd: *mut ibv_pd) {
    boundary::void("ibv_unimport_pd", || {
        if !owner!(pd)? {
            return foreign!(ibv_unimport_pd(pd));
        }
        // SAFETY: ours.
        unsafe { Pd::unimport(pd) }
    })
}
