//! krcore: a libibverbs interposition library.
//!
//! The crate builds `libkrcore.so`, which exports the `ibv_*` symbols, hands
//! out its own verbs objects (whose function pointers point back here) and
//! forwards to the real libibverbs that it loads with `dlopen`.
//!
//! Layering (see docs/ARCHITECTURE.md):
//! - [`abi`]: the only `#[no_mangle]` items, thin: panic boundary, ours-vs-
//!   foreign check, then a call into one of the modules below.
//! - [`real`]: the real libibverbs, resolved once with pinned symbol versions.
//! - [`obj`]: wrapper objects laid out like the libibverbs structs.
//! - [`vqp`]: the QP data path (today a forwarder to one physical QP).
//! - [`transport`]: the transports under VQPs (so far the datagram tier's
//!   core, not yet called by the VQP path).
//! - [`config`], [`log`], [`stats`]: plumbing.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]
// call_real!/real_ctx_op! take FFI arguments, which are raw by nature.
#![allow(clippy::macro_metavars_in_unsafe)]

pub mod abi;
pub mod clock;
pub mod codec;
pub mod config;
pub mod error;
pub mod log;
pub mod meta;
pub mod mr;
pub mod node;
pub mod obj;
pub mod poll;
pub mod rdma;
pub mod real;
pub mod recent;
pub mod service;
pub mod stats;
#[cfg(test)]
mod testing;
pub mod transport;
pub mod vqp;

/// Raw C types of libibverbs (layout only; never call functions from here:
/// inside this library they would bind to our own exports).
pub use rdma_sys as sys;

/// Process exit: stop the background deregistration thread, then report
/// the statistics (`KRCORE_STATS`, `KRCORE_STATS_FILE`).
#[ctor::dtor]
fn at_exit() {
    let _ = std::panic::catch_unwind(mr::shutdown);
    let _ = std::panic::catch_unwind(stats::report_at_exit);
}
