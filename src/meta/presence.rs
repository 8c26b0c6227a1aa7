//! Which processes a meta server's open connections vouch for.
//!
//! A process that binds nothing has no entry whose lease says it lives,
//! but it holds a connection to the meta server for its lookups, and the
//! kernel closes that connection the moment the process dies. Each
//! `Hello` names the incarnation of the process's service endpoint; a
//! peer that doubts the process asks ([`super::proto::PresenceQuery`]).
//!
//! An open connection wins: a stranger that names a live process's
//! incarnation in a `Hello` of its own and closes it does not make that
//! process look gone (its own connection is still open). It can make a
//! dead one look connected for as long as it holds its connection; the
//! peer's datagram tier still gives up on the dead one within its bound
//! (`LIVE_BOUND_US`), as it does for a process with no sign at all.

use super::proto::Presence;
use crate::recent::Recent;
use std::collections::HashMap;

/// Departed incarnations remembered (the oldest is forgotten: asked about
/// after that, it is unknown, as a process never connected).
pub const MAX_DEPARTED: usize = 1 << 16;

pub struct Presences {
    /// Open connections per incarnation.
    open: HashMap<u64, u32>,
    /// Incarnations with no open connection left.
    departed: Recent<u64>,
}

impl Default for Presences {
    fn default() -> Self {
        Presences { open: HashMap::new(), departed: Recent::new(MAX_DEPARTED) }
    }
}

impl Presences {
    /// A connection naming `incarnation` was admitted (0: it names none).
    pub fn connected(&mut self, incarnation: u64) {
        if incarnation == 0 {
            return;
        }
        *self.open.entry(incarnation).or_default() += 1;
        self.departed.remove(&incarnation);
    }

    /// A connection naming `incarnation` closed.
    pub fn disconnected(&mut self, incarnation: u64) {
        let Some(n) = self.open.get_mut(&incarnation) else { return };
        *n -= 1;
        if *n > 0 {
            return;
        }
        self.open.remove(&incarnation);
        self.departed.insert(incarnation);
    }

    pub fn of(&self, incarnation: u64) -> Presence {
        if incarnation != 0 && self.open.contains_key(&incarnation) {
            Presence::Connected
        } else if self.departed.contains(&incarnation) {
            Presence::Departed
        } else {
            Presence::Unknown
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connected_until_its_last_connection_closes() {
        let mut p = Presences::default();
        assert_eq!(p.of(7), Presence::Unknown);
        p.connected(7);
        assert_eq!(p.of(7), Presence::Connected);
        // A second connection naming it (a stranger's, or a replica
        // reconnect) closing leaves it connected.
        p.connected(7);
        p.disconnected(7);
        assert_eq!(p.of(7), Presence::Connected);
        p.disconnected(7);
        assert_eq!(p.of(7), Presence::Departed);
        // A close of nothing known changes nothing.
        p.disconnected(7);
        p.disconnected(8);
        assert_eq!(p.of(8), Presence::Unknown);
        // Connected again (a reconnect after a lost connection).
        p.connected(7);
        assert_eq!(p.of(7), Presence::Connected);
        assert!(p.departed.is_empty());
    }

    #[test]
    fn incarnation_zero_names_no_process() {
        let mut p = Presences::default();
        p.connected(0);
        assert_eq!(p.of(0), Presence::Unknown);
        p.disconnected(0);
        assert_eq!(p.of(0), Presence::Unknown);
    }

    #[test]
    fn departed_memory_is_bounded_oldest_forgotten() {
        let mut p = Presences::default();
        for i in 1..=(MAX_DEPARTED as u64 + 10) {
            p.connected(i);
            p.disconnected(i);
        }
        assert_eq!(p.departed.len(), MAX_DEPARTED);
        assert_eq!(p.of(1), Presence::Unknown);
        assert_eq!(p.of(10), Presence::Unknown);
        assert_eq!(p.of(11), Presence::Departed);
        assert_eq!(p.of(MAX_DEPARTED as u64 + 10), Presence::Departed);
        assert!(p.open.is_empty());
    }
}
