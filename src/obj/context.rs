//! The device context: a full `verbs_context` (with `abi_compat` and `sz`)
//! so that verbs.h's inline `verbs_get_ctx_op()` finds our extended ops.

use super::zeroed;
use crate::sys::*;
use std::mem::offset_of;
use std::sync::atomic::AtomicUsize;

#[repr(C)]
pub struct Context {
    /// What verbs.h sees; the application's `ibv_context *` is `vctx.context`,
    /// the last field.
    pub vctx: verbs_context,
    /// The real context.
    pub real: *mut ibv_context,
    /// Live memory windows: while zero, `post_send` on RC/UC QPs skips the
    /// scan for `IBV_WR_BIND_MW` requests that need pointer translation.
    pub mws: AtomicUsize,
}

const CTX_OFFSET: usize = offset_of!(Context, vctx) + offset_of!(verbs_context, context);

impl Context {
    /// A new wrapper around a real context; ops are installed by the ABI layer.
    ///
    /// # Safety
    /// `real` must be a live context of the real libibverbs.
    pub unsafe fn new(real: *mut ibv_context) -> Box<Context> {
        // SAFETY: verbs_context is plain C data; all-zero is valid.
        let mut vctx: verbs_context = unsafe { zeroed() };
        vctx.sz = std::mem::size_of::<verbs_context>();
        // SAFETY: real is live (caller contract).
        let r = unsafe { &*real };
        let c = &mut vctx.context;
        c.device = r.device;
        c.cmd_fd = r.cmd_fd;
        c.async_fd = r.async_fd;
        c.num_comp_vectors = r.num_comp_vectors;
        c.abi_compat = usize::MAX as *mut libc::c_void;
        Box::new(Context { vctx, real, mws: AtomicUsize::new(0) })
    }

    /// The wrapper behind an application context pointer.
    ///
    /// # Safety
    /// `p` must be a context handed out by this library.
    #[inline(always)]
    pub unsafe fn from_ibv<'a>(p: *mut ibv_context) -> &'a mut Context {
        // SAFETY: p points at vctx.context inside a live Context.
        unsafe { &mut *p.cast::<u8>().sub(CTX_OFFSET).cast::<Context>() }
    }

    #[inline(always)]
    pub fn as_ibv(&mut self) -> *mut ibv_context {
        &mut self.vctx.context
    }

    pub fn into_ibv(self: Box<Self>) -> *mut ibv_context {
        let p = Box::into_raw(self);
        // SAFETY: p is a valid, uniquely owned Context.
        unsafe { &mut (*p).vctx.context }
    }

    /// # Safety
    /// `p` came from `into_ibv` and is not used afterwards.
    pub unsafe fn free(p: *mut ibv_context) {
        // SAFETY: caller contract; from_ibv recovers the Box's pointer.
        drop(unsafe { Box::from_raw(Context::from_ibv(p) as *mut Context) });
    }
}

#[cfg(test)]
#[allow(clippy::undocumented_unsafe_blocks)]
mod tests {
    use super::*;

    #[test]
    fn context_is_last_and_sizes_match_rdma_core_44() {
        // verbs.h requires `context` to be the last field of verbs_context.
        assert_eq!(offset_of!(verbs_context, context) + std::mem::size_of::<ibv_context>(), std::mem::size_of::<verbs_context>());
        assert_eq!(std::mem::size_of::<verbs_context>(), 648);
        assert_eq!(std::mem::size_of::<ibv_context>(), 328);
    }

    #[test]
    fn from_ibv_round_trips() {
        let mut real: ibv_context = unsafe { zeroed() };
        real.cmd_fd = 7;
        real.async_fd = 8;
        let p = unsafe { Context::new(&mut real) }.into_ibv();
        let c = unsafe { Context::from_ibv(p) };
        assert_eq!(c.real, &mut real as *mut _);
        assert_eq!(unsafe { (*p).async_fd }, 8);
        assert_eq!(unsafe { (*p).abi_compat } as usize, usize::MAX);
        unsafe { Context::free(p) };
    }
}
