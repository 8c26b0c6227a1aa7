//! The completions VQPs deliver into an application's CQ: its software
//! queue, the runtimes that must make progress before it is polled, and
//! the notifier that raises its completion events.

use super::*;

/// The wr_id of a notifier's sends (with its QP number, tells them apart
/// from the application's own completions on the same real CQ).
pub const NOTIFY_WR_ID: u64 = 0x4b52_4e4f_5449_4659;

/// Raises a completion event on an application's CQ from software: a
/// zero-length UD send to itself (dropped at the receive side: nothing is
/// posted there) whose send completion lands in the application's real
/// CQ, which the kernel then signals on the CQ's completion channel like
/// any other completion. `ibv_poll_cq` drops that completion.
///
/// Its objects are on a PD of its own: it needs no runtime (a VQP on the
/// agent's path completes before its process's runtime is up), and the
/// application may deallocate its PDs before it destroys the CQ.
struct Notifier {
    qp: Qp,
    ah: Ah,
    _cq: Arc<Cq>,
    _dev: Arc<Device>,
}

impl Notifier {
    fn new(real_cq: *mut ibv_cq) -> Result<Notifier> {
        // SAFETY: the application's live CQ and its context, which
        // outlives it.
        let dev = unsafe { Device::with_own_pd((*real_cq).context) }?;
        let cq = Arc::new(Cq::new(&dev, 4)?);
        let caps = Caps { send_wr: 64, recv_wr: 1, send_sge: 1, recv_sge: 1, inline: 0 };
        let qp = Qp::with_send_cq(&dev, ibv_qp_type::IBV_QPT_UD, SendCq::Foreign(real_cq), &cq, None, caps)?;
        qp.ud_ready()?;
        // To itself: any usable GID of the port.
        let index = dev.default_gid_index()?;
        let mut attr = qp.ah_attr(index, &dev.gid(index)?);
        let ah = Ah::new(&dev, &mut attr)?;
        Ok(Notifier { qp, ah, _cq: cq, _dev: dev })
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
            match Notifier::new(self.real_cq) {
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
