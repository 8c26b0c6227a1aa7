//! The real libibverbs: loaded once with `dlopen`, every function resolved
//! with `dlvsym` pinned to the version an application would bind.
//!
//! Inside this cdylib an `extern "C" ibv_*` declaration would bind to our own
//! export and recurse; every call to the real library goes through this table.

use crate::error::{Errno, Result};
use crate::klog;
use crate::log::Level;
use crate::sys::*;
use libc::{c_char, c_int, c_uint, c_void};
use once_cell::sync::Lazy;
use std::ffi::CString;

type Dev = *mut ibv_device;
type Ctx = *mut ibv_context;

macro_rules! real_table {
    ($( $field:ident @ $ver:expr => fn($($arg:ty),*) $(-> $ret:ty)? ;)*) => {
        /// Function pointers of the real libibverbs; `None` when this
        /// rdma-core does not have the symbol at that version.
        pub struct RealVerbs {
            $( pub $field: Option<unsafe extern "C" fn($($arg),*) $(-> $ret)?>, )*
        }

        impl RealVerbs {
            fn resolve(handle: *mut c_void) -> RealVerbs {
                RealVerbs {
                    $( $field: {
                        let p = lookup(handle, stringify!($field), $ver);
                        // SAFETY: the symbol of that name and version has this
                        // C signature (rdma-core's verbs.h); NULL maps to None.
                        unsafe { std::mem::transmute::<*mut c_void, Option<unsafe extern "C" fn($($arg),*) $(-> $ret)?>>(p) }
                    }, )*
                }
            }
        }
    };
}

const V1_0: Option<&str> = Some("IBVERBS_1.0");
const V1_1: Option<&str> = Some("IBVERBS_1.1");
/// Private symbols: their version node changes with the provider ABI, take
/// the default one.
const PRIVATE: Option<&str> = None;

real_table! {
    ibv_get_device_name @ V1_1 => fn(Dev) -> *const c_char;
    ibv_get_device_guid @ V1_1 => fn(Dev) -> u64;
    ibv_get_device_index @ Some("IBVERBS_1.9") => fn(Dev) -> c_int;
    ibv_node_type_str @ V1_1 => fn(c_int) -> *const c_char;
    ibv_port_state_str @ V1_1 => fn(c_int) -> *const c_char;
    ibv_event_type_str @ V1_1 => fn(c_int) -> *const c_char;
    ibv_wc_status_str @ V1_1 => fn(c_int) -> *const c_char;
    ibv_rate_to_mult @ Some("IBVERBS_1.0") => fn(c_int) -> c_int;
    mult_to_ibv_rate @ Some("IBVERBS_1.0") => fn(c_int) -> c_int;
    ibv_rate_to_mbps @ V1_1 => fn(c_int) -> c_int;
    mbps_to_ibv_rate @ V1_1 => fn(c_int) -> c_int;
    ibv_get_device_list @ V1_1 => fn(*mut c_int) -> *mut Dev;
    ibv_free_device_list @ V1_1 => fn(*mut Dev);
    ibv_open_device @ V1_1 => fn(Dev) -> Ctx;
    ibv_close_device @ V1_1 => fn(Ctx) -> c_int;
    ibv_import_device @ Some("IBVERBS_1.10") => fn(c_int) -> Ctx;
    ibv_get_async_event @ V1_1 => fn(Ctx, *mut ibv_async_event) -> c_int;
    ibv_ack_async_event @ V1_1 => fn(*mut ibv_async_event);
    ibv_query_device @ V1_1 => fn(Ctx, *mut ibv_device_attr) -> c_int;
    ibv_query_port @ V1_1 => fn(Ctx, u8, *mut ibv_port_attr) -> c_int;
    ibv_query_gid @ V1_1 => fn(Ctx, u8, c_int, *mut ibv_gid) -> c_int;
    _ibv_query_gid_ex @ Some("IBVERBS_1.11") => fn(Ctx, u32, u32, *mut ibv_gid_entry, u32, usize) -> c_int;
    _ibv_query_gid_table @ Some("IBVERBS_1.11") => fn(Ctx, *mut ibv_gid_entry, usize, u32, usize) -> isize;
    ibv_query_gid_type @ PRIVATE => fn(Ctx, u8, c_uint, *mut c_uint) -> c_int;
    ibv_query_pkey @ V1_1 => fn(Ctx, u8, c_int, *mut u16) -> c_int;
    ibv_get_pkey_index @ Some("IBVERBS_1.5") => fn(Ctx, u8, u16) -> c_int;
    ibv_alloc_pd @ V1_1 => fn(Ctx) -> *mut ibv_pd;
    ibv_dealloc_pd @ V1_1 => fn(*mut ibv_pd) -> c_int;
    ibv_import_pd @ Some("IBVERBS_1.10") => fn(Ctx, u32) -> *mut ibv_pd;
    ibv_unimport_pd @ Some("IBVERBS_1.10") => fn(*mut ibv_pd);
    ibv_reg_mr @ V1_1 => fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;
    ibv_reg_mr_iova @ Some("IBVERBS_1.7") => fn(*mut ibv_pd, *mut c_void, usize, u64, c_int) -> *mut ibv_mr;
    ibv_reg_mr_iova2 @ Some("IBVERBS_1.8") => fn(*mut ibv_pd, *mut c_void, usize, u64, c_uint) -> *mut ibv_mr;
    ibv_reg_dmabuf_mr @ Some("IBVERBS_1.12") => fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr;
    ibv_rereg_mr @ V1_1 => fn(*mut ibv_mr, c_int, *mut ibv_pd, *mut c_void, usize, c_int) -> c_int;
    ibv_dereg_mr @ V1_1 => fn(*mut ibv_mr) -> c_int;
    ibv_import_mr @ Some("IBVERBS_1.10") => fn(*mut ibv_pd, u32) -> *mut ibv_mr;
    ibv_unimport_mr @ Some("IBVERBS_1.10") => fn(*mut ibv_mr);
    ibv_import_dm @ Some("IBVERBS_1.13") => fn(Ctx, u32) -> *mut ibv_dm;
    ibv_unimport_dm @ Some("IBVERBS_1.13") => fn(*mut ibv_dm);
    ibv_create_comp_channel @ V1_0 => fn(Ctx) -> *mut ibv_comp_channel;
    ibv_destroy_comp_channel @ V1_0 => fn(*mut ibv_comp_channel) -> c_int;
    ibv_create_cq @ V1_1 => fn(Ctx, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq;
    ibv_resize_cq @ V1_1 => fn(*mut ibv_cq, c_int) -> c_int;
    ibv_destroy_cq @ V1_1 => fn(*mut ibv_cq) -> c_int;
    ibv_get_cq_event @ V1_1 => fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int;
    ibv_ack_cq_events @ V1_1 => fn(*mut ibv_cq, c_uint);
    ibv_create_srq @ V1_1 => fn(*mut ibv_pd, *mut ibv_srq_init_attr) -> *mut ibv_srq;
    ibv_modify_srq @ V1_1 => fn(*mut ibv_srq, *mut ibv_srq_attr, c_int) -> c_int;
    ibv_query_srq @ V1_1 => fn(*mut ibv_srq, *mut ibv_srq_attr) -> c_int;
    ibv_destroy_srq @ V1_1 => fn(*mut ibv_srq) -> c_int;
    ibv_create_qp @ V1_1 => fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
    ibv_query_qp @ V1_1 => fn(*mut ibv_qp, *mut ibv_qp_attr, c_int, *mut ibv_qp_init_attr) -> c_int;
    ibv_modify_qp @ V1_1 => fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
    ibv_destroy_qp @ V1_1 => fn(*mut ibv_qp) -> c_int;
    ibv_qp_to_qp_ex @ Some("IBVERBS_1.6") => fn(*mut ibv_qp) -> *mut ibv_qp_ex;
    ibv_query_ece @ Some("IBVERBS_1.10") => fn(*mut ibv_qp, *mut ibv_ece) -> c_int;
    ibv_set_ece @ Some("IBVERBS_1.10") => fn(*mut ibv_qp, *mut ibv_ece) -> c_int;
    ibv_query_qp_data_in_order @ Some("IBVERBS_1.14") => fn(*mut ibv_qp, c_uint, u32) -> c_int;
    ibv_create_ah @ V1_1 => fn(*mut ibv_pd, *mut ibv_ah_attr) -> *mut ibv_ah;
    ibv_destroy_ah @ V1_1 => fn(*mut ibv_ah) -> c_int;
    ibv_init_ah_from_wc @ V1_1 => fn(Ctx, u8, *mut ibv_wc, *mut ibv_grh, *mut ibv_ah_attr) -> c_int;
    ibv_create_ah_from_wc @ V1_1 => fn(*mut ibv_pd, *mut ibv_wc, *mut ibv_grh, u8) -> *mut ibv_ah;
    ibv_resolve_eth_l2_from_gid @ V1_1 => fn(Ctx, *mut ibv_ah_attr, *mut u8, *mut u16) -> c_int;
    ibv_attach_mcast @ V1_1 => fn(*mut ibv_qp, *const ibv_gid, u16) -> c_int;
    ibv_detach_mcast @ V1_1 => fn(*mut ibv_qp, *const ibv_gid, u16) -> c_int;
    ibv_fork_init @ V1_1 => fn() -> c_int;
    ibv_is_fork_initialized @ Some("IBVERBS_1.13") => fn() -> c_uint;
    ibv_dontfork_range @ V1_1 => fn(*mut c_void, usize) -> c_int;
    ibv_dofork_range @ V1_1 => fn(*mut c_void, usize) -> c_int;
}

fn lookup(handle: *mut c_void, name: &str, version: Option<&str>) -> *mut c_void {
    let cname = CString::new(name).expect("symbol names have no NUL");
    let p = match version {
        Some(v) => {
            let cver = CString::new(v).expect("versions have no NUL");
            // SAFETY: handle is a live dlopen handle, both strings are C strings.
            unsafe { libc::dlvsym(handle, cname.as_ptr(), cver.as_ptr()) }
        }
        // SAFETY: as above.
        None => unsafe { libc::dlsym(handle, cname.as_ptr()) },
    };
    if p.is_null() {
        klog!(Level::Debug, "real libibverbs has no {name}@{}", version.unwrap_or("default"));
    }
    p
}

fn load() -> std::result::Result<RealVerbs, String> {
    let path = &crate::config::get().ibverbs_lib;
    crate::kmark!("real: loading {path}");
    // RTLD_NOW: fail here rather than at a first call deep in a data path.
    // SAFETY: loading libibverbs runs its constructors, which have no
    // preconditions on us.
    let lib = unsafe { libloading::os::unix::Library::open(Some(path), libc::RTLD_NOW | libc::RTLD_LOCAL) }
        .map_err(|e| format!("cannot load {path}: {e}"))?;
    crate::kmark!("real: loaded");
    // Never unloaded: real objects and provider code outlive any handle.
    let handle = lib.into_raw();
    let table = RealVerbs::resolve(handle);
    if table.ibv_open_device.is_none() || table.ibv_create_qp.is_none() {
        return Err(format!("{path} is not libibverbs (no ibv_open_device@IBVERBS_1.1)"));
    }
    crate::kmark!("real: functions resolved");
    klog!(Level::Info, "loaded real libibverbs from {path}");
    Ok(table)
}

static REAL: Lazy<std::result::Result<RealVerbs, String>> = Lazy::new(|| {
    let r = load();
    if let Err(e) = &r {
        // Always said, whatever KRCORE_LOG: every verb will fail with ENOSYS.
        let line = format!("krcore: {e}\n");
        // SAFETY: writing an initialised buffer to fd 2.
        unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
    }
    r
});

/// The real function table, or ENOSYS when libibverbs could not be loaded.
#[inline]
pub fn real() -> Result<&'static RealVerbs> {
    REAL.as_ref().map_err(|_| Errno::ENOSYS)
}

/// A resolved real function, or ENOSYS/EOPNOTSUPP when it is missing.
#[inline]
pub fn need<F>(f: Option<F>) -> Result<F> {
    f.ok_or(Errno::EOPNOTSUPP)
}

/// Shorthand: `call!(ibv_alloc_pd(ctx))` is the real function's result, or
/// an `Errno` when the library or the symbol is missing.
#[macro_export]
macro_rules! call_real {
    ($f:ident($($a:expr),* $(,)?)) => {
        match $crate::real::real().and_then(|r| $crate::real::need(r.$f)) {
            // SAFETY: the caller passes real (never wrapped) objects and the
            // argument contract of the libibverbs function it names.
            Ok(f) => Ok(unsafe { f($($a),*) }),
            Err(e) => Err(e),
        }
    };
}

/// The real `verbs_context` around a real `ibv_context`, when extended.
///
/// # Safety
/// `ctx` must be a live context created by the real libibverbs.
pub unsafe fn verbs_ctx(ctx: *mut ibv_context) -> Option<*mut verbs_context> {
    // SAFETY: ctx is live (caller contract).
    if unsafe { (*ctx).abi_compat } as usize != usize::MAX {
        return None;
    }
    let off = std::mem::offset_of!(verbs_context, context);
    Some(ctx.cast::<u8>().wrapping_sub(off).cast())
}

/// `verbs_get_ctx_op()` of verbs.h for a real context: the extended op, if
/// the real context is extended, large enough to have it, and sets it.
#[macro_export]
macro_rules! real_ctx_op {
    ($ctx:expr, $op:ident) => {{
        // SAFETY: $ctx is a live real context (caller contract).
        match unsafe { $crate::real::verbs_ctx($ctx) } {
            None => None,
            Some(v) => {
                let need = std::mem::size_of::<$crate::sys::verbs_context>() - std::mem::offset_of!($crate::sys::verbs_context, $op);
                // SAFETY: v is the verbs_context that holds $ctx; sz is read
                // first, and the op only when sz says it exists.
                unsafe {
                    if (*v).sz < need {
                        None
                    } else {
                        (*v).$op
                    }
                }
            }
        }
    }};
}
