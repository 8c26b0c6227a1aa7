//! The process's side of the meta server: lookups by one-sided READ of the
//! server's table (cached locally: the DCCache), and registrations by
//! request messages, each with a lease that a background thread renews.
//!
//! Every replica named in `KRCORE_META` gets one TCP connection (bootstrap,
//! then only a liveness signal both ways: closing it, which the kernel does
//! when the process dies, removes our entries at once; the server's end
//! closing tells us it died) and one RC QP.
//!
//! Failover. A replica is down (never reached, or its connection failed),
//! being repopulated, up, or failed (waiting for the background thread to
//! drop its connection). The background thread wakes every renewal period
//! (and at once when a connection fails or the server's end of a TCP
//! connection closes), renews our leases on every connected replica,
//! reconnects to every replica that is down (at most once a period each),
//! and registers everything this process has bound on a replica it
//! reached again, before lookups use it: a restarted meta server is
//! repopulated by its clients without the application doing anything. A
//! renewal answered with fewer entries than we registered (they expired
//! while we could not renew, e.g. the process was stopped) registers them
//! again too.
//!
//! - A lookup uses the up replicas in `KRCORE_META` order, skipping one
//!   that is busy (the background thread or another lookup holds it) and
//!   coming back to it, waiting at most the timeout, only when no other
//!   one answered. "Not bound" from one replica is confirmed with the
//!   others (a replica that came back may not have every process's
//!   entries yet); an entry one of them holds is the answer. It fails
//!   (ECONNREFUSED, or the last transport error) only when no replica
//!   can answer, and never waits for a replica known to be down.
//! - A binding succeeds when at least one connected replica accepted it
//!   and none refused it (a refusal, EADDRINUSE, ENOSPC or EDQUOT, is undone on
//!   the replicas that had accepted and returned). A replica that was down
//!   gets it when it is reached again.
//!
//! Lookups run on the caller's thread and poll their own completion (the
//! caller is inside an extended verb that waits for the answer anyway);
//! the background thread sleeps in poll(2) on the TCP connections and an
//! eventfd, and on the replicas' completion channels, never spinning.

use super::proof::Prover;
use super::proto::{self, Hello, Op, Presence, Request, Response, Welcome};
use super::table::{Lookup, RemoteEndpointTable, HEADER_SIZE, NEIGHBORHOOD};
use super::{Endpoint, Key};
use crate::error::{Errno, Result};
use crate::klog;
use crate::log::Level;
use crate::rdma::{self, Caps, Cq, Device, Qp, RcPeer, Region};
use crate::stats::{self, Stat};
use crate::sys::*;
use parking_lot::{Mutex, MutexGuard};
use rustc_hash::FxHashMap;
use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Torn reads tolerated in a row before a lookup gives up (EAGAIN).
const TORN_RETRIES: u32 = 64;

/// Offsets in a replica's buffer region.
const RECV_OFF: usize = 0;
const SEND_OFF: usize = proto::META_LEN;
const READ_OFF: usize = 2 * proto::META_LEN;
/// Room for one neighborhood READ (or the table header).
const READ_LEN: usize = NEIGHBORHOOD * 128;
/// Requests a batch sends at once: the receives the server holds for each
/// client.
pub const PIPELINE: usize = super::server::CREDITS;
/// After the READ room: the receive and send slots of a batch's requests
/// beyond the first.
const BATCH_OFF: usize = READ_OFF + READ_LEN;
const BUFS_LEN: usize = BATCH_OFF + 2 * (PIPELINE - 1) * proto::META_LEN;

/// Where request `i` of a batch is answered.
fn recv_off(i: usize) -> usize {
    if i == 0 {
        RECV_OFF
    } else {
        BATCH_OFF + (i - 1) * proto::META_LEN
    }
}

/// Where request `i` of a batch is sent from.
fn send_off(i: usize) -> usize {
    if i == 0 {
        SEND_OFF
    } else {
        BATCH_OFF + (PIPELINE - 1 + i - 1) * proto::META_LEN
    }
}

/// How long a `Bind` under a GID whose proof the server has not seen is
/// retried (the proof sent again each time) before it fails EACCES: a
/// proof is one datagram, lost only when the server's receives are full.
const PROOF_WAIT: Duration = Duration::from_secs(1);

/// The longest sleep of a request's wait between looks at its replica's
/// state (only while a request is outstanding).
const WAIT_SLICE: Duration = Duration::from_millis(10);
/// How often a polling request's wait looks whether its server closed
/// the connection (a system call: not at every poll of the CQ).
const SERVER_LOOK: Duration = Duration::from_millis(1);

/// A replica's state ([`Replica::state`]).
const DOWN: u8 = 0;
/// Connected; our entries are being registered; not used for lookups.
const REPOPULATING: u8 = 1;
const UP: u8 = 2;
/// Its connection failed; the background thread drops it.
const FAILED: u8 = 3;

/// How the client behaves (`KRCORE_META*`).
#[derive(Clone, Debug)]
pub struct Options {
    /// Bound on every wait for the meta server.
    pub timeout: Duration,
    /// Lease asked for each registration; renewed every third of it.
    pub lease: Duration,
    /// Our service endpoint's incarnation, whose presence the connections
    /// vouch for ([`presence`]); 0: none.
    pub incarnation: u64,
}

impl Options {
    fn period(&self) -> Duration {
        (self.lease / 3).max(Duration::from_millis(1))
    }

    /// Bound on the background thread's registrations on a replica reached
    /// again: one that does not answer within a period is reconnected.
    fn background_timeout(&self) -> Duration {
        self.timeout.min(self.period())
    }

    /// Bound on one pass of renewals: until the leases renewed a period
    /// ago would run out. A renewal answered late (a meta server busy
    /// with a burst of new processes) still keeps our entries; giving up
    /// on it closes the connection, which drops them all at once.
    fn renew_timeout(&self) -> Duration {
        self.lease.saturating_sub(self.period()).max(self.period())
    }

    /// Bound on a reconnection attempt (TCP connect, Welcome, header READ)
    /// to one of `replicas`: half a period, so that an unreachable replica
    /// does not delay the renewals on the others. A lone replica delays
    /// nothing: its attempt may take what a renewal may (a meta server
    /// busy with a burst of new processes brings a QP up seconds late, and
    /// an attempt given up wastes that work and queues again behind the
    /// burst: a bound of half a period never got through one).
    fn reconnect_timeout(&self, replicas: usize) -> Duration {
        if replicas == 1 {
            return self.renew_timeout();
        }
        self.timeout.min(self.period() / 2).max(Duration::from_millis(1))
    }
}

/// One meta-server replica and our connection to it.
struct Replica {
    addr: SocketAddr,
    state: AtomicU8,
    /// The connection's TCP socket (-1: none), for the background thread's
    /// poll; only that thread changes it once the client runs.
    tcp_fd: AtomicI32,
    conn: Mutex<Option<Conn>>,
}

struct Conn {
    /// Held open: the server drops our entries when it closes.
    tcp: TcpStream,
    cq: Arc<Cq>,
    qp: Qp,
    bufs: Region,
    table_addr: u64,
    table_rkey: u32,
    /// The table's geometry, from its header (read once, at connect).
    table: Option<RemoteEndpointTable>,
    incarnation: u64,
    next_req: u32,
    /// Keys this replica refused when we registered them again (another
    /// process took them while it did not have ours): not retried on this
    /// connection.
    refused: HashSet<Key>,
    /// A transport failure: the QP may hold work we no longer track.
    broken: bool,
    /// Proves to the server the GIDs we bind keys under.
    prover: Prover,
    /// The GIDs proven (whose proof was sent) on this connection.
    proven: HashSet<rdma::Gid>,
    /// The GIDs whose last `Bind` failed for want of a proof: the server
    /// never saw one (the datagram cannot reach it from there, such as a
    /// link-local GID across a router) or cannot (EADDRNOTAVAIL).
    unprovable: HashSet<rdma::Gid>,
}

pub struct MetaClient {
    replicas: Vec<Replica>,
    dev: Arc<Device>,
    sgid_index: u32,
    /// The DCCache: endpoints looked up, valid until the peer is found dead.
    cache: Mutex<FxHashMap<Key, Endpoint>>,
    /// What this process registered, for renewal and repopulation. Held
    /// while a registration is sent, so that a replica being repopulated
    /// gets every binding (lock order: `bound`, then a replica's `conn`).
    bound: Mutex<HashMap<Key, Endpoint>>,
    /// The processes this connection vouches for ([`MetaClient::vouch`]:
    /// an agent's attached ones), sent again to a replica reconnected.
    vouched: Mutex<HashSet<(u64, rdma::Gid)>>,
    opts: Options,
    renewer: Mutex<Option<std::thread::JoinHandle<()>>>,
    stop: AtomicBool,
    /// Wakes the background thread (a failure, or `shutdown`).
    wake_fd: OwnedFd,
}

/// This process's binding secret ([`proto::Request::secret`]): chosen at
/// random once, sent with every request, never shown to anyone but the
/// meta servers. Every connection of the process (a reconnect, another
/// PD's runtime) renews and unbinds what another bound.
static SECRET: once_cell::sync::Lazy<u64> = once_cell::sync::Lazy::new(crate::rdma::random_u64);

/// A vouch's request fields: the GID in the key, the incarnation in the
/// endpoint ([`Op::Vouch`]).
fn vouch_request(incarnation: u64, gid: &rdma::Gid) -> (Key, Endpoint) {
    (Key::Port { gid: *gid, port: 0 }, Endpoint { gid: *gid, qpn: 0, qkey: 0, incarnation, vqpn: 0 })
}

/// Parse `KRCORE_META`: `ip:port[,ip:port...]`.
pub fn parse_addrs(spec: &str) -> Result<Vec<SocketAddr>> {
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let mut addrs = part.to_socket_addrs().map_err(|_| Errno::EINVAL)?;
        out.push(addrs.next().ok_or(Errno::EINVAL)?);
    }
    if out.is_empty() {
        return Err(Errno::EINVAL);
    }
    Ok(out)
}

/// Who is bound at `key`, asked over a short TCP connection of its own (a
/// [`proto::Query`]): one round trip after the connect, no QP, for a
/// process whose RC connection to the meta server is still being made.
/// The replicas in order, as [`MetaClient::lookup`]: the first that knows
/// the key answers; `Ok(None)` when one that answered knows nothing of it
/// and none knows it.
pub fn query(addrs: &[SocketAddr], key: &Key, timeout: Duration) -> Result<Option<Endpoint>> {
    query_within(addrs, key, timeout, timeout)
}

/// [`query`], each replica's TCP connect bounded by `connect` and its
/// answer, once connected, by `answer`: a replica that took the
/// connection lives (a dead one's port refuses, and its death resets
/// the connection) and may only be slow.
pub fn query_within(addrs: &[SocketAddr], key: &Key, connect: Duration, answer: Duration) -> Result<Option<Endpoint>> {
    let mut last = Errno(libc::ECONNREFUSED);
    let mut absent = false;
    for addr in addrs {
        match query_one(addr, key, connect, answer) {
            Ok(Some(ep)) => return Ok(Some(ep)),
            Ok(None) => absent = true,
            Err(e) => last = e,
        }
    }
    if absent {
        return Ok(None);
    }
    Err(last)
}

fn query_one(addr: &SocketAddr, key: &Key, connect: Duration, answer: Duration) -> Result<Option<Endpoint>> {
    let mut out = [0u8; proto::BOOT_LEN];
    proto::Query { key: *key }.encode(&mut out);
    Ok(proto::Answer::decode(&ask(addr, &out, connect, answer)?)?.endpoint)
}

/// One boot message over a short TCP connection of its own (connected
/// within `connect`), and its answer (within `answer`).
fn ask(addr: &SocketAddr, msg: &[u8; proto::BOOT_LEN], connect: Duration, answer: Duration) -> Result<[u8; proto::BOOT_LEN]> {
    let mut tcp = TcpStream::connect_timeout(addr, connect)?;
    tcp.set_read_timeout(Some(answer))?;
    tcp.set_write_timeout(Some(answer))?;
    let _ = tcp.set_nodelay(true);
    tcp.write_all(msg)?;
    let mut buf = [0u8; proto::BOOT_LEN];
    tcp.read_exact(&mut buf)?;
    Ok(buf)
}

/// Whether the process with `incarnation` at `gid` holds a connection to a
/// meta server that proved `gid` ([`proto::PresenceQuery`], each replica asked over a short TCP
/// connection): connected to one of them, it lives; departed from one
/// and connected to none, it is gone (a process that lost one replica
/// but not the others still counts as connected); else unknown (no
/// replica answered, or none knows it).
pub fn presence(addrs: &[SocketAddr], incarnation: u64, gid: &rdma::Gid, timeout: Duration) -> Presence {
    let mut out = [0u8; proto::BOOT_LEN];
    proto::PresenceQuery { incarnation, gid: *gid }.encode(&mut out);
    let mut departed = false;
    for addr in addrs {
        match ask(addr, &out, timeout, timeout).and_then(|b| Ok(proto::PresenceAnswer::decode(&b)?.presence)) {
            Ok(Presence::Connected) => return Presence::Connected,
            Ok(Presence::Departed) => departed = true,
            Ok(Presence::Unknown) => {}
            Err(e) => klog!(Level::Debug, "meta server {addr}: presence query failed: {e:?}"),
        }
    }
    if departed {
        Presence::Departed
    } else {
        Presence::Unknown
    }
}

/// Whether a replica that answered a renewal with `held` entries lost some
/// of the `bound` we registered (`refused` of them it never had).
fn lost_entries(held: u32, bound: usize, refused: usize) -> bool {
    (held as usize) < bound.saturating_sub(refused)
}

/// Say that a replica refused a binding: at warn level when it is the
/// server's bound on one client's entries (EDQUOT, `krcore-meta
/// --max-entries-per-client`), which the caller's errno alone does not
/// name; the others (EADDRINUSE, ENOSPC) are the caller's to handle.
fn log_refusal(addr: &SocketAddr, e: Errno) {
    if e.0 == libc::EDQUOT {
        klog!(Level::Warn, "meta server {addr}: bind refused: this connection holds the entries krcore-meta allows one client (--max-entries-per-client): EDQUOT");
    } else {
        klog!(Level::Debug, "meta server {addr}: bind refused: {e:?}");
    }
}

/// When a replica that is down may be tried next: a period after the last
/// attempt, and not before `now` (at once after a failure, unless the last
/// attempt was less than a period ago: a replica that fails every request
/// is not reconnected in a loop).
fn next_attempt(last: Option<Instant>, now: Instant, period: Duration) -> Instant {
    last.map_or(now, |l| (l + period).max(now))
}

/// The outcome of a lookup on one replica.
enum Step {
    Found(Endpoint),
    Absent,
    Failed(Errno),
    /// It went down meanwhile.
    Skipped,
}

impl MetaClient {
    /// Connect to every replica from our GID at `sgid_index` on `dev`.
    /// Fails (ECONNREFUSED, ETIMEDOUT, ...) when no replica is reachable;
    /// the others are reconnected in the background.
    pub fn connect(dev: &Arc<Device>, sgid_index: u32, addrs: &[SocketAddr], opts: Options) -> Result<Arc<MetaClient>> {
        let bound = opts.timeout;
        MetaClient::connect_within(dev, sgid_index, addrs, opts, bound)
    }

    /// [`MetaClient::connect`], each replica's bootstrap (TCP connect,
    /// `Welcome`, QP, the table's header) bounded by `bound` instead of
    /// the options' timeout (a connection made in the background, which
    /// nobody waits on but through their own bound).
    pub fn connect_within(
        dev: &Arc<Device>,
        sgid_index: u32,
        addrs: &[SocketAddr],
        opts: Options,
        bound: Duration,
    ) -> Result<Arc<MetaClient>> {
        let mut replicas = Vec::new();
        let mut last = Errno(libc::ECONNREFUSED);
        for addr in addrs {
            let r = Replica { addr: *addr, state: AtomicU8::new(DOWN), tcp_fd: AtomicI32::new(-1), conn: Mutex::new(None) };
            match Conn::connect(dev, sgid_index, *addr, bound, opts.incarnation) {
                Ok(c) => {
                    r.tcp_fd.store(c.tcp.as_raw_fd(), Ordering::Relaxed);
                    *r.conn.lock() = Some(c);
                    r.state.store(UP, Ordering::Release);
                }
                Err(e) => {
                    klog!(Level::Warn, "meta server {addr}: cannot connect: {e:?} (tried again every {:?})", opts.period());
                    last = e;
                }
            }
            replicas.push(r);
        }
        if replicas.iter().all(|r| r.state() == DOWN) {
            return Err(last);
        }
        // SAFETY: plain syscall; the fd is checked and then owned.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(Errno::last());
        }
        let me = Arc::new(MetaClient {
            replicas,
            dev: Arc::clone(dev),
            sgid_index,
            cache: Mutex::new(FxHashMap::default()),
            bound: Mutex::new(HashMap::new()),
            vouched: Mutex::new(HashSet::new()),
            opts,
            renewer: Mutex::new(None),
            stop: AtomicBool::new(false),
            // SAFETY: a new fd that nothing else owns.
            wake_fd: unsafe { OwnedFd::from_raw_fd(fd) },
        });
        // Always: lookups need failed replicas reconnected, bindings need
        // renewing, a replica down now must be reached when it comes back.
        me.start_renewer();
        Ok(me)
    }

    /// The endpoint bound at `key`: from the DCCache, else one READ of the
    /// table on an up replica (re-read while torn). `Ok(None)`: nothing is
    /// bound there, on any replica that answered.
    pub fn lookup(&self, key: &Key) -> Result<Option<Endpoint>> {
        if let Some(ep) = self.cache.lock().get(key) {
            return Ok(Some(*ep));
        }
        let mut last = Errno(libc::ECONNREFUSED);
        let mut absent = false;
        let mut busy = Vec::new();
        let mut step = |i: usize, g: MutexGuard<'_, Option<Conn>>, last: &mut Errno| match self.lookup_on(i, g, key) {
            Step::Found(ep) => Some(ep),
            Step::Absent => {
                absent = true;
                None
            }
            Step::Failed(e) => {
                *last = e;
                None
            }
            Step::Skipped => None,
        };
        for (i, r) in self.replicas.iter().enumerate() {
            if r.state() != UP {
                continue;
            }
            // Never wait behind a renewal (or another lookup) here.
            let Some(g) = r.conn.try_lock() else {
                busy.push(i);
                continue;
            };
            if let Some(ep) = step(i, g, &mut last) {
                return Ok(Some(self.found(i, key, ep)));
            }
        }
        for i in busy {
            let r = &self.replicas[i];
            if r.state() != UP {
                continue;
            }
            let Some(g) = r.conn.try_lock_for(self.opts.timeout) else {
                last = Errno(libc::ETIMEDOUT);
                continue;
            };
            if let Some(ep) = step(i, g, &mut last) {
                return Ok(Some(self.found(i, key, ep)));
            }
        }
        if absent {
            return Ok(None);
        }
        Err(last)
    }

    fn found(&self, i: usize, key: &Key, ep: Endpoint) -> Endpoint {
        if i != 0 {
            stats::inc(Stat::KRCORE_STAT_META_LOOKUP_FAILOVERS);
        }
        self.cache.lock().insert(*key, ep);
        ep
    }

    fn lookup_on(&self, i: usize, mut g: MutexGuard<'_, Option<Conn>>, key: &Key) -> Step {
        let r = &self.replicas[i];
        let Some(conn) = g.as_mut().filter(|_| r.state() == UP) else { return Step::Skipped };
        match conn.lookup(key, self.opts.timeout, &r.state) {
            Ok(Some(ep)) => Step::Found(ep),
            Ok(None) => Step::Absent,
            Err(e) => {
                klog!(Level::Warn, "meta server {}: lookup failed: {e:?}", r.addr);
                if conn.broken {
                    drop(g);
                    self.fail(i);
                }
                Step::Failed(e)
            }
        }
    }

    /// The endpoint bound at `key` now: one READ, the DCCache bypassed
    /// (and refreshed). A cached endpoint that is no longer the one bound
    /// there (its process died or let go, and another may have bound the
    /// address since) is forgotten, with everything cached of its process:
    /// a dead peer's entry can outlive it here until its link is found
    /// failed (the probe and RC's retries, seconds), while the meta server
    /// drops it within milliseconds.
    pub fn lookup_fresh(&self, key: &Key) -> Result<Option<Endpoint>> {
        let old = self.cache.lock().remove(key);
        crate::kmark!("meta: lookup (READ)");
        let now = self.lookup(key)?;
        crate::kmark!("meta: lookup done");
        if let Some(old) = old.filter(|o| now != Some(*o)) {
            self.forget_process(old.incarnation);
        }
        Ok(now)
    }

    /// Forget a cached endpoint (its process was found dead).
    pub fn invalidate(&self, key: &Key) {
        self.cache.lock().remove(key);
    }

    /// Forget every cached endpoint of the process with `incarnation` (its
    /// link failed: it died, or cannot be reached).
    pub fn forget_process(&self, incarnation: u64) {
        self.cache.lock().retain(|_, ep| ep.incarnation != incarnation);
    }

    /// Register `key` -> `ep` on every connected replica, then keep it
    /// alive (and register it on the others when they are reached).
    pub fn bind(&self, key: &Key, ep: &Endpoint) -> Result<()> {
        let mut bound = self.bound.lock();
        let mut accepted = Vec::new();
        let mut refusal = None;
        let mut last = Errno(libc::ECONNREFUSED);
        for (i, r) in self.replicas.iter().enumerate() {
            match self.request_on(i, Op::Bind, key, ep, self.opts.timeout) {
                None => {}
                Some(Ok(_)) => accepted.push(i),
                Some(Err((e, true))) => last = e,
                // The server's verdict (EADDRINUSE, ENOSPC, ...) is the answer.
                Some(Err((e, false))) => {
                    log_refusal(&r.addr, e);
                    refusal = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = refusal {
            // Undo a new binding where it was accepted (not one we held).
            if !bound.contains_key(key) {
                for i in accepted {
                    let _ = self.request_on(i, Op::Unbind, key, ep, self.opts.timeout);
                }
            }
            return Err(e);
        }
        if accepted.is_empty() {
            return Err(last);
        }
        bound.insert(*key, *ep);
        Ok(())
    }

    /// Whether keys under `gid` may be bound: no connected replica found
    /// that it cannot be proven there (see [`Conn::requests`]).
    pub fn provable(&self, gid: &rdma::Gid) -> bool {
        self.replicas.iter().all(|r| r.conn.lock().as_ref().is_none_or(|c| !c.unprovable.contains(gid)))
    }

    /// Bind every key of `keys` to `ep`, all or none: as [`bind`] does
    /// for one, with the requests to a replica pipelined ([`PIPELINE`] at
    /// a time) rather than one round trip each.
    ///
    /// [`bind`]: MetaClient::bind
    pub fn bind_all(&self, keys: &[Key], ep: &Endpoint) -> Result<()> {
        let mut bound = self.bound.lock();
        let mut accepted: Vec<(usize, Key)> = Vec::new();
        let mut refusal = None;
        let mut last = Errno(libc::ECONNREFUSED);
        let mut any = false;
        'replicas: for (i, r) in self.replicas.iter().enumerate() {
            let mut done = 0;
            for chunk in keys.chunks(PIPELINE) {
                match self.requests_on(i, Op::Bind, chunk, ep, self.opts.timeout) {
                    None => continue 'replicas,
                    Some(Err(e)) => {
                        last = e;
                        continue 'replicas;
                    }
                    Some(Ok(res)) => {
                        for (key, res) in chunk.iter().zip(res) {
                            match res {
                                Ok(_) => accepted.push((i, *key)),
                                Err(e) => {
                                    log_refusal(&r.addr, e);
                                    refusal = Some(e);
                                }
                            }
                        }
                        if refusal.is_some() {
                            break 'replicas;
                        }
                        done += chunk.len();
                    }
                }
            }
            any |= done == keys.len();
        }
        if let Some(e) = refusal {
            // Undo the new bindings where they were accepted (not ones we held).
            for (i, key) in accepted.into_iter().filter(|(_, k)| !bound.contains_key(k)) {
                let _ = self.request_on(i, Op::Unbind, &key, ep, self.opts.timeout);
            }
            return Err(e);
        }
        if !any {
            return Err(last);
        }
        for key in keys {
            bound.insert(*key, *ep);
        }
        Ok(())
    }

    /// [`unbind`] of each of `keys`, pipelined; the ones we did not hold
    /// are skipped.
    ///
    /// [`unbind`]: MetaClient::unbind
    pub fn unbind_all(&self, keys: &[Key]) {
        let mut bound = self.bound.lock();
        let mut held: Vec<(Key, Endpoint)> = keys.iter().filter_map(|k| bound.remove(k).map(|ep| (*k, ep))).collect();
        // One request carries one endpoint: group by it (a VQP's keys share one).
        held.sort_by_key(|(_, ep)| (ep.gid, ep.qpn, ep.vqpn));
        for group in held.chunk_by(|a, b| a.1 == b.1) {
            let ks: Vec<Key> = group.iter().map(|(k, _)| *k).collect();
            for (i, r) in self.replicas.iter().enumerate() {
                for chunk in ks.chunks(PIPELINE) {
                    let _ = self.requests_on(i, Op::Unbind, chunk, &group[0].1, self.opts.timeout);
                }
                if let Some(c) = r.conn.lock().as_mut() {
                    for k in &ks {
                        c.refused.remove(k);
                    }
                }
            }
        }
        drop(bound);
    }

    /// Withdraw a binding of ours from every connected replica (a replica
    /// that did not have it, or cannot be reached, does not matter: it
    /// loses it with our connection or its lease).
    pub fn unbind(&self, key: &Key) -> Result<()> {
        let mut bound = self.bound.lock();
        let Some(ep) = bound.remove(key) else { return Err(Errno(libc::ENOENT)) };
        for (i, r) in self.replicas.iter().enumerate() {
            let _ = self.request_on(i, Op::Unbind, key, &ep, self.opts.timeout);
            if let Some(c) = r.conn.lock().as_mut() {
                c.refused.remove(key);
            }
        }
        drop(bound);
        Ok(())
    }

    /// Vouch for the process of `incarnation` at `gid` (a GID of ours) on
    /// every connected replica, and on each one reconnected later, until
    /// [`MetaClient::unvouch`]: a presence query about it says connected
    /// while this connection is open (docs/vqp.md, "Presence"). Err when
    /// no replica took it.
    pub fn vouch(&self, incarnation: u64, gid: &rdma::Gid) -> Result<()> {
        let mut vouched = self.vouched.lock();
        let (key, ep) = vouch_request(incarnation, gid);
        let mut last = Errno(libc::ECONNREFUSED);
        let mut any = false;
        for i in 0..self.replicas.len() {
            match self.request_on(i, Op::Vouch, &key, &ep, self.opts.timeout) {
                Some(Ok(_)) => any = true,
                Some(Err((e, _))) => last = e,
                None => {}
            }
        }
        if !any {
            return Err(last);
        }
        vouched.insert((incarnation, *gid));
        Ok(())
    }

    /// Vouch for that process no more: it exited (`departed`), or we lost
    /// sight of it (it may live: unknown to a presence query).
    pub fn unvouch(&self, incarnation: u64, gid: &rdma::Gid, departed: bool) {
        let mut vouched = self.vouched.lock();
        if !vouched.remove(&(incarnation, *gid)) {
            return;
        }
        let (key, ep) = vouch_request(incarnation, gid);
        let op = if departed { Op::Departed } else { Op::Released };
        for i in 0..self.replicas.len() {
            let _ = self.request_on(i, op, &key, &ep, self.opts.timeout);
        }
    }

    /// One request on replica `i` if it is connected (None when it is
    /// not): the response's `held`, or the error and whether it was a
    /// transport failure (the replica is then failed).
    fn request_on(&self, i: usize, op: Op, key: &Key, ep: &Endpoint, timeout: Duration) -> Option<std::result::Result<u32, (Errno, bool)>> {
        self.on_conn(i, op, |conn, lease_ms, state| conn.request(op, lease_ms, key, ep, timeout, state))
            .map(|(res, broken)| res.map_err(|e| (e, broken)))
    }

    /// A batch of requests on replica `i` (see `Conn::requests`) if it is
    /// connected (None when it is not); a transport failure fails it.
    fn requests_on(&self, i: usize, op: Op, keys: &[Key], ep: &Endpoint, timeout: Duration) -> Option<Result<Vec<Result<u32>>>> {
        self.on_conn(i, op, |conn, lease_ms, state| conn.requests(op, lease_ms, keys, ep, timeout, state)).map(|(res, _)| res)
    }

    /// Run `f` on replica `i`'s connection if it is connected (None when
    /// it is not), with the lease in ms; a transport failure (the
    /// connection broken) fails the replica. Also says whether it broke.
    fn on_conn<T>(&self, i: usize, op: Op, f: impl FnOnce(&mut Conn, u32, &AtomicU8) -> Result<T>) -> Option<(Result<T>, bool)> {
        let r = &self.replicas[i];
        if !matches!(r.state(), REPOPULATING | UP) {
            return None;
        }
        let mut g = r.conn.lock();
        let conn = g.as_mut().filter(|_| matches!(r.state(), REPOPULATING | UP))?;
        let lease_ms = self.opts.lease.as_millis().min(u32::MAX as u128) as u32;
        let res = f(conn, lease_ms, &r.state);
        let broken = conn.broken;
        drop(g);
        if broken {
            if let Err(e) = &res {
                klog!(Level::Warn, "meta server {}: {op:?} failed: {e:?}", r.addr);
                self.fail(i);
            }
        }
        Some((res, broken))
    }

    /// Replica `i`'s connection failed: skip it from now on, and have the
    /// background thread drop it and reconnect.
    fn fail(&self, i: usize) {
        let r = &self.replicas[i];
        let was = r.state.fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| matches!(s, REPOPULATING | UP).then_some(FAILED));
        if was.is_ok() {
            klog!(Level::Warn, "meta server {}: connection failed; reconnecting in the background", r.addr);
            self.wake();
        }
    }

    fn wake(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes to our eventfd (non-blocking: a full
        // counter already wakes the thread).
        unsafe { libc::write(self.wake_fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn start_renewer(self: &Arc<Self>) {
        let mut t = self.renewer.lock();
        if t.is_some() {
            return;
        }
        let me = Arc::downgrade(self);
        *t = std::thread::Builder::new()
            .name("krcore-meta-renew".into())
            .spawn(move || background(&me))
            .map_err(|e| klog!(Level::Warn, "meta: cannot start the lease renewal thread: {e}"))
            .ok();
    }

    /// Stop renewing and reconnecting (the entries then expire, unless
    /// unbound first).
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake();
        if let Some(h) = self.renewer.lock().take() {
            let _ = h.join();
        }
    }

    /// Renew our leases on every connected replica (one request each,
    /// however many entries); one that answers with fewer entries than we
    /// registered gets them all again.
    fn renew(&self) {
        let n = self.bound.lock().len();
        if n == 0 {
            return;
        }
        let any = Key::Port { gid: [0; 16], port: 0 };
        let none = Endpoint { gid: [0; 16], qpn: 0, qkey: 0, incarnation: 0, vqpn: 0 };
        // One bound for the pass: a replica answering late leaves the
        // others what is left of their leases.
        let deadline = Instant::now() + self.opts.renew_timeout();
        for (i, r) in self.replicas.iter().enumerate() {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            match self.request_on(i, Op::RenewAll, &any, &none, left) {
                Some(Ok(held)) => {
                    let refused = r.conn.lock().as_ref().map_or(0, |c| c.refused.len());
                    if lost_entries(held, n, refused) {
                        klog!(
                            Level::Warn,
                            "meta server {}: holds {held} of our {n} entries (leases ran out?): registering them again",
                            r.addr
                        );
                        self.repopulate(i);
                    }
                }
                Some(Err((e, false))) => klog!(Level::Warn, "meta server {}: lease renewal refused: {e:?}", r.addr),
                _ => {}
            }
        }
    }

    /// Register every binding of ours on replica `i` (Bind of a key it has
    /// with our endpoint is a no-op), and vouch there again for the
    /// processes we vouch for. False when the replica failed.
    fn repopulate(&self, i: usize) -> bool {
        let r = &self.replicas[i];
        {
            let vouched = self.vouched.lock();
            for (incarnation, gid) in vouched.iter() {
                let (key, ep) = vouch_request(*incarnation, gid);
                if matches!(self.request_on(i, Op::Vouch, &key, &ep, self.opts.background_timeout()), None | Some(Err((_, true)))) {
                    return false;
                }
            }
        }
        let keys: Vec<Key> = self.bound.lock().keys().copied().collect();
        let mut done = 0;
        for key in keys {
            // Held across the request: an unbind in between must not be
            // undone by this registration.
            let bound = self.bound.lock();
            let Some(ep) = bound.get(&key).copied() else { continue };
            if r.conn.lock().as_ref().is_some_and(|c| c.refused.contains(&key)) {
                continue;
            }
            match self.request_on(i, Op::Bind, &key, &ep, self.opts.background_timeout()) {
                Some(Ok(_)) => done += 1,
                Some(Err((e, false))) => {
                    // Another process took it there while that replica did
                    // not have ours. It stays ours on the replicas that
                    // have it (and in our renewals): the application has
                    // no way to hear of a lost binding, and dropping it
                    // everywhere would lose it for good.
                    klog!(
                        Level::Warn,
                        "meta server {}: {key:?} refused when registered again: {e:?}; kept on the other replicas, not retried here",
                        r.addr
                    );
                    if let Some(c) = r.conn.lock().as_mut() {
                        c.refused.insert(key);
                    }
                }
                _ => return false,
            }
            drop(bound);
        }
        stats::add(Stat::KRCORE_STAT_META_REBINDS, done);
        true
    }

    /// Connect to replica `i` again and register our entries there; it is
    /// up (used for lookups) once they all are.
    fn reconnect(&self, i: usize) -> Result<()> {
        let r = &self.replicas[i];
        let conn =
            Conn::connect(&self.dev, self.sgid_index, r.addr, self.opts.reconnect_timeout(self.replicas.len()), self.opts.incarnation)?;
        let incarnation = conn.incarnation;
        r.tcp_fd.store(conn.tcp.as_raw_fd(), Ordering::Relaxed);
        *r.conn.lock() = Some(conn);
        r.state.store(REPOPULATING, Ordering::Release);
        stats::inc(Stat::KRCORE_STAT_META_RECONNECTS);
        let t0 = Instant::now();
        if self.repopulate(i) && r.state.compare_exchange(REPOPULATING, UP, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            klog!(
                Level::Info,
                "meta server {}: connected again (incarnation {incarnation:#x}); our {} entries registered in {:?}",
                r.addr,
                self.bound.lock().len(),
                t0.elapsed()
            );
        }
        Ok(())
    }

    /// Drop replica `i`'s failed connection (closing its TCP connection:
    /// the server drops what we had there).
    fn reap(&self, i: usize) {
        let r = &self.replicas[i];
        let old = r.conn.lock().take();
        r.tcp_fd.store(-1, Ordering::Relaxed);
        r.state.store(DOWN, Ordering::Release);
        drop(old);
    }
}

impl Replica {
    fn state(&self) -> u8 {
        self.state.load(Ordering::Acquire)
    }
}

/// The background thread: renewals every period, failure detection, and
/// reconnection. Sleeps in poll(2) on the eventfd and the TCP connections
/// (the server's end closing: it died) until the next thing due.
fn background(me: &Weak<MetaClient>) {
    let Some(c) = me.upgrade() else { return };
    let period = c.opts.period();
    let n = c.replicas.len();
    let t0 = Instant::now();
    let mut next_renew = t0 + period;
    // Replicas down from the start were just tried.
    let mut last_try: Vec<Option<Instant>> = vec![Some(t0); n];
    let mut next_try: Vec<Instant> = vec![t0 + period; n];
    let mut warned = vec![false; n];
    drop(c);
    loop {
        let Some(c) = me.upgrade() else { return };
        if c.stop.load(Ordering::Acquire) {
            return;
        }
        let now = Instant::now();
        let mut due = next_renew;
        let mut fds = vec![libc::pollfd { fd: c.wake_fd.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        let mut watched = Vec::new();
        for (i, r) in c.replicas.iter().enumerate() {
            match r.state() {
                DOWN => due = due.min(next_try[i]),
                FAILED => due = now,
                _ => {
                    let fd = r.tcp_fd.load(Ordering::Relaxed);
                    if fd >= 0 {
                        fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
                        watched.push(i);
                    }
                }
            }
        }
        let ms = due.saturating_duration_since(now).as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        // SAFETY: valid pollfds; the sockets are closed only by this
        // thread (`reap`), the eventfd when the client is dropped, which
        // our reference prevents.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if rc < 0 && Errno::last().0 != libc::EINTR {
            klog!(Level::Warn, "meta: background poll failed: {:?}", Errno::last());
            return;
        }
        if fds[0].revents != 0 {
            let mut v = 0u64;
            // SAFETY: reads 8 bytes from our non-blocking eventfd.
            unsafe { libc::read(c.wake_fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        }
        if c.stop.load(Ordering::Acquire) {
            return;
        }
        // The server never sends on TCP after its Welcome: readable means
        // it closed (died or restarted).
        for (k, &i) in watched.iter().enumerate() {
            if fds[1 + k].revents != 0 {
                klog!(Level::Warn, "meta server {}: closed our connection", c.replicas[i].addr);
                c.fail(i);
            }
        }
        let now = Instant::now();
        for (i, r) in c.replicas.iter().enumerate() {
            if r.state() == FAILED {
                c.reap(i);
                next_try[i] = next_attempt(last_try[i], now, period);
            }
        }
        if now >= next_renew {
            c.renew();
            next_renew = now + period;
        }
        for (i, r) in c.replicas.iter().enumerate() {
            let now = Instant::now();
            if r.state() != DOWN || now < next_try[i] {
                continue;
            }
            last_try[i] = Some(now);
            match c.reconnect(i) {
                Ok(()) => warned[i] = false,
                Err(e) => {
                    // Once per outage at warn: a replica may be down long.
                    let lvl = if warned[i] { Level::Debug } else { Level::Warn };
                    klog!(lvl, "meta server {}: cannot reconnect: {e:?} (tried again every {period:?})", r.addr);
                    warned[i] = true;
                }
            }
            next_try[i] = Instant::now().max(now + period);
        }
    }
}

impl Conn {
    /// Whether the server closed our TCP connection: it never sends on it
    /// after its `Welcome`, so readable (or hung up) means it died or
    /// restarted.
    fn server_closed(&self) -> bool {
        crate::poll::readable(self.tcp.as_raw_fd(), 0)
    }

    fn connect(dev: &Arc<Device>, sgid_index: u32, addr: SocketAddr, timeout: Duration, incarnation: u64) -> Result<Conn> {
        // Our objects first: the server drops a connection whose `Hello`
        // does not come within 2 s, and these kernel commands take that
        // long in a process starved of CPU (a burst of new ones).
        let cq = Arc::new(Cq::new(dev, 2 * PIPELINE as u32)?);
        let caps = Caps { send_wr: PIPELINE as u32, recv_wr: PIPELINE as u32, send_sge: 1, recv_sge: 1, inline: 0 };
        let qp = Qp::new(dev, ibv_qp_type::IBV_QPT_RC, &cq, &cq, caps)?;
        qp.to_init()?;
        let bufs = Region::new(dev, BUFS_LEN, rdma::LOCAL_WRITE)?;
        crate::kmark!("meta: CQ, QP (INIT) and buffers made");
        let mut tcp = TcpStream::connect_timeout(&addr, timeout)?;
        crate::kmark!("meta: TCP connected to {addr}");
        tcp.set_read_timeout(Some(timeout))?;
        let _ = tcp.set_nodelay(true);
        let psn = rdma::random_psn();
        let hello = Hello { gid: dev.gid(sgid_index)?, qpn: qp.qpn(), psn, incarnation };
        let mut out = [0u8; proto::BOOT_LEN];
        hello.encode(&mut out);
        tcp.write_all(&out)?;
        // Made while the server brings its QP up.
        let mut prover = Prover::new(dev)?;
        let mut buf = [0u8; proto::BOOT_LEN];
        tcp.read_exact(&mut buf)?;
        crate::kmark!("meta: welcome received (TCP round trip)");
        let w = Welcome::decode(&buf)?;
        if w.status != 0 {
            return Err(Errno(w.status as i32));
        }
        // Our GID first: the keys of a `qbind` are under it, and the proof
        // is there before our first `Bind` can be.
        prover.aim(&w);
        prover.prove(&hello.gid, timeout)?;
        qp.rc_connect(sgid_index, psn, &RcPeer { gid: w.gid, qpn: w.qpn, psn: w.psn })?;
        crate::kmark!("meta: proof sent, QP RTR + RTS");
        let mut c = Conn {
            tcp,
            cq,
            qp,
            bufs,
            table_addr: w.table_addr,
            table_rkey: w.table_rkey,
            table: None,
            incarnation: w.incarnation,
            next_req: 1,
            refused: HashSet::new(),
            broken: false,
            prover,
            proven: HashSet::from([hello.gid]),
            unprovable: HashSet::new(),
        };
        c.post_recv()?;
        // The header, once: it says how to find a key's neighborhood.
        let up = AtomicU8::new(REPOPULATING);
        c.read(0, HEADER_SIZE, timeout, &up)?;
        crate::kmark!("meta: table header READ");
        // SAFETY: the READ completed; nothing else writes the buffer.
        let table = RemoteEndpointTable::parse(unsafe { c.bufs.bytes(READ_OFF, HEADER_SIZE) })?;
        if table.nslots() != w.table_slots || table.incarnation() != w.incarnation {
            return Err(Errno(libc::EPROTO));
        }
        c.table = Some(table);
        Ok(c)
    }

    fn post_recv(&self) -> Result<()> {
        self.post_recv_at(RECV_OFF)
    }

    fn post_recv_at(&self, off: usize) -> Result<()> {
        let mut sge = self.bufs.sge(off, proto::META_LEN);
        // SAFETY: a plain C struct.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        // SAFETY: one WR over our own registered buffer.
        unsafe { self.qp.post_recv(&mut wr) }
    }

    /// One signaled READ of `len` bytes at `off` in the table into our
    /// buffer, waited for.
    fn read(&mut self, off: u64, len: usize, timeout: Duration, state: &AtomicU8) -> Result<()> {
        let mut sge = self.bufs.sge(READ_OFF, len);
        // SAFETY: a plain C struct.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.rdma.remote_addr = self.table_addr + off;
        wr.wr.rdma.rkey = self.table_rkey;
        // SAFETY: one WR into our own registered buffer.
        unsafe { self.qp.post_send(&mut wr) }.inspect_err(|_| self.broken = true)?;
        match self.wait(timeout, false, state)? {
            ibv_wc_opcode::IBV_WC_RDMA_READ => Ok(()),
            other => Err(self.protocol_error(other)),
        }
    }

    /// A completion we did not expect: our bookkeeping of this QP is lost.
    fn protocol_error(&mut self, opcode: u32) -> Errno {
        klog!(Level::Warn, "meta: unexpected completion (opcode {opcode})");
        self.broken = true;
        Errno(libc::EPROTO)
    }

    fn lookup(&mut self, key: &Key, timeout: Duration, state: &AtomicU8) -> Result<Option<Endpoint>> {
        let table = self.table.ok_or(Errno(libc::ENOTCONN))?;
        let (off, len) = table.neighborhood(*key);
        for _ in 0..TORN_RETRIES {
            self.read(off, len, timeout, state)?;
            // SAFETY: the READ completed; nothing else writes the buffer.
            match table.lookup_in(unsafe { self.bufs.bytes(READ_OFF, len) }, *key) {
                Lookup::Found(ep) => return Ok(Some(ep)),
                Lookup::Absent => return Ok(None),
                Lookup::Torn => continue,
            }
        }
        Err(Errno(libc::EAGAIN))
    }

    /// One request and its response: the response's `held`, or its errno
    /// (`broken` false: the server's verdict).
    fn request(&mut self, op: Op, lease_ms: u32, key: &Key, ep: &Endpoint, timeout: Duration, state: &AtomicU8) -> Result<u32> {
        self.requests(op, lease_ms, std::slice::from_ref(key), ep, timeout, state)?.remove(0)
    }

    /// Up to [`PIPELINE`] requests (one per key, all with `ep`) and their
    /// responses, in order: each one's `held` or the server's verdict; the
    /// outer error is a transport failure (`broken`). The GIDs of the keys
    /// a `Bind` names are proven first; one the server answers EAGAIN (it
    /// has not seen the proof: the datagram may come after the request, or
    /// be lost) is proven again and retried, for [`PROOF_WAIT`] at most,
    /// then fails EACCES (EADDRNOTAVAIL: a GID that is not ours).
    fn requests(
        &mut self,
        op: Op,
        lease_ms: u32,
        keys: &[Key],
        ep: &Endpoint,
        timeout: Duration,
        state: &AtomicU8,
    ) -> Result<Vec<Result<u32>>> {
        if !matches!(op, Op::Bind | Op::Renew | Op::Vouch) {
            return self.send_requests(op, lease_ms, keys, ep, timeout, state);
        }
        let mut out: Vec<Result<u32>> = vec![Err(Errno(libc::EAGAIN)); keys.len()];
        for (i, key) in keys.iter().enumerate() {
            if !self.proven.contains(key.gid()) {
                // Another error: the server says EAGAIN, and it is proven
                // again below.
                match self.prove(key.gid(), timeout) {
                    Err(e) if e.0 == libc::EADDRNOTAVAIL => out[i] = Err(e),
                    _ => {}
                }
            }
        }
        let deadline = Instant::now() + PROOF_WAIT.min(timeout);
        let mut pause = Duration::from_micros(50);
        let mut first = true;
        loop {
            let todo: Vec<usize> = (0..keys.len()).filter(|&i| out[i] == Err(Errno(libc::EAGAIN))).collect();
            if todo.is_empty() {
                break;
            }
            if !first {
                if Instant::now() + pause > deadline {
                    for i in todo {
                        out[i] = Err(Errno(libc::EACCES));
                    }
                    break;
                }
                stats::inc(Stat::KRCORE_STAT_META_PROOF_RETRIES);
                std::thread::sleep(pause);
                pause = (pause * 4).min(Duration::from_millis(100));
                for gid in todo.iter().map(|&i| *keys[i].gid()).collect::<HashSet<_>>() {
                    let _ = self.prove(&gid, timeout);
                }
            }
            first = false;
            let batch: Vec<Key> = todo.iter().map(|&i| keys[i]).collect();
            for (i, r) in todo.into_iter().zip(self.send_requests(op, lease_ms, &batch, ep, timeout, state)?) {
                out[i] = r;
            }
        }
        for (key, r) in keys.iter().zip(&out) {
            match r {
                Err(e) if e.0 == libc::EACCES || e.0 == libc::EADDRNOTAVAIL => {
                    if self.unprovable.insert(*key.gid()) {
                        klog!(
                            Level::Info,
                            "meta: GID {} cannot be proven to the server ({e:?}): no key is bound under it on this connection",
                            std::net::Ipv6Addr::from(*key.gid())
                        );
                    }
                }
                Ok(_) => {
                    self.unprovable.remove(key.gid());
                }
                Err(_) => {}
            }
        }
        Ok(out)
    }

    /// Send a proof of `gid` (then proven here); an error other than
    /// EADDRNOTAVAIL (not a GID we can prove from) is logged.
    fn prove(&mut self, gid: &rdma::Gid, timeout: Duration) -> Result<()> {
        let r = self.prover.prove(gid, timeout);
        match &r {
            Ok(()) => {
                self.proven.insert(*gid);
            }
            Err(e) if e.0 == libc::EADDRNOTAVAIL => {}
            Err(e) => klog!(Level::Warn, "meta: cannot prove GID {}: {e:?}", std::net::Ipv6Addr::from(*gid)),
        }
        r
    }

    /// [`requests`] sent as they are, at once. The server answers a
    /// client's requests in order, and holds [`PIPELINE`] receives for it.
    ///
    /// [`requests`]: Conn::requests
    fn send_requests(
        &mut self,
        op: Op,
        lease_ms: u32,
        keys: &[Key],
        ep: &Endpoint,
        timeout: Duration,
        state: &AtomicU8,
    ) -> Result<Vec<Result<u32>>> {
        let n = keys.len();
        if n == 0 || n > PIPELINE {
            return Err(Errno::EINVAL);
        }
        // One receive (slot 0) is always posted; the others for this batch.
        for i in 1..n {
            self.post_recv_at(recv_off(i)).inspect_err(|_| self.broken = true)?;
        }
        let first = self.next_req;
        for (i, key) in keys.iter().enumerate() {
            let req_id = first.wrapping_add(i as u32);
            let req = Request { op, req_id, lease_ms, key: *key, endpoint: *ep, secret: *SECRET };
            // SAFETY: the send slots are free: a batch is sent only once
            // the previous one completed.
            let out = unsafe { self.bufs.bytes_mut(send_off(i), proto::META_LEN) };
            req.encode(out.try_into().expect("a META_LEN slice"));
            let mut sge = self.bufs.sge(send_off(i), proto::META_LEN);
            // SAFETY: a plain C struct.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
            wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
            // SAFETY: one WR over our own registered buffer.
            unsafe { self.qp.post_send(&mut wr) }.inspect_err(|_| self.broken = true)?;
        }
        self.next_req = first.wrapping_add(n as u32);
        if op == Op::RenewAll {
            stats::inc(Stat::KRCORE_STAT_META_RENEWALS);
        }
        // The responses' receives may complete before our sends' ACKs do:
        // the two queues' completions come in either order. Receives
        // complete in the order they were posted: response i in slot i.
        let (mut sent, mut answered) = (0, 0);
        while sent < n || answered < n {
            match self.wait(timeout, true, state)? {
                ibv_wc_opcode::IBV_WC_SEND if sent < n => sent += 1,
                ibv_wc_opcode::IBV_WC_RECV if answered < n => answered += 1,
                other => return Err(self.protocol_error(other)),
            }
        }
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            // SAFETY: the receive completed; slot 0 is posted again below,
            // after every response was read.
            let resp = Response::decode(unsafe { self.bufs.bytes(recv_off(i), proto::META_LEN) }).inspect_err(|_| self.broken = true)?;
            if resp.req_id != first.wrapping_add(i as u32) {
                self.broken = true;
                return Err(Errno(libc::EPROTO));
            }
            out.push(match resp.status {
                0 => Ok(resp.held),
                e => Err(Errno(e as i32)),
            });
        }
        self.post_recv().inspect_err(|_| self.broken = true)?;
        Ok(out)
    }

    /// Wait for our next completion and return its opcode: polling
    /// (`sleep` false: a lookup on the caller's thread) or sleeping on the
    /// completion channel between polls; either gives up as soon as the
    /// replica is found failed (by the background thread) or its server
    /// closed our TCP connection (it died: no answer will come), looked at
    /// every [`WAIT_SLICE`] while sleeping and every millisecond while
    /// polling. The background thread itself waits here for its renewals:
    /// a server that died just before one would otherwise hold it, and
    /// every lookup behind it, for the whole renewal bound. A failure or a
    /// timeout breaks the connection: its QP may hold work we no longer
    /// track.
    fn wait(&mut self, timeout: Duration, sleep: bool, state: &AtomicU8) -> Result<u32> {
        let start = Instant::now();
        let deadline = start + timeout;
        let mut next_look = start + SERVER_LOOK;
        // SAFETY: plain C data.
        let mut wc: [ibv_wc; 1] = unsafe { std::mem::zeroed() };
        loop {
            if self.cq.poll(&mut wc).inspect_err(|_| self.broken = true)? == 1 {
                if wc[0].status != ibv_wc_status::IBV_WC_SUCCESS {
                    klog!(Level::Warn, "meta: completion status {}", wc[0].status);
                    self.broken = true;
                    return Err(Errno(libc::ECONNRESET));
                }
                return Ok(wc[0].opcode);
            }
            let now = Instant::now();
            if now >= deadline {
                self.broken = true;
                return Err(Errno(libc::ETIMEDOUT));
            }
            if state.load(Ordering::Acquire) == FAILED {
                // Found dead meanwhile (its server closed the connection).
                self.broken = true;
                return Err(Errno(libc::ECONNRESET));
            }
            if sleep || now >= next_look {
                next_look = now + SERVER_LOOK;
                if self.server_closed() {
                    klog!(Level::Debug, "meta: the server closed our connection during a request");
                    self.broken = true;
                    return Err(Errno(libc::ECONNRESET));
                }
            }
            if sleep {
                // In slices, to see the replica found dead meanwhile.
                let slice = (deadline - now).min(WAIT_SLICE);
                self.cq.wait(Some(slice)).inspect_err(|_| self.broken = true)?;
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lost_entries_counts_what_the_replica_should_hold() {
        assert!(!lost_entries(3, 3, 0));
        assert!(!lost_entries(4, 3, 0), "more (an unbind in flight) is not a loss");
        assert!(lost_entries(2, 3, 0));
        assert!(lost_entries(0, 1, 0), "a restarted server knows nothing of us");
        // Keys it refused are not expected there.
        assert!(!lost_entries(2, 3, 1));
        assert!(!lost_entries(0, 1, 5));
    }

    #[test]
    fn reconnection_attempts_are_a_period_apart() {
        let t = Instant::now();
        let p = Duration::from_millis(500);
        assert_eq!(next_attempt(None, t, p), t, "never tried: at once");
        assert_eq!(next_attempt(Some(t - Duration::from_secs(2)), t, p), t, "long ago: at once");
        assert_eq!(next_attempt(Some(t - Duration::from_millis(100)), t, p), t + Duration::from_millis(400));
    }

    #[test]
    fn background_bounds_fit_the_lease() {
        let o = Options { timeout: Duration::from_secs(2), lease: Duration::from_millis(1500), incarnation: 0 };
        assert_eq!(o.period(), Duration::from_millis(500));
        assert_eq!(o.background_timeout(), Duration::from_millis(500));
        assert_eq!(o.reconnect_timeout(2), Duration::from_millis(250));
        // Alone, an attempt is bounded as a renewal.
        assert_eq!(o.reconnect_timeout(1), Duration::from_millis(1000));
        // Renewals wait until the leases renewed a period ago run out,
        // whatever the timeout of the application's waits.
        assert_eq!(o.renew_timeout(), Duration::from_millis(1000));
        let o = Options { timeout: Duration::from_millis(100), lease: Duration::from_secs(3), incarnation: 0 };
        assert_eq!(o.renew_timeout(), Duration::from_secs(2));
        let o = Options { timeout: Duration::from_millis(100), lease: Duration::from_secs(30), incarnation: 0 };
        assert_eq!(o.background_timeout(), Duration::from_millis(100));
        assert_eq!(o.reconnect_timeout(3), Duration::from_millis(100));
    }

    #[test]
    fn parse_addrs_takes_a_list() {
        let a = parse_addrs("10.0.0.1:5, 10.0.0.2:6,").unwrap();
        assert_eq!(a.len(), 2);
        assert_eq!(a[1].port(), 6);
        assert_eq!(parse_addrs(" , ").unwrap_err(), Errno::EINVAL);
        assert_eq!(parse_addrs("nonsense").unwrap_err(), Errno::EINVAL);
    }
}
