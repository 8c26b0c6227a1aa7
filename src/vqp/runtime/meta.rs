//! The runtime's meta-server connection: made in the background from the
//! runtime's start (each caller waits for it within its own bound), and
//! the lookups that go through the host's agent, a TCP query or it.

use super::{connect_timeout, Runtime};
use crate::error::{Errno, Result};
use crate::klog;
use crate::log::Level;
use crate::meta::client::{self, MetaClient};
use crate::rdma::Device;
use parking_lot::Mutex;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A meta-server connection made in the background: its outcome once it
/// has one, and when it came.
#[derive(Default)]
pub(super) struct MetaStart {
    outcome: Mutex<Option<(Result<Arc<MetaClient>>, Instant)>>,
    came: parking_lot::Condvar,
}

impl MetaStart {
    fn set(&self, r: Result<Arc<MetaClient>>) {
        *self.outcome.lock() = Some((r, Instant::now()));
        self.came.notify_all();
    }

    pub(super) fn is_finished(&self) -> bool {
        self.outcome.lock().is_some()
    }

    /// Its outcome, waiting until `deadline` at most (None: still under way).
    pub(super) fn wait_until(&self, deadline: Instant) -> Option<(Result<Arc<MetaClient>>, Instant)> {
        let mut g = self.outcome.lock();
        while g.is_none() {
            if self.came.wait_until(&mut g, deadline).timed_out() {
                break;
            }
        }
        g.as_ref().map(|(r, at)| (r.clone(), *at))
    }
}

/// How long the meta server is waited for once it took our connection
/// (a query's answer; the connection made in the background, and the
/// PD's teardown waiting for it): as a live peer that is slow
/// (`LIVE_BOUND_US`, 10 s, or the connect timeout if larger). A meta
/// server busy with a burst of new processes answers late, not never:
/// given up sooner, its work on the server is wasted and the next attempt
/// queues behind the same burst. Nobody waits on the background
/// connection but through their own bound (`meta()`).
pub(super) fn slow_meta_bound() -> Duration {
    connect_timeout().max(Duration::from_micros(crate::transport::dgram::port::LIVE_BOUND_US))
}

/// Connect to `KRCORE_META` from our GID at `gid_index`, on a thread of its
/// own, while the caller builds the rest of the runtime. None without
/// `KRCORE_META` (or when no thread can be made: `meta()` connects then).
pub(super) fn start_meta(dev: &Arc<Device>, gid_index: u32, incarnation: u64) -> Option<Arc<MetaStart>> {
    let spec = crate::config::get().meta.as_deref()?;
    let dev = Arc::clone(dev);
    let spec = spec.to_string();
    let start = Arc::new(MetaStart::default());
    let s = Arc::clone(&start);
    let body = move || s.set(client::parse_addrs(&spec).and_then(|a| connect_meta(&dev, gid_index, &a, slow_meta_bound(), incarnation)));
    std::thread::Builder::new().name("krcore-meta-connect".into()).spawn(body).ok()?;
    Some(start)
}

/// Connect to `addrs`, each replica's bootstrap bounded by `bound`; the
/// connections vouch for the process of service endpoint `incarnation`.
fn connect_meta(
    dev: &Arc<Device>,
    gid_index: u32,
    addrs: &[std::net::SocketAddr],
    bound: Duration,
    incarnation: u64,
) -> Result<Arc<MetaClient>> {
    let lease = Duration::from_millis(crate::config::get().meta_lease_ms);
    let opts = client::Options { timeout: connect_timeout(), lease, incarnation };
    crate::kmark!("meta: connecting");
    let c = MetaClient::connect_within(dev, gid_index, addrs, opts, bound);
    crate::kmark!("meta: connected");
    let stat =
        if c.is_ok() { crate::stats::Stat::KRCORE_STAT_META_CONNECTIONS } else { crate::stats::Stat::KRCORE_STAT_META_CONNECT_FAILURES };
    crate::stats::inc(stat);
    c
}

impl Runtime {
    /// Who is bound at `key`, for a connect (`fresh`: the DCCache bypassed,
    /// [`MetaClient::lookup_fresh`]). Without a meta-server connection of
    /// our own, the host's agent answers (`src/node/`); with no agent, our
    /// connection is made (in the background). While the one made
    /// at the start is still on its way (its RC QP and handshake take
    /// milliseconds), the key is asked over TCP instead (one round trip, no
    /// QP on the connect's path: [`client::query`]); if that fails, the
    /// lookup waits for the connection. The query's connect and the wait
    /// for the connection are bounded by `KRCORE_CONNECT_TIMEOUT_MS`, the
    /// query's answer by `LIVE_BOUND_US` (10 s), as a live peer that is
    /// slow: 2 s failed 1-3 of 64 new processes in bursts, their meta
    /// server starved of CPU (one bound for both waits failed 29 of 64).
    pub fn resolve(&self, key: &crate::meta::Key, fresh: bool) -> Result<Option<crate::meta::Endpoint>> {
        if self.meta.get().is_none() {
            if let Some(found) = crate::node::client::lookup(key, fresh) {
                return Ok(found);
            }
            // No agent (any more): this process's own connection, asked by
            // query meanwhile.
            let mut start = self.meta_start.lock();
            if self.meta_closed.load(Ordering::Acquire) {
                return Err(Errno(libc::ESHUTDOWN));
            }
            if start.is_none() {
                *start = start_meta(self.svc.device(), self.svc.gid_index(), self.svc.endpoint().incarnation);
            }
        }
        let starting = self.meta.get().is_none() && self.meta_start.lock().as_ref().is_some_and(|s| !s.is_finished());
        if let (true, Some(spec)) = (starting, crate::config::get().meta.as_deref()) {
            crate::kmark!("meta: lookup by query (TCP)");
            // Its answer waited for as a peer that lives but is slow (a
            // meta server starved by the burst this process is part of).
            match client::parse_addrs(spec).and_then(|addrs| client::query_within(&addrs, key, connect_timeout(), slow_meta_bound())) {
                Ok(found) => {
                    crate::kmark!("meta: query answered");
                    crate::stats::inc(crate::stats::Stat::KRCORE_STAT_META_QUERIES);
                    return Ok(found);
                }
                Err(e) => klog!(Level::Debug, "vqp: a lookup by query failed ({e:?}): waiting for the meta-server connection"),
            }
        }
        let meta = self.meta()?;
        if fresh {
            meta.lookup_fresh(key)
        } else {
            meta.lookup(key)
        }
    }

    /// Forget what is cached of `key` here (its endpoint did not answer).
    pub fn forget(&self, key: &crate::meta::Key) {
        if let Some(m) = self.meta.get() {
            m.invalidate(key);
        }
    }

    /// The meta-server client (`KRCORE_META`), connected at first use;
    /// waits for the connection made since the start, or makes one,
    /// within `KRCORE_CONNECT_TIMEOUT_MS`.
    pub fn meta(&self) -> Result<Arc<MetaClient>> {
        if let Some(m) = self.meta.get() {
            return Ok(Arc::clone(m));
        }
        let called = Instant::now();
        let deadline = called + connect_timeout();
        let started = self.meta_start.lock().clone();
        if let Some(s) = started {
            // The connection made since the start, waited for within this
            // call's bound; still under way then, it is kept for the next
            // call. One that failed before this call (made at the
            // runtime's start, maybe at `ibv_alloc_pd`, before the meta
            // server was up) is not this call's answer: it tries once more
            // itself. One that failed during this call is.
            match s.wait_until(deadline) {
                None => return Err(Errno(libc::ETIMEDOUT)),
                Some((Ok(c), _)) => {
                    self.meta_start.lock().take();
                    return Ok(Arc::clone(self.meta.get_or_init(|| c)));
                }
                Some((Err(e), at)) => {
                    self.meta_start.lock().take();
                    if at > called {
                        return Err(e);
                    }
                    klog!(Level::Info, "vqp: the meta-server connection made at the start failed ({e:?}): trying again");
                }
            }
        }
        self.meta
            .get_or_try_init(|| {
                if self.meta_closed.load(Ordering::Acquire) {
                    return Err(Errno(libc::ESHUTDOWN));
                }
                let cfg = crate::config::get();
                let Some(spec) = cfg.meta.as_deref() else {
                    klog!(
                        Level::Error,
                        "qbind/qconnect need the meta server: set KRCORE_META=<ip>:<port> (krcore-meta --listen <ip>:<port>)"
                    );
                    return Err(Errno(libc::ENOTCONN));
                };
                let addrs = client::parse_addrs(spec)?;
                let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
                connect_meta(self.svc.device(), self.svc.gid_index(), &addrs, left, self.svc.endpoint().incarnation)
            })
            .cloned()
    }
}
