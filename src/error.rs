//! One error type for the library: an errno value.

use std::fmt;

/// An errno value (always positive).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub i32);

impl Errno {
    pub const EINVAL: Errno = Errno(libc::EINVAL);
    pub const ENOMEM: Errno = Errno(libc::ENOMEM);
    pub const ENOSYS: Errno = Errno(libc::ENOSYS);
    pub const EOPNOTSUPP: Errno = Errno(libc::EOPNOTSUPP);

    /// The calling thread's current `errno`, or EIO when a failing call left
    /// it at zero (libibverbs promises a non-zero errno on NULL returns).
    pub fn last() -> Errno {
        match std::io::Error::last_os_error().raw_os_error() {
            Some(e) if e != 0 => Errno(e),
            _ => Errno(libc::EIO),
        }
    }

    pub fn errno(self) -> i32 {
        self.0
    }

    /// Store this value in the thread's `errno`.
    pub fn set(self) {
        // SAFETY: __errno_location returns the calling thread's errno slot.
        unsafe { *libc::__errno_location() = self.0 };
    }
}

impl fmt::Debug for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", std::io::Error::from_raw_os_error(self.0))
    }
}

pub type Result<T> = std::result::Result<T, Errno>;

/// A standard I/O error as an errno; a timeout of a socket operation is
/// ETIMEDOUT whatever the platform reports.
impl From<std::io::Error> for Errno {
    fn from(e: std::io::Error) -> Errno {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Errno(libc::ETIMEDOUT),
            _ => Errno(e.raw_os_error().unwrap_or(libc::EIO)),
        }
    }
}
