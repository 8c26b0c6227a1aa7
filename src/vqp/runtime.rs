//! The virtual-QP runtime of one protection domain: its service endpoint
//! and links, its meta-server client, the receive buffers all links share,
//! and the progress function that turns the links' completions into the
//! VQPs' completions and received messages.
//!
//! Progress runs on whichever thread needs it (an application polling a
//! CQ that VQPs feed, a post that found its link's queue full,
//! `qpop_msgs`, and the service thread while a CQ that VQPs feed is armed
//! for a completion event), one at a time (`try_lock`: a thread that finds
//! progress already running goes on; the runner delivers for everyone).
//!
//! Here: the runtime, its start and teardown, the MR lease. By concern:
//! `progress` (completions and messages dispatched), `links` (links
//! asked for, probed, closed; their receive side and header arenas), `cq`
//! (the application CQs' software completions and events), `peer_mrs`
//! (the MRStore), `meta` (the meta-server connection and lookups).

use super::header::{Flags, Header, LinkOp, HEADER_LEN};
use super::large::{Control, Large};
use super::qp as vqp;
use super::queue::SoftCq;
use super::wrid::WrId;
use crate::error::{Errno, Result};
use crate::klog;
use crate::log::Level;
use crate::meta::client::{self, MetaClient};
use crate::rdma::{self, Ah, Caps, Cq, Device, Qp, Region, SendCq};
use crate::service::{self, Service};
use crate::sys::*;
use once_cell::sync::OnceCell;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

mod cq;
mod links;
mod liveness;
mod meta;
mod peer_mrs;
mod progress;
pub use cq::{CqSoft, Sink, NOTIFY_WR_ID};
pub(super) use links::Ranges;
pub use links::{HdrArena, HDR_SLOT};
use meta::{slow_meta_bound, start_meta, MetaStart};
pub use peer_mrs::PeerMrs;
pub(crate) use progress::pause;
use progress::LastVqp;

/// Payload bytes a message may carry (a receive buffer holds the header
/// and this much).
pub const MAX_MSG: usize = 4096;
const RECV_BUF: usize = HEADER_LEN + MAX_MSG;
/// Bytes a liveness probe READs.
const PROBE_LEN: usize = 8;
/// How long a link's work is waited for to complete (a READ of a peer's
/// probe target, the WQEs before a link's LINK_CLOSE): RC completes it, in
/// error at worst, once the retries ran out (timeout 17, 6 retries: about
/// 3.8 s); more, for load.
pub const TRANSPORT_WAIT: Duration = Duration::from_secs(10);
/// RC's own time to give up on a WQE the peer does not answer: a link
/// QP's timeout (17: 4.096 us x 2^17 = 537 ms) times its tries (retry
/// count 6, plus the first), about 3.76 s. A WQE posted at t has reached
/// the peer, or failed its link, by t plus this (once it left the queue).
pub const RC_RETRY_TIME: Duration = Duration::from_micros(4096 * (1 << 17) * 7 / 1000);

pub struct Runtime {
    /// The application's real PD.
    pub pd: usize,
    /// Header slots of every VQP's in-flight SENDs, in registered arenas
    /// added as VQPs need them (the first, small, with the links' side).
    hdr_arenas: Mutex<Vec<Arc<HdrArena>>>,
    /// The MRStore of each peer, by the peer's incarnation.
    peer_mrs: Mutex<FxHashMap<u64, Arc<Mutex<PeerMrs>>>>,
    pub svc: Service,
    meta: OnceCell<Arc<MetaClient>>,
    /// The meta-server connection being made on its own thread since the
    /// runtime started (with `KRCORE_META`), taken by the first `meta()`
    /// that finds it made.
    meta_start: Mutex<Option<Arc<MetaStart>>>,
    /// The teardown began (set under `meta_start`'s lock): no connection
    /// to the meta server is made any more. One started then (a silent
    /// peer's liveness looked up during the teardown) made its QP on the
    /// PD after the runtime was gone: `ibv_dealloc_pd` failed `EBUSY`.
    meta_closed: AtomicBool,
    /// The links' receive buffers, posted on the SRQ: made in the
    /// background once the runtime is up, or by the first link made
    /// before that ([`Self::receive_side`]); a VQP on the datagram tier
    /// needs none.
    recv_bufs: OnceCell<Region>,
    /// A thread is making the links' side and receive buffers.
    preparing: AtomicBool,
    /// Held by the one thread making progress (see the module doc).
    progress: Mutex<LastVqp>,
    /// A thread found `progress` held: its holder drains once more after
    /// releasing it (else a completion that came after the holder's poll
    /// and whose event woke only that thread waits for the next poll; an
    /// application asleep on a completion channel never makes one).
    progress_again: AtomicBool,
    /// How many of the CQs this runtime's VQPs deliver to are armed: the
    /// service thread wakes on link completions only while some are.
    armed_cqs: std::sync::atomic::AtomicUsize,
    /// Checks of peers' rkeys waiting for answers, answers owed.
    pub mr_checks: super::mrcheck::Checks,
    next_tag: std::sync::atomic::AtomicU32,
    /// Messages above MAX_MSG: staging, DONEs awaited, READs in flight.
    pub large: Large,
    /// Progress runs (by the application, mostly), and the count the
    /// service thread saw last: whether the application polls by itself.
    polls: std::sync::atomic::AtomicU64,
    polls_seen: std::sync::atomic::AtomicU64,
    /// Where liveness probes land (their bytes are not looked at), made
    /// with the links' side.
    probe_buf: OnceCell<Region>,
    /// Probes keep being scheduled until the runtime is released.
    probing: AtomicBool,
    /// What waits for WQEs on the links to complete (teardown, MRs).
    pub wire: super::wire::Waiters,
    /// See [`Runtime::gids`].
    gids: OnceCell<Vec<rdma::Gid>>,
    /// The datagram tier on the service endpoint's UD QP.
    pub dgram: crate::transport::dgram::port::Port,
    /// Links being made in the background, by peer process, index, path.
    linking: Mutex<std::collections::HashSet<(u64, u16, service::Path)>>,
    /// Processes (incarnations) a link to failed, or that did not answer
    /// a handshake: gone, as far as this process can tell, until a
    /// connect finds one of their bindings still there ([`Self::forgive`]).
    gone: Mutex<crate::recent::Recent<u64>>,
    /// The key each peer process was last resolved by, to look it up
    /// again when it goes silent (`liveness.rs`), and the processes being
    /// looked up so.
    keys: Mutex<crate::recent::RecentMap<u64, (crate::meta::Key, crate::meta::Endpoint)>>,
    doubting: Mutex<std::collections::HashSet<u64>>,
    me: OnceCell<Weak<Runtime>>,
}

/// Processes taken for gone that are remembered (the oldest is forgotten:
/// a connect to it then finds out again).
const MAX_GONE: usize = 4096;

/// A signaled READ of the library's own (a control READ, `tag`) into
/// `sge` from (addr, rkey); `sge` must outlive the post.
fn control_read_wr(tag: u32, sge: &mut ibv_sge, addr: u64, rkey: u32) -> ibv_send_wr {
    // SAFETY: a plain C struct.
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = WrId::Control { tag }.encode();
    wr.sg_list = sge;
    wr.num_sge = 1;
    wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
    wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
    wr.wr.rdma.remote_addr = addr;
    wr.wr.rdma.rkey = rkey;
    wr
}

pub use super::registry::{release_context, release_pd};

/// `KRCORE_CONNECT_TIMEOUT_MS`: the bound on every wait for a peer or the
/// meta server.
pub fn connect_timeout() -> Duration {
    Duration::from_millis(crate::config::get().connect_timeout_ms)
}

impl Runtime {
    /// Build the runtime of the application's real `pd` on real `ctx` with
    /// our GID at `gid_index` (`registry::get_or_start` makes one per PD).
    ///
    /// # Safety
    /// `ctx` and `pd` are live real objects that outlive the runtime.
    pub(super) unsafe fn start(ctx: *mut ibv_context, pd: *mut ibv_pd, gid_index: Option<u32>) -> Result<Arc<Runtime>> {
        crate::kmark!("runtime: start");
        // SAFETY: caller contract.
        let dev = unsafe { Device::borrow(ctx, pd) }?;
        let gi = match gid_index.or(crate::config::get().gid_index) {
            Some(i) => i,
            None => Runtime::home_gid_index(&dev)?,
        };
        let gid = dev.gid(gi)?;
        if gid == [0; 16] {
            // An empty slot of the GID table (rxe answers for any index
            // below its table's length): nothing could reach us there.
            klog!(Level::Error, "vqp: GID index {gi} of {} holds no GID (KRCORE_GID_INDEX, or qbind's GID)", dev.name);
            return Err(Errno(libc::EADDRNOTAVAIL));
        }
        crate::kmark!("runtime: device borrowed, GID index {gi}");
        // Attached to the host's agent, a process that binds nothing needs
        // no meta-server connection of its own (lookups go through the
        // agent; a bind makes it then). A transparent QP publishes its QPN
        // at creation: made now. The agent's path is not opened here: a
        // qconnect once this runtime is up connects by itself, so only a
        // start that waits until it is needed opens it first
        // (`registry::start_soon`), for the qconnects meanwhile; a
        // transparent QP never uses it.
        let attached = crate::node::client::attach();
        let own_meta = crate::config::get().virtualize != crate::config::Virtualize::Off || !attached;
        // Chosen here: the meta-server connection, made meanwhile, names it.
        let incarnation = crate::rdma::random_u64();
        let meta_start = if own_meta { start_meta(&dev, gi, incarnation) } else { None };
        // A start in the background gives way to the process's first work
        // through the agent between its steps (none when started for a
        // caller: it asked for the runtime, which ended the giving way).
        let give_way = crate::transport::agent::give_way;
        give_way();
        let svc = Service::start(&dev, gi, service::Options { between_steps: give_way, incarnation, ..Default::default() })?;
        if !own_meta {
            // No meta-server connection says that this process lives: the
            // agent does (`node::presence`).
            crate::node::client::present(incarnation, gid);
        }
        // What only links use (header arena, scratch, probe buffer) is
        // made with the links' side, in the background (`prepare_links`):
        // the first operations go on the datagram tier without them.
        let dgram =
            crate::transport::dgram::port::Port::new(svc.mtu(), crate::config::get().dgram_rto_us, connect_timeout().as_micros() as u64)?;
        let rt = Arc::new(Runtime {
            pd: pd as usize,
            hdr_arenas: Mutex::new(Vec::new()),
            peer_mrs: Mutex::new(FxHashMap::default()),
            svc,
            meta: OnceCell::new(),
            meta_start: Mutex::new(meta_start),
            meta_closed: AtomicBool::new(false),
            recv_bufs: OnceCell::new(),
            preparing: AtomicBool::new(false),
            progress: Mutex::new(LastVqp::default()),
            progress_again: AtomicBool::new(false),
            armed_cqs: std::sync::atomic::AtomicUsize::new(0),
            mr_checks: super::mrcheck::Checks::default(),
            next_tag: std::sync::atomic::AtomicU32::new(1),
            large: Large::default(),
            polls: std::sync::atomic::AtomicU64::new(0),
            polls_seen: std::sync::atomic::AtomicU64::new(0),
            probe_buf: OnceCell::new(),
            probing: AtomicBool::new(true),
            wire: Default::default(),
            gids: OnceCell::new(),
            dgram,
            linking: Mutex::new(Default::default()),
            gone: Mutex::new(crate::recent::Recent::new(MAX_GONE)),
            keys: Mutex::new(crate::recent::RecentMap::new(liveness::MAX_KEYS)),
            doubting: Mutex::new(Default::default()),
            me: OnceCell::new(),
        });
        let _ = rt.me.set(Arc::downgrade(&rt));
        let weak = Arc::downgrade(&rt);
        rt.svc.on_datagram(Box::new(move |bytes, from| {
            if let Some(rt) = weak.upgrade() {
                rt.dgram.on_datagram(&*rt, bytes, from);
            }
        }));
        // The links' CQs, SRQ, probe target and receive buffers, off the
        // caller's path (the first operation goes on the datagram tier)
        // and off the progress thread's (it answers the tier meanwhile;
        // a peer's link request waits for its next copy until they are
        // made).
        rt.prepare_links();
        let weak = Arc::downgrade(&rt);
        rt.svc.on_accepting(Box::new(move || {
            let Some(rt) = weak.upgrade() else { return false };
            rt.recv_bufs.get().is_some() || {
                rt.prepare_links();
                false
            }
        }));
        // A link puts its peer in this PD (it may READ and WRITE what the
        // PD's rkeys open): only for a process a VQP of ours takes
        // messages from.
        let weak = Arc::downgrade(&rt);
        rt.svc.on_link_wanted(Box::new(move |peer, path| {
            let Some(rt) = weak.upgrade() else { return false };
            vqp::live().iter().any(|v| v.runs_on(&rt) && v.wants_link_with(peer, path))
        }));
        // While the application sleeps on a completion channel, the
        // service thread makes progress when the links have completions.
        let weak = Arc::downgrade(&rt);
        rt.svc.on_link_event(Box::new(move || {
            let Some(rt) = weak.upgrade() else { return false };
            rt.progress();
            rt.armed_cqs.load(Ordering::Acquire) > 0
        }));
        // Messages are taken off the SRQ in the background too (waiting
        // for a progress run the application's thread may be in).
        let weak = Arc::downgrade(&rt);
        rt.svc.on_link_recv(Box::new(move || {
            let Some(rt) = weak.upgrade() else { return false };
            rt.progress_messages();
            let polls = rt.polls.load(Ordering::Relaxed);
            let polled = polls != rt.polls_seen.swap(polls, Ordering::Relaxed);
            // An application with an armed CQ waits for its event, however
            // often it polled before: messages must wake this thread.
            polled && rt.armed_cqs.load(Ordering::Acquire) == 0
        }));
        // A link made beyond KRCORE_MAX_LINKS: close the least recently
        // used idle ones now, not at the next tick.
        let weak = Arc::downgrade(&rt);
        rt.svc.on_new_link(Box::new(move || {
            let Some(rt) = weak.upgrade() else { return };
            // A link a peer asked for: its messages need our receives.
            if let Err(e) = rt.receive_side() {
                klog!(Level::Warn, "vqp: the links' receive buffers: {e:?}");
            }
            let max = crate::config::get().max_links;
            if max > 0 && rt.svc.physical_links() > max {
                let weak = Arc::downgrade(&rt);
                rt.svc.defer(
                    Instant::now(),
                    Box::new(move || {
                        if let Some(rt) = weak.upgrade() {
                            rt.reclaim_links();
                        }
                    }),
                );
            }
        }));
        Runtime::schedule_maintenance(&rt);
        crate::kmark!("runtime: started");
        Ok(rt)
    }

    /// Before the PD goes (`registry::release_pd`, the last reference
    /// held): what holds objects on it besides the runtime's own fields.
    pub(super) fn teardown(self: &Arc<Self>) {
        // Delayed deregistrations hold the PD: they go now.
        self.probing.store(false, Ordering::Release);
        self.wire.force(self);
        self.svc.run_deferred_now();
        // A connection still being made holds objects on the PD too.
        // (Bounded: the attempt's own bound.)
        let started = {
            let mut start = self.meta_start.lock();
            self.meta_closed.store(true, Ordering::Release);
            start.take()
        };
        let started = started.and_then(|s| s.wait_until(Instant::now() + slow_meta_bound())).and_then(|(r, _)| r.ok());
        for meta in self.meta.get().into_iter().chain(started.as_ref()) {
            meta.shutdown();
        }
    }

    /// A weak reference to this runtime (for work that must not keep it).
    pub fn weak_self(&self) -> Weak<Runtime> {
        self.me.get().cloned().unwrap_or_default()
    }

    /// Our GID when neither qbind nor `KRCORE_GID_INDEX` names one: the
    /// one the kernel routes to the (first reachable) meta server from,
    /// so that the meta server and the peers that reach it reach us; else
    /// the port's first usable GID.
    fn home_gid_index(dev: &Device) -> Result<u32> {
        let addrs = crate::config::get().meta.as_deref().and_then(|m| client::parse_addrs(m).ok()).unwrap_or_default();
        let gi = match addrs.iter().find_map(|a| dev.route_gid_index(a)) {
            Some(i) => i,
            None => dev.default_gid_index()?,
        };
        klog!(Level::Info, "vqp: links and the meta server use GID index {gi} of {} (KRCORE_GID_INDEX overrides)", dev.name);
        Ok(gi)
    }

    /// Every distinct usable GID of our port, read once: a transparent
    /// VQP's QPN is published under each (the application may advertise
    /// any of them).
    pub fn gids(&self) -> &[rdma::Gid] {
        self.gids.get_or_init(|| {
            let mut g = self.svc.device().usable_gids();
            // Ours first: the key the peers of a default setup look up.
            if let Ok(home) = self.svc.device().gid(self.svc.gid_index()) {
                g.retain(|x| *x != home);
                g.insert(0, home);
            }
            g
        })
    }
}

/// When an MR of real `pd` that peers can access may really be
/// deregistered: after the MR lease (`KRCORE_MR_LEASE_MS`, plus a tenth for
/// operations in flight) when the PD has a runtime with links; None when
/// it may go at once.
pub fn mr_lease_end(pd: usize) -> Option<std::time::Instant> {
    let lease = crate::config::get().mr_lease_ms;
    if lease == 0 {
        return None;
    }
    let rt = super::registry::of(pd)?;
    if !rt.svc.has_links() {
        return None;
    }
    Some(std::time::Instant::now() + mr_lease_hold(lease))
}

/// How long an MR peers may use stays registered after it left the MR
/// table: a peer trusts what it READ for the lease, counted from that
/// READ's post (before the owner's deregistration); a WQE it posts within
/// the lease reaches us within RC's retry time (or fails its link); a
/// tenth of the lease more for load.
pub fn mr_lease_hold(lease_ms: u64) -> Duration {
    Duration::from_millis(lease_ms + lease_ms / 10) + RC_RETRY_TIME
}

/// A deregistration of an MR of real `pd` (unpublished already: nothing
/// new can use it): `f` does the real one. It waits until every WQE the
/// PD's links had then completed (one of them may use the MR: a
/// deregistered key fails the link, for every VQP on it) and, when
/// `lease_end` is given, until that time too (peers may hold its rkey).
/// `f` comes back (`Err`) when it may run at once (nothing to wait for).
pub fn defer_dereg(pd: usize, lease_end: Option<Instant>, f: service::Deferred) -> std::result::Result<(), service::Deferred> {
    let rt = super::registry::of(pd);
    let Some(rt) = rt else { return Err(f) };
    let marks: Vec<(Weak<service::Link>, u64)> = rt.link_marks().iter().map(|(l, m)| (Arc::downgrade(l), *m)).collect();
    if marks.is_empty() {
        return match lease_end {
            Some(at) => {
                rt.svc.defer(at, f);
                Ok(())
            }
            None => Err(f),
        };
    }
    let mut f = Some(f);
    rt.wire.wait(
        &rt,
        Box::new(move |rt: &Runtime, force: bool| {
            if !force && !super::wire::marks_reached(rt, &marks) {
                return false;
            }
            if let Some(f) = f.take() {
                rt.svc.defer(if force { Instant::now() } else { lease_end.unwrap_or_else(Instant::now) }, f);
            }
            true
        }),
    );
    Ok(())
}

/// Whether a link of real `pd` has WQEs not yet completed (one of them
/// may use an MR about to change).
pub fn links_busy(pd: usize) -> bool {
    let rt = super::registry::of(pd);
    rt.is_some_and(|rt| !rt.link_marks().is_empty())
}

/// Run `f` at `at` on the service thread of real `pd`'s runtime (at once
/// when it has none).
pub fn defer(pd: usize, at: std::time::Instant, f: service::Deferred) {
    let rt = super::registry::of(pd);
    match rt {
        Some(rt) => rt.svc.defer(at, f),
        None => f(),
    }
}
