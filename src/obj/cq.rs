//! Completion queues and completion channels.
//!
//! Every CQ wrapper embeds a full `ibv_cq_ex` (an `ibv_cq` is its prefix);
//! the real CQ's `cq_context` points at the wrapper so `ibv_get_cq_event`
//! maps a real CQ back to the application's in O(1).

use super::{misc::check_owner, non_null, ok_or_errno, real_of, wrapper, zeroed, Context};
use crate::call_real;
use crate::error::{Errno, Result};
use crate::real_ctx_op;
use crate::stats::{self, Stat};
use crate::sys::*;
use crate::vqp::runtime::{CqSoft, Sink};
use libc::{c_int, c_uint, c_void};
use std::ptr::null_mut;

#[repr(C)]
pub struct CompChannel {
    pub ibv: ibv_comp_channel,
    pub real: *mut ibv_comp_channel,
}
wrapper!(CompChannel, ibv_comp_channel);
real_of!(CompChannel, ibv_comp_channel);

impl CompChannel {
    pub fn create(ctx: &mut Context) -> Result<*mut ibv_comp_channel> {
        let real = non_null(call_real!(ibv_create_comp_channel(ctx.real))?)?;
        // SAFETY: real is a live channel.
        let fd = unsafe { (*real).fd };
        let ibv = ibv_comp_channel { context: ctx.as_ibv(), fd, refcnt: 0 };
        Ok(Box::new(CompChannel { ibv, real }).into_ibv())
    }

    /// # Safety
    /// `p` is a channel of this library.
    pub unsafe fn destroy(p: *mut ibv_comp_channel) -> Result<()> {
        // SAFETY: caller contract.
        let ch = unsafe { CompChannel::from_ibv(p) };
        ok_or_errno(call_real!(ibv_destroy_comp_channel(ch.real))?)?;
        // SAFETY: the real channel is gone.
        unsafe { CompChannel::free(p) };
        Ok(())
    }

    /// `ibv_get_cq_event`: -1 with errno on failure, like libibverbs.
    ///
    /// # Safety
    /// The out pointers are valid for writes.
    pub unsafe fn get_cq_event(&mut self, cq_out: *mut *mut ibv_cq, ctx_out: *mut *mut c_void) -> c_int {
        let (mut rcq, mut rctx) = (null_mut(), null_mut());
        let rc = match call_real!(ibv_get_cq_event(self.real, &mut rcq, &mut rctx)) {
            Ok(rc) => rc,
            Err(e) => {
                e.set();
                return -1;
            }
        };
        if rc != 0 {
            return rc;
        }
        // SAFETY: every real CQ on our channels has its wrapper as context.
        let cq = unsafe { &mut *rctx.cast::<Cq>() };
        stats::inc(Stat::KRCORE_STAT_CQ_EVENTS);
        cq.app_armed.store(false, std::sync::atomic::Ordering::Release);
        // SAFETY: out pointers valid (caller contract).
        unsafe {
            *cq_out = cq.as_ibv().cast();
            *ctx_out = cq.ibv.cq_context;
        }
        0
    }

    fn sync_refcnt(p: *mut ibv_comp_channel, real: *mut ibv_comp_channel) {
        if !p.is_null() {
            // SAFETY: both channels are live.
            unsafe { (*p).refcnt = (*real).refcnt };
        }
    }
}

pub type PollCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
pub type ReqNotifyFn = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;

#[repr(C)]
pub struct Cq {
    /// What the application sees (`ibv_cq` is its prefix).
    pub ibv: ibv_cq_ex,
    pub real: *mut ibv_cq,
    /// The real extended CQ, for CQs made with `ibv_create_cq_ex`.
    pub real_ex: *mut ibv_cq_ex,
    /// The real provider's poll and notify, cached for the hot path.
    pub poll: Option<PollCqFn>,
    pub notify: Option<ReqNotifyFn>,
    real_channel: *mut ibv_comp_channel,
    /// Completions of the VQPs this CQ serves (set at the first VQP).
    pub soft: once_cell::sync::OnceCell<std::sync::Arc<crate::vqp::runtime::CqSoft>>,
    /// A real QP or SRQ was created with this CQ (its real queue then has
    /// completions for the application; else only VQPs feed it).
    real_users: std::sync::atomic::AtomicBool,
    /// The application armed the real CQ (`ibv_req_notify_cq`) and has not
    /// had its event yet: a software side made now starts armed.
    pub app_armed: std::sync::atomic::AtomicBool,
}
wrapper!(Cq, ibv_cq_ex);

impl Cq {
    fn empty() -> Box<Cq> {
        Box::new(Cq {
            // SAFETY: ibv_cq_ex is plain C data.
            ibv: unsafe { zeroed() },
            real: null_mut(),
            real_ex: null_mut(),
            poll: None,
            notify: None,
            real_channel: null_mut(),
            soft: once_cell::sync::OnceCell::new(),
            real_users: std::sync::atomic::AtomicBool::new(false),
            app_armed: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The software completion queue VQPs deliver to, made at first use
    /// with the CQ's capacity.
    pub fn soft(&self) -> Result<std::sync::Arc<crate::vqp::runtime::CqSoft>> {
        self.soft
            .get_or_try_init(|| {
                self.room_for_notifications();
                let soft = CqSoft::new(self.ibv.cqe.max(1) as u32, self.real)?;
                // Armed before its first VQP (pyverbs' tests, perftest):
                // that VQP's first completion must raise the event.
                if self.app_armed.load(std::sync::atomic::Ordering::Acquire) && self.evented() {
                    soft.arm();
                }
                Ok(std::sync::Arc::new(soft))
            })
            .cloned()
    }

    /// Whether the CQ has a completion channel: an event can be raised
    /// (without one, arming it makes no notifier).
    pub fn evented(&self) -> bool {
        !self.real_channel.is_null()
    }

    /// The real CQ receives our event notifications (see `CqSoft`). A small
    /// one (perftest's latency tests make CQs of 1 entry) overflows when a
    /// second notification lands before the application polled the first,
    /// and the provider then drops that completion, and with it the event
    /// the application sleeps for: grow it (the application still sees the
    /// size it asked for; a failure only leaves the risk).
    fn room_for_notifications(&self) {
        const ROOM: c_int = 64;
        // SAFETY: the real CQ is live.
        let cqe = unsafe { (*self.real).cqe };
        // Without a completion channel no event is ever raised: nothing
        // to make room for (a resize is a kernel command, milliseconds in
        // front of a new process's first VQP).
        if cqe >= ROOM || !self.evented() {
            return;
        }
        match call_real!(ibv_resize_cq(self.real, ROOM)) {
            Ok(0) => {}
            Ok(rc) => crate::klog!(crate::log::Level::Debug, "cq: cannot grow a CQ of {cqe} for event notifications: {rc}"),
            Err(e) => crate::klog!(crate::log::Level::Debug, "cq: cannot grow a CQ of {cqe} for event notifications: {e:?}"),
        }
    }

    /// `ibv_poll_cq`: VQP completions first (after progress), then the
    /// real CQ's.
    ///
    /// # Safety
    /// `wc` is valid for `n` entries of writes.
    pub unsafe fn poll_all(&self, n: c_int, wc: *mut ibv_wc) -> c_int {
        let mut got = 0;
        if let Some(soft) = self.soft.get() {
            let out: &mut [std::mem::MaybeUninit<ibv_wc>] = if n > 0 && !wc.is_null() {
                // SAFETY: wc holds n entries (caller contract), maybe
                // uninitialised.
                unsafe { std::slice::from_raw_parts_mut(wc.cast(), n as usize) }
            } else {
                &mut []
            };
            // Work through the host's agent completes into the queue.
            crate::transport::agent::poll();
            // What was queued before this poll comes first: progress then
            // delivers behind it, into the queue.
            let direct = {
                let mut sink = Sink::new(soft, &mut *out);
                soft.progress(Some(&mut sink));
                sink.n
            };
            got = direct as c_int;
            if direct < out.len() && !soft.is_empty() {
                got += soft.pop_into(&mut out[direct..]) as c_int;
            }
        }
        if got == n {
            if let Some(soft) = self.soft.get().filter(|s| s.has_notifier()) {
                // The event notifications must not pile up in the real CQ
                // (a small one overflows and raises no more events).
                self.drain_notifications(soft);
            }
            return got;
        }
        // Only VQPs feed this CQ and nothing raised an event on its real
        // queue: nothing there (a poll of it costs the provider's lock).
        if let Some(soft) = self.soft.get() {
            if !self.real_users.load(std::sync::atomic::Ordering::Acquire) && !soft.has_notifier() {
                return got;
            }
        }
        let Some(f) = self.poll else { return if got > 0 { got } else { -libc::EOPNOTSUPP } };
        // SAFETY: the real CQ with the rest of the caller's array.
        let r = unsafe { f(self.real, n - got, wc.add(got as usize)) };
        if r < 0 {
            return if got > 0 { got } else { r };
        }
        // Drop our event notifications (see CqSoft), keeping the order.
        let Some(soft) = self.soft.get() else { return got + r };
        let mut kept = got;
        for i in got..got + r {
            // SAFETY: the provider wrote entries got..got+r.
            let e = unsafe { std::ptr::read(wc.add(i as usize)) };
            if !soft.is_notification(&e) {
                // SAFETY: kept <= i, within the caller's array.
                unsafe { std::ptr::write(wc.add(kept as usize), e) };
                kept += 1;
            }
        }
        kept
    }

    /// Empty the real CQ, dropping our notifications and queueing the
    /// real completions behind the software ones, in their order.
    fn drain_notifications(&self, soft: &CqSoft) {
        let Some(f) = self.poll else { return };
        // SAFETY: ibv_wc is plain C data.
        let mut buf: [ibv_wc; 8] = unsafe { zeroed() };
        loop {
            // SAFETY: the real CQ, a local array of 8.
            let r = unsafe { f(self.real, buf.len() as c_int, buf.as_mut_ptr()) };
            for e in buf.iter().take(r.max(0) as usize) {
                if !soft.is_notification(e) {
                    // SAFETY: a completion the provider wrote (plain data).
                    soft.enqueue(unsafe { std::ptr::read(e) });
                }
            }
            if r < buf.len() as c_int {
                return;
            }
        }
    }

    /// The wrapper behind an application `ibv_cq *`.
    ///
    /// # Safety
    /// `p` is a CQ of this library.
    #[inline(always)]
    pub unsafe fn from_cq<'a>(p: *mut ibv_cq) -> &'a mut Cq {
        // SAFETY: caller contract; ibv_cq is the prefix of ibv_cq_ex.
        unsafe { Cq::from_ibv(p.cast()) }
    }

    /// # Safety
    /// Pointer arguments are NULL where the verb allows it, or valid verbs
    /// objects and attribute structs of the caller.
    pub unsafe fn create(
        ctx: &mut Context,
        cqe: c_int,
        cq_context: *mut c_void,
        channel: *mut ibv_comp_channel,
        comp_vector: c_int,
    ) -> Result<*mut ibv_cq> {
        // SAFETY: channel is NULL or a live channel pointer from the caller.
        let real_channel = unsafe { CompChannel::real_of(channel, ctx.as_ibv()) }?;
        let mut cq = Cq::empty();
        let me: *mut c_void = (&mut *cq as *mut Cq).cast();
        let real = non_null(call_real!(ibv_create_cq(ctx.real, cqe, me, real_channel, comp_vector))?)?;
        cq.fill(ctx, real, cq_context, channel, real_channel);
        Ok(cq.into_ibv().cast())
    }

    /// # Safety
    /// Pointer arguments are NULL where the verb allows it, or valid verbs
    /// objects and attribute structs of the caller.
    pub unsafe fn create_ex(ctx: &mut Context, attr: *mut ibv_cq_init_attr_ex) -> Result<*mut ibv_cq_ex> {
        let create = real_ctx_op!(ctx.real, create_cq_ex).ok_or(Errno::EOPNOTSUPP)?;
        // SAFETY: attr is the caller's valid attribute struct; copied so the
        // caller's pointers stay its own.
        let mut a = unsafe { *attr };
        if a.comp_mask & ibv_cq_init_attr_mask::IBV_CQ_INIT_ATTR_MASK_PD.0 != 0 {
            // Parent domains are not wrapped (documented limitation).
            return Err(Errno::EOPNOTSUPP);
        }
        let channel = a.channel;
        // SAFETY: channel is NULL or a live channel pointer from the caller.
        a.channel = unsafe { CompChannel::real_of(channel, ctx.as_ibv()) }?;
        let user_ctx = a.cq_context;
        let mut cq = Cq::empty();
        a.cq_context = (&mut *cq as *mut Cq).cast();
        // SAFETY: real context and a valid attribute struct.
        let real_ex = non_null(unsafe { create(ctx.real, &mut a) })?;
        cq.real_ex = real_ex;
        // SAFETY: real_ex is live.
        cq.ibv.comp_mask = unsafe { (*real_ex).comp_mask };
        let real_channel = a.channel;
        cq.fill(ctx, real_ex.cast(), user_ctx, channel, real_channel);
        Ok(cq.into_ibv())
    }

    /// Wrap an existing real CQ (test doubles, benchmarks).
    ///
    /// # Safety
    /// `real` is a live CQ whose context's ops are callable, and `ctx`
    /// outlives the wrapper.
    pub unsafe fn adopt(ctx: &mut Context, real: *mut ibv_cq) -> *mut ibv_cq {
        let mut cq = Cq::empty();
        cq.fill(ctx, real, null_mut(), null_mut(), null_mut());
        cq.into_ibv().cast()
    }

    fn fill(
        &mut self,
        ctx: &mut Context,
        real: *mut ibv_cq,
        cq_context: *mut c_void,
        channel: *mut ibv_comp_channel,
        real_channel: *mut ibv_comp_channel,
    ) {
        stats::inc(Stat::KRCORE_STAT_CQS_CREATED);
        self.real = real;
        self.real_channel = real_channel;
        // SAFETY: real is a live CQ with a live real context.
        let (r, ops) = unsafe { (&*real, &(*(*real).context).ops) };
        self.poll = ops.poll_cq;
        self.notify = ops.req_notify_cq;
        let i = &mut self.ibv;
        i.context = ctx.as_ibv();
        i.channel = channel;
        i.cq_context = cq_context;
        i.handle = r.handle;
        i.cqe = r.cqe;
        if !channel.is_null() {
            CompChannel::sync_refcnt(channel, real_channel);
        }
    }

    /// # Safety
    /// `p` is a CQ of this library.
    pub unsafe fn destroy(p: *mut ibv_cq) -> Result<()> {
        // SAFETY: caller contract.
        let cq = unsafe { Cq::from_cq(p) };
        let (channel, real_channel) = (cq.ibv.channel, cq.real_channel);
        if let Some(soft) = cq.soft.get() {
            // EBUSY while VQPs use it, as a real CQ with QPs.
            soft.release()?;
        }
        ok_or_errno(call_real!(ibv_destroy_cq(cq.real))?)?;
        CompChannel::sync_refcnt(channel, real_channel);
        // SAFETY: the real CQ is gone.
        unsafe { Cq::free(p.cast()) };
        Ok(())
    }

    pub fn resize(&mut self, cqe: c_int) -> Result<()> {
        ok_or_errno(call_real!(ibv_resize_cq(self.real, cqe))?)?;
        // SAFETY: the real CQ is live.
        self.ibv.cqe = unsafe { (*self.real).cqe };
        Ok(())
    }

    pub fn ack_events(&mut self, n: c_uint) -> Result<()> {
        call_real!(ibv_ack_cq_events(self.real, n))?;
        self.ibv.comp_events_completed = self.ibv.comp_events_completed.wrapping_add(n);
        Ok(())
    }

    /// The real CQ behind an application CQ of `ctx` (NULL stays NULL).
    ///
    /// # Safety
    /// `p` is NULL or a live CQ pointer.
    pub unsafe fn real_of(p: *mut ibv_cq, ctx: *mut ibv_context) -> Result<*mut ibv_cq> {
        if p.is_null() {
            return Ok(null_mut());
        }
        if !check_owner!(p, ctx) {
            return Err(Errno::EINVAL);
        }
        // SAFETY: owned by ctx, hence ours.
        let cq = unsafe { Cq::from_cq(p) };
        cq.real_users.store(true, std::sync::atomic::Ordering::Release);
        Ok(cq.real)
    }
}

#[cfg(test)]
#[allow(clippy::undocumented_unsafe_blocks)]
mod tests {
    use super::*;

    #[test]
    fn cq_sizes_match_rdma_core_44() {
        assert_eq!(std::mem::size_of::<ibv_cq>(), 128);
        assert_eq!(std::mem::size_of::<ibv_cq_ex>(), 288);
        assert_eq!(std::mem::size_of::<ibv_comp_channel>(), 16);
    }
}
