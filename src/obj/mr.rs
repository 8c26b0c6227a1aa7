//! Memory regions. Every registration returns its own wrapper carrying the
//! application's PD, the requested `addr`/`length` and the keys of the real
//! MR behind it, which may be a region of the registration cache
//! (`mr::cache`) shared with other registrations.

use super::{non_null, ok_or_errno, wrapper, Pd};
use crate::call_real;
use crate::error::{Errno, Result};
use crate::mr::policy::EntryId;
use crate::stats::{self, Stat};
use crate::sys::*;
use libc::{c_int, c_void};

/// `enum ibv_rereg_mr_err_code` values.
pub(crate) const REREG_ERR_INPUT: c_int = -1;
const REREG_ERR_CMD: c_int = -4;

#[repr(C)]
pub struct Mr {
    pub ibv: ibv_mr,
    pub real: *mut ibv_mr,
    /// The cache region this MR holds a reference on; 0 when uncached.
    lease: EntryId,
    /// The access flags it was registered with (for rereg).
    access: u32,
}
wrapper!(Mr, ibv_mr);

/// Access that lets peers use an MR.
const REMOTE_ACCESS: u32 =
    ibv_access_flags::IBV_ACCESS_REMOTE_READ.0 | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0 | ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;

/// Which real registration verb to use.
pub enum RegKind {
    /// `ibv_reg_mr(pd, addr, length, access)`
    Plain { addr: *mut c_void, length: usize, access: c_int },
    /// `ibv_reg_mr_iova(pd, addr, length, iova, access)`
    Iova { addr: *mut c_void, length: usize, iova: u64, access: c_int },
    /// `ibv_reg_mr_iova2(pd, addr, length, iova, access)`
    Iova2 { addr: *mut c_void, length: usize, iova: u64, access: u32 },
    /// `ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access)`
    Dmabuf { offset: u64, length: usize, iova: u64, fd: c_int, access: c_int },
    /// `ibv_import_mr(pd, handle)`
    Import { handle: u32 },
}

impl RegKind {
    /// The address WRs use for the MR's first byte, for the VQP pre-checks
    /// (dma-buf and imported MRs are not offered to VQPs).
    fn iova(&self) -> Option<u64> {
        match *self {
            RegKind::Plain { addr, .. } => Some(addr as u64),
            RegKind::Iova { iova, .. } | RegKind::Iova2 { iova, .. } => Some(iova),
            _ => None,
        }
    }

    fn access(&self) -> u32 {
        match *self {
            RegKind::Plain { access, .. } | RegKind::Iova { access, .. } | RegKind::Dmabuf { access, .. } => access as u32,
            RegKind::Iova2 { access, .. } => access,
            RegKind::Import { .. } => 0,
        }
    }

    /// `(addr, length, access)` when the cache may serve this request: a
    /// virtual-address registration with iova == addr.
    fn cacheable(&self) -> Option<(usize, usize, u32)> {
        let (addr, length, iova, access) = match *self {
            RegKind::Plain { addr, length, access } => (addr as usize, length, addr as u64, access as u32),
            RegKind::Iova { addr, length, iova, access } => (addr as usize, length, iova, access as u32),
            RegKind::Iova2 { addr, length, iova, access } => (addr as usize, length, iova, access),
            _ => return None,
        };
        (iova == addr as u64 && length > 0 && addr != 0).then_some((addr, length, access))
    }
}

impl Mr {
    pub fn register(pd: &mut Pd, kind: RegKind) -> Result<*mut ibv_mr> {
        let iova = kind.iova();
        let access = kind.access();
        let mr = Self::register_real(pd, kind)?;
        if let Some(iova) = iova {
            // SAFETY: just registered, live.
            let m = unsafe { &*mr };
            let info = crate::vqp::precheck::MrInfo { addr: iova, len: m.length as u64, access };
            crate::vqp::mrs::added(pd.real as usize, m.lkey, m.rkey, info);
        }
        Ok(mr)
    }

    fn register_real(pd: &mut Pd, kind: RegKind) -> Result<*mut ibv_mr> {
        if let (Some(cache), Some((addr, length, access))) = (crate::mr::cache(), kind.cacheable()) {
            // SAFETY: a live real PD.
            let real_ctx = unsafe { (*pd.real).context } as usize;
            let lease = cache.acquire(real_ctx, pd.real, addr, length, access)?;
            stats::inc(Stat::KRCORE_STAT_MRS_REGISTERED);
            // SAFETY: the region's real MR is live while we hold the lease.
            let r = unsafe { &*lease.real };
            let ibv = ibv_mr {
                context: pd.ibv.context,
                pd: pd.as_ibv(),
                addr: addr as *mut c_void,
                length,
                handle: r.handle,
                lkey: r.lkey,
                rkey: r.rkey,
            };
            return Ok(Box::new(Mr { ibv, real: lease.real, lease: lease.id, access }).into_ibv());
        }
        let access = kind.access();
        let rp = pd.real;
        let real = match kind {
            RegKind::Plain { addr, length, access } => call_real!(ibv_reg_mr(rp, addr, length, access))?,
            RegKind::Iova { addr, length, iova, access } => call_real!(ibv_reg_mr_iova(rp, addr, length, iova, access))?,
            RegKind::Iova2 { addr, length, iova, access } => call_real!(ibv_reg_mr_iova2(rp, addr, length, iova, access))?,
            RegKind::Dmabuf { offset, length, iova, fd, access } => call_real!(ibv_reg_dmabuf_mr(rp, offset, length, iova, fd, access))?,
            RegKind::Import { handle } => call_real!(ibv_import_mr(rp, handle))?,
        };
        let real = non_null(real)?;
        stats::inc(Stat::KRCORE_STAT_MRS_REGISTERED);
        let ibv = ibv_mr { context: pd.ibv.context, pd: pd.as_ibv(), ..Self::copy(real) };
        Ok(Box::new(Mr { ibv, real, lease: 0, access }).into_ibv())
    }

    /// The real MR's public fields (context and pd are replaced by the caller).
    fn copy(real: *mut ibv_mr) -> ibv_mr {
        // SAFETY: real is a live MR of the real library.
        unsafe { *real }
    }

    /// `ibv_rereg_mr`, with libibverbs' return convention: 0, or an `enum
    /// ibv_rereg_mr_err_code` (negative) with errno set. `new_pd` is already
    /// checked to be one of our PDs of this context when `IBV_REREG_MR_CHANGE_PD`
    /// is set.
    ///
    /// # Safety
    /// `self` is a live MR of this library.
    pub unsafe fn rereg(
        &mut self,
        flags: c_int,
        new_pd: *mut ibv_pd,
        addr: *mut c_void,
        length: usize,
        access: c_int,
    ) -> std::result::Result<(), c_int> {
        let change_pd = flags as u32 & ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_PD.0 != 0;
        let real_pd = if change_pd && !new_pd.is_null() {
            // SAFETY: checked by the caller to be one of our PDs.
            unsafe { Pd::from_ibv(new_pd) }.real
        } else {
            // Providers read the PD only with CHANGE_PD (ibv_cmd_rereg_mr).
            std::ptr::null_mut()
        };
        // SAFETY: an MR's PD outlives it.
        let old_pd = unsafe { Pd::from_ibv(self.ibv.pd) }.real as usize;
        let lease_end = if self.access & REMOTE_ACCESS != 0 { crate::vqp::runtime::mr_lease_end(old_pd) } else { None };
        if lease_end.is_some() || crate::vqp::runtime::links_busy(old_pd) {
            let wrapper = if real_pd.is_null() { std::ptr::null_mut() } else { new_pd };
            return self.rereg_aside(flags, wrapper, addr, length, access, lease_end);
        }
        let real = if self.lease != 0 { self.exclusive_real(flags, addr, length, access)? } else { self.real };
        let rc = call_real!(ibv_rereg_mr(real, flags, real_pd, addr, length, access)).map_err(|e| {
            e.set();
            REREG_ERR_INPUT
        })?;
        if real != self.real {
            if rc != 0 {
                // The provider refused: the application's MR stays as it was.
                let errno = Errno::last();
                let _ = call_real!(ibv_dereg_mr(real));
                errno.set();
                return Err(rc);
            }
            self.leave_cache(real);
        }
        // On failure the real MR is kept, as libibverbs keeps it.
        if rc != 0 {
            return Err(rc);
        }
        let (ctx, pd) = (self.ibv.context, if change_pd { new_pd } else { self.ibv.pd });
        // SAFETY: an MR's PD outlives it.
        let old_pd = unsafe { Pd::from_ibv(self.ibv.pd) }.real as usize;
        crate::vqp::mrs::removed(old_pd, self.ibv.lkey);
        self.ibv = ibv_mr { context: ctx, pd, ..Self::copy(self.real) };
        if flags as u32 & ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_ACCESS.0 != 0 {
            self.access = access as u32;
        }
        // SAFETY: as above.
        let new_pd = unsafe { Pd::from_ibv(pd) }.real as usize;
        let info = crate::vqp::precheck::MrInfo { addr: self.ibv.addr as u64, len: self.ibv.length as u64, access: self.access };
        crate::vqp::mrs::added(new_pd, self.ibv.lkey, self.ibv.rkey, info);
        Ok(())
    }

    /// `ibv_rereg_mr` while peers may still use the MR (its lease) or a
    /// WQE queued on a link may: as a deregistration, the old registration
    /// stays until they are done (see [`Mr::dereg`]); the MR gets a new
    /// registration with the new attributes, and new keys, at once (the
    /// keys may change at a rereg). `new_pd`: the application's new PD
    /// with `IBV_REREG_MR_CHANGE_PD`, else null.
    fn rereg_aside(
        &mut self,
        flags: c_int,
        new_pd: *mut ibv_pd,
        addr: *mut c_void,
        length: usize,
        access: c_int,
        lease_end: Option<std::time::Instant>,
    ) -> std::result::Result<(), c_int> {
        rereg_input_ok(flags, addr, length, access)?;
        let f = flags as u32;
        let translation = ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_TRANSLATION.0;
        let change_access = ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_ACCESS.0;
        // SAFETY: an MR's PD outlives it.
        let old_pd = unsafe { Pd::from_ibv(self.ibv.pd) }.real;
        // SAFETY: checked by the caller to be one of our PDs.
        let pd = if new_pd.is_null() { old_pd } else { unsafe { Pd::from_ibv(new_pd) }.real };
        let (addr, len) = if f & translation != 0 { (addr, length) } else { (self.ibv.addr, self.ibv.length) };
        let acc = if f & change_access != 0 { access as u32 } else { self.access };
        let new = call_real!(ibv_reg_mr_iova2(pd, addr, len, addr as u64, acc)).and_then(non_null).map_err(|e| {
            e.set();
            REREG_ERR_CMD
        })?;
        let (old_real, old_lease, old_lkey) = (self.real as usize, self.lease, self.ibv.lkey);
        crate::vqp::mrs::removed(old_pd as usize, old_lkey);
        stats::inc(Stat::KRCORE_STAT_MR_DEREG_DELAYED);
        let later: crate::service::Deferred = Box::new(move || {
            stats::sub(Stat::KRCORE_STAT_MR_DEREG_DELAYED, 1);
            let r = if old_lease != 0 {
                crate::mr::cache().map_or(Ok(()), |c| c.release(old_lease))
            } else {
                call_real!(ibv_dereg_mr(old_real as *mut ibv_mr)).and_then(ok_or_errno)
            };
            if let Err(e) = r {
                crate::klog!(crate::log::Level::Warn, "mr: deregistering the registration a rereg replaced failed: {e:?}");
            }
        });
        if let Err(now) = crate::vqp::runtime::defer_dereg(old_pd as usize, lease_end, later) {
            now();
        }
        let ibv_pd = if new_pd.is_null() { self.ibv.pd } else { new_pd };
        self.real = new;
        self.lease = 0;
        self.access = acc;
        self.ibv = ibv_mr { context: self.ibv.context, pd: ibv_pd, ..Self::copy(new) };
        let info = crate::vqp::precheck::MrInfo { addr: self.ibv.addr as u64, len: self.ibv.length as u64, access: acc };
        crate::vqp::mrs::added(pd as usize, self.ibv.lkey, self.ibv.rkey, info);
        Ok(())
    }

    /// A cache-backed MR about to be re-registered: libibverbs' own input
    /// checks first (so that bad input fails exactly as without the cache,
    /// before anything changes), then a real MR of exactly this registration
    /// that nothing else shares, for the provider to act on. That is the
    /// cache's region itself when this MR is its only user and has its
    /// exact range (taken out of the cache), else a private registration.
    fn exclusive_real(&mut self, flags: c_int, addr: *mut c_void, length: usize, access: c_int) -> std::result::Result<*mut ibv_mr, c_int> {
        rereg_input_ok(flags, addr, length, access)?;
        let start = self.ibv.addr as usize;
        if let Some(real) = crate::mr::cache().and_then(|c| c.detach(self.lease, start, start + self.ibv.length)) {
            self.lease = 0;
            self.real = real;
            return Ok(real);
        }
        // SAFETY: an MR's PD outlives it.
        let pd = unsafe { Pd::from_ibv(self.ibv.pd) }.real;
        let (addr, len) = (self.ibv.addr, self.ibv.length);
        call_real!(ibv_reg_mr_iova2(pd, addr, len, addr as u64, self.access)).and_then(non_null).map_err(|e| {
            e.set();
            REREG_ERR_CMD
        })
    }

    /// The provider re-registered our private copy: it replaces the cache
    /// lease behind this MR.
    fn leave_cache(&mut self, real: *mut ibv_mr) {
        if let Some(cache) = crate::mr::cache() {
            let _ = cache.release(self.lease);
        }
        self.lease = 0;
        self.real = real;
    }

    /// # Safety
    /// `p` is an MR of this library.
    pub unsafe fn dereg(p: *mut ibv_mr) -> Result<()> {
        // SAFETY: caller contract.
        let mr = unsafe { Mr::from_ibv(p) };
        // SAFETY: an MR's PD outlives it.
        let real_pd = unsafe { Pd::from_ibv(mr.ibv.pd) }.real as usize;
        let (lkey, rkey) = (mr.ibv.lkey, mr.ibv.rkey);
        // Linked peers may have checked an MR they can access within their
        // lease and still use its rkey; and a WQE of this process queued on
        // a link (behind other VQPs' work, or RNR) may use it. A key
        // deregistered under either fails the link, for every VQP on it.
        // So the MR leaves the registry now (nothing new can use it) and
        // the real deregistration waits for both.
        let lease_end = if mr.access & REMOTE_ACCESS != 0 { crate::vqp::runtime::mr_lease_end(real_pd) } else { None };
        let info = crate::vqp::mrs::with(real_pd, |m| crate::vqp::precheck::LocalMrs::local(m, lkey));
        crate::vqp::mrs::removed(real_pd, lkey);
        let addr = p as usize;
        stats::inc(Stat::KRCORE_STAT_MR_DEREG_DELAYED);
        let later: crate::service::Deferred = Box::new(move || {
            stats::sub(Stat::KRCORE_STAT_MR_DEREG_DELAYED, 1);
            let p = addr as *mut ibv_mr;
            // SAFETY: the application gave the MR up at its ibv_dereg_mr;
            // nobody else frees it.
            let r = unsafe { Self::dereg_real(Mr::from_ibv(p), p) };
            if let Err(e) = r {
                crate::klog!(crate::log::Level::Warn, "mr: delayed deregistration failed: {e:?}");
            }
        });
        if crate::vqp::runtime::defer_dereg(real_pd, lease_end, later).is_ok() {
            return Ok(());
        }
        stats::sub(Stat::KRCORE_STAT_MR_DEREG_DELAYED, 1);
        // SAFETY: caller contract.
        let r = unsafe { Self::dereg_real(mr, p) };
        if r.is_err() {
            // Still registered (EBUSY: a memory window bound to it).
            if let Some(info) = info {
                crate::vqp::mrs::added(real_pd, lkey, rkey, info);
            }
        }
        r
    }

    /// # Safety
    /// `p` is `mr`, an MR of this library.
    unsafe fn dereg_real(mr: &mut Mr, p: *mut ibv_mr) -> Result<()> {
        if mr.lease != 0 {
            // A forked child never touches the parent's cached regions.
            if let Some(cache) = crate::mr::cache() {
                cache.release(mr.lease)?;
            }
            // SAFETY: the application gave up its pointer.
            unsafe { Mr::free(p) };
            return Ok(());
        }
        ok_or_errno(call_real!(ibv_dereg_mr(mr.real))?)?;
        // SAFETY: the real MR is gone.
        unsafe { Mr::free(p) };
        Ok(())
    }

    /// # Safety
    /// `p` is an MR of this library.
    pub unsafe fn unimport(p: *mut ibv_mr) -> Result<()> {
        // SAFETY: caller contract.
        let mr = unsafe { Mr::from_ibv(p) };
        call_real!(ibv_unimport_mr(mr.real))?;
        // SAFETY: the real MR is gone.
        unsafe { Mr::free(p) };
        Ok(())
    }
}

/// libibverbs' own input checks of `ibv_rereg_mr` (before anything
/// changes): unsupported flags, a translation change without a range,
/// access flags without `IBV_REREG_MR_CHANGE_ACCESS`.
fn rereg_input_ok(flags: c_int, addr: *mut c_void, length: usize, access: c_int) -> std::result::Result<(), c_int> {
    let f = flags as u32;
    let translation = ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_TRANSLATION.0;
    let change_access = ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_ACCESS.0;
    let supported = (change_access << 1) - 1; // IBV_REREG_MR_FLAGS_SUPPORTED
    if f & !supported != 0 || (f & translation != 0 && (length == 0 || addr.is_null())) || (access != 0 && f & change_access == 0) {
        Errno::EINVAL.set();
        return Err(REREG_ERR_INPUT);
    }
    Ok(())
}
