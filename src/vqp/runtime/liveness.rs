//! Whether a peer process that does not answer lives: the meta server is
//! the authority (a binding stays only while its process renews the
//! lease). A process starved of CPU (a burst of new processes on its
//! host) answers the datagram tier and link handshakes seconds late,
//! where an RC responder's NIC would have answered for it; taking it for
//! gone after `KRCORE_CONNECT_TIMEOUT_MS` failed live connections. Before
//! a process is taken for gone, its binding is looked up again, or, with
//! no binding known (a client that binds nothing), the meta server is
//! asked whether the process's own connection to it is open (the kernel
//! closes it when the process dies: `meta::presence`): there, it is
//! vouched for and waited for (a flow at most `LIVE_BOUND_US` after it ran
//! out of retries); gone, it is gone. With neither to ask (no meta server,
//! a process attached to its host's agent), a process that sent to us
//! lately is vouched for.

use super::Runtime;
use crate::klog;
use crate::log::Level;
use crate::meta::proto::Presence;
use crate::meta::{Endpoint, Key};
use crate::transport::dgram::port::Peer;

/// Peer processes whose keys are remembered (the oldest is forgotten:
/// its silence is then not looked into, and it fails at the old bounds).
pub(super) const MAX_KEYS: usize = 4096;

/// What the meta server says of a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// Its binding is there (it renewed its lease lately), or, with no
    /// binding known, its connection to the meta server is open.
    Alive,
    /// Its binding is gone or names another process now, or, with no
    /// binding known, its connection to the meta server closed.
    Gone,
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
            self.keys.lock().insert(ep.incarnation, (*key, *ep));
        }
    }

    /// Look process `incarnation`'s binding up again (one READ of the meta
    /// server's table, or the agent's), or, with none known, ask whether
    /// its meta-server connection from `gid` (its endpoint's) is open (a
    /// short TCP exchange per replica). Blocks up to the connect timeout
    /// for each.
    pub(super) fn liveness(&self, incarnation: u64, gid: &crate::rdma::Gid) -> Liveness {
        let known = self.keys.lock().get(&incarnation).copied();
        if let Some((key, _)) = known {
            match self.resolve(&key, true) {
                Ok(Some(ep)) if ep.incarnation == incarnation => return Liveness::Alive,
                Ok(_) => return Liveness::Gone,
                Err(e) => klog!(Level::Debug, "vqp: looking up a silent peer's binding failed: {e:?}"),
            }
        }
        let Some(addrs) = crate::config::get().meta.as_deref().and_then(|s| crate::meta::client::parse_addrs(s).ok()) else {
            return Liveness::Unknown;
        };
        crate::stats::inc(crate::stats::Stat::KRCORE_STAT_PRESENCE_QUERIES);
        match crate::meta::client::presence(&addrs, incarnation, gid, super::connect_timeout()) {
            Presence::Connected => Liveness::Alive,
            Presence::Departed => Liveness::Gone,
            Presence::Unknown => Liveness::Unknown,
        }
    }

    /// [`crate::transport::dgram::port::Host::doubt`]: a thread of its own
    /// (one per process at a time) finds out and vouches for the process
    /// or not. Alive: still bound or connected to the meta server, or,
    /// with neither to ask, heard from on the tier lately. Gone: its
    /// VQPs move to the error state.
    pub(crate) fn doubt_process(&self, incarnation: u64, peer: &Peer) -> bool {
        self.find_out(incarnation, peer, peer.dgid)
    }

    /// [`Self::doubt_process`] of the process of endpoint GID `gid`, at
    /// `peer` (also asked when a link to it that it never confirmed fails:
    /// `peer` then names the link's end).
    pub(super) fn find_out(&self, incarnation: u64, peer: &Peer, gid: crate::rdma::Gid) -> bool {
        if !self.doubting.lock().insert(incarnation) {
            return true;
        }
        let weak = self.weak_self();
        let peer = *peer;
        let body = move || {
            let Some(rt) = weak.upgrade() else { return };
            let timeout = super::connect_timeout();
            // Its binding or its meta-server connection says (a killed
            // process's go at once); with neither, heard within the
            // tier's bound: a process that sent its last seconds ago may
            // be starved still (a killed one is waited for that long).
            let found = rt.liveness(incarnation, &gid);
            let within = std::time::Duration::from_micros(crate::transport::dgram::port::LIVE_BOUND_US);
            let heard = found == Liveness::Unknown && rt.dgram.heard_from(incarnation, peer.qpn, &[peer.dgid], within);
            let alive = heard || found == Liveness::Alive;
            rt.doubting.lock().remove(&incarnation);
            // With no flow and no link to it (an unconfirmed link of its
            // failed), nothing else looks into its silence again: unvouched,
            // it is gone now; vouched for by its traffic alone, it is looked
            // at again once that vouch runs out (else it could stay alive
            // for good: likely `vqp_popmsgs`'s rare killed sender never
            // taken for gone).
            let unwatched = !rt.dgram.has_flows_to(incarnation) && !rt.svc.live_links().iter().any(|l| l.peer.incarnation == incarnation);
            if heard && unwatched {
                let weak = rt.weak_self();
                rt.svc.defer(
                    std::time::Instant::now() + timeout,
                    Box::new(move || {
                        if let Some(rt) = weak.upgrade() {
                            rt.find_out(incarnation, &peer, gid);
                        }
                    }),
                );
            }
            if found == Liveness::Gone || (!alive && unwatched) {
                // Silent and gone (its lease ran out, it unbound, or its
                // connection closed): its idle VQPs too, as when a link to
                // it fails.
                let known = rt.keys.lock().get(&incarnation).map(|&(_, ep)| ep);
                let ep = known.unwrap_or(Endpoint { gid, qpn: peer.qpn, qkey: peer.qkey, incarnation, vqpn: 0 });
                rt.peer_is_gone(ep, 0, rt.svc.default_path(&ep));
            }
            if alive {
                crate::stats::inc(crate::stats::Stat::KRCORE_STAT_PEERS_VOUCHED);
                klog!(
                    Level::Info,
                    "vqp: a peer process that does not answer lives ({}): waiting for it",
                    if heard { "it sends to us" } else { "the meta server vouches for it" }
                );
            }
            // Looked at again when this runs out: a lease renewed within
            // the last lease is no older proof than this.
            rt.dgram.vouch(&*rt, incarnation, alive.then_some(timeout));
        };
        if std::thread::Builder::new().name("krcore-doubt".into()).spawn(body).is_err() {
            self.doubting.lock().remove(&incarnation);
            return false;
        }
        true
    }
}
