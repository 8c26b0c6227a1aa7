//! The service endpoint of a protection domain, its progress thread, its
//! pool of warm QPs and its links to peer processes.
//!
//! A *peer* is a service endpoint of another process: (GID, UD QPN, qkey,
//! incarnation). A *link* is an RC QP pair between two endpoints; every
//! virtual QP of this PD that talks to that peer shares it. Links are set
//! up by a two-message handshake over the UD QPs (DESIGN.md, "Link setup"):
//!
//! ```text
//! initiator                                   responder (progress thread)
//! take a warm QP (INIT)
//! LinkRequest{rc_qpn, psn, probe}    --UD-->  take a warm QP, RTR
//!                                   <--UD--   LinkReply{rc_qpn, psn, probe}
//! RTR + RTS                                   RTS (posts wait for it)
//! ```
//!
//! Nothing on this path creates a QP: QPs wait in the pool already in INIT
//! and the progress thread refills it after each use. UD is unreliable, so
//! the initiator sends its request again every `RETRANSMIT` until the reply
//! comes or its time runs out; the responder answers a repeated request
//! with the link it already made. The peer's incarnation in the reply must
//! be the one the initiator expected, or the connect is refused (a new
//! process now owns that address). Two processes asking for the same link
//! at once make one: the lower incarnation answers the other's request
//! EALREADY, and the other takes the link it accepts (`Links::crossed`).
//!
//! One progress thread per endpoint answers peers while the application
//! is busy elsewhere. It sleeps in `poll(2)` on the UD completion channel
//! and an eventfd (refill, stop), never spinning.

mod ahs;
pub mod credit;
mod gate;
mod late;
mod link;
mod link_side;

use late::Late;
pub use link::{Link, Path};
use link::{LinkKey, Links};
use link_side::LinkSide;

use crate::error::{Errno, Result};
use crate::klog;
use crate::log::Level;
use crate::meta::proto::{LinkInfo, LinkMessage, LinkReady, LinkReply, LinkRequest, LINK_LEN};
use crate::meta::Endpoint;
use crate::rdma::{self, Ah, Caps, Cq, Device, Gid, Qp, RcPeer, Region, Srq};
use crate::sys::*;
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often an unanswered link request is sent again.
const RETRANSMIT: Duration = Duration::from_millis(100);
/// How long a requester told `EALREADY` waits for the peer's link before it
/// asks again.
const CROSSED_WAIT: Duration = Duration::from_millis(400);
/// Receive buffers of the UD QP (a GRH then a link message or a datagram
/// of the connectionless tier each).
const UD_RECVS: usize = 128;
/// Link requests accepted at once, each on a thread of its own, in all
/// and from one requesting GID (a request beyond waits for its next copy,
/// 100 ms later): a host whose requests name addresses that do not
/// resolve holds up only its own.
const MAX_ACCEPTS: usize = 16;
const MAX_ACCEPTS_PER_GID: usize = 2;
/// Datagrams of the tier in flight on the UD QP (each holds a send buffer
/// until its completion is reaped).
const UD_SENDS: usize = 128;
const GRH: usize = rdma::GRH_LEN;
/// wr_id bit of a datagram's send (the rest: its send buffer).
const TX_TAG: u64 = 1 << 63;

/// See [`Service::on_link_wanted`].
pub type LinkWanted = Box<dyn Fn(&Endpoint, &Path) -> bool + Send + Sync>;

/// Sizes of the service endpoint and its links, and how its start runs.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// QPs kept in INIT for new links.
    pub warm_qps: usize,
    /// Send queue depth of a link.
    pub link_send_wr: u32,
    /// Receives of the SRQ all links share.
    pub srq_wr: u32,
    /// `KRCORE_MAX_GID_LINKS`: links the endpoints of one GID may hold.
    pub max_gid_links: usize,
    /// `KRCORE_MAX_AHS`: address handles kept.
    pub max_ahs: usize,
    /// `KRCORE_LINK_WINDOW_BYTES`: our receive window on each link.
    pub window: u32,
    /// Called between the start's steps (each milliseconds of QP commands
    /// or registrations): a start in the background may wait there.
    pub between_steps: fn(),
    /// The endpoint's incarnation, when the caller chose it (its meta-server
    /// connection, made meanwhile, names it); 0: a random one.
    pub incarnation: u64,
}

impl Default for Options {
    fn default() -> Self {
        let cfg = crate::config::get();
        Options {
            warm_qps: 4,
            link_send_wr: 256,
            srq_wr: 256,
            max_gid_links: cfg.max_gid_links,
            max_ahs: cfg.max_ahs,
            window: cfg.link_window,
            between_steps: || {},
            incarnation: 0,
        }
    }
}

/// One of our link requests awaiting its reply.
struct Awaited {
    /// The endpoint it was sent to: the only one whose reply counts.
    from: Endpoint,
    reply: Option<LinkReply>,
}

/// A link message that is malformed or does not come from the endpoint it
/// names: counted (`link_msgs_dropped`), logged at debug level only (a
/// stranger must not fill the application's stderr).
fn link_msg_dropped(what: std::fmt::Arguments<'_>) {
    crate::stats::inc(crate::stats::Stat::KRCORE_STAT_LINK_MSGS_DROPPED);
    klog!(Level::Debug, "service: dropped a link message: {what}");
}

/// Scatter entries of a link's send WRs (one for a message header, the
/// rest the application's).
pub const LINK_SEND_SGE: u32 = 4;
/// Inline bytes of a link's send WRs: a bare message header (a DONE), or
/// one with an MR check's answer, needs no registered memory.
pub const LINK_INLINE: u32 = (crate::vqp::header::HEADER_LEN + crate::vqp::mrcheck::ANSWER_LEN) as u32;

/// Our link request for a key is out while this lives (`Links::crossed`
/// reads it).
struct Asking<'a> {
    shared: &'a Shared,
    key: LinkKey,
}

impl Drop for Asking<'_> {
    fn drop(&mut self) {
        self.shared.links.lock().asking.remove(&self.key);
    }
}

/// One of our connects in progress ([`Shared::connects`]).
struct Connecting<'a>(&'a Shared);

impl<'a> Connecting<'a> {
    fn new(s: &'a Shared) -> Connecting<'a> {
        s.connects.fetch_add(1, Ordering::AcqRel);
        Connecting(s)
    }
}

impl Drop for Connecting<'_> {
    fn drop(&mut self) {
        if self.0.connects.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The refills put off meanwhile.
            self.0.kick();
        }
    }
}

/// State shared with the progress thread.
struct Shared {
    dev: Arc<Device>,
    sgid_index: u32,
    me: Endpoint,
    opts: Options,
    /// The UD QP's receives (the progress thread sleeps on its channel).
    ud_cq: Arc<Cq>,
    ud: Qp,
    ud_bufs: Region,
    /// A UD receive buffer: a GRH and a datagram of up to `mtu` bytes.
    ud_slot: usize,
    /// The largest datagram of the port (its active path MTU).
    mtu: usize,
    /// The UD QP's sends: reaped by whoever sends next (no thread wakes
    /// for them), each datagram from one of `UD_SENDS` buffers.
    tx: Mutex<Tx>,
    /// Datagrams of the connectionless tier go here (the runtime's port).
    on_datagram: Mutex<Option<DatagramHandler>>,
    /// Held by the thread that drains the UD queue: the progress thread,
    /// or an application thread that polls (`Service::poll_datagrams`).
    ud_turn: Mutex<()>,
    /// Link requests and readies an application thread took off the UD
    /// queue: the progress thread handles them (they make and move QPs).
    link_msgs: Mutex<Vec<(LinkMessage, Source)>>,
    /// Address handles to peers' GIDs (from ours), for UD sends.
    ahs: Mutex<ahs::Bounded<Path, Arc<Ah>>>,
    /// A grant is due on some link (`credit`): its VQPs let messages go.
    grants_due: Arc<AtomicBool>,
    /// Indexes of our GIDs that link requests were sent to.
    gid_indexes: Mutex<HashMap<Gid, u32>>,
    /// The links' CQs, SRQ and probe target, made with the first link (or
    /// in the background after the start): see [`Shared::link_side`].
    link_side: once_cell::sync::OnceCell<LinkSide>,
    /// `link_side` is made (and the progress thread told).
    link_side_ready: AtomicBool,
    /// Whether a peer's link may be accepted now (the runtime's receive
    /// side is ready; if not, it has it made): see `on_accepting`.
    accepting: Mutex<Option<Box<dyn Fn() -> bool + Send + Sync>>>,
    /// Whether a link with the endpoint that asks for one, on that path,
    /// is wanted (some VQP is bound, or connected to it): see
    /// `on_link_wanted`.
    wanted: Mutex<Option<LinkWanted>>,
    warm: Mutex<Vec<Qp>>,
    links: Mutex<Links>,
    /// Replies to our requests, by request id: an entry per waiter (no
    /// reply until it comes), so that a late or repeated reply (to a
    /// retransmission) is dropped, not kept; with the endpoint the request
    /// went to (a reply from anywhere else is dropped).
    replies: Mutex<HashMap<u32, Awaited>>,
    reply_ready: Condvar,
    /// Requests whose handshake gave up, by request id (locked after
    /// `replies` when both are).
    late: Mutex<HashMap<u32, Late>>,
    /// Signalled (under `links`) when an accepted link becomes ready, is
    /// in `by_key`, or its accepting ends.
    link_ready: Condvar,
    /// Link requests being accepted on threads of their own, and those
    /// threads (joined before the endpoint goes: they hold its QPs).
    accepts: AtomicUsize,
    accept_threads: Mutex<Vec<JoinHandle<()>>>,
    /// Ourselves, for those threads.
    this: once_cell::sync::OnceCell<Weak<Shared>>,
    next_req: AtomicU32,
    /// Cold connects one at a time per link key (a second connect to the
    /// same key waits and takes the link the first made); connects to
    /// different peers run side by side.
    connecting: gate::Gate<LinkKey>,
    /// Our connects waiting for a reply or finishing their RTR and RTS:
    /// the progress thread refills the warm pool only when there are none
    /// (a refill is milliseconds of kernel work, which would stand between
    /// a connect and its reply), and is kicked when the last one ends.
    connects: AtomicU32,
    /// Whether the warm pool is filled. With the datagram tier, not before
    /// this process makes or accepts its first link: a QP creation is
    /// milliseconds of kernel work that would stand in the tier's way
    /// (rxe posts through the same kernel device) in a process that may
    /// never need a link.
    pool_wanted: AtomicBool,
    /// Wakes the progress thread (refill, stop).
    event_fd: libc::c_int,
    /// Called by the progress thread when the links have completions;
    /// returns whether to keep waking on them.
    on_link_event: Mutex<Option<Box<dyn Fn() -> bool + Send + Sync>>>,
    /// Called by the progress thread when messages arrived; says whether
    /// the application made progress itself since the last call.
    on_link_recv: Mutex<Option<Box<dyn Fn() -> bool + Send + Sync>>>,
    /// Called when a link was made (by either side).
    on_new_link: Mutex<Option<Box<dyn Fn() + Send + Sync>>>,
    /// While the application polls by itself the receive CQ is not armed
    /// (an event per message would wake this thread at every message):
    /// it is looked at again at this time, then less and less often.
    recv_recheck: Mutex<Option<(Instant, Duration)>>,
    /// Work due at a time (delayed deregistrations), run by the progress
    /// thread, or at once when the service stops.
    deferred: Mutex<Vec<(Instant, Deferred)>>,
    stop: AtomicBool,
}

/// Work for the progress thread.
pub type Deferred = Box<dyn FnOnce() + Send>;

/// What takes the connectionless tier's datagrams: (bytes, their source).
pub type DatagramHandler = Box<dyn Fn(&[u8], &Source) + Send + Sync>;

pub use crate::transport::dgram::port::Source;

/// The UD QP's send side.
struct Tx {
    cq: Arc<Cq>,
    bufs: Region,
    free: Vec<u32>,
}

impl Tx {
    /// Take the completed sends' buffers back (and see failed sends).
    fn reap(&mut self) {
        // SAFETY: plain C data.
        let mut wcs: [ibv_wc; 16] = unsafe { std::mem::zeroed() };
        loop {
            let n = match self.cq.poll(&mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    klog!(Level::Warn, "service: polling the UD send CQ: {e:?}");
                    return;
                }
            };
            for wc in &wcs[..n] {
                if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
                    klog!(Level::Warn, "service: a UD send failed (status {})", wc.status);
                }
                if wc.wr_id & TX_TAG != 0 {
                    self.free.push((wc.wr_id & !TX_TAG) as u32);
                }
            }
            if n < wcs.len() {
                return;
            }
        }
    }
}

/// The path MTU of `dev`'s port in bytes, within what the tier takes.
fn port_mtu(dev: &Device) -> usize {
    use crate::transport::dgram::wire::{MAX_MTU, MIN_MTU};
    (128usize << dev.port_attr.active_mtu.clamp(1, 5)).clamp(MIN_MTU, MAX_MTU)
}

/// A PD's service endpoint: what peers address, and what makes links.
pub struct Service {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Service {
    /// Start the endpoint on `dev` from our GID at `sgid_index`.
    pub fn start(dev: &Arc<Device>, sgid_index: u32, opts: Options) -> Result<Service> {
        let gid = dev.gid(sgid_index)?;
        let ud_cq = Arc::new(Cq::new(dev, UD_RECVS as u32)?);
        let tx_cq = Arc::new(Cq::new(dev, (UD_SENDS + UD_RECVS) as u32)?);
        let caps = Caps { send_wr: UD_SENDS as u32, recv_wr: UD_RECVS as u32, send_sge: 1, recv_sge: 1, inline: LINK_LEN as u32 };
        let ud = Qp::new(dev, ibv_qp_type::IBV_QPT_UD, &tx_cq, &ud_cq, caps)?;
        if (ud.caps.inline as usize) < LINK_LEN {
            return Err(Errno::EOPNOTSUPP);
        }
        ud.ud_ready()?;
        crate::kmark!("service: UD CQ and QP (RTS) made");
        (opts.between_steps)();
        let mtu = port_mtu(dev);
        let ud_slot = GRH + mtu.max(LINK_LEN);
        let ud_bufs = Region::new(dev, UD_RECVS * ud_slot, rdma::LOCAL_WRITE)?;
        let tx = Tx { cq: tx_cq, bufs: Region::new(dev, UD_SENDS * mtu, rdma::LOCAL_WRITE)?, free: (0..UD_SENDS as u32).collect() };
        crate::kmark!("service: UD buffers registered");
        (opts.between_steps)();
        let incarnation = if opts.incarnation != 0 { opts.incarnation } else { rdma::random_u64() };
        // SAFETY: plain syscall.
        let event_fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if event_fd < 0 {
            return Err(Errno::last());
        }
        let me = Endpoint { gid, qpn: ud.qpn(), qkey: rdma::QKEY, incarnation, vqpn: 0 };
        let shared = Arc::new(Shared {
            dev: Arc::clone(dev),
            sgid_index,
            me,
            opts,
            ud_cq,
            ud,
            ud_bufs,
            ud_slot,
            mtu,
            tx: Mutex::new(tx),
            on_datagram: Mutex::new(None),
            ud_turn: Mutex::new(()),
            link_msgs: Mutex::new(Vec::new()),
            late: Mutex::new(HashMap::new()),
            ahs: Mutex::new(ahs::Bounded::new(opts.max_ahs)),
            grants_due: Arc::default(),
            gid_indexes: Mutex::new(HashMap::new()),
            link_side: once_cell::sync::OnceCell::new(),
            link_side_ready: AtomicBool::new(false),
            accepting: Mutex::new(None),
            wanted: Mutex::new(None),
            warm: Mutex::new(Vec::new()),
            links: Mutex::new(Links::default()),
            replies: Mutex::new(HashMap::new()),
            reply_ready: Condvar::new(),
            link_ready: Condvar::new(),
            next_req: AtomicU32::new(1),
            connecting: gate::Gate::new(),
            connects: AtomicU32::new(0),
            pool_wanted: AtomicBool::new(!crate::config::get().dgram),
            event_fd,
            on_link_event: Mutex::new(None),
            on_link_recv: Mutex::new(None),
            on_new_link: Mutex::new(None),
            recv_recheck: Mutex::new(None),
            deferred: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            accepts: AtomicUsize::new(0),
            accept_threads: Mutex::new(Vec::new()),
            this: once_cell::sync::OnceCell::new(),
        });
        let _ = shared.this.set(Arc::downgrade(&shared));
        for slot in 0..UD_RECVS {
            shared.post_ud_recv(slot)?;
        }
        let s2 = Arc::clone(&shared);
        let thread =
            std::thread::Builder::new().name("krcore-service".into()).spawn(move || s2.progress()).map_err(|_| Errno(libc::EAGAIN))?;
        // The warm pool fills on the progress thread, not in front of the
        // first connect (which makes its own QP if it comes first).
        shared.kick();
        klog!(Level::Info, "service endpoint: UD QP {} on GID index {sgid_index}", me.qpn);
        Ok(Service { shared, thread: Some(thread) })
    }

    /// What peers address to reach this endpoint.
    pub fn endpoint(&self) -> Endpoint {
        self.shared.me
    }

    /// The largest datagram of the UD QP (the port's active MTU).
    pub fn mtu(&self) -> usize {
        self.shared.mtu
    }

    /// Hand the connectionless tier's datagrams to `f` (on the progress
    /// thread).
    pub fn on_datagram(&self, f: DatagramHandler) {
        *self.shared.on_datagram.lock() = Some(f);
    }

    /// Drain the UD queue on the caller's thread, unless another thread is
    /// doing it: an application that polls for the tier's answers need not
    /// wait for the progress thread to wake (two wake-ups per round trip
    /// under emulation cost more than the round trip). Link requests found
    /// meanwhile go to the progress thread.
    pub fn poll_datagrams(&self) {
        if let Some(_turn) = self.shared.ud_turn.try_lock() {
            // What is left (a queue's worth taken) is the progress thread's
            // or the next poll's.
            self.shared.drain_ud(false);
        }
    }

    /// Send one datagram of the connectionless tier (at most `mtu()`
    /// bytes) to UD QP `qpn` over `path`. Best effort, as UD: with every
    /// send buffer in flight it is dropped (EAGAIN; the tier retransmits).
    pub fn send_datagram(&self, path: Path, qpn: u32, qkey: u32, bytes: &[u8]) -> Result<()> {
        self.shared.send_datagram(path, qpn, qkey, bytes)
    }

    /// Whether a grant may be due on some link, clearing the flag (the
    /// caller looks at every link).
    pub fn take_grants_due(&self) -> bool {
        self.shared.grants_due.swap(false, Ordering::AcqRel)
    }

    /// Address handles kept (`KRCORE_MAX_AHS` at most).
    pub fn address_handles(&self) -> usize {
        self.shared.ahs.lock().len()
    }

    /// Make `path`'s address handle now, so that a later send on it (an
    /// ACK that must go out before what it acknowledges is seen) does not
    /// wait for its creation.
    pub fn prepare_path(&self, path: Path) -> Result<()> {
        self.shared.ah(path).map(drop)
    }

    /// Make `path`'s address handle on the progress thread, unless made:
    /// a connect that knows its peer's GID before the lookup that names
    /// the peer does not create it on its own path afterwards
    /// (`ibv_create_ah` is a kernel call that resolves the address).
    pub fn prepare_path_soon(&self, path: Path) {
        if self.shared.ahs.lock().contains(&path) {
            return;
        }
        let shared = Arc::clone(&self.shared);
        self.defer(
            Instant::now(),
            Box::new(move || {
                if let Err(e) = shared.ah(path) {
                    klog!(Level::Debug, "service: an address handle made ahead: {e:?}");
                }
            }),
        );
    }

    /// The index of our GID `gid`.
    pub fn gid_index_of(&self, gid: &Gid) -> Result<u32> {
        self.shared.our_gid_index(gid)
    }

    /// Link number `index` to `peer`: the existing one (no communication at
    /// all), or a new one made with the UD handshake. ECONNREFUSED when a
    /// different process (incarnation) answers, ETIMEDOUT when none does
    /// within `timeout`.
    pub fn link(&self, peer: &Endpoint, index: u16, path: Path, timeout: Duration) -> Result<Arc<Link>> {
        self.link_as(peer, index, path, timeout, false)
    }

    /// [`Self::link`] for VQPs that can stay on the datagram tier without
    /// it: a peer at its `KRCORE_MAX_LINKS` refuses it (ECONNREFUSED)
    /// rather than close a link in use.
    pub fn optional_link(&self, peer: &Endpoint, index: u16, path: Path, timeout: Duration) -> Result<Arc<Link>> {
        self.link_as(peer, index, path, timeout, true)
    }

    fn link_as(&self, peer: &Endpoint, index: u16, path: Path, timeout: Duration, optional: bool) -> Result<Arc<Link>> {
        let key = LinkKey::of(peer, index, path);
        let found = self.shared.links.lock().by_key.get(&key).cloned();
        if let Some(l) = found {
            return Ok(self.shared.when_ready(l));
        }
        crate::kmark!("link: connecting");
        // A connect that waited for another to the same key is bounded by
        // `timeout` twice at most (the wait, then its own handshake).
        let _one = self.shared.connecting.enter(key, timeout)?;
        crate::kmark!("link: the connecting lock taken");
        // The peer's request for this key may be being accepted now: that
        // link serves (a request of ours would make a second).
        let deadline = Instant::now() + timeout;
        let link = loop {
            match self.shared.link_or_ask(&key, deadline) {
                Ok(l) => break l,
                Err(asking) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match self.shared.connect(peer, index, path, left, optional, asking)? {
                        Some(l) => break l,
                        // Crossed, and the peer's link did not come: asked again.
                        None if Instant::now() < deadline => crate::kmark!("link: asking again after a crossing"),
                        None => return Err(Errno(libc::ETIMEDOUT)),
                    }
                }
            }
        };
        Ok(self.shared.when_ready(link))
    }

    /// The path of a link to `peer` when the application names no GIDs:
    /// from our home GID to the peer endpoint's.
    pub fn default_path(&self, peer: &Endpoint) -> Path {
        self.shared.home_path(peer.gid)
    }

    /// The link that serves link number `index` of process `incarnation`
    /// over `path` now, whichever side made it (a datagram names its
    /// sender's process, not its home GID), once ready (an accepted one:
    /// confirmed, or after `READY_WAIT_MS`; taking only confirmed ones,
    /// tried at stop 41, stalled bursts of 64 new processes for minutes).
    pub fn link_to(&self, incarnation: u64, index: u16, path: Path) -> Option<Arc<Link>> {
        let links = self.shared.links.lock();
        links.by_key.values().find(|l| l.peer.incarnation == incarnation && l.index == index && l.path == path && l.is_ready()).cloned()
    }

    /// Something came from the peer on `link`: its end receives.
    pub fn heard_on(&self, link: &Link) {
        if !link.ready.load(Ordering::Acquire) {
            self.shared.mark_ready(link);
        }
    }

    /// Links currently up (made by either side).
    pub fn links(&self) -> usize {
        self.shared.links.lock().by_key.len()
    }

    /// QPs waiting in the pool.
    pub fn warm_qps(&self) -> usize {
        self.shared.warm.lock().len()
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.shared.dev
    }

    /// The completion queues of every link's sends and receives; None
    /// before the first link (nothing completes on them).
    pub fn link_cqs(&self) -> Option<(&Arc<Cq>, &Arc<Cq>)> {
        self.shared.link_side.get().map(|s| (&s.link_cq, &s.recv_cq))
    }

    /// Accept a peer's link only when `f` says so (the progress thread
    /// never makes the links' side itself); the link side must be made too.
    pub fn on_accepting(&self, f: Box<dyn Fn() -> bool + Send + Sync>) {
        *self.shared.accepting.lock() = Some(f);
    }

    /// A link request is answered only if `f(sender, path)` says a link
    /// with its sender is wanted; otherwise it is dropped, as an RC QP
    /// ignores a QP it is not connected to (the sender's retransmissions
    /// find it wanted once a VQP of ours connects to it). Without `f`
    /// (a service without a runtime) every link is wanted.
    pub fn on_link_wanted(&self, f: LinkWanted) {
        *self.shared.wanted.lock() = Some(f);
    }

    /// Run `f` on the progress thread when messages arrived while the
    /// application was not polling; `f` says whether it polled since.
    pub fn on_link_recv(&self, f: Box<dyn Fn() -> bool + Send + Sync>) {
        *self.shared.on_link_recv.lock() = Some(f);
    }

    /// The receive queue every link takes its receives from.
    pub fn srq(&self) -> Result<&Arc<Srq>> {
        Ok(&self.shared.link_side()?.srq)
    }

    /// Run `f` on the progress thread when the links' CQ has completions
    /// while events are wanted (an application asleep on a completion
    /// channel waits for what they carry); `f` says whether they still are.
    pub fn on_link_event(&self, f: Box<dyn Fn() -> bool + Send + Sync>) {
        *self.shared.on_link_event.lock() = Some(f);
    }

    /// Run `f` on the progress thread at `at` (or when the service stops,
    /// whichever comes first).
    pub fn defer(&self, at: Instant, f: Deferred) {
        self.shared.deferred.lock().push((at, f));
        self.shared.kick();
    }

    /// Run every deferred work now (before the PD they hold goes).
    pub fn run_deferred_now(&self) {
        let due: Vec<(Instant, Deferred)> = std::mem::take(&mut *self.shared.deferred.lock());
        for (_, f) in due {
            f();
        }
    }

    /// Wake the progress thread at the next link completion (one event;
    /// the handler decides whether to go on).
    pub fn want_link_events(&self) -> Result<()> {
        // No link side yet: it is armed when made.
        self.shared.link_side.get().map_or(Ok(()), |s| s.link_cq.arm())
    }

    /// Wake the progress thread at the next message: an application that
    /// armed a CQ which receives waits for its event, and must not wait
    /// for the thread's next look (up to 64 ms while it seemed to poll).
    pub fn want_message_events(&self) -> Result<()> {
        self.shared.link_side.get().map_or(Ok(()), |s| s.recv_cq.arm())
    }

    /// Whether any peer has a link to us (and so may hold our MRs' keys).
    pub fn has_links(&self) -> bool {
        !self.shared.links.lock().by_qpn.is_empty()
    }

    /// The link whose QP has number `qpn`.
    pub fn link_by_qpn(&self, qpn: u32) -> Option<Arc<Link>> {
        self.shared.links.lock().by_qpn.get(&qpn).cloned()
    }

    /// The link with QP `qpn` had an error completion: RC moved its QP to
    /// the error state, for good. It is handed out no more (a connect to
    /// that peer makes a new link) and its QP is moved to ERR, which
    /// flushes every WQE still on it. The link, the first time only.
    pub fn fail_link(&self, qpn: u32) -> Option<Arc<Link>> {
        let link = {
            let mut links = self.shared.links.lock();
            let link = links.by_qpn.get(&qpn).cloned()?;
            if link.failed.swap(true, Ordering::AcqRel) {
                return None;
            }
            links.retire(&link);
            link
        };
        crate::stats::inc(crate::stats::Stat::KRCORE_STAT_LINKS_FAILED);
        if let Err(e) = link.qp.to_error() {
            klog!(Level::Debug, "service: moving a failed link's QP to ERR: {e:?}");
        }
        Some(link)
    }

    /// Forget a failed link whose flushed WQEs were all seen, or a closed
    /// one: its QP is destroyed when the last holder lets it go. Whether
    /// it was known.
    pub fn forget_link(&self, qpn: u32) -> bool {
        let mut links = self.shared.links.lock();
        let Some(link) = links.by_qpn.remove(&qpn) else { return false };
        links.retire(&link);
        link.ungauge();
        true
    }

    /// Physical QPs of links held (open, closing or failed).
    pub fn physical_links(&self) -> usize {
        self.shared.links.lock().by_qpn.len()
    }

    /// Every link held (open, closing or failed).
    pub fn all_links(&self) -> Vec<Arc<Link>> {
        self.shared.links.lock().by_qpn.values().cloned().collect()
    }

    /// Every open link (what the liveness probes look at).
    pub fn live_links(&self) -> Vec<Arc<Link>> {
        self.shared.links.lock().by_qpn.values().filter(|l| l.is_open()).cloned().collect()
    }

    /// Run `f` when a link was made (by either side).
    pub fn on_new_link(&self, f: Box<dyn Fn() + Send + Sync>) {
        *self.shared.on_new_link.lock() = Some(f);
    }

    /// The links to close now: the duplicates of simultaneous connects,
    /// then, while more than `max` physical QPs are held (0: no limit),
    /// the least recently used open links this process posted nothing on
    /// for `idle_ms` (as seen at maintenance ticks: a post is dated by the
    /// first tick after it) and whose peer sent nothing on since the last
    /// look but its probes (`Link::peer_used`).
    pub fn links_to_close(&self, max: usize, idle_ms: u64) -> Vec<Arc<Link>> {
        let now = crate::clock::coarse_ms();
        let (mut out, held, idle) = {
            let links = self.shared.links.lock();
            for l in links.by_qpn.values() {
                if l.used.swap(false, Ordering::Relaxed) {
                    l.last_used.store(now, Ordering::Relaxed);
                }
            }
            let out: Vec<Arc<Link>> = links.duplicates().cloned().collect();
            let held = links.by_qpn.values().filter(|l| l.is_open()).count() - out.len();
            let idle: Vec<Arc<Link>> = if max > 0 && held > max {
                let idle_by_us = |l: &&Arc<Link>| l.is_open() && now.saturating_sub(l.last_used.load(Ordering::Relaxed)) >= idle_ms;
                links.by_key.values().filter(idle_by_us).cloned().collect()
            } else {
                Vec::new()
            };
            (out, held, idle)
        };
        // Idle by our posts, but maybe not by the peer's (its READs): asked
        // outside the lock (a kernel call each).
        let mut idle: Vec<(u64, Arc<Link>)> =
            idle.into_iter().filter(|l| !l.peer_used(now)).map(|l| (l.last_used.load(Ordering::Relaxed), l)).collect();
        idle.sort_by_key(|(used, _)| *used);
        out.extend(idle.into_iter().take(held.saturating_sub(max)).map(|(_, l)| l));
        out
    }

    /// Start closing `link`: handed out no more (a connect to its peer
    /// makes a new link). False when it is closing or failed already.
    pub fn begin_close(&self, link: &Arc<Link>) -> bool {
        let mut links = self.shared.links.lock();
        if !link.is_open() || !links.by_qpn.contains_key(&link.qp.qpn()) {
            return false;
        }
        link.close_started.store(crate::clock::coarse_ms(), Ordering::Relaxed);
        link.closing.store(true, Ordering::Release);
        links.retire(link);
        true
    }

    /// Links being closed and not failed.
    pub fn closing_links(&self) -> Vec<Arc<Link>> {
        self.shared.links.lock().by_qpn.values().filter(|l| l.is_closing() && !l.is_failed()).cloned().collect()
    }

    pub fn gid_index(&self) -> u32 {
        self.shared.sgid_index
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.kick();
        if let Some(t) = self.thread.take() {
            // The last holder may be the progress thread itself (a handler
            // or deferred work that upgraded its weak reference): it cannot
            // join itself; it sees `stop` once that work returns, and ends.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
        // Accepts under way hold the endpoint (and QPs on the PD, which
        // the application may deallocate next): they finish first. One of
        // them may be dropping us (its new link's callback held the last
        // reference): it cannot join itself.
        let accepts = std::mem::take(&mut *self.shared.accept_threads.lock());
        for t in accepts {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
        self.run_deferred_now();
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: our eventfd, closed once.
        unsafe { libc::close(self.event_fd) };
    }
}

impl Shared {
    /// The links' CQs, SRQ and probe target, made at the first call.
    fn link_side(&self) -> Result<&LinkSide> {
        let side = self.link_side.get_or_try_init(|| LinkSide::new(&self.dev, self.opts.srq_wr))?;
        if !self.link_side_ready.swap(true, Ordering::AcqRel) {
            // The progress thread sleeps on the new channels from its next pass.
            self.kick();
        }
        Ok(side)
    }

    fn info(&self, rc_qpn: u32, psn: u32, index: u16, src_gid: Gid, dst_gid: Gid) -> LinkInfo {
        // Made with the link's QP (a refusal carries none).
        let (addr, rkey) = self.link_side.get().map_or((0, 0), LinkSide::probe);
        LinkInfo { from: self.me, rc_qpn, psn, probe_addr: addr, probe_rkey: rkey, window: self.opts.window, link: index, src_gid, dst_gid }
    }

    /// A new link's flow control: the peer's window (what we may send)
    /// and ours. EPROTO when the peer's is too small for two messages (it
    /// could stall us for good).
    fn credit(&self, theirs: &LinkInfo) -> Result<credit::LinkCredit> {
        if theirs.window < credit::MIN_WINDOW {
            return Err(Errno(libc::EPROTO));
        }
        Ok(credit::LinkCredit::new(theirs.window, self.opts.window, Arc::clone(&self.grants_due)))
    }

    /// The index of our GID `gid` (where a link request was sent to).
    fn our_gid_index(&self, gid: &Gid) -> Result<u32> {
        if let Some(&i) = self.gid_indexes.lock().get(gid) {
            return Ok(i);
        }
        let i = self.dev.gid_index(gid)?;
        self.gid_indexes.lock().insert(*gid, i);
        Ok(i)
    }

    /// A QP in INIT from the pool (or a new one when the pool ran dry).
    fn take_warm(&self) -> Result<Qp> {
        self.pool_wanted.store(true, Ordering::Release);
        let qp = self.warm.lock().pop();
        self.kick();
        match qp {
            Some(qp) => Ok(qp),
            None => {
                klog!(Level::Info, "service: the warm QP pool is empty: creating a QP on the connect path");
                self.new_link_qp()
            }
        }
    }

    fn new_link_qp(&self) -> Result<Qp> {
        let caps = Caps { send_wr: self.opts.link_send_wr, recv_wr: 0, send_sge: LINK_SEND_SGE, recv_sge: 1, inline: LINK_INLINE };
        let side = self.link_side()?;
        let qp = Qp::with_srq(&self.dev, ibv_qp_type::IBV_QPT_RC, &side.link_cq, &side.recv_cq, Some(&side.srq), caps)?;
        qp.to_init()?;
        Ok(qp)
    }

    /// One QP into the warm pool if it is short; whether it is still short.
    /// One at a time, so that link requests arriving meanwhile are answered
    /// between two creations (each costs milliseconds in the kernel).
    fn refill_one(&self) -> bool {
        if self.connects.load(Ordering::Acquire) > 0
            || !self.link_side_ready.load(Ordering::Acquire)
            || !self.pool_wanted.load(Ordering::Acquire)
            || self.warm.lock().len() >= self.opts.warm_qps
        {
            return false;
        }
        crate::kmark!("warm pool: refill (create + INIT)");
        let made = self.new_link_qp();
        crate::kmark!("warm pool: refilled");
        match made {
            Ok(qp) => {
                let mut w = self.warm.lock();
                w.push(qp);
                w.len() < self.opts.warm_qps
            }
            Err(e) => {
                klog!(Level::Warn, "service: cannot refill the warm QP pool: {e:?}");
                false
            }
        }
    }

    /// Wake the progress thread.
    fn kick(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes to our eventfd.
        unsafe { libc::write(self.event_fd, (&one as *const u64).cast(), 8) };
    }

    /// Send request `req_id` (`msg`) every RETRANSMIT until its reply comes
    /// or `deadline` passes (ETIMEDOUT).
    fn await_reply(&self, peer: &Endpoint, req_id: u32, msg: &[u8; LINK_LEN], deadline: Instant) -> Result<LinkReply> {
        loop {
            self.send_ud(self.home_path(peer.gid), peer.qpn, peer.qkey, msg)?;
            crate::kmark!("link: request {req_id} sent");
            let until = (Instant::now() + RETRANSMIT).min(deadline);
            let mut replies = self.replies.lock();
            loop {
                if let Some(r) = replies.get_mut(&req_id).and_then(|a| a.reply.take()) {
                    crate::kmark!("link: reply {req_id} taken by its waiter");
                    return Ok(r);
                }
                if Instant::now() >= until {
                    break;
                }
                self.reply_ready.wait_until(&mut replies, until);
            }
            drop(replies);
            if Instant::now() >= deadline {
                return Err(Errno(libc::ETIMEDOUT));
            }
        }
    }

    /// The link that serves `key` (waited for while the peer's request for
    /// it is being accepted), or, with none, our request marked out for
    /// it, in the same hold of the lock: a peer's request that comes after
    /// is a crossing one (`Links::crossed`), never a second link accepted
    /// while ours is about to leave.
    fn link_or_ask(&self, key: &LinkKey, deadline: Instant) -> std::result::Result<Arc<Link>, Asking<'_>> {
        let mut links = self.links.lock();
        while !links.by_key.contains_key(key) && links.accepting.contains(key) && Instant::now() < deadline {
            self.link_ready.wait_until(&mut links, deadline);
        }
        match links.by_key.get(key) {
            Some(l) => Ok(Arc::clone(l)),
            None => {
                links.asking.insert(*key);
                Err(Asking { shared: self, key: *key })
            }
        }
    }

    /// Our request for the link `key` (out: `asking`), and its handshake.
    /// None: the peer said its own link serves the key (`EALREADY`) and
    /// none came within [`CROSSED_WAIT`]: the caller asks again.
    fn connect(
        &self,
        peer: &Endpoint,
        index: u16,
        path: Path,
        timeout: Duration,
        optional: bool,
        asking: Asking<'_>,
    ) -> Result<Option<Arc<Link>>> {
        let _refill_later = Connecting::new(self);
        let deadline = Instant::now() + timeout;
        let src_gid = self.dev.gid(path.sgid_index).map_err(|_| Errno::EINVAL)?;
        let qp = self.take_warm()?;
        crate::kmark!("link: warm QP taken");
        let psn = rdma::random_psn();
        let req_id = self.next_req.fetch_add(1, Ordering::Relaxed);
        let req = LinkRequest { req_id, info: self.info(qp.qpn(), psn, index, src_gid, path.dgid), optional };
        let mut msg = [0u8; LINK_LEN];
        req.encode(&mut msg);
        let key = asking.key;
        self.replies.lock().insert(req_id, Awaited { from: *peer, reply: None });
        let reply = match self.await_reply(peer, req_id, &msg, deadline) {
            Err(e) if e.0 == libc::ETIMEDOUT => {
                // In the same hold of `replies` as the waiter goes: a reply
                // that comes after finds the request parked.
                let mut replies = self.replies.lock();
                match replies.remove(&req_id).and_then(|a| a.reply) {
                    Some(r) => r,
                    None => {
                        self.park_late(req_id, Late::new(*peer, index, path, qp, psn, req.info));
                        return Err(e);
                    }
                }
            }
            r => {
                self.replies.lock().remove(&req_id);
                r?
            }
        };
        if reply.status == libc::EALREADY as u32 {
            // The peer has the lower incarnation and a request or a new
            // link of its own for this key: its request makes the link,
            // here. Unless the link it means is one we are closing (a
            // peer over KRCORE_MAX_LINKS reclaims links seconds old, and
            // the peer may see our request before our LINK_CLOSE): then
            // none comes, and asking again finds the key free there.
            self.warm.lock().push(qp);
            crate::kmark!("link: crossed the peer's request: waiting for its link");
            return Ok(self.link_when(&key, (Instant::now() + CROSSED_WAIT).min(deadline), |_| true));
        }
        if reply.status != 0 {
            return Err(Errno(reply.status as i32));
        }
        let theirs = reply.info;
        if theirs.from.incarnation != peer.incarnation || theirs.from.gid != peer.gid || theirs.src_gid != path.dgid {
            return Err(Errno(libc::ECONNREFUSED));
        }
        let link = Arc::new(Link::new(qp, *peer, index, path, &theirs, true, psn, self.credit(&theirs)?)?);
        self.establish(key, link, &theirs, req_id, req.info).map(Some)
    }

    /// Bring up `link`, ours by request `req_id` (`ours`), to the peer's
    /// end `theirs`, and tell the peer (LINK_READY): the link that serves
    /// `key` now. Known by its QP number before RTR, where it starts
    /// receiving: the peer may send at once (a message, its LINK_CLOSE of a
    /// duplicate), and a completion of a QP not in the table is dropped.
    /// Until RTS the link's send lock is held (nothing posts on a QP that
    /// cannot send yet). A link the peer asked for meanwhile may serve this
    /// key instead: ours is kept until closed (the peer may send on its
    /// other end), and the caller uses the one that serves.
    fn establish(&self, key: LinkKey, link: Arc<Link>, theirs: &LinkInfo, req_id: u32, ours: LinkInfo) -> Result<Arc<Link>> {
        let (peer, path, psn) = (link.peer, link.path, link.psn);
        let serving = {
            let _sends_wait = link.sq.lock();
            let serving = self.links.lock().insert(key, Arc::clone(&link), &self.me);
            if let Err(e) = link.qp.rc_connect(path.sgid_index, psn, &RcPeer { gid: path.dgid, qpn: theirs.rc_qpn, psn: theirs.psn }) {
                link.failed.store(true, Ordering::Release);
                let mut links = self.links.lock();
                links.retire(&link);
                links.by_qpn.remove(&link.qp.qpn());
                return Err(e);
            }
            serving
        };
        crate::kmark!("link: RTR + RTS");
        // The peer uses its end once it knows ours receives (a loss costs
        // it READY_WAIT_MS at most: see `Link::ready`).
        let mut ready = [0u8; LINK_LEN];
        LinkReady { req_id, info: ours }.encode(&mut ready);
        if let Err(e) = self.send_ud(self.home_path(peer.gid), peer.qpn, peer.qkey, &ready) {
            klog!(Level::Debug, "service: LINK_READY not sent: {e:?}");
        }
        self.new_link_made(&link);
        Ok(serving)
    }

    /// The link that serves `key`, waited for until `deadline` while
    /// `pending` says one may still come (a peer's request for it being
    /// accepted here).
    fn link_when(&self, key: &LinkKey, deadline: Instant, pending: impl Fn(&Links) -> bool) -> Option<Arc<Link>> {
        let mut links = self.links.lock();
        while !links.by_key.contains_key(key) && pending(&links) && Instant::now() < deadline {
            self.link_ready.wait_until(&mut links, deadline);
        }
        links.by_key.get(key).cloned()
    }

    /// `link` once ready to be handed out: an accepted link whose
    /// requester has not said its end receives is waited for, at most
    /// until its `ready_after_ms`.
    fn when_ready(&self, link: Arc<Link>) -> Arc<Link> {
        if link.is_ready() {
            return link;
        }
        crate::kmark!("link: waiting for the peer's end");
        let until = Instant::now() + Duration::from_millis(link.ready_after_ms.saturating_sub(crate::clock::coarse_ms()));
        let mut links = self.links.lock();
        while !link.is_ready() && Instant::now() < until {
            self.link_ready.wait_until(&mut links, until);
        }
        crate::kmark!("link: the peer's end ready");
        drop(links);
        link
    }

    fn mark_ready(&self, link: &Link) {
        let _links = self.links.lock();
        link.ready.store(true, Ordering::Release);
        self.link_ready.notify_all();
    }

    /// The requester of one of our accepted links says its end receives.
    fn on_ready(&self, r: &LinkReady) {
        let id = (r.info.from.incarnation, r.info.rc_qpn, r.info.psn);
        let link = self.links.lock().accepted.get(&id).cloned();
        match link {
            Some(l) => self.mark_ready(&l),
            None => klog!(Level::Debug, "service: LINK_READY for no link of ours (QP {})", r.info.rc_qpn),
        }
    }

    /// A link was made: the owner of the links may have some to close.
    /// Logged with the path the device holds for it.
    fn new_link_made(&self, link: &Link) {
        if crate::log::enabled(Level::Info) {
            match link.qp.path() {
                Ok((sgid_index, dgid)) => klog!(
                    Level::Info,
                    "service: link QP {} to {:?} QP {}: GID index {sgid_index} -> {}",
                    link.qp.qpn(),
                    std::net::Ipv6Addr::from(link.peer.gid),
                    link.peer.qpn,
                    std::net::Ipv6Addr::from(dgid)
                ),
                Err(e) => klog!(Level::Info, "service: link QP {}: ibv_query_qp: {e:?}", link.qp.qpn()),
            }
        }
        if let Some(f) = self.on_new_link.lock().as_ref() {
            f();
        }
    }

    /// From our home GID to `gid`: where link messages go (the peer checks
    /// that they come from the home GID of the endpoint they name).
    fn home_path(&self, gid: Gid) -> Path {
        Path { sgid_index: self.sgid_index, dgid: gid }
    }

    /// The address handle of `path` (made once, kept while in use within
    /// the bound of [`ahs`]). EAGAIN when the bound leaves no room.
    fn ah(&self, path: Path) -> Result<Arc<Ah>> {
        let now = crate::clock::coarse_ms();
        let mut ahs = self.ahs.lock();
        if let Some(ah) = ahs.get(&path, now) {
            return Ok(ah);
        }
        if !ahs.make_room(now, |ah| Arc::strong_count(ah) == 1) {
            crate::stats::inc(crate::stats::Stat::KRCORE_STAT_AHS_REFUSED);
            klog!(Level::Debug, "service: KRCORE_MAX_AHS address handles, each used within a second: none made for {:02x?}", path.dgid);
            return Err(Errno(libc::EAGAIN));
        }
        let mut attr = self.ud.ah_attr(path.sgid_index, &path.dgid);
        let ah = Arc::new(Ah::new(&self.dev, &mut attr)?);
        crate::kmark!("UD: address handle made");
        ahs.insert(path, Arc::clone(&ah), now);
        Ok(ah)
    }

    /// One link message to a peer's UD QP (inline: `msg` may go at once).
    fn send_ud(&self, path: Path, qpn: u32, qkey: u32, msg: &[u8; LINK_LEN]) -> Result<()> {
        let ah = self.ah(path)?;
        let mut sge = ibv_sge { addr: msg.as_ptr() as u64, length: LINK_LEN as u32, lkey: 0 };
        let mut tx = self.tx.lock();
        tx.reap();
        // SAFETY: inline data is copied at post time; the AH outlives the
        // send (cached, and kept a second after each use: `ahs`).
        unsafe { self.post_ud(&ah, qpn, qkey, &mut sge, ibv_send_flags::IBV_SEND_INLINE.0, 0) }
    }

    fn send_datagram(&self, path: Path, qpn: u32, qkey: u32, bytes: &[u8]) -> Result<()> {
        if bytes.len() > self.mtu {
            return Err(Errno::EINVAL);
        }
        let ah = self.ah(path)?;
        let mut tx = self.tx.lock();
        if tx.free.is_empty() {
            tx.reap();
        }
        let Some(slot) = tx.free.pop() else { return Err(Errno(libc::EAGAIN)) };
        let off = slot as usize * self.mtu;
        // SAFETY: a free send buffer (its last send completed), ours until
        // this send's completion is reaped.
        unsafe { tx.bufs.bytes_mut(off, bytes.len()) }.copy_from_slice(bytes);
        let mut sge = tx.bufs.sge(off, bytes.len());
        // SAFETY: the buffer stays untouched until the completion comes back.
        let r = unsafe { self.post_ud(&ah, qpn, qkey, &mut sge, 0, TX_TAG | u64::from(slot)) };
        if r.is_err() {
            tx.free.push(slot);
        }
        r
    }

    /// Post one signaled UD send (the caller holds `tx`: the send queue
    /// never holds more than its reaped share).
    ///
    /// # Safety
    /// `sge` is valid for the send (inline, or registered memory that
    /// stays untouched until its completion).
    unsafe fn post_ud(&self, ah: &Ah, qpn: u32, qkey: u32, sge: &mut ibv_sge, flags: u32, wr_id: u64) -> Result<()> {
        // SAFETY: a plain C struct.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        // Signaled: every send is reaped, so the queue never fills with
        // completions nobody polls.
        wr.send_flags = flags | ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.ud.ah = ah.ah;
        wr.wr.ud.remote_qpn = qpn;
        wr.wr.ud.remote_qkey = qkey;
        // SAFETY: caller contract; the AH outlives the send (cached, and
        // kept a second after each use: `ahs`).
        unsafe { self.ud.post_send(&mut wr) }
    }

    fn post_ud_recv(&self, slot: usize) -> Result<()> {
        let mut sge = self.ud_bufs.sge(slot * self.ud_slot, self.ud_slot);
        // SAFETY: a plain C struct.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = slot as u64;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        // SAFETY: one WR over our own registered buffer.
        unsafe { self.ud.post_recv(&mut wr) }
    }

    /// The progress thread. Each pass runs under a panic boundary: a bug
    /// in it (or in the runtime's handlers and deferred work it calls)
    /// must not end the thread, whose death would leave every VQP of this
    /// PD waiting forever, nor unwind into the application. A pass that
    /// panics is logged and fails this endpoint's links (their state can
    /// no longer be trusted); the thread goes on serving.
    fn progress(&self) {
        // SAFETY: a live channel.
        let ud_fd = unsafe { (*self.ud_cq.channel).fd };
        while !self.stop.load(Ordering::SeqCst) {
            let pass = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.progress_pass(ud_fd)));
            if let Err(payload) = pass {
                self.after_panic(&*payload);
            }
        }
    }

    /// A pass of the progress thread panicked: log it and move every link
    /// to the error state. Their WQEs flush, and the runtime's handling of
    /// those error completions (on the application's polls, or on the
    /// link event raised here) moves their VQPs to the error state, as
    /// when a peer dies.
    fn after_panic(&self, payload: &(dyn std::any::Any + Send)) {
        let what = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(no message)");
        crate::stats::inc(crate::stats::Stat::KRCORE_STAT_SERVICE_PANICS);
        let links: Vec<Arc<Link>> = self.links.lock().by_qpn.values().cloned().collect();
        klog!(Level::Error, "service: the progress thread panicked: {what}; failing its {} links", links.len());
        for link in links {
            if let Err(e) = link.qp.to_error() {
                klog!(Level::Debug, "service: moving a link's QP to ERR: {e:?}");
            }
        }
        // The flushes complete on the links' CQ: let its handler see them.
        let handler = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if let Some(f) = self.on_link_event.lock().as_ref() {
                f();
            }
        }));
        if handler.is_err() {
            klog!(Level::Error, "service: the link handler panicked again after a panic");
        }
    }

    /// One pass: wait for something to do (bounded by the next deferred
    /// work or recheck), then do it.
    fn progress_pass(&self, cq_fd: libc::c_int) {
        {
            // Before the link side is made, no link fds (poll skips -1).
            let side = self.link_side.get();
            let (link_fd, recv_fd) = side.map_or((-1, -1), LinkSide::fds);
            let mut fds = [
                libc::pollfd { fd: cq_fd, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.event_fd, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: link_fd, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: recv_fd, events: libc::POLLIN, revents: 0 },
            ];
            let recheck = self.recv_recheck.lock().map(|(at, _)| at);
            let next = match (self.next_deferred(), recheck) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let timeout = next.map_or(-1, |at| {
                let ms = at.saturating_duration_since(Instant::now()).as_millis();
                ms.min(i32::MAX as u128) as libc::c_int + 1
            });
            // SAFETY: four valid pollfds.
            unsafe { libc::poll(fds.as_mut_ptr(), 4, timeout) };
            crate::kmark!(
                "progress: woke (UD {}, kick {}, links {}, messages {})",
                fds[0].revents,
                fds[1].revents,
                fds[2].revents,
                fds[3].revents
            );
            let due = recheck.is_some_and(|at| at <= Instant::now());
            if fds[3].revents != 0 || due {
                if let Some(side) = side.filter(|_| fds[3].revents != 0) {
                    if let Err(e) = side.recv_cq.consume_event() {
                        klog!(Level::Warn, "service: link receive channel: {e:?}");
                    }
                }
                self.on_messages();
            }
            if let Some(side) = side.filter(|_| fds[2].revents != 0) {
                // Not re-armed unless the handler wants more: an armed link
                // CQ would wake this thread at every completion and race
                // the application's own polling.
                if let Err(e) = side.link_cq.consume_event() {
                    klog!(Level::Warn, "service: link completion channel: {e:?}");
                }
                let more = self.on_link_event.lock().as_ref().is_some_and(|f| f());
                if more {
                    if let Err(e) = side.link_cq.arm() {
                        klog!(Level::Warn, "service: arming the links' CQ: {e:?}");
                    }
                    // Completions between the handler's poll and the arm
                    // raise no event: one more pass.
                    if let Some(f) = self.on_link_event.lock().as_ref() {
                        f();
                    }
                }
            }
            if fds[1].revents != 0 {
                let mut v = 0u64;
                // SAFETY: reads 8 bytes from our eventfd.
                unsafe { libc::read(self.event_fd, (&mut v as *mut u64).cast(), 8) };
            }
            if fds[0].revents != 0 {
                if let Err(e) = self.ud_cq.wait(Some(Duration::ZERO)) {
                    klog!(Level::Warn, "service: completion channel: {e:?}");
                }
            }
            let more = {
                let _turn = self.ud_turn.lock();
                for (m, src) in std::mem::take(&mut *self.link_msgs.lock()) {
                    self.on_link_message(m, &src, true);
                }
                self.drain_ud(true)
            };
            // Timers after what arrived: a retransmission timer that went
            // off while this thread was starved must not fail a flow whose
            // answers wait in the UD queue.
            self.run_due();
            let refill = self.refill_one();
            if more || refill {
                // More to take or make: look at the UD queue first, without
                // sleeping.
                self.kick();
            }
        }
    }

    /// Messages arrived (or a recheck is due): move them to their VQPs.
    /// If the application polled meanwhile it will go on doing so: look
    /// again later (1 ms, doubling up to 64 ms) without arming; else arm
    /// (before the last poll: a message after it raises the next event).
    fn on_messages(&self) {
        let active = self.on_link_recv.lock().as_ref().is_some_and(|f| f());
        let mut r = self.recv_recheck.lock();
        if active {
            let wait = r.map_or(Duration::from_millis(1), |(_, w)| (w * 2).min(Duration::from_millis(64)));
            *r = Some((Instant::now() + wait, wait));
            return;
        }
        *r = None;
        drop(r);
        if let Some(Err(e)) = self.link_side.get().map(|s| s.recv_cq.arm()) {
            klog!(Level::Warn, "service: arming the links' receive CQ: {e:?}");
        }
        if let Some(f) = self.on_link_recv.lock().as_ref() {
            f();
        }
    }

    fn next_deferred(&self) -> Option<Instant> {
        self.deferred.lock().iter().map(|(at, _)| *at).min()
    }

    /// Run the deferred work that is due (outside the lock: it may defer more).
    fn run_due(&self) {
        let now = Instant::now();
        let due: Vec<Deferred> = {
            let mut d = self.deferred.lock();
            let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut *d).into_iter().partition(|(at, _)| *at <= now);
            *d = later;
            due.into_iter().map(|(_, f)| f).collect()
        };
        for f in due {
            // Each under its own boundary: the works after a panicking one
            // (delayed deregistrations) still run.
            if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                self.after_panic(&*payload);
            }
        }
    }

    /// Take what the UD queue holds (`ud_turn` held), at most a queue's
    /// worth: whether more may wait. `progress`: on the progress thread,
    /// else link requests and readies wait for it.
    ///
    /// Bounded: datagrams that arrive as fast as they are handled (a
    /// server starved of CPU by a burst of new clients, each retransmitting)
    /// would keep the turn with one thread for good, and the progress
    /// thread, waiting for it, would run no timer and answer no link
    /// request meanwhile (a burst stalled for minutes so).
    fn drain_ud(&self, progress: bool) -> bool {
        // SAFETY: plain C data.
        let mut wcs: [ibv_wc; 16] = unsafe { std::mem::zeroed() };
        for _ in 0..UD_RECVS / wcs.len() {
            let n = match self.ud_cq.poll(&mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    klog!(Level::Warn, "service: polling the UD CQ: {e:?}");
                    return false;
                }
            };
            if n > 0 {
                crate::kmark!("UD: {n} received");
            }
            for wc in &wcs[..n] {
                self.on_recv(wc, progress);
            }
            if n < wcs.len() {
                return false;
            }
        }
        true
    }

    fn on_recv(&self, wc: &ibv_wc, progress: bool) {
        let slot = wc.wr_id as usize;
        let len = (wc.byte_len as usize).clamp(GRH, self.ud_slot);
        // SAFETY: this slot's receive completed; it is reposted below.
        let bytes = unsafe { self.ud_bufs.bytes(slot * self.ud_slot, len) };
        if wc.status == ibv_wc_status::IBV_WC_SUCCESS && crate::transport::dgram::wire::is_dgram(&bytes[GRH..]) {
            let gids = (wc.wc_flags & ibv_wc_flags::IBV_WC_GRH.0 != 0).then(|| rdma::grh_gids(&bytes[..GRH])).flatten();
            match (gids, self.on_datagram.lock().as_ref()) {
                (Some((gid, to_gid)), Some(f)) => f(&bytes[GRH..], &Source { gid, to_gid, qpn: wc.src_qp }),
                _ => crate::stats::inc(crate::stats::Stat::KRCORE_STAT_DGRAM_DROPPED),
            }
        } else if wc.status == ibv_wc_status::IBV_WC_SUCCESS {
            // SAFETY: as above (the slot holds at least a link message).
            let msg = LinkMessage::decode(unsafe { self.ud_bufs.bytes(slot * self.ud_slot + GRH, LINK_LEN) });
            let gids = (wc.wc_flags & ibv_wc_flags::IBV_WC_GRH.0 != 0).then(|| rdma::grh_gids(&bytes[..GRH])).flatten();
            match (msg, gids) {
                (Ok(m), Some((gid, to_gid))) => {
                    let src = Source { gid, to_gid, qpn: wc.src_qp };
                    if !self.sent_by_its_endpoint(&m, &src) {
                        link_msg_dropped(format_args!("{m:?} from {src:?}: not the endpoint it names"));
                    } else if progress || matches!(m, LinkMessage::Reply(_)) {
                        self.on_link_message(m, &src, progress);
                    } else {
                        self.for_progress_thread(m, src);
                    }
                }
                (Ok(m), None) => link_msg_dropped(format_args!("{m:?} without a GRH")),
                (Err(e), _) => link_msg_dropped(format_args!("malformed: {e:?}")),
            }
        }
        if let Err(e) = self.post_ud_recv(slot) {
            klog!(Level::Warn, "service: cannot repost a UD receive: {e:?}");
        }
    }

    /// Hand link message `m` to the progress thread (it makes and moves
    /// QPs). Bounded as the UD queue is: a peer repeats its request until
    /// answered.
    fn for_progress_thread(&self, m: LinkMessage, src: Source) {
        let mut q = self.link_msgs.lock();
        if q.len() < UD_RECVS {
            q.push((m, src));
        }
        drop(q);
        self.kick();
    }

    /// Whether link message `m` came from the endpoint it speaks for, as
    /// the network says: a request or a READY from the UD QP and home GID
    /// of the endpoint it names, sent to ours (link messages travel between
    /// the endpoints' home GIDs, whatever GIDs the link itself joins). So
    /// nobody can ask for a link, or say it is ready, as another process.
    fn sent_by_its_endpoint(&self, m: &LinkMessage, src: &Source) -> bool {
        match m {
            LinkMessage::Request(r) => self.sent_to_us_by(&r.info.from, src),
            LinkMessage::Ready(r) => self.sent_to_us_by(&r.info.from, src),
            // Checked against the request it answers (on_link_message).
            LinkMessage::Reply(_) => true,
        }
    }

    /// Whether a link message from `src` came from endpoint `ep`'s UD QP
    /// and home GID, to our home GID.
    fn sent_to_us_by(&self, ep: &Endpoint, src: &Source) -> bool {
        ep.gid == src.gid && ep.qpn == src.qpn && src.to_gid == self.me.gid
    }

    /// `progress`: on the progress thread (else what makes or moves QPs
    /// waits for it).
    fn on_link_message(&self, msg: LinkMessage, src: &Source, progress: bool) {
        match msg {
            LinkMessage::Request(r) => {
                crate::kmark!("link: request {} received", r.req_id);
                self.on_request(&r)
            }
            LinkMessage::Ready(r) => {
                crate::kmark!("link: ready {} received", r.req_id);
                self.on_ready(&r)
            }
            LinkMessage::Reply(r) => {
                crate::kmark!("link: reply {} received", r.req_id);
                // Only from the endpoint the request went to: anyone else's
                // "reply" (a guessed request id) would fail or hijack it.
                let mut replies = self.replies.lock();
                match replies.get_mut(&r.req_id) {
                    Some(a) if self.sent_to_us_by(&a.from, src) => a.reply = Some(r),
                    Some(_) => link_msg_dropped(format_args!("a reply to request {} from {src:?}, not the endpoint asked", r.req_id)),
                    None => {
                        drop(replies);
                        return self.on_late_reply(r, src, progress);
                    }
                }
                drop(replies);
                self.reply_ready.notify_all();
            }
        }
    }

    /// A peer asks for a link: make it (or find the one a repeated request
    /// already made: the same peer QP) and answer.
    fn on_request(&self, r: &LinkRequest) {
        let peer = r.info.from;
        // The link runs between the GIDs the requester chose: its source
        // GID and the one of ours it sent to (the reply goes back that way).
        let path = match self.our_gid_index(&r.info.dst_gid) {
            Ok(sgid_index) => Path { sgid_index, dgid: r.info.src_gid },
            Err(e) => {
                // Anyone can send this: counted, logged at debug only.
                crate::stats::inc(crate::stats::Stat::KRCORE_STAT_LINK_MSGS_DROPPED);
                klog!(Level::Debug, "service: a link request from QP {} names a GID that is not ours: {e:?}", peer.qpn);
                return;
            }
        };
        let id = (peer.incarnation, r.info.rc_qpn, r.info.psn);
        let (existing, retired) = {
            let links = self.links.lock();
            (links.accepted.get(&id).cloned(), links.was_retired(&id))
        };
        match existing {
            None if retired => {
                klog!(Level::Debug, "service: a late copy of a link request from QP {} whose link is closed: dropped", peer.qpn);
            }
            Some(l) => self.answer(r, Ok(&l)),
            None if self.crossed(r, path, &mut self.links.lock()) => self.answer(r, Err(Errno(libc::EALREADY))),
            None if !self.link_wanted(&peer, &path) => {
                crate::stats::inc(crate::stats::Stat::KRCORE_STAT_LINKS_UNWANTED);
                klog!(Level::Debug, "service: a link request from QP {}: no VQP here is bound or connected to it", peer.qpn);
            }
            None if r.optional && self.at_link_limit() => {
                klog!(Level::Debug, "service: at KRCORE_MAX_LINKS: refused an optional link from QP {}", peer.qpn);
                self.answer(r, Err(Errno(libc::ECONNREFUSED)));
            }
            None if self.links_held_by(&peer) >= self.peer_link_bound() => {
                crate::stats::inc(crate::stats::Stat::KRCORE_STAT_LINKS_REFUSED);
                klog!(Level::Debug, "service: QP {} holds KRCORE_MAX_PEER_LINKS links with us: refused another", peer.qpn);
                self.answer(r, Err(Errno(libc::EBUSY)));
            }
            None if self.links_held_by_gid(&peer.gid) >= self.opts.max_gid_links => {
                crate::stats::inc(crate::stats::Stat::KRCORE_STAT_LINKS_REFUSED);
                klog!(
                    Level::Debug,
                    "service: the endpoints of QP {}'s GID hold KRCORE_MAX_GID_LINKS links with us: refused another",
                    peer.qpn
                );
                self.answer(r, Err(Errno(libc::EBUSY)));
            }
            // The links' side is made on a thread of its own, never on
            // this one (it answers the datagram tier meanwhile): until it
            // is ready the request waits for its next copy.
            None if !self.links_may_be_accepted() => {
                klog!(
                    Level::Debug,
                    "service: a link request from QP {} before our links' side is ready: answered at a later copy",
                    peer.qpn
                );
            }
            None => {
                let key = LinkKey::of(&peer, r.info.link, path);
                // Crossing asked again in the same hold of the lock as the
                // accept is marked out: our connect for this key may have
                // begun since the first look (`link_or_ask` marks it out
                // under the lock, or waits for a request being accepted);
                // else both requests would make a link.
                let mut links = self.links.lock();
                if self.crossed(r, path, &mut links) {
                    drop(links);
                    self.answer(r, Err(Errno(libc::EALREADY)));
                } else if links.accepting.insert(key) {
                    // (A copy of a request being accepted: that accept answers.)
                    drop(links);
                    self.accept_elsewhere(*r, path, key);
                }
            }
        }
    }

    /// Whether `r` crossed a request of ours for its key (`Links::crossed`):
    /// it is to be answered EALREADY.
    fn crossed(&self, r: &LinkRequest, path: Path, links: &mut Links) -> bool {
        let peer = r.info.from;
        let id = (peer.incarnation, r.info.rc_qpn, r.info.psn);
        let key = LinkKey::of(&peer, r.info.link, path);
        let crossed = links.crossed(id, &key, self.me.incarnation < peer.incarnation, crate::config::get().connect_timeout_ms);
        if crossed {
            klog!(Level::Debug, "service: a link request from QP {} crossed ours: ours makes the link", peer.qpn);
        }
        crossed
    }

    /// Accept `r` on a thread of its own: its QP's RTR may wait in the
    /// kernel (about a second for a GID whose address does not resolve,
    /// which the requester chooses), while this thread answers every other
    /// peer and the datagram tier. At most [`MAX_ACCEPTS`] at once,
    /// [`MAX_ACCEPTS_PER_GID`] from one GID; a request beyond is answered
    /// at a later copy. Inline when no thread can be made.
    fn accept_elsewhere(&self, r: LinkRequest, path: Path, key: LinkKey) {
        let from = r.info.from;
        let of_gid = self.links.lock().accepting.iter().filter(|k| k.is_from_gid(&from.gid)).count();
        let slot = || self.accepts.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < MAX_ACCEPTS).then_some(n + 1)).is_ok();
        if of_gid > MAX_ACCEPTS_PER_GID || !slot() {
            self.links.lock().accepting.remove(&key);
            self.link_ready.notify_all();
            klog!(
                Level::Debug,
                "service: {MAX_ACCEPTS} links being accepted: a request from QP {} waits for its next copy",
                r.info.from.qpn
            );
            return;
        }
        let Some(me) = self.this.get().and_then(Weak::upgrade) else {
            return self.accept_now(&r, path, key);
        };
        match std::thread::Builder::new().name("krcore-accept".into()).spawn(move || me.accept_now(&r, path, key)) {
            Ok(t) => {
                let mut threads = self.accept_threads.lock();
                threads.retain(|t| !t.is_finished());
                threads.push(t);
            }
            Err(_) => self.accept_now(&r, path, key),
        }
    }

    /// Accept `r` here (a slot of `accepts` taken), answer a refusal, and
    /// release the slot.
    fn accept_now(&self, r: &LinkRequest, path: Path, key: LinkKey) {
        let accepted = self.accept(r, path);
        self.links.lock().accepting.remove(&key);
        self.link_ready.notify_all();
        if let Err(e) = accepted {
            klog!(Level::Debug, "service: refused a link from QP {}: {e:?}", r.info.from.qpn);
            self.answer(r, Err(e));
        }
        self.accepts.fetch_sub(1, Ordering::AcqRel);
    }

    fn link_wanted(&self, peer: &Endpoint, path: &Path) -> bool {
        self.wanted.lock().as_ref().is_none_or(|f| f(peer, path))
    }

    fn links_may_be_accepted(&self) -> bool {
        match self.accepting.lock().as_ref() {
            Some(f) => self.link_side_ready.load(Ordering::Acquire) && f(),
            // A service without a runtime (its own tests): made here.
            None => self.link_side().is_ok(),
        }
    }

    /// Links with the endpoint `peer` names, but those closing: an honest
    /// peer that reclaims links (`KRCORE_MAX_LINKS`) asks for the next one
    /// while the last closes, and closing ones go within the close's
    /// bound (two transport waits) whether the peer answers or not.
    fn links_held_by(&self, peer: &Endpoint) -> usize {
        let links = self.links.lock();
        let held = links.by_qpn.values().filter(|l| l.peer.gid == peer.gid && l.peer.qpn == peer.qpn && !l.is_closing()).count();
        held + links.accepting.iter().filter(|k| k.is_with(&peer.gid, peer.qpn)).count()
    }

    /// Links the endpoints of `gid` (one host's) asked for, as
    /// [`Service::links_held_by`] counts them (ours to them are not theirs
    /// to bound).
    fn links_held_by_gid(&self, gid: &Gid) -> usize {
        let links = self.links.lock();
        let held = links.by_qpn.values().filter(|l| l.peer.gid == *gid && !l.initiated && !l.is_closing()).count();
        held + links.accepting.iter().filter(|k| k.is_from_gid(gid)).count()
    }

    /// `KRCORE_MAX_PEER_LINKS`, at least room for `KRCORE_LINKS_PER_PEER`
    /// links and a duplicate of each while it closes.
    fn peer_link_bound(&self) -> usize {
        let cfg = crate::config::get();
        cfg.max_peer_links.max(2 * cfg.links_per_peer as usize)
    }

    /// Whether we hold `KRCORE_MAX_LINKS` links (open, closing or failed).
    fn at_link_limit(&self) -> bool {
        let max = crate::config::get().max_links;
        max > 0 && self.links.lock().by_qpn.len() >= max
    }

    /// Reply to link request `r`: with our end of `link`, or the error.
    fn answer(&self, r: &LinkRequest, link: Result<&Link>) {
        let (ours, theirs) = (r.info.dst_gid, r.info.src_gid);
        let reply = match link {
            Ok(link) => LinkReply { req_id: r.req_id, status: 0, info: self.info(link.qp.qpn(), link.psn, r.info.link, ours, theirs) },
            Err(e) => LinkReply { req_id: r.req_id, status: e.0 as u32, info: self.info(0, 0, r.info.link, ours, theirs) },
        };
        let mut msg = [0u8; LINK_LEN];
        reply.encode(&mut msg);
        if let Err(e) = self.send_ud(self.home_path(r.info.from.gid), r.info.from.qpn, r.info.from.qkey, &msg) {
            klog!(Level::Warn, "service: cannot answer a link request: {e:?}");
        }
        crate::kmark!("link: reply {} sent", r.req_id);
    }

    /// Make the link `r` asks for and answer. The reply goes as soon as
    /// our QP is in RTR, where it already receives and answers (ACKs, READ
    /// responses, atomics): the requester's RTR and RTS overlap our RTS.
    /// Until RTS, the link's send lock is held, so nothing posts on a QP
    /// that cannot send yet.
    fn accept(&self, r: &LinkRequest, path: Path) -> Result<()> {
        let theirs = &r.info;
        let qp = self.take_warm()?;
        crate::kmark!("link: warm QP taken");
        let psn = rdma::random_psn();
        qp.to_rtr(path.sgid_index, &RcPeer { gid: path.dgid, qpn: theirs.rc_qpn, psn: theirs.psn })?;
        crate::kmark!("link: RTR");
        let link = Arc::new(Link::new(qp, theirs.from, theirs.link, path, theirs, false, psn, self.credit(theirs)?)?);
        {
            let _sends_wait = link.sq.lock();
            {
                let mut links = self.links.lock();
                links.accepted.insert((theirs.from.incarnation, theirs.rc_qpn, theirs.psn), Arc::clone(&link));
                links.insert(LinkKey::of(&theirs.from, theirs.link, path), Arc::clone(&link), &self.me);
                // A connect of ours that crossed this request waits for it.
                self.link_ready.notify_all();
            }
            self.answer(r, Ok(&link));
            if let Err(e) = link.qp.to_rts(psn) {
                // The peer has our reply: its operations on the link fail
                // (RC retries) as if we had died, and it connects anew.
                klog!(Level::Warn, "service: an accepted link's QP {} cannot go to RTS: {e:?}: it fails", link.qp.qpn());
                link.failed.store(true, Ordering::Release);
                let mut links = self.links.lock();
                links.retire(&link);
                links.by_qpn.remove(&link.qp.qpn());
                drop(links);
                let _ = link.qp.to_error();
                return Ok(());
            }
            crate::kmark!("link: RTS");
        }
        self.new_link_made(&link);
        Ok(())
    }
}
