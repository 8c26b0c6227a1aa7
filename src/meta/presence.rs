//! Which processes a meta server's open connections vouch for.
//!
//! A process that binds nothing has no entry whose lease says it lives,
//! but it holds a connection to the meta server for its lookups, and the
//! kernel closes that connection the moment the process dies. Each
//! `Hello` names the incarnation of the process's service endpoint, and a
//! connection counts for (incarnation, GID) once it proved that GID (the
//! proof every connection makes of its own GID, as for a binding under
//! it); a peer that doubts the process asks with both
//! ([`super::proto::PresenceQuery`]).
//!
//! So a stranger on another host cannot make a process look gone or
//! alive: it cannot prove the process's GID. A local one can name a
//! process's incarnation in a `Hello` of its own; an open connection wins
//! (closing its own does not make a connected process look gone), and a
//! dead process it makes look connected is still given up by the peer's
//! datagram tier within its bound (`LIVE_BOUND_US`), as one with no sign
//! at all.
//!
//! A process attached to its host's agent (`krcore-node`) may have no
//! connection of its own: the agent vouches for it on its connection
//! ([`super::proto::Op::Vouch`], under a GID the agent's connection
//! proved), says when it exited (departed) or when it only lost sight of
//! it (released: unknown), and its vouches are released with its
//! connection (an agent that dies says nothing of its processes).

use super::proto::Presence;
use crate::rdma::Gid;
use crate::recent::Recent;
use std::collections::HashMap;

/// A process as a connection vouches for it: its incarnation and a GID the
/// connection proved.
pub type Proven = (u64, Gid);

/// Departed incarnations remembered (the oldest is forgotten: asked about
/// after that, it is unknown, as a process never connected).
pub const MAX_DEPARTED: usize = 1 << 16;

pub struct Presences {
    /// Open connections per (incarnation, GID).
    open: HashMap<Proven, u32>,
    /// Those with no open connection left.
    departed: Recent<Proven>,
}

impl Default for Presences {
    fn default() -> Self {
        Presences { open: HashMap::new(), departed: Recent::new(MAX_DEPARTED) }
    }
}

impl Presences {
    /// A connection naming incarnation `p.0` proved GID `p.1` (incarnation
    /// 0: it names none).
    pub fn connected(&mut self, p: Proven) {
        if p.0 == 0 {
            return;
        }
        *self.open.entry(p).or_default() += 1;
        self.departed.remove(&p);
    }

    /// A connection that counted for `p` closed.
    pub fn disconnected(&mut self, p: Proven) {
        if self.uncount(p) {
            self.departed.insert(p);
        }
    }

    /// A connection that counted for `p` stopped vouching for it without
    /// knowing that it ended (an agent's connection closed, or the agent
    /// lost sight of a process that may live): with no other, unknown.
    pub fn released(&mut self, p: Proven) {
        self.uncount(p);
    }

    /// One connection fewer counts for `p`: whether it was the last.
    fn uncount(&mut self, p: Proven) -> bool {
        let Some(n) = self.open.get_mut(&p) else { return false };
        *n -= 1;
        if *n > 0 {
            return false;
        }
        self.open.remove(&p);
        true
    }

    pub fn of(&self, p: Proven) -> Presence {
        if p.0 != 0 && self.open.contains_key(&p) {
            Presence::Connected
        } else if self.departed.contains(&p) {
            Presence::Departed
        } else {
            Presence::Unknown
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: Gid = [7; 16];
    const H: Gid = [8; 16];

    #[test]
    fn connected_until_its_last_connection_closes() {
        let mut p = Presences::default();
        assert_eq!(p.of((7, G)), Presence::Unknown);
        p.connected((7, G));
        assert_eq!(p.of((7, G)), Presence::Connected);
        // Only under the GID it proved.
        assert_eq!(p.of((7, H)), Presence::Unknown);
        // A second connection naming it (a stranger's on its host, or a
        // replica reconnect) closing leaves it connected.
        p.connected((7, G));
        p.disconnected((7, G));
        assert_eq!(p.of((7, G)), Presence::Connected);
        p.disconnected((7, G));
        assert_eq!(p.of((7, G)), Presence::Departed);
        // A stranger on another host (its own GID proven) closing a
        // connection that named the incarnation: not the process's.
        p.connected((9, H));
        p.disconnected((9, H));
        assert_eq!(p.of((9, G)), Presence::Unknown);
        // A close of nothing known changes nothing.
        p.disconnected((7, G));
        p.disconnected((8, G));
        assert_eq!(p.of((8, G)), Presence::Unknown);
        // Connected again (a reconnect after a lost connection).
        p.connected((7, G));
        assert_eq!(p.of((7, G)), Presence::Connected);
        assert_eq!(p.departed.len(), 1, "(9, H)");
    }

    #[test]
    fn released_is_unknown_not_departed() {
        let mut p = Presences::default();
        p.connected((7, G));
        p.connected((7, G));
        p.released((7, G));
        assert_eq!(p.of((7, G)), Presence::Connected, "another connection vouches still");
        p.released((7, G));
        assert_eq!(p.of((7, G)), Presence::Unknown);
        // Released, never departed: a departure after is of nothing open.
        p.disconnected((7, G));
        assert_eq!(p.of((7, G)), Presence::Unknown);
        p.released((8, G));
        assert_eq!(p.of((8, G)), Presence::Unknown);
    }

    #[test]
    fn incarnation_zero_names_no_process() {
        let mut p = Presences::default();
        p.connected((0, G));
        assert_eq!(p.of((0, G)), Presence::Unknown);
        p.disconnected((0, G));
        assert_eq!(p.of((0, G)), Presence::Unknown);
    }

    #[test]
    fn departed_memory_is_bounded_oldest_forgotten() {
        let mut p = Presences::default();
        for i in 1..=(MAX_DEPARTED as u64 + 10) {
            p.connected((i, G));
            p.disconnected((i, G));
        }
        assert_eq!(p.departed.len(), MAX_DEPARTED);
        assert_eq!(p.of((1, G)), Presence::Unknown);
        assert_eq!(p.of((10, G)), Presence::Unknown);
        assert_eq!(p.of((11, G)), Presence::Departed);
        assert_eq!(p.of((MAX_DEPARTED as u64 + 10, G)), Presence::Departed);
        assert!(p.open.is_empty());
    }
}
