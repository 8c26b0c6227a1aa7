//! The krcore C API (the only file, with stats.rs, that cbindgen reads into
//! include/krcore.h).

use crate::abi::boundary;
use crate::stats;
use libc::{c_char, size_t};

/// The library version as a static NUL-terminated string, e.g. "0.1.0".
/// Never NULL; the caller must not free it. Thread-safe.
#[no_mangle]
pub extern "C" fn krcore_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The current value of one statistics counter; `stat` is a value of
/// `enum krcore_stat`. Returns 0 for a value outside the enum.
/// Counters are process-wide, monotonic and thread-safe to read.
#[no_mangle]
pub extern "C" fn krcore_stat_get(stat: u32) -> u64 {
    boundary::value("krcore_stat_get", 0, || stats::get(stat as usize).unwrap_or(0))
}

/// The snake_case name of a counter ("post_send"), a static string; NULL
/// for a value outside `enum krcore_stat`.
#[no_mangle]
pub extern "C" fn krcore_stat_name(stat: u32) -> *const c_char {
    boundary::value("krcore_stat_name", std::ptr::null(), || stats::name_c(stat as usize).unwrap_or(std::ptr::null()))
}

/// Copy `text` snprintf-style into `buf`; returns the full length.
///
/// # Safety
/// `buf` is valid for `len` bytes of writes, or NULL.
unsafe fn copy_out(text: &str, buf: *mut c_char, len: size_t) -> size_t {
    if !buf.is_null() && len > 0 {
        let n = text.len().min(len - 1);
        // SAFETY: buf has len >= n + 1 writable bytes (caller contract).
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    }
    text.len()
}

/// Write all counters as one JSON object into `buf` (NUL-terminated,
/// truncated to `len`). Returns the length the full JSON needs, excluding
/// the NUL, like snprintf; `buf` may be NULL when `len` is 0.
///
/// # Safety
/// `buf` must be valid for `len` bytes of writes (or NULL with `len == 0`).
#[no_mangle]
pub unsafe extern "C" fn krcore_stats_json(buf: *mut c_char, len: size_t) -> size_t {
    // SAFETY: caller contract.
    boundary::value("krcore_stats_json", 0, || unsafe { copy_out(&stats::to_json(), buf, len) })
}

/// Write the effective configuration, one `KRCORE_NAME=value` line per
/// variable, into `buf`; same conventions as `krcore_stats_json`.
///
/// # Safety
/// `buf` must be valid for `len` bytes of writes (or NULL with `len == 0`).
#[no_mangle]
pub unsafe extern "C" fn krcore_config_dump(buf: *mut c_char, len: size_t) -> size_t {
    // SAFETY: caller contract.
    boundary::value("krcore_config_dump", 0, || unsafe { copy_out(&crate::config::get().dump(), buf, len) })
}
