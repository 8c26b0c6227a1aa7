//! The extended verbs (`qbind`, `qconnect`, `qpop_msgs`) behind the C ABI
//! in `abi/ext.rs`.

use crate::error::{Errno, Result};
use crate::obj::Qp;
use crate::sys::*;
use libc::c_int;

/// The VQP behind an application QP pointer (EINVAL for NULL or a QP that
/// is not virtual).
///
/// # Safety
/// `qp` is NULL or a QP of this library.
unsafe fn vqp_of<'a>(qp: *mut ibv_qp) -> Result<&'a std::sync::Arc<super::qp::Vqp>> {
    if qp.is_null() {
        return Err(Errno::EINVAL);
    }
    // SAFETY: caller contract.
    unsafe { Qp::from_qp(qp) }.vqp.as_ref().ok_or(Errno::EINVAL)
}

fn port_of(port: c_int) -> Result<u32> {
    u32::try_from(port).map_err(|_| Errno::EINVAL)
}

/// # Safety
/// `qp` is NULL or a QP of this library.
pub unsafe fn qbind(qp: *mut ibv_qp, gid: [u8; 16], port: c_int) -> Result<c_int> {
    // SAFETY: caller contract.
    let v = unsafe { vqp_of(qp) }?;
    v.bind(gid, port_of(port)?)?;
    // SAFETY: as above.
    unsafe { (*qp).state = ibv_qp_state::IBV_QPS_RTS };
    Ok(0)
}

/// # Safety
/// `qp` is NULL or a QP of this library.
pub unsafe fn qconnect(qp: *mut ibv_qp, gid: [u8; 16], port: c_int) -> Result<c_int> {
    // SAFETY: caller contract.
    let v = unsafe { vqp_of(qp) }?;
    crate::kmark!("qconnect: start (port {port})");
    let r = v.connect(gid, port_of(port)?);
    crate::kmark!("qconnect: done ({:?})", r.as_ref().err());
    r?;
    // SAFETY: as above.
    unsafe { (*qp).state = ibv_qp_state::IBV_QPS_RTS };
    Ok(0)
}

/// # Safety
/// `qp` is NULL or a QP of this library; `src_qp` and `wc` hold
/// `num_entries` entries.
pub unsafe fn qpop_msgs(qp: *mut ibv_qp, num_entries: c_int, src_qp: *mut *mut ibv_qp, wc: *mut ibv_wc) -> c_int {
    let r = (|| {
        // SAFETY: caller contract.
        let v = unsafe { vqp_of(qp) }?;
        if num_entries < 0 || (num_entries > 0 && (src_qp.is_null() || wc.is_null())) {
            return Err(Errno::EINVAL);
        }
        // SAFETY: as above.
        let ctx = unsafe { (*qp).qp_context };
        let msgs = v.pop_msgs(num_entries as usize, &|src| Ok(Qp::wrap_virtual(std::sync::Arc::clone(src), ctx)), &|src| {
            // SAFETY: a src_qp the library made, alive until destroyed here.
            if unsafe { vqp_of(src) }.is_ok_and(|s| s.sends_outstanding()) {
                return false;
            }
            // SAFETY: as above; no longer handed out.
            let _ = unsafe { Qp::destroy(src) };
            true
        })?;
        for (i, (q, w)) in msgs.iter().enumerate() {
            // SAFETY: both arrays hold num_entries >= msgs.len() entries.
            unsafe {
                *src_qp.add(i) = *q;
                std::ptr::write(wc.add(i), std::ptr::read(w));
            }
        }
        Ok(msgs.len() as c_int)
    })();
    r.unwrap_or_else(|e| -e.0)
}
