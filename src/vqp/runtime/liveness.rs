//! Whether a peer process that does not answer lives: the meta server is
//! the authority (a binding stays only while its process renews the
//! lease). A process starved of CPU (a burst of new processes on its
//! host) answers the datagram tier and link handshakes seconds late,
//! where an RC responder's NIC would have answered for it; taking it for
//! gone after `KRCORE_CONNECT_TIMEOUT_MS` failed live connections. Before
//! a process is taken for gone, its binding is looked up again: still
//! there, the process is vouched for and waited for (at most
//! [`LIVE_BOUND`]); gone, it is gone.

use super::Runtime;
use crate::klog;
use crate::log::Level;
use crate::meta::{Endpoint, Key};
use std::sync::Arc;
use std::time::Duration;

/// How long a process whose binding stays is waited for, from its first
/// unanswered handshake or its flows' last retry (the tier's own bound).
pub const LIVE_BOUND: Duration = Duration::from_micros(crate::transport::dgram::port::LIVE_BOUND_US);

/// Peer processes whose keys are remembered (the oldest is forgotten:
/// its silence is then not looked into, and it fails at the old bounds).
pub(super) const MAX_KEYS: usize = 4096;

/// What the meta server says of a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// Its binding is there: it renewed its lease lately.
    Bound,
    /// Its binding is gone, or names another process now.
    Unbound,
    /// Nothing to ask by, or the meta server did not answer.
    Unknown,
}

impl Runtime {
    /// `key` resolved to `ep`: what to look up should `ep`'s process go
    /// silent. Only a binding the process could have made vouches for it:
    /// an address under its own GID (a meta server takes an address only
    /// under a GID its binder proved, so a process on another host cannot
    /// keep a dead one looking alive), or a VQPN it published.
    pub(crate) fn remember_key(&self, key: &Key, ep: &Endpoint) {
        let vouches = match key {
            Key::Port { gid, .. } => *gid == ep.gid,
            Key::Vqpn { .. } => true,
        };
        if vouches {
            self.keys.lock().insert(ep.incarnation, *key);
        }
    }

    /// Look process `incarnation`'s binding up again (one READ of the meta
    /// server's table, or the agent's; blocks up to the connect timeout).
    pub(super) fn liveness(&self, incarnation: u64) -> Liveness {
        let Some(key) = self.keys.lock().get(&incarnation).copied() else { return Liveness::Unknown };
        match self.resolve(&key, true) {
            Ok(Some(ep)) if ep.incarnation == incarnation => Liveness::Bound,
            Ok(_) => Liveness::Unbound,
            Err(e) => {
                klog!(Level::Debug, "vqp: looking up a silent peer's binding failed: {e:?}");
                Liveness::Unknown
            }
        }
    }

    /// [`crate::transport::dgram::port::Host::doubt`]: a thread of its own
    /// asks the meta server (one per process at a time), and vouches for
    /// the process or not.
    pub(crate) fn doubt_process(&self, incarnation: u64) -> bool {
        if self.keys.lock().get(&incarnation).is_none() {
            return false;
        }
        if !self.doubting.lock().insert(incarnation) {
            return true;
        }
        let weak = self.weak_self();
        let body = move || {
            let Some(rt) = weak.upgrade() else { return };
            let found = rt.liveness(incarnation);
            rt.doubting.lock().remove(&incarnation);
            let valid = match found {
                Liveness::Bound => {
                    crate::stats::inc(crate::stats::Stat::KRCORE_STAT_PEERS_VOUCHED);
                    klog!(Level::Info, "vqp: a peer process is slow to answer the datagram tier, but its binding stays: waiting for it");
                    // Looked at again when this runs out: a lease renewed
                    // within the last lease is no older proof than this.
                    Some(super::connect_timeout())
                }
                Liveness::Unbound | Liveness::Unknown => None,
            };
            rt.dgram.vouch(&*rt, incarnation, valid);
        };
        if std::thread::Builder::new().name("krcore-doubt".into()).spawn(body).is_err() {
            self.doubting.lock().remove(&incarnation);
            return false;
        }
        true
    }

    /// A link handshake to `peer` timed out `since` its first try: try
    /// again while its binding stays (and [`LIVE_BOUND`] has not passed).
    pub(super) fn wait_for_silent(self: &Arc<Self>, peer: &Endpoint, since: std::time::Instant) -> bool {
        if since.elapsed() >= LIVE_BOUND || self.liveness(peer.incarnation) != Liveness::Bound {
            return false;
        }
        crate::stats::inc(crate::stats::Stat::KRCORE_STAT_PEERS_VOUCHED);
        klog!(Level::Info, "vqp: no link to {:02x?} within the connect timeout, but its binding stays: asking again", peer.gid);
        true
    }
}
