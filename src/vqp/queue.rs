//! The software queues of the virtual-QP data path.
//!
//! A VQP owns no hardware queue: its work requests go to a physical QP shared
//! with other VQPs, and the physical completions come back through the wr_id
//! codec, which names the VQP and a sequence number. What a real RC QP and CQ
//! keep in their rings therefore lives here, so that an application sees the
//! semantics of a QP of its own:
//!
//! - [`SendRing`]: a VQP's send queue. It keeps the application's wr_id and
//!   whether it asked for a completion (neither travels in the physical WQE)
//!   and retires FIFO as RC does: a completion for WR `n` means every WR
//!   before it completed too; an error completes `n` with its status, flushes
//!   everything behind it and leaves the queue in the error state.
//! - [`RecvRing`]: the receive buffers posted on a VQP, into which messages
//!   arriving on a shared link are scattered.
//! - [`PhysSq`]: overflow accounting of one shared physical send queue: how
//!   many WQEs may still be posted, and which ones the library must signal
//!   so that polling always frees room.
//! - [`SoftCq`]: the completions delivered to one application CQ.
//!
//! All four are plain data without locks: the caller holds the lock of the
//! VQP, physical QP or CQ. Storage is allocated once, at creation, and
//! fallibly (an oversized queue is `ENOMEM`, not an abort); no operation
//! allocates.

use crate::error::{Errno, Result};
use crate::sys::{ibv_sge, ibv_wc, ibv_wc_opcode, ibv_wc_status};
use std::mem::MaybeUninit;

/// The deepest send or receive queue and physical send queue accepted. A
/// [`SendRing`] window then fills at most half of its `u16` sequence space,
/// so a sequence number retired within the last `MAX_DEPTH` posts can never
/// be mistaken for an outstanding one. Also the largest `max_qp_wr` of
/// common NICs (mlx5).
pub const MAX_DEPTH: u32 = 32768;

/// Most SGEs per posted receive buffer: bounds the flat SGE array of a
/// [`RecvRing`] (NICs offer about 30).
pub const MAX_RECV_SGE: u32 = 64;

/// `n` slots filled by `fill`, or `ENOMEM` instead of aborting the
/// application's process when the allocation fails.
fn alloc_slots<T>(n: usize, fill: impl FnMut() -> T) -> Result<Box<[T]>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Errno::ENOMEM)?;
    v.resize_with(n, fill);
    Ok(v.into_boxed_slice())
}

/// A work completion with every field zero.
fn empty_wc() -> ibv_wc {
    // SAFETY: ibv_wc holds integers and a union of two u32s: all-zero bytes
    // are a valid value.
    unsafe { crate::obj::zeroed() }
}

/// Head and length of a bounded FIFO over `cap` preallocated slots.
#[derive(Debug)]
struct Fifo {
    head: usize,
    len: usize,
    cap: usize,
}

impl Fifo {
    fn new(cap: usize) -> Fifo {
        Fifo { head: 0, len: 0, cap }
    }

    /// The slot of the entry `i` places behind the front.
    fn slot(&self, i: usize) -> usize {
        debug_assert!(i < self.len);
        let s = self.head + i;
        if s >= self.cap {
            s - self.cap
        } else {
            s
        }
    }

    /// Claims the slot behind the back; `None` when full.
    fn push(&mut self) -> Option<usize> {
        if self.len == self.cap {
            return None;
        }
        self.len += 1;
        Some(self.slot(self.len - 1))
    }

    /// Claims the slot before the front; `None` when full.
    fn push_front(&mut self) -> Option<usize> {
        if self.len == self.cap {
            return None;
        }
        self.head = if self.head == 0 { self.cap - 1 } else { self.head - 1 };
        self.len += 1;
        Some(self.head)
    }

    /// Releases the front slot and returns it; `None` when empty.
    fn pop(&mut self) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let front = self.head;
        self.head = if front + 1 == self.cap { 0 } else { front + 1 };
        self.len -= 1;
        Some(front)
    }
}

/// A completion for the application, before it becomes an `ibv_wc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    pub status: ibv_wc_status::Type,
    pub opcode: ibv_wc_opcode::Type,
    pub byte_len: u32,
}

impl Completion {
    /// The work completion the application polls from the VQP `qp_num`.
    pub fn to_wc(self, qp_num: u32) -> ibv_wc {
        ibv_wc { wr_id: self.wr_id, status: self.status, opcode: self.opcode, byte_len: self.byte_len, qp_num, ..empty_wc() }
    }
}

/// What a [`SendRing`] remembers of one posted send WR.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendEntry {
    /// The application's wr_id.
    pub wr_id: u64,
    /// The application set `IBV_SEND_SIGNALED` (or the QP signals all WRs).
    pub signaled: bool,
    /// The opcode its completion reports.
    pub opcode: ibv_wc_opcode::Type,
    pub byte_len: u32,
    /// A large message: its physical completion only says the receiver
    /// has the header; the WR completes when the receiver's DONE says the
    /// payload was READ ([`SendRing::done`]).
    pub awaits_done: bool,
}

impl SendEntry {
    fn completion(self, status: ibv_wc_status::Type) -> Completion {
        Completion { wr_id: self.wr_id, status, opcode: self.opcode, byte_len: self.byte_len }
    }
}

/// One VQP's send queue: the WRs posted and not yet reported, FIFO, each
/// named by a wrapping `u16` sequence number.
///
/// In the error state (after an error completion or [`SendRing::flush`])
/// the ring tracks no physical WQE: completions still arriving for WRs
/// posted earlier are stale. New WRs are accepted, as a real QP in ERR
/// accepts them, but must not be posted: they wait in the ring, completed
/// with `IBV_WC_WR_FLUSH_ERR`, until [`SendRing::take_flushed`] reports them.
#[derive(Debug)]
pub struct SendRing {
    entries: Box<[SendEntry]>,
    fifo: Fifo,
    /// Sequence number of the front entry.
    head_seq: u16,
    /// Front entries completed on the wire, some held by one awaiting DONE.
    acked: usize,
    error: bool,
    /// The status the next WR reported in the error state takes instead of
    /// a flush: the peer was found gone while nothing was outstanding.
    owed: Option<ibv_wc_status::Type>,
}

impl SendRing {
    /// A queue of `max_send_wr` entries (0 is a QP that cannot send);
    /// `EINVAL` above [`MAX_DEPTH`].
    pub fn new(max_send_wr: u32) -> Result<SendRing> {
        if max_send_wr > MAX_DEPTH {
            return Err(Errno::EINVAL);
        }
        let cap = max_send_wr as usize;
        Ok(SendRing {
            entries: alloc_slots(cap, SendEntry::default)?,
            fifo: Fifo::new(cap),
            head_seq: 0,
            acked: 0,
            error: false,
            owed: None,
        })
    }

    /// Appends a WR and returns its sequence number; `ENOMEM` when the queue
    /// is full, as a real QP's post_send.
    #[inline]
    pub fn push(&mut self, entry: SendEntry) -> Result<u16> {
        let slot = self.fifo.push().ok_or(Errno::ENOMEM)?;
        self.entries[slot] = entry;
        // The window is at most MAX_DEPTH long: its offset fits a u16.
        Ok(self.head_seq.wrapping_add((self.fifo.len - 1) as u16))
    }

    /// A physical completion for the WR `seq`: every WR up to and
    /// including it has completed on the wire (RC completes in order). With
    /// `IBV_WC_SUCCESS` they are retired, oldest first, up to the first
    /// that still awaits its DONE (the ones behind it wait, in order); only
    /// signaled WRs are reported (an unsignaled WR's slot is freed
    /// silently). With an error the WRs before `seq` succeeded, except that
    /// the first one still awaiting a DONE never gets it and takes the
    /// error instead; the failing WR is reported with `status` whether
    /// signaled or not, every WR behind it is flushed, and the queue enters
    /// the error state.
    ///
    /// `EINVAL`, with nothing retired or reported, when `seq` is not
    /// outstanding: a stale or corrupt completion (in the error state every
    /// completion is stale).
    pub fn complete(&mut self, seq: u16, status: ibv_wc_status::Type, emit: &mut impl FnMut(Completion)) -> Result<()> {
        let pos = usize::from(seq.wrapping_sub(self.head_seq));
        if self.error || pos >= self.fifo.len {
            return Err(Errno::EINVAL);
        }
        if status != ibv_wc_status::IBV_WC_SUCCESS {
            let fail = (0..pos).find(|&i| self.entries[self.fifo.slot(i)].awaits_done).unwrap_or(pos);
            for i in 0..=fail {
                let Some(entry) = self.pop_front() else { break };
                if i == fail {
                    emit(entry.completion(status));
                } else if entry.signaled {
                    emit(entry.completion(ibv_wc_status::IBV_WC_SUCCESS));
                }
            }
            self.flush(emit);
            return Ok(());
        }
        self.acked = self.acked.max(pos + 1);
        self.retire(emit);
        Ok(())
    }

    /// The receiver's DONE for the large message `seq`: it completes once
    /// its own physical completion (and those before it) arrived too.
    /// `EINVAL` when `seq` is not an outstanding large message.
    pub fn done(&mut self, seq: u16, emit: &mut impl FnMut(Completion)) -> Result<()> {
        let pos = usize::from(seq.wrapping_sub(self.head_seq));
        if self.error || pos >= self.fifo.len {
            return Err(Errno::EINVAL);
        }
        let slot = self.fifo.slot(pos);
        if !self.entries[slot].awaits_done {
            return Err(Errno::EINVAL);
        }
        self.entries[slot].awaits_done = false;
        self.retire(emit);
        Ok(())
    }

    /// Report the completed WRs at the front, up to the first awaiting a DONE.
    fn retire(&mut self, emit: &mut impl FnMut(Completion)) {
        while self.acked > 0 && self.fifo.len > 0 {
            if self.entries[self.fifo.slot(0)].awaits_done {
                return;
            }
            let Some(entry) = self.pop_front() else { return };
            self.acked -= 1;
            if entry.signaled {
                emit(entry.completion(ibv_wc_status::IBV_WC_SUCCESS));
            }
        }
    }

    /// The oldest WR outstanding fails with `status` (whether signaled or
    /// not), the rest are flushed, and the queue enters the error state:
    /// what an RC QP reports when its peer stops answering. With nothing
    /// outstanding, the next WR posted takes `status` (an RC QP finds its
    /// peer gone only when it sends), those after it are flushed.
    pub fn fail_oldest(&mut self, status: ibv_wc_status::Type, emit: &mut impl FnMut(Completion)) {
        if self.fifo.len == 0 && !self.error {
            self.error = true;
            self.owed = Some(status);
            return;
        }
        if self.complete(self.head_seq, status, emit).is_err() {
            self.flush(emit);
        }
    }

    /// Reports every WR in the queue with `IBV_WC_WR_FLUSH_ERR`, FIFO, and
    /// enters the error state: the VQP moved to ERR or is being destroyed.
    /// Their physical completions, if any arrive, are stale from now on.
    pub fn flush(&mut self, emit: &mut impl FnMut(Completion)) {
        self.error = true;
        self.acked = 0;
        while let Some(entry) = self.pop_front() {
            emit(entry.completion(self.owed.take().unwrap_or(ibv_wc_status::IBV_WC_WR_FLUSH_ERR)));
        }
    }

    /// Out of the error state, empty (a transparent VQP moved to RESET).
    /// Sequence numbers go on from where they were, so completions still
    /// arriving for the flushed WRs stay stale.
    pub fn revive(&mut self) {
        self.flush(&mut |_| {});
        self.error = false;
        self.owed = None;
    }

    /// In the error state, reports the WRs pushed since the last report as
    /// flushed; otherwise does nothing.
    pub fn take_flushed(&mut self, emit: &mut impl FnMut(Completion)) {
        if self.error {
            self.flush(emit);
        }
    }

    /// WRs posted and not yet reported.
    pub fn outstanding(&self) -> usize {
        self.fifo.len
    }

    pub fn is_error(&self) -> bool {
        self.error
    }

    fn pop_front(&mut self) -> Option<SendEntry> {
        let slot = self.fifo.pop()?;
        self.head_seq = self.head_seq.wrapping_add(1);
        Some(self.entries[slot])
    }
}

/// Where a receive WR's SGE list lives in [`RecvRing::sges`].
#[derive(Clone, Copy, Debug, Default)]
struct RecvSlot {
    wr_id: u64,
    num_sge: usize,
}

/// A VQP's posted receive buffers, FIFO. The SGE lists live in one flat
/// array of `max_recv_wr × max_recv_sge` entries indexed by slot, so a post
/// copies its list without allocating.
pub struct RecvRing {
    slots: Box<[RecvSlot]>,
    sges: Box<[ibv_sge]>,
    max_sge: usize,
    fifo: Fifo,
}

impl RecvRing {
    /// A queue of `max_recv_wr` buffers of up to `max_recv_sge` SGEs each;
    /// `EINVAL` above [`MAX_DEPTH`] or [`MAX_RECV_SGE`].
    pub fn new(max_recv_wr: u32, max_recv_sge: u32) -> Result<RecvRing> {
        if max_recv_wr > MAX_DEPTH || max_recv_sge > MAX_RECV_SGE {
            return Err(Errno::EINVAL);
        }
        let (cap, max_sge) = (max_recv_wr as usize, max_recv_sge as usize);
        let empty_sge = || ibv_sge { addr: 0, length: 0, lkey: 0 };
        Ok(RecvRing {
            slots: alloc_slots(cap, RecvSlot::default)?,
            sges: alloc_slots(cap * max_sge, empty_sge)?,
            max_sge,
            fifo: Fifo::new(cap),
        })
    }

    /// Appends a buffer (an application's `ibv_post_recv`): `EINVAL` for
    /// more SGEs than the queue was created with, `ENOMEM` when full.
    pub fn push(&mut self, wr_id: u64, sg_list: &[ibv_sge]) -> Result<()> {
        self.put(wr_id, sg_list, Fifo::push)
    }

    /// Gives a buffer taken by [`RecvRing::pop_front`] back, in front (the
    /// message it was taken for never arrived): `ENOMEM` when the queue
    /// was filled meanwhile.
    pub fn push_front(&mut self, wr_id: u64, sg_list: &[ibv_sge]) -> Result<()> {
        self.put(wr_id, sg_list, Fifo::push_front)
    }

    fn put(&mut self, wr_id: u64, sg_list: &[ibv_sge], claim: fn(&mut Fifo) -> Option<usize>) -> Result<()> {
        if sg_list.len() > self.max_sge {
            return Err(Errno::EINVAL);
        }
        let slot = claim(&mut self.fifo).ok_or(Errno::ENOMEM)?;
        let base = slot * self.max_sge;
        self.sges[base..base + sg_list.len()].copy_from_slice(sg_list);
        self.slots[slot] = RecvSlot { wr_id, num_sge: sg_list.len() };
        Ok(())
    }

    /// Takes the oldest buffer: the one the next message lands in.
    pub fn pop_front(&mut self) -> Option<RecvWr<'_>> {
        let slot = self.fifo.pop()?;
        let RecvSlot { wr_id, num_sge } = self.slots[slot];
        let base = slot * self.max_sge;
        Some(RecvWr { wr_id, sg_list: &self.sges[base..base + num_sge] })
    }

    /// Reports every buffer with `IBV_WC_WR_FLUSH_ERR`, FIFO.
    pub fn flush(&mut self, emit: &mut impl FnMut(Completion)) {
        while let Some(wr) = self.pop_front() {
            emit(Completion {
                wr_id: wr.wr_id,
                status: ibv_wc_status::IBV_WC_WR_FLUSH_ERR,
                opcode: ibv_wc_opcode::IBV_WC_RECV,
                byte_len: 0,
            });
        }
    }

    /// The receive WRs it holds at most.
    pub fn capacity(&self) -> u32 {
        self.slots.len() as u32
    }

    pub fn len(&self) -> usize {
        self.fifo.len
    }

    pub fn is_empty(&self) -> bool {
        self.fifo.len == 0
    }
}

/// A receive buffer taken from a [`RecvRing`].
#[derive(Clone, Copy)]
pub struct RecvWr<'a> {
    pub wr_id: u64,
    pub sg_list: &'a [ibv_sge],
}

impl<'a> RecvWr<'a> {
    /// Where `len` bytes of a message land in this buffer: the pieces, in
    /// order, each with its SGE's lkey (ready to be a READ's local SGE).
    /// Zero-length SGEs are skipped, as providers do. A message longer than
    /// the buffer is `Err(IBV_WC_LOC_LEN_ERR)`, the status its completion
    /// carries.
    pub fn scatter(&self, len: u32) -> std::result::Result<Scatter<'a>, ibv_wc_status::Type> {
        let room: u64 = self.sg_list.iter().map(|s| u64::from(s.length)).sum();
        if u64::from(len) > room {
            return Err(ibv_wc_status::IBV_WC_LOC_LEN_ERR);
        }
        Ok(Scatter { sges: self.sg_list.iter(), left: len })
    }
}

/// The pieces of a [`RecvWr::scatter`] plan.
#[derive(Clone)]
pub struct Scatter<'a> {
    sges: std::slice::Iter<'a, ibv_sge>,
    left: u32,
}

impl Iterator for Scatter<'_> {
    type Item = ibv_sge;

    fn next(&mut self) -> Option<ibv_sge> {
        while self.left > 0 {
            let sge = self.sges.next()?;
            let length = sge.length.min(self.left);
            if length > 0 {
                self.left -= length;
                return Some(ibv_sge { length, ..*sge });
            }
        }
        None
    }
}

/// How the next WQE on a physical QP is to be posted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PostDecision {
    /// Post it with `IBV_SEND_SIGNALED`.
    pub signal: bool,
    /// The library signals it although the application did not ask.
    pub forced: bool,
    /// WQEs its completion retires: itself and the unsignaled ones since the
    /// previous signaled WQE (0 when not signaled). The wr_id carries it back
    /// to [`PhysSq::on_completion`].
    pub retired: u16,
}

/// Overflow accounting of one shared physical send queue of depth `D`.
///
/// An unsignaled WQE leaves the queue only when a later signaled one
/// completes, so the library must never post more than `D` WQEs, and must
/// never fill the queue with unsignaled WQEs alone: no completion would ever
/// free it. Policy: every WQE the application signals is signaled, and at
/// most `S - 1` unsignaled WQEs follow a signaled one (the `S`-th is forced
/// to signal), with `1 <= S <= D`.
///
/// Why a full queue always makes progress: of the `D` outstanding WQEs at
/// most `S - 1` are unsignaled tail, so at least `D - S + 1 >= 1` are
/// covered by a signaled WQE already posted. Its completion (success, or an
/// error CQE, which RC generates for unsignaled WQEs too) will arrive, so a
/// caller that finds the queue full can poll the physical CQ until
/// [`PhysSq::try_post`] succeeds. The default `S = max(1, D/2)` leaves
/// `D/2 + 1` covered WQEs in a full queue, that is at least two signaled
/// ones: while the poller retires one group the next is already in flight.
#[derive(Debug)]
pub struct PhysSq {
    depth: u16,
    period: u16,
    outstanding: u16,
    /// Unsignaled WQEs posted since the last signaled one (always < period).
    run: u16,
    /// WQEs ever posted and ever retired: RC completes a send queue in
    /// order, so `retired_total >= m` says that every WQE posted up to
    /// the [`PhysSq::mark`] `m` completed (teardown waits on it).
    posted_total: u64,
    retired_total: u64,
    /// Every completion of the link was seen (it failed: its QP is in ERR
    /// and flushed): nothing posted on it touches memory any more.
    drained: bool,
}

impl PhysSq {
    /// A send queue of `depth` WQEs with the default signal period
    /// `max(1, depth/2)`.
    pub fn new(depth: u32) -> Result<PhysSq> {
        PhysSq::with_signal_period(depth, (depth / 2).max(1))
    }

    /// A send queue of `depth` WQEs where at least every `period`-th WQE is
    /// signaled; `EINVAL` unless `1 <= period <= depth <= MAX_DEPTH`.
    pub fn with_signal_period(depth: u32, period: u32) -> Result<PhysSq> {
        if depth > MAX_DEPTH || period == 0 || period > depth {
            return Err(Errno::EINVAL);
        }
        // Both fit: period <= depth <= MAX_DEPTH < u16::MAX.
        Ok(PhysSq { depth: depth as u16, period: period as u16, outstanding: 0, run: 0, posted_total: 0, retired_total: 0, drained: false })
    }

    /// Claims room for one WQE and decides whether to signal it; `None` when
    /// the queue is full (poll the physical CQ and retry; see the type's
    /// comment for why that terminates).
    pub fn try_post(&mut self, app_signaled: bool) -> Option<PostDecision> {
        if self.outstanding == self.depth {
            return None;
        }
        debug_assert!(self.run < self.period);
        self.outstanding += 1;
        self.posted_total += 1;
        let forced = !app_signaled && self.run + 1 == self.period;
        if !(app_signaled || forced) {
            self.run += 1;
            return Some(PostDecision { signal: false, forced: false, retired: 0 });
        }
        let retired = self.run + 1;
        self.run = 0;
        Some(PostDecision { signal: true, forced, retired })
    }

    /// A signaled WQE completed, retiring `retired` WQEs. `EINVAL`, with
    /// nothing changed, when that is more than the signaled WQEs cover (or
    /// 0): a corrupt wr_id.
    pub fn on_completion(&mut self, retired: u16) -> Result<()> {
        let covered = self.outstanding - self.run;
        if retired == 0 || retired > covered {
            return Err(Errno::EINVAL);
        }
        self.outstanding -= retired;
        self.retired_total += u64::from(retired);
        Ok(())
    }

    /// Where the queue stands: every WQE posted so far is before it.
    pub fn mark(&self) -> u64 {
        self.posted_total
    }

    /// Whether every WQE posted before `mark` completed (or the link was
    /// drained: failed, every completion seen).
    pub fn reached(&self, mark: u64) -> bool {
        self.drained || self.retired_total >= mark
    }

    /// Whether a signaled WQE at or after `mark` is posted: its completion
    /// (which retires the ones before it) will come. An unsignaled tail
    /// needs a signaled WQE behind it.
    pub fn covered(&self, mark: u64) -> bool {
        self.posted_total - u64::from(self.run) >= mark
    }

    /// The link failed and every completion it had was seen.
    pub fn set_drained(&mut self) {
        self.drained = true;
    }

    /// WQEs posted and not yet retired.
    pub fn outstanding(&self) -> usize {
        usize::from(self.outstanding)
    }

    /// Forgets every outstanding WQE: the physical QP went to the error
    /// state and is being replaced or reset.
    pub fn reset(&mut self) {
        self.outstanding = 0;
        self.run = 0;
        self.retired_total = self.posted_total;
    }
}

/// A completion did not fit in a [`SoftCq`]: the CQ overran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Overrun;

/// The completions waiting in one application CQ, FIFO, at most the `cqe`
/// the CQ was granted.
///
/// An overrun is an error on a real CQ, reported by an `IBV_EVENT_CQ_ERR`
/// async event, not a reason to drop older completions: the one that does
/// not fit is refused and the sticky [`SoftCq::is_overrun`] flag tells the
/// caller to raise the event.
pub struct SoftCq {
    wcs: Box<[ibv_wc]>,
    fifo: Fifo,
    overrun: bool,
}

impl SoftCq {
    /// A CQ of `cqe` entries; `EINVAL` for 0.
    pub fn new(cqe: u32) -> Result<SoftCq> {
        if cqe == 0 {
            return Err(Errno::EINVAL);
        }
        let cap = cqe as usize;
        Ok(SoftCq { wcs: alloc_slots(cap, empty_wc)?, fifo: Fifo::new(cap), overrun: false })
    }

    /// Appends a completion, or refuses it and sets the overrun flag.
    pub fn push(&mut self, wc: ibv_wc) -> std::result::Result<(), Overrun> {
        let Some(slot) = self.fifo.push() else {
            self.overrun = true;
            return Err(Overrun);
        };
        self.wcs[slot] = wc;
        Ok(())
    }

    /// Moves up to `out.len()` completions into `out`, oldest first, and
    /// returns how many. `out` may be uninitialised: it is usually the
    /// array an application passed to `ibv_poll_cq`.
    pub fn pop_into(&mut self, out: &mut [MaybeUninit<ibv_wc>]) -> usize {
        let mut n = 0;
        for dst in out.iter_mut() {
            let Some(slot) = self.fifo.pop() else { break };
            // SAFETY: a plain C struct (no drop); the slot is free now and
            // overwritten by the push that reuses it.
            dst.write(unsafe { std::ptr::read(&self.wcs[slot]) });
            n += 1;
        }
        n
    }

    pub fn len(&self) -> usize {
        self.fifo.len
    }

    pub fn is_empty(&self) -> bool {
        self.fifo.len == 0
    }

    /// A completion was ever refused (sticky: a real CQ stays in error).
    pub fn is_overrun(&self) -> bool {
        self.overrun
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;
    use ibv_wc_opcode::{IBV_WC_RDMA_WRITE, IBV_WC_RECV, IBV_WC_SEND};
    use ibv_wc_status::{IBV_WC_LOC_LEN_ERR, IBV_WC_REM_ACCESS_ERR, IBV_WC_RETRY_EXC_ERR, IBV_WC_SUCCESS, IBV_WC_WR_FLUSH_ERR};
    use std::collections::VecDeque;

    fn entry(wr_id: u64, signaled: bool) -> SendEntry {
        SendEntry { wr_id, signaled, opcode: IBV_WC_SEND, byte_len: wr_id as u32 * 10, awaits_done: false }
    }

    fn large(wr_id: u64) -> SendEntry {
        SendEntry { awaits_done: true, ..entry(wr_id, true) }
    }

    fn done(r: &mut SendRing, seq: u16) -> (Result<()>, Vec<(u64, u32)>) {
        let mut out = Vec::new();
        let res = r.done(seq, &mut |c| out.push((c.wr_id, c.status)));
        (res, out)
    }

    #[test]
    fn send_ring_large_message_completes_after_wire_and_done_in_either_order() {
        let mut r = SendRing::new(8).unwrap();
        r.push(entry(1, true)).unwrap();
        r.push(large(2)).unwrap();
        r.push(entry(3, true)).unwrap();
        // The wire completes all three; the large one holds itself and 3.
        assert_eq!(complete(&mut r, 2, IBV_WC_SUCCESS), (Ok(()), vec![(1, IBV_WC_SUCCESS)]));
        assert_eq!(r.outstanding(), 2);
        assert_eq!(done(&mut r, 1), (Ok(()), vec![(2, IBV_WC_SUCCESS), (3, IBV_WC_SUCCESS)]));
        assert_eq!(r.outstanding(), 0);
        // DONE before the wire completion: nothing until the wire says so.
        r.push(large(4)).unwrap();
        r.push(entry(5, true)).unwrap();
        assert_eq!(done(&mut r, 3), (Ok(()), vec![]));
        assert_eq!(complete(&mut r, 3, IBV_WC_SUCCESS), (Ok(()), vec![(4, IBV_WC_SUCCESS)]));
        assert_eq!(complete(&mut r, 4, IBV_WC_SUCCESS), (Ok(()), vec![(5, IBV_WC_SUCCESS)]));
        // A DONE for a WR that is not a pending large message.
        r.push(entry(6, true)).unwrap();
        assert_eq!(done(&mut r, 5).0, Err(Errno::EINVAL), "not large");
        assert_eq!(done(&mut r, 3).0, Err(Errno::EINVAL), "retired");
        assert_eq!(done(&mut r, 9).0, Err(Errno::EINVAL), "never posted");
    }

    #[test]
    fn send_ring_error_behind_a_large_message_fails_the_large_one() {
        let mut r = SendRing::new(8).unwrap();
        r.push(entry(1, false)).unwrap();
        r.push(large(2)).unwrap();
        r.push(entry(3, true)).unwrap();
        r.push(entry(4, true)).unwrap();
        // The link broke at 3: the large message 2 never gets its DONE.
        assert_eq!(
            complete(&mut r, 2, IBV_WC_RETRY_EXC_ERR),
            (Ok(()), vec![(2, IBV_WC_RETRY_EXC_ERR), (3, IBV_WC_WR_FLUSH_ERR), (4, IBV_WC_WR_FLUSH_ERR)])
        );
        assert!(r.is_error());
        assert_eq!(done(&mut r, 1).0, Err(Errno::EINVAL), "stale DONE after the error");
    }

    /// Results as (wr_id, status) pairs.
    fn complete(r: &mut SendRing, seq: u16, status: u32) -> (Result<()>, Vec<(u64, u32)>) {
        let mut out = Vec::new();
        let res = r.complete(seq, status, &mut |c| out.push((c.wr_id, c.status)));
        (res, out)
    }

    fn flush(r: &mut SendRing) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        r.flush(&mut |c| out.push((c.wr_id, c.status)));
        out
    }

    fn take_flushed(r: &mut SendRing) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        r.take_flushed(&mut |c| out.push((c.wr_id, c.status)));
        out
    }

    #[test]
    fn send_ring_depth_bounds() {
        assert_eq!(SendRing::new(MAX_DEPTH + 1).err(), Some(Errno::EINVAL));
        assert_eq!(SendRing::new(MAX_DEPTH).map(|r| r.outstanding()), Ok(0));
        let mut none = SendRing::new(0).unwrap();
        assert_eq!(none.push(entry(1, true)), Err(Errno::ENOMEM));
        assert_eq!(none.outstanding(), 0);
    }

    #[test]
    fn send_ring_full_is_enomem_until_a_completion_frees_room() {
        let mut r = SendRing::new(3).unwrap();
        assert_eq!(r.push(entry(1, false)), Ok(0));
        assert_eq!(r.push(entry(2, true)), Ok(1));
        assert_eq!(r.push(entry(3, true)), Ok(2));
        assert_eq!(r.push(entry(4, true)), Err(Errno::ENOMEM));
        assert_eq!(r.outstanding(), 3);
        assert_eq!(complete(&mut r, 1, IBV_WC_SUCCESS), (Ok(()), vec![(2, IBV_WC_SUCCESS)]));
        assert_eq!(r.outstanding(), 1);
        assert_eq!(r.push(entry(4, true)), Ok(3));
        assert_eq!(r.push(entry(5, true)), Ok(4));
        assert_eq!(r.push(entry(6, true)), Err(Errno::ENOMEM));
    }

    #[test]
    fn send_ring_reports_only_signaled_wrs_and_frees_unsignaled_slots() {
        let mut r = SendRing::new(8).unwrap();
        for (id, sig) in [(10, false), (11, true), (12, false), (13, false), (14, true)] {
            r.push(entry(id, sig)).unwrap();
        }
        // seq 1 (wr 11) retires the unsignaled wr 10 silently.
        assert_eq!(complete(&mut r, 1, IBV_WC_SUCCESS), (Ok(()), vec![(11, IBV_WC_SUCCESS)]));
        assert_eq!(r.outstanding(), 3);
        // A signal the library forced on the unsignaled wr 13: nothing to report.
        assert_eq!(complete(&mut r, 3, IBV_WC_SUCCESS), (Ok(()), vec![]));
        assert_eq!(r.outstanding(), 1);
        let mut seen = Vec::new();
        r.complete(4, IBV_WC_SUCCESS, &mut |c| seen.push(c)).unwrap();
        let want = Completion { wr_id: 14, status: IBV_WC_SUCCESS, opcode: IBV_WC_SEND, byte_len: 140 };
        assert_eq!(seen, vec![want]);
        assert_eq!(r.outstanding(), 0);
        assert!(!r.is_error());
    }

    #[test]
    fn send_ring_error_in_the_middle_completes_flushes_and_enters_error() {
        let mut r = SendRing::new(8).unwrap();
        for (id, sig) in [(1, false), (2, true), (3, false), (4, false), (5, true)] {
            r.push(entry(id, sig)).unwrap();
        }
        // Error on the unsignaled wr 3: 1 succeeded silently, 2 succeeded
        // and was not yet reported, 3 carries the error, 4 and 5 flush.
        let want = vec![(2, IBV_WC_SUCCESS), (3, IBV_WC_REM_ACCESS_ERR), (4, IBV_WC_WR_FLUSH_ERR), (5, IBV_WC_WR_FLUSH_ERR)];
        assert_eq!(complete(&mut r, 2, IBV_WC_REM_ACCESS_ERR), (Ok(()), want));
        assert!(r.is_error());
        assert_eq!(r.outstanding(), 0);
        // The physical flush completions of 4 and 5 are stale now.
        assert_eq!(complete(&mut r, 4, IBV_WC_WR_FLUSH_ERR), (Err(Errno::EINVAL), vec![]));
    }

    #[test]
    fn send_ring_error_on_the_last_wr_flushes_nothing_else() {
        let mut r = SendRing::new(4).unwrap();
        r.push(entry(1, true)).unwrap();
        let out = complete(&mut r, 0, IBV_WC_REM_ACCESS_ERR);
        assert_eq!(out, (Ok(()), vec![(1, IBV_WC_REM_ACCESS_ERR)]));
        assert!(r.is_error());
    }

    #[test]
    fn send_ring_rejects_stale_and_unposted_seqs_without_effect() {
        let mut r = SendRing::new(4).unwrap();
        for id in 0..3 {
            r.push(entry(id, true)).unwrap();
        }
        complete(&mut r, 0, IBV_WC_SUCCESS).0.unwrap();
        for seq in [0, 3, 4, u16::MAX, 0x8000] {
            assert_eq!(complete(&mut r, seq, IBV_WC_SUCCESS), (Err(Errno::EINVAL), vec![]));
            assert_eq!(complete(&mut r, seq, IBV_WC_REM_ACCESS_ERR), (Err(Errno::EINVAL), vec![]));
        }
        assert_eq!(r.outstanding(), 2);
        assert!(!r.is_error());
        assert_eq!(complete(&mut r, 2, IBV_WC_SUCCESS), (Ok(()), vec![(1, 0), (2, 0)]));
        assert_eq!(complete(&mut r, 2, IBV_WC_SUCCESS), (Err(Errno::EINVAL), vec![]));
    }

    #[test]
    fn send_ring_failed_while_empty_gives_the_next_wr_the_error() {
        let mut r = SendRing::new(4).unwrap();
        let mut out = Vec::new();
        r.fail_oldest(IBV_WC_RETRY_EXC_ERR, &mut |c| out.push((c.wr_id, c.status)));
        assert_eq!(out, vec![], "nothing outstanding, nothing reported");
        assert!(r.is_error());
        r.push(entry(1, false)).unwrap();
        r.push(entry(2, true)).unwrap();
        assert_eq!(take_flushed(&mut r), vec![(1, IBV_WC_RETRY_EXC_ERR), (2, IBV_WC_WR_FLUSH_ERR)]);
        r.push(entry(3, true)).unwrap();
        assert_eq!(take_flushed(&mut r), vec![(3, IBV_WC_WR_FLUSH_ERR)], "owed once");
        r.revive();
        r.fail_oldest(IBV_WC_RETRY_EXC_ERR, &mut |_| {});
        r.revive();
        r.push(entry(4, true)).unwrap();
        assert_eq!(take_flushed(&mut r), vec![], "a revived ring owes nothing");
    }

    #[test]
    fn send_ring_error_state_accepts_pushes_and_reports_them_flushed() {
        let mut r = SendRing::new(2).unwrap();
        assert_eq!(take_flushed(&mut r), vec![]);
        r.push(entry(1, false)).unwrap();
        assert_eq!(take_flushed(&mut r), vec![], "a healthy ring flushes nothing");
        assert_eq!(r.outstanding(), 1);
        assert_eq!(flush(&mut r), vec![(1, IBV_WC_WR_FLUSH_ERR)]);
        assert!(r.is_error());
        // Seqs keep counting; unsignaled WRs are flushed too.
        assert_eq!(r.push(entry(2, false)), Ok(1));
        assert_eq!(r.push(entry(3, true)), Ok(2));
        assert_eq!(r.push(entry(4, true)), Err(Errno::ENOMEM), "still bounded");
        assert_eq!(complete(&mut r, 1, IBV_WC_SUCCESS), (Err(Errno::EINVAL), vec![]));
        let flushed = vec![(2, IBV_WC_WR_FLUSH_ERR), (3, IBV_WC_WR_FLUSH_ERR)];
        assert_eq!(take_flushed(&mut r), flushed);
        assert_eq!(r.outstanding(), 0);
        assert_eq!(take_flushed(&mut r), vec![]);
        assert!(r.is_error(), "the error state is sticky");
    }

    #[test]
    fn send_ring_keeps_fifo_order_across_seq_wraparound() {
        let mut r = SendRing::new(5).unwrap();
        let mut next_id = 0u64;
        let mut next_seq = 0u16;
        let mut reported = 0u64;
        // Keep 3 WRs in flight, completing them one by one, past two wraps
        // of the u16 sequence space.
        for _ in 0..3 {
            assert_eq!(r.push(entry(next_id, true)), Ok(next_seq));
            next_id += 1;
            next_seq = next_seq.wrapping_add(1);
        }
        for _ in 0..140_000 {
            let seq = next_seq.wrapping_sub(3);
            assert_eq!(complete(&mut r, seq, IBV_WC_SUCCESS), (Ok(()), vec![(reported, 0)]));
            reported += 1;
            assert_eq!(r.push(entry(next_id, true)), Ok(next_seq));
            next_id += 1;
            next_seq = next_seq.wrapping_add(1);
        }
        assert_eq!(next_seq, (140_003 % 65_536) as u16);
        assert_eq!(r.outstanding(), 3);
    }

    /// The ring against a VecDeque model: random pushes, successful and
    /// failed completions of random outstanding seqs, stale seqs, flushes.
    /// A ring in the error state is replaced by a new one whose sequence
    /// numbers start at a random point, so windows straddle the wrap.
    #[test]
    fn send_ring_matches_a_model_under_random_operations() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut errors = 0;
        for cap in [1u32, 2, 7, 64] {
            let mut r = SendRing::new(cap).unwrap();
            let mut model: VecDeque<(u16, SendEntry)> = VecDeque::new();
            let (mut error, mut next_seq, mut next_id) = (false, 0u16, 0u64);
            for _ in 0..50_000 {
                match rng.below(10) {
                    0..=4 => {
                        let e = entry(next_id, rng.chance(40));
                        next_id += 1;
                        if model.len() == cap as usize {
                            assert_eq!(r.push(e), Err(Errno::ENOMEM));
                        } else {
                            assert_eq!(r.push(e), Ok(next_seq));
                            model.push_back((next_seq, e));
                            next_seq = next_seq.wrapping_add(1);
                        }
                    }
                    5..=7 if !error && !model.is_empty() => {
                        let pos = rng.below(model.len() as u64) as usize;
                        let seq = model[pos].0;
                        let status = if rng.chance(3) { IBV_WC_REM_ACCESS_ERR } else { IBV_WC_SUCCESS };
                        let mut want = Vec::new();
                        for (i, (_, e)) in model.drain(..=pos).enumerate() {
                            if i == pos && status != IBV_WC_SUCCESS {
                                want.push((e.wr_id, status));
                            } else if e.signaled {
                                want.push((e.wr_id, IBV_WC_SUCCESS));
                            }
                        }
                        if status != IBV_WC_SUCCESS {
                            want.extend(model.drain(..).map(|(_, e)| (e.wr_id, IBV_WC_WR_FLUSH_ERR)));
                            error = true;
                            errors += 1;
                        }
                        assert_eq!(complete(&mut r, seq, status), (Ok(()), want));
                    }
                    8 => {
                        // Outside the window; in the error state also inside.
                        let head = next_seq.wrapping_sub(model.len() as u16);
                        let k = rng.below(65_536 - model.len() as u64) as u16;
                        let mut seqs = vec![head.wrapping_add(model.len() as u16).wrapping_add(k)];
                        if error && !model.is_empty() {
                            seqs.push(model[rng.below(model.len() as u64) as usize].0);
                        }
                        for seq in seqs {
                            assert_eq!(complete(&mut r, seq, IBV_WC_SUCCESS), (Err(Errno::EINVAL), vec![]));
                        }
                    }
                    9 if error && rng.chance(30) => {
                        r = SendRing::new(cap).unwrap();
                        next_seq = rng.next() as u16;
                        r.head_seq = next_seq;
                        model.clear();
                        error = false;
                    }
                    _ => {
                        let hard = rng.chance(10);
                        let flushed = |m: &mut VecDeque<(u16, SendEntry)>| -> Vec<(u64, u32)> {
                            m.drain(..).map(|(_, e)| (e.wr_id, IBV_WC_WR_FLUSH_ERR)).collect()
                        };
                        let want = if hard || error { flushed(&mut model) } else { vec![] };
                        error |= hard;
                        let got = if hard { flush(&mut r) } else { take_flushed(&mut r) };
                        assert_eq!(got, want);
                    }
                }
                assert_eq!(r.outstanding(), model.len());
                assert_eq!(r.is_error(), error);
            }
        }
        assert!(errors > 100, "error completions exercised: {errors}");
    }

    fn sge(addr: u64, length: u32, lkey: u32) -> ibv_sge {
        ibv_sge { addr, length, lkey }
    }

    fn triples(sges: impl IntoIterator<Item = ibv_sge>) -> Vec<(u64, u32, u32)> {
        sges.into_iter().map(|s| (s.addr, s.length, s.lkey)).collect()
    }

    #[test]
    fn recv_ring_bounds() {
        assert_eq!(RecvRing::new(MAX_DEPTH + 1, 1).err().map(|e| e.0), Some(libc::EINVAL));
        assert_eq!(RecvRing::new(1, MAX_RECV_SGE + 1).err().map(|e| e.0), Some(libc::EINVAL));
        assert!(RecvRing::new(MAX_DEPTH, MAX_RECV_SGE).is_ok());
        let mut none = RecvRing::new(0, 2).unwrap();
        assert_eq!(none.push(1, &[]), Err(Errno::ENOMEM));
        // max_recv_sge 0: buffers for zero-byte messages only.
        let mut zero = RecvRing::new(1, 0).unwrap();
        assert_eq!(zero.push(1, &[sge(0x10, 1, 1)]), Err(Errno::EINVAL));
        assert_eq!(zero.push(2, &[]), Ok(()));
        let wr = zero.pop_front().unwrap();
        assert_eq!((wr.wr_id, wr.sg_list.len()), (2, 0));
    }

    #[test]
    fn recv_ring_enomem_when_full_and_einval_for_too_many_sges() {
        let mut r = RecvRing::new(2, 2).unwrap();
        let three = [sge(1, 1, 1), sge(2, 1, 1), sge(3, 1, 1)];
        assert_eq!(r.push(9, &three), Err(Errno::EINVAL));
        assert!(r.is_empty());
        r.push(1, &three[..2]).unwrap();
        r.push(2, &three[..1]).unwrap();
        assert_eq!(r.push(3, &[]), Err(Errno::ENOMEM));
        assert_eq!(r.len(), 2);
        assert_eq!(r.pop_front().map(|w| w.wr_id), Some(1));
        assert_eq!(r.push(3, &[]), Ok(()));
        assert_eq!(r.len(), 2);
    }

    /// A buffer given back goes in front, with its SGEs, across the wrap
    /// of the ring; a full ring refuses it.
    #[test]
    fn recv_ring_push_front_gives_a_buffer_back_first() {
        let mut r = RecvRing::new(3, 2).unwrap();
        r.push(1, &[sge(0x10, 8, 1), sge(0x20, 8, 1)]).unwrap();
        r.push(2, &[sge(0x30, 8, 1)]).unwrap();
        let (id, list) = {
            let w = r.pop_front().unwrap();
            (w.wr_id, w.sg_list.to_vec())
        };
        r.push(3, &[]).unwrap();
        r.push_front(id, &list).unwrap();
        assert_eq!(r.push_front(9, &[]), Err(Errno::ENOMEM));
        let w = r.pop_front().unwrap();
        assert_eq!((w.wr_id, w.sg_list.len(), w.sg_list[1].addr), (1, 2, 0x20));
        assert_eq!(r.pop_front().map(|w| w.wr_id), Some(2));
        assert_eq!(r.pop_front().map(|w| w.wr_id), Some(3));
        assert!(r.is_empty());
    }

    /// Slots of different SGE counts are reused across several wraps and
    /// never show another slot's SGEs.
    #[test]
    fn recv_ring_keeps_fifo_order_and_sge_lists_across_wraparound() {
        let mut r = RecvRing::new(3, 3).unwrap();
        let list = |id: u64| -> Vec<ibv_sge> { (0..id % 4).map(|i| sge(id << 8 | i, (id + i) as u32, id as u32)).collect() };
        r.push(0, &list(0)).unwrap();
        r.push(1, &list(1)).unwrap();
        for id in 2..20u64 {
            r.push(id, &list(id)).unwrap();
            let wr = r.pop_front().unwrap();
            assert_eq!(wr.wr_id, id - 2);
            assert_eq!(triples(wr.sg_list.iter().copied()), triples(list(id - 2)));
        }
        assert_eq!(r.len(), 2);
    }

    #[test]
    fn recv_ring_flush_reports_every_buffer_in_order() {
        let mut r = RecvRing::new(4, 1).unwrap();
        for id in [7, 8, 9] {
            r.push(id, &[sge(id, 64, 1)]).unwrap();
        }
        r.pop_front().unwrap();
        let mut seen = Vec::new();
        r.flush(&mut |c| seen.push(c));
        let flushed = |wr_id| Completion { wr_id, status: IBV_WC_WR_FLUSH_ERR, opcode: IBV_WC_RECV, byte_len: 0 };
        assert_eq!(seen, vec![flushed(8), flushed(9)]);
        assert!(r.is_empty());
        assert!(r.pop_front().is_none());
    }

    #[test]
    fn scatter_plans_exact_fit_partial_fit_and_overflow() {
        let list = [sge(0x1000, 4, 11), sge(0x2000, 0, 22), sge(0x3000, 6, 33)];
        let wr = RecvWr { wr_id: 1, sg_list: &list };
        let plan = |n| wr.scatter(n).map(triples);
        assert_eq!(plan(10), Ok(vec![(0x1000, 4, 11), (0x3000, 6, 33)]));
        assert_eq!(plan(11), Err(IBV_WC_LOC_LEN_ERR));
        assert_eq!(plan(4), Ok(vec![(0x1000, 4, 11)]));
        assert_eq!(plan(5), Ok(vec![(0x1000, 4, 11), (0x3000, 1, 33)]));
        assert_eq!(plan(0), Ok(vec![]));
        assert_eq!(plan(u32::MAX), Err(IBV_WC_LOC_LEN_ERR));
    }

    #[test]
    fn scatter_plans_for_empty_and_huge_buffers() {
        let none = RecvWr { wr_id: 1, sg_list: &[] };
        assert_eq!(none.scatter(0).map(triples), Ok(vec![]));
        assert_eq!(none.scatter(1).map(triples), Err(IBV_WC_LOC_LEN_ERR));
        let zeros = [sge(0x10, 0, 1), sge(0x20, 0, 1)];
        let zero = RecvWr { wr_id: 2, sg_list: &zeros };
        assert_eq!(zero.scatter(0).map(triples), Ok(vec![]));
        assert_eq!(zero.scatter(1).map(triples), Err(IBV_WC_LOC_LEN_ERR));
        // Room beyond u32 does not overflow the sum.
        let huge = [sge(0, u32::MAX, 1), sge(1 << 40, u32::MAX, 2)];
        let wr = RecvWr { wr_id: 3, sg_list: &huge };
        assert_eq!(wr.scatter(u32::MAX).map(triples), Ok(vec![(0, u32::MAX, 1)]));
    }

    fn decision(signal: bool, forced: bool, retired: u16) -> Option<PostDecision> {
        Some(PostDecision { signal, forced, retired })
    }

    #[test]
    fn phys_sq_rejects_bad_depths_and_periods() {
        for (depth, period) in [(0, 1), (MAX_DEPTH + 1, 1), (4, 0), (4, 5)] {
            assert_eq!(PhysSq::with_signal_period(depth, period).err(), Some(Errno::EINVAL));
        }
        assert_eq!(PhysSq::new(0).err(), Some(Errno::EINVAL));
        assert!(PhysSq::new(MAX_DEPTH).is_ok());
        assert!(PhysSq::with_signal_period(MAX_DEPTH, MAX_DEPTH).is_ok());
    }

    #[test]
    fn phys_sq_forces_every_half_depth_and_blocks_when_full() {
        let mut q = PhysSq::new(8).unwrap();
        for _ in 0..3 {
            assert_eq!(q.try_post(false), decision(false, false, 0));
        }
        assert_eq!(q.try_post(false), decision(true, true, 4));
        for _ in 0..3 {
            assert_eq!(q.try_post(false), decision(false, false, 0));
        }
        assert_eq!(q.try_post(false), decision(true, true, 4));
        assert_eq!(q.outstanding(), 8);
        assert_eq!(q.try_post(true), None);
        assert_eq!(q.try_post(false), None);
        assert_eq!(q.on_completion(4), Ok(()));
        assert_eq!(q.outstanding(), 4);
        // An application signal retires the run before it.
        assert_eq!(q.try_post(false), decision(false, false, 0));
        assert_eq!(q.try_post(true), decision(true, false, 2));
        assert_eq!(q.try_post(true), decision(true, false, 1));
        assert_eq!(q.outstanding(), 7);
    }

    #[test]
    fn phys_sq_of_depth_one_and_two_signals_every_wqe() {
        for depth in [1, 2] {
            let mut q = PhysSq::new(depth).unwrap();
            for _ in 0..depth {
                assert_eq!(q.try_post(false), decision(true, true, 1));
            }
            assert_eq!(q.try_post(false), None);
        }
    }

    #[test]
    fn phys_sq_rejects_completions_retiring_more_than_is_covered() {
        let mut q = PhysSq::with_signal_period(8, 8).unwrap();
        assert_eq!(q.try_post(false), decision(false, false, 0));
        assert_eq!(q.try_post(true), decision(true, false, 2));
        assert_eq!(q.try_post(false), decision(false, false, 0));
        // Covered: 2 (the third is the unsignaled tail).
        assert_eq!(q.on_completion(0), Err(Errno::EINVAL));
        assert_eq!(q.on_completion(3), Err(Errno::EINVAL));
        assert_eq!(q.outstanding(), 3);
        assert_eq!(q.on_completion(2), Ok(()));
        assert_eq!(q.on_completion(1), Err(Errno::EINVAL));
        assert_eq!(q.outstanding(), 1);
        // The tail keeps counting into the next signal.
        assert_eq!(q.try_post(true), decision(true, false, 2));
    }

    #[test]
    fn phys_sq_marks_are_reached_in_order_and_an_unsignaled_tail_is_not_covered() {
        let mut q = PhysSq::with_signal_period(8, 4).unwrap();
        let a = q.try_post(true).unwrap();
        let m1 = q.mark();
        assert!(!q.reached(m1) && q.covered(m1), "a signaled WQE: its completion will come");
        q.try_post(false).unwrap();
        let m2 = q.mark();
        assert!(!q.covered(m2), "an unsignaled tail needs a signaled WQE behind it");
        q.on_completion(a.retired).unwrap();
        assert!(q.reached(m1) && !q.reached(m2));
        let b = q.try_post(true).unwrap();
        assert!(q.covered(m2), "a signaled WQE behind the tail");
        q.on_completion(b.retired).unwrap();
        assert!(q.reached(m2) && q.reached(q.mark()));
        q.try_post(false).unwrap();
        let m3 = q.mark();
        assert!(!q.reached(m3));
        q.set_drained();
        assert!(q.reached(m3), "a drained link touches nothing any more");
    }

    #[test]
    fn phys_sq_reset_forgets_everything_outstanding() {
        let mut q = PhysSq::new(4).unwrap();
        assert_eq!(q.try_post(false), decision(false, false, 0));
        assert_eq!(q.try_post(false), decision(true, true, 2));
        assert_eq!(q.try_post(false), decision(false, false, 0));
        q.reset();
        assert_eq!(q.outstanding(), 0);
        assert_eq!(q.on_completion(1), Err(Errno::EINVAL));
        // The unsignaled run restarted too: the first WQE is not forced.
        assert_eq!(q.try_post(false), decision(false, false, 0));
        assert_eq!(q.try_post(false), decision(true, true, 2));
    }

    /// Random posts and in-order completions of signaled WQEs at random
    /// times, against a model of the WQEs in flight: never more than D
    /// outstanding, never full without a signaled WQE in flight, every
    /// decision exactly as the policy says.
    #[test]
    fn phys_sq_never_overflows_or_deadlocks_under_random_operations() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let mut fulls = 0;
        for depth in [1u32, 2, 3, 4, 7, 8, 16, 64] {
            for period in [(depth / 2).max(1), 1, depth] {
                let mut q = PhysSq::with_signal_period(depth, period).unwrap();
                // Signaled?, per WQE in flight, oldest first.
                let mut model: VecDeque<bool> = VecDeque::new();
                let app_rate = rng.below(50);
                for _ in 0..20_000 {
                    if rng.chance(55) {
                        let app = rng.chance(app_rate);
                        match q.try_post(app) {
                            None => {
                                assert_eq!(model.len(), depth as usize);
                                fulls += 1;
                            }
                            Some(d) => {
                                let run = model.iter().rev().take_while(|s| !**s).count();
                                let forced = !app && run + 1 == period as usize;
                                let want = if app || forced { decision(true, forced, run as u16 + 1) } else { decision(false, false, 0) };
                                assert_eq!(Some(d), want);
                                model.push_back(d.signal);
                            }
                        }
                    } else if let Some(first) = model.iter().position(|s| *s) {
                        model.drain(..=first);
                        assert_eq!(q.on_completion(first as u16 + 1), Ok(()));
                    }
                    assert_eq!(q.outstanding(), model.len());
                    assert!(model.len() <= depth as usize);
                    let tail = model.iter().rev().take_while(|s| !**s).count();
                    assert!(tail < period as usize, "unsignaled tail {tail} >= S {period}");
                    if model.len() == depth as usize {
                        assert!(model.contains(&true), "full with nothing signaled: D={depth}");
                    }
                }
            }
        }
        assert!(fulls > 1000, "the full queue was exercised: {fulls}");
    }

    fn wc(wr_id: u64) -> ibv_wc {
        Completion { wr_id, status: IBV_WC_SUCCESS, opcode: IBV_WC_RDMA_WRITE, byte_len: 8 }.to_wc(0x11)
    }

    fn pop(cq: &mut SoftCq, n: usize) -> Vec<u64> {
        let mut out: Vec<MaybeUninit<ibv_wc>> = (0..n).map(|_| MaybeUninit::uninit()).collect();
        let got = cq.pop_into(&mut out);
        // SAFETY: pop_into initialised the first `got` entries.
        out[..got].iter().map(|w| unsafe { w.assume_init_ref() }.wr_id).collect()
    }

    #[test]
    fn completion_to_wc_fills_the_fields_and_zeroes_the_rest() {
        let c = Completion { wr_id: 5, status: IBV_WC_REM_ACCESS_ERR, opcode: IBV_WC_SEND, byte_len: 7 };
        let w = c.to_wc(0x1234);
        assert_eq!((w.wr_id, w.status, w.opcode, w.byte_len, w.qp_num), (5, IBV_WC_REM_ACCESS_ERR, IBV_WC_SEND, 7, 0x1234));
        assert_eq!((w.vendor_err, w.src_qp, w.wc_flags, w.pkey_index, w.slid, w.sl, w.dlid_path_bits), (0, 0, 0, 0, 0, 0, 0));
        // SAFETY: both union members are u32.
        assert_eq!(unsafe { w.imm_data_invalidated_rkey_union.imm_data }, 0);
    }

    #[test]
    fn soft_cq_overrun_refuses_the_newcomer_keeps_the_rest_and_sticks() {
        assert_eq!(SoftCq::new(0).err(), Some(Errno::EINVAL));
        let mut cq = SoftCq::new(3).unwrap();
        for id in 1..=3 {
            assert_eq!(cq.push(wc(id)), Ok(()));
        }
        assert!(!cq.is_overrun());
        assert_eq!(cq.push(wc(4)), Err(Overrun));
        assert!(cq.is_overrun());
        assert_eq!(cq.len(), 3);
        assert_eq!(pop(&mut cq, 8), vec![1, 2, 3]);
        assert!(cq.is_empty());
        assert_eq!(cq.push(wc(5)), Ok(()));
        assert!(cq.is_overrun(), "sticky after draining");
    }

    #[test]
    fn soft_cq_pops_in_batches_across_wraparound() {
        let mut cq = SoftCq::new(4).unwrap();
        assert_eq!(pop(&mut cq, 4), Vec::<u64>::new());
        let mut next = 0;
        let mut want = 0;
        for round in 0..10 {
            while cq.len() < 4 {
                cq.push(wc(next)).unwrap();
                next += 1;
            }
            let n = round % 4 + 1;
            assert_eq!(pop(&mut cq, n), (want..want + n as u64).collect::<Vec<_>>());
            want += n as u64;
            assert_eq!(pop(&mut cq, 0), Vec::<u64>::new());
        }
        let mut out = [const { MaybeUninit::uninit() }; 1];
        cq.pop_into(&mut out);
        // SAFETY: the queue was not empty, so one entry was written.
        let w = unsafe { out[0].assume_init_ref() };
        assert_eq!((w.wr_id, w.qp_num, w.opcode, w.byte_len), (want, 0x11, IBV_WC_RDMA_WRITE, 8));
    }
}
