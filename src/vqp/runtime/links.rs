//! The runtime's links: asked for, made, probed, closed beyond
//! `KRCORE_MAX_LINKS` or when they fail; the peers taken for gone; the
//! links' side (header arenas, the shared receive buffers, the probe
//! target).

use super::*;

/// How long a closed link's QP outlives its close: the peer's RC retries
/// of its last message (`rdma::Qp::to_rts`: 7 tries of 537 ms).
const LINGER: Duration = Duration::from_secs(4);

/// Header slots of in-flight SENDs, carved per VQP (one per send-queue
/// entry, taken at its first SEND) out of registered arenas of
/// HDR_ARENA_SLOTS slots: a registration per VQP would cost a kernel call
/// on its first send.
pub const HDR_SLOT: usize = HEADER_LEN + crate::vqp::qp::MAX_INLINE as usize;
const HDR_ARENA_SLOTS: u32 = 8192;
/// The arena made with the runtime is small (a few VQPs' worth): the
/// start registers it in front of the first operation; the next ones, made
/// as VQPs need them, are full size.
pub(super) const FIRST_HDR_ARENA_SLOTS: u32 = 512;

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
pub(in crate::vqp) struct Ranges(Vec<(u32, u32)>);

impl Ranges {
    pub(in crate::vqp) fn new(n: u32) -> Ranges {
        Ranges(vec![(0, n)])
    }

    pub(in crate::vqp) fn alloc(&mut self, n: u32) -> Option<u32> {
        let i = self.0.iter().position(|&(_, len)| len >= n)?;
        let (start, len) = self.0[i];
        if len == n {
            self.0.remove(i);
        } else {
            self.0[i] = (start + n, len - n);
        }
        Some(start)
    }

    pub(in crate::vqp) fn free(&mut self, start: u32, n: u32) {
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

impl Runtime {
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
        if self.gone.lock().insert(incarnation) {
            crate::stats::inc(crate::stats::Stat::KRCORE_STAT_PEERS_GONE);
        }
    }

    /// Process `peer` did not answer a link handshake within
    /// `KRCORE_CONNECT_TIMEOUT_MS` and no link to it is open: it is gone
    /// (its VQPs on the tier fail, as they would on a link whose peer
    /// died), unless it answers on the tier, its binding or meta-server
    /// connection stays, or, the meta server knowing nothing of it, it sent
    /// to us within the tier's bound (then its VQPs stay on the tier, whose
    /// own retries and doubts find a death).
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
        // As a silent flow's doubt is settled (`find_out`): the meta
        // server's word, and with none (a fresh process whose own meta
        // connection is still being made, in a burst), its traffic within
        // the tier's bound.
        let tier_bound = Duration::from_micros(crate::transport::dgram::port::LIVE_BOUND_US);
        let vouched = match self.liveness(peer.incarnation, &peer.gid) {
            super::liveness::Liveness::Alive => Some("the meta server vouches for it"),
            super::liveness::Liveness::Unknown if self.dgram.heard_from(peer.incarnation, peer.qpn, &[peer.gid, path.dgid], tier_bound) => {
                Some("it sent to us within the tier's bound")
            }
            _ => None,
        };
        if let Some(why) = vouched {
            crate::stats::inc(crate::stats::Stat::KRCORE_STAT_PEERS_VOUCHED);
            klog!(Level::Info, "vqp: no link to {:02x?} within the connect timeout, but {why}", peer.gid);
            return;
        }
        self.peer_is_gone(peer, index, path);
    }

    /// Process `peer` does not answer and nothing vouches for it: it is
    /// gone; its VQPs move to the error state.
    pub(super) fn peer_is_gone(&self, peer: crate::meta::Endpoint, index: u16, path: service::Path) {
        klog!(
            Level::Warn,
            "vqp: {:02x?} does not answer and nothing vouches for it: the process is gone; its VQPs move to the error state",
            peer.gid
        );
        self.take_for_gone(peer.incarnation);
        for v in vqp::live() {
            v.on_peer_unreachable(peer, index, path);
        }
        crate::stats::inc(crate::stats::Stat::KRCORE_STAT_PEERS_UNREACHABLE);
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

    /// Look after the links on the service thread (a deferred work that
    /// defers itself again): probe the idle ones every
    /// `KRCORE_LINK_PROBE_MS`, close those beyond `KRCORE_MAX_LINKS` and
    /// the duplicates, and finish closes.
    pub(super) fn schedule_maintenance(rt: &Arc<Runtime>) {
        let ms = crate::config::get().link_tick_ms();
        let weak = Arc::downgrade(rt);
        rt.svc.defer(
            Instant::now() + Duration::from_millis(ms),
            Box::new(move || {
                let Some(rt) = weak.upgrade() else { return };
                if rt.probing.load(Ordering::Acquire) {
                    // What completed first: a link with a WQE outstanding
                    // is not probed, and the completion of a header posted
                    // here (an MR check's answer) raises no event: until
                    // the next message woke a progress run, its link went
                    // unprobed (`vqp_reclaim`'s readers, once their checks
                    // came every 2.5 s). Send completions only: taking the
                    // messages here would look like the application
                    // polling to the service thread (`polls`).
                    rt.progress_for(false, None);
                    rt.probe_links(crate::config::get().link_probe_ms > 0);
                    rt.reclaim_links();
                    Runtime::schedule_maintenance(&rt);
                }
            }),
        );
    }

    /// Close the links `links_to_close` names (LINK_CLOSE, see
    /// [`Runtime::close_link`]) and move the closes under way along.
    pub(super) fn reclaim_links(&self) {
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
    pub(super) fn close_link(&self, link: &Arc<service::Link>) {
        if !link.close_posted.load(Ordering::Acquire) {
            let h = Header::link(LinkOp::Close, 0, 0, 0);
            // No room: the next tick tries again. Posted, it marks the
            // link `close_posted` (under its send lock).
            if crate::vqp::qp::post_header_as(self, link, &h, |retired| Control::LinkClose { retired }) {
                if let Err(e) = self.svc.want_link_events() {
                    klog!(Level::Warn, "vqp: arming the links' CQ: {e:?}");
                }
            }
        }
        self.finish_close(link);
    }

    /// The link goes if both LINK_CLOSEs are done and nothing needs it.
    pub(super) fn finish_close(&self, link: &Arc<service::Link>) {
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
        // Its QP lingers: our ACK of the peer's LINK_CLOSE may not have
        // reached it (rxe reports a message received before it sends the
        // ACK; an ACK can be lost), and its retransmission must find a QP
        // that ACKs it again, not none (its LINK_CLOSE would fail
        // `IBV_WC_RETRY_EXC_ERR` and take us for gone: `vqp_reclaim`'s LRU
        // case, both processes' VQPs flushed).
        let lingering = Arc::clone(link);
        self.svc.defer(Instant::now() + LINGER, Box::new(move || drop(lingering)));
    }

    /// One READ of 8 bytes of the peer's probe target on every link with
    /// nothing outstanding (`all`; else only on the accepted links not
    /// confirmed yet). RC has no keepalive: a link on which nothing
    /// is posted never learns that its peer died, and the VQPs waiting on
    /// it for messages would wait forever. A busy link needs no probe: its
    /// own WQEs fail. The probe's completion wakes the service thread
    /// (an error one fails the link, see `dispatch`; a good one confirms
    /// it, if its LINK_READY was lost).
    fn probe_links(&self, all: bool) {
        let mut posted = false;
        for link in self.svc.live_links().into_iter().filter(|l| all || !l.confirmed()) {
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
    fn post_probe(&self, link: &service::Link, sq: &mut crate::vqp::queue::PhysSq) -> bool {
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
    pub(in crate::vqp) fn link_failed(&self, qpn: u32, status: u32) {
        let Some(link) = self.svc.fail_link(qpn) else { return };
        if link.confirmed() {
            klog!(
                Level::Warn,
                "vqp: the link to {:02x?} (QP {qpn}) failed with status {status}: the peer is gone; its VQPs move to the error state",
                link.peer.gid
            );
            self.take_for_gone(link.peer.incarnation);
        } else {
            // Accepted, never confirmed: its requester may have given the
            // handshake up (a process starved of CPU), and lives on; what
            // went on the link fails, and whether the process lives is
            // asked (a requester killed during its handshake is gone).
            klog!(
                Level::Info,
                "vqp: the link to {:02x?} (QP {qpn}), never confirmed by its peer, failed with status {status}: does its process live?",
                link.peer.gid
            );
            let p = &link.peer;
            let at =
                crate::transport::dgram::port::Peer { sgid_index: link.path.sgid_index, dgid: link.path.dgid, qpn: p.qpn, qkey: p.qkey };
            if !self.find_out(p.incarnation, &at, p.gid) {
                klog!(Level::Debug, "vqp: no thread to find out whether {:02x?} lives", p.gid);
            }
        }
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
    pub(super) fn link_gone(&self, link: &Arc<service::Link>) {
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
            v.on_link_failed(link, link.confirmed());
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

    pub(super) fn post_recv_buf(&self, bufs: &Region, buf: u32) -> Result<()> {
        let mut sge = bufs.sge(buf as usize * RECV_BUF, RECV_BUF);
        // SAFETY: a plain C struct.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = WrId::Recv { buf }.encode();
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        // SAFETY: one WR over our own registered buffer.
        unsafe { self.svc.srq()?.post_recv(&mut wr) }
    }
}

#[cfg(test)]
mod tests {
    use super::Ranges;
    use crate::testing::Rng;

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
