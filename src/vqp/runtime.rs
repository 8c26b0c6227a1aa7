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

mod meta;
use meta::{background_meta_bound, start_meta, MetaStart};

/// Payload bytes a message may carry (a receive buffer holds the header
/// and this much).
pub const MAX_MSG: usize = 4096;
const RECV_BUF: usize = HEADER_LEN + MAX_MSG;
/// Bytes a liveness probe READs.
const PROBE_LEN: usize = 8;
/// How often the links are looked after when they are not probed
/// (`KRCORE_LINK_PROBE_MS=0`): closes beyond `KRCORE_MAX_LINKS`.
const MAINTENANCE_MS: u64 = 1000;
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

/// The wr_id of a notifier's sends (with its QP number, tells them apart
/// from the application's own completions on the same real CQ).
pub const NOTIFY_WR_ID: u64 = 0x4b52_4e4f_5449_4659;

/// Raises a completion event on an application's CQ from software: a
/// zero-length UD send to itself (dropped at the receive side: nothing is
/// posted there) whose send completion lands in the application's real
/// CQ, which the kernel then signals on the CQ's completion channel like
/// any other completion. `ibv_poll_cq` drops that completion.
struct Notifier {
    qp: Qp,
    ah: Ah,
    _cq: Arc<Cq>,
}

impl Notifier {
    fn new(rt: &Runtime, real_cq: *mut ibv_cq) -> Result<Notifier> {
        let dev = rt.svc.device();
        let cq = Arc::new(Cq::new(dev, 4)?);
        let caps = Caps { send_wr: 64, recv_wr: 1, send_sge: 1, recv_sge: 1, inline: 0 };
        let qp = Qp::with_send_cq(dev, ibv_qp_type::IBV_QPT_UD, SendCq::Foreign(real_cq), &cq, None, caps)?;
        qp.ud_ready()?;
        let gid = dev.gid(rt.svc.gid_index())?;
        let mut attr = qp.ah_attr(rt.svc.gid_index(), &gid);
        let ah = Ah::new(dev, &mut attr)?;
        Ok(Notifier { qp, ah, _cq: cq })
    }

    fn ring(&self) -> Result<()> {
        // SAFETY: a plain C struct.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = NOTIFY_WR_ID;
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.ud.ah = self.ah.ah;
        wr.wr.ud.remote_qpn = self.qp.qpn();
        wr.wr.ud.remote_qkey = rdma::QKEY;
        // SAFETY: a zero-length send; the AH lives as long as the QP.
        unsafe { self.qp.post_send(&mut wr) }
    }
}

/// The software completions VQPs deliver to one application CQ, the
/// runtimes that must make progress before it is polled, and what raises
/// its completion events.
pub struct CqSoft {
    q: Mutex<Spilling>,
    runtimes: Mutex<Vec<Weak<Runtime>>>,
    /// The application's real CQ (where notifications land).
    real_cq: *mut ibv_cq,
    /// `ibv_req_notify_cq` was called and no event was raised since.
    armed: AtomicBool,
    notifier: Mutex<Option<Notifier>>,
    notifier_qpn: AtomicU32,
    /// Some VQP receives into this CQ: its polls take the links' messages
    /// too (a CQ only for sends leaves them to the CQs that receive, and
    /// to the service thread).
    receives: AtomicBool,
    /// Completions in `q` (queued and spilled), written under its lock:
    /// a poll that finds none looks no further, and delivers straight
    /// into its caller's array (see [`Sink`]).
    queued: AtomicUsize,
    /// Live VQPs that complete into this CQ (a destroyed VQP may still be
    /// referenced for a moment by the service thread: that is no user).
    users: AtomicUsize,
    /// The application destroyed the CQ: raise no more events (its real
    /// CQ is gone).
    released: AtomicBool,
    /// A completion was queued while the CQ was not armed and is still
    /// there: the next arm raises an event at once (as the kernel's
    /// `IB_CQ_REPORT_MISSED_EVENTS` would report it). perftest arms its
    /// CQs after the handshake, when the peer's first message may be in.
    missed: AtomicBool,
}

/// The array of an `ibv_poll_cq` in progress on one CQ: while that CQ has
/// nothing queued, the polling thread's own progress delivers the CQ's
/// completions straight into it instead of through the queue (a lock and
/// two copies less per completion). Order holds: a VQP delivers under its
/// lock, so anything it queued earlier is seen in `queued`, and what is
/// queued after a direct delivery is popped behind it.
pub struct Sink<'a> {
    cq: *const CqSoft,
    out: &'a mut [std::mem::MaybeUninit<ibv_wc>],
    /// Entries written.
    pub n: usize,
}

impl<'a> Sink<'a> {
    pub fn new(cq: &CqSoft, out: &'a mut [std::mem::MaybeUninit<ibv_wc>]) -> Sink<'a> {
        Sink { cq, out, n: 0 }
    }
}

// SAFETY: `real_cq` is only handed to the real library; the rest is
// behind locks or atomic.
unsafe impl Send for CqSoft {}
// SAFETY: as above.
unsafe impl Sync for CqSoft {}

/// A CQ's software completions: the queue of the CQ's size, and behind it
/// what did not fit. A real CQ would overrun and fail (IBV_EVENT_CQ_ERR);
/// here nothing is lost: completions wait, in order, until polled.
struct Spilling {
    q: SoftCq,
    cap: usize,
    spill: std::collections::VecDeque<ibv_wc>,
}

impl CqSoft {
    pub fn new(cqe: u32, real_cq: *mut ibv_cq) -> Result<CqSoft> {
        Ok(CqSoft {
            q: Mutex::new(Spilling { q: SoftCq::new(cqe.max(1))?, cap: cqe.max(1) as usize, spill: std::collections::VecDeque::new() }),
            runtimes: Mutex::new(Vec::new()),
            real_cq,
            armed: AtomicBool::new(false),
            notifier: Mutex::new(None),
            notifier_qpn: AtomicU32::new(u32::MAX),
            receives: AtomicBool::new(false),
            queued: AtomicUsize::new(0),
            users: AtomicUsize::new(0),
            released: AtomicBool::new(false),
            missed: AtomicBool::new(false),
        })
    }

    /// A VQP completes into this CQ from now on (until [`CqSoft::remove_user`]).
    pub fn add_user(&self) {
        self.users.fetch_add(1, Ordering::AcqRel);
    }

    pub fn remove_user(&self) {
        self.users.fetch_sub(1, Ordering::AcqRel);
    }

    /// This CQ gets completions of `rt`'s VQPs (`receives`: receive
    /// completions among them).
    pub fn serve(self: &Arc<Self>, rt: &Arc<Runtime>, receives: bool) {
        if receives {
            self.receives.store(true, Ordering::Release);
        }
        let mut r = self.runtimes.lock();
        if !r.iter().any(|w| w.as_ptr() == Arc::as_ptr(rt)) {
            r.push(Arc::downgrade(rt));
            rt.cqs.lock().push(Arc::downgrade(self));
            // Armed already: this runtime's completions must raise the
            // event too.
            if self.armed.load(Ordering::Acquire) {
                rt.armed_cqs.fetch_add(1, Ordering::AcqRel);
                drop(r);
                self.want_events(std::slice::from_ref(rt));
            }
        }
    }

    /// Make progress on every runtime that feeds this CQ (not under the
    /// list's lock: delivering may take it). Called at every poll: the
    /// common case, one runtime, allocates nothing.
    pub fn progress(&self, mut sink: Option<&mut Sink<'_>>) {
        let receives = self.receives.load(Ordering::Acquire);
        let r = self.runtimes.lock();
        if r.len() <= 1 {
            let Some(one) = r.first().and_then(Weak::upgrade) else { return };
            drop(r);
            one.progress_for(receives, sink);
            return;
        }
        let all: Vec<Arc<Runtime>> = r.iter().filter_map(Weak::upgrade).collect();
        drop(r);
        for rt in all {
            rt.progress_for(receives, sink.as_deref_mut());
        }
    }

    /// A completion for the application: into `sink` when it is this CQ's
    /// poll in progress and nothing is queued before it, else queued.
    #[inline]
    pub fn deliver(&self, wc: ibv_wc, sink: Option<&mut Sink<'_>>) {
        if let Some(s) = sink {
            if std::ptr::eq(s.cq, self) && s.n < s.out.len() && self.queued.load(Ordering::Acquire) == 0 {
                s.out[s.n].write(wc);
                s.n += 1;
                self.raise_if_armed();
                return;
            }
        }
        self.push(wc);
    }

    /// Whether nothing is queued (a poll need not take the lock).
    pub fn is_empty(&self) -> bool {
        self.queued.load(Ordering::Acquire) == 0
    }

    /// A completion for the application: queue it, and raise an event if
    /// the CQ is armed.
    pub fn push(&self, wc: ibv_wc) {
        self.enqueue(wc);
        if !self.armed.load(Ordering::Acquire) {
            self.missed.store(true, Ordering::Release);
        }
        self.raise_if_armed();
    }

    /// Queue a completion the real CQ already raised its event for.
    pub fn enqueue(&self, wc: ibv_wc) {
        {
            let mut g = self.q.lock();
            // Behind what already spilled, to keep the order.
            if !g.spill.is_empty() || g.q.len() >= g.cap {
                if g.spill.is_empty() {
                    klog!(Level::Debug, "vqp: more completions than the CQ holds: keeping them until polled");
                }
                g.spill.push_back(wc);
                crate::stats::inc(crate::stats::Stat::KRCORE_STAT_CQ_SPILLS);
            } else if g.q.push(wc).is_err() {
                debug_assert!(false, "room was checked");
            }
            self.queued.store(g.q.len() + g.spill.len(), Ordering::Release);
        }
    }

    /// A completion arrived: raise the event an `ibv_req_notify_cq` asked
    /// for.
    #[inline]
    fn raise_if_armed(&self) {
        // A load first: the swap is a locked instruction, rarely needed.
        if !self.armed.load(Ordering::Acquire) {
            return;
        }
        // The runtimes' count of armed CQs changes under the list's lock,
        // with the state: a runtime that starts serving the CQ meanwhile
        // is counted once (see serve).
        {
            let r = self.runtimes.lock();
            if !self.armed.swap(false, Ordering::AcqRel) {
                return;
            }
            for rt in r.iter().filter_map(Weak::upgrade) {
                rt.armed_cqs.fetch_sub(1, Ordering::AcqRel);
            }
        }
        klog!(Level::Debug, "vqp: completion event on CQ {:p}", self.real_cq);
        self.raise();
    }

    /// Take up to `out.len()` completions, oldest first.
    pub fn pop_into(&self, out: &mut [std::mem::MaybeUninit<ibv_wc>]) -> usize {
        let mut g = self.q.lock();
        let mut n = g.q.pop_into(out);
        while n < out.len() {
            let Some(wc) = g.spill.pop_front() else { break };
            out[n].write(wc);
            n += 1;
        }
        let left = g.q.len() + g.spill.len();
        self.queued.store(left, Ordering::Release);
        if left == 0 {
            self.missed.store(false, Ordering::Release);
        }
        n
    }

    /// `ibv_req_notify_cq` on the application's CQ: the next VQP
    /// completion raises an event (the real CQ is armed by the caller).
    pub fn arm(&self) {
        let rts: Vec<Arc<Runtime>> = {
            let r = self.runtimes.lock();
            if self.armed.swap(true, Ordering::AcqRel) {
                return;
            }
            r.iter().filter_map(Weak::upgrade).collect()
        };
        klog!(Level::Debug, "vqp: CQ {:p} armed", self.real_cq);
        for rt in &rts {
            rt.armed_cqs.fetch_add(1, Ordering::AcqRel);
        }
        self.want_events(&rts);
        // What completed before the links' CQ was armed raises no event:
        // deliver it now (an armed CQ then raises its own).
        for rt in rts {
            rt.progress();
        }
        if self.missed.swap(false, Ordering::AcqRel) && !self.is_empty() {
            self.raise_if_armed();
        }
    }

    /// Wake the service thread of each runtime on its links' completions.
    fn want_events(&self, rts: &[Arc<Runtime>]) {
        let receives = self.receives.load(Ordering::Acquire);
        for rt in rts {
            if let Err(e) = rt.svc.want_link_events() {
                klog!(Level::Warn, "vqp: arming the links' CQ: {e:?}");
            }
            if receives {
                if let Err(e) = rt.svc.want_message_events() {
                    klog!(Level::Warn, "vqp: arming the links' receive CQ: {e:?}");
                }
            }
        }
    }

    fn raise(&self) {
        let mut n = self.notifier.lock();
        if self.released.load(Ordering::Acquire) {
            return;
        }
        if n.is_none() {
            let rt = self.runtimes.lock().iter().find_map(Weak::upgrade);
            let Some(rt) = rt else { return };
            match Notifier::new(&rt, self.real_cq) {
                Ok(made) => {
                    self.notifier_qpn.store(made.qp.qpn(), Ordering::Release);
                    *n = Some(made);
                }
                Err(e) => {
                    klog!(Level::Warn, "vqp: cannot raise completion events on this CQ: {e:?}");
                    return;
                }
            }
        }
        if let Some(made) = n.as_ref() {
            if let Err(e) = made.ring() {
                klog!(Level::Warn, "vqp: raising a completion event failed: {e:?}");
            }
        }
    }

    /// Whether a notifier was made (its completions land in the real CQ).
    pub fn has_notifier(&self) -> bool {
        self.notifier_qpn.load(Ordering::Acquire) != u32::MAX
    }

    /// Whether a real completion is one of our notifications.
    pub fn is_notification(&self, wc: &ibv_wc) -> bool {
        wc.wr_id == NOTIFY_WR_ID && wc.qp_num == self.notifier_qpn.load(Ordering::Acquire)
    }

    /// Before the application's CQ is destroyed: EBUSY while VQPs use it;
    /// else the notifier goes (its QP holds the real CQ).
    pub fn release(self: &Arc<Self>) -> Result<()> {
        if self.users.load(Ordering::Acquire) > 0 {
            return Err(Errno(libc::EBUSY));
        }
        self.released.store(true, Ordering::Release);
        self.notifier.lock().take();
        Ok(())
    }
}

/// Header slots of in-flight SENDs, carved per VQP (one per send-queue
/// entry, taken at its first SEND) out of registered arenas of
/// HDR_ARENA_SLOTS slots: a registration per VQP would cost a kernel call
/// on its first send.
pub const HDR_SLOT: usize = HEADER_LEN + super::qp::MAX_INLINE as usize;
const HDR_ARENA_SLOTS: u32 = 8192;
/// The arena made with the runtime is small (a few VQPs' worth): the
/// start registers it in front of the first operation; the next ones, made
/// as VQPs need them, are full size.
const FIRST_HDR_ARENA_SLOTS: u32 = 512;

/// A registered arena of header slots and its free ranges.
pub struct HdrArena {
    pub region: Region,
    free: Mutex<Ranges>,
}

impl HdrArena {
    fn new(dev: &Arc<Device>, slots: u32) -> Result<HdrArena> {
        Ok(HdrArena { region: Region::new(dev, slots as usize * HDR_SLOT, rdma::LOCAL_WRITE)?, free: Mutex::new(Ranges::new(slots)) })
    }

    pub fn free(&self, start: u32, n: u32) {
        self.free.lock().free(start, n)
    }
}

/// Free ranges of slots, first fit, merged on free.
pub(super) struct Ranges(Vec<(u32, u32)>);

impl Ranges {
    pub(super) fn new(n: u32) -> Ranges {
        Ranges(vec![(0, n)])
    }

    pub(super) fn alloc(&mut self, n: u32) -> Option<u32> {
        let i = self.0.iter().position(|&(_, len)| len >= n)?;
        let (start, len) = self.0[i];
        if len == n {
            self.0.remove(i);
        } else {
            self.0[i] = (start + n, len - n);
        }
        Some(start)
    }

    pub(super) fn free(&mut self, start: u32, n: u32) {
        let f = &mut self.0;
        let i = f.partition_point(|&(s, _)| s < start);
        f.insert(i, (start, n));
        if i + 1 < f.len() && f[i].0 + f[i].1 == f[i + 1].0 {
            f[i].1 += f[i + 1].1;
            f.remove(i + 1);
        }
        if i > 0 && f[i - 1].0 + f[i - 1].1 == f[i].0 {
            f[i - 1].1 += f[i].1;
            f.remove(i);
        }
    }
}

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
    known: FxHashMap<u32, (super::precheck::MrInfo, u64, u64)>,
}

impl PeerMrs {
    /// The peer said `info` for `rkey` to a check sent at `at_ms`
    /// ([`crate::clock::coarse_ms`]): the lease is counted from the check's sending, not
    /// from the answer (which may come a transport's retries later, while
    /// the owner counts from its deregistration).
    pub fn learn(&mut self, rkey: u32, info: super::precheck::MrInfo, at_ms: u64) {
        let used = self.known.get(&rkey).map_or(at_ms, |k| k.2);
        self.known.insert(rkey, (info, at_ms, used));
    }

    /// The peer's MR of `rkey` and when its table said so (coarse ms); the
    /// pre-checks use it while [`super::memo::lease_holds`].
    pub fn get(&mut self, rkey: u32) -> Option<(super::precheck::MrInfo, u64)> {
        let k = self.known.get_mut(&rkey)?;
        k.2 = crate::clock::coarse_ms();
        Some((k.0, k.1))
    }

    /// The rkeys looked up within `used_ms` of `now_ms` whose check is at
    /// least `older_ms` old: the ones to check again before their lease
    /// runs out.
    pub fn due(&self, now_ms: u64, older_ms: u64, used_ms: u64) -> Vec<(u32, super::precheck::MrInfo)> {
        let due = |&(_, at, used): &(super::precheck::MrInfo, u64, u64)| {
            now_ms.saturating_sub(used) <= used_ms && now_ms.saturating_sub(at) >= older_ms
        };
        self.known.iter().filter(|(_, k)| due(k)).map(|(&rkey, k)| (rkey, k.0)).collect()
    }

    pub fn forget(&mut self, rkey: u32) {
        self.known.remove(&rkey);
    }
}

/// The VQP the last send completion went to: completions come in runs for
/// one VQP, which then skip the slot table and its lock.
#[derive(Default)]
struct LastVqp(Option<(u32, u8, Weak<vqp::Vqp>)>);

impl LastVqp {
    fn get(&mut self, slot: u32, gen: u8) -> Option<Arc<vqp::Vqp>> {
        if let Some((s, g, w)) = &self.0 {
            if (*s, *g) == (slot, gen) {
                // A destroyed VQP fails to upgrade, as its slot would.
                return w.upgrade();
            }
        }
        let v = vqp::lookup(slot, gen)?;
        self.0 = Some((slot, gen, Arc::downgrade(&v)));
        Some(v)
    }
}

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
    /// The CQs this runtime's VQPs deliver to (their notifiers live on
    /// this PD).
    cqs: Mutex<Vec<Weak<CqSoft>>>,
    /// How many of those CQs are armed: the service thread wakes on link
    /// completions only while some are.
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
        if dev.gid(gi)? == [0; 16] {
            // An empty slot of the GID table (rxe answers for any index
            // below its table's length): nothing could reach us there.
            klog!(Level::Error, "vqp: GID index {gi} of {} holds no GID (KRCORE_GID_INDEX, or qbind's GID)", dev.name);
            return Err(Errno(libc::EADDRNOTAVAIL));
        }
        crate::kmark!("runtime: device borrowed, GID index {gi}");
        // Attached to the host's agent, a process that binds nothing needs
        // no meta-server connection of its own (lookups go through the
        // agent; a bind makes it then). A transparent QP publishes its QPN
        // at creation: made now.
        let attached = crate::node::client::attach();
        if attached {
            // The agent's path ready before the first qconnect (its staging
            // registered by the agent): made here, off the caller's path
            // when this start is in the background.
            let _ = crate::transport::agent::AgentPath::get();
        }
        let own_meta = crate::config::get().virtualize != crate::config::Virtualize::Off || !attached;
        let meta_start = if own_meta { start_meta(&dev, gi) } else { None };
        // A start in the background gives way to the process's first work
        // through the agent between its steps (none when started for a
        // caller: it asked for the runtime, which ended the giving way).
        let give_way = crate::transport::agent::give_way;
        give_way();
        let svc = Service::start(&dev, gi, service::Options { between_steps: give_way, ..Default::default() })?;
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
            recv_bufs: OnceCell::new(),
            preparing: AtomicBool::new(false),
            progress: Mutex::new(LastVqp::default()),
            progress_again: AtomicBool::new(false),
            cqs: Mutex::new(Vec::new()),
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
        let started =
            self.meta_start.lock().take().and_then(|s| s.wait_until(Instant::now() + background_meta_bound())).and_then(|(r, _)| r.ok());
        for meta in self.meta.get().into_iter().chain(started.as_ref()) {
            meta.shutdown();
        }
        // Notifiers are QPs on this PD; a CQ that needs one again makes it
        // again (with the next runtime).
        for cq in self.cqs.lock().iter().filter_map(Weak::upgrade) {
            cq.notifier.lock().take();
        }
    }

    /// Whether process `incarnation` is taken for gone (a link to it
    /// failed, or it did not answer a handshake): its VQPs on the datagram
    /// tier fail with its links' VQPs, and new ones get nowhere until a
    /// connect tries it anew ([`Self::forgive`]).
    pub fn peer_gone(&self, incarnation: u64) -> bool {
        self.gone.lock().contains(&incarnation)
    }

    /// A connect found a binding of process `incarnation`, taken for gone,
    /// still there after looking again: try it anew (a link can fail, or
    /// a process stop answering for a while, and the process live on; if
    /// it is dead, the new connection's work fails as the first did).
    pub fn forgive(&self, incarnation: u64) {
        self.gone.lock().remove(&incarnation);
    }

    /// Process `incarnation` is gone as far as we can tell: its endpoint
    /// leaves the DCCache, and [`Self::peer_gone`] says so.
    fn take_for_gone(&self, incarnation: u64) {
        if let Some(meta) = self.meta.get() {
            meta.forget_process(incarnation);
        }
        self.dgram.forget_process(incarnation);
        self.gone.lock().insert(incarnation);
    }

    /// Process `peer` did not answer a link handshake within
    /// `KRCORE_CONNECT_TIMEOUT_MS` and no link to it is open: it is gone
    /// (its VQPs on the tier fail, as they would on a link whose peer died).
    fn peer_unreachable(&self, peer: crate::meta::Endpoint, index: u16, path: service::Path) {
        if self.svc.live_links().iter().any(|l| l.peer.incarnation == peer.incarnation) {
            return;
        }
        if self.dgram.heard_from(peer.incarnation, peer.qpn, &[peer.gid, path.dgid], connect_timeout()) {
            // Alive on the tier (a handshake can be lost, or late under
            // load): its VQPs stay there; the tier's own retries find a
            // death.
            klog!(Level::Info, "vqp: no link to {:02x?} within the connect timeout, but it answers on the datagram tier", peer.gid);
            return;
        }
        klog!(Level::Warn, "vqp: {:02x?} does not answer: the process is gone; its VQPs move to the error state", peer.gid);
        self.take_for_gone(peer.incarnation);
        for v in vqp::live() {
            v.on_peer_unreachable(peer, index, path);
        }
        crate::stats::inc(crate::stats::Stat::KRCORE_STAT_PEERS_UNREACHABLE);
    }

    /// A weak reference to this runtime (for work that must not keep it).
    pub fn weak_self(&self) -> Weak<Runtime> {
        self.me.get().cloned().unwrap_or_default()
    }

    /// Make link `index` to `peer` over `path` in the background (a
    /// thread of its own for the handshake; one per link at a time), for
    /// VQPs on the datagram tier to move onto.
    pub fn want_link(rt: &Arc<Runtime>, peer: crate::meta::Endpoint, index: u16, path: service::Path) {
        let key = (peer.incarnation, index, path);
        // At KRCORE_MAX_LINKS a new link would only close another one in
        // use (thrashing): the VQP stays on the tier, and asks again later.
        let max = crate::config::get().max_links;
        let full = max > 0 && rt.svc.physical_links() + rt.linking.lock().len() >= max;
        if full || rt.svc.link_to(peer.incarnation, index, path).is_some() || !rt.linking.lock().insert(key) {
            return;
        }
        let weak = Arc::downgrade(rt);
        let body = move || {
            let Some(rt) = weak.upgrade() else { return };
            crate::kmark!("link: made in the background");
            match rt.make_link(&peer, index, path, true) {
                // VQPs with nothing on the tier take it now (the others at
                // their next post once drained): an idle VQP learns of its
                // peer's death from the link's probes.
                Ok(link) => vqp::live().iter().for_each(|v| v.move_if_idle(&link)),
                Err(e) if e.0 == libc::ETIMEDOUT => rt.peer_unreachable(peer, index, path),
                Err(e) => {
                    klog!(Level::Info, "vqp: a background link to {:02x?} failed: {e:?} (its VQPs stay on the datagram tier)", peer.gid)
                }
            }
            rt.linking.lock().remove(&key);
        };
        crate::kmark!("link: starting its thread");
        if std::thread::Builder::new().name("krcore-link".into()).spawn(body).is_err() {
            rt.linking.lock().remove(&key);
        }
    }

    /// [`Runtime::want_link`] at `at`, from the progress thread: the
    /// link's thread is not started on the application's path. Nothing
    /// (not even a wake-up) when a link serves that peer already.
    pub fn want_link_at(&self, at: Instant, peer: crate::meta::Endpoint, index: u16, path: service::Path) {
        if self.svc.link_to(peer.incarnation, index, path).is_some() {
            return;
        }
        let weak = self.weak_self();
        self.svc.defer(
            at,
            Box::new(move || {
                if let Some(rt) = weak.upgrade() {
                    Runtime::want_link(&rt, peer, index, path);
                }
            }),
        );
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

    /// Look after the links on the service thread (a deferred work that
    /// defers itself again): probe the idle ones every
    /// `KRCORE_LINK_PROBE_MS`, close those beyond `KRCORE_MAX_LINKS` and
    /// the duplicates, and finish closes.
    fn schedule_maintenance(rt: &Arc<Runtime>) {
        let cfg = crate::config::get();
        let ms = if cfg.link_probe_ms > 0 { cfg.link_probe_ms } else { MAINTENANCE_MS };
        let weak = Arc::downgrade(rt);
        rt.svc.defer(
            Instant::now() + Duration::from_millis(ms),
            Box::new(move || {
                let Some(rt) = weak.upgrade() else { return };
                if rt.probing.load(Ordering::Acquire) {
                    if crate::config::get().link_probe_ms > 0 {
                        rt.probe_links();
                    }
                    rt.reclaim_links();
                    Runtime::schedule_maintenance(&rt);
                }
            }),
        );
    }

    /// Close the links `links_to_close` names (LINK_CLOSE, see
    /// [`Runtime::close_link`]) and move the closes under way along.
    fn reclaim_links(&self) {
        let cfg = crate::config::get();
        for link in self.svc.links_to_close(cfg.max_links, cfg.link_idle_ms) {
            if self.svc.begin_close(&link) {
                klog!(Level::Info, "vqp: closing the link to {:02x?} (QP {})", link.peer.gid, link.qp.qpn());
            }
        }
        for link in self.svc.closing_links() {
            // Closing links are not probed (once the peer's LINK_CLOSE came
            // its end may be gone); a peer that never answers is dead or
            // stuck: the link fails, as on RC after its retries.
            if !link.close_heard.load(Ordering::Acquire) && link.closing_for_ms() > 2 * TRANSPORT_WAIT.as_millis() as u64 {
                klog!(Level::Warn, "vqp: the peer of link QP {} did not answer its LINK_CLOSE", link.qp.qpn());
                self.link_failed(link.qp.qpn(), ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
                continue;
            }
            self.close_link(&link);
        }
    }

    /// Link close, each side alike (DESIGN.md, "Moving a VQP from one link
    /// to another"): a closing link is handed out no more and takes no new
    /// work; we post a LINK_CLOSE behind everything we sent on it, and our
    /// VQPs move to a new link once it completed (nothing they send there
    /// can overtake what they sent here). The peer's LINK_CLOSE comes after
    /// everything it sent on the link. When both are done and no large
    /// message still needs the link (a READ of a staged payload, a DONE),
    /// the link goes: its VQPs let it go and its QP is destroyed.
    fn close_link(&self, link: &Arc<service::Link>) {
        if !link.close_posted.load(Ordering::Acquire) {
            let h = Header::link(LinkOp::Close, 0, 0, 0);
            // No room: the next tick tries again.
            if super::qp::post_header_as(self, link, &h, |retired| Control::LinkClose { retired }) {
                link.close_posted.store(true, Ordering::Release);
                if let Err(e) = self.svc.want_link_events() {
                    klog!(Level::Warn, "vqp: arming the links' CQ: {e:?}");
                }
            }
        }
        self.finish_close(link);
    }

    /// The link goes if both LINK_CLOSEs are done and nothing needs it.
    fn finish_close(&self, link: &Arc<service::Link>) {
        let qpn = link.qp.qpn();
        if link.is_failed() || !link.close_done.load(Ordering::Acquire) || !link.close_heard.load(Ordering::Acquire) {
            return;
        }
        if link.sq.lock().outstanding() > 0 || self.large.sent_on(qpn) {
            return;
        }
        let live = vqp::live();
        if live.iter().any(|v| v.pins(link)) {
            return;
        }
        if !self.svc.forget_link(qpn) {
            return;
        }
        self.large.forget_link(qpn);
        for v in live {
            v.on_link_closed(link);
        }
        crate::stats::inc(crate::stats::Stat::KRCORE_STAT_LINKS_CLOSED);
        klog!(Level::Info, "vqp: the link to {:02x?} (QP {qpn}) is closed", link.peer.gid);
    }

    /// One READ of 8 bytes of the peer's probe target on every link with
    /// nothing outstanding. RC has no keepalive: a link on which nothing
    /// is posted never learns that its peer died, and the VQPs waiting on
    /// it for messages would wait forever. A busy link needs no probe: its
    /// own WQEs fail. The probe's completion wakes the service thread
    /// (an error one fails the link, see `dispatch`).
    fn probe_links(&self) {
        let mut posted = false;
        for link in self.svc.live_links() {
            let mut sq = link.sq.lock();
            if sq.outstanding() > 0 {
                continue;
            }
            if self.post_probe(&link, &mut sq) {
                posted = true;
                crate::stats::inc(crate::stats::Stat::KRCORE_STAT_LINK_PROBES);
            }
        }
        if posted {
            if let Err(e) = self.svc.want_link_events() {
                klog!(Level::Warn, "vqp: arming the links' CQ: {e:?}");
            }
        }
    }

    /// Post one signaled 8-byte READ of the peer's probe target on `link` (its
    /// accounting `sq` held): a probe, or a fence behind WQEs a teardown
    /// waits for. Whether it was posted.
    fn post_probe(&self, link: &service::Link, sq: &mut super::queue::PhysSq) -> bool {
        let Ok(probe_buf) = self.probe_buf() else { return false };
        let Some(d) = sq.try_post(true) else { return false };
        let tag = self.next_tag();
        self.large.track(tag, Control::Probe { retired: d.retired });
        let mut sge = probe_buf.sge(0, PROBE_LEN);
        let mut wr = control_read_wr(tag, &mut sge, link.peer_probe.0, link.peer_probe.1);
        // SAFETY: one READ into our own registered buffer from the
        // peer's probe target (registered for remote READ by the peer).
        match unsafe { link.qp.post_send(&mut wr) } {
            Ok(()) => true,
            Err(e) => {
                self.large.take(tag);
                let _ = sq.on_completion(d.retired);
                klog!(Level::Warn, "vqp: cannot post a READ on the link to {:?}: {e:?}", link.peer.gid);
                false
            }
        }
    }

    /// Make sure the WQEs posted on `link` before `mark` will be reported
    /// complete: they are, or a signaled WQE behind them will retire them
    /// (RC completes in order), or one is posted now (the 8-byte READ of a
    /// probe; nothing on a link that failed, whose fence covers all, or
    /// whose LINK_CLOSE, signaled, is posted behind). False when the link
    /// had no room: make progress and ask again.
    pub fn fence_after(&self, link: &service::Link, mark: u64) -> bool {
        let mut sq = link.sq.lock();
        if sq.reached(mark) || sq.covered(mark) || link.is_failed() || link.close_posted.load(Ordering::Acquire) {
            return true;
        }
        if !self.post_probe(link, &mut sq) {
            return false;
        }
        drop(sq);
        if let Err(e) = self.svc.want_link_events() {
            klog!(Level::Warn, "vqp: arming the links' CQ: {e:?}");
        }
        true
    }

    /// Where each link with WQEs not yet completed stands now.
    pub fn link_marks(&self) -> Vec<(Arc<service::Link>, u64)> {
        self.svc
            .all_links()
            .into_iter()
            .filter_map(|l| {
                let m = {
                    let sq = l.sq.lock();
                    (!sq.reached(sq.mark())).then(|| sq.mark())
                };
                m.map(|m| (l, m))
            })
            .collect()
    }

    /// An error completion came on link `qpn`: RC moved its QP to the error
    /// state, for good (the peer died, or cannot be reached). The link is
    /// handed out no more, the peer's endpoint leaves the DCCache, and a
    /// fence posted behind the link's WQEs says when all of their (flushed)
    /// completions were seen; then the link's VQPs move to the error state.
    pub(super) fn link_failed(&self, qpn: u32, status: u32) {
        let Some(link) = self.svc.fail_link(qpn) else { return };
        klog!(
            Level::Warn,
            "vqp: the link to {:02x?} (QP {qpn}) failed with status {status}: the peer is gone; its VQPs move to the error state",
            link.peer.gid
        );
        self.take_for_gone(link.peer.incarnation);
        let tag = self.next_tag();
        self.large.track(tag, Control::Fence { link_qpn: qpn });
        // SAFETY: a plain C struct.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = WrId::Control { tag }.encode();
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        // SAFETY: a WR without data; the QP is in ERR and flushes it.
        if let Err(e) = unsafe { link.qp.post_send(&mut wr) } {
            // No fence: what is still in flight on the link completes as
            // stale (the VQPs' queues are flushed already by then).
            klog!(Level::Debug, "vqp: no fence on the failed link: {e:?}");
            self.large.take(tag);
            self.link_gone(&link);
        }
    }

    /// Every completion of a failed link was seen: its VQPs move to the
    /// error state, what it held goes.
    fn link_gone(&self, link: &Arc<service::Link>) {
        let qpn = link.qp.qpn();
        // Its QP is in ERR and every WQE's completion came: nothing on it
        // touches memory any more (what teardowns wait for).
        link.sq.lock().set_drained();
        self.svc.forget_link(qpn);
        self.large.forget_link(qpn);
        // The peer's MRs are forgotten with it (a new connect reads them
        // again); VQPs holding them keep theirs until they go.
        self.peer_mrs.lock().remove(&link.peer.incarnation);
        for v in vqp::live() {
            v.on_link_failed(link);
        }
    }

    /// `n` contiguous header slots: from an arena with room, else from a
    /// new arena (one registration per HDR_ARENA_SLOTS slots, not one per
    /// VQP); None when `n` is larger than an arena.
    pub fn alloc_hdrs(&self, n: u32) -> Result<Option<(Arc<HdrArena>, u32)>> {
        if n > HDR_ARENA_SLOTS {
            return Ok(None);
        }
        let mut arenas = self.hdr_arenas.lock();
        for a in arenas.iter() {
            if let Some(start) = a.free.lock().alloc(n) {
                return Ok(Some((Arc::clone(a), start)));
            }
        }
        // A small first arena: most processes need no more.
        let slots = if arenas.is_empty() && n <= FIRST_HDR_ARENA_SLOTS { FIRST_HDR_ARENA_SLOTS } else { HDR_ARENA_SLOTS };
        let a = Arc::new(HdrArena::new(self.svc.device(), slots)?);
        let start = a.free.lock().alloc(n);
        arenas.push(Arc::clone(&a));
        Ok(start.map(|s| (a, s)))
    }

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
                match super::mrcheck::ask(self, &link, rkey, info.addr) {
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

    /// Make the links' side and receive buffers on a thread of their own,
    /// unless made or being made (a failure is logged; the next link, or
    /// the next link request, tries again).
    pub fn prepare_links(self: &Arc<Self>) {
        if self.recv_bufs.get().is_some() || self.preparing.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak = Arc::downgrade(self);
        let body = move || {
            crate::transport::agent::give_way();
            let Some(rt) = weak.upgrade() else { return };
            if let Err(e) = rt.receive_side() {
                klog!(Level::Warn, "vqp: the links' side and receive buffers: {e:?} (tried again by the next link)");
            }
            rt.preparing.store(false, Ordering::Release);
        };
        if let Err(e) = std::thread::Builder::new().name("krcore-prepare".into()).spawn(body) {
            klog!(Level::Warn, "vqp: no thread to prepare the links ({e}): the first link does it");
            self.preparing.store(false, Ordering::Release);
        }
    }

    /// The links' receive buffers, registered and posted on the SRQ the
    /// first time (a link needs them before its peer's first message:
    /// until then the peer's RC retries on RNR).
    pub fn receive_side(&self) -> Result<&Region> {
        self.recv_bufs.get_or_try_init(|| {
            // The links' own buffers first (a link's first post finds them).
            self.probe_buf()?;
            if self.hdr_arenas.lock().is_empty() {
                let first = Arc::new(HdrArena::new(self.svc.device(), FIRST_HDR_ARENA_SLOTS)?);
                let mut arenas = self.hdr_arenas.lock();
                if arenas.is_empty() {
                    arenas.push(first);
                }
            }
            crate::kmark!("runtime: header arena and probe registered");
            let n = service::Options::default().srq_wr;
            let bufs = Region::new(self.svc.device(), n as usize * RECV_BUF, rdma::LOCAL_WRITE)?;
            for buf in 0..n {
                self.post_recv_buf(&bufs, buf)?;
            }
            crate::kmark!("runtime: the links' receives posted");
            Ok(bufs)
        })
    }

    fn probe_buf(&self) -> Result<&Region> {
        self.probe_buf.get_or_try_init(|| Region::new(self.svc.device(), PROBE_LEN, rdma::LOCAL_WRITE))
    }

    /// Link `index` to `peer` over `path`, made (or the one that serves),
    /// within the connect timeout, our receives posted first; `optional`:
    /// a peer at its link limit may refuse it.
    pub fn make_link(&self, peer: &crate::meta::Endpoint, index: u16, path: service::Path, optional: bool) -> Result<Arc<service::Link>> {
        self.receive_side()?;
        if optional {
            self.svc.optional_link(peer, index, path, connect_timeout())
        } else {
            self.svc.link(peer, index, path, connect_timeout())
        }
    }

    fn post_recv_buf(&self, bufs: &Region, buf: u32) -> Result<()> {
        let mut sge = bufs.sge(buf as usize * RECV_BUF, RECV_BUF);
        // SAFETY: a plain C struct.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = WrId::Recv { buf }.encode();
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        // SAFETY: one WR over our own registered buffer.
        unsafe { self.svc.srq()?.post_recv(&mut wr) }
    }

    /// Poll the links' completions and deliver them. Returns at once when
    /// another thread is already doing it.
    pub fn progress(&self) {
        self.progress_for(true, None);
    }

    /// Progress for a poll of an application CQ: the links' messages are
    /// taken only when it `receives` (or a large send awaits its DONE,
    /// which comes as a message); else they wait for a CQ that receives or
    /// for the service thread, which takes them while nobody polls for
    /// them (`polls` tells it).
    /// Completions for the CQ behind `sink` go into it (see [`Sink`]).
    pub fn progress_for(&self, receives: bool, mut sink: Option<&mut Sink<'_>>) {
        if self.dgram.busy() {
            self.svc.poll_datagrams();
        }
        let mut messages = receives || self.large.awaits_done();
        if messages {
            // A plain store, not a locked increment: the service thread
            // only asks whether it changed.
            self.polls.store(self.polls.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
        }
        loop {
            let mut last = match self.progress.try_lock() {
                Some(l) => l,
                None => {
                    // Flag, then try again: the holder looks at the flag
                    // after releasing, so one of the two drains.
                    self.progress_again.store(true, Ordering::SeqCst);
                    match self.progress.try_lock() {
                        Some(l) => l,
                        None => return,
                    }
                }
            };
            self.drain(&mut last, messages, sink.as_deref_mut());
            drop(last);
            // A load first: the swap is a locked instruction, rarely needed.
            if !self.progress_again.load(Ordering::SeqCst) || !self.progress_again.swap(false, Ordering::SeqCst) {
                return;
            }
            // For the other thread, which may have wanted the messages.
            messages = true;
        }
    }

    /// Deliver the messages that landed in the links' receive buffers
    /// (waiting for a thread that is delivering some now). A VQP whose link
    /// closed sends on the datagram tier once its last WQE there completed,
    /// that is once its messages landed here, not once they were taken: the
    /// tier delivers a flow's messages after this, so they cannot overtake
    /// them.
    pub(crate) fn take_link_messages(&self) {
        if self.svc.link_cqs().is_some() {
            self.progress_messages();
        }
    }

    /// The service thread's pass over the links' messages: it waits for
    /// the progress lock (the messages must be taken off the shared
    /// buffers), then, like [`Runtime::progress_for`], drains once more
    /// for a thread that found the lock held meanwhile and left its work
    /// to this one (an application arming its CQ relies on that pass for
    /// a completion that came before the links' CQ was armed).
    fn progress_messages(&self) {
        let mut last = self.progress.lock();
        self.drain(&mut last, true, None);
        drop(last);
        if self.progress_again.load(Ordering::SeqCst) && self.progress_again.swap(false, Ordering::SeqCst) {
            self.progress_for(true, None);
        }
    }

    /// Poll the links' send (and, with `messages`, receive) completions
    /// and deliver them (the progress lock held).
    fn drain(&self, last: &mut LastVqp, messages: bool, mut sink: Option<&mut Sink<'_>>) {
        const BATCH: usize = 32;
        let mut wcs = [const { std::mem::MaybeUninit::<ibv_wc>::uninit() }; BATCH];
        // No link side yet: no link, nothing to poll.
        let both = self.svc.link_cqs();
        for cq in [both.map(|b| b.0), both.filter(|_| messages).map(|b| b.1)].into_iter().flatten() {
            loop {
                let got = match cq.poll_uninit(&mut wcs) {
                    Ok(got) => got,
                    Err(e) => {
                        klog!(Level::Warn, "vqp: polling the links: {e:?}");
                        return;
                    }
                };
                for wc in got {
                    self.dispatch(wc, last, sink.as_deref_mut());
                }
                if got.len() < BATCH {
                    break;
                }
            }
        }
        // Receivers of large messages that found no room on their link.
        for (slot, gen) in self.large.take_waiting() {
            if let Some(v) = vqp::lookup(slot, gen) {
                v.pump_large();
            }
        }
        super::mrcheck::pump_owed(self);
        self.pump_grants();
        self.wire.check(self);
    }

    /// A fresh tag for a control WQE's wr_id.
    pub fn next_tag(&self) -> u32 {
        self.next_tag.fetch_add(1, Ordering::Relaxed)
    }

    fn dispatch(&self, wc: &ibv_wc, last: &mut LastVqp, sink: Option<&mut Sink<'_>>) {
        self.dispatch_one(wc, last, sink);
        // Any error completion of a link's send queue (the receive side's
        // are flushes of the SRQ's buffers, handled there) means its QP
        // is in ERR: every VQP on it follows.
        if wc.status != ibv_wc_status::IBV_WC_SUCCESS && !matches!(WrId::decode(wc.wr_id), Ok(WrId::Recv { .. })) {
            self.link_failed(wc.qp_num, wc.status);
        }
    }

    fn dispatch_one(&self, wc: &ibv_wc, last: &mut LastVqp, sink: Option<&mut Sink<'_>>) {
        let id = match WrId::decode(wc.wr_id) {
            Ok(id) => id,
            Err(_) => {
                klog!(Level::Warn, "vqp: a completion with a foreign wr_id {:#x}", wc.wr_id);
                return;
            }
        };
        match id {
            WrId::Recv { buf } => self.on_message(buf, wc),
            WrId::Send(s) => {
                // The VQP's own link does the accounting (one lookup less
                // per completion); a destroyed VQP's, the link by number.
                let accounted = match last.get(s.slot(), s.generation()) {
                    Some(v) => v.on_send_completion(s.seq(), wc.status, wc.qp_num, s.retired(), sink),
                    None => false,
                };
                if !accounted {
                    if let Some(link) = self.svc.link_by_qpn(wc.qp_num).filter(|l| !l.is_failed()) {
                        if let Err(e) = link.sq.lock().on_completion(s.retired()) {
                            klog!(Level::Warn, "vqp: link accounting: {e:?}");
                        }
                    }
                }
            }
            WrId::Control { tag } => match self.large.take(tag) {
                Some(Control::Fence { link_qpn }) => {
                    if let Some(link) = self.svc.link_by_qpn(link_qpn) {
                        self.link_gone(&link);
                    }
                }
                Some(c) => {
                    if let Some(link) = self.svc.link_by_qpn(wc.qp_num).filter(|l| !l.is_failed()) {
                        if let Err(e) = link.sq.lock().on_completion(c.retired()) {
                            klog!(Level::Warn, "vqp: link accounting: {e:?}");
                        }
                    }
                    match c {
                        Control::Read { slot, gen, .. } => {
                            if let Some(v) = vqp::lookup(slot, gen) {
                                v.on_large_read(wc.status);
                            }
                        }
                        Control::LinkClose { .. } => {
                            if let Some(link) = self.svc.link_by_qpn(wc.qp_num) {
                                if wc.status == ibv_wc_status::IBV_WC_SUCCESS {
                                    link.close_done.store(true, Ordering::Release);
                                    self.finish_close(&link);
                                }
                            }
                        }
                        Control::Header { .. } | Control::Bind { .. } | Control::Probe { .. } | Control::Fence { .. } => {}
                    }
                }
                None => klog!(Level::Warn, "vqp: a completion for no control WQE of ours (tag {tag})"),
            },
        }
    }

    /// A message landed in receive buffer `buf`.
    fn on_message(&self, buf: u32, wc: &ibv_wc) {
        if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
            // Flushed: its link went down; the buffer is gone with it.
            return;
        }
        let off = buf as usize * RECV_BUF;
        let Some(bufs) = self.recv_bufs.get() else { return };
        // SAFETY: this buffer's receive completed; it is reposted below
        // once the message is copied out.
        let bytes = unsafe { bufs.bytes(off, RECV_BUF) };
        let link = self.svc.link_by_qpn(wc.qp_num);
        if let Some(l) = &link {
            self.svc.heard_on(l);
        }
        match Header::received(bytes, wc.byte_len, MAX_MSG) {
            Ok(h) if h.flags.contains(Flags::LINK) => match (link, h.link_op()) {
                (Some(link), Some(LinkOp::Close)) => {
                    // Everything the peer sent on it came before this.
                    link.close_heard.store(true, Ordering::Release);
                    if self.svc.begin_close(&link) {
                        klog!(Level::Info, "vqp: the peer closes the link to {:02x?} (QP {})", link.peer.gid, wc.qp_num);
                    }
                    self.close_link(&link);
                }
                (Some(link), Some(LinkOp::MrCheck)) => super::mrcheck::on_check(self, &link, &h),
                (Some(_), Some(LinkOp::MrAnswer)) => {
                    let payload = &bytes[HEADER_LEN..HEADER_LEN + h.carried_len() as usize];
                    super::mrcheck::on_answer(self, wc.qp_num, &h, payload);
                }
                (Some(link), Some(LinkOp::Grant)) => {
                    if !link.credit.granted(h.addr) {
                        crate::stats::inc(crate::stats::Stat::KRCORE_STAT_MSGS_OVERRUN);
                        klog!(Level::Debug, "vqp: a grant of {} bytes, more than we sent on QP {}: ignored", h.addr, wc.qp_num);
                    }
                }
                _ => klog!(Level::Warn, "vqp: a {:?} message on no link of ours (QP {})", h.link_op(), wc.qp_num),
            },
            Ok(h) if h.flags.contains(Flags::DONE) => match self.large.on_done(h.addr, wc.qp_num) {
                Some((slot, gen, seq)) => {
                    if let Some(v) = vqp::lookup(slot, gen) {
                        v.on_large_done(seq, h.imm);
                    }
                }
                None => klog!(Level::Warn, "vqp: dropped a DONE for no message of ours ({:#x})", h.addr),
            },
            Ok(h) => {
                // Exactly what arrived (checked by `received`).
                let payload = &bytes[HEADER_LEN..HEADER_LEN + h.carried_len() as usize];
                match link {
                    Some(link) => self.on_vqp_message(&h, payload, &link),
                    None => klog!(Level::Debug, "vqp: dropped a message on no link of ours (QP {})", wc.qp_num),
                }
            }
            Err(e) => {
                // A header that does not decode, or whose length is not
                // what arrived: delivering it would hand the application
                // stale bytes of this shared buffer. Its sender broke the
                // protocol; nothing more it sends can be trusted.
                crate::stats::inc(crate::stats::Stat::KRCORE_STAT_MSGS_MALFORMED);
                klog!(
                    Level::Warn,
                    "vqp: dropped a malformed message of {} bytes on QP {} ({e:?}): failing its link",
                    wc.byte_len,
                    wc.qp_num
                );
                self.link_failed(wc.qp_num, ibv_wc_status::IBV_WC_LOC_PROT_ERR);
            }
        }
        if let Err(e) = self.post_recv_buf(bufs, buf) {
            klog!(Level::Warn, "vqp: cannot repost a receive buffer: {e:?}");
        }
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

#[cfg(test)]
mod tests {
    use super::{PeerMrs, Ranges};
    use crate::testing::Rng;
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

    #[test]
    fn slot_ranges_allocate_first_fit_and_merge_back() {
        let mut r = Ranges::new(100);
        assert_eq!(r.alloc(30), Some(0));
        assert_eq!(r.alloc(30), Some(30));
        assert_eq!(r.alloc(50), None, "40 left");
        r.free(0, 30);
        assert_eq!(r.alloc(40), Some(60));
        r.free(30, 30);
        assert_eq!(r.0, vec![(0, 60)], "neighbours merged");
        r.free(60, 40);
        assert_eq!(r.0, vec![(0, 100)]);
        // Random alloc/free against a bitmap model: no slot twice.
        let mut rng = Rng(7);
        let mut used = [false; 100];
        let mut live: Vec<(u32, u32)> = Vec::new();
        for _ in 0..10_000 {
            if rng.chance(50) && !live.is_empty() {
                let (s, n) = live.swap_remove(rng.below(live.len() as u64) as usize);
                (s..s + n).for_each(|i| used[i as usize] = false);
                r.free(s, n);
            } else {
                let n = 1 + rng.below(10) as u32;
                if let Some(s) = r.alloc(n) {
                    assert!((s..s + n).all(|i| !used[i as usize]), "slot handed out twice");
                    (s..s + n).for_each(|i| used[i as usize] = true);
                    live.push((s, n));
                }
            }
        }
        for (s, n) in live {
            r.free(s, n);
        }
        assert_eq!(r.0, vec![(0, 100)], "everything merged back");
    }
}
