//! The application's MRs by protection domain, as the VQP path needs them:
//! by lkey for the local pre-checks, and by rkey for the peers' checks
//! (`super::mrcheck`) and the datagram tier's one-sided requests.
//!
//! `obj::Mr` reports every registration and deregistration here; a
//! registration is slow anyway, so one lock is no cost.

use super::precheck::{LocalMrs, MrInfo};
use parking_lot::RwLock;
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Clone, Copy, Debug)]
struct Entry {
    info: MrInfo,
    rkey: u32,
    /// Several application MRs may share one cached registration (the same
    /// keys): the entry lives while any of them does.
    refs: u32,
}

/// One PD's MRs.
#[derive(Default)]
pub struct PdMrs {
    by_lkey: FxHashMap<u32, Entry>,
    /// rkey -> lkey of the MRs peers may access.
    rkeys: FxHashMap<u32, u32>,
}

impl PdMrs {
    /// The MR peers may access under `rkey` (what a peer's check is
    /// answered with, and the datagram tier's target serves against).
    pub fn by_rkey(&self, rkey: u32) -> Option<MrInfo> {
        self.rkeys.get(&rkey).and_then(|lkey| self.by_lkey.get(lkey)).map(|e| e.info)
    }
}

impl LocalMrs for PdMrs {
    fn local(&self, lkey: u32) -> Option<MrInfo> {
        self.by_lkey.get(&lkey).map(|e| e.info)
    }
}

/// Whether peers may access an MR: only those are found by rkey (a
/// local-only MR's rkey means nothing; rxe gives them all rkey 0).
fn remote(info: &MrInfo) -> bool {
    use crate::sys::ibv_access_flags as A;
    info.access & (A::IBV_ACCESS_REMOTE_READ.0 | A::IBV_ACCESS_REMOTE_WRITE.0 | A::IBV_ACCESS_REMOTE_ATOMIC.0) != 0
}

static PDS: RwLock<Option<FxHashMap<usize, PdMrs>>> = RwLock::new(None);

/// Bumped whenever an MR leaves the registry: what a VQP remembers of an
/// MR found at an older epoch may be gone (see [`super::memo`]).
static EPOCH: AtomicU64 = AtomicU64::new(0);

/// The registry's epoch. Read it before a lookup: a removal after the
/// read bumps it, so the lookup's answer is never newer than its epoch.
pub fn epoch() -> u64 {
    EPOCH.load(Ordering::Acquire)
}

/// An MR of real PD `pd` was registered (`lkey`, `rkey`, range, access).
pub fn added(pd: usize, lkey: u32, rkey: u32, info: MrInfo) {
    let mut g = PDS.write();
    let mrs = g.get_or_insert_with(FxHashMap::default).entry(pd).or_default();
    let e = mrs.by_lkey.entry(lkey).or_insert(Entry { info, rkey, refs: 0 });
    e.refs += 1;
    if e.refs == 1 && remote(&info) {
        mrs.rkeys.insert(rkey, lkey);
    }
}

/// An MR of real PD `pd` was deregistered.
pub fn removed(pd: usize, lkey: u32) {
    let mut g = PDS.write();
    let Some(mrs) = g.as_mut().and_then(|m| m.get_mut(&pd)) else { return };
    let Some(e) = mrs.by_lkey.get_mut(&lkey) else { return };
    e.refs -= 1;
    if e.refs > 0 {
        return;
    }
    let (rkey, found_by_rkey) = (e.rkey, remote(&e.info));
    mrs.by_lkey.remove(&lkey);
    if found_by_rkey && mrs.rkeys.get(&rkey) == Some(&lkey) {
        mrs.rkeys.remove(&rkey);
    }
    EPOCH.fetch_add(1, Ordering::AcqRel);
}

/// Run `f` with PD `pd`'s MRs (an empty set if it has none).
pub fn with<R>(pd: usize, f: impl FnOnce(&PdMrs) -> R) -> R {
    let g = PDS.read();
    match g.as_ref().and_then(|m| m.get(&pd)) {
        Some(mrs) => f(mrs),
        None => f(&PdMrs::default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(addr: u64) -> MrInfo {
        MrInfo { addr, len: 4096, access: 7 }
    }

    #[test]
    fn shared_keys_live_while_any_mr_does() {
        let pd = 0x5150;
        added(pd, 1, 11, info(0x1000));
        added(pd, 1, 11, info(0x1000)); // a second MR on the same cached region
        added(pd, 2, 22, info(0x9000));
        assert_eq!(with(pd, |m| m.local(1)), Some(info(0x1000)));
        assert_eq!(with(pd, |m| m.by_rkey(22)), Some(info(0x9000)));
        let before = epoch();
        removed(pd, 1);
        assert_eq!(with(pd, |m| m.local(1)), Some(info(0x1000)), "still held by the other MR");
        assert_eq!(with(pd, |m| m.by_rkey(11)), Some(info(0x1000)));
        removed(pd, 1);
        assert_eq!(with(pd, |m| m.local(1)), None);
        assert_eq!(with(pd, |m| m.by_rkey(11)), None);
        assert!(epoch() > before, "a removal moves the epoch");
        assert_eq!(with(pd + 1, |m| m.by_rkey(22)), None, "other PDs see nothing");
        let local_only = MrInfo { access: 1, ..info(0xa000) };
        added(pd, 3, 0, local_only);
        assert_eq!(with(pd, |m| m.by_rkey(0)), None, "a local-only MR is not found by rkey");
        removed(pd, 2);
        removed(pd, 3);
    }
}
