//! The meta server's data and the messages around it: the (GID, port) /
//! (GID, virtual QPN) -> endpoint table that `krcore-meta` serves from
//! registered memory and processes look up with one-sided READs (`table`),
//! and the messages of the bootstrap, registration and link-setup
//! protocols (`proto`), how a client proves the GIDs it binds keys
//! under (`proof`), and which processes the server's connections vouch
//! for (`presence`).

pub mod client;
pub mod presence;
pub mod proof;
pub mod proto;
pub mod server;
pub mod table;

/// What a meta-table entry is found by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Key {
    /// A `qbind(gid, port)`.
    Port { gid: [u8; 16], port: u32 },
    /// Transparent mode: a virtual QPN published on a GID.
    Vqpn { gid: [u8; 16], vqpn: u32 },
}

impl Key {
    /// The GID the key is published under.
    pub fn gid(&self) -> &[u8; 16] {
        match self {
            Key::Port { gid, .. } | Key::Vqpn { gid, .. } => gid,
        }
    }
}

/// A process's service endpoint (where link requests go), and the VQP a
/// key names inside that process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub gid: [u8; 16],
    /// The service endpoint's UD QP number.
    pub qpn: u32,
    pub qkey: u32,
    /// Chosen at random when the process starts its service endpoint:
    /// tells a restarted process at the same (GID, QPN) from the old one.
    pub incarnation: u64,
    /// The virtual QPN of the VQP the key names.
    pub vqpn: u32,
}
