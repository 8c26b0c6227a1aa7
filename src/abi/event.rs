//! Asynchronous events: the real event names real QPs/CQs/SRQs, whose user
//! context slot holds our wrapper; the application gets its own pointers,
//! and the acknowledgement translates them back.

use super::{boundary, foreign, is_ours};
use crate::error::Errno;
use crate::obj::{Context, Cq, Qp, Srq};
use crate::stats::{self, Stat};
use crate::sys::*;
use libc::{c_int, c_void};

/// `struct ibv_async_event` read with a plain integer type, so an event
/// type newer than our headers is not undefined behaviour.
#[repr(C)]
struct RawEvent {
    element: *mut c_void,
    event_type: u32,
}

#[derive(PartialEq)]
enum Element {
    Qp,
    Cq,
    Srq,
    Other,
}

fn element_of(ty: u32) -> Element {
    use ibv_event_type::*;
    const QP: [ibv_event_type; 8] = [
        IBV_EVENT_QP_FATAL,
        IBV_EVENT_QP_REQ_ERR,
        IBV_EVENT_QP_ACCESS_ERR,
        IBV_EVENT_COMM_EST,
        IBV_EVENT_SQ_DRAINED,
        IBV_EVENT_PATH_MIG,
        IBV_EVENT_PATH_MIG_ERR,
        IBV_EVENT_QP_LAST_WQE_REACHED,
    ];
    if QP.iter().any(|t| *t as u32 == ty) {
        Element::Qp
    } else if ty == IBV_EVENT_CQ_ERR as u32 {
        Element::Cq
    } else if ty == IBV_EVENT_SRQ_ERR as u32 || ty == IBV_EVENT_SRQ_LIMIT_REACHED as u32 {
        Element::Srq
    } else {
        Element::Other
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_async_event(context: *mut ibv_context, event: *mut ibv_async_event) -> c_int {
    boundary::minus_one("ibv_get_async_event", || {
        if context.is_null() || event.is_null() {
            return Err(Errno::EINVAL);
        }
        if !is_ours(context) {
            return foreign!(ibv_get_async_event(context, event));
        }
        // SAFETY: ours.
        let real = unsafe { Context::from_ibv(context) }.real;
        let rc = crate::call_real!(ibv_get_async_event(real, event))?;
        if rc != 0 {
            return Ok(rc);
        }
        stats::inc(Stat::KRCORE_STAT_ASYNC_EVENTS);
        let ev = event.cast::<RawEvent>();
        // SAFETY: the real library filled the event; the element's user
        // context slot is our wrapper (set when we created it).
        unsafe {
            let e = (*ev).element;
            (*ev).element = match element_of((*ev).event_type) {
                Element::Qp => (*e.cast::<ibv_qp>()).qp_context,
                Element::Cq => (*e.cast::<ibv_cq>()).cq_context,
                Element::Srq => (*e.cast::<ibv_srq>()).srq_context,
                Element::Other => e,
            };
        }
        Ok(0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_ack_async_event(event: *mut ibv_async_event) {
    boundary::void("ibv_ack_async_event", || {
        if event.is_null() {
            return Err(Errno::EINVAL);
        }
        // SAFETY: the caller's event, as returned by ibv_get_async_event.
        let raw = unsafe { &*event.cast::<RawEvent>() };
        let kind = element_of(raw.event_type);
        let e = raw.element;
        // SAFETY: QP/CQ/SRQ events name a live object; its context tells
        // whether it is one of ours.
        let ours = kind != Element::Other && !e.is_null() && is_ours(unsafe { *e.cast::<*mut ibv_context>() });
        if !ours {
            return foreign!(ibv_ack_async_event(event));
        }
        // SAFETY: ours: map to the real object in a copy, keep the caller's.
        let real: *mut c_void = unsafe {
            match kind {
                Element::Qp => Qp::from_qp(e.cast()).real.cast(),
                Element::Cq => Cq::from_cq(e.cast()).real.cast(),
                _ => Srq::from_ibv(e.cast()).real.cast(),
            }
        };
        let mut copy = RawEvent { element: real, event_type: raw.event_type };
        crate::call_real!(ibv_ack_async_event((&mut copy as *mut RawEvent).cast()))
    })
}
