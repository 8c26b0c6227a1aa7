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
        let access = match kind {
            RegKind::Plain { access, .. } | RegKind::Iova { access, .. } | RegKind::Dmabuf { access, .. } => access as u32,
            RegKind::Iova2 { access, .. } => access,
            RegKind::Import { .. } => 0,
        };
        let rp = pd.real;
        let real = match kind {
            RegKind::Plain { addr, length, access } => call_real!(ibv_reg_mr(rp, addr, length, access))?,
            RegKind::Iova { addr, length, iova, access } => {
                call_real!(ibv_reg_mr_iova(rp, addr, length, iova, access))?
            }
            RegKind::Iova2 { addr, length, iova, access } => {
                call_real!(ibv_reg_mr_iova2(rp, addr, length, iova, access))?
            }
            RegKind::Dmabuf { offset, length, iova, fd, access } => {
                call_real!(ibv_reg_dmabuf_mr(rp, offset, length, iova, fd, access))?
            }
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

    /// `ibv_rereg_mr`: `new_pd` is already checked to be one of ours (or NULL).
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
        if self.lease != 0 {
            return self.rereg_cached(flags, new_pd, addr, length, access);
        }
        let real_pd = if new_pd.is_null() {
            std::ptr::null_mut()
        } else {
            // SAFETY: checked by the caller to be one of our PDs.
            unsafe { Pd::from_ibv(new_pd) }.real
        };
        let rc = call_real!(ibv_rereg_mr(self.real, flags, real_pd, addr, length, access))
            .map_err(|e| e.errno())?;
        // ibv_rereg_mr returns 0 or an enum ibv_rereg_mr_err_code (negative)
        // with errno set; the real MR is kept either way.
        if rc != 0 {
            return Err(rc);
        }
        let (ctx, pd) = (self.ibv.context, if new_pd.is_null() { self.ibv.pd } else { new_pd });
        self.ibv = ibv_mr { context: ctx, pd, ..Self::copy(self.real) };
        if flags as u32 & ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_ACCESS.0 != 0 {
            self.access = access as u32;
        }
        Ok(())
    }

    /// `ibv_rereg_mr` of a cache-backed MR: a registration with the new
    /// parameters from the cache, then the old lease is released. The keys
    /// may change, as they may with a real rereg.
    fn rereg_cached(
        &mut self,
        flags: c_int,
        new_pd: *mut ibv_pd,
        addr: *mut c_void,
        length: usize,
        access: c_int,
    ) -> std::result::Result<(), c_int> {
        const ERR_INPUT: c_int = -1; // IBV_REREG_MR_ERR_INPUT
        const ERR_CMD: c_int = -4; // IBV_REREG_MR_ERR_CMD
        let f = flags as u32;
        let known = ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_TRANSLATION.0
            | ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_PD.0
            | ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_ACCESS.0;
        if f == 0 || f & !known != 0 {
            Errno::EINVAL.set();
            return Err(ERR_INPUT);
        }
        let pd = if f & ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_PD.0 != 0 { new_pd } else { self.ibv.pd };
        let (addr, length) = if f & ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_TRANSLATION.0 != 0 {
            (addr, length)
        } else {
            (self.ibv.addr, self.ibv.length)
        };
        let access = if f & ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_ACCESS.0 != 0 { access as u32 } else { self.access };
        if pd.is_null() {
            Errno::EINVAL.set();
            return Err(ERR_INPUT);
        }
        // SAFETY: checked by the caller to be one of our PDs of this context.
        let pd = unsafe { Pd::from_ibv(pd) };
        let fresh = Mr::register(pd, RegKind::Iova2 { addr, length, iova: addr as u64, access }).map_err(|e| {
            e.set();
            ERR_CMD
        })?;
        // SAFETY: just created by us; moved into self, its box freed.
        let fresh = unsafe { Box::from_raw(fresh.cast::<Mr>()) };
        if let Some(cache) = crate::mr::cache().filter(|_| self.lease != 0) {
            let _ = cache.release(self.lease);
        }
        self.ibv = fresh.ibv;
        self.real = fresh.real;
        self.lease = fresh.lease;
        self.access = fresh.access;
        Ok(())
    }

    /// # Safety
    /// `p` is an MR of this library.
    pub unsafe fn dereg(p: *mut ibv_mr) -> Result<()> {
        // SAFETY: caller contract.
        let mr = unsafe { Mr::from_ibv(p) };
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
