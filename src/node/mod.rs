//! `krcore-node`: the per-host agent, and a process's side of it.
//!
//! KRCORE's connect is microseconds even in a process that has just
//! started because what it needs exists before the process does. In user
//! space the one place that can hold it is a long-lived process on each
//! host: the agent (`src/bin/krcore-node.rs`). It holds the host's
//! connection to the meta server(s) and the DCCache every process of the
//! host shares, so that a new process's first `qconnect` resolves its
//! peer with one unix-socket round trip, and a burst of new processes
//! asking for one address costs the meta server one READ.
//!
//! - `proto`: the messages on the unix socket (fixed length, strict codec);
//! - `ring`: the work requests and completions in a staging region's shared memory;
//! - `agent`: the agent's loop (its listener, `SO_PEERCRED`, lookups);
//! - `client`: a process's attachment (found through `KRCORE_NODE`).

pub mod agent;
pub mod client;
pub mod path;
pub mod presence;
pub mod proto;
pub mod ring;
pub mod warm;

/// Where the agent listens and a process looks for it when `KRCORE_NODE`
/// is not set: `$XDG_RUNTIME_DIR/krcore-node.sock` (a directory only its
/// user may enter), else `/tmp/krcore-node-<uid>.sock`.
pub fn default_socket() -> std::path::PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(dir) => std::path::Path::new(&dir).join("krcore-node.sock"),
        // SAFETY: geteuid has no preconditions.
        None => format!("/tmp/krcore-node-{}.sock", unsafe { libc::geteuid() }).into(),
    }
}

/// Which meta servers `addrs` names, as one number: an agent serves a
/// process only for the meta servers the process itself would ask (the
/// same list, in any order).
pub fn meta_fingerprint(addrs: &[std::net::SocketAddr]) -> u64 {
    let mut names: Vec<String> = addrs.iter().map(ToString::to_string).collect();
    names.sort();
    names.dedup();
    // FNV-1a: stable across builds and processes (std's hasher is not).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in names.join(",").bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}
