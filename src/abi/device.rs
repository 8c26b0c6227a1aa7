//! Devices and contexts: open/close/import, queries, fork control.
//! Devices themselves stay real (they have no ops the data path uses).

use super::boundary;
use super::{ctx_of, foreign, is_ours, ops};
use crate::call_real;
use crate::error::Errno;
use crate::obj::{non_null, Context};
use crate::real_ctx_op;
use crate::stats::{self, Stat};
use crate::sys::*;
use libc::{c_int, c_uint, c_void};

/// Which context to hand to the real library: ours map to their real one.
fn real_ctx(ctx: *mut ibv_context) -> crate::error::Result<*mut ibv_context> {
    if ctx.is_null() {
        return Err(Errno::EINVAL);
    }
    if is_ours(ctx) {
        // SAFETY: ours.
        Ok(unsafe { Context::from_ibv(ctx) }.real)
    } else {
        stats::inc(Stat::KRCORE_STAT_FOREIGN_CALLS);
        Ok(ctx)
    }
}

fn wrap_context(real: *mut ibv_context) -> *mut ibv_context {
    // SAFETY: real is a context the real library just opened.
    let mut ctx = unsafe { Context::new(real) };
    ops::install_context_ops(&mut ctx);
    stats::inc(Stat::KRCORE_STAT_CONTEXTS_OPENED);
    crate::klog!(crate::log::Level::Info, "opened context {:p} (real {:p})", &ctx.vctx.context, real);
    ctx.into_ibv()
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut ibv_device {
    boundary::ptr("ibv_get_device_list", || {
        crate::kmark!("ibv_get_device_list: called");
        let r = call_real!(ibv_get_device_list(num_devices));
        crate::kmark!("ibv_get_device_list: returns");
        r
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    boundary::void("ibv_free_device_list", || call_real!(ibv_free_device_list(list)))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_open_device(device: *mut ibv_device) -> *mut ibv_context {
    boundary::ptr("ibv_open_device", || {
        if device.is_null() {
            return Err(Errno::EINVAL);
        }
        Ok(wrap_context(non_null(call_real!(ibv_open_device(device))?)?))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_import_device(cmd_fd: c_int) -> *mut ibv_context {
    boundary::ptr("ibv_import_device", || Ok(wrap_context(non_null(call_real!(ibv_import_device(cmd_fd))?)?)))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_close_device(context: *mut ibv_context) -> c_int {
    boundary::minus_one("ibv_close_device", || {
        if !is_ours(context) {
            return foreign!(ibv_close_device(context));
        }
        // SAFETY: ours.
        let real = unsafe { Context::from_ibv(context) }.real;
        crate::vqp::runtime::release_context(real);
        if let Some(cache) = crate::mr::cache() {
            cache.flush_context(real as usize);
        }
        let rc = call_real!(ibv_close_device(real))?;
        if rc == 0 {
            // SAFETY: the real context is closed; the application gave up its pointer.
            unsafe { Context::free(context) };
        }
        Ok(rc)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_device(context: *mut ibv_context, attr: *mut ibv_device_attr) -> c_int {
    boundary::errno("ibv_query_device", || call_real!(ibv_query_device(real_ctx(context)?, attr)))
}

/// The exported (compat) `ibv_query_port`; verbs.h normally uses the
/// context's `query_port` op instead.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_port(context: *mut ibv_context, port_num: u8, attr: *mut ibv_port_attr) -> c_int {
    boundary::errno("ibv_query_port", || call_real!(ibv_query_port(real_ctx(context)?, port_num, attr)))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid(context: *mut ibv_context, port_num: u8, index: c_int, gid: *mut ibv_gid) -> c_int {
    boundary::minus_one("ibv_query_gid", || call_real!(ibv_query_gid(real_ctx(context)?, port_num, index, gid)))
}

#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_ex(
    context: *mut ibv_context,
    port_num: u32,
    gid_index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    boundary::errno("_ibv_query_gid_ex", || {
        call_real!(_ibv_query_gid_ex(real_ctx(context)?, port_num, gid_index, entry, flags, entry_size))
    })
}

#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_table(
    context: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    boundary::value("_ibv_query_gid_table", -(libc::EIO as isize), || {
        match real_ctx(context).and_then(|c| call_real!(_ibv_query_gid_table(c, entries, max_entries, flags, entry_size))) {
            Ok(n) => n,
            Err(e) => -(e.errno() as isize),
        }
    })
}

/// Private to rdma-core (IBVERBS_PRIVATE_*), used by its own libraries.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid_type(context: *mut ibv_context, port_num: u8, index: c_uint, ty: *mut c_uint) -> c_int {
    boundary::minus_one("ibv_query_gid_type", || call_real!(ibv_query_gid_type(real_ctx(context)?, port_num, index, ty)))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_pkey(context: *mut ibv_context, port_num: u8, index: c_int, pkey: *mut u16) -> c_int {
    boundary::minus_one("ibv_query_pkey", || call_real!(ibv_query_pkey(real_ctx(context)?, port_num, index, pkey)))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_pkey_index(context: *mut ibv_context, port_num: u8, pkey: u16) -> c_int {
    boundary::value("ibv_get_pkey_index", -1, || {
        real_ctx(context).and_then(|c| call_real!(ibv_get_pkey_index(c, port_num, pkey))).unwrap_or(-1)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_resolve_eth_l2_from_gid(
    context: *mut ibv_context,
    attr: *mut ibv_ah_attr,
    eth_mac: *mut u8,
    vid: *mut u16,
) -> c_int {
    boundary::errno("ibv_resolve_eth_l2_from_gid", || call_real!(ibv_resolve_eth_l2_from_gid(real_ctx(context)?, attr, eth_mac, vid)))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_fork_init() -> c_int {
    boundary::errno("ibv_fork_init", || {
        let rc = call_real!(ibv_fork_init())?;
        if rc == 0 {
            crate::mr::check_fork_protection();
        }
        Ok(rc)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_is_fork_initialized() -> c_uint {
    // enum ibv_fork_status: IBV_FORK_UNNEEDED is 2 (the kernel copes), 0 is disabled.
    boundary::value("ibv_is_fork_initialized", 0, || call_real!(ibv_is_fork_initialized()).unwrap_or(0))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dontfork_range(base: *mut c_void, size: usize) -> c_int {
    boundary::errno("ibv_dontfork_range", || call_real!(ibv_dontfork_range(base, size)))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dofork_range(base: *mut c_void, size: usize) -> c_int {
    boundary::errno("ibv_dofork_range", || call_real!(ibv_dofork_range(base, size)))
}

/// Device memory is not wrapped: importing it into one of our contexts is
/// refused (EOPNOTSUPP), foreign contexts pass through.
#[no_mangle]
pub unsafe extern "C" fn ibv_import_dm(context: *mut ibv_context, dm_handle: u32) -> *mut ibv_dm {
    boundary::ptr("ibv_import_dm", || {
        if is_ours(context) {
            return Err(Errno::EOPNOTSUPP);
        }
        foreign!(ibv_import_dm(context, dm_handle))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_dm(dm: *mut ibv_dm) {
    boundary::void("ibv_unimport_dm", || foreign!(ibv_unimport_dm(dm)))
}

/// The context's `query_port` op.
pub(super) unsafe extern "C" fn query_port_op(context: *mut ibv_context, port_num: u8, attr: *mut ibv_port_attr, attr_len: usize) -> c_int {
    boundary::errno("query_port", || {
        let real = ctx_of(context)?.real;
        match real_ctx_op!(real, query_port) {
            // SAFETY: the real context's own op with its own context.
            Some(op) => Ok(unsafe { op(real, port_num, attr, attr_len) }),
            None => call_real!(ibv_query_port(real, port_num, attr)),
        }
    })
}

/// The context's `query_device_ex` op.
pub(super) unsafe extern "C" fn query_device_ex_op(
    context: *mut ibv_context,
    input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    boundary::errno("query_device_ex", || {
        let real = ctx_of(context)?.real;
        let op = real_ctx_op!(real, query_device_ex).ok_or(Errno::EOPNOTSUPP)?;
        // SAFETY: the real context's own op.
        Ok(unsafe { op(real, input, attr, attr_size) })
    })
}
