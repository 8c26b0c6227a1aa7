//! The QP data path.
//!
//! A pass-through QP is backed one to one by a real QP, and the
//! [`Forwarder`] here posts straight to it. A virtual QP (`KRCORE_VQP`, or
//! an RC QP under `KRCORE_VIRTUALIZE`) is a [`qp::Vqp`]: shared physical
//! QPs (links), pre-checks, wr_id encoding; `rc.rs` is the RC state machine
//! a transparent one plays, `srq.rs` its SRQs, `wr_builder.rs` its
//! `ibv_wr_*` batches.

pub mod api;
pub mod header;
pub mod large;
pub mod memo;
pub mod mrcheck;
pub mod mrs;
pub mod precheck;
pub mod qp;
pub mod queue;
pub mod rc;
pub mod registry;
pub mod runtime;
pub mod srq;
pub mod window;
pub mod wire;
pub mod wr_builder;
pub mod wrid;

use crate::obj::{Ah, Context, Mr, Mw};
use crate::sys::*;
use libc::c_int;
use std::mem::MaybeUninit;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicUsize, Ordering};

pub type PostSendFn = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
pub type PostRecvFn = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

/// Work requests translated per batch on the stack (no allocation).
const CHUNK: usize = 16;

/// Posts to one real QP.
#[repr(C)]
pub struct Forwarder {
    real: *mut ibv_qp,
    post_send: Option<PostSendFn>,
    post_recv: Option<PostRecvFn>,
    /// The wrapped context: objects carrying it are ours and get translated.
    app_ctx: *mut ibv_context,
    /// The context's live memory-window count.
    mws: *const AtomicUsize,
    /// UD send requests carry an AH pointer and always need translation.
    is_ud: bool,
}

static NO_MWS: AtomicUsize = AtomicUsize::new(0);

impl Default for Forwarder {
    fn default() -> Self {
        Forwarder { real: null_mut(), post_send: None, post_recv: None, app_ctx: null_mut(), mws: &NO_MWS, is_ud: false }
    }
}

impl Forwarder {
    /// # Safety
    /// `real` is a live real QP of `ctx.real`, and `ctx` outlives the QP.
    pub unsafe fn new(real: *mut ibv_qp, ctx: &mut Context) -> Forwarder {
        // SAFETY: real and its context are live (caller contract).
        let (ops, qp_type) = unsafe { (&(*(*real).context).ops, (*real).qp_type) };
        Forwarder {
            real,
            post_send: ops.post_send,
            post_recv: ops.post_recv,
            app_ctx: ctx.as_ibv(),
            mws: &ctx.mws,
            is_ud: qp_type == ibv_qp_type::IBV_QPT_UD,
        }
    }

    /// `ibv_post_send`.
    ///
    /// # Safety
    /// `wr` is a valid list of work requests, `bad` valid for writes.
    #[inline]
    pub unsafe fn post_send(&self, wr: *mut ibv_send_wr, bad: *mut *mut ibv_send_wr) -> c_int {
        let Some(post) = self.post_send else {
            // SAFETY: bad is valid for writes (caller contract).
            unsafe { *bad = wr };
            return libc::EOPNOTSUPP;
        };
        // SAFETY: mws points into our live context (or the static zero).
        // Relaxed: a racing ibv_alloc_mw cannot be used by a WR posted
        // before the allocation returned in the posting thread.
        if !self.is_ud && unsafe { (*self.mws).load(Ordering::Relaxed) } == 0 {
            // SAFETY: a list without AH or MW pointers is valid as is.
            return unsafe { post(self.real, wr, bad) };
        }
        // SAFETY: caller contract.
        unsafe { self.post_send_translated(post, wr, bad) }
    }

    /// Copy WRs in chunks, replacing our AH/MW/MR pointers by the real ones.
    /// Semantics match one post: on error nothing after `*bad` is posted.
    #[cold]
    unsafe fn post_send_translated(&self, post: PostSendFn, wr: *mut ibv_send_wr, bad: *mut *mut ibv_send_wr) -> c_int {
        let mut copies: [MaybeUninit<ibv_send_wr>; CHUNK] = [const { MaybeUninit::uninit() }; CHUNK];
        let mut origin: [*mut ibv_send_wr; CHUNK] = [null_mut(); CHUNK];
        let mut cur = wr;
        while !cur.is_null() {
            let mut n = 0;
            while n < CHUNK && !cur.is_null() {
                // SAFETY: cur is a valid WR of the caller's list; a bitwise
                // copy of a C struct.
                let mut c = unsafe { std::ptr::read(cur) };
                // SAFETY: the pointers inside are the caller's live objects.
                unsafe { self.translate(&mut c) };
                c.next = null_mut();
                copies[n].write(c);
                origin[n] = cur;
                // SAFETY: as above.
                cur = unsafe { (*cur).next };
                n += 1;
            }
            for i in 1..n {
                let next = copies[i].as_mut_ptr();
                // SAFETY: copies[..n] are initialised.
                unsafe { (*copies[i - 1].as_mut_ptr()).next = next };
            }
            let mut real_bad: *mut ibv_send_wr = null_mut();
            // SAFETY: a valid, translated list of n WRs.
            let rc = unsafe { post(self.real, copies[0].as_mut_ptr(), &mut real_bad) };
            if rc != 0 {
                let base = copies.as_ptr() as usize;
                let idx = (real_bad as usize).wrapping_sub(base) / std::mem::size_of::<ibv_send_wr>();
                // SAFETY: bad is valid for writes (caller contract).
                unsafe { *bad = if idx < n { origin[idx] } else { origin[0] } };
                return rc;
            }
        }
        0
    }

    /// # Safety
    /// The object pointers in `wr` are NULL or live.
    unsafe fn translate(&self, wr: &mut ibv_send_wr) {
        let ctx = self.app_ctx;
        if self.is_ud {
            // SAFETY: UD requests use the `ud` member of the union.
            let ah = unsafe { wr.wr.ud.ah };
            // SAFETY: a live AH pointer from the application.
            if !ah.is_null() && unsafe { (*ah).context } == ctx {
                // SAFETY: carries our context, hence our AH.
                wr.wr.ud.ah = unsafe { Ah::from_ibv(ah) }.real;
            }
        }
        if wr.opcode == ibv_wr_opcode::IBV_WR_BIND_MW {
            // SAFETY: BIND_MW requests use the `bind_mw` member.
            let b = unsafe { &mut wr.bind_mw_tso_union.bind_mw };
            // SAFETY: live objects from the application.
            unsafe {
                b.mw = Mw::real_or_same(b.mw, ctx);
                let mr = b.bind_info.mr;
                if !mr.is_null() && (*mr).context == ctx {
                    b.bind_info.mr = Mr::from_ibv(mr).real;
                }
            }
        }
    }

    /// `ibv_post_recv`.
    ///
    /// # Safety
    /// `wr` is a valid list, `bad` valid for writes.
    #[inline]
    pub unsafe fn post_recv(&self, wr: *mut ibv_recv_wr, bad: *mut *mut ibv_recv_wr) -> c_int {
        match self.post_recv {
            // SAFETY: receive WRs hold no object pointers.
            Some(post) => unsafe { post(self.real, wr, bad) },
            None => {
                // SAFETY: bad valid (caller contract).
                unsafe { *bad = wr };
                libc::EOPNOTSUPP
            }
        }
    }
}

// The forwarder is only read after creation; its pointers are to objects
// that libibverbs allows to be used from any thread.
// SAFETY: see above.
unsafe impl Send for Forwarder {}
// SAFETY: see above.
unsafe impl Sync for Forwarder {}

#[cfg(test)]
#[allow(clippy::undocumented_unsafe_blocks)]
mod tests {
    use super::*;
    use crate::obj::{zeroed, Ah};
    use std::cell::RefCell;

    thread_local! {
        /// (wr_id, ah) of every WR the fake provider saw.
        static SEEN: RefCell<Vec<(u64, usize)>> = const { RefCell::new(Vec::new()) };
        static FAIL_WR_ID: RefCell<u64> = const { RefCell::new(u64::MAX) };
    }

    /// A provider post_send that records WRs and rejects one wr_id.
    unsafe extern "C" fn fake_post(_qp: *mut ibv_qp, wr: *mut ibv_send_wr, bad: *mut *mut ibv_send_wr) -> c_int {
        let mut cur = wr;
        while !cur.is_null() {
            let w = unsafe { &*cur };
            if w.wr_id == FAIL_WR_ID.with(|f| *f.borrow()) {
                unsafe { *bad = cur };
                return libc::EINVAL;
            }
            SEEN.with(|s| s.borrow_mut().push((w.wr_id, unsafe { w.wr.ud.ah } as usize)));
            cur = w.next;
        }
        0
    }

    struct Fixture {
        real_ctx: Box<ibv_context>,
        real_qp: Box<ibv_qp>,
        ctx: Box<Context>,
    }

    fn fixture(qp_type: ibv_qp_type::Type) -> Fixture {
        let mut real_ctx: Box<ibv_context> = Box::new(unsafe { zeroed() });
        real_ctx.ops.post_send = Some(fake_post);
        let mut real_qp: Box<ibv_qp> = Box::new(unsafe { zeroed() });
        real_qp.context = &mut *real_ctx;
        real_qp.qp_type = qp_type;
        let ctx = unsafe { Context::new(&mut *real_ctx) };
        Fixture { real_ctx, real_qp, ctx }
    }

    fn chain(wrs: &mut [ibv_send_wr]) {
        for i in 0..wrs.len() {
            wrs[i].next = if i + 1 < wrs.len() { &mut wrs[i + 1] } else { null_mut() };
        }
    }

    #[test]
    fn ud_ahs_are_translated_across_chunks_and_bad_wr_maps_back() {
        let mut f = fixture(ibv_qp_type::IBV_QPT_UD);
        let fwd = unsafe { Forwarder::new(&mut *f.real_qp, &mut f.ctx) };
        let real_ah = 0xa11 as *mut ibv_ah;
        let mut ah = Ah { ibv: ibv_ah { context: f.ctx.as_ibv(), pd: null_mut(), handle: 0 }, real: real_ah };
        let n = CHUNK + 4;
        let mut wrs: Vec<ibv_send_wr> = (0..n).map(|_| unsafe { zeroed() }).collect();
        for (i, w) in wrs.iter_mut().enumerate() {
            w.wr_id = i as u64;
            w.wr.ud.ah = ah.as_ibv();
        }
        chain(&mut wrs);
        SEEN.with(|s| s.borrow_mut().clear());
        FAIL_WR_ID.with(|x| *x.borrow_mut() = (CHUNK + 2) as u64);
        let mut bad = null_mut();
        let rc = unsafe { fwd.post_send(&mut wrs[0], &mut bad) };
        assert_eq!(rc, libc::EINVAL);
        assert_eq!(bad, &mut wrs[CHUNK + 2] as *mut _, "bad_wr must name the caller's WR");
        let seen = SEEN.with(|s| s.borrow().clone());
        assert_eq!(seen.len(), CHUNK + 2, "everything before the bad WR is posted");
        assert!(seen.iter().enumerate().all(|(i, &(id, a))| id == i as u64 && a == real_ah as usize));
        // The caller's list is untouched.
        assert_eq!(unsafe { wrs[0].wr.ud.ah }, ah.as_ibv());
        let _ = (&f.real_ctx,);
    }

    #[test]
    fn rc_without_memory_windows_posts_the_callers_list_directly() {
        let mut f = fixture(ibv_qp_type::IBV_QPT_RC);
        let fwd = unsafe { Forwarder::new(&mut *f.real_qp, &mut f.ctx) };
        let mut wrs: Vec<ibv_send_wr> = (0..3).map(|_| unsafe { zeroed() }).collect();
        for (i, w) in wrs.iter_mut().enumerate() {
            w.wr_id = 100 + i as u64;
        }
        chain(&mut wrs);
        FAIL_WR_ID.with(|x| *x.borrow_mut() = 101);
        let mut bad = null_mut();
        assert_eq!(unsafe { fwd.post_send(&mut wrs[0], &mut bad) }, libc::EINVAL);
        assert_eq!(bad, &mut wrs[1] as *mut _);
    }

    #[test]
    fn missing_provider_op_reports_eopnotsupp_and_bad_wr() {
        let fwd = Forwarder::default();
        let mut wr: ibv_send_wr = unsafe { zeroed() };
        let mut bad = null_mut();
        assert_eq!(unsafe { fwd.post_send(&mut wr, &mut bad) }, libc::EOPNOTSUPP);
        assert_eq!(bad, &mut wr as *mut _);
    }
}
