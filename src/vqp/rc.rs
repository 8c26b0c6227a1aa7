//! The RC QP that a transparent VQP plays (`KRCORE_VIRTUALIZE`, issue 8):
//! which `ibv_modify_qp` transitions and attribute masks a real RC QP
//! accepts, the attributes they set (kept, for `ibv_query_qp`), and what
//! each transition asks of the VQP (attach at RTR, post from RTS, flush at
//! ERR). The table is the one the kernel applies to every RC QP before the
//! driver sees it (`ib_modify_qp_is_ok`), so a program gets the errno its
//! real QP would give it: EINVAL. Pure logic: the VQP acts on the
//! [`Effect`].

use crate::error::{Errno, Result};
use crate::sys::{ibv_mtu, ibv_qp_attr, ibv_qp_attr_mask, ibv_qp_state};

const STATE: u32 = ibv_qp_attr_mask::IBV_QP_STATE.0;
const CUR_STATE: u32 = ibv_qp_attr_mask::IBV_QP_CUR_STATE.0;
const EN_SQD_ASYNC_NOTIFY: u32 = ibv_qp_attr_mask::IBV_QP_EN_SQD_ASYNC_NOTIFY.0;
const ACCESS_FLAGS: u32 = ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0;
const PKEY_INDEX: u32 = ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0;
const PORT: u32 = ibv_qp_attr_mask::IBV_QP_PORT.0;
const AV: u32 = ibv_qp_attr_mask::IBV_QP_AV.0;
const PATH_MTU: u32 = ibv_qp_attr_mask::IBV_QP_PATH_MTU.0;
const TIMEOUT: u32 = ibv_qp_attr_mask::IBV_QP_TIMEOUT.0;
const RETRY_CNT: u32 = ibv_qp_attr_mask::IBV_QP_RETRY_CNT.0;
const RNR_RETRY: u32 = ibv_qp_attr_mask::IBV_QP_RNR_RETRY.0;
const RQ_PSN: u32 = ibv_qp_attr_mask::IBV_QP_RQ_PSN.0;
const MAX_QP_RD_ATOMIC: u32 = ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC.0;
const ALT_PATH: u32 = ibv_qp_attr_mask::IBV_QP_ALT_PATH.0;
const MIN_RNR_TIMER: u32 = ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0;
const SQ_PSN: u32 = ibv_qp_attr_mask::IBV_QP_SQ_PSN.0;
const MAX_DEST_RD_ATOMIC: u32 = ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC.0;
const PATH_MIG_STATE: u32 = ibv_qp_attr_mask::IBV_QP_PATH_MIG_STATE.0;
const DEST_QPN: u32 = ibv_qp_attr_mask::IBV_QP_DEST_QPN.0;

use ibv_qp_state::*;

/// (required, optional) attributes of the RC transition `cur` -> `next`
/// besides `IBV_QP_STATE`; `None`: not a transition an RC QP makes.
fn rc_params(cur: ibv_qp_state::Type, next: ibv_qp_state::Type) -> Option<(u32, u32)> {
    Some(match (cur, next) {
        (_, IBV_QPS_RESET) | (_, IBV_QPS_ERR) => (0, 0),
        (IBV_QPS_RESET, IBV_QPS_INIT) => (PKEY_INDEX | PORT | ACCESS_FLAGS, 0),
        (IBV_QPS_INIT, IBV_QPS_INIT) => (0, PKEY_INDEX | PORT | ACCESS_FLAGS),
        (IBV_QPS_INIT, IBV_QPS_RTR) => {
            (AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER, ALT_PATH | ACCESS_FLAGS | PKEY_INDEX)
        }
        (IBV_QPS_RTR, IBV_QPS_RTS) => (
            TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC,
            CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE,
        ),
        (IBV_QPS_RTS, IBV_QPS_RTS) | (IBV_QPS_SQD, IBV_QPS_RTS) => {
            (0, CUR_STATE | ACCESS_FLAGS | ALT_PATH | PATH_MIG_STATE | MIN_RNR_TIMER)
        }
        (IBV_QPS_RTS, IBV_QPS_SQD) => (0, EN_SQD_ASYNC_NOTIFY),
        (IBV_QPS_SQD, IBV_QPS_SQD) => (
            0,
            AV | TIMEOUT
                | RETRY_CNT
                | RNR_RETRY
                | MAX_QP_RD_ATOMIC
                | MAX_DEST_RD_ATOMIC
                | ALT_PATH
                | ACCESS_FLAGS
                | PKEY_INDEX
                | MIN_RNR_TIMER
                | PATH_MIG_STATE,
        ),
        _ => return None,
    })
}

/// The state `ibv_modify_qp(attr, mask)` moves an RC QP in `cur` to, or
/// EINVAL where a real RC QP refuses the call. `attr_state` and
/// `attr_cur_state` are the attribute's `qp_state` and `cur_qp_state`
/// (read only when the mask names them).
pub fn transition(
    cur: ibv_qp_state::Type,
    mask: u32,
    attr_state: ibv_qp_state::Type,
    attr_cur_state: ibv_qp_state::Type,
) -> Result<ibv_qp_state::Type> {
    let cur = if mask & CUR_STATE != 0 { attr_cur_state } else { cur };
    let next = if mask & STATE != 0 { attr_state } else { cur };
    if cur > IBV_QPS_ERR || next > IBV_QPS_ERR {
        return Err(Errno::EINVAL);
    }
    let (req, opt) = rc_params(cur, next).ok_or(Errno::EINVAL)?;
    if mask & req != req || mask & !(req | opt | STATE) != 0 {
        return Err(Errno::EINVAL);
    }
    Ok(next)
}

/// What an accepted `ibv_modify_qp` asks of the VQP beyond the kept state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    None,
    /// INIT -> RTR: attach to the peer's VQP `dest_qpn` on the node of
    /// `dgid` (resolved through the meta server), from our GID at
    /// `sgid_index`.
    Connect {
        dgid: [u8; 16],
        dest_qpn: u32,
        sgid_index: u32,
    },
    /// RTR -> RTS: the send queue opens.
    Ready,
    /// -> ERR: outstanding work completes with IBV_WC_WR_FLUSH_ERR.
    Flush,
    /// -> RESET: outstanding work is dropped without completions and the
    /// VQP leaves its peer.
    Reset,
}

/// A copy of a verbs attribute struct (plain C data, but bindgen derives
/// no `Clone` through its unions).
fn copy<T>(v: &T) -> T {
    // SAFETY: only used on C structs without pointers that own anything.
    unsafe { std::ptr::read(v) }
}

/// QPNs, PSNs: 24 bits on the wire.
const MASK_24: u32 = 0xff_ffff;

/// The RC QP's state and attributes as `ibv_modify_qp` left them.
pub struct RcShadow {
    attr: ibv_qp_attr,
}

impl Clone for RcShadow {
    fn clone(&self) -> Self {
        RcShadow { attr: copy(&self.attr) }
    }
}

impl Default for RcShadow {
    fn default() -> Self {
        // SAFETY: a plain C struct; all zeroes is RESET with no attributes.
        RcShadow { attr: unsafe { std::mem::zeroed() } }
    }
}

impl RcShadow {
    pub fn state(&self) -> ibv_qp_state::Type {
        self.attr.qp_state
    }

    /// The connection failed (its link did): in ERR, as a real RC QP whose
    /// retries ran out.
    pub fn fail(&mut self) {
        self.attr.qp_state = IBV_QPS_ERR;
        self.attr.cur_qp_state = IBV_QPS_ERR;
    }

    /// `ibv_modify_qp(attr, mask)`: EINVAL as a real RC QP on RoCE would
    /// refuse it (the transition, the mask, an out-of-range MTU or QPN, an
    /// RTR address without a GRH), else the state moves, the attributes
    /// the mask names are kept, and the effect is returned.
    pub fn modify(&mut self, attr: &ibv_qp_attr, mask: u32) -> Result<Effect> {
        let cur = self.attr.qp_state;
        let next = transition(cur, mask, attr.qp_state, attr.cur_qp_state)?;
        if mask & PATH_MTU != 0 && !(ibv_mtu::IBV_MTU_256..=ibv_mtu::IBV_MTU_4096).contains(&attr.path_mtu) {
            return Err(Errno::EINVAL);
        }
        if mask & DEST_QPN != 0 && attr.dest_qp_num > MASK_24 {
            return Err(Errno::EINVAL);
        }
        // RoCE addresses by GID: an address vector without a GRH names no
        // peer (the kernel cannot resolve its MAC).
        if mask & AV != 0 && attr.ah_attr.is_global == 0 {
            return Err(Errno::EINVAL);
        }
        let a = &mut self.attr;
        // The plain attributes each mask bit names, kept as given.
        macro_rules! keep {
            ($($bit:expr => $($field:ident),+;)*) => {
                $(if mask & $bit != 0 {
                    $(a.$field = attr.$field;)+
                })*
            };
        }
        keep! {
            ACCESS_FLAGS => qp_access_flags;
            PKEY_INDEX => pkey_index;
            PORT => port_num;
            ALT_PATH => alt_pkey_index, alt_port_num, alt_timeout;
            PATH_MTU => path_mtu;
            DEST_QPN => dest_qp_num;
            MAX_DEST_RD_ATOMIC => max_dest_rd_atomic;
            MAX_QP_RD_ATOMIC => max_rd_atomic;
            MIN_RNR_TIMER => min_rnr_timer;
            TIMEOUT => timeout;
            RETRY_CNT => retry_cnt;
            RNR_RETRY => rnr_retry;
            PATH_MIG_STATE => path_mig_state;
            EN_SQD_ASYNC_NOTIFY => en_sqd_async_notify;
        }
        // Address vectors are copied whole; PSNs are 24 bits on the wire.
        if mask & AV != 0 {
            a.ah_attr = copy(&attr.ah_attr);
        }
        if mask & ALT_PATH != 0 {
            a.alt_ah_attr = copy(&attr.alt_ah_attr);
        }
        if mask & RQ_PSN != 0 {
            a.rq_psn = attr.rq_psn & MASK_24;
        }
        if mask & SQ_PSN != 0 {
            a.sq_psn = attr.sq_psn & MASK_24;
        }
        a.qp_state = next;
        a.cur_qp_state = next;
        Ok(match (cur, next) {
            (_, IBV_QPS_RESET) => {
                // A QP back in RESET forgets its attributes.
                *self = RcShadow::default();
                Effect::Reset
            }
            (_, IBV_QPS_ERR) => Effect::Flush,
            (IBV_QPS_INIT, IBV_QPS_RTR) => {
                // SAFETY: a GID is 16 bytes whichever way it is read.
                let dgid = unsafe { self.attr.ah_attr.grh.dgid.raw };
                Effect::Connect { dgid, dest_qpn: self.attr.dest_qp_num, sgid_index: self.attr.ah_attr.grh.sgid_index.into() }
            }
            (IBV_QPS_RTR, IBV_QPS_RTS) => Effect::Ready,
            _ => Effect::None,
        })
    }

    /// What `ibv_query_qp` reports: every kept attribute, whatever the
    /// mask asks for (as rxe does); the capabilities are the caller's.
    pub fn query(&self) -> ibv_qp_attr {
        copy(&self.attr)
    }

    /// Whether the send queue takes work requests (RTS or SQD; a real
    /// QP's post_send fails with EINVAL before RTS).
    pub fn can_send(&self) -> bool {
        matches!(self.attr.qp_state, IBV_QPS_RTS | IBV_QPS_SQD)
    }

    /// Whether the receive queue takes work requests (from INIT on, and in
    /// ERR, where they are flushed).
    pub fn can_receive(&self) -> bool {
        self.attr.qp_state != IBV_QPS_RESET
    }
}

#[cfg(test)]
#[allow(clippy::undocumented_unsafe_blocks)]
mod tests {
    use super::*;

    const TO_INIT: u32 = STATE | PKEY_INDEX | PORT | ACCESS_FLAGS;
    const TO_RTR: u32 = STATE | AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER;
    const TO_RTS: u32 = STATE | TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC;

    fn go(cur: ibv_qp_state::Type, mask: u32, next: ibv_qp_state::Type) -> Result<ibv_qp_state::Type> {
        transition(cur, mask, next, IBV_QPS_RESET)
    }

    #[test]
    fn the_usual_path_reset_init_rtr_rts() {
        assert_eq!(go(IBV_QPS_RESET, TO_INIT, IBV_QPS_INIT), Ok(IBV_QPS_INIT));
        assert_eq!(go(IBV_QPS_INIT, TO_RTR, IBV_QPS_RTR), Ok(IBV_QPS_RTR));
        assert_eq!(go(IBV_QPS_RTR, TO_RTS, IBV_QPS_RTS), Ok(IBV_QPS_RTS));
        // Optional attributes where the table allows them.
        assert_eq!(go(IBV_QPS_INIT, TO_RTR | ACCESS_FLAGS | PKEY_INDEX, IBV_QPS_RTR), Ok(IBV_QPS_RTR));
        assert_eq!(go(IBV_QPS_RTR, TO_RTS | MIN_RNR_TIMER, IBV_QPS_RTS), Ok(IBV_QPS_RTS));
    }

    #[test]
    fn a_missing_required_attribute_is_einval() {
        for bit in [PKEY_INDEX, PORT, ACCESS_FLAGS] {
            assert_eq!(go(IBV_QPS_RESET, TO_INIT & !bit, IBV_QPS_INIT), Err(Errno::EINVAL), "{bit:#x}");
        }
        for bit in [AV, PATH_MTU, DEST_QPN, RQ_PSN, MAX_DEST_RD_ATOMIC, MIN_RNR_TIMER] {
            assert_eq!(go(IBV_QPS_INIT, TO_RTR & !bit, IBV_QPS_RTR), Err(Errno::EINVAL), "{bit:#x}");
        }
        for bit in [TIMEOUT, RETRY_CNT, RNR_RETRY, SQ_PSN, MAX_QP_RD_ATOMIC] {
            assert_eq!(go(IBV_QPS_RTR, TO_RTS & !bit, IBV_QPS_RTS), Err(Errno::EINVAL), "{bit:#x}");
        }
    }

    #[test]
    fn an_attribute_the_transition_does_not_take_is_einval() {
        assert_eq!(go(IBV_QPS_RESET, TO_INIT | DEST_QPN, IBV_QPS_INIT), Err(Errno::EINVAL));
        assert_eq!(go(IBV_QPS_INIT, TO_RTR | SQ_PSN, IBV_QPS_RTR), Err(Errno::EINVAL));
        assert_eq!(go(IBV_QPS_RTR, TO_RTS | DEST_QPN, IBV_QPS_RTS), Err(Errno::EINVAL));
        // UD's QKEY is no RC attribute.
        assert_eq!(go(IBV_QPS_RESET, TO_INIT | ibv_qp_attr_mask::IBV_QP_QKEY.0, IBV_QPS_INIT), Err(Errno::EINVAL));
    }

    #[test]
    fn skipping_a_state_is_einval() {
        assert_eq!(go(IBV_QPS_RESET, TO_RTR, IBV_QPS_RTR), Err(Errno::EINVAL));
        assert_eq!(go(IBV_QPS_INIT, TO_RTS, IBV_QPS_RTS), Err(Errno::EINVAL));
        assert_eq!(go(IBV_QPS_RESET, TO_RTS, IBV_QPS_RTS), Err(Errno::EINVAL));
        // RTR -> RTR is no transition (not even without attributes).
        assert_eq!(go(IBV_QPS_RTR, STATE, IBV_QPS_RTR), Err(Errno::EINVAL));
        // An RC QP never enters SQE by a modify.
        assert_eq!(go(IBV_QPS_RTS, STATE, IBV_QPS_SQE), Err(Errno::EINVAL));
    }

    #[test]
    fn reset_and_err_from_anywhere_with_the_state_only() {
        for cur in [IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_SQD, IBV_QPS_SQE, IBV_QPS_ERR] {
            assert_eq!(go(cur, STATE, IBV_QPS_RESET), Ok(IBV_QPS_RESET));
            assert_eq!(go(cur, STATE, IBV_QPS_ERR), Ok(IBV_QPS_ERR));
            assert_eq!(go(cur, STATE | PORT, IBV_QPS_ERR), Err(Errno::EINVAL));
        }
        // Out of ERR only through RESET.
        assert_eq!(go(IBV_QPS_ERR, TO_INIT, IBV_QPS_INIT), Err(Errno::EINVAL));
    }

    #[test]
    fn attributes_without_a_state_change_stay_in_the_state() {
        assert_eq!(go(IBV_QPS_RTS, MIN_RNR_TIMER, IBV_QPS_RESET), Ok(IBV_QPS_RTS));
        assert_eq!(go(IBV_QPS_INIT, PORT, IBV_QPS_RESET), Ok(IBV_QPS_INIT));
        assert_eq!(go(IBV_QPS_RTS, TIMEOUT, IBV_QPS_RESET), Err(Errno::EINVAL));
    }

    /// An INIT -> RTR attribute set naming (dgid, dest_qpn).
    fn rtr_attr(dgid: u8, dest_qpn: u32) -> ibv_qp_attr {
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = IBV_QPS_RTR;
        a.path_mtu = ibv_mtu::IBV_MTU_1024;
        a.dest_qp_num = dest_qpn;
        a.rq_psn = 0x1234_5678;
        a.max_dest_rd_atomic = 4;
        a.min_rnr_timer = 12;
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid.raw = [dgid; 16];
        a
    }

    fn state_only(s: ibv_qp_state::Type) -> ibv_qp_attr {
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = s;
        a
    }

    fn to_init(qp: &mut RcShadow) -> Result<Effect> {
        let mut a = state_only(IBV_QPS_INIT);
        a.port_num = 1;
        a.qp_access_flags = 7;
        qp.modify(&a, TO_INIT)
    }

    #[test]
    fn a_shadow_walks_to_rts_and_asks_to_connect_at_rtr() {
        let mut qp = RcShadow::default();
        assert_eq!(qp.state(), IBV_QPS_RESET);
        assert!(!qp.can_send() && !qp.can_receive());
        assert_eq!(to_init(&mut qp), Ok(Effect::None));
        assert!(qp.can_receive() && !qp.can_send());
        assert_eq!(qp.modify(&rtr_attr(9, 0x80_1234), TO_RTR), Ok(Effect::Connect { dgid: [9; 16], dest_qpn: 0x80_1234, sgid_index: 0 }));
        assert!(!qp.can_send());
        let mut rts = state_only(IBV_QPS_RTS);
        rts.sq_psn = 0xff00_0001;
        rts.timeout = 14;
        rts.retry_cnt = 7;
        rts.rnr_retry = 7;
        rts.max_rd_atomic = 4;
        assert_eq!(qp.modify(&rts, TO_RTS), Ok(Effect::Ready));
        assert!(qp.can_send());
        // Everything set is reported, PSNs in 24 bits.
        let q = qp.query();
        assert_eq!((q.qp_state, q.cur_qp_state), (IBV_QPS_RTS, IBV_QPS_RTS));
        assert_eq!((q.port_num, q.qp_access_flags, q.path_mtu), (1, 7, ibv_mtu::IBV_MTU_1024));
        assert_eq!((q.dest_qp_num, q.rq_psn, q.sq_psn), (0x80_1234, 0x34_5678, 0x1));
        assert_eq!((q.timeout, q.retry_cnt, q.rnr_retry, q.max_rd_atomic, q.max_dest_rd_atomic, q.min_rnr_timer), (14, 7, 7, 4, 4, 12));
        assert_eq!(unsafe { q.ah_attr.grh.dgid.raw }, [9; 16]);
    }

    #[test]
    fn a_refused_modify_changes_nothing() {
        let mut qp = RcShadow::default();
        to_init(&mut qp).unwrap();
        let before = qp.query();
        let mut bad = rtr_attr(9, 5);
        bad.path_mtu = 0;
        assert_eq!(qp.modify(&bad, TO_RTR), Err(Errno::EINVAL), "MTU 0");
        bad = rtr_attr(9, 1 << 24);
        assert_eq!(qp.modify(&bad, TO_RTR), Err(Errno::EINVAL), "QPN over 24 bits");
        bad = rtr_attr(9, 5);
        bad.ah_attr.is_global = 0;
        assert_eq!(qp.modify(&bad, TO_RTR), Err(Errno::EINVAL), "no GRH on RoCE");
        assert_eq!(qp.modify(&rtr_attr(9, 5), TO_RTR & !RQ_PSN), Err(Errno::EINVAL), "mask");
        let after = qp.query();
        assert_eq!((after.qp_state, after.dest_qp_num, after.path_mtu), (before.qp_state, before.dest_qp_num, before.path_mtu));
        assert_eq!(qp.state(), IBV_QPS_INIT);
    }

    #[test]
    fn err_flushes_and_reset_forgets() {
        let mut qp = RcShadow::default();
        to_init(&mut qp).unwrap();
        qp.modify(&rtr_attr(3, 77), TO_RTR).unwrap();
        assert_eq!(qp.modify(&state_only(IBV_QPS_ERR), STATE), Ok(Effect::Flush));
        assert!(!qp.can_send() && qp.can_receive());
        assert_eq!(qp.modify(&rtr_attr(3, 77), TO_RTR), Err(Errno::EINVAL), "out of ERR only through RESET");
        assert_eq!(qp.modify(&state_only(IBV_QPS_RESET), STATE), Ok(Effect::Reset));
        let q = qp.query();
        assert_eq!((q.qp_state, q.dest_qp_num, q.port_num), (IBV_QPS_RESET, 0, 0));
        // And it can be brought up again.
        assert_eq!(to_init(&mut qp), Ok(Effect::None));
    }

    #[test]
    fn cur_state_overrides_where_allowed() {
        assert_eq!(transition(IBV_QPS_INIT, TO_RTS | CUR_STATE, IBV_QPS_RTS, IBV_QPS_RTR), Ok(IBV_QPS_RTS));
        assert_eq!(transition(IBV_QPS_RESET, TO_INIT | CUR_STATE, IBV_QPS_INIT, IBV_QPS_RESET), Err(Errno::EINVAL));
        assert_eq!(transition(IBV_QPS_RTS, STATE, 9, IBV_QPS_RESET), Err(Errno::EINVAL));
    }
}
