//! Completion channels and completion events.

use super::{boundary, ctx_of, foreign, is_ours, owner};
use crate::obj::{CompChannel, Cq};
use crate::sys::*;
use libc::{c_int, c_uint, c_void};

#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(context: *mut ibv_context) -> *mut ibv_comp_channel {
    boundary::ptr("ibv_create_comp_channel", || {
        if !context.is_null() && !is_ours(context) {
            return foreign!(ibv_create_comp_channel(context));
        }
        CompChannel::create(ctx_of(context)?)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(channel: *mut ibv_comp_channel) -> c_int {
    boundary::errno("ibv_destroy_comp_channel", || {
        if !owner!(channel)? {
            return foreign!(ibv_destroy_comp_channel(channel));
        }
        // SAFETY: ours.
        unsafe { CompChannel::destroy(channel) }.map(|_| 0)
    })
}

/// Returns the application's CQ and its `cq_context`.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_cq_event(channel: *mut ibv_comp_channel, cq: *mut *mut ibv_cq, cq_context: *mut *mut c_void) -> c_int {
    boundary::minus_one("ibv_get_cq_event", || {
        if !owner!(channel)? {
            return foreign!(ibv_get_cq_event(channel, cq, cq_context));
        }
        // SAFETY: ours; out pointers are the caller's.
        Ok(unsafe { CompChannel::from_ibv(channel).get_cq_event(cq, cq_context) })
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, nevents: c_uint) {
    boundary::void("ibv_ack_cq_events", || {
        if !owner!(cq)? {
            return foreign!(ibv_ack_cq_events(cq, nevents));
        }
        // SAFETY: ours.
        unsafe { Cq::from_cq(cq) }.ack_events(nevents)
    })
}
