//! Queue pairs. The wrapper embeds a full `ibv_qp_ex` (an `ibv_qp` is its
//! prefix, and `ibv_qp_to_qp_ex` returns the same address) and owns the
//! data path object that posts for it.

use super::{misc::Xrcd, non_null, ok_or_errno, wrapper, zeroed, Context, Cq, Pd, Srq};
use crate::call_real;
use crate::error::{Errno, Result};
use crate::real_ctx_op;
use crate::stats::{self, Stat};
use crate::sys::*;
use crate::vqp::Forwarder;
use libc::{c_int, c_void};
use std::ptr::null_mut;

#[repr(C)]
pub struct Qp {
    /// What the application sees.
    pub ibv: ibv_qp_ex,
    pub real: *mut ibv_qp,
    /// The real `ibv_qp_ex` when the QP was created with send-ops flags.
    pub real_ex: *mut ibv_qp_ex,
    /// Posts this QP's work requests.
    pub path: Forwarder,
    /// A virtual QP (`KRCORE_VQP`): posts go there, `real` is NULL.
    pub vqp: Option<std::sync::Arc<crate::vqp::qp::Vqp>>,
    /// A VQP created with send-ops flags: its `ibv_wr_*` batch.
    pub wr: Option<Box<crate::vqp::wr_builder::QpWr>>,
    /// `KRCORE_VIRTUALIZE=auto`: the real QP, in RESET, that takes the
    /// VQP's place if its peer does not resolve (its QPN is the one shown).
    backup: *mut ibv_qp,
}
wrapper!(Qp, ibv_qp_ex);

thread_local! {
    /// This thread is inside librdmacm's `rdma_create_qp(_ex)`.
    static VIA_RDMACM: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The application's pointers to a QP's parents.
struct Parents {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    send_cq: *mut ibv_cq,
    recv_cq: *mut ibv_cq,
    srq: *mut ibv_srq,
    qp_context: *mut c_void,
}

/// Replace the application's CQ/SRQ pointers by the real ones.
///
/// # Safety
/// The pointers are NULL or live objects.
unsafe fn translate_queues(
    ctx: *mut ibv_context,
    send_cq: &mut *mut ibv_cq,
    recv_cq: &mut *mut ibv_cq,
    srq: &mut *mut ibv_srq,
) -> Result<()> {
    // SAFETY: caller contract.
    unsafe {
        *send_cq = Cq::real_of(*send_cq, ctx)?;
        *recv_cq = Cq::real_of(*recv_cq, ctx)?;
        *srq = Srq::real_of(*srq, ctx)?;
    }
    Ok(())
}

impl Qp {
    fn empty() -> Box<Qp> {
        Box::new(Qp {
            // SAFETY: ibv_qp_ex is plain C data.
            ibv: unsafe { zeroed() },
            real: null_mut(),
            real_ex: null_mut(),
            path: Forwarder::default(),
            vqp: None,
            wr: None,
            backup: null_mut(),
        })
    }

    /// A VQP for `ibv_create_qp(_ex)` with `qp_type == KRCORE_VQP`.
    fn create_virtual(pd: &mut Pd, p: &Parents, cap: &mut ibv_qp_cap, sq_sig_all: bool) -> Result<*mut ibv_qp> {
        if p.send_cq.is_null() || p.recv_cq.is_null() {
            return Err(Errno::EINVAL);
        }
        // SAFETY: the application's CQs of this context (translated above
        // for the real path; ours by construction here).
        let (scq, rcq) = unsafe { (Cq::from_cq(p.send_cq), Cq::from_cq(p.recv_cq)) };
        // SAFETY: our PD's context is our live context.
        let ctx = unsafe { Context::from_ibv(pd.ibv.context) };
        let app = crate::vqp::qp::AppRefs {
            ctx: ctx.as_ibv(),
            pd: pd.as_ibv(),
            send_cq: p.send_cq,
            recv_cq: p.recv_cq,
            real_ctx: ctx.real,
            real_pd: pd.real,
        };
        let v = crate::vqp::qp::Vqp::new(app, scq.soft()?, rcq.soft()?, cap, sq_sig_all)?;
        Ok(Qp::wrap_virtual(v, p.qp_context))
    }

    /// Whether `KRCORE_VIRTUALIZE` makes this RC QP a transparent VQP
    /// (`extra`: a reason of the caller's to keep it real); the log says
    /// why one stays real.
    fn virtualizes(p: &Parents, qp_type: ibv_qp_type::Type, cap: &ibv_qp_cap, extra: Option<&'static str>) -> bool {
        use crate::config::Virtualize;
        let cfg = crate::config::get();
        if cfg.virtualize == Virtualize::Off || qp_type != ibv_qp_type::IBV_QPT_RC {
            return false;
        }
        let why = if cfg.meta.is_none() {
            Some("KRCORE_META is not set")
        } else if !crate::vqp::qp::caps_fit(cap) {
            Some("its capabilities exceed a VQP's (3 send SGEs, 16 receive SGEs, 256 B inline, 32,768 WRs per queue)")
        } else if VIA_RDMACM.with(|v| v.get()) {
            Some("librdmacm creates it (rdma_create_qp): its connection goes through the kernel's CM")
        } else if !p.srq.is_null() && !Qp::srq_of(p).is_some_and(|s| s.serves_virtual()) {
            Some("its SRQ serves real QPs (or was made without KRCORE_VIRTUALIZE)")
        } else if p.send_cq.is_null() || p.recv_cq.is_null() {
            Some("it lacks a CQ")
        } else if [p.send_cq, p.recv_cq].iter().any(|&c| {
            // SAFETY: a CQ of this context is one of ours.
            super::misc::check_owner!(c, p.ctx) && unsafe { !Cq::from_cq(c).real_ex.is_null() }
        }) {
            Some("a CQ of it comes from ibv_create_cq_ex (ibv_start_poll does not see VQP completions)")
        } else {
            extra
        };
        match why {
            Some(why) => {
                crate::klog!(crate::log::Level::Info, "KRCORE_VIRTUALIZE: an RC QP stays real: {why}");
                false
            }
            None => true,
        }
    }

    /// Whether this PD's runtime starts and reaches the meta server, which
    /// a transparent VQP needs (it publishes its QPN there). Once it did
    /// not, every later RC QP of the process stays real too (a peer of
    /// this process then finds none of its QPs virtual, not some); the
    /// first failure is one warning on stderr, unless `KRCORE_LOG` was set
    /// below warn.
    fn meta_reachable(pd: &Pd) -> bool {
        static DOWN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if DOWN.load(std::sync::atomic::Ordering::Acquire) {
            crate::klog!(crate::log::Level::Info, "KRCORE_VIRTUALIZE: an RC QP stays real: the meta server could not be reached");
            return false;
        }
        // SAFETY: our PD's context is our live context.
        let ctx = unsafe { Context::from_ibv(pd.ibv.context) }.real;
        // SAFETY: the application's live real context and PD (they outlive
        // the runtime: destroying them first fails with EBUSY).
        let r = unsafe { crate::vqp::runtime::Runtime::get_or_start(ctx, pd.real, None) }.and_then(|rt| rt.meta());
        let Err(e) = r else { return true };
        if !DOWN.swap(true, std::sync::atomic::Ordering::AcqRel)
            && (crate::log::enabled(crate::log::Level::Warn) || std::env::var_os("KRCORE_LOG").is_none())
        {
            let meta = crate::config::get().meta.clone().unwrap_or_default();
            crate::log::write_line(
                crate::log::Level::Warn,
                format_args!("KRCORE_VIRTUALIZE: the meta server {meta} cannot be reached ({e:?}): this process's RC QPs stay real QPs"),
            );
        }
        false
    }

    /// Run `f` (librdmacm creating a QP): the QPs it creates stay real
    /// (`abi/rdmacm.rs` says why).
    pub fn created_by_rdmacm<R>(f: impl FnOnce() -> R) -> R {
        /// Clears the mark however `f` returns.
        struct Unmark;
        impl Drop for Unmark {
            fn drop(&mut self) {
                VIA_RDMACM.with(|v| v.set(false));
            }
        }
        VIA_RDMACM.with(|v| v.set(true));
        let _unmark = Unmark;
        f()
    }

    /// `KRCORE_VIRTUALIZE=auto`: a real QP as `a` asks, kept in RESET
    /// behind the VQP (NULL otherwise, and for QPs with an SRQ: a virtual
    /// SRQ cannot serve a real QP).
    fn fallback_qp(ctx: *mut ibv_context, real_pd: *mut ibv_pd, a: &ibv_qp_init_attr) -> Result<*mut ibv_qp> {
        if crate::config::get().virtualize != crate::config::Virtualize::Auto || !a.srq.is_null() {
            return Ok(null_mut());
        }
        let mut b = *a;
        // SAFETY: the application's CQs, checked to be ours of ctx.
        unsafe { translate_queues(ctx, &mut b.send_cq, &mut b.recv_cq, &mut b.srq)? };
        non_null(call_real!(ibv_create_qp(real_pd, &mut b))?)
    }

    /// `KRCORE_VIRTUALIZE=auto`, an RTR whose peer does not resolve: the
    /// real QP takes over (INIT as the VQP was, then this RTR), with the
    /// receives posted so far; the VQP is dropped.
    ///
    /// # Safety
    /// `attr` is valid for the fields `mask` names.
    unsafe fn fall_back(&mut self, attr: *mut ibv_qp_attr, mask: c_int) -> Result<()> {
        let (Some(v), real) = (self.vqp.clone(), self.backup) else { return Err(Errno::EINVAL) };
        let kept = v.query_rc().ok_or(Errno::EINVAL)?;
        // SAFETY: a plain C struct.
        let mut init: ibv_qp_attr = unsafe { zeroed() };
        init.qp_state = ibv_qp_state::IBV_QPS_INIT;
        init.pkey_index = kept.pkey_index;
        init.port_num = kept.port_num;
        init.qp_access_flags = kept.qp_access_flags;
        use ibv_qp_attr_mask as M;
        let init_mask = (M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS).0 as c_int;
        let r = ok_or_errno(call_real!(ibv_modify_qp(real, &mut init, init_mask))?)
            .and_then(|_| ok_or_errno(call_real!(ibv_modify_qp(real, attr, mask))?));
        if let Err(e) = r {
            // Back to RESET: the application may retry its RTR.
            init.qp_state = ibv_qp_state::IBV_QPS_RESET;
            let _ = call_real!(ibv_modify_qp(real, &mut init, M::IBV_QP_STATE.0 as c_int));
            return Err(e);
        }
        // SAFETY: our QP's context is our live context; real is live.
        self.path = unsafe { Forwarder::new(real, Context::from_ibv(self.ibv.qp_base.context)) };
        for (wr_id, mut sges) in v.take_receives() {
            // SAFETY: a plain C struct.
            let mut wr: ibv_recv_wr = unsafe { zeroed() };
            wr.wr_id = wr_id;
            wr.sg_list = sges.as_mut_ptr();
            wr.num_sge = sges.len() as c_int;
            let mut bad = null_mut();
            // SAFETY: the real QP (INIT or later takes receives); the list
            // lives across the call.
            ok_or_errno(unsafe { self.path.post_recv(&mut wr, &mut bad) })?;
        }
        self.real = real;
        self.backup = null_mut();
        self.vqp = None;
        v.destroy();
        let b = &mut self.ibv.qp_base;
        // SAFETY: the real QP is live.
        unsafe {
            b.handle = (*real).handle;
            b.state = (*real).state;
        }
        stats::inc(Stat::KRCORE_STAT_QPS_FALLBACK);
        crate::klog!(
            crate::log::Level::Info,
            "KRCORE_VIRTUALIZE=auto: QP {:#x}: its peer runs no krcore (nothing resolves): a real QP from now on",
            b.qp_num
        );
        Ok(())
    }

    /// The application's SRQ, if it is one of ours.
    fn srq_of<'a>(p: &Parents) -> Option<&'a mut Srq> {
        // SAFETY: real_of checks that the SRQ is ours, of this context.
        (!p.srq.is_null() && unsafe { Srq::real_of(p.srq, p.ctx) }.is_ok()).then(|| {
            // SAFETY: checked just above.
            unsafe { Srq::from_ibv(p.srq) }
        })
    }

    /// A transparent VQP for an application's RC QP: in RESET, its
    /// published QPN as `qp_num`.
    fn create_transparent(pd: &mut Pd, p: &Parents, cap: &mut ibv_qp_cap, sq_sig_all: bool, backup: *mut ibv_qp) -> Result<*mut ibv_qp> {
        let srq = match Qp::srq_of(p) {
            Some(s) => {
                let v = s.virt.clone().ok_or(Errno::EINVAL)?;
                v.attach(true, |_, _| Ok(()))?;
                // As providers do for a QP with an SRQ: no receive queue.
                cap.max_recv_wr = 0;
                cap.max_recv_sge = 0;
                Some(v)
            }
            None => None,
        };
        let q = match Qp::create_virtual(pd, p, cap, sq_sig_all) {
            Ok(q) => q,
            Err(e) => {
                if !backup.is_null() {
                    let _ = call_real!(ibv_destroy_qp(backup));
                }
                return Err(e);
            }
        };
        // SAFETY: just made by create_virtual.
        let qp = unsafe { Qp::from_qp(q) };
        let real_qpn = (!backup.is_null()).then(|| {
            qp.backup = backup;
            // SAFETY: a live real QP; its context slot names our wrapper
            // (async events).
            unsafe {
                (*backup).qp_context = q.cast();
                (*backup).qp_num
            }
        });
        let made = qp.vqp.as_ref().map(|v| {
            if let Some(s) = srq {
                v.set_srq(s);
            }
            v.make_transparent(real_qpn)
        });
        match made {
            Some(Ok(qpn)) => {
                let b = &mut qp.ibv.qp_base;
                b.qp_num = qpn;
                b.state = ibv_qp_state::IBV_QPS_RESET;
                b.qp_type = ibv_qp_type::IBV_QPT_RC;
                stats::inc(Stat::KRCORE_STAT_QPS_VIRTUALIZED);
                Ok(q)
            }
            Some(Err(e)) => {
                // SAFETY: ours, never handed out.
                let _ = unsafe { Qp::destroy(q) };
                Err(e)
            }
            None => Err(Errno::EINVAL),
        }
    }

    /// The application object of a VQP.
    pub fn wrap_virtual(v: std::sync::Arc<crate::vqp::qp::Vqp>, qp_context: *mut c_void) -> *mut ibv_qp {
        stats::inc(Stat::KRCORE_STAT_QPS_CREATED);
        let mut qp = Qp::empty();
        let b = &mut qp.ibv.qp_base;
        b.context = v.app.ctx;
        b.qp_context = qp_context;
        b.pd = v.app.pd;
        b.send_cq = v.app.send_cq;
        b.recv_cq = v.app.recv_cq;
        b.qp_num = v.vqpn;
        b.state = ibv_qp_state::IBV_QPS_INIT;
        b.qp_type = crate::abi::ext::KRCORE_VQP;
        qp.vqp = Some(v);
        qp.into_ibv().cast()
    }

    /// # Safety
    /// `p` is a QP of this library.
    #[inline(always)]
    pub unsafe fn from_qp<'a>(p: *mut ibv_qp) -> &'a mut Qp {
        // SAFETY: caller contract; ibv_qp is the prefix of ibv_qp_ex.
        unsafe { Qp::from_ibv(p.cast()) }
    }

    /// `ibv_create_qp`. The real verb writes the granted capabilities back
    /// into `attr->cap`; so do we.
    /// # Safety
    /// Pointer arguments are NULL where the verb allows it, or valid verbs
    /// objects and attribute structs of the caller.
    pub unsafe fn create(pd: &mut Pd, attr: *mut ibv_qp_init_attr) -> Result<*mut ibv_qp> {
        let ctx = pd.ibv.context;
        // SAFETY: attr is the caller's valid attribute struct.
        let mut a = unsafe { *attr };
        let parents = Parents { ctx, pd: pd.as_ibv(), send_cq: a.send_cq, recv_cq: a.recv_cq, srq: a.srq, qp_context: a.qp_context };
        if a.qp_type == crate::abi::ext::KRCORE_VQP {
            if !parents.srq.is_null() {
                return Err(Errno::EINVAL);
            }
            let q = Qp::create_virtual(pd, &parents, &mut a.cap, a.sq_sig_all != 0)?;
            // SAFETY: attr is valid for writes.
            unsafe { (*attr).cap = a.cap };
            return Ok(q);
        }
        if Qp::virtualizes(&parents, a.qp_type, &a.cap, None) && Qp::meta_reachable(pd) {
            let backup = Qp::fallback_qp(ctx, pd.real, &a)?;
            let q = Qp::create_transparent(pd, &parents, &mut a.cap, a.sq_sig_all != 0, backup)?;
            // SAFETY: attr is valid for writes.
            unsafe { (*attr).cap = a.cap };
            return Ok(q);
        }
        if let Some(s) = Qp::srq_of(&parents) {
            s.attach_real()?;
        }
        // SAFETY: the pointers come from the caller's attr.
        unsafe { translate_queues(ctx, &mut a.send_cq, &mut a.recv_cq, &mut a.srq)? };
        let mut qp = Qp::empty();
        a.qp_context = (&mut *qp as *mut Qp).cast();
        let real = non_null(call_real!(ibv_create_qp(pd.real, &mut a))?)?;
        // SAFETY: attr is valid for writes.
        unsafe { (*attr).cap = a.cap };
        // SAFETY: our PD's context is our live context.
        qp.fill(unsafe { Context::from_ibv(ctx) }, real, null_mut(), &parents);
        Ok(qp.into_ibv().cast())
    }

    /// `ibv_create_qp_ex` (the context's `create_qp_ex` op).
    /// # Safety
    /// Pointer arguments are NULL where the verb allows it, or valid verbs
    /// objects and attribute structs of the caller.
    pub unsafe fn create_ex(ctx: &mut Context, attr: *mut ibv_qp_init_attr_ex) -> Result<*mut ibv_qp> {
        let create = real_ctx_op!(ctx.real, create_qp_ex).ok_or(Errno::EOPNOTSUPP)?;
        let me = ctx.as_ibv();
        // SAFETY: attr is the caller's valid attribute struct.
        let mut a = unsafe { *attr };
        let mask = a.comp_mask;
        if mask & ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_IND_TABLE.0 != 0 {
            // RSS indirection tables and WQs are not wrapped (documented).
            return Err(Errno::EOPNOTSUPP);
        }
        let parents = Parents {
            ctx: me,
            pd: if mask & ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0 != 0 { a.pd } else { null_mut() },
            send_cq: a.send_cq,
            recv_cq: a.recv_cq,
            srq: a.srq,
            qp_context: a.qp_context,
        };
        // What a VQP offers of ibv_create_qp_ex: a PD, and send-ops flags
        // (the ibv_wr_* API) for the opcodes its data path carries.
        const VQP_MASK: u32 = ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0 | ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS.0;
        let send_ops = (mask & ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS.0 != 0).then_some(a.send_ops_flags);
        let lacks_op = send_ops.and_then(crate::vqp::wr_builder::unsupported_send_op);
        if a.qp_type == crate::abi::ext::KRCORE_VQP {
            if parents.pd.is_null() || !parents.srq.is_null() || mask & !VQP_MASK != 0 {
                return Err(Errno::EINVAL);
            }
            if let Some(why) = lacks_op {
                crate::klog!(
                    crate::log::Level::Info,
                    "ibv_create_qp_ex of a KRCORE_VQP: EOPNOTSUPP: {why} (send_ops_flags {:#x})",
                    a.send_ops_flags
                );
                return Err(Errno::EOPNOTSUPP);
            }
            // SAFETY: checked to be one of our PDs of this context.
            unsafe { Pd::real_of(a.pd, me)? };
            // SAFETY: as above.
            let pd = unsafe { Pd::from_ibv(a.pd) };
            let q = Qp::create_virtual(pd, &parents, &mut a.cap, a.sq_sig_all != 0)?;
            // SAFETY: attr is valid for writes.
            unsafe { (*attr).cap = a.cap };
            // SAFETY: just made by create_virtual.
            unsafe { Qp::from_qp(q) }.add_wr_builder(send_ops);
            return Ok(q);
        }
        let extra = if parents.pd.is_null() {
            Some("it has no PD")
        } else if mask & !VQP_MASK != 0 {
            Some("it asks for ibv_create_qp_ex features (create flags, TSO, source QPN, ...) not virtualized")
        } else {
            // Send ops a VQP cannot do (the ibv_wr_* ones it can are its own).
            lacks_op
        };
        let virt_pd = if Qp::virtualizes(&parents, a.qp_type, &a.cap, extra) {
            // SAFETY: checked to be one of our PDs of this context.
            unsafe { Pd::real_of(a.pd, me)? };
            // SAFETY: as above.
            Some(unsafe { Pd::from_ibv(a.pd) }).filter(|pd| Qp::meta_reachable(pd))
        } else {
            None
        };
        if let Some(pd) = virt_pd {
            let basic = ibv_qp_init_attr {
                qp_context: a.qp_context,
                send_cq: a.send_cq,
                recv_cq: a.recv_cq,
                srq: a.srq,
                cap: a.cap,
                qp_type: a.qp_type,
                sq_sig_all: a.sq_sig_all,
            };
            // The ibv_wr_* builders are the VQP's: no real QP to fall back to.
            let backup = if send_ops.is_some() { null_mut() } else { Qp::fallback_qp(me, pd.real, &basic)? };
            let q = Qp::create_transparent(pd, &parents, &mut a.cap, a.sq_sig_all != 0, backup)?;
            // SAFETY: attr is valid for writes.
            unsafe { (*attr).cap = a.cap };
            // SAFETY: just made by create_transparent.
            unsafe { Qp::from_qp(q) }.add_wr_builder(send_ops);
            return Ok(q);
        }
        if let Some(s) = Qp::srq_of(&parents) {
            s.attach_real()?;
        }
        // SAFETY: the pointers come from the caller's attr.
        unsafe {
            if mask & ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0 != 0 {
                a.pd = Pd::real_of(a.pd, me)?;
            }
            if mask & ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_XRCD.0 != 0 {
                a.xrcd = Xrcd::real_of(a.xrcd, me)?;
            }
            translate_queues(me, &mut a.send_cq, &mut a.recv_cq, &mut a.srq)?;
        }
        let mut qp = Qp::empty();
        a.qp_context = (&mut *qp as *mut Qp).cast();
        // SAFETY: real context and a translated attribute struct.
        let real = non_null(unsafe { create(ctx.real, &mut a) })?;
        // SAFETY: attr is valid for writes.
        unsafe { (*attr).cap = a.cap };
        let real_ex = if mask & ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS.0 != 0 {
            call_real!(ibv_qp_to_qp_ex(real)).unwrap_or(null_mut())
        } else {
            null_mut()
        };
        qp.fill(ctx, real, real_ex, &parents);
        Ok(qp.into_ibv().cast())
    }

    /// A VQP created with send-ops flags gets its `ibv_wr_*` batch (the
    /// builders are installed by `abi::ops::install_qp_ex_ops`).
    fn add_wr_builder(&mut self, send_ops: Option<u64>) {
        let (Some(ops), Some(v)) = (send_ops, &self.vqp) else { return };
        let limits =
            crate::vqp::wr_builder::Limits { max_sge: v.caps.max_send_sge, max_inline: v.caps.max_inline_data, max_wr: v.sq_depth() };
        self.wr = Some(Box::new(crate::vqp::wr_builder::QpWr::new(limits, ops)));
    }

    /// Wrap an existing real QP that has no parents we know of (test
    /// doubles, benchmarks).
    ///
    /// # Safety
    /// `real` is a live QP whose context's ops are callable, and `ctx`
    /// outlives the wrapper.
    pub unsafe fn adopt(ctx: &mut Context, real: *mut ibv_qp) -> *mut ibv_qp {
        let mut qp = Qp::empty();
        let none = Parents {
            ctx: ctx.as_ibv(),
            pd: null_mut(),
            send_cq: null_mut(),
            recv_cq: null_mut(),
            srq: null_mut(),
            qp_context: null_mut(),
        };
        qp.fill(ctx, real, null_mut(), &none);
        qp.into_ibv().cast()
    }

    fn fill(&mut self, ctx: &mut Context, real: *mut ibv_qp, real_ex: *mut ibv_qp_ex, p: &Parents) {
        stats::inc(Stat::KRCORE_STAT_QPS_CREATED);
        self.real = real;
        self.real_ex = real_ex;
        // SAFETY: real is a live QP.
        let r = unsafe { &*real };
        let b = &mut self.ibv.qp_base;
        b.context = ctx.as_ibv();
        b.qp_context = p.qp_context;
        b.pd = p.pd;
        b.send_cq = p.send_cq;
        b.recv_cq = p.recv_cq;
        b.srq = p.srq;
        b.handle = r.handle;
        b.qp_num = r.qp_num;
        b.state = r.state;
        b.qp_type = r.qp_type;
        if !real_ex.is_null() {
            // SAFETY: real_ex is live.
            self.ibv.comp_mask = unsafe { (*real_ex).comp_mask };
        }
        // SAFETY: real is live and belongs to ctx.real.
        self.path = unsafe { Forwarder::new(real, ctx) };
    }

    /// `ibv_modify_qp`: returns the real verb's errno.
    ///
    /// # Safety
    /// `attr` is valid for the fields `mask` names.
    pub unsafe fn modify(&mut self, attr: *mut ibv_qp_attr, mask: c_int) -> Result<()> {
        if let Some(v) = &self.vqp {
            // A KRCORE_VQP needs no transitions (bind or connect it); a
            // transparent one plays an RC QP's.
            if !v.is_transparent() || attr.is_null() {
                return Err(Errno::EINVAL);
            }
            // SAFETY: attr is the caller's valid attribute struct.
            match v.modify_rc(unsafe { &*attr }, mask as u32) {
                // SAFETY: as above.
                Err(e) if e.0 == libc::ECONNREFUSED && !self.backup.is_null() => return unsafe { self.fall_back(attr, mask) },
                r => r?,
            }
            if let Some(now) = v.query_rc() {
                self.ibv.qp_base.state = now.qp_state;
            }
            return Ok(());
        }
        ok_or_errno(call_real!(ibv_modify_qp(self.real, attr, mask))?)?;
        // SAFETY: the real QP is live; libibverbs updated its state.
        self.ibv.qp_base.state = unsafe { (*self.real).state };
        Ok(())
    }

    /// `ibv_query_qp`: the provider reports the real CQs, SRQ and our
    /// wrapper as `qp_context`; give the application its own pointers.
    ///
    /// # Safety
    /// `attr` and `init` are valid for writes.
    pub unsafe fn query(&mut self, attr: *mut ibv_qp_attr, mask: c_int, init: *mut ibv_qp_init_attr) -> Result<()> {
        if let Some(v) = self.vqp.as_ref().filter(|v| v.is_transparent()) {
            let cap = ibv_qp_cap {
                max_send_wr: v.sq_depth(),
                max_recv_wr: v.rq_depth(),
                max_send_sge: v.caps.max_send_sge,
                max_recv_sge: v.caps.max_recv_sge,
                max_inline_data: v.caps.max_inline_data,
            };
            let b = &mut self.ibv.qp_base;
            // SAFETY: attr and init are valid for writes (caller contract).
            unsafe {
                *attr = v.query_rc().ok_or(Errno::EINVAL)?;
                (*attr).cap = cap;
                b.state = (*attr).qp_state;
                if !init.is_null() {
                    *init = zeroed();
                    (*init).qp_context = b.qp_context;
                    (*init).send_cq = b.send_cq;
                    (*init).recv_cq = b.recv_cq;
                    (*init).cap = cap;
                    (*init).qp_type = ibv_qp_type::IBV_QPT_RC;
                    (*init).sq_sig_all = v.sq_sig_all() as c_int;
                }
            }
            return Ok(());
        }
        if let Some(v) = &self.vqp {
            let ready = v.is_bound() || v.is_connected();
            let state = if ready { ibv_qp_state::IBV_QPS_RTS } else { ibv_qp_state::IBV_QPS_INIT };
            let b = &mut self.ibv.qp_base;
            b.state = state;
            let cap = ibv_qp_cap {
                max_send_wr: 0,
                max_recv_wr: 0,
                max_send_sge: v.caps.max_send_sge,
                max_recv_sge: v.caps.max_recv_sge,
                max_inline_data: v.caps.max_inline_data,
            };
            // SAFETY: attr and init are valid for writes (caller contract).
            unsafe {
                *attr = zeroed();
                (*attr).qp_state = state;
                (*attr).cur_qp_state = state;
                (*attr).cap = cap;
                if !init.is_null() {
                    *init = zeroed();
                    (*init).qp_context = b.qp_context;
                    (*init).send_cq = b.send_cq;
                    (*init).recv_cq = b.recv_cq;
                    (*init).cap = cap;
                    (*init).qp_type = b.qp_type;
                }
            }
            // Every field is filled whatever `mask` asks for.
            return Ok(());
        }
        ok_or_errno(call_real!(ibv_query_qp(self.real, attr, mask, init))?)?;
        let b = &mut self.ibv.qp_base;
        // SAFETY: init is valid for writes; the real QP is live.
        unsafe {
            if !init.is_null() {
                (*init).qp_context = b.qp_context;
                (*init).send_cq = b.send_cq;
                (*init).recv_cq = b.recv_cq;
                (*init).srq = b.srq;
            }
            b.state = (*self.real).state;
        }
        Ok(())
    }

    /// # Safety
    /// `p` is a QP of this library.
    pub unsafe fn destroy(p: *mut ibv_qp) -> Result<()> {
        // SAFETY: caller contract.
        let qp = unsafe { Qp::from_qp(p) };
        if !qp.backup.is_null() {
            ok_or_errno(call_real!(ibv_destroy_qp(qp.backup))?)?;
            qp.backup = null_mut();
        }
        if let Some(v) = qp.vqp.take() {
            for src in v.destroy() {
                // SAFETY: VQPs made for qpop_msgs, owned by the library.
                let _ = unsafe { Qp::destroy(src) };
            }
            // SAFETY: nothing refers to the wrapper any more.
            unsafe { Qp::free(p.cast()) };
            return Ok(());
        }
        ok_or_errno(call_real!(ibv_destroy_qp(qp.real))?)?;
        // SAFETY: the real QP is gone.
        unsafe { Qp::free(p.cast()) };
        Ok(())
    }

    /// `ibv_qp_to_qp_ex`: NULL unless created with send-ops flags.
    pub fn to_qp_ex(&mut self) -> *mut ibv_qp_ex {
        if self.real_ex.is_null() && self.wr.is_none() {
            null_mut()
        } else {
            self.as_ibv()
        }
    }
}

#[cfg(test)]
#[allow(clippy::undocumented_unsafe_blocks)]
mod tests {
    use super::*;

    #[test]
    fn qp_sizes_match_rdma_core_44() {
        assert_eq!(std::mem::size_of::<ibv_qp>(), 160);
        assert_eq!(std::mem::size_of::<ibv_qp_ex>(), 352);
        assert_eq!(std::mem::size_of::<ibv_qp_init_attr>(), 64);
        assert_eq!(std::mem::size_of::<ibv_qp_init_attr_ex>(), 136);
    }
}
