//! librdmacm's QP creation. Under `KRCORE_VIRTUALIZE`, a QP that librdmacm
//! creates for a connection stays real: the connection's QPN and PSN go
//! through the kernel's CM, which knows nothing of virtual QPs (a
//! virtualized `ib_send_lat -R` was rejected, `RDMA_CM_EVENT_REJECTED`).
//! These exports mark the creation and call librdmacm's own.

use super::boundary;
use super::mem::Next;
use libc::{c_int, c_void};
use std::sync::atomic::AtomicPtr;

static CREATE_QP: Next = Next(AtomicPtr::new(std::ptr::null_mut()), c"rdma_create_qp");
static CREATE_QP_EX: Next = Next(AtomicPtr::new(std::ptr::null_mut()), c"rdma_create_qp_ex");

type CreateQpFn = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_void) -> c_int;
type CreateQpExFn = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;

/// librdmacm's function, or ENOSYS (as errno, -1) without librdmacm.
fn next(n: &Next) -> Option<*mut c_void> {
    let p = n.get();
    if p.is_null() {
        // SAFETY: the thread's errno slot.
        unsafe { *libc::__errno_location() = libc::ENOSYS };
        return None;
    }
    Some(p)
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_qp(id: *mut c_void, pd: *mut c_void, attr: *mut c_void) -> c_int {
    boundary::value("rdma_create_qp", -1, || {
        let Some(f) = next(&CREATE_QP) else { return -1 };
        // SAFETY: librdmacm's rdma_create_qp, with the caller's arguments.
        crate::obj::Qp::created_by_rdmacm(|| unsafe { std::mem::transmute::<*mut c_void, CreateQpFn>(f)(id, pd, attr) })
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_qp_ex(id: *mut c_void, attr: *mut c_void) -> c_int {
    boundary::value("rdma_create_qp_ex", -1, || {
        let Some(f) = next(&CREATE_QP_EX) else { return -1 };
        // SAFETY: librdmacm's rdma_create_qp_ex, with the caller's arguments.
        crate::obj::Qp::created_by_rdmacm(|| unsafe { std::mem::transmute::<*mut c_void, CreateQpExFn>(f)(id, attr) })
    })
}
