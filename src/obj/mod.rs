//! Wrapper objects: what the application holds.
//!
//! Each wrapper is `#[repr(C)]` with the libibverbs struct as its first
//! field, so the pointer the application holds *is* the wrapper pointer. It
//! keeps back-pointers to its parents and the real object it stands for.
//! The real object's user-context slot (`cq_context`, `qp_context`,
//! `srq_context`) points at the wrapper, so completion and async events map
//! back in O(1) (rdma-core's compat-1_0.c does the same).
//!
//! Create: call the real verb, then allocate the wrapper. Destroy: destroy
//! the real object first, free the wrapper only on success (an EBUSY leaves
//! the handle valid).

pub mod context;
pub mod cq;
pub mod misc;
pub mod mr;
pub mod qp;
pub mod srq;

pub use context::Context;
pub use cq::{CompChannel, Cq};
pub use misc::{Ah, Mw, Pd, Xrcd};
pub use mr::Mr;
pub use qp::Qp;
pub use srq::Srq;

/// A zero-filled C struct.
///
/// # Safety
/// `T` must be a C struct for which all-zero bytes is a valid value
/// (integers, raw pointers, `Option<fn>`, opaque pthread storage).
pub(crate) unsafe fn zeroed<T>() -> T {
    // SAFETY: caller contract.
    unsafe { std::mem::MaybeUninit::<T>::zeroed().assume_init() }
}

/// `Wrapper::from_ibv(p)`: the wrapper behind a pointer to its first field.
macro_rules! wrapper {
    ($ty:ident, $ibv:ty) => {
        impl $ty {
            /// The wrapper whose first field `p` points to.
            ///
            /// # Safety
            /// `p` must have been handed out by this library for this type.
            #[inline(always)]
            pub unsafe fn from_ibv<'a>(p: *mut $ibv) -> &'a mut $ty {
                // SAFETY: repr(C) with the ibv struct first: same address.
                unsafe { &mut *p.cast::<$ty>() }
            }

            /// The pointer the application holds.
            #[inline(always)]
            pub fn as_ibv(&mut self) -> *mut $ibv {
                (self as *mut $ty).cast()
            }

            /// Move a new wrapper to the heap and hand out its ibv pointer.
            pub fn into_ibv(self: Box<Self>) -> *mut $ibv {
                Box::into_raw(self).cast()
            }

            /// Free a wrapper whose real object is gone.
            ///
            /// # Safety
            /// `p` came from `into_ibv` and is not used afterwards.
            pub unsafe fn free(p: *mut $ibv) {
                // SAFETY: caller contract.
                drop(unsafe { Box::from_raw(p.cast::<$ty>()) });
            }
        }
    };
}
pub(crate) use wrapper;

/// `real_of(p, ctx)` for wrappers whose real object has the same type:
/// the real object behind an application object of context `ctx`; NULL
/// stays NULL, an object of another context is EINVAL.
macro_rules! real_of {
    ($ty:ident, $ibv:ty) => {
        impl $ty {
            /// # Safety
            /// `p` is NULL or a live object pointer.
            pub unsafe fn real_of(p: *mut $ibv, ctx: *mut crate::sys::ibv_context) -> crate::error::Result<*mut $ibv> {
                if p.is_null() {
                    return Ok(std::ptr::null_mut());
                }
                if !$crate::obj::misc::check_owner!(p, ctx) {
                    return Err(crate::error::Errno::EINVAL);
                }
                // SAFETY: owned by ctx, hence one of ours.
                Ok(unsafe { $ty::from_ibv(p) }.real)
            }
        }
    };
}
pub(crate) use real_of;

/// Turn a real verb's NULL return into the errno it left.
pub(crate) fn non_null<T>(p: *mut T) -> crate::error::Result<*mut T> {
    if p.is_null() {
        Err(crate::error::Errno::last())
    } else {
        Ok(p)
    }
}

/// A real verb's int return (0 or a positive errno) as a Result.
pub(crate) fn ok_or_errno(rc: libc::c_int) -> crate::error::Result<()> {
    match rc {
        0 => Ok(()),
        e if e > 0 => Err(crate::error::Errno(e)),
        _ => Err(crate::error::Errno::last()),
    }
}
