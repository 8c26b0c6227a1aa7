//! Completion queues (the data-path ops are in ops.rs).

use super::{boundary, ctx_of, foreign, is_ours, owner};
use crate::obj::Cq;
use crate::sys::*;
use libc::{c_int, c_void};

#[no_mangle]
pub unsafe extern "C" fn ibv_create_cq(
    context: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    boundary::ptr("ibv_create_cq", || {
        if !context.is_null() && !is_ours(context) {
            return foreign!(ibv_create_cq(context, cqe, cq_context, channel, comp_vector));
        }
        // SAFETY: channel is NULL or the caller's channel.
        unsafe { Cq::create(ctx_of(context)?, cqe, cq_context, channel, comp_vector) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_resize_cq(cq: *mut ibv_cq, cqe: c_int) -> c_int {
    boundary::errno("ibv_resize_cq", || {
        if !owner!(cq)? {
            return foreign!(ibv_resize_cq(cq, cqe));
        }
        // SAFETY: ours.
        unsafe { Cq::from_cq(cq) }.resize(cqe).map(|_| 0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    boundary::errno("ibv_destroy_cq", || {
        if !owner!(cq)? {
            return foreign!(ibv_destroy_cq(cq));
        }
        // SAFETY: ours.
        unsafe { Cq::destroy(cq) }.map(|_| 0)
    })
}
