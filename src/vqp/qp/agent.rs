//! A VQP's first one-sided work through the host's agent
//! (`src/transport/agent.rs`), and the move onto the process's own path.
//!
//! A `qconnect` in a process attached to an agent whose runtime is not up
//! yet (its start is under way, from `ibv_alloc_pd`, or started now in the
//! background) connects a VQP of the agent's instead of waiting, and
//! returns. Its RDMA READs and WRITEs (up to
//! [`agent::MAX_WR`] bytes, not inline) and atomics go through the agent from then on,
//! copied through the staging region, their completions delivered in
//! order into the VQP's send CQ. A `qconnect` in a process whose runtime
//! is up connects by itself (its own datagram tier meets a new peer as
//! soon, and does not queue behind the agent). The move: the first post
//! that finds the process's own link to the peer open (asked for after the first
//! completion on the agent's path, or `ASK_LATE` after the connect, once
//! the runtime is up: its handshake does not compete with the first work),
//! or that the path cannot carry (a SEND, a larger one),
//! waits until everything on the agent's path completed, then connects the
//! VQP itself (`connect_to`) and goes on there: nothing posted after can
//! overtake what went through the agent.
//!
//! Not taken for transparent VQPs, or for bound ones.

use super::*;
use crate::transport::agent::{self, AgentPath};
use std::sync::atomic::Ordering;

/// How a `qconnect` connects.
pub(super) enum Via {
    Agent,
    /// By ourselves.
    Own,
}

/// A VQP on the agent's path.
pub(super) struct AgentLeg {
    path: Arc<AgentPath>,
    handle: u32,
    key: crate::meta::Key,
    inflight: VecDeque<InFlight>,
    /// A completion in error came: the VQP is in the error state (what
    /// follows is flushed, as on RC).
    failed: bool,
    /// The peer's endpoint, as the agent looked it up.
    peer: crate::meta::Endpoint,
    /// The path of our own link to it, once asked for.
    own: Option<crate::service::Path>,
    /// When the agent connected it, and whether a completion came since:
    /// our own link is asked for after the first completion (or
    /// `ASK_LATE` after the connect), so that its handshake does not
    /// compete with the first work for the host.
    since: std::time::Instant,
    completed: bool,
}

struct InFlight {
    token: u32,
    wr_id: u64,
    signaled: bool,
    /// The work request's (`ibv_wr_opcode`).
    opcode: u32,
    len: u32,
    /// The first of its staging slots (as many as `len` takes).
    slot: u16,
    /// Where a READ's bytes or an atomic's result go: the application's
    /// SGEs.
    sges: Vec<ibv_sge>,
}

/// How often a post that found the staging region without room for it
/// looks again (the region is the process's, shared by its VQPs).
const SLOTS_LOOK_AGAIN: std::time::Duration = std::time::Duration::from_millis(5);

// A request's opcode is the work request's.
const _: () = assert!(
    crate::node::proto::OP_WRITE == ibv_wr_opcode::IBV_WR_RDMA_WRITE
        && crate::node::proto::OP_READ == ibv_wr_opcode::IBV_WR_RDMA_READ
        && crate::node::proto::OP_CMP_AND_SWP == ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP
        && crate::node::proto::OP_FETCH_AND_ADD == ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD
);

/// Whether work of `opcode` brings bytes back into its SGEs.
fn returns_bytes(opcode: u32) -> bool {
    opcode != ibv_wr_opcode::IBV_WR_RDMA_WRITE
}

impl agent::User for Vqp {
    fn done(&self, token: u32, status: u32, byte_len: u32) {
        let mut g = self.agent.lock();
        let Some(leg) = g.as_mut() else { return };
        let Some(pos) = leg.inflight.iter().position(|f| f.token == token) else { return };
        // In order: the agent's VQP completes in order, and what its
        // connection carries stays in order.
        debug_assert_eq!(pos, 0, "the agent's completions come in order");
        let f = leg.inflight.remove(pos).expect("found");
        if status == ibv_wc_status::IBV_WC_SUCCESS && returns_bytes(f.opcode) {
            // SAFETY: the slot is this work request's, back from the agent;
            // the SGEs were checked against the application's MRs at post.
            let src = unsafe { leg.path.bytes(f.slot, f.len as usize) };
            let mut at = 0;
            for s in &f.sges {
                let n = (s.length as usize).min(byte_len as usize - at.min(byte_len as usize));
                // SAFETY: inside a registered MR of the application's (checked at post).
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(at), s.addr as *mut u8, n) };
                at += n;
            }
        }
        leg.path.release(f.slot, f.len as usize);
        if status != ibv_wc_status::IBV_WC_SUCCESS {
            leg.failed = true;
        } else if !leg.completed {
            leg.completed = true;
            self.ask_own_link(leg);
        }
        if f.signaled || status != ibv_wc_status::IBV_WC_SUCCESS {
            // The length as the process's own path reports it.
            let byte_len = if status == ibv_wc_status::IBV_WC_SUCCESS { f.len } else { 0 };
            let wc = super::super::queue::Completion { wr_id: f.wr_id, status, opcode: wc_opcode_of(f.opcode), byte_len }.to_wc(self.qpn());
            self.send_soft.push(wc);
        }
        drop(g);
        self.agent_moved.notify_all();
    }
}

impl Vqp {
    /// `qconnect` through the agent, when it applies (see the module
    /// doc); else [`Via::Own`].
    pub(super) fn connect_via_agent(&self, key: &crate::meta::Key) -> Via {
        // Our runtime is up: by ourselves. A warm process met a new peer
        // no sooner through the agent (4.3 ms, against 4.3-4.9 ms on its
        // own datagram tier: bench/connect-compare.sh, stops 36-37), and
        // a full mesh through one agent queued every first contact of the
        // host behind its loop (8 processes: 0.72 s against 0.53 s).
        if crate::vqp::registry::of(self.app.real_pd as usize).is_some() {
            return Via::Own;
        }
        let Some(path) = AgentPath::get() else { return Via::Own };
        crate::kmark!("qconnect: through the agent?");
        let (handle, peer) = match path.connect(key) {
            Ok(h) => h,
            Err(e) => {
                klog!(Level::Debug, "vqp {:#x}: the agent could not connect ({e:?}): connecting by itself", self.qpn());
                return Via::Own;
            }
        };
        crate::kmark!("qconnect: through the agent");
        *self.agent.lock() = Some(AgentLeg {
            path,
            handle,
            key: *key,
            peer,
            inflight: VecDeque::new(),
            failed: false,
            own: None,
            since: std::time::Instant::now(),
            completed: false,
        });
        self.on_agent.store(true, Ordering::Release);
        // The move needs our runtime and our link: under way from now.
        crate::vqp::registry::start_soon(self.app.real_ctx, self.app.real_pd);
        crate::stats::inc(crate::stats::Stat::KRCORE_STAT_NODE_CONNECTS);
        Via::Agent
    }

    /// Ask for our own link to the leg's peer, once, when our runtime is up.
    fn ask_own_link(&self, leg: &mut AgentLeg) {
        if leg.own.is_some() {
            return;
        }
        let Some(rt) = crate::vqp::registry::of(self.app.real_pd as usize) else { return };
        let index = self.link_index();
        let path = rt.svc.default_path(&leg.peer);
        rt.want_link_at(std::time::Instant::now(), leg.peer, index, path);
        leg.own = Some(path);
    }

    /// Whether our own link to the leg's peer is open (asked for after the
    /// first completion on the agent's path, or `ASK_LATE` after the
    /// connect, once our runtime is up).
    fn own_link_open(&self, leg: &mut AgentLeg) -> bool {
        if leg.completed || leg.since.elapsed() >= super::tier::ASK_LATE {
            self.ask_own_link(leg);
        }
        let (Some(path), Some(rt)) = (leg.own, crate::vqp::registry::of(self.app.real_pd as usize)) else { return false };
        let index = self.link_index();
        rt.svc.link_to(leg.peer.incarnation, index, path).is_some_and(|l| l.is_open())
    }

    /// Post `w` on the agent's path: None when the VQP is not on it (any
    /// more: the move was made), else the post's result.
    ///
    /// # Safety
    /// `w` and its SGE list are the application's valid WR.
    pub(super) unsafe fn post_via_agent(&self, w: &ibv_send_wr) -> Option<Result<()>> {
        if !self.on_agent.load(Ordering::Acquire) {
            return None;
        }
        let mut g = self.agent.lock();
        let leg = g.as_mut()?;
        let signaled = self.sq_sig_all || w.send_flags & ibv_send_flags::IBV_SEND_SIGNALED.0 != 0;
        // SAFETY: caller contract.
        let sges: &[ibv_sge] = unsafe { sge_list(w) };
        let total: u64 = sges.iter().map(|s| s.length as u64).sum();
        if leg.failed {
            // As an RC QP in the error state: accepted, then flushed.
            let opcode = wc_opcode_of(w.opcode);
            let wc = super::super::queue::Completion { wr_id: w.wr_id, status: ibv_wc_status::IBV_WC_WR_FLUSH_ERR, opcode, byte_len: 0 }
                .to_wc(self.qpn());
            self.send_soft.push(wc);
            return Some(Ok(()));
        }
        if leg.own.is_none() && leg.since.elapsed() >= agent::OWN_AFTER {
            // Still on the agent's path: worth a runtime and a link of our
            // own to move onto (a process that ends after its first work
            // never makes one). Once our link is asked for, the runtime is
            // up: no need to say so at every post.
            agent::runtime_needed();
        }
        let carried = carried(w, sges, total) && !leg.path.is_dead() && self.local_ok(sges, returns_bytes(w.opcode));
        if !carried || self.own_link_open(leg) {
            drop(g);
            return match self.move_off_agent() {
                Ok(()) => None,
                Err(e) => Some(Err(e)),
            };
        }
        if leg.inflight.len() >= self.sq_cap as usize {
            return Some(Err(Errno::ENOMEM));
        }
        // Room on the path: a window per VQP and staging slots in a row.
        let deadline = std::time::Instant::now() + crate::vqp::runtime::connect_timeout();
        let slot = loop {
            let leg = g.as_mut().expect("on the path");
            let window = leg.inflight.len() < agent::WINDOW;
            if window {
                if let Some(s) = leg.path.slots(total as usize) {
                    break s;
                }
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return Some(Err(Errno::ENOMEM));
            }
            // Our own completions wake us; slots another VQP of the
            // process gives back do not: looked at again while the region
            // has no room.
            let until = if window { deadline.min(now + SLOTS_LOOK_AGAIN) } else { deadline };
            let _ = self.agent_moved.wait_until(&mut g, until);
            if g.is_none() {
                return None;
            }
        };
        let leg = g.as_mut().expect("on the path");
        if !returns_bytes(w.opcode) {
            // SAFETY: the slots are ours until its completion.
            let dst = unsafe { leg.path.bytes(slot, total as usize) };
            let mut at = 0;
            for s in sges {
                // SAFETY: inside a registered MR of the application's (local_ok).
                unsafe { std::ptr::copy_nonoverlapping(s.addr as *const u8, dst.as_mut_ptr().add(at), s.length as usize) };
                at += s.length as usize;
            }
        }
        let token = leg.path.token();
        let mut post = crate::node::proto::Post { token, handle: leg.handle, opcode: w.opcode, len: total as u32, ..Default::default() };
        if send::is_atomic(w.opcode) {
            // SAFETY: a plain union read: atomic opcodes use `atomic`.
            let a = unsafe { w.wr.atomic };
            (post.remote, post.rkey, post.compare_add, post.swap) = (a.remote_addr, a.rkey, a.compare_add, a.swap);
        } else {
            // SAFETY: a plain union read: RDMA opcodes use `rdma`.
            (post.remote, post.rkey) = unsafe { (w.wr.rdma.remote_addr, w.wr.rdma.rkey) };
        }
        let Some(me) = lookup(self.slot, self.gen) else { return Some(Err(Errno::EINVAL)) };
        let me: Weak<dyn agent::User> = Arc::downgrade(&me) as Weak<dyn agent::User>;
        leg.inflight.push_back(InFlight {
            token,
            wr_id: w.wr_id,
            signaled,
            opcode: w.opcode,
            len: total as u32,
            slot,
            sges: sges.to_vec(),
        });
        if let Err(e) = leg.path.post(post, slot, me) {
            leg.inflight.pop_back();
            leg.path.release(slot, total as usize);
            return Some(Err(e));
        }
        crate::stats::inc(crate::stats::Stat::KRCORE_STAT_NODE_WRS);
        Some(Ok(()))
    }

    /// Whether `sges` lie in the application's MRs of our PD, with local
    /// write access where bytes come back (else the process's own path
    /// reports the error as RC does).
    fn local_ok(&self, sges: &[ibv_sge], read: bool) -> bool {
        let pd = self.app.real_pd as usize;
        sges.iter().all(|s| {
            send::registry_local(pd, s.lkey).is_some_and(|m| {
                let write = m.access & ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 != 0;
                s.addr >= m.addr && s.addr + s.length as u64 <= m.addr + m.len && (!read || write)
            })
        })
    }

    /// The move: wait (bounded) until the agent's path has nothing of ours
    /// outstanding, close its VQP, and connect by ourselves.
    fn move_off_agent(&self) -> Result<()> {
        let deadline = std::time::Instant::now() + crate::vqp::runtime::connect_timeout().max(crate::vqp::runtime::TRANSPORT_WAIT);
        let mut g = self.agent.lock();
        while g.as_ref().is_some_and(|l| !l.inflight.is_empty()) {
            if self.agent_moved.wait_until(&mut g, deadline).timed_out() {
                return Err(Errno(libc::ETIMEDOUT));
            }
        }
        let Some(leg) = g.take() else { return Ok(()) };
        self.on_agent.store(false, Ordering::Release);
        drop(g);
        leg.path.close(leg.handle);
        if leg.failed {
            // Stays in the error state on its own path too.
            self.st.lock().failed = true;
        }
        crate::kmark!("vqp: moving off the agent's path");
        self.connect_to(&leg.key, None, Some(leg.peer))
    }

    /// Destroy: the agent's VQP goes, after what it still has of ours
    /// (bounded: its slots are the agent's to write until then); no
    /// completion of ours is delivered after.
    pub(super) fn leave_agent(&self) {
        let deadline = std::time::Instant::now() + crate::vqp::runtime::connect_timeout();
        let mut g = self.agent.lock();
        while g.as_ref().is_some_and(|l| !l.inflight.is_empty() && !l.path.is_dead()) {
            if self.agent_moved.wait_until(&mut g, deadline).timed_out() {
                break;
            }
        }
        let Some(leg) = g.take() else { return };
        self.on_agent.store(false, Ordering::Release);
        drop(g);
        leg.path.forget(leg.inflight.iter().map(|f| f.token));
        if !leg.inflight.is_empty() {
            // Still with the agent: their slots are not reused.
            klog!(Level::Warn, "vqp {:#x}: destroyed with {} work requests still with the agent", self.qpn(), leg.inflight.len());
        }
        leg.path.close(leg.handle);
    }
}

/// Whether the agent's path carries `w` (its `sges`, of `total` bytes):
/// RDMA READ and WRITE up to [`agent::MAX_WR`] bytes, not inline, and atomics on one
/// aligned 8-byte word (anything else makes the move: the process's own
/// path reports its errors as RC does).
fn carried(w: &ibv_send_wr, sges: &[ibv_sge], total: u64) -> bool {
    match w.opcode {
        ibv_wr_opcode::IBV_WR_RDMA_READ | ibv_wr_opcode::IBV_WR_RDMA_WRITE => {
            w.send_flags & ibv_send_flags::IBV_SEND_INLINE.0 == 0 && total <= agent::MAX_WR as u64
        }
        op if send::is_atomic(op) => {
            // SAFETY: a plain union read: atomic opcodes use `atomic`.
            let remote = unsafe { w.wr.atomic.remote_addr };
            sges.len() == 1 && total == 8 && remote % 8 == 0
        }
        _ => false,
    }
}

/// The SGEs of `w`.
///
/// # Safety
/// `w` is a valid WR whose `sg_list` holds `num_sge` entries.
unsafe fn sge_list(w: &ibv_send_wr) -> &[ibv_sge] {
    if w.num_sge <= 0 || w.sg_list.is_null() {
        return &[];
    }
    // SAFETY: caller contract.
    unsafe { std::slice::from_raw_parts(w.sg_list, w.num_sge as usize) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wr(opcode: u32, flags: u32, remote: u64) -> ibv_send_wr {
        // SAFETY: a plain C struct.
        let mut w: ibv_send_wr = unsafe { std::mem::zeroed() };
        w.opcode = opcode;
        w.send_flags = flags;
        w.wr.atomic.remote_addr = remote;
        w
    }

    fn sges(lens: &[u32]) -> Vec<ibv_sge> {
        lens.iter().map(|&length| ibv_sge { addr: 0x1000, length, lkey: 1 }).collect()
    }

    #[test]
    fn the_path_carries_one_sided_work_up_to_its_largest_and_aligned_atomics() {
        use ibv_wr_opcode::*;
        let (read, write) = (IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE);
        let max = agent::MAX_WR as u32;
        assert!(carried(&wr(read, 0, 0), &sges(&[max]), max as u64));
        assert!(carried(&wr(write, 0, 0), &sges(&[8, 8]), 16));
        assert!(carried(&wr(read, 0, 0), &sges(&[0]), 0), "empty: one slot");
        assert!(!carried(&wr(read, 0, 0), &sges(&[max, 1]), max as u64 + 1), "larger than the largest");
        let inline = ibv_send_flags::IBV_SEND_INLINE.0;
        assert!(!carried(&wr(write, inline, 0), &sges(&[8]), 8), "inline");
        for op in [IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD] {
            assert!(carried(&wr(op, 0, 0x1008), &sges(&[8]), 8));
            assert!(!carried(&wr(op, 0, 0x1004), &sges(&[8]), 8), "misaligned");
            assert!(!carried(&wr(op, 0, 0x1008), &sges(&[4, 4]), 8), "two SGEs");
            assert!(!carried(&wr(op, 0, 0x1008), &sges(&[16]), 16), "not one word");
        }
        for op in [IBV_WR_SEND, IBV_WR_SEND_WITH_IMM, IBV_WR_RDMA_WRITE_WITH_IMM] {
            assert!(!carried(&wr(op, 0, 0), &sges(&[8]), 8), "opcode {op}: makes the move");
        }
        assert!(returns_bytes(read) && returns_bytes(IBV_WR_ATOMIC_FETCH_AND_ADD) && !returns_bytes(write));
    }
}
