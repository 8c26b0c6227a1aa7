//! The krcore C API (the only file, with stats.rs, that cbindgen reads into
//! include/krcore.h).

use crate::abi::boundary;
use crate::stats;
use crate::sys::{ibv_gid, ibv_qp, ibv_wc};
use libc::{c_char, c_int, size_t};

/// The `qp_type` that makes `ibv_create_qp` / `ibv_create_qp_ex` return a
/// virtual QP (VQP): reliable and in order like RC, multiplexed with other
/// VQPs on shared physical QPs, connected with `qconnect` or bound with
/// `qbind` (no `ibv_modify_qp` needed). Outside `enum ibv_qp_type`.
pub const KRCORE_VQP: u32 = 0x4b52;

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

/// 1 when this process is attached to its host's agent (`krcore-node`
/// listening at `KRCORE_NODE`, run by this user or root, serving the meta
/// servers of `KRCORE_META`), else 0. Attaches first when it is not and
/// has not looked within the last second; the library also attaches by
/// itself at the start of a PD's runtime (the first `ibv_alloc_pd` with
/// `KRCORE_META` set, or the first extended verb). Thread-safe.
#[no_mangle]
pub extern "C" fn krcore_node_attached() -> c_int {
    boundary::value("krcore_node_attached", 0, || crate::node::client::attach() as c_int)
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

/// Bind the VQP `qp` to (`gid`, `port`): messages other processes send to
/// that address arrive at it, and come out of `qpop_msgs`. `gid` must be one
/// of the device's GIDs; the binding is published in the meta server
/// (`KRCORE_META`) with a lease the library renews, and removed when the VQP
/// is destroyed or the process exits.
///
/// Returns 0, or an errno value: EINVAL (`qp` is not a VQP, or already bound
/// or connected), EADDRNOTAVAIL (`gid` is not on this device), EADDRINUSE
/// (some VQP anywhere is bound there), EDQUOT (this process holds the
/// entries a meta server allows one client, `krcore-meta
/// --max-entries-per-client`), ENOTCONN (`KRCORE_META` is unset: a log
/// line says what to set), ECONNREFUSED / ETIMEDOUT (no meta server
/// answers).
///
/// # Safety
/// `qp` is a QP returned by this library, or NULL (EINVAL).
#[no_mangle]
pub unsafe extern "C" fn qbind(qp: *mut ibv_qp, gid: ibv_gid, port: c_int) -> c_int {
    // SAFETY: caller contract; ibv_gid is plain bytes.
    boundary::errno("qbind", || unsafe { crate::vqp::api::qbind(qp, gid.raw, port) })
}

/// Connect the VQP `qp` to the VQP bound at (`gid`, `port`): afterwards
/// `ibv_post_send` on `qp` sends messages to it and reads, writes and
/// atomics reach that process's registered memory. Costs a lookup (one
/// RDMA READ of the meta server: who holds the address now, so that a
/// server restarted there is reached even before this process found the
/// old one dead) and, for a process this one has no link to yet, a link
/// handshake.
///
/// Returns 0, or an errno value: EINVAL (`qp` is not a VQP, or already
/// connected or bound), ECONNREFUSED (nothing is bound there, or the
/// process that bound it is gone), ETIMEDOUT (the address is bound but its
/// process did not answer within `KRCORE_CONNECT_TIMEOUT_MS`), ENOTCONN
/// (`KRCORE_META` is unset).
///
/// # Safety
/// `qp` is a QP returned by this library, or NULL (EINVAL).
#[no_mangle]
pub unsafe extern "C" fn qconnect(qp: *mut ibv_qp, gid: ibv_gid, port: c_int) -> c_int {
    // SAFETY: caller contract; ibv_gid is plain bytes.
    boundary::errno("qconnect", || unsafe { crate::vqp::api::qconnect(qp, gid.raw, port) })
}

/// Take up to `num_entries` messages received by the bound VQP `qp`:
/// `wc[i]` is the receive completion (of a buffer posted with
/// `ibv_post_recv` on `qp`) and `src_qp[i]` a VQP connected back to the
/// sender, ready for `ibv_post_send` replies (their send completions go to
/// `qp`'s send CQ). A bound VQP's receive completions come out here only,
/// never through `ibv_poll_cq`.
///
/// The library owns every `src_qp`: one per sending VQP, reused for all its
/// messages. When the sender destroys its VQP, the `src_qp` is reported
/// once more, after the sender's last message, with `wc[i].status ==
/// IBV_WC_WR_FLUSH_ERR` (`byte_len` 0, no receive buffer consumed, like a
/// disconnect event); it stays valid until the next `qpop_msgs` call on
/// `qp`, which destroys it once the work the application posted on it has
/// completed (its completions reach the CQ first), so that a server that
/// serves any number of short-lived clients in turn keeps its memory
/// flat. All of them are destroyed with `qp`. The application may also destroy one early with
/// `ibv_destroy_qp`; a later message from that sender then gets a new one.
///
/// Returns the number of entries (0 when none is waiting), or a negative
/// errno: -EINVAL (`qp` is not a bound VQP, `num_entries` < 0, or a NULL
/// array), -ENOMEM (a `src_qp` could not be made). It never blocks: it
/// never waits for the network (a `src_qp` for a sender whose link is gone
/// gets one at its first post; for a sender whose process died it is in
/// the error state: posts on it are flushed). An error met after messages
/// were taken returns those messages, and the error at the next call; the
/// message it met stays queued, so no message is lost.
///
/// # Safety
/// `qp` is a QP of this library; `src_qp` and `wc` are valid for
/// `num_entries` writes.
#[no_mangle]
pub unsafe extern "C" fn qpop_msgs(qp: *mut ibv_qp, num_entries: c_int, src_qp: *mut *mut ibv_qp, wc: *mut ibv_wc) -> c_int {
    // SAFETY: caller contract.
    boundary::value("qpop_msgs", -libc::EIO, || unsafe { crate::vqp::api::qpop_msgs(qp, num_entries, src_qp, wc) })
}
