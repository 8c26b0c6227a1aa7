//! Pre-checks: reject a work request before it can break a shared QP.
//!
//! Many VQPs are multiplexed onto one physical RC QP. Plain verbs lets a bad
//! work request through `ibv_post_send` and the NIC then fails the WQE: a
//! local protection or length error, or a remote access NAK from the peer.
//! Either way the physical QP goes to the error state and every VQP on it
//! breaks, not just the one that posted the request. So, as in KRCORE §4,
//! every request is checked here first; a rejected one returns EINVAL to the
//! application with `*bad_wr` pointing at it, and nothing after it is posted.
//!
//! The checks, in this order (cheap ones first, lookups last):
//! 1. the opcode is one a VQP carries on RC, and `send_flags` has no bits
//!    beyond FENCE, SIGNALED, SOLICITED and INLINE;
//! 2. the SGE count and the total length (sum of the SGE lengths) fit the
//!    VQP's capabilities;
//! 3. inline data only with SEND/RDMA_WRITE (with or without immediate) and
//!    within `max_inline_data`;
//! 4. atomics: the device supports them (`atomic_cap` is not
//!    `IBV_ATOMIC_NONE`), one 8-byte SGE, both addresses 8-byte aligned;
//! 5. unless inline, every SGE of non-zero length lies inside a local MR of
//!    its lkey, which allows local write when the NIC writes into it (READ,
//!    atomics, receives);
//! 6. RDMA and atomics: the rkey names a peer MR with the right access, and
//!    the remote range lies inside it.
//!
//! The length bound is the device port's `max_msg_sz` ([`Caps::on_device`]).
//! An MR registered with `IBV_ACCESS_ZERO_BASED` (its WR addresses are
//! offsets, not the iova the checks compare with) or `IBV_ACCESS_ON_DEMAND`
//! (a page fault the NIC cannot resolve fails the WQE, and with it the
//! link) is not modelled: a request that uses one, local or remote, is
//! refused ([`Reason::MrNotSupported`]).
//!
//! All local checks come before the remote lookup, so the caller only pays
//! for checking an rkey with the peer ([`Verdict::NeedRemote`]) on a request
//! that is otherwise valid.
//!
//! Where verbs leaves behaviour to the provider we take the strictest known
//! reading, because a provider that is lenient on a private QP gains nothing
//! here and a strict one costs every VQP on the link:
//! - Zero-length SGEs are skipped, lkey included (mlx5 and rxe skip them
//!   too), but a zero-length RDMA op still needs a known rkey with the
//!   right access and `remote_addr` inside its MR (the end included). IBTA
//!   C9-88 lets a responder skip the R_Key check when the DMA length is 0;
//!   we do not rely on every responder doing so.
//! - The local atomic buffer must be 8-byte aligned, which the spec only asks
//!   of the remote address.
//! - `IBV_SEND_IP_CSUM` and undefined flag bits have no RC meaning that we
//!   could vouch for on a shared QP.
//! - The total length of a receive is bounded by `max_msg_size` too, as
//!   rxe's post_recv does.
//!
//! Inline data is copied by the provider while posting, so its lkeys mean
//! nothing and its addresses are the application's to get right (a bad one
//! faults the posting thread, as with plain verbs; it cannot fail a WQE).
//! Range checks use exact arithmetic: a range may end at 2^64 but never
//! wraps, even when an MR entry (the peer's answer is data we got over the
//! network) claims to.
//!
//! This module only judges; it neither posts nor fetches. It runs on every
//! post: no allocation, two passes over a few SGEs (lengths, then lookups),
//! and the first broken rule ends the check.

use crate::error::Errno;
use crate::sys::{ibv_access_flags, ibv_send_flags, ibv_sge, ibv_wr_opcode};
use std::fmt;

/// The fields of an `ibv_send_wr` that the checks read. The caller builds it
/// from the application's WR; the atomic operands are not checked.
#[derive(Clone, Copy)]
pub struct SendWr<'a> {
    pub opcode: ibv_wr_opcode::Type,
    pub send_flags: u32,
    /// `sg_list[..num_sge]`. Check `num_sge` against the caps before forming
    /// the slice when it comes straight from the application: a count larger
    /// than the list it points at must not become a slice.
    pub sge: &'a [ibv_sge],
    pub remote_addr: u64,
    pub rkey: u32,
}

/// The fields of an `ibv_recv_wr` that the checks read.
#[derive(Clone, Copy)]
pub struct RecvWr<'a> {
    pub sge: &'a [ibv_sge],
}

/// The capabilities granted to a VQP: what its requests may use of the
/// physical QP they share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
    /// The port's `max_msg_sz`.
    pub max_msg_size: u32,
    /// Whether the device performs atomics (`atomic_cap`).
    pub atomics: bool,
}

impl Caps {
    /// These caps on a device whose port reports `max_msg_sz` and whose
    /// `atomic_cap` is `atomic_cap`: the message bound is the smaller one,
    /// atomics only where the device has them.
    pub fn on_device(self, max_msg_sz: u32, atomic_cap: u32) -> Caps {
        Caps {
            max_msg_size: self.max_msg_size.min(max_msg_sz),
            atomics: self.atomics && atomic_cap != crate::sys::ibv_atomic_cap::IBV_ATOMIC_NONE,
            ..self
        }
    }
}

/// A memory region as the checks see it (`addr` is its start in the
/// addresses that WRs use, its iova).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MrInfo {
    pub addr: u64,
    pub len: u64,
    /// `ibv_access_flags` bits the MR was registered with.
    pub access: u32,
}

/// The process's own MRs, by lkey.
pub trait LocalMrs {
    /// The MR of `lkey` if this VQP may use it (registered in its PD), else
    /// `None`.
    fn local(&self, lkey: u32) -> Option<MrInfo>;
}

/// The peer's MRs already fetched and checked (MRStore).
pub trait RemoteMrs {
    /// The peer's MR of `rkey`, or `None` if it is not known yet.
    fn remote(&self, rkey: u32) -> Option<MrInfo>;
}

/// Which address of an atomic is misaligned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Local,
    Remote,
}

/// Why a work request was rejected. Every reason is EINVAL for the
/// application; the fields are there for the log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    UnsupportedOpcode {
        opcode: u32,
    },
    /// The bits of `send_flags` that are not allowed.
    UnsupportedFlags {
        flags: u32,
    },
    TooManySge {
        num: usize,
        max: u32,
    },
    MessageTooLarge {
        len: u64,
        max: u32,
    },
    InlineNotAllowed {
        opcode: u32,
    },
    InlineTooLarge {
        len: u64,
        max: u32,
    },
    /// An atomic without exactly one SGE of 8 bytes (`len` is the total).
    AtomicSge {
        num: usize,
        len: u64,
    },
    AtomicMisaligned {
        side: Side,
        addr: u64,
    },
    UnknownLkey {
        sge: usize,
        lkey: u32,
    },
    SgeOutOfRange {
        sge: usize,
        lkey: u32,
        addr: u64,
        len: u32,
        mr_addr: u64,
        mr_len: u64,
    },
    /// The MR lacks IBV_ACCESS_LOCAL_WRITE and the NIC would write into it.
    LocalAccess {
        sge: usize,
        lkey: u32,
    },
    /// The peer has no MR with this rkey (see [`Verdict::into_reason`]).
    RemoteUnknown {
        rkey: u32,
    },
    /// `need` is the `ibv_access_flags` bit the remote MR lacks.
    RemoteAccess {
        rkey: u32,
        need: u32,
    },
    RemoteOutOfRange {
        rkey: u32,
        addr: u64,
        len: u64,
        mr_addr: u64,
        mr_len: u64,
    },
    /// The device has no atomics (`atomic_cap` is `IBV_ATOMIC_NONE`).
    AtomicsNotSupported,
    /// The MR of `key` (an lkey, or with `remote` an rkey of the peer) was
    /// registered with `access` bits ([`NOT_MODELLED`]) the checks do not
    /// model.
    MrNotSupported {
        key: u32,
        remote: bool,
        access: u32,
    },
}

/// MR access bits whose semantics the checks do not model: a request using
/// such an MR is refused.
pub const NOT_MODELLED: u32 = ibv_access_flags::IBV_ACCESS_ZERO_BASED.0 | ibv_access_flags::IBV_ACCESS_ON_DEMAND.0;

impl Reason {
    /// The error the application sees.
    pub fn errno(self) -> Errno {
        Errno::EINVAL
    }
}

/// The outcome of a failed [`check_send`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Every local check passed but the peer's MR of `rkey` is not cached:
    /// check the rkey with the peer and check again.
    NeedRemote {
        rkey: u32,
    },
    Reject(Reason),
}

impl Verdict {
    /// The reason to report when the caller can learn no more: after the
    /// peer answered, an rkey still unknown is a rejection.
    pub fn into_reason(self) -> Reason {
        match self {
            Verdict::NeedRemote { rkey } => Reason::RemoteUnknown { rkey },
            Verdict::Reject(reason) => reason,
        }
    }
}

impl From<Reason> for Verdict {
    fn from(reason: Reason) -> Verdict {
        Verdict::Reject(reason)
    }
}

/// What a supported opcode does, as far as the checks care.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Send,
    Write,
    Read,
    Atomic,
}

impl Op {
    fn of(opcode: ibv_wr_opcode::Type) -> Option<Op> {
        use ibv_wr_opcode::*;
        match opcode {
            IBV_WR_SEND | IBV_WR_SEND_WITH_IMM => Some(Op::Send),
            IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM => Some(Op::Write),
            IBV_WR_RDMA_READ => Some(Op::Read),
            IBV_WR_ATOMIC_CMP_AND_SWP | IBV_WR_ATOMIC_FETCH_AND_ADD => Some(Op::Atomic),
            _ => None,
        }
    }
}

const ALLOWED_SEND_FLAGS: u32 = ibv_send_flags::IBV_SEND_FENCE.0
    | ibv_send_flags::IBV_SEND_SIGNALED.0
    | ibv_send_flags::IBV_SEND_SOLICITED.0
    | ibv_send_flags::IBV_SEND_INLINE.0;

const LOCAL_WRITE: u32 = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
const REMOTE_WRITE: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
const REMOTE_READ: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
const REMOTE_ATOMIC: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;

/// Check a send-queue request of a VQP. `Ok` means it cannot fail on the
/// physical QP for any reason the checks cover; on
/// [`Verdict::NeedRemote`] fetch the peer's MR and call again; on
/// [`Verdict::Reject`] fail the post with [`Reason::errno`].
pub fn check_send<L, R>(wr: &SendWr<'_>, caps: &Caps, local: &L, remote: &R) -> Result<(), Verdict>
where
    L: LocalMrs + ?Sized,
    R: RemoteMrs + ?Sized,
{
    let op = Op::of(wr.opcode).ok_or(Reason::UnsupportedOpcode { opcode: wr.opcode })?;
    let bad_flags = wr.send_flags & !ALLOWED_SEND_FLAGS;
    if bad_flags != 0 {
        return Err(Reason::UnsupportedFlags { flags: bad_flags }.into());
    }
    let len = total_len(wr.sge, caps.max_send_sge, caps.max_msg_size)?;
    let inline = wr.send_flags & ibv_send_flags::IBV_SEND_INLINE.0 != 0;
    if inline {
        if !matches!(op, Op::Send | Op::Write) {
            return Err(Reason::InlineNotAllowed { opcode: wr.opcode }.into());
        }
        if len > u64::from(caps.max_inline_data) {
            return Err(Reason::InlineTooLarge { len, max: caps.max_inline_data }.into());
        }
    }
    if op == Op::Atomic {
        if !caps.atomics {
            return Err(Reason::AtomicsNotSupported.into());
        }
        check_atomic_shape(wr, len)?;
    }
    if !inline {
        check_local(wr.sge, matches!(op, Op::Read | Op::Atomic), local)?;
    }
    let need = match op {
        Op::Send => return Ok(()),
        Op::Write => REMOTE_WRITE,
        Op::Read => REMOTE_READ,
        Op::Atomic => REMOTE_ATOMIC,
    };
    let mr = remote.remote(wr.rkey).ok_or(Verdict::NeedRemote { rkey: wr.rkey })?;
    if mr.access & NOT_MODELLED != 0 {
        return Err(Reason::MrNotSupported { key: wr.rkey, remote: true, access: mr.access & NOT_MODELLED }.into());
    }
    if mr.access & need == 0 {
        return Err(Reason::RemoteAccess { rkey: wr.rkey, need }.into());
    }
    if !contains(&mr, wr.remote_addr, len) {
        return Err(Reason::RemoteOutOfRange { rkey: wr.rkey, addr: wr.remote_addr, len, mr_addr: mr.addr, mr_len: mr.len }.into());
    }
    Ok(())
}

/// The common one-sided request, judged from MRs already known: a READ or
/// WRITE of one SGE of `sge.length > 0` bytes, without inline data, whose
/// local MR is `local` and remote MR `remote`. `true` means
/// [`check_send`] would pass it with those MRs; `false` means nothing:
/// ask [`check_send`].
#[inline]
pub fn one_sided_ok(opcode: u32, sge: &ibv_sge, remote_addr: u64, caps: &Caps, local: &MrInfo, remote: &MrInfo) -> bool {
    let (local_need, remote_need) = match opcode {
        ibv_wr_opcode::IBV_WR_RDMA_READ => (LOCAL_WRITE, REMOTE_READ),
        ibv_wr_opcode::IBV_WR_RDMA_WRITE => (0, REMOTE_WRITE),
        _ => return false,
    };
    let len = u64::from(sge.length);
    len > 0
        && caps.max_send_sge >= 1
        && len <= u64::from(caps.max_msg_size)
        && (local.access | remote.access) & NOT_MODELLED == 0
        && contains(local, sge.addr, len)
        && (local_need == 0 || local.access & local_need != 0)
        && remote.access & remote_need != 0
        && contains(remote, remote_addr, len)
}

/// Check a receive request of a VQP: the library (or the NIC, reading a
/// large message straight into it) writes every byte of its buffers.
pub fn check_recv<L: LocalMrs + ?Sized>(wr: &RecvWr<'_>, caps: &Caps, local: &L) -> Result<(), Reason> {
    total_len(wr.sge, caps.max_recv_sge, caps.max_msg_size)?;
    check_local(wr.sge, true, local)
}

/// The message length, once the SGE count and the length are within caps.
fn total_len(sge: &[ibv_sge], max_sge: u32, max_msg_size: u32) -> Result<u64, Reason> {
    if sge.len() as u64 > u64::from(max_sge) {
        return Err(Reason::TooManySge { num: sge.len(), max: max_sge });
    }
    // At most u32::MAX lengths below 2^32 each: the u64 sum cannot overflow,
    // and it cannot wrap around the limit the way a u32 sum could.
    let len: u64 = sge.iter().map(|s| u64::from(s.length)).sum();
    if len > u64::from(max_msg_size) {
        return Err(Reason::MessageTooLarge { len, max: max_msg_size });
    }
    Ok(len)
}

fn check_atomic_shape(wr: &SendWr<'_>, len: u64) -> Result<(), Reason> {
    let [sge] = wr.sge else {
        return Err(Reason::AtomicSge { num: wr.sge.len(), len });
    };
    if sge.length != 8 {
        return Err(Reason::AtomicSge { num: 1, len });
    }
    if sge.addr % 8 != 0 {
        return Err(Reason::AtomicMisaligned { side: Side::Local, addr: sge.addr });
    }
    if wr.remote_addr % 8 != 0 {
        return Err(Reason::AtomicMisaligned { side: Side::Remote, addr: wr.remote_addr });
    }
    Ok(())
}

fn check_local<L: LocalMrs + ?Sized>(sges: &[ibv_sge], nic_writes: bool, local: &L) -> Result<(), Reason> {
    for (i, s) in sges.iter().enumerate().filter(|(_, s)| s.length > 0) {
        let mr = local.local(s.lkey).ok_or(Reason::UnknownLkey { sge: i, lkey: s.lkey })?;
        if mr.access & NOT_MODELLED != 0 {
            return Err(Reason::MrNotSupported { key: s.lkey, remote: false, access: mr.access & NOT_MODELLED });
        }
        if !contains(&mr, s.addr, u64::from(s.length)) {
            return Err(Reason::SgeOutOfRange { sge: i, lkey: s.lkey, addr: s.addr, len: s.length, mr_addr: mr.addr, mr_len: mr.len });
        }
        if nic_writes && mr.access & LOCAL_WRITE == 0 {
            return Err(Reason::LocalAccess { sge: i, lkey: s.lkey });
        }
    }
    Ok(())
}

/// Whether `[addr, addr + len)` lies inside `mr` and below 2^64.
fn contains(mr: &MrInfo, addr: u64, len: u64) -> bool {
    let end = u128::from(addr) + u128::from(len);
    let mr_end = (u128::from(mr.addr) + u128::from(mr.len)).min(1 << 64);
    addr >= mr.addr && end <= mr_end
}

fn opcode_name(opcode: u32) -> Option<&'static str> {
    use ibv_wr_opcode::*;
    Some(match opcode {
        IBV_WR_RDMA_WRITE => "RDMA_WRITE",
        IBV_WR_RDMA_WRITE_WITH_IMM => "RDMA_WRITE_WITH_IMM",
        IBV_WR_SEND => "SEND",
        IBV_WR_SEND_WITH_IMM => "SEND_WITH_IMM",
        IBV_WR_RDMA_READ => "RDMA_READ",
        IBV_WR_ATOMIC_CMP_AND_SWP => "ATOMIC_CMP_AND_SWP",
        IBV_WR_ATOMIC_FETCH_AND_ADD => "ATOMIC_FETCH_AND_ADD",
        IBV_WR_LOCAL_INV => "LOCAL_INV",
        IBV_WR_BIND_MW => "BIND_MW",
        IBV_WR_SEND_WITH_INV => "SEND_WITH_INV",
        IBV_WR_TSO => "TSO",
        IBV_WR_DRIVER1 => "DRIVER1",
        IBV_WR_ATOMIC_WRITE => "ATOMIC_WRITE",
        _ => return None,
    })
}

struct Opcode(u32);

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match opcode_name(self.0) {
            Some(name) => write!(f, "IBV_WR_{name}"),
            None => write!(f, "opcode {}", self.0),
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// An address range as `[start, +length)`.
struct Span(u64, u64);

impl fmt::Display for Span {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{:#x}, +{})", self.0, self.1)
    }
}

fn access_name(flag: u32) -> Option<&'static str> {
    match flag {
        REMOTE_WRITE => Some("IBV_ACCESS_REMOTE_WRITE"),
        REMOTE_READ => Some("IBV_ACCESS_REMOTE_READ"),
        REMOTE_ATOMIC => Some("IBV_ACCESS_REMOTE_ATOMIC"),
        _ => None,
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Reason::UnsupportedOpcode { opcode } => {
                write!(f, "{} is not supported on a virtual QP", Opcode(opcode))
            }
            Reason::UnsupportedFlags { flags } => {
                write!(f, "send_flags {flags:#x} are not supported on a virtual QP")
            }
            Reason::TooManySge { num, max } => write!(f, "{num} SGEs, the QP allows {max}"),
            Reason::MessageTooLarge { len, max } => {
                write!(f, "message of {len} bytes, max_msg_sz is {max}")
            }
            Reason::InlineNotAllowed { opcode } => {
                let opcode = Opcode(opcode);
                write!(f, "IBV_SEND_INLINE with {opcode}: only SEND and RDMA_WRITE carry inline data")
            }
            Reason::InlineTooLarge { len, max } => {
                write!(f, "{len} bytes inline, the QP allows {max}")
            }
            Reason::AtomicSge { num, len } => {
                write!(f, "atomic with {num} SGEs of {len} bytes in all: it needs one SGE of 8 bytes")
            }
            Reason::AtomicMisaligned { side, addr } => {
                write!(f, "atomic {side} address {addr:#x} is not 8-byte aligned")
            }
            Reason::UnknownLkey { sge, lkey } => {
                write!(f, "SGE {sge}: lkey {lkey:#x} is not a local MR usable by this QP")
            }
            Reason::SgeOutOfRange { sge, lkey, addr, len, mr_addr, mr_len } => {
                let (range, mr) = (Span(addr, len.into()), Span(mr_addr, mr_len));
                write!(f, "SGE {sge}: {range} is outside MR lkey {lkey:#x} {mr}")
            }
            Reason::LocalAccess { sge, lkey } => {
                write!(f, "SGE {sge}: MR lkey {lkey:#x} lacks IBV_ACCESS_LOCAL_WRITE")
            }
            Reason::RemoteUnknown { rkey } => write!(f, "rkey {rkey:#x} is not an MR of the peer"),
            Reason::RemoteAccess { rkey, need } => match access_name(need) {
                Some(name) => write!(f, "remote MR rkey {rkey:#x} lacks {name}"),
                None => write!(f, "remote MR rkey {rkey:#x} lacks access {need:#x}"),
            },
            Reason::RemoteOutOfRange { rkey, addr, len, mr_addr, mr_len } => {
                let (range, mr) = (Span(addr, len), Span(mr_addr, mr_len));
                write!(f, "remote {range} is outside MR rkey {rkey:#x} {mr}")
            }
            Reason::AtomicsNotSupported => write!(f, "atomics: the device's atomic_cap is IBV_ATOMIC_NONE"),
            Reason::MrNotSupported { key, remote, access } => {
                let (side, k) = if remote { ("remote MR", "rkey") } else { ("MR", "lkey") };
                write!(f, "{side} {k} {key:#x} has access {access:#x} (IBV_ACCESS_ZERO_BASED/ON_DEMAND), not supported on a virtual QP")
            }
        }
    }
}

/// SGEs as `addr+length/lkey` (`ibv_sge` has no `Debug`).
struct Sges<'a>(&'a [ibv_sge]);

struct Sge<'a>(&'a ibv_sge);

impl fmt::Debug for Sge<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}+{}/{:#x}", self.0.addr, self.0.length, self.0.lkey)
    }
}

impl fmt::Debug for Sges<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.0.iter().map(Sge)).finish()
    }
}

impl fmt::Debug for SendWr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendWr")
            .field("opcode", &format_args!("{}", Opcode(self.opcode)))
            .field("send_flags", &format_args!("{:#x}", self.send_flags))
            .field("sge", &Sges(self.sge))
            .field("remote_addr", &format_args!("{:#x}", self.remote_addr))
            .field("rkey", &format_args!("{:#x}", self.rkey))
            .finish()
    }
}

impl fmt::Debug for RecvWr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvWr").field("sge", &Sges(self.sge)).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;
    use ibv_wr_opcode::*;

    const INLINE: u32 = ibv_send_flags::IBV_SEND_INLINE.0;
    const SIGNALED: u32 = ibv_send_flags::IBV_SEND_SIGNALED.0;
    const ALL_REMOTE: u32 = REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC;

    const CAPS: Caps = Caps { max_send_sge: 4, max_recv_sge: 2, max_inline_data: 64, max_msg_size: 1 << 20, atomics: true };

    /// A set of MRs: local MRs by lkey, or the peer's by rkey with the ones
    /// not fetched yet hidden.
    #[derive(Default)]
    struct Table {
        mrs: Vec<(u32, MrInfo, bool)>,
    }

    impl Table {
        fn with(mut self, key: u32, addr: u64, len: u64, access: u32) -> Table {
            self.mrs.push((key, MrInfo { addr, len, access }, true));
            self
        }
        fn hidden(mut self, key: u32, addr: u64, len: u64, access: u32) -> Table {
            self.mrs.push((key, MrInfo { addr, len, access }, false));
            self
        }
        fn reveal_all(&mut self) {
            self.mrs.iter_mut().for_each(|m| m.2 = true);
        }
        fn get(&self, key: u32) -> Option<MrInfo> {
            self.mrs.iter().find(|m| m.0 == key && m.2).map(|m| m.1)
        }
    }

    impl LocalMrs for Table {
        fn local(&self, lkey: u32) -> Option<MrInfo> {
            self.get(lkey)
        }
    }

    impl RemoteMrs for Table {
        fn remote(&self, rkey: u32) -> Option<MrInfo> {
            self.get(rkey)
        }
    }

    fn sge(addr: u64, length: u32, lkey: u32) -> ibv_sge {
        ibv_sge { addr, length, lkey }
    }

    /// Local MRs: 1 writable [0x1000, +0x1000), 2 read-only [0x8000, +0x100).
    fn local() -> Table {
        Table::default().with(1, 0x1000, 0x1000, LOCAL_WRITE).with(2, 0x8000, 0x100, 0)
    }

    /// Peer MRs: 7 with every remote access at [0x10_0000, +0x1000).
    fn remote() -> Table {
        Table::default().with(7, 0x10_0000, 0x1000, ALL_REMOTE)
    }

    fn wr(opcode: u32, sge: &[ibv_sge]) -> SendWr<'_> {
        SendWr { opcode, send_flags: SIGNALED, sge, remote_addr: 0x10_0000, rkey: 7 }
    }

    fn reject(r: Reason) -> Result<(), Verdict> {
        Err(Verdict::Reject(r))
    }

    #[test]
    fn valid_requests_of_every_supported_opcode_pass() {
        let data = [sge(0x1000, 64, 1), sge(0x8000, 0x100, 2)];
        for op in [IBV_WR_SEND, IBV_WR_SEND_WITH_IMM, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM] {
            assert_eq!(check_send(&wr(op, &data), &CAPS, &local(), &remote()), Ok(()), "{op}");
        }
        let read = [sge(0x1000, 64, 1)];
        assert_eq!(check_send(&wr(IBV_WR_RDMA_READ, &read), &CAPS, &local(), &remote()), Ok(()));
        let atomic = [sge(0x1008, 8, 1)];
        for op in [IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD] {
            assert_eq!(check_send(&wr(op, &atomic), &CAPS, &local(), &remote()), Ok(()), "{op}");
        }
        let recv = RecvWr { sge: &[sge(0x1000, 0x1000, 1)] };
        assert_eq!(check_recv(&recv, &CAPS, &local()), Ok(()));
    }

    #[test]
    fn opcodes_a_vqp_cannot_carry_are_rejected() {
        for op in [IBV_WR_LOCAL_INV, IBV_WR_BIND_MW, IBV_WR_SEND_WITH_INV, IBV_WR_TSO, IBV_WR_DRIVER1, IBV_WR_ATOMIC_WRITE, 12, u32::MAX] {
            let r = check_send(&wr(op, &[]), &CAPS, &local(), &remote());
            assert_eq!(r, reject(Reason::UnsupportedOpcode { opcode: op }));
        }
    }

    #[test]
    fn flags_beyond_fence_signaled_solicited_inline_are_rejected() {
        let all = ALLOWED_SEND_FLAGS;
        let ok = SendWr { send_flags: all, ..wr(IBV_WR_SEND, &[]) };
        assert_eq!(check_send(&ok, &CAPS, &local(), &remote()), Ok(()));
        let csum = ibv_send_flags::IBV_SEND_IP_CSUM.0;
        for extra in [csum, 1 << 31] {
            let w = SendWr { send_flags: all | extra, ..wr(IBV_WR_SEND, &[]) };
            let r = check_send(&w, &CAPS, &local(), &remote());
            assert_eq!(r, reject(Reason::UnsupportedFlags { flags: extra }));
        }
    }

    #[test]
    fn sge_count_is_bounded_by_the_caps_of_each_queue() {
        let four = [sge(0x1000, 1, 1); 4];
        assert_eq!(check_send(&wr(IBV_WR_SEND, &four), &CAPS, &local(), &remote()), Ok(()));
        let five = [sge(0x1000, 1, 1); 5];
        let r = check_send(&wr(IBV_WR_SEND, &five), &CAPS, &local(), &remote());
        assert_eq!(r, reject(Reason::TooManySge { num: 5, max: 4 }));

        assert_eq!(check_recv(&RecvWr { sge: &four[..2] }, &CAPS, &local()), Ok(()));
        let r = check_recv(&RecvWr { sge: &four[..3] }, &CAPS, &local());
        assert_eq!(r, Err(Reason::TooManySge { num: 3, max: 2 }));
    }

    #[test]
    fn the_device_bounds_messages_and_atomics() {
        // A port below RC's 2 GiB: a 1.5 GiB READ is refused, not passed
        // to the link (where it would fail the WQE and the link).
        let qp = Caps { max_msg_size: 1 << 31, ..CAPS };
        let dev = qp.on_device(1 << 30, crate::sys::ibv_atomic_cap::IBV_ATOMIC_HCA);
        assert_eq!((dev.max_msg_size, dev.atomics), (1 << 30, true));
        let mrs = Table::default().with(1, 0, 1 << 32, LOCAL_WRITE);
        let peer = Table::default().with(9, 0, 1 << 32, ALL_REMOTE);
        let big = [sge(0, 3 << 29, 1)];
        let read = SendWr { remote_addr: 0, rkey: 9, ..wr(IBV_WR_RDMA_READ, &big) };
        assert_eq!(check_send(&read, &qp, &mrs, &peer), Ok(()));
        assert_eq!(check_send(&read, &dev, &mrs, &peer), reject(Reason::MessageTooLarge { len: 3 << 29, max: 1 << 30 }));
        assert!(!one_sided_ok(IBV_WR_RDMA_READ, &big[0], 0, &dev, &mrs.get(1).unwrap(), &peer.get(9).unwrap()));
        assert!(one_sided_ok(IBV_WR_RDMA_READ, &big[0], 0, &qp, &mrs.get(1).unwrap(), &peer.get(9).unwrap()));
        // The smaller bound wins either way.
        assert_eq!(Caps { max_msg_size: 100, ..CAPS }.on_device(u32::MAX, 1).max_msg_size, 100);
        // No atomics on the device: refused before anything else about them.
        let none = qp.on_device(1 << 31, crate::sys::ibv_atomic_cap::IBV_ATOMIC_NONE);
        assert!(!none.atomics);
        let one = [sge(8, 8, 1)];
        let cas = SendWr { remote_addr: 8, rkey: 9, ..wr(IBV_WR_ATOMIC_CMP_AND_SWP, &one) };
        assert_eq!(check_send(&cas, &qp, &mrs, &peer), Ok(()));
        assert_eq!(check_send(&cas, &none, &mrs, &peer), reject(Reason::AtomicsNotSupported));
        let faa = SendWr { opcode: IBV_WR_ATOMIC_FETCH_AND_ADD, ..cas };
        assert_eq!(check_send(&faa, &none, &mrs, &peer), reject(Reason::AtomicsNotSupported));
        // GLOB is as good as HCA for a VQP.
        assert!(qp.on_device(1, crate::sys::ibv_atomic_cap::IBV_ATOMIC_GLOB).atomics);
    }

    #[test]
    fn zero_based_and_on_demand_mrs_are_refused_on_either_side() {
        const ZB: u32 = ibv_access_flags::IBV_ACCESS_ZERO_BASED.0;
        const ODP: u32 = ibv_access_flags::IBV_ACCESS_ON_DEMAND.0;
        for odd in [ZB, ODP, ZB | ODP] {
            let mrs = Table::default().with(1, 0x1000, 4096, LOCAL_WRITE).with(2, 0x1000, 4096, LOCAL_WRITE | odd);
            let peer = Table::default().with(8, 0, 4096, ALL_REMOTE).with(9, 0, 4096, ALL_REMOTE | odd);
            let good = [sge(0x1000, 64, 1)];
            let odd_local = [sge(0x1000, 64, 2)];
            let local_reason = Reason::MrNotSupported { key: 2, remote: false, access: odd };
            let remote_reason = Reason::MrNotSupported { key: 9, remote: true, access: odd };
            for op in [IBV_WR_SEND, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ] {
                let w = SendWr { rkey: 8, ..wr(op, &odd_local) };
                assert_eq!(check_send(&w, &CAPS, &mrs, &peer), reject(local_reason), "{op}");
                if op != IBV_WR_SEND {
                    let w = SendWr { rkey: 9, ..wr(op, &good) };
                    assert_eq!(check_send(&w, &CAPS, &mrs, &peer), reject(remote_reason), "{op}");
                    assert!(!one_sided_ok(op, &good[0], 0, &CAPS, &mrs.get(1).unwrap(), &peer.get(9).unwrap()));
                    assert!(!one_sided_ok(op, &odd_local[0], 0, &CAPS, &mrs.get(2).unwrap(), &peer.get(8).unwrap()));
                    assert!(one_sided_ok(op, &good[0], 0, &CAPS, &mrs.get(1).unwrap(), &peer.get(8).unwrap()));
                }
            }
            // Receives too; a zero-length SGE names no MR.
            assert_eq!(check_recv(&RecvWr { sge: &odd_local }, &CAPS, &mrs), Err(local_reason));
            assert_eq!(check_recv(&RecvWr { sge: &[sge(0, 0, 2)] }, &CAPS, &mrs), Ok(()));
            // Inline data reads no MR.
            let inl = SendWr { send_flags: INLINE, ..wr(IBV_WR_SEND, &odd_local) };
            assert_eq!(check_send(&inl, &CAPS, &mrs, &peer), Ok(()));
        }
    }

    #[test]
    fn total_length_is_bounded_by_max_msg_size_without_wrapping() {
        let mrs = Table::default().with(1, 0, u64::MAX, LOCAL_WRITE);
        let caps = Caps { max_msg_size: 100, ..CAPS };
        let at_limit = [sge(0, 60, 1), sge(0, 40, 1)];
        assert_eq!(check_send(&wr(IBV_WR_SEND, &at_limit), &caps, &mrs, &remote()), Ok(()));
        let over = [sge(0, 60, 1), sge(0, 41, 1)];
        let r = check_send(&wr(IBV_WR_SEND, &over), &caps, &mrs, &remote());
        assert_eq!(r, reject(Reason::MessageTooLarge { len: 101, max: 100 }));
        assert_eq!(check_recv(&RecvWr { sge: &over }, &caps, &mrs), Err(Reason::MessageTooLarge { len: 101, max: 100 }));

        // A u32 sum would wrap to u32::MAX - 1 and pass.
        let caps = Caps { max_msg_size: u32::MAX, ..CAPS };
        let huge = [sge(0, u32::MAX, 1), sge(0, u32::MAX, 1)];
        let r = check_send(&wr(IBV_WR_SEND, &huge), &caps, &mrs, &remote());
        assert_eq!(r, reject(Reason::MessageTooLarge { len: 2 * u64::from(u32::MAX), max: u32::MAX }));
    }

    #[test]
    fn inline_is_bounded_and_skips_lkeys() {
        let no_mrs = Table::default();
        let at_limit = [sge(0xdead, 60, 99), sge(0xbeef, 4, 98)];
        for op in [IBV_WR_SEND, IBV_WR_SEND_WITH_IMM, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM] {
            let w = SendWr { send_flags: INLINE, ..wr(op, &at_limit) };
            assert_eq!(check_send(&w, &CAPS, &no_mrs, &remote()), Ok(()), "{op}");
        }
        // Without the flag the same buffers must be registered.
        let r = check_send(&wr(IBV_WR_SEND, &at_limit), &CAPS, &no_mrs, &remote());
        assert_eq!(r, reject(Reason::UnknownLkey { sge: 0, lkey: 99 }));

        let over = [sge(0xdead, 65, 99)];
        let w = SendWr { send_flags: INLINE, ..wr(IBV_WR_SEND, &over) };
        let r = check_send(&w, &CAPS, &no_mrs, &remote());
        assert_eq!(r, reject(Reason::InlineTooLarge { len: 65, max: 64 }));
    }

    #[test]
    fn inline_write_still_needs_the_remote_range() {
        let data = [sge(0xdead, 16, 99)];
        let w = SendWr { send_flags: INLINE, remote_addr: 0x10_0ff8, ..wr(IBV_WR_RDMA_WRITE, &data) };
        let r = check_send(&w, &CAPS, &local(), &remote());
        assert!(matches!(r, Err(Verdict::Reject(Reason::RemoteOutOfRange { len: 16, .. }))), "{r:?}");
    }

    #[test]
    fn inline_is_refused_where_the_nic_writes_local_memory() {
        let one = [sge(0x1000, 8, 1)];
        for op in [IBV_WR_RDMA_READ, IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD] {
            let w = SendWr { send_flags: INLINE, ..wr(op, &one) };
            let r = check_send(&w, &CAPS, &local(), &remote());
            assert_eq!(r, reject(Reason::InlineNotAllowed { opcode: op }));
        }
    }

    #[test]
    fn unknown_lkey_names_the_sge_and_zero_length_sges_are_skipped() {
        let data = [sge(0x1000, 8, 1), sge(0, 0, 42), sge(0x1000, 8, 43)];
        let r = check_send(&wr(IBV_WR_SEND, &data), &CAPS, &local(), &remote());
        assert_eq!(r, reject(Reason::UnknownLkey { sge: 2, lkey: 43 }));
        assert_eq!(check_send(&wr(IBV_WR_SEND, &data[..2]), &CAPS, &local(), &remote()), Ok(()));
        let r = check_recv(&RecvWr { sge: &data }, &CAPS, &local());
        assert_eq!(r, Err(Reason::TooManySge { num: 3, max: 2 }));
        let r = check_recv(&RecvWr { sge: &data[1..] }, &CAPS, &local());
        assert_eq!(r, Err(Reason::UnknownLkey { sge: 1, lkey: 43 }));
    }

    #[test]
    fn sge_range_boundaries() {
        let send = |s: ibv_sge| check_send(&wr(IBV_WR_SEND, &[s]), &CAPS, &local(), &remote());
        let out = |addr, len| reject(Reason::SgeOutOfRange { sge: 0, lkey: 1, addr, len, mr_addr: 0x1000, mr_len: 0x1000 });
        assert_eq!(send(sge(0x1000, 0x1000, 1)), Ok(()), "the whole MR");
        assert_eq!(send(sge(0x1fff, 1, 1)), Ok(()), "the last byte");
        assert_eq!(send(sge(0x1fff, 2, 1)), out(0x1fff, 2), "one past the end");
        assert_eq!(send(sge(0x2000, 1, 1)), out(0x2000, 1), "starts at the end");
        assert_eq!(send(sge(0xfff, 1, 1)), out(0xfff, 1), "one before the start");
        assert_eq!(send(sge(0xfff, 0, 1)), Ok(()), "zero length is never looked at");
    }

    #[test]
    fn ranges_near_the_top_of_the_address_space_never_wrap() {
        let top = Table::default().with(1, u64::MAX - 15, 16, LOCAL_WRITE);
        let send = |s: ibv_sge| check_send(&wr(IBV_WR_SEND, &[s]), &CAPS, &top, &remote());
        assert_eq!(send(sge(u64::MAX, 1, 1)), Ok(()), "the last byte of the address space");
        assert_eq!(send(sge(u64::MAX - 7, 8, 1)), Ok(()));
        let r = send(sge(u64::MAX - 3, 8, 1));
        assert!(matches!(r, Err(Verdict::Reject(Reason::SgeOutOfRange { .. }))), "wraps: {r:?}");

        // An MR entry claiming to run past 2^64 does not make wrapping legal.
        let bogus = Table::default().with(1, u64::MAX - 7, 64, LOCAL_WRITE);
        let r = check_send(&wr(IBV_WR_SEND, &[sge(u64::MAX - 3, 8, 1)]), &CAPS, &bogus, &remote());
        assert!(matches!(r, Err(Verdict::Reject(Reason::SgeOutOfRange { .. }))), "{r:?}");

        let peer = Table::default().with(7, u64::MAX - 15, 16, ALL_REMOTE);
        let read = |remote_addr, len| {
            let data = [sge(0x1000, len, 1)];
            let w = SendWr { remote_addr, ..wr(IBV_WR_RDMA_READ, &data) };
            check_send(&w, &CAPS, &local(), &peer)
        };
        assert_eq!(read(u64::MAX - 15, 16), Ok(()));
        let r = read(u64::MAX - 7, 16);
        let expected = Reason::RemoteOutOfRange { rkey: 7, addr: u64::MAX - 7, len: 16, mr_addr: u64::MAX - 15, mr_len: 16 };
        assert_eq!(r, reject(expected));
    }

    #[test]
    fn the_nic_writes_only_into_locally_writable_mrs() {
        let ro = [sge(0x8000, 8, 2)];
        assert_eq!(check_send(&wr(IBV_WR_SEND, &ro), &CAPS, &local(), &remote()), Ok(()));
        assert_eq!(check_send(&wr(IBV_WR_RDMA_WRITE, &ro), &CAPS, &local(), &remote()), Ok(()));
        for op in [IBV_WR_RDMA_READ, IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD] {
            let r = check_send(&wr(op, &ro), &CAPS, &local(), &remote());
            assert_eq!(r, reject(Reason::LocalAccess { sge: 0, lkey: 2 }), "{op}");
        }
        let recv = [sge(0x1000, 8, 1), sge(0x8000, 8, 2)];
        let r = check_recv(&RecvWr { sge: &recv }, &CAPS, &local());
        assert_eq!(r, Err(Reason::LocalAccess { sge: 1, lkey: 2 }));
    }

    #[test]
    fn atomics_take_one_aligned_eight_byte_sge() {
        let op = IBV_WR_ATOMIC_FETCH_AND_ADD;
        let check = |w: &SendWr<'_>| check_send(w, &CAPS, &local(), &remote());
        assert_eq!(check(&wr(op, &[])), reject(Reason::AtomicSge { num: 0, len: 0 }));
        let two = [sge(0x1000, 4, 1), sge(0x1004, 4, 1)];
        assert_eq!(check(&wr(op, &two)), reject(Reason::AtomicSge { num: 2, len: 8 }));
        for len in [0, 4, 16] {
            let one = [sge(0x1000, len, 1)];
            assert_eq!(check(&wr(op, &one)), reject(Reason::AtomicSge { num: 1, len: u64::from(len) }));
        }
        let local_off = [sge(0x1004, 8, 1)];
        let r = check(&wr(op, &local_off));
        assert_eq!(r, reject(Reason::AtomicMisaligned { side: Side::Local, addr: 0x1004 }));
        let ok = [sge(0x1000, 8, 1)];
        let w = SendWr { remote_addr: 0x10_0004, ..wr(op, &ok) };
        let r = check(&w);
        assert_eq!(r, reject(Reason::AtomicMisaligned { side: Side::Remote, addr: 0x10_0004 }));
        let w = SendWr { remote_addr: 0x10_0ff8, ..wr(op, &ok) };
        assert_eq!(check(&w), Ok(()), "the last aligned word of the remote MR");
    }

    #[test]
    fn each_rdma_op_needs_its_remote_access() {
        let peer = Table::default().with(1, 0, 0x1000, REMOTE_READ | REMOTE_ATOMIC).with(2, 0, 0x1000, REMOTE_WRITE | REMOTE_ATOMIC).with(
            3,
            0,
            0x1000,
            REMOTE_WRITE | REMOTE_READ,
        );
        let data = [sge(0x1000, 8, 1)];
        for (op, rkey, need) in [
            (IBV_WR_RDMA_WRITE, 1, REMOTE_WRITE),
            (IBV_WR_RDMA_WRITE_WITH_IMM, 1, REMOTE_WRITE),
            (IBV_WR_RDMA_READ, 2, REMOTE_READ),
            (IBV_WR_ATOMIC_CMP_AND_SWP, 3, REMOTE_ATOMIC),
            (IBV_WR_ATOMIC_FETCH_AND_ADD, 3, REMOTE_ATOMIC),
        ] {
            let w = SendWr { remote_addr: 0, rkey, ..wr(op, &data) };
            let r = check_send(&w, &CAPS, &local(), &peer);
            assert_eq!(r, reject(Reason::RemoteAccess { rkey, need }), "{op}");
        }
    }

    #[test]
    fn remote_range_boundaries() {
        let write = |remote_addr, len| {
            let data = [sge(0x1000, len, 1)];
            let w = SendWr { remote_addr, ..wr(IBV_WR_RDMA_WRITE, &data) };
            check_send(&w, &CAPS, &local(), &remote())
        };
        let out = |addr, len| reject(Reason::RemoteOutOfRange { rkey: 7, addr, len, mr_addr: 0x10_0000, mr_len: 0x1000 });
        assert_eq!(write(0x10_0000, 0x1000), Ok(()), "the whole MR");
        assert_eq!(write(0x10_0fff, 1), Ok(()), "the last byte");
        assert_eq!(write(0x10_0fff, 2), out(0x10_0fff, 2), "one past the end");
        assert_eq!(write(0x0f_ffff, 1), out(0x0f_ffff, 1), "one before the start");
        assert_eq!(write(u64::MAX, 2), out(u64::MAX, 2), "wraps");
    }

    #[test]
    fn zero_length_rdma_needs_a_known_rkey_and_an_address_inside() {
        let w = |remote_addr, rkey| SendWr { remote_addr, rkey, ..wr(IBV_WR_RDMA_WRITE_WITH_IMM, &[]) };
        assert_eq!(check_send(&w(0x10_1000, 7), &CAPS, &local(), &remote()), Ok(()), "at the end");
        let r = check_send(&w(0x10_1001, 7), &CAPS, &local(), &remote());
        assert!(matches!(r, Err(Verdict::Reject(Reason::RemoteOutOfRange { len: 0, .. }))), "{r:?}");
        let r = check_send(&w(0, 0), &CAPS, &local(), &remote());
        assert_eq!(r, Err(Verdict::NeedRemote { rkey: 0 }));
    }

    #[test]
    fn sends_never_consult_the_peer() {
        let data = [sge(0x1000, 8, 1)];
        let w = SendWr { rkey: 12345, remote_addr: 3, ..wr(IBV_WR_SEND_WITH_IMM, &data) };
        assert_eq!(check_send(&w, &CAPS, &local(), &Table::default()), Ok(()));
    }

    #[test]
    fn unknown_rkey_asks_for_the_peer_table_then_passes_or_is_final() {
        let mut peer = Table::default().hidden(7, 0x10_0000, 0x1000, ALL_REMOTE);
        let data = [sge(0x1000, 64, 1)];
        let read = wr(IBV_WR_RDMA_READ, &data);
        let first = check_send(&read, &CAPS, &local(), &peer);
        assert_eq!(first, Err(Verdict::NeedRemote { rkey: 7 }));
        peer.reveal_all();
        assert_eq!(check_send(&read, &CAPS, &local(), &peer), Ok(()));

        let stranger = SendWr { rkey: 8, ..read };
        let v = check_send(&stranger, &CAPS, &local(), &peer).unwrap_err();
        assert_eq!(v.into_reason(), Reason::RemoteUnknown { rkey: 8 });
        assert_eq!(Verdict::Reject(Reason::TooManySge { num: 1, max: 0 }).into_reason(), Reason::TooManySge { num: 1, max: 0 });
    }

    #[test]
    fn local_faults_win_over_fetching_the_peer_table() {
        let data = [sge(0x1000, 64, 9)];
        let w = SendWr { rkey: 8, ..wr(IBV_WR_RDMA_READ, &data) };
        let r = check_send(&w, &CAPS, &local(), &Table::default());
        assert_eq!(r, reject(Reason::UnknownLkey { sge: 0, lkey: 9 }));
    }

    #[test]
    fn every_reason_is_einval_and_prints_its_limits() {
        let cases = [
            (Reason::UnsupportedOpcode { opcode: IBV_WR_SEND_WITH_INV }, "IBV_WR_SEND_WITH_INV"),
            (Reason::UnsupportedOpcode { opcode: 77 }, "opcode 77"),
            (Reason::UnsupportedFlags { flags: 0x10 }, "0x10"),
            (Reason::TooManySge { num: 5, max: 4 }, "5 SGEs, the QP allows 4"),
            (Reason::MessageTooLarge { len: 101, max: 100 }, "101 bytes, max_msg_sz is 100"),
            (Reason::InlineNotAllowed { opcode: IBV_WR_RDMA_READ }, "IBV_WR_RDMA_READ"),
            (Reason::InlineTooLarge { len: 65, max: 64 }, "65 bytes inline, the QP allows 64"),
            (Reason::AtomicSge { num: 2, len: 8 }, "2 SGEs"),
            (Reason::AtomicMisaligned { side: Side::Remote, addr: 0x4 }, "remote address 0x4"),
            (Reason::UnknownLkey { sge: 3, lkey: 0x2a }, "SGE 3: lkey 0x2a"),
            (
                Reason::SgeOutOfRange { sge: 1, lkey: 1, addr: 0x1fff, len: 2, mr_addr: 0x1000, mr_len: 4096 },
                "SGE 1: [0x1fff, +2) is outside MR lkey 0x1 [0x1000, +4096)",
            ),
            (Reason::LocalAccess { sge: 0, lkey: 2 }, "IBV_ACCESS_LOCAL_WRITE"),
            (Reason::RemoteUnknown { rkey: 8 }, "rkey 0x8"),
            (Reason::RemoteAccess { rkey: 1, need: REMOTE_ATOMIC }, "lacks IBV_ACCESS_REMOTE_ATOMIC"),
            (
                Reason::RemoteOutOfRange { rkey: 7, addr: 0x10, len: 9, mr_addr: 0, mr_len: 0x10 },
                "remote [0x10, +9) is outside MR rkey 0x7 [0x0, +16)",
            ),
            (Reason::AtomicsNotSupported, "IBV_ATOMIC_NONE"),
            (Reason::MrNotSupported { key: 3, remote: true, access: 32 }, "remote MR rkey 0x3 has access 0x20"),
        ];
        for (reason, text) in cases {
            assert_eq!(reason.errno(), Errno::EINVAL);
            let line = reason.to_string();
            assert!(line.contains(text), "{line:?} lacks {text:?}");
        }
    }

    /// Whether every byte of `[addr, addr + len)` is a byte of `mr`, for the
    /// reference model: stated on the last byte rather than the end.
    fn model_inside(mr: &MrInfo, addr: u64, len: u64) -> bool {
        let (a, l, start, size) = (addr as u128, len as u128, mr.addr as u128, mr.len as u128);
        let last_of_space = u64::MAX as u128;
        if l == 0 {
            return start <= a && a <= (start + size).min(last_of_space + 1);
        }
        if size == 0 {
            return false;
        }
        let (last, mr_last) = (a + l - 1, start + size - 1);
        start <= a && last <= mr_last && last <= last_of_space
    }

    /// Every rule of the module doc that a request breaks without asking
    /// the peer, stated independently of the implementation's order.
    fn model_local(sges: &[ibv_sge], op: Option<Op>, flags: u32, caps: &Caps, recv: bool, mrs: &Table) -> Vec<Reason> {
        let mut v = Vec::new();
        let inline = !recv && flags & INLINE != 0;
        let max_sge = if recv { caps.max_recv_sge } else { caps.max_send_sge };
        if sges.len() > max_sge as usize {
            v.push(Reason::TooManySge { num: sges.len(), max: max_sge });
        }
        let total: u64 = sges.iter().map(|s| s.length as u64).sum();
        if total > caps.max_msg_size as u64 {
            v.push(Reason::MessageTooLarge { len: total, max: caps.max_msg_size });
        }
        if inline && total > caps.max_inline_data as u64 {
            v.push(Reason::InlineTooLarge { len: total, max: caps.max_inline_data });
        }
        if op == Some(Op::Atomic) && (sges.len() != 1 || total != 8) {
            v.push(Reason::AtomicSge { num: sges.len(), len: total });
        }
        if op == Some(Op::Atomic) && sges.len() == 1 && sges[0].addr % 8 != 0 {
            v.push(Reason::AtomicMisaligned { side: Side::Local, addr: sges[0].addr });
        }
        let writes = recv || matches!(op, Some(Op::Read | Op::Atomic));
        for (i, s) in sges.iter().enumerate() {
            if inline || s.length == 0 {
                continue;
            }
            match mrs.get(s.lkey) {
                None => v.push(Reason::UnknownLkey { sge: i, lkey: s.lkey }),
                Some(mr) => {
                    if !model_inside(&mr, s.addr, s.length as u64) {
                        v.push(Reason::SgeOutOfRange {
                            sge: i,
                            lkey: s.lkey,
                            addr: s.addr,
                            len: s.length,
                            mr_addr: mr.addr,
                            mr_len: mr.len,
                        });
                    }
                    if writes && mr.access & LOCAL_WRITE == 0 {
                        v.push(Reason::LocalAccess { sge: i, lkey: s.lkey });
                    }
                }
            }
        }
        v
    }

    /// The expected outcome of `check_send` as a set: `Ok(())`, NeedRemote,
    /// or any of the broken rules (the implementation reports the first).
    fn model_send(w: &SendWr<'_>, caps: &Caps, mrs: &Table, peer: &Table) -> Result<(), Vec<Verdict>> {
        let op = match w.opcode {
            IBV_WR_SEND | IBV_WR_SEND_WITH_IMM => Op::Send,
            IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM => Op::Write,
            IBV_WR_RDMA_READ => Op::Read,
            IBV_WR_ATOMIC_CMP_AND_SWP | IBV_WR_ATOMIC_FETCH_AND_ADD => Op::Atomic,
            _ => return Err(vec![Reason::UnsupportedOpcode { opcode: w.opcode }.into()]),
        };
        let mut v = model_local(w.sge, Some(op), w.send_flags, caps, false, mrs);
        let inline = w.send_flags & INLINE != 0;
        if w.send_flags & !(1 | 2 | 4 | 8) != 0 {
            v.push(Reason::UnsupportedFlags { flags: w.send_flags & !15 });
        }
        if inline && matches!(op, Op::Read | Op::Atomic) {
            v.push(Reason::InlineNotAllowed { opcode: w.opcode });
        }
        if op == Op::Atomic && w.remote_addr % 8 != 0 {
            v.push(Reason::AtomicMisaligned { side: Side::Remote, addr: w.remote_addr });
        }
        if !v.is_empty() {
            return Err(v.into_iter().map(Verdict::Reject).collect());
        }
        let need = match op {
            Op::Send => return Ok(()),
            Op::Write => REMOTE_WRITE,
            Op::Read => REMOTE_READ,
            Op::Atomic => REMOTE_ATOMIC,
        };
        let Some(mr) = peer.get(w.rkey) else {
            return Err(vec![Verdict::NeedRemote { rkey: w.rkey }]);
        };
        let total: u64 = w.sge.iter().map(|s| s.length as u64).sum();
        let mut v = Vec::new();
        if mr.access & need == 0 {
            v.push(Reason::RemoteAccess { rkey: w.rkey, need }.into());
        }
        if !model_inside(&mr, w.remote_addr, total) {
            let (addr, mr_addr, mr_len) = (w.remote_addr, mr.addr, mr.len);
            v.push(Reason::RemoteOutOfRange { rkey: w.rkey, addr, len: total, mr_addr, mr_len }.into());
        }
        if v.is_empty() {
            Ok(())
        } else {
            Err(v)
        }
    }

    /// Keys 1..=4 with MRs that are mostly well formed and permissive, so
    /// that most requests break no rule or exactly one.
    fn random_table(rng: &mut Rng, all_known: bool) -> Table {
        let mut t = Table::default();
        for key in 1..=4 {
            let base = rng.pick(&[0, 0x1000, 0x7fff_f000, u64::MAX - 4095, u64::MAX - 63]);
            // Ending at 2^64, or claiming to run past it, included.
            let len = rng.pick(&[64, 4096, 4096, 0, 1, (u64::MAX - base).saturating_add(1)]);
            let access = (0..4).filter(|_| rng.below(8) != 0).map(|bit| 1 << bit).sum();
            t = if all_known || rng.below(4) != 0 { t.with(key, base, len, access) } else { t.hidden(key, base, len, access) };
        }
        t
    }

    /// A key of the tables most of the time, else one they lack.
    fn random_key(rng: &mut Rng) -> u32 {
        if rng.below(10) == 0 {
            rng.pick(&[0, 5])
        } else {
            1 + rng.below(4) as u32
        }
    }

    /// An address in the MR of `key` (any MR if there is none): mostly an
    /// aligned one near its start, else one next to either edge.
    fn random_addr(rng: &mut Rng, t: &Table, key: u32) -> u64 {
        let (_, mr, _) = *t.mrs.iter().find(|m| m.0 == key).unwrap_or(&t.mrs[0]);
        if rng.below(4) != 0 {
            return mr.addr.wrapping_add(8 * rng.below(mr.len.min(64) / 8 + 1));
        }
        let edge = if rng.below(2) == 0 { mr.addr } else { mr.addr.wrapping_add(mr.len) };
        edge.wrapping_add_signed(rng.pick(&[-9, -8, -1, 0, 1, 4, 7, 8]))
    }

    #[test]
    fn random_requests_agree_with_a_reference_model() {
        use std::collections::HashSet;
        let mut rng = Rng(0x5eed_cafe_f00d_d00d);
        let opcodes = [
            IBV_WR_SEND,
            IBV_WR_SEND_WITH_IMM,
            IBV_WR_RDMA_WRITE,
            IBV_WR_RDMA_WRITE_WITH_IMM,
            IBV_WR_RDMA_READ,
            IBV_WR_ATOMIC_CMP_AND_SWP,
            IBV_WR_ATOMIC_FETCH_AND_ADD,
        ];
        let bad_opcodes = [IBV_WR_SEND_WITH_INV, IBV_WR_LOCAL_INV, IBV_WR_BIND_MW, 99];
        let csum = ibv_send_flags::IBV_SEND_IP_CSUM.0;
        let flags = [0, SIGNALED, SIGNALED | 1, SIGNALED | 4, INLINE, INLINE | SIGNALED, csum, 1 << 20];
        // Outcomes where the model allows exactly one verdict: a rule the
        // implementation forgot would show up as a mismatch there.
        let mut sole = HashSet::new();
        for _ in 0..20_000 {
            let caps = Caps {
                max_send_sge: rng.pick(&[4, 4, 2, 1]),
                max_recv_sge: rng.pick(&[4, 4, 2, 1]),
                max_inline_data: rng.pick(&[64, 64, 8, 0]),
                max_msg_size: rng.pick(&[u32::MAX, 1 << 20, 4096, 16]),
                atomics: true,
            };
            let mrs = random_table(&mut rng, true);
            let mut peer = random_table(&mut rng, false);
            let n = rng.pick(&[1, 1, 1, 0, 2, 3, 4]);
            let mut sges = [sge(0, 0, 0); 4];
            for s in &mut sges[..n] {
                let lkey = random_key(&mut rng);
                let addr = random_addr(&mut rng, &mrs, lkey);
                *s = sge(addr, rng.pick(&[8, 8, 8, 16, 0, 1, 7, 9, 64, u32::MAX]), lkey);
            }
            let sge_list = &sges[..n];
            let rkey = random_key(&mut rng);
            let w = SendWr {
                opcode: if rng.below(10) == 0 { rng.pick(&bad_opcodes) } else { rng.pick(&opcodes) },
                send_flags: rng.pick(&flags),
                sge: sge_list,
                remote_addr: random_addr(&mut rng, &peer, rkey),
                rkey,
            };

            let mut got = check_send(&w, &caps, &mrs, &peer);
            let mut want = model_send(&w, &caps, &mrs, &peer);
            if got == Err(Verdict::NeedRemote { rkey }) {
                assert_eq!(want, Err(vec![Verdict::NeedRemote { rkey }]), "{w:?}");
                sole.insert("need remote".to_string());
                peer.reveal_all();
                got = check_send(&w, &caps, &mrs, &peer);
                want = model_send(&w, &caps, &mrs, &peer);
            }
            // The fast path's judgement agrees wherever it applies: it
            // never passes what the checks reject, and passes everything
            // of its shape they accept.
            let fast_shape = n == 1
                && matches!(w.opcode, IBV_WR_RDMA_READ | IBV_WR_RDMA_WRITE)
                && w.send_flags & !(SIGNALED | ibv_send_flags::IBV_SEND_FENCE.0) == 0
                && sges[0].length > 0;
            if let (true, Some(l), Some(r)) = (fast_shape, mrs.get(sges[0].lkey), peer.get(rkey)) {
                let fast = one_sided_ok(w.opcode, &sges[0], w.remote_addr, &caps, &l, &r);
                assert_eq!(fast, got == Ok(()), "{w:?} {l:?} {r:?}");
                if fast {
                    sole.insert("fast".to_string());
                }
            }
            match (&got, &want) {
                (Ok(()), Ok(())) => {
                    sole.insert("ok".to_string());
                }
                (Err(v), Err(allowed)) if allowed.contains(v) => {
                    if allowed.len() == 1 {
                        sole.insert(format!("{:?}", std::mem::discriminant(&v.into_reason())));
                    }
                }
                _ => panic!("{w:?} with {caps:?}: got {got:?}, the model allows {want:?}"),
            }

            let recv = RecvWr { sge: sge_list };
            let got = check_recv(&recv, &caps, &mrs);
            let want = model_local(sge_list, None, 0, &caps, true, &mrs);
            match got {
                Ok(()) => assert!(want.is_empty(), "{recv:?}: model rejects with {want:?}"),
                Err(r) => assert!(want.contains(&r), "{recv:?}: {r:?} not in {want:?}"),
            }
        }
        // Acceptance, a fetch, a fast-path acceptance, and every reason
        // alone (an rkey still unknown after the fetch is RemoteUnknown).
        assert_eq!(sole.len(), 3 + 14, "outcomes seen alone: {sole:?}");
    }
}
