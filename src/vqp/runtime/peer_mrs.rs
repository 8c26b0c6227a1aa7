//! The MRStore: the peers' MRs we checked, per peer, and the renewal of
//! the checks a host's agent keeps warm.

use super::*;

/// The peer's MRs it told us of when we checked them
/// ([`super::mrcheck`]; the MRStore), shared by every VQP that talks to
/// that peer. An entry is trusted for the MR lease (`KRCORE_MR_LEASE_MS`):
/// the peer keeps a deregistered MR registered that long, so an access
/// checked against a fresh entry cannot hit a dead key; an older entry is
/// checked again.
#[derive(Default)]
pub struct PeerMrs {
    /// rkey -> (what the peer said, when we asked, when a pre-check last
    /// looked it up: [`crate::clock::coarse_ms`]).
    known: FxHashMap<u32, (crate::vqp::precheck::MrInfo, u64, u64)>,
}

impl PeerMrs {
    /// The peer said `info` for `rkey` to a check sent at `at_ms`
    /// ([`crate::clock::coarse_ms`]): the lease is counted from the check's sending, not
    /// from the answer (which may come a transport's retries later, while
    /// the owner counts from its deregistration).
    pub fn learn(&mut self, rkey: u32, info: crate::vqp::precheck::MrInfo, at_ms: u64) {
        let used = self.known.get(&rkey).map_or(at_ms, |k| k.2);
        self.known.insert(rkey, (info, at_ms, used));
    }

    /// The peer's MR of `rkey` and when its table said so (coarse ms); the
    /// pre-checks use it while [`super::memo::lease_holds`].
    pub fn get(&mut self, rkey: u32) -> Option<(crate::vqp::precheck::MrInfo, u64)> {
        let k = self.known.get_mut(&rkey)?;
        k.2 = crate::clock::coarse_ms();
        Some((k.0, k.1))
    }

    /// The rkeys looked up within `used_ms` of `now_ms` whose check is at
    /// least `older_ms` old: the ones to check again before their lease
    /// runs out.
    pub fn due(&self, now_ms: u64, older_ms: u64, used_ms: u64) -> Vec<(u32, crate::vqp::precheck::MrInfo)> {
        let due = |&(_, at, used): &(crate::vqp::precheck::MrInfo, u64, u64)| {
            now_ms.saturating_sub(used) <= used_ms && now_ms.saturating_sub(at) >= older_ms
        };
        self.known.iter().filter(|(_, k)| due(k)).map(|(&rkey, k)| (rkey, k.0)).collect()
    }

    pub fn forget(&mut self, rkey: u32) {
        self.known.remove(&rkey);
    }
}

impl Runtime {
    /// The MRStore of the peer with `incarnation`.
    pub fn peer_mrs(&self, incarnation: u64) -> Arc<Mutex<PeerMrs>> {
        Arc::clone(self.peer_mrs.lock().entry(incarnation).or_default())
    }

    /// Check again, over an open link to their owner, the peers' rkeys
    /// looked up within `used_ms` whose lease is half over (the host's
    /// agent keeps the rkeys its processes use warm: a new process's first
    /// READ then waits for no check). How many were renewed.
    pub fn renew_mr_checks(&self, used_ms: u64) -> usize {
        let lease = crate::config::get().mr_lease_ms;
        if lease == 0 {
            return 0;
        }
        let now = crate::clock::coarse_ms();
        let peers: Vec<(u64, Arc<Mutex<PeerMrs>>)> = self.peer_mrs.lock().iter().map(|(i, p)| (*i, Arc::clone(p))).collect();
        let mut renewed = 0;
        for (incarnation, pm) in peers {
            let due = pm.lock().due(now, lease / 2, used_ms);
            if due.is_empty() {
                continue;
            }
            let Some(link) = self.svc.live_links().into_iter().find(|l| l.peer.incarnation == incarnation) else { continue };
            for (rkey, info) in due {
                match crate::vqp::mrcheck::ask(self, &link, rkey, info.addr) {
                    Ok(Some((info, at))) => {
                        pm.lock().learn(rkey, info, at);
                        renewed += 1;
                    }
                    Ok(None) => pm.lock().forget(rkey),
                    Err(_) => break,
                }
            }
        }
        renewed
    }
}

#[cfg(test)]
mod tests {
    use super::PeerMrs;
    use crate::vqp::precheck::MrInfo;

    #[test]
    fn rkeys_due_again_are_the_used_ones_half_through_their_lease() {
        let mr = |a| MrInfo { addr: a, len: 4096, access: 0xf };
        let mut p = PeerMrs::default();
        p.learn(1, mr(0x1000), 1000);
        p.learn(2, mr(0x2000), 1400);
        // Learned counts as used then.
        assert_eq!(p.due(1400, 500, 10_000), vec![]);
        let mut d = p.due(1900, 500, 10_000);
        d.sort_by_key(|e| e.0);
        assert_eq!(d, vec![(1, mr(0x1000)), (2, mr(0x2000))]);
        // Checked again: its lease counts from then, and it stays used
        // as of its last look-up (a renewal is not a use).
        p.learn(1, mr(0x1000), 1900);
        assert_eq!(p.due(1950, 500, 10_000), vec![(2, mr(0x2000))]);
        // Not looked up within `used_ms`: no longer kept warm.
        assert_eq!(p.due(11_500, 500, 10_000), vec![]);
        p.forget(2);
        assert_eq!(p.due(11_500, 500, 100_000), vec![(1, mr(0x1000))]);
    }
}
