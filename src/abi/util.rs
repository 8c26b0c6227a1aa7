//! Functions that take no verbs object, forwarded as they are so that a
//! program can link `-lkrcore` alone (under LD_PRELOAD they would bind to
//! libibverbs anyway). Enum arguments travel as plain integers: a value
//! outside the enum must not be undefined behaviour here.

use super::boundary;
use crate::call_real;
use crate::sys::ibv_device;
use libc::{c_char, c_int};
use std::ptr::null;

/// Forward `name(arg) -> ret`, with `fallback` when the real library or the
/// symbol is missing.
macro_rules! forward {
    ($(fn $name:ident($a:ident: $t:ty) -> $ret:ty = $fallback:expr;)*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name($a: $t) -> $ret {
            boundary::value(stringify!($name), $fallback, || call_real!($name($a)).unwrap_or($fallback))
        }
    )*};
}

forward! {
    fn ibv_get_device_name(device: *mut ibv_device) -> *const c_char = null();
    fn ibv_get_device_guid(device: *mut ibv_device) -> u64 = 0;
    fn ibv_get_device_index(device: *mut ibv_device) -> c_int = -1;
    fn ibv_node_type_str(node_type: c_int) -> *const c_char = c"unknown".as_ptr();
    fn ibv_port_state_str(port_state: c_int) -> *const c_char = c"unknown".as_ptr();
    fn ibv_event_type_str(event: c_int) -> *const c_char = c"unknown".as_ptr();
    fn ibv_wc_status_str(status: c_int) -> *const c_char = c"unknown".as_ptr();
    fn ibv_rate_to_mult(rate: c_int) -> c_int = -1;
    fn mult_to_ibv_rate(mult: c_int) -> c_int = 0;
    fn ibv_rate_to_mbps(rate: c_int) -> c_int = -1;
    fn mbps_to_ibv_rate(mbps: c_int) -> c_int = 0;
}
