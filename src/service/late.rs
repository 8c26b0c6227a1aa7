//! Link replies that come after their request's handshake gave up
//! (`Shared::connect`, ETIMEDOUT: this process starved of CPU, or the
//! peer slow to answer). The peer made its end when it answered, and hands
//! it out unconfirmed after `READY_WAIT_MS`: what it sends there would be
//! lost, failing `IBV_WC_RETRY_EXC_ERR` on its side, unless our end comes
//! up within RC's retries (about 3.8 s) of its first send. So the request's
//! QP is kept a while, and a reply that comes makes the link after all.

use super::link::{Link, LinkKey, Path};
use super::{link_msg_dropped, Shared, Source};
use crate::klog;
use crate::log::Level;
use crate::meta::proto::{LinkInfo, LinkMessage, LinkReply};
use crate::meta::Endpoint;
use crate::rdma::Qp;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long after its handshake gave up a link request of ours still takes
/// its reply.
const LATE_REPLY_WAIT: Duration = Duration::from_secs(5);
/// Link requests whose handshake gave up, each holding its QP until its
/// reply or `LATE_REPLY_WAIT`.
const MAX_LATE: usize = 32;

/// One of our link requests whose handshake gave up: its QP (INIT) and
/// what the link needs, should the reply still come.
pub(super) struct Late {
    peer: Endpoint,
    index: u16,
    path: Path,
    qp: Qp,
    psn: u32,
    /// Our request's half of the link (told to the peer again in LINK_READY).
    ours: LinkInfo,
    until: Instant,
}

impl Late {
    pub(super) fn new(peer: Endpoint, index: u16, path: Path, qp: Qp, psn: u32, ours: LinkInfo) -> Late {
        Late { peer, index, path, qp, psn, ours, until: Instant::now() + LATE_REPLY_WAIT }
    }
}

impl Shared {
    /// Keep request `id`'s QP for its reply: expired ones go, and the
    /// oldest beyond [`MAX_LATE`].
    pub(super) fn park_late(&self, id: u32, late: Late) {
        let now = Instant::now();
        let mut parked = self.late.lock();
        parked.retain(|_, l| l.until > now);
        if parked.len() >= MAX_LATE {
            if let Some(oldest) = parked.iter().min_by_key(|(_, l)| l.until).map(|(id, _)| *id) {
                parked.remove(&oldest);
            }
        }
        parked.insert(id, late);
    }

    /// A reply to no waiting request: one whose handshake gave up, come
    /// late. Its link is made after all (on the progress thread: QP
    /// commands), so that the peer's end, maybe carrying work already, is
    /// not left to fail; it is handed out once the peer is heard on it (a
    /// probe READ, or anything it sends), not before: its end may have
    /// given up on ours meanwhile, and a link that fails unconfirmed does
    /// not take the process for gone.
    pub(super) fn on_late_reply(&self, r: LinkReply, src: &Source, progress: bool) {
        let mut parked = self.late.lock();
        match parked.get(&r.req_id) {
            None => return,
            Some(l) if !self.sent_to_us_by(&l.peer, src) => {
                drop(parked);
                link_msg_dropped(format_args!("a late reply to request {} from {src:?}, not the endpoint asked", r.req_id));
                return;
            }
            Some(_) if !progress => {
                drop(parked);
                return self.for_progress_thread(LinkMessage::Reply(r), *src);
            }
            Some(_) => {}
        }
        let Some(l) = parked.remove(&r.req_id) else { return };
        drop(parked);
        let theirs = r.info;
        let from_peer = theirs.from.incarnation == l.peer.incarnation && theirs.from.gid == l.peer.gid && theirs.src_gid == l.path.dgid;
        if r.status != 0 || !from_peer || Instant::now() > l.until || !self.link_wanted(&l.peer, &l.path) {
            klog!(Level::Debug, "service: a late reply to link request {} (status {}): no link made", r.req_id, r.status);
            return;
        }
        let key = LinkKey::of(&l.peer, l.index, l.path);
        let made = self
            .credit(&theirs)
            .and_then(|credit| Link::new(l.qp, l.peer, l.index, l.path, &theirs, true, l.psn, credit))
            .and_then(|link| self.establish(key, Arc::new(link.confirmed_when_heard()), &theirs, r.req_id, l.ours));
        match made {
            Ok(_) => {
                klog!(Level::Info, "service: a late reply to link request {}: its link made, used once the peer is heard on it", r.req_id)
            }
            Err(e) => klog!(Level::Info, "service: a late reply to link request {}: its link failed: {e:?}", r.req_id),
        }
    }
}
