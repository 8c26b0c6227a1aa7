//! The datagram tier on a service endpoint's UD QP: the flows of this
//! endpoint's VQPs, what arrives for them, the one-sided requests served
//! for peers, and the timers.
//!
//! The port is the glue between [`super::reliable`] / [`super::serve`]
//! (pure logic) and the world, which it reaches through [`Host`]: sending a
//! datagram, waking at a time, and the VQPs (who takes a flow, where a
//! message or a completion goes). Threads: a VQP posts from the
//! application's thread; what arrives is handled by whichever thread
//! drains the UD queue (the endpoint's progress thread, or an application
//! thread polling while the tier is in use), and every timer on the
//! progress thread. Arrivals and timers take turns ([`Port::on_datagram`],
//! [`Port::on_timer`]): one thread at a time takes completions out of a
//! flow, so they reach the VQP in order.
//!
//! Trust: a flow is bound to the network address (GRH source GID and
//! `src_qp`) it was opened with or came from: an answer to one of our
//! flows from anywhere else is dropped and counted, as is anything that
//! does not decode or that the flow's nonces and sequence numbers do not
//! match; a peer's flow is keyed by its route and its address, so that a
//! packet from elsewhere writing its route is another flow (its own
//! sender's, refused unless the VQP it names takes from anyone), never
//! that flow's, and a stranger who sends first on a route does not take
//! it from the process whose incarnation it writes. A one-sided request is served only against the MRs the target
//! application registered with remote access (rkey, range and access
//! checked by [`super::serve::check`]) in the PD of the VQP it names.

use super::reliable::{self, Completion, Config, Delivery, Received, Receiver, Sender};
use super::serve::{Memory, Mrs, Responder};
use super::wire::{self, Message, Route, SendOp};
use crate::clock::coarse_ms;
use crate::error::{Errno, Result};
use crate::rdma::Gid;
use crate::recent::RecentMap;
use crate::stats::{self, Stat};
use crate::vqp::precheck::MrInfo;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where a datagram came from, as the network says (not as it claims).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Source {
    /// The GRH's source GID.
    pub gid: Gid,
    /// The GID of ours it was sent to (the GRH's destination).
    pub to_gid: Gid,
    /// The sending UD QP (`wc.src_qp`).
    pub qpn: u32,
}

/// Where a flow's datagrams go: the peer endpoint's UD QP over a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    pub sgid_index: u32,
    pub dgid: Gid,
    pub qpn: u32,
    pub qkey: u32,
}

impl Peer {
    fn sent(&self, from: &Source) -> bool {
        from.gid == self.dgid && from.qpn == self.qpn
    }
}

/// A peer's flow to one of our VQPs: its route as its packets carry it,
/// and the network address they come from. The address is part of the
/// key, not only checked against the flow's: whoever sends first on a
/// route (a stranger writing another process's incarnation and a VQPN it
/// guessed, VQPNs being slot numbers) must not own it, or the process's
/// own packets on it would be dropped as from another source.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct FlowKey {
    route: Route,
    gid: Gid,
    qpn: u32,
}

impl FlowKey {
    fn of(route: Route, from: &Source) -> FlowKey {
        FlowKey { route, gid: from.gid, qpn: from.qpn }
    }
}

/// What the port needs from its endpoint and its VQPs.
pub trait Host: Send + Sync {
    /// Send one datagram (best effort: a loss is the flows' business).
    fn send(&self, to: &Peer, bytes: &[u8]);
    /// Call [`Port::on_timer`] at `at` (or a bit later) on the progress
    /// thread.
    fn wake_at(&self, at: Instant);
    /// A peer VQP opens a flow to our VQP `route.dst_vqpn`: the PD whose
    /// MRs serve its one-sided requests, and the address its answers go
    /// to; None to refuse (no such VQP, or one that takes nothing from
    /// that sender).
    fn admit(&self, route: &Route, from: &Source) -> Option<(usize, Peer)>;
    /// Messages of an admitted flow, in the flow's order. `answers`, what
    /// acknowledges them (the RESPONSEs of requests that came between or
    /// after them, then the flow's ACK when one is due), are sent first,
    /// in order, under what keeps the VQP's arrivals in order: as an RC
    /// responder's NIC acknowledges before the application can act, a
    /// receiver that exits as soon as it saw a message leaves its sender a
    /// success; and nothing the sender sends once it has an answer (on a
    /// link) can land before them.
    fn messages(&self, route: &Route, from: &Peer, batch: Vec<Arrived>, answers: &[Vec<u8>]);
    /// A work request of our flow `route` finished (in post order).
    fn completed(&self, route: &Route, c: Completion);
    /// Our flows to process `incarnation` at `peer` ran out of retries:
    /// find out whether it lives (in the background: the caller holds
    /// the port; then [`Port::vouch`]). False when that cannot be found
    /// out: they fail now.
    fn doubt(&self, incarnation: u64, peer: &Peer) -> bool;
}

/// A whole two-sided message of a peer's flow.
pub struct Arrived {
    pub opcode: SendOp,
    pub imm: u32,
    pub data: Vec<u8>,
    /// Its bytes, held against its source GID until it leaves the VQP
    /// that takes it (`super::budget`).
    pub held: Option<super::budget::Reservation>,
}

/// A work request on the datagram tier (the caller's `id` comes back in
/// its [`Completion`]).
pub enum Op<'a> {
    Send { id: u64, opcode: SendOp, imm: u32, data: &'a [u8] },
    Read { id: u64, rkey: u32, addr: u64, len: u32 },
    Write { id: u64, rkey: u32, addr: u64, data: &'a [u8] },
    Atomic { id: u64, atomic: reliable::Atomic, rkey: u32, addr: u64 },
}

/// One of our VQPs' flows to a peer VQP.
pub struct Flow {
    pub route: Route,
    pub peer: Peer,
    sender: Mutex<Sender>,
    /// Its VQP is gone: the port keeps it until its last work (a CLOSE)
    /// completed or failed, then drops it ([`Port::linger`]).
    lingering: AtomicBool,
}

impl Flow {
    /// Work requests posted and not completed.
    pub fn outstanding(&self) -> usize {
        self.sender.lock().outstanding()
    }
}

/// A peer's flow to one of our VQPs.
struct Inbound {
    peer: Peer,
    pd: usize,
    /// When its last packet came (µs since the port's epoch).
    last_us: u64,
    receiver: Receiver,
    responder: Responder,
}

/// A peer's flow that closed: how to tell its late packets, and what to
/// answer them.
struct Closed {
    peer: Peer,
    /// Its first packet's nonce: a packet with sequence number 0 and
    /// another nonce starts the route's next flow.
    first_nonce: Option<u64>,
    /// Its final ACK's next sequence number and nonce.
    next: u64,
    nonce: u64,
}

/// What [`Port::late_packet`] found.
enum Late {
    No,
    Answer(Peer, Vec<u8>),
}

/// Closed flows a port remembers (about 120 bytes each): a late packet
/// comes within the sender's retries (about 4 s), and it takes a lost
/// final ACK and more closes than this meanwhile to forget one early.
const MAX_CLOSED: usize = 128;

/// Packets a port holds past gaps, over all its flows (up to 4 KiB
/// each): a packet that would be held beyond is dropped, and its sender
/// retransmits it once the gap is filled (an honest flow loses only the
/// time of a retransmission, and only while strangers fill the rest).
pub const MAX_AHEAD: usize = 4096;

/// Most flows from peers a port keeps (each a receiver and a cache of
/// answers); a flow beyond them is dropped until one goes.
pub const MAX_INBOUND: usize = 4096;

pub struct Port {
    cfg: Config,
    /// The last timeout a flow measured: a new flow starts with it (the
    /// same host's round trip, most likely) rather than with a guess.
    rto_hint: AtomicU64,
    epoch: Instant,
    out: Mutex<HashMap<Route, Arc<Flow>>>,
    inbound: Mutex<HashMap<FlowKey, Inbound>>,
    /// Flows in `inbound` by source GID (taken inside `inbound`'s lock),
    /// at most `flows_per_gid` each (`KRCORE_DGRAM_FLOWS_PER_GID`): one
    /// host cannot take the whole table.
    per_gid: Mutex<HashMap<Gid, usize>>,
    flows_per_gid: usize,
    /// Packets the flows in `inbound` hold past gaps (changed inside
    /// its lock), at most [`MAX_AHEAD`].
    ahead: AtomicUsize,
    /// The earliest wake-up asked of the host and not run yet (µs since
    /// `epoch`; u64::MAX: none).
    armed: AtomicU64,
    /// Peers' flows closed here lately (their CLOSE delivered), as TCP's
    /// TIME_WAIT: a late packet of one (the CLOSE again, its final ACK
    /// lost) gets that ACK again instead of making a new flow whose
    /// receiver would hold it and later close the route's next flow.
    closed: Mutex<RecentMap<FlowKey, Closed>>,
    /// Flows in `out` and `inbound`, and when the tier was last used
    /// (a post, a datagram; CLOCK_MONOTONIC_COARSE ms): while it is in
    /// use, an application thread that polls drains the UD queue too
    /// ([`Port::busy`]); a connection that moved onto its link leaves its
    /// flows behind, and its polls should not pay for them.
    flows: AtomicUsize,
    used_ms: AtomicU64,
    /// Held while what arrived or a timer is handled (see the module).
    turn: Mutex<()>,
}

impl Port {
    /// A port for paths of `mtu` bytes; a flow whose peer never answers
    /// fails after `first_contact_us`, unless the host vouches for the
    /// peer ([`Host::doubt`]).
    pub fn new(mtu: usize, rto_min_us: u64, first_contact_us: u64) -> Result<Port> {
        let base = Config::default();
        let rto = rto_min_us.max(base.ack_delay_us + 1);
        // About 2 s of retransmissions before a flow fails (RC's retries
        // are about as long), backing off to half a second: a process
        // starved of CPU for a moment is not taken for dead.
        let cfg = Config {
            mtu,
            rto_initial_us: RTO_FIRST_US.max(rto),
            rto_min_us: rto,
            rto_max_us: RTO_MAX_US.max(rto),
            retry_limit: 10,
            first_contact_us,
            live_bound_us: LIVE_BOUND_US,
            proof_wait_us: first_contact_us.max(RTO_MAX_US),
            max_queued: crate::vqp::queue::MAX_DEPTH as usize,
            hold_bytes: crate::config::get().link_window.into(),
            ..base
        };
        Sender::new(cfg, ZERO_ROUTE, 0)?; // validates the config
        Ok(Port {
            cfg,
            rto_hint: AtomicU64::new(0),
            epoch: Instant::now(),
            out: Mutex::new(HashMap::new()),
            inbound: Mutex::new(HashMap::new()),
            per_gid: Mutex::new(HashMap::new()),
            flows_per_gid: crate::config::get().dgram_flows_per_gid,
            ahead: AtomicUsize::new(0),
            armed: AtomicU64::new(u64::MAX),
            closed: Mutex::new(RecentMap::new(MAX_CLOSED)),
            flows: AtomicUsize::new(0),
            used_ms: AtomicU64::new(0),
            turn: Mutex::new(()),
        })
    }

    /// Whether the tier may have something arriving: a flow is open and
    /// the tier was used in the last [`BUSY_MS`].
    pub fn busy(&self) -> bool {
        self.flows.load(Ordering::Relaxed) > 0 && coarse_ms().saturating_sub(self.used_ms.load(Ordering::Relaxed)) <= BUSY_MS
    }

    fn used(&self) {
        self.used_ms.store(coarse_ms(), Ordering::Relaxed);
    }

    /// At most `n` flows from one source GID (for the tests; the library
    /// takes `KRCORE_DGRAM_FLOWS_PER_GID`).
    pub fn with_flows_per_gid(mut self, n: usize) -> Port {
        self.flows_per_gid = n.max(1);
        self
    }

    /// Whether `gid` may open one more flow here, counting it if so (the
    /// `inbound` lock held).
    fn inbound_added(&self, gid: &Gid) -> bool {
        let mut per_gid = self.per_gid.lock();
        let n = per_gid.entry(*gid).or_insert(0);
        if *n >= self.flows_per_gid {
            return false;
        }
        *n += 1;
        true
    }

    /// Flow `f` from `gid` left `inbound` (its lock held).
    fn inbound_gone(&self, gid: &Gid, f: &Inbound) {
        self.ahead.fetch_sub(f.receiver.ahead(), Ordering::Relaxed);
        let mut per_gid = self.per_gid.lock();
        if let Some(n) = per_gid.get_mut(gid) {
            *n -= 1;
            if *n == 0 {
                per_gid.remove(gid);
            }
        }
    }

    /// `n` flows more, or fewer (the statistic and the port's count).
    fn flows_added(&self, n: usize) {
        self.flows.fetch_add(n, Ordering::Relaxed);
        stats::add(Stat::KRCORE_STAT_DGRAM_FLOWS, n as u64);
    }

    fn flows_removed(&self, n: usize) {
        self.flows.fetch_sub(n, Ordering::Relaxed);
        stats::sub(Stat::KRCORE_STAT_DGRAM_FLOWS, n as u64);
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// Our flow on `route` to `peer` (the existing one, whose sequence
    /// numbers go on: a VQP that falls back from a link keeps its flow).
    /// EAGAIN while the route's last flow lingers: a VQP that took a
    /// destroyed one's number waits until the peer dropped that flow (its
    /// CLOSE acknowledged) or the flow failed, or the new flow's first
    /// packets would land in the old one's receiver.
    pub fn open(&self, route: Route, peer: Peer) -> Result<Arc<Flow>> {
        let mut out = self.out.lock();
        if let Some(f) = out.get(&route) {
            if f.lingering.load(Ordering::Acquire) {
                return Err(Errno(libc::EAGAIN));
            }
            if f.peer == peer {
                return Ok(Arc::clone(f));
            }
        }
        let hint = self.rto_hint.load(Ordering::Relaxed);
        let cfg = if hint > 0 { Config { rto_initial_us: hint, ..self.cfg } } else { self.cfg };
        let sender = Sender::new(cfg, route, reliable::random_seed())?;
        let f = Arc::new(Flow { route, peer, sender: Mutex::new(sender), lingering: AtomicBool::new(false) });
        if out.insert(route, Arc::clone(&f)).is_none() {
            self.flows_added(1);
        }
        Ok(f)
    }

    /// Our flow ends (its VQP was destroyed, reset or failed): what it
    /// still has outstanding completes no more (a lingering flow stays
    /// until its work is done).
    pub fn close(&self, flow: &Flow) {
        if flow.lingering.load(Ordering::Acquire) {
            return;
        }
        self.remove(flow);
    }

    /// Keep `flow` (its VQP is going) only until its outstanding work, a
    /// CLOSE its VQP posted last, is acknowledged or the flow fails: the
    /// VQP's destruction does not wait for its peer.
    pub fn linger(&self, flow: &Flow) {
        flow.lingering.store(true, Ordering::Release);
        self.drop_if_done(flow, &flow.sender.lock());
    }

    /// A lingering flow with nothing left to do goes.
    fn drop_if_done(&self, flow: &Flow, s: &Sender) {
        if flow.lingering.load(Ordering::Acquire) && (s.outstanding() == 0 || s.failed()) {
            self.remove(flow);
        }
    }

    fn remove(&self, flow: &Flow) {
        let mut out = self.out.lock();
        if out.get(&flow.route).is_some_and(|f| std::ptr::eq(&**f, flow)) {
            out.remove(&flow.route);
            self.flows_removed(1);
            if out.is_empty() {
                out.shrink_to_fit();
            }
        }
    }

    /// Our VQP `vqpn` is going: the final ACKs of the flows to it from
    /// process `carry_for`, for its CLOSE to carry (an RC QP acknowledges
    /// in its transport, reliably, before its application could destroy
    /// it; a lone ACK datagram may be lost). At most
    /// [`wire::MAX_CLOSE_ACKS`]; the others, and those of other processes,
    /// are sent now as they are.
    pub fn final_acks(&self, host: &dyn Host, vqpn: u32, carry_for: Option<u64>) -> Vec<u8> {
        let mut carried = Vec::new();
        let mut loose = Vec::new();
        for (k, f) in self.inbound.lock().iter_mut().filter(|(k, _)| k.route.dst_vqpn == vqpn) {
            let a = f.receiver.final_ack();
            if carry_for == Some(k.route.src_incarnation) && carried.len() < wire::MAX_CLOSE_ACKS * wire::ACK_LEN {
                carried.extend_from_slice(&a);
            } else {
                loose.push((f.peer, a));
            }
        }
        for (peer, a) in loose {
            stats::inc(Stat::KRCORE_STAT_DGRAM_SENT);
            host.send(&peer, &a);
        }
        carried
    }

    /// Our VQP `vqpn` is gone: the peers' flows to it go too.
    pub fn forget_vqp(&self, vqpn: u32) {
        self.forget_inbound(|r| r.dst_vqpn == vqpn);
    }

    /// Process `incarnation` is gone: every flow from it goes.
    pub fn forget_process(&self, incarnation: u64) {
        self.forget_inbound(|r| r.src_incarnation == incarnation);
    }

    fn forget_inbound(&self, which: impl Fn(&Route) -> bool) {
        let mut inbound = self.inbound.lock();
        let before = inbound.len();
        inbound.retain(|k, f| {
            let keep = !which(&k.route);
            if !keep {
                self.inbound_gone(&k.gid, f);
            }
            keep
        });
        self.flows_removed(before - inbound.len());
        if inbound.is_empty() {
            // A burst of peers leaves no high-water table behind.
            inbound.shrink_to_fit();
        }
    }

    /// Whether a flow of ours goes to process `incarnation` (its doubts
    /// will look into the process's silence).
    pub fn has_flows_to(&self, incarnation: u64) -> bool {
        self.out.lock().values().any(|f| f.route.dst_incarnation == incarnation)
    }

    /// Whether process `incarnation`, whose service QP is `qpn` on one of
    /// `gids`, was heard from on the tier (answered one of our flows, or
    /// sent on one of its own) in the last `within`. Flows from another
    /// address that write its incarnation are a stranger's: they do not
    /// keep a dead process alive.
    pub fn heard_from(&self, incarnation: u64, qpn: u32, gids: &[Gid], within: Duration) -> bool {
        let since = self.now_us().saturating_sub(within.as_micros() as u64);
        let its = |p: &Peer| p.qpn == qpn && gids.contains(&p.dgid);
        // (A flow's lock is never taken under `out`'s: a lingering flow
        // takes `out`'s under its own.)
        let flows: Vec<Arc<Flow>> =
            self.out.lock().values().filter(|f| f.route.dst_incarnation == incarnation && its(&f.peer)).cloned().collect();
        let answered = flows.iter().any(|f| f.sender.lock().heard_at().is_some_and(|t| t >= since));
        answered || self.inbound.lock().iter().any(|(k, f)| k.route.src_incarnation == incarnation && its(&f.peer) && f.last_us >= since)
    }

    /// Post `op` on `flow` and send what its window admits. ENOTCONN when
    /// the flow failed (the caller's VQP is in the error state: the
    /// request is flushed), ENOMEM when its queue is full.
    pub fn post(&self, host: &dyn Host, flow: &Flow, op: Op<'_>) -> Result<()> {
        let mut s = flow.sender.lock();
        if s.failed() {
            return Err(Errno(libc::ENOTCONN));
        }
        match op {
            Op::Send { id, opcode, imm, data } => s.post_send(id, opcode, imm, data)?,
            Op::Read { id, rkey, addr, len } => s.post_read(id, rkey, addr, len)?,
            Op::Write { id, rkey, addr, data } => s.post_write(id, rkey, addr, data)?,
            Op::Atomic { id, atomic, rkey, addr } => s.post_atomic(id, atomic, rkey, addr)?,
        }
        stats::inc(Stat::KRCORE_STAT_DGRAM_WRS);
        self.used();
        self.transmit(host, flow, &mut s);
        Ok(())
    }

    /// Send what the sender has to send now (under its lock: in order),
    /// and make sure its timer is armed.
    fn transmit(&self, host: &dyn Host, flow: &Flow, s: &mut Sender) {
        for d in s.poll(self.now_us()) {
            crate::kmark!("dgram: a packet sent ({} bytes)", d.len());
            stats::inc(Stat::KRCORE_STAT_DGRAM_SENT);
            host.send(&flow.peer, &d);
        }
        if s.take_doubt() && !host.doubt(flow.route.dst_incarnation, &flow.peer) {
            s.vouch(None);
        }
        if let Some(at) = s.next_deadline() {
            self.arm(host, at);
        }
    }

    fn arm(&self, host: &dyn Host, at_us: u64) {
        if self.armed.fetch_min(at_us, Ordering::AcqRel) > at_us {
            host.wake_at(self.epoch + Duration::from_micros(at_us));
        }
    }

    /// A datagram of this family arrived from `from` (the progress thread).
    pub fn on_datagram(&self, host: &dyn Host, bytes: &[u8], from: &Source) {
        let _turn = self.turn.lock();
        self.used();
        let m = match Message::decode(bytes) {
            Ok(m) => m,
            Err(_) => return dropped(),
        };
        match m {
            Message::Ack(_) | Message::Response(_) => self.on_answer(host, &m, from),
            Message::Data(_) | Message::Request(_) => self.on_inbound(host, &m, from),
        }
    }

    /// An ACK or RESPONSE for one of our flows.
    fn on_answer(&self, host: &dyn Host, m: &Message, from: &Source) {
        let route = m.route().reverse();
        crate::kmark!("dgram: an answer received");
        let Some(flow) = self.out.lock().get(&route).cloned() else { return dropped() };
        if !flow.peer.sent(from) {
            crate::kmark!("dgram: an answer from another source dropped ({from:?} for {:?})", flow.peer);
            return dropped();
        }
        let done = {
            let mut s = flow.sender.lock();
            let before = s.drops;
            s.on_message(self.now_us(), m);
            if s.drops != before {
                dropped();
            }
            let done = take_completions(&mut s);
            self.transmit(host, &flow, &mut s);
            if let Some(rto) = s.measured_rto() {
                self.rto_hint.store(rto, Ordering::Relaxed);
            }
            self.drop_if_done(&flow, &s);
            done
        };
        for c in done {
            host.completed(&flow.route, c);
        }
        crate::kmark!("dgram: answer handled");
    }

    /// A DATA or REQUEST packet of a peer's flow to one of our VQPs.
    fn on_inbound(&self, host: &dyn Host, m: &Message, from: &Source) {
        let route = *m.route();
        let key = FlowKey::of(route, from);
        let mut inbound = self.inbound.lock();
        if !inbound.contains_key(&key) {
            match self.late_packet(&key, m) {
                Late::No => {}
                Late::Answer(peer, ack) => {
                    drop(inbound);
                    stats::inc(Stat::KRCORE_STAT_DGRAM_SENT);
                    return host.send(&peer, &ack);
                }
            }
            // (Checked again when it is added: the lock is let go while
            // the host admits it.)
            if inbound.len() >= MAX_INBOUND || self.per_gid.lock().get(&key.gid).is_some_and(|n| *n >= self.flows_per_gid) {
                return dropped();
            }
            drop(inbound);
            let Some((pd, peer)) = host.admit(&route, from) else { return dropped() };
            let receiver = match Receiver::new(self.cfg, route).map(|r| r.with_source(key.gid)) {
                Ok(r) => r,
                Err(_) => return dropped(),
            };
            inbound = self.inbound.lock();
            if let std::collections::hash_map::Entry::Vacant(e) = inbound.entry(key) {
                if !self.inbound_added(&key.gid) {
                    crate::klog!(
                        crate::log::Level::Debug,
                        "dgram: KRCORE_DGRAM_FLOWS_PER_GID flows from {:02x?}: a new one dropped",
                        key.gid
                    );
                    return dropped();
                }
                self.flows_added(1);
                e.insert(Inbound { peer, pd, last_us: 0, receiver, responder: Responder::new(self.cfg.mtu, MAX_MSG) });
            }
        }
        let Some(f) = inbound.get_mut(&key) else { return };
        let now = self.now_us();
        f.last_us = now;
        // One-sided requests spend their source GID's misses with the
        // links' MR checks (`crate::vqp::mrcheck`): a GID that spent them
        // is not served, whatever it asks, until it has one again (its
        // sender retransmits meanwhile).
        if matches!(m, Message::Request(_)) && !crate::vqp::mrcheck::admit(&from.gid) {
            return dropped();
        }
        if f.receiver.would_hold(m) && self.ahead.load(Ordering::Relaxed) >= MAX_AHEAD {
            return dropped();
        }
        let (ahead_before, rnr_before) = (f.receiver.ahead(), f.receiver.drops.rnr);
        let (peer, pd) = (f.peer, f.pd);
        let mut answers = Vec::new();
        let mut messages = Vec::new();
        let mut answered = None;
        match f.receiver.on_message(now, m) {
            Received::Dropped => dropped(),
            // Its ACK says RNR (counted below): the sender waits and sends
            // it again.
            Received::Rnr => {}
            Received::DuplicateRequest => {
                if let Message::Request(req) = m {
                    answers = crate::vqp::mrs::with(pd, |mrs| f.responder.serve_duplicate(req, &Registered(mrs), &mut ProcessMemory));
                }
            }
            Received::Taken => {
                while let Some(d) = f.receiver.pop() {
                    match d {
                        Delivery::Message { opcode, imm, data, held } => messages.push(Arrived { opcode, imm, data, held }),
                        Delivery::Request(_) => {
                            let Some(req) = d.request() else { continue };
                            let served = crate::vqp::mrs::with(pd, |mrs| f.responder.serve(&req, &Registered(mrs), &mut ProcessMemory));
                            stats::inc(Stat::KRCORE_STAT_DGRAM_SERVED);
                            // (A WRITE's segments before its last are not
                            // answered: the flow's ACK covers them.)
                            if !served.responses.is_empty() {
                                answered = Some(req.seq);
                            }
                            answers.extend(served.responses);
                            if served.status == super::wire::Status::RemoteAccess {
                                crate::vqp::mrcheck::missed(&from.gid);
                            }
                            if served.status != super::wire::Status::Ok {
                                stats::inc(Stat::KRCORE_STAT_DGRAM_REFUSED);
                                // As an RC responder: nothing more of this flow.
                                f.receiver.fail();
                                messages.clear();
                                break;
                            }
                        }
                    }
                }
            }
        }
        // Refused now, or one held past the gap that it let through.
        stats::add(Stat::KRCORE_STAT_DGRAM_RNR, f.receiver.drops.rnr - rnr_before);
        let ahead_after = f.receiver.ahead();
        if ahead_after >= ahead_before {
            self.ahead.fetch_add(ahead_after - ahead_before, Ordering::Relaxed);
        } else {
            self.ahead.fetch_sub(ahead_before - ahead_after, Ordering::Relaxed);
        }
        if let Some(seq) = answered {
            // Its responses acknowledge it: no ACK datagram (and no
            // delayed-ACK timer) for a READ or an atomic.
            f.receiver.answered(seq);
        }
        // A CLOSE is its flow's last message (the number's next flow waits
        // for its ACK: `open`).
        if let Some(i) = messages.iter().position(|m| m.opcode == SendOp::Close) {
            messages.truncate(i + 1);
        }
        let closed = messages.last().is_some_and(|m| m.opcode == SendOp::Close);
        // The ACK of what is delivered now goes with it (Host::messages); a
        // CLOSE is acknowledged once its flow is gone, below.
        let ack = if messages.is_empty() || closed { None } else { f.receiver.poll_ack(now) };
        drop(inbound);
        crate::kmark!("dgram: a packet received, {} answers", answers.len());
        // A RESPONSE acknowledges every message before its request: with
        // messages to deliver it goes with them (Host::messages), as the ACK.
        if messages.is_empty() {
            for a in &answers {
                stats::inc(Stat::KRCORE_STAT_DGRAM_SENT);
                host.send(&peer, a);
            }
            answers.clear();
        }
        if closed {
            // Its final ACKs first, so that what we sent the closing VQP
            // completes before it is reported gone; only ACKs of flows to
            // that VQP are taken.
            let close = messages.last_mut().expect("closed");
            for a in close.data.chunks_exact(wire::ACK_LEN) {
                match Message::decode(a) {
                    Ok(m @ Message::Ack(_))
                        if m.route().src_vqpn == route.src_vqpn && m.route().src_incarnation == route.src_incarnation =>
                    {
                        self.on_answer(host, &m, from)
                    }
                    _ => dropped(),
                }
            }
            close.data = Vec::new();
        }
        if !messages.is_empty() {
            answers.extend(ack);
            for _ in &answers {
                stats::inc(Stat::KRCORE_STAT_DGRAM_SENT);
            }
            host.messages(&route, &peer, messages, &answers);
        }
        if closed {
            // The sender's VQP is gone: its CLOSE is acknowledged now and
            // the flow goes (its number may come back with a new VQP).
            let gone = {
                let mut inbound = self.inbound.lock();
                let gone = inbound.remove(&key);
                if let Some(f) = &gone {
                    self.inbound_gone(&key.gid, f);
                }
                gone
            };
            if let Some(mut f) = gone {
                self.flows_removed(1);
                stats::inc(Stat::KRCORE_STAT_DGRAM_SENT);
                host.send(&peer, &f.receiver.final_ack());
                let (next, nonce) = f.receiver.position();
                self.closed.lock().insert(key, Closed { peer, first_nonce: f.receiver.first_nonce(), next, nonce });
            }
            return;
        }
        self.ack(host, &key, now);
    }

    /// A packet `m` of flow `key`, which is not open here: whether that
    /// flow closed here lately and `m` is one of its packets (not the
    /// first of a new flow: sequence number 0 with another nonce), to be
    /// answered with its final ACK again. A new flow forgets the closed
    /// one (only its own sender's: the key holds the source address).
    fn late_packet(&self, key: &FlowKey, m: &Message) -> Late {
        let mut closed = self.closed.lock();
        let (Some(c), Some((seq, nonce))) = (closed.get(key), m.seq_nonce()) else { return Late::No };
        if seq == 0 && c.first_nonce != Some(nonce) {
            closed.remove(key);
            return Late::No;
        }
        let ack = Message::Ack(wire::Ack { route: key.route.reverse(), next: c.next, nonce: c.nonce, sack: 0, rnr: false }).to_vec();
        Late::Answer(c.peer, ack)
    }

    /// Send flow `key`'s ACK if one is due, else arm its timer.
    fn ack(&self, host: &dyn Host, key: &FlowKey, now: u64) {
        let mut inbound = self.inbound.lock();
        let Some(f) = inbound.get_mut(key) else { return };
        let peer = f.peer;
        if let Some(a) = f.receiver.poll_ack(now) {
            drop(inbound);
            stats::inc(Stat::KRCORE_STAT_DGRAM_SENT);
            host.send(&peer, &a);
        } else if let Some(at) = f.receiver.next_deadline() {
            drop(inbound);
            self.arm(host, at);
        }
    }

    /// What the host found out about process `incarnation` after
    /// [`Host::doubt`]: alive for `valid` more (its flows go on retrying
    /// meanwhile, at most `LIVE_BOUND_US` after they ran out), or None:
    /// its flows that ran out of retries fail now.
    pub fn vouch(&self, host: &dyn Host, incarnation: u64, valid: Option<Duration>) {
        let _turn = self.turn.lock();
        let until = valid.map(|d| self.now_us() + d.as_micros() as u64);
        let flows: Vec<Arc<Flow>> = self.out.lock().values().filter(|f| f.route.dst_incarnation == incarnation).cloned().collect();
        for flow in flows {
            let done = {
                let mut s = flow.sender.lock();
                s.vouch(until);
                let done = take_completions(&mut s);
                self.drop_if_done(&flow, &s);
                done
            };
            for c in done {
                host.completed(&flow.route, c);
            }
        }
    }

    /// The timer fired: retransmissions, delayed ACKs, failed flows.
    pub fn on_timer(&self, host: &dyn Host) {
        let _turn = self.turn.lock();
        self.armed.store(u64::MAX, Ordering::Release);
        let now = self.now_us();
        let flows: Vec<Arc<Flow>> = self.out.lock().values().cloned().collect();
        for flow in flows {
            let done = {
                let mut s = flow.sender.lock();
                if s.next_deadline().is_none_or(|d| d > now) {
                    if let Some(d) = s.next_deadline() {
                        self.arm(host, d);
                    }
                    continue;
                }
                crate::kmark!("dgram: a flow's timer expired");
                self.transmit(host, &flow, &mut s);
                let done = take_completions(&mut s);
                self.drop_if_done(&flow, &s);
                done
            };
            for c in done {
                host.completed(&flow.route, c);
            }
        }
        let keys: Vec<FlowKey> =
            self.inbound.lock().iter().filter(|(_, f)| f.receiver.next_deadline().is_some()).map(|(k, _)| *k).collect();
        for k in keys {
            self.ack(host, &k, now);
        }
    }
}

/// How long after the tier was last used the application's polls still
/// drain the UD queue (beyond the first timeouts of a new peer's answer).
const BUSY_MS: u64 = 100;

/// The first timeout of a flow before any round trip was measured on
/// this endpoint: a new peer's first answer waits for its service thread
/// to wake, which on a loaded or emulated host takes milliseconds, and a
/// retransmission then would only add work (TCP starts at 1 s).
const RTO_FIRST_US: u64 = 50_000;

/// The longest retransmission timeout of the tier.
const RTO_MAX_US: u64 = 500_000;

/// How long a flow out of retries goes on while its peer is vouched for
/// (sending to us, or bound at the meta server with its lease renewed,
/// yet not answering: a process starved of CPU by a burst of new ones on
/// its host answers seconds late, where an RC responder's NIC would have
/// answered for it). Bounded: a live peer may also drop a flow for good.
pub const LIVE_BOUND_US: u64 = 10_000_000;

/// The largest work request the tier carries, and the largest READ a
/// target serves on it. A message is a window of datagrams each handled
/// by the target's progress thread: beyond this a link, asked for at
/// first contact, comes up sooner than the message would arrive (a 1 MiB
/// SEND took 10 s on a loaded testbed), so larger work waits for it.
pub const MAX_MSG: u32 = 64 << 10;

const ZERO_ROUTE: Route = Route { src_incarnation: 0, dst_incarnation: 0, src_vqpn: 0, dst_vqpn: 0 };

fn dropped() {
    stats::inc(Stat::KRCORE_STAT_DGRAM_DROPPED);
}

fn take_completions(s: &mut Sender) -> Vec<Completion> {
    std::iter::from_fn(|| s.pop_completion()).collect()
}

/// The PD's registered MRs with remote access.
struct Registered<'a>(&'a crate::vqp::mrs::PdMrs);

impl Mrs for Registered<'_> {
    fn by_rkey(&self, rkey: u32) -> Option<MrInfo> {
        self.0.by_rkey(rkey)
    }
}

/// This process's memory, inside MRs the checks found registered (and
/// which stay registered: the caller holds the MR registry's lock, which
/// a deregistration takes first).
struct ProcessMemory;

impl Memory for ProcessMemory {
    fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
        // SAFETY: [addr, addr + len) lies inside a registered MR (checked),
        // which stays registered while the registry's lock is held.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), out.len()) };
        true
    }

    fn write(&mut self, addr: u64, data: &[u8]) -> bool {
        // SAFETY: as `read`; the MR grants REMOTE_WRITE (checked).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
        true
    }

    fn compare_swap(&mut self, addr: u64, compare: u64, swap: u64) -> Option<u64> {
        // SAFETY: 8 aligned bytes inside a registered MR granting
        // REMOTE_ATOMIC (checked); concurrent CPU access is atomic too.
        let a = unsafe { std::sync::atomic::AtomicU64::from_ptr(addr as *mut u64) };
        Some(match a.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(v) | Err(v) => v,
        })
    }

    fn fetch_add(&mut self, addr: u64, add: u64) -> Option<u64> {
        // SAFETY: as `compare_swap`.
        let a = unsafe { std::sync::atomic::AtomicU64::from_ptr(addr as *mut u64) };
        Some(a.fetch_add(add, Ordering::SeqCst))
    }
}

#[cfg(test)]
#[path = "port_tests.rs"]
mod tests;
