//! Memory regions. Every registration returns its own wrapper carrying the
//! application's PD and the real MR's keys; the registration cache (a later
//! layer) will sit between these wrappers and the real MRs.

use super::{non_null, ok_or_errno, wrapper, Pd};
use crate::call_real;
use crate::error::Result;
use crate::stats::{self, Stat};
use crate::sys::*;
use libc::{c_int, c_void};

#[repr(C)]
pub struct Mr {
    pub ibv: ibv_mr,
    pub real: *mut ibv_mr,
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

impl Mr {
    pub fn register(pd: &mut Pd, kind: RegKind) -> Result<*mut ibv_mr> {
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
        Ok(Box::new(Mr { ibv, real }).into_ibv())
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
        Ok(())
    }

    /// # Safety
    /// `p` is an MR of this library.
    pub unsafe fn dereg(p: *mut ibv_mr) -> Result<()> {
        // SAFETY: caller contract.
        let mr = unsafe { Mr::from_ibv(p) };
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
