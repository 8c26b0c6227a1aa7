//! The panic boundary: no panic unwinds into C. Each helper says what a
//! panic (and an error) turns into, following the verb's convention.

use crate::error::{Errno, Result};
use crate::klog;
use crate::log::Level;
use libc::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};

fn caught(name: &str) -> Errno {
    klog!(Level::Error, "internal panic in {name}; returning EIO");
    Errno(libc::EIO)
}

/// Pointer-returning verbs: NULL with `errno` set on error.
#[inline(always)]
pub fn ptr<T>(name: &str, f: impl FnOnce() -> Result<*mut T>) -> *mut T {
    match catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| Err(caught(name))) {
        Ok(p) => p,
        Err(e) => {
            klog!(Level::Debug, "{name}: {e:?}");
            e.set();
            std::ptr::null_mut()
        }
    }
}

/// Verbs that return 0 or a positive errno.
#[inline(always)]
pub fn errno(name: &str, f: impl FnOnce() -> Result<c_int>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| Err(caught(name))) {
        Ok(rc) => rc,
        Err(e) => {
            klog!(Level::Debug, "{name}: {e:?}");
            e.errno()
        }
    }
}

/// Verbs that return -1 with `errno` set on error.
#[inline(always)]
pub fn minus_one(name: &str, f: impl FnOnce() -> Result<c_int>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| Err(caught(name))) {
        Ok(rc) => rc,
        Err(e) => {
            klog!(Level::Debug, "{name}: {e:?}");
            e.set();
            -1
        }
    }
}

/// Verbs with no return value (errors are only logged).
#[inline(always)]
pub fn void(name: &str, f: impl FnOnce() -> Result<()>) {
    if let Err(e) = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| Err(caught(name))) {
        klog!(Level::Warn, "{name}: {e:?}");
    }
}

/// Any other return type: `fallback` on panic.
#[inline(always)]
pub fn value<T>(name: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        caught(name);
        fallback
    })
}

#[cfg(test)]
#[allow(clippy::undocumented_unsafe_blocks)]
mod tests {
    use super::*;

    #[test]
    fn panics_become_errors() {
        let p: *mut u8 = ptr("t", || panic!("boom"));
        assert!(p.is_null());
        assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EIO));
        assert_eq!(errno("t", || panic!("boom")), libc::EIO);
        assert_eq!(minus_one("t", || Err(Errno::EINVAL)), -1);
        assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EINVAL));
        assert_eq!(value("t", 7, || panic!("boom")), 7);
    }
}
