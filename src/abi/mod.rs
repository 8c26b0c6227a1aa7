//! The C ABI: every `#[no_mangle]` item of the library lives below.
//!
//! Each export runs inside the panic boundary, decides whether its argument
//! is one of our wrapped objects or a foreign (real) one, and either calls
//! the module that owns the verb or passes the foreign object straight to
//! the real libibverbs (libibverbs, providers and librdmacm call exported
//! `ibv_*` functions through the PLT with real objects).

pub mod boundary;
pub mod ext;
pub mod ops;

mod ah;
mod channel;
mod cq;
mod device;
mod event;
mod mem;
mod mr;
mod pd;
mod qp;
mod rdmacm;
mod srq;
mod util;

use crate::error::{Errno, Result};
use crate::sys::ibv_context;

/// Is `ctx` a context of this library? Ours carry our `post_send` in their
/// ops table; a real context carries its provider's.
#[inline]
pub(crate) fn is_ours(ctx: *const ibv_context) -> bool {
    // SAFETY: a non-NULL context handed to a verb is live.
    !ctx.is_null() && unsafe { (*ctx).ops.post_send }.map(|f| f as *const ()) == Some(ops::post_send as *const ())
}

/// For an object pointer: `Ok(true)` if it belongs to one of our contexts,
/// `Ok(false)` if it is foreign, EINVAL for NULL (libibverbs would crash).
macro_rules! owner {
    ($obj:expr) => {{
        let o = $obj;
        if o.is_null() {
            Err($crate::error::Errno::EINVAL)
        } else {
            // SAFETY: a non-NULL verbs object handed to a verb is live.
            Ok($crate::abi::is_ours(unsafe { (*o).context }))
        }
    }};
}
pub(crate) use owner;

/// Pass a foreign object's call to the real function, counting it.
macro_rules! foreign {
    ($f:ident($($a:expr),* $(,)?)) => {{
        $crate::stats::inc($crate::stats::Stat::KRCORE_STAT_FOREIGN_CALLS);
        $crate::call_real!($f($($a),*))
    }};
}
pub(crate) use foreign;

/// Our context behind an application context (checked non-NULL and ours).
pub(crate) fn ctx_of<'a>(ctx: *mut ibv_context) -> Result<&'a mut crate::obj::Context> {
    if !is_ours(ctx) {
        return Err(Errno::EINVAL);
    }
    // SAFETY: checked to be one of ours.
    Ok(unsafe { crate::obj::Context::from_ibv(ctx) })
}
