//! The last local and remote MR a VQP's pre-checks found: an application
//! posts stream after stream on the same buffers, and under emulation the
//! registries' locks and hash lookups were a third of the pre-checks.
//!
//! A local MR is remembered with the registry's epoch ([`super::mrs::epoch`])
//! and used while no MR has left the registry since. A remote MR is
//! remembered with the time its peer was asked and used while that
//! READ is younger than the lease, exactly as the MRStore itself decides
//! ([`lease_holds`]), so the memo never extends what the store allows.

use super::precheck::{LocalMrs, MrInfo, RemoteMrs};
use std::cell::Cell;

/// The memo itself, kept in the VQP's state (under its lock).
#[derive(Default)]
pub struct MrMemo {
    /// (registry epoch, lkey, MR).
    local: Cell<Option<(u64, u32, MrInfo)>>,
    /// (rkey, MR, when the peer was asked, in coarse ms).
    remote: Cell<Option<(u32, MrInfo, u64)>>,
}

/// Whether an MR the peer answered for (asked at `at_ms`) may still be used
/// at `now_ms`. Both readings come from a clock that may be one tick late,
/// so the age counts one tick more.
pub fn lease_holds(at_ms: u64, now_ms: u64, lease_ms: u64) -> bool {
    now_ms.saturating_sub(at_ms).saturating_add(COARSE_TICK_MS) < lease_ms
}

/// The coarse clock's resolution is one scheduler tick: at most 10 ms
/// (HZ >= 100).
const COARSE_TICK_MS: u64 = 10;

/// The pre-checks' view of the MRs through a memo: `epoch` is the
/// registry's, read before any lookup; `local` and `remote` are the
/// registries themselves (the remote one answers with the MR and when it
/// was READ); `now` reads the coarse clock, only for one-sided requests.
pub struct Memoized<'a, L, R, N> {
    pub memo: &'a MrMemo,
    pub epoch: u64,
    pub lease_ms: u64,
    pub local: L,
    pub remote: R,
    pub now: N,
}

impl<L, R, N> LocalMrs for Memoized<'_, L, R, N>
where
    L: Fn(u32) -> Option<MrInfo>,
{
    fn local(&self, lkey: u32) -> Option<MrInfo> {
        if let Some((epoch, key, info)) = self.memo.local.get() {
            if epoch == self.epoch && key == lkey {
                return Some(info);
            }
        }
        let info = (self.local)(lkey)?;
        self.memo.local.set(Some((self.epoch, lkey, info)));
        Some(info)
    }
}

impl<L, R, N> RemoteMrs for Memoized<'_, L, R, N>
where
    R: Fn(u32) -> Option<(MrInfo, u64)>,
    N: Fn() -> u64,
{
    fn remote(&self, rkey: u32) -> Option<MrInfo> {
        let now = (self.now)();
        if let Some((key, info, at)) = self.memo.remote.get() {
            if key == rkey && lease_holds(at, now, self.lease_ms) {
                return Some(info);
            }
        }
        let (info, at) = (self.remote)(rkey)?;
        if !lease_holds(at, now, self.lease_ms) {
            return None;
        }
        self.memo.remote.set(Some((rkey, info, at)));
        Some(info)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mr(addr: u64) -> MrInfo {
        MrInfo { addr, len: 4096, access: 7 }
    }

    /// A memoized view over a registry that counts its lookups.
    #[allow(clippy::type_complexity)]
    fn view<'a>(
        memo: &'a MrMemo,
        epoch: u64,
        now: u64,
        lookups: &'a Cell<u32>,
    ) -> Memoized<'a, impl Fn(u32) -> Option<MrInfo> + 'a, impl Fn(u32) -> Option<(MrInfo, u64)> + 'a, impl Fn() -> u64> {
        Memoized {
            memo,
            epoch,
            lease_ms: 1000,
            local: move |k| {
                lookups.set(lookups.get() + 1);
                (k == 1).then(|| mr(0x1000 * epoch))
            },
            remote: move |k| {
                lookups.set(lookups.get() + 1);
                (k == 9).then(|| (mr(0x9000), 100))
            },
            now: move || now,
        }
    }

    #[test]
    fn a_local_mr_is_reused_until_the_registry_loses_one() {
        let memo = MrMemo::default();
        let n = Cell::new(0);
        assert_eq!(view(&memo, 1, 0, &n).local(1), Some(mr(0x1000)));
        assert_eq!(view(&memo, 1, 0, &n).local(1), Some(mr(0x1000)));
        assert_eq!(n.get(), 1, "the second check used the memo");
        // Another MR left the registry: look again (it answers anew).
        assert_eq!(view(&memo, 2, 0, &n).local(1), Some(mr(0x2000)));
        assert_eq!(n.get(), 2);
        // Another lkey is looked up, and an unknown one is not remembered.
        assert_eq!(view(&memo, 2, 0, &n).local(5), None);
        assert_eq!(view(&memo, 2, 0, &n).local(5), None);
        assert_eq!(n.get(), 4);
        assert_eq!(view(&memo, 2, 0, &n).local(1), Some(mr(0x2000)));
    }

    #[test]
    fn a_remote_mr_is_reused_only_while_its_lease_holds() {
        let memo = MrMemo::default();
        let n = Cell::new(0);
        assert_eq!(view(&memo, 0, 200, &n).remote(9), Some(mr(0x9000)));
        assert_eq!(view(&memo, 0, 500, &n).remote(9), Some(mr(0x9000)));
        assert_eq!(n.get(), 1);
        // READ at 100, lease 1000, one tick of slack: 1089 is the last
        // moment it holds, from the memo or from the store alike.
        assert_eq!(view(&memo, 0, 1089, &n).remote(9), Some(mr(0x9000)));
        assert_eq!(n.get(), 1);
        assert_eq!(view(&memo, 0, 1090, &n).remote(9), None, "expired: the store must READ again");
        assert_eq!(n.get(), 2);
        assert_eq!(view(&memo, 0, 0, &n).remote(8), None);
    }

    #[test]
    fn lease_counts_one_tick_of_slack_and_never_underflows() {
        assert!(lease_holds(100, 100, 11));
        assert!(!lease_holds(100, 100, 10));
        assert!(lease_holds(100, 50, 11), "a reading older than the READ is age 0");
        assert!(!lease_holds(0, u64::MAX - 5, 1000));
    }
}
