//! A VQP's connection: `qbind`, `qconnect`, a transparent VQP's RC state
//! machine (connect at RTR), and what becomes of the connection when its
//! link closes, fails or cannot be made.

use super::*;

impl Vqp {
    /// `qbind`: publish (gid, port) -> this VQP.
    pub fn bind(self: &Arc<Self>, gid: [u8; 16], port: u32) -> Result<()> {
        {
            let st = self.st.lock();
            if st.conn.is_some() || st.bound.is_some() {
                return Err(Errno::EINVAL);
            }
        }
        let dev_gid_index = {
            // SAFETY: a plain C union; the application's live real context.
            let probe = unsafe { rdma::Device::borrow(self.app.real_ctx, self.app.real_pd) }?;
            probe.gid_index(&gid)?
        };
        let rt = self.runtime(Some(dev_gid_index))?;
        let key = crate::meta::Key::Port { gid, port };
        let ep = Endpoint { vqpn: self.vqpn, ..rt.svc.endpoint() };
        rt.meta()?.bind(&key, &ep)?;
        self.st.lock().bound = Some(key);
        Ok(())
    }

    /// `qconnect`: look (gid, port) up and attach to the link to its process.
    pub fn connect(&self, gid: [u8; 16], port: u32) -> Result<()> {
        {
            let st = self.st.lock();
            if st.conn.is_some() || st.bound.is_some() || st.rc.is_some() || self.agent.lock().is_some() {
                return Err(Errno::EINVAL);
            }
        }
        let key = crate::meta::Key::Port { gid, port };
        match self.connect_via_agent(&key) {
            super::agent::Via::Agent => Ok(()),
            super::agent::Via::Own => self.connect_to(&key, None, None),
        }
    }

    /// Which of the process's links to a peer this VQP uses: VQPs spread
    /// over them by slot (`KRCORE_LINKS_PER_PEER`).
    pub(super) fn link_index(&self) -> u16 {
        (self.slot % crate::config::get().links_per_peer) as u16
    }

    /// Look `key` up (unless `known`: looked up fresh by the caller) and
    /// attach to the link to the process it names, from our GID at
    /// `sgid_index` to the key's GID (None: between the two processes'
    /// home GIDs).
    pub(super) fn connect_to(&self, key: &crate::meta::Key, sgid_index: Option<u32>, known: Option<Endpoint>) -> Result<()> {
        let key = *key;
        let rt = self.runtime(None)?;
        let index = self.link_index();
        // An address (`qconnect`) may have been bound anew since it was
        // cached, by a process started after its binder died: the meta
        // server says who holds it now (one READ). A QPN key (RTR of a
        // transparent VQP) names one VQP for its life: cached.
        let fresh = matches!(key, crate::meta::Key::Port { .. });
        if crate::config::get().dgram {
            // The peer's endpoint is on the key's GID, most likely: its
            // address handle is made meanwhile, for the first post.
            let (crate::meta::Key::Port { gid, .. } | crate::meta::Key::Vqpn { gid, .. }) = key;
            rt.svc.prepare_path_soon(Path { sgid_index: sgid_index.unwrap_or(rt.svc.gid_index()), dgid: gid });
        }
        let mut ep = match known {
            Some(ep) => ep,
            None => rt.resolve(&key, fresh)?.ok_or(Errno(libc::ECONNREFUSED))?,
        };
        let mut looked_again = false;
        loop {
            rt.remember_key(&key, &ep);
            if let Some(pm) = self.peer_mrs.get() {
                // A VQP's pre-checks use one peer's MRs for its life:
                // a transparent VQP brought back from RESET reconnects only
                // to a VQP of the same process (documented limit).
                if !Arc::ptr_eq(pm, &rt.peer_mrs(ep.incarnation)) {
                    klog!(Level::Warn, "vqp {:#x}: reconnecting to another process after RESET is not supported", self.qpn());
                    return Err(Errno::EINVAL);
                }
            }
            let path = match (sgid_index, key) {
                (Some(sgid_index), crate::meta::Key::Vqpn { gid, .. }) => Path { sgid_index, dgid: gid },
                _ => rt.svc.default_path(&ep),
            };
            if crate::config::get().dgram && rt.peer_gone(ep.incarnation) {
                // A binding of a process taken for gone: ask again. Gone:
                // ECONNREFUSED; bound by another process now: that one;
                // the same one still: try it anew.
                if looked_again {
                    rt.forgive(ep.incarnation);
                    continue;
                }
                looked_again = true;
                ep = rt.resolve(&key, true)?.ok_or(Errno(libc::ECONNREFUSED))?;
                continue;
            }
            if crate::config::get().dgram {
                // No handshake: the first posts go on the datagram tier
                // while the link is made (tier.rs).
                self.attach_at(rt, None, ep, index, path, ep.vqpn);
                crate::kmark!("qconnect: on the datagram tier");
                // A `qconnect`: asked for at the first completion on the
                // tier (tier.rs), or by now + ASK_LATE if nothing is posted
                // meanwhile. A transparent VQP: now (an unmodified program
                // may stream at once, and its peer asks ASK_LATE after its
                // own first post: a link by then keeps the two from making
                // one each).
                if crate::config::get().link_after == 0 && self.asks_first(rt, &ep) {
                    let transparent = self.st.lock().rc.is_some();
                    let after = if transparent { std::time::Duration::ZERO } else { super::tier::ASK_LATE };
                    rt.want_link_at(std::time::Instant::now() + after, ep, index, path);
                }
                return Ok(());
            }
            match rt.make_link(&ep, index, path, false) {
                Ok(link) => {
                    self.attach(rt, link, ep, ep.vqpn);
                    return Ok(());
                }
                Err(e) if e.0 == libc::ETIMEDOUT || e.0 == libc::ECONNREFUSED => {
                    // The cached endpoint may be stale: ask the meta server
                    // again. Gone: ECONNREFUSED; another process bound
                    // there now: try it (once); the same one, bound but
                    // not answering: ETIMEDOUT.
                    if looked_again {
                        rt.forget(&key);
                        return Err(e);
                    }
                    looked_again = true;
                    match rt.resolve(&key, true)? {
                        None => return Err(Errno(libc::ECONNREFUSED)),
                        Some(now) if now == ep => return Err(Errno(libc::ETIMEDOUT)),
                        Some(now) => ep = now,
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Make this new VQP a transparent RC QP (`KRCORE_VIRTUALIZE`): in
    /// RESET, with a QPN of its own, random with bit 23 set (above every
    /// real QPN of rxe and mlx5), published on the process's GID so that
    /// a peer's RTR naming it resolves here. Returns that QPN.
    /// `real_qpn`: publish that QPN instead (`KRCORE_VIRTUALIZE=auto`: the
    /// number of the real QP kept for a fallback, unique on the device).
    ///
    /// The QPN is published under every distinct usable GID of the port:
    /// the application advertises the GID of the `sgid_index` it picks at
    /// RTR, and its peer may resolve it before that (ibv_rc_pingpong's
    /// server does its RTR before it sends its own address).
    pub fn make_transparent(&self, real_qpn: Option<u32>) -> Result<u32> {
        let rt = self.runtime(None)?;
        let meta = rt.meta()?;
        let ep = Endpoint { vqpn: self.vqpn, ..rt.svc.endpoint() };
        'draw: for _ in 0..32 {
            let qpn = real_qpn.unwrap_or_else(|| 0x80_0000 | (rdma::random_u64() as u32 & 0x7f_ffff));
            // Not under a GID the meta server cannot see ours (a link-local
            // one across a router): tried once, then left out.
            let keys: Vec<_> =
                rt.gids().iter().filter(|g| meta.provable(g)).map(|&gid| crate::meta::Key::Vqpn { gid, vqpn: qpn }).collect();
            match meta.bind_all(&keys, &ep) {
                Ok(()) => {}
                // Taken on a GID (by another process), or its place in the
                // table is full: draw again.
                Err(e) if real_qpn.is_none() && (e.0 == libc::EADDRINUSE || e.0 == libc::ENOSPC) => continue 'draw,
                // A GID found unprovable: again without it.
                Err(e) if e.0 == libc::EACCES || e.0 == libc::EADDRNOTAVAIL => continue 'draw,
                Err(e) => return Err(e),
            }
            let mut st = self.st.lock();
            st.rc = Some(RcShadow::default());
            st.published = keys;
            let _ = self.app_qpn.set(qpn);
            return Ok(qpn);
        }
        Err(Errno(libc::EADDRINUSE))
    }

    /// `ibv_modify_qp` on a transparent VQP: the RC state machine, and at
    /// RTR the attachment to the peer's VQP (looked up by its GID and
    /// QPN). A refused call changes nothing.
    pub fn modify_rc(&self, attr: &ibv_qp_attr, mask: u32) -> Result<()> {
        let mut next = {
            let st = self.st.lock();
            st.rc.as_ref().ok_or(Errno::EINVAL)?.clone()
        };
        match next.modify(attr, mask)? {
            Effect::Connect { dgid, dest_qpn, sgid_index } => {
                let key = crate::meta::Key::Vqpn { gid: dgid, vqpn: dest_qpn };
                if let Err(e) = self.connect_to(&key, Some(sgid_index), None) {
                    klog!(
                        Level::Warn,
                        "vqp {:#x}: RTR: no VQP {dest_qpn:#x} on GID {dgid:02x?} resolves (its process must run krcore with KRCORE_VIRTUALIZE and the same KRCORE_META): {e:?}",
                        self.qpn()
                    );
                    return Err(e);
                }
            }
            Effect::Flush => {
                // Sends still on the link report their flush once it
                // completed them (teardown.rs); receives at once.
                let mut out = Vec::new();
                let mut st = self.st.lock();
                let held = self.flush_sends(&mut st, &mut |c| out.push((true, c)));
                st.rq.flush(&mut |c| out.push((false, c)));
                st.rc = Some(next);
                drop(st);
                for (send, c) in out {
                    self.deliver(if send { &self.send_soft } else { &self.recv_soft }, c);
                }
                if held {
                    self.watch_held();
                }
                return Ok(());
            }
            Effect::Reset => {
                // Nothing of ours may be in flight once RESET returns.
                let unread = self.quiesce();
                let mut st = self.st.lock();
                st.sq.revive();
                st.rq.flush(&mut |_| {});
                st.held.clear();
                if let Some(rt) = self.rt.get() {
                    self.detach_flow(rt, &mut st);
                }
                st.conn = None;
                st.failed = false;
                st.memo = MrMemo::default();
                st.wire = None;
                st.torn_down = false;
                st.rc = Some(next);
                drop(st);
                self.tell_unread(unread);
                return Ok(());
            }
            Effect::Ready | Effect::None => {}
        }
        self.st.lock().rc = Some(next);
        Ok(())
    }

    /// Connect to `dst` on the far side of `link` (qconnect, or a VQP
    /// made for `qpop_msgs` to answer a sender).
    pub(super) fn attach(&self, rt: &Runtime, link: Arc<Link>, peer: Endpoint, dst: u32) {
        let (index, path) = (link.index, link.path);
        self.attach_at(rt, Some(link), peer, index, path, dst);
    }

    /// [`Self::attach`], to link `index` of `peer`; without a link (None)
    /// the first post makes or finds one, or takes the datagram tier
    /// ([`Self::ensure_tier`]).
    pub(super) fn attach_at(&self, rt: &Runtime, link: Option<Arc<Link>>, peer: Endpoint, index: u16, path: Path, dst: u32) {
        let _ = self.peer_mrs.set(rt.peer_mrs(peer.incarnation));
        let conn = Conn { link, peer, index, path, dst, flow: None };
        let mut st = self.st.lock();
        // What arrived before (held): only its peer's is its.
        st.held.retain(|h| {
            let ours = conn.sent_by_peer(&h.origin);
            if !ours {
                super::landing::refused(self.vqpn, &h.origin.path.dgid, h.origin.peer.qpn);
            }
            ours
        });
        let waited = !st.held.is_empty();
        st.conn = Some(conn);
        drop(st);
        if waited {
            self.deliver_held();
        }
    }

    /// A new link to our peer could not be made: as an RC QP whose retries
    /// ran out, the VQP enters the error state.
    pub(super) fn fail_unreachable(&self, e: Errno) {
        klog!(Level::Warn, "vqp {:#x}: its peer cannot be reached again ({e:?}): error state", self.vqpn);
        let mut st = self.st.lock();
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        let held = self.flush_sends(&mut st, &mut |c| sends.push(c));
        st.conn = None;
        st.failed = true;
        if let Some(rc) = st.rc.as_mut() {
            rc.fail();
        }
        self.flush_receives_if_failed(&mut st, &mut recvs);
        drop(st);
        sends.into_iter().for_each(|c| self.deliver(&self.send_soft, c));
        recvs.into_iter().for_each(|c| self.deliver(&self.recv_soft, c));
        if held {
            self.watch_held();
        }
    }

    /// Link `link` was closed (both sides done with it): a connection on
    /// it lets it go, and takes another at its next post.
    pub fn on_link_closed(&self, link: &Arc<Link>) {
        let mut st = self.st.lock();
        if let Some(c) = st.conn.as_mut().filter(|c| c.is_on(link)) {
            c.link = None;
        }
    }

    /// The link this VQP sends on failed (its peer died or cannot be
    /// reached): as an RC QP whose retries ran out, it enters the error
    /// state. What is still outstanding on its send queue completes with
    /// `IBV_WC_WR_FLUSH_ERR` (the WR that met the error was reported with
    /// its status already), its receives are flushed once the messages
    /// that came before are delivered, and later posts are flushed. A bound
    /// VQP reports the senders of that process closed (`qpop_msgs`) and
    /// serves the others as before.
    /// A link its peer never confirmed (`process_gone` false) fails only
    /// the VQPs on it: the process may live on.
    pub fn on_link_failed(&self, link: &Arc<Link>, process_gone: bool) {
        self.on_peer_gone(&Origin::of(link), process_gone);
    }

    /// Link `index` to `peer` over `path` could not be made (the process
    /// did not answer within `KRCORE_CONNECT_TIMEOUT_MS`) and we have no
    /// other: the process is gone for this VQP as if its link had failed,
    /// and the VQP's oldest work on the tier fails with
    /// `IBV_WC_RETRY_EXC_ERR` (an RC QP's status when its peer stops
    /// answering).
    pub fn on_peer_unreachable(&self, peer: Endpoint, index: u16, path: Path) {
        self.on_peer_gone(&Origin { peer, index, path, link: None }, true);
    }

    /// The process of `from` is gone (`from.link` failed, or none could be
    /// made): see [`Self::on_link_failed`].
    fn on_peer_gone(&self, from: &Origin, process_gone: bool) {
        let mut st = self.st.lock();
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        let incarnation = from.peer.incarnation;
        // Its VQPs on the datagram tier to that process fail with it (the
        // process is gone), whether or not they had moved yet.
        let on_tier = |c: &Conn| process_gone && c.link.is_none() && c.peer.incarnation == incarnation;
        if let Some(tier) = st.conn.as_ref().filter(|c| from.link.as_ref().is_some_and(|l| c.is_on(l)) || on_tier(c)).map(on_tier) {
            if let Some(rt) = self.rt.get() {
                self.detach_flow(rt, &mut st);
            }
            st.conn = None;
            st.failed = true;
            // The link is drained: what was held for it goes first.
            sends.append(&mut st.held_sends);
            // Work on the tier met no error of its own yet: its oldest
            // takes one, as on an RC QP whose peer stopped answering.
            if tier {
                st.sq.fail_oldest(ibv_wc_status::IBV_WC_RETRY_EXC_ERR, &mut |c| sends.push(c));
            } else {
                st.sq.flush(&mut |c| sends.push(c));
            }
            if let Some(rc) = st.rc.as_mut() {
                rc.fail();
            }
        }
        if let Some(link) = from.link.as_ref().filter(|l| st.reading.as_ref().is_some_and(|r| Arc::ptr_eq(&r.link, l))) {
            if let Some(mut rd) = st.reading.take() {
                rd.wc.status = ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
                self.complete_recv(&mut st, rd.wc, &Origin::of(link));
                self.drain_held(&mut st);
            }
        }
        if st.bound.is_some() && process_gone {
            let process = &from.peer;
            let mut gone: Vec<Sender> = st.src_qps.keys().filter(|s| s.of_process(process)).copied().collect();
            // Senders of that process not answered yet: `qpop_msgs` makes
            // their src_qps when it takes their messages (waiting in the
            // inbox, held, or being taken now), so they are reported
            // closed too, after those messages.
            gone.extend(st.inbox.iter().filter_map(|e| match e {
                Inbox::Msg(o, src, _) if o.sender(*src).of_process(process) => Some(o.sender(*src)),
                _ => None,
            }));
            gone.extend(
                st.held
                    .iter()
                    .filter(|h| !h.header.flags.contains(Flags::CLOSE))
                    .map(|h| h.origin.sender(h.header.src_vqpn))
                    .filter(|s| s.of_process(process)),
            );
            gone.extend(st.answering.filter(|s| s.of_process(process)));
            let mut seen = std::collections::HashSet::new();
            gone.retain(|s| seen.insert(*s));
            for s in gone {
                // Behind what that sender's messages still wait for.
                if st.held.is_empty() && st.reading.is_none() {
                    st.inbox.push_back(Inbox::Closed(s));
                } else {
                    let header = Header { flags: Flags::CLOSE, src_vqpn: s.vqpn, dst: self.vqpn, ..Header::default() };
                    st.held.push_back(Held { header, payload: Vec::new(), origin: Origin::of_sender(from, s), cost: 0, _tier: None });
                }
            }
        }
        self.flush_receives_if_failed(&mut st, &mut recvs);
        drop(st);
        sends.into_iter().for_each(|c| self.deliver(&self.send_soft, c));
        recvs.into_iter().for_each(|c| self.deliver(&self.recv_soft, c));
    }
}
