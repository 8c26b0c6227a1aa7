//! `krcore-meta`: serves the (GID, port) / (GID, virtual QPN) -> endpoint
//! table from registered memory.
//!
//! A process connects over TCP to the address the server listens on and
//! exchanges one `Hello` / `Welcome` pair: its RC QP for one of ours, and
//! where the table lives (address, rkey, slot count). From then on
//! everything is RDMA: lookups are one-sided READs of the table (no server
//! CPU), and registrations are `Request` SENDs answered by `Response`
//! SENDs. The TCP connection stays open only as a liveness signal: when the
//! process exits (however it dies, the kernel closes the socket) its
//! entries are removed at once; a process that stops renewing its leases
//! loses them when they expire.
//! The same signal answers for a process that binds nothing: its `Hello`
//! names its incarnation, and a `PresenceQuery` asks whether a connection
//! that named it and proved the GID asked about is open
//! (`super::presence`).
//!
//! One thread, event driven: `poll(2)` on the listening socket, every
//! client's socket (and those still owing their `Hello`), the completion
//! channel and the helpers' eventfd, with the next lease sweep as timeout.
//! No locks; nothing spins. The one call that may wait is a new client's
//! RTR: it resolves the GID its `Hello` names to a MAC address, and the
//! kernel waits for an ARP answer up to a second (1.02 s measured on a
//! veth with nobody at the address; a NOARP netdev such as the testbed's
//! dummy answers at once). So a client's QP is made and brought up (RTR,
//! RTS) on a short-lived helper thread (its creation and registration are
//! kernel work queries would otherwise wait behind), at most [`MAX_CONNECTING`] at once (more
//! `Hello`s wait their turn in `pending`), which hands it back over a
//! channel and wakes the loop through an eventfd; the `Welcome` follows.
//!
//! An expired entry must never resolve, yet lookups are READs the server
//! does not see: so an entry is removed a margin *before* its deadline
//! ([`sweep_margin`]), and nothing in the loop blocks for longer than that
//! margin (a new client's `Hello` is read when its socket is readable, not
//! waited for).
//!
//! Nothing a stranger sends makes it hold more than its [`Limits`]: clients
//! (in total and per source address, connections still owing their
//! `Hello` counted with those of their address), connections owing their
//! `Hello`, entries per client, and completions served per pass of the
//! loop (the rest wait for the next pass, after the sweep). A connection
//! beyond a bound is reset at once, a `Hello` beyond the clients' bound is
//! answered `EUSERS`, a `Bind` beyond a client's entries `EDQUOT`; each is
//! counted ([`Refused`]) and logged at warn level (at most once a second).
//!
//! A key is bound only under a GID its client proved to come from
//! (`super::proof`): a `Bind` under another is answered EAGAIN, and the
//! GIDs a client proves are bounded too.

use super::presence::Presences;
use super::proof::ProofQp;
use super::proto::{self, Answer, BootMessage, Hello, Op, PresenceAnswer, PresenceQuery, Query, Request, Response, Welcome};
use super::table::EndpointTable;
use super::{Endpoint, Key};
use crate::error::{Errno, Result};
use crate::rdma::{self, Caps, Cq, Device, Qp, RcPeer, Region};
use crate::sys::*;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The pollfds before the clients': the listener, the completion channel,
/// the helpers' eventfd.
const FIXED_FDS: usize = 3;

/// Requests a client may have in flight (receive buffers per client).
pub(crate) const CREDITS: usize = 8;

/// Completions a client can have in the CQ at once: its receives, and its
/// send queue's responses.
const CQES_PER_CLIENT: usize = 3 * CREDITS;

/// Completions served in one pass of the loop: a flood of requests does
/// not hold the sweep (or the other clients' sockets) up.
const COMPLETIONS_PER_PASS: usize = 1024;

/// What the server holds at most for the processes that connect to it
/// (`krcore-meta`'s `--max-*` options). Beyond, it refuses: nothing a
/// stranger sends exhausts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connected clients (each holds an RC QP here), in total.
    pub clients: usize,
    /// Connections from one source address: its clients and those still
    /// owing their `Hello`.
    pub clients_per_ip: usize,
    /// Connections still owing their `Hello` (queriers among them), in
    /// total.
    pub pending: usize,
    /// Entries one client (one connection) holds.
    pub entries_per_client: u32,
    /// GIDs one client proves (keys are bound under proven GIDs only).
    pub gids_per_client: usize,
}

impl Default for Limits {
    /// Far above an honest deployment: a process holds one connection per
    /// replica and PD runtime, and one entry per `qbind` and per
    /// transparent QP and usable GID (1,000 QPs on 10 GIDs: 10,000).
    fn default() -> Limits {
        Limits { clients: 1024, clients_per_ip: 256, pending: 512, entries_per_client: 16384, gids_per_client: 64 }
    }
}

/// Why a connection or request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    /// [`Limits::clients`] are connected.
    Clients,
    /// Its source address has [`Limits::clients_per_ip`] connections.
    PerIp,
    /// [`Limits::pending`] connections owe their `Hello`.
    Pending,
    /// The client holds [`Limits::entries_per_client`] (or vouches for
    /// [`MAX_VOUCHED`] processes).
    Entries,
    /// The process is out of file descriptors.
    Descriptors,
    /// A message that does not decode.
    Malformed,
    /// A proof that proves nothing: no client has its token, or its
    /// client proved [`Limits::gids_per_client`] GIDs.
    Proof,
}

/// What the server refused so far, by bound.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Refused {
    /// Connections (at accept, or at their `Hello`): clients were full.
    pub clients: u64,
    /// Connections: their source address was at its bound.
    pub per_ip: u64,
    /// Connections: too many owed their `Hello`.
    pub pending: u64,
    /// `Bind`s (and `Renew`s that bind again): their client held its
    /// bound of entries.
    pub entries: u64,
    /// Connections taken and reset at once: the process was out of file
    /// descriptors (`RLIMIT_NOFILE`).
    pub descriptors: u64,
    /// Messages that did not decode: boot messages (their connection is
    /// closed) and requests on a client's QP, a whole `META_LEN` bytes or
    /// not (answered `EBADMSG`).
    pub malformed: u64,
    /// Proof datagrams that proved nothing: malformed or without a GRH,
    /// naming no client or with another client's token, or beyond their
    /// client's bound of GIDs.
    pub proofs: u64,
    /// `Bind`s (and `Renew`s) under a GID their client had not proven,
    /// answered EAGAIN (an honest client's proof may still be on its way:
    /// it proves again and retries).
    pub unproven: u64,
}

impl Refused {
    fn count(&mut self, why: Refusal) {
        *match why {
            Refusal::Clients => &mut self.clients,
            Refusal::PerIp => &mut self.per_ip,
            Refusal::Pending => &mut self.pending,
            Refusal::Entries => &mut self.entries,
            Refusal::Descriptors => &mut self.descriptors,
            Refusal::Malformed => &mut self.malformed,
            Refusal::Proof => &mut self.proofs,
        } += 1;
    }
}

/// Whether a new connection from an address that has `from_ip`
/// connections (clients and pending) is taken, with `clients` connected
/// and `pending` owing their `Hello`.
fn admit(limits: &Limits, clients: usize, pending: usize, from_ip: usize) -> Option<Refusal> {
    if from_ip >= limits.clients_per_ip {
        Some(Refusal::PerIp)
    } else if clients >= limits.clients {
        Some(Refusal::Clients)
    } else if pending >= limits.pending {
        Some(Refusal::Pending)
    } else {
        None
    }
}

/// QPs brought up at once on helper threads; more `Hello`s wait (each
/// takes a second at most: the kernel's address resolution).
const MAX_CONNECTING: usize = 16;

/// A client whose QP a helper thread brings up (RTR, RTS).
struct Connecting {
    tcp: TcpStream,
    peer: std::net::SocketAddr,
    incarnation: u64,
}

/// A client's QP brought up (RTS) by a helper thread: the QP, its receive
/// buffers and the PSN it sends with.
struct BroughtUp {
    qp: Qp,
    bufs: Region,
    psn: u32,
}

/// A helper thread's result, for the handshake it was given (its number).
type Brought = (u64, Result<BroughtUp>);

/// How the server runs.
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddrV4,
    /// Home slots of the table (entries it can hold, about).
    pub slots: u32,
    /// The longest lease granted, whatever a client asks for.
    pub max_lease: Duration,
    /// The RDMA device (the first one when `None`).
    pub device: Option<String>,
    pub limits: Limits,
}

struct Client {
    tcp: TcpStream,
    /// Its source address (for [`Limits::clients_per_ip`]).
    ip: IpAddr,
    qp: Qp,
    /// CREDITS receive slots, then CREDITS send slots, of `proto::META_LEN`.
    bufs: Region,
    /// What its proofs carry ([`Welcome::token`]).
    token: u32,
    /// The GIDs it proved: it binds keys under these only.
    proven: Vec<rdma::Gid>,
    /// Its `Hello`'s: the process its connection vouches for, under the
    /// GIDs it proved.
    incarnation: u64,
    /// The processes it vouches for besides ([`Op::Vouch`]: a host's
    /// agent, for its attached processes), at most [`MAX_VOUCHED`].
    vouched: Vec<super::presence::Proven>,
}

/// Processes one connection may vouch for (an agent's attached processes:
/// `krcore-node --max-clients`, and a process may present one runtime per
/// protection domain).
pub const MAX_VOUCHED: usize = 16_384;

/// How long a client that connected may take to send its `Hello`.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);

struct Lease {
    deadline: Instant,
    /// When the sweep removes it: a margin before `deadline`.
    sweep_at: Instant,
    /// The client (its QP number) that holds it.
    owner: u32,
    /// The secret it was bound with ([`Request::secret`]).
    secret: u64,
    endpoint: Endpoint,
}

/// How long before its deadline an entry is removed: a tenth of its
/// lease, at most 200 ms. It covers the server's wakeup latency (poll(2)
/// rounds to milliseconds; a loaded machine schedules late), so that a
/// READ never finds an entry past its deadline. Renewals come every third
/// of the lease, long before it.
pub fn sweep_margin(lease: Duration) -> Duration {
    (lease / 10).min(Duration::from_millis(200))
}

/// The leases of the entries served, and how many each client holds.
#[derive(Default)]
struct Leases {
    map: HashMap<Key, Lease>,
    held: HashMap<u32, u32>,
}

impl Leases {
    /// `key` is `owner`'s now, until `now + lease`.
    fn insert(&mut self, key: Key, owner: u32, secret: u64, endpoint: Endpoint, now: Instant, lease: Duration) {
        let (deadline, sweep_at) = (now + lease, now + lease - sweep_margin(lease));
        if let Some(old) = self.map.insert(key, Lease { deadline, sweep_at, owner, secret, endpoint }) {
            self.dec(old.owner);
        }
        *self.held.entry(owner).or_default() += 1;
    }

    fn remove(&mut self, key: &Key) -> Option<Lease> {
        let l = self.map.remove(key)?;
        self.dec(l.owner);
        Some(l)
    }

    fn dec(&mut self, owner: u32) {
        if let Some(n) = self.held.get_mut(&owner) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&owner);
            }
        }
    }

    fn get(&self, key: &Key) -> Option<&Lease> {
        self.map.get(key)
    }

    /// Whether a request with `secret` may bind, renew or unbind `key`:
    /// nobody holds it, or it was bound with that secret (by this
    /// connection, or by an earlier one of the same process).
    fn may_change(&self, key: &Key, secret: u64) -> bool {
        self.map.get(key).is_none_or(|l| l.secret == secret)
    }

    /// Whether `owner` may hold `key` with at most `limit` entries: it
    /// holds it already (a renewal), or fewer than `limit`.
    fn may_take(&self, key: &Key, owner: u32, limit: u32) -> bool {
        self.map.get(key).is_some_and(|l| l.owner == owner) || self.held(owner) < limit
    }

    /// Extend every lease `owner` holds; how many that is.
    fn renew_all(&mut self, owner: u32, now: Instant, lease: Duration) -> u32 {
        let held = self.held(owner);
        if held > 0 {
            let (deadline, sweep_at) = (now + lease, now + lease - sweep_margin(lease));
            for l in self.map.values_mut().filter(|l| l.owner == owner) {
                l.deadline = deadline;
                l.sweep_at = sweep_at;
            }
        }
        held
    }

    fn held(&self, owner: u32) -> u32 {
        self.held.get(&owner).copied().unwrap_or(0)
    }

    fn owned_by(&self, owner: u32) -> Vec<Key> {
        self.map.iter().filter(|(_, l)| l.owner == owner).map(|(k, _)| *k).collect()
    }

    /// The entries to remove at `now`, with how late each is past its
    /// deadline (zero when on time).
    fn due(&self, now: Instant) -> Vec<(Key, Duration)> {
        self.map.iter().filter(|(_, l)| l.sweep_at <= now).map(|(k, l)| (*k, now.saturating_duration_since(l.deadline))).collect()
    }

    /// When the next sweep is due.
    fn next_sweep(&self) -> Option<Instant> {
        self.map.values().map(|l| l.sweep_at).min()
    }

    fn len(&self) -> usize {
        self.map.len()
    }
}

/// An accepted connection before its `Hello`: what it sent so far is kept
/// here, never waited for (a client that sends a message a byte at a time
/// holds nobody up).
struct Pending {
    tcp: TcpStream,
    peer: std::net::SocketAddr,
    /// Dropped if no `Hello` came by then (a `Query` extends it).
    until: Instant,
    got: Vec<u8>,
    /// Its `Hello`, when it came while [`MAX_CONNECTING`] QPs were being
    /// brought up: served in a later pass.
    hello: Option<Hello>,
}

pub struct Server {
    /// Declared before `table_mem`, whose memory it points into, so that
    /// it is dropped first.
    table: EndpointTable<'static>,
    table_mem: Region,
    dev: Arc<Device>,
    sgid_index: u32,
    gid: rdma::Gid,
    /// Our IPv6 GID for the clients' IPv6 proofs ([`Welcome::gid6`]).
    gid6: rdma::Gid,
    cq: Arc<Cq>,
    /// Takes the clients' proofs of their GIDs (completes on `cq`).
    proofs: ProofQp,
    slots: u32,
    incarnation: u64,
    listener: TcpListener,
    clients: HashMap<u32, Client>,
    presences: Presences,
    /// Accepted connections whose `Hello` has not come yet.
    pending: Vec<Pending>,
    leases: Leases,
    max_lease: Duration,
    /// Clients whose QP a helper thread makes and brings up, by the
    /// handshake's number (`handshakes`).
    connecting: HashMap<u64, Connecting>,
    handshakes: u64,
    brought_tx: std::sync::mpsc::Sender<Brought>,
    brought_rx: std::sync::mpsc::Receiver<Brought>,
    /// Written by a helper thread when it is done (wakes the loop).
    brought_fd: Arc<std::os::fd::OwnedFd>,
    limits: Limits,
    refused: Refused,
    /// When a refusal was last logged (at most once a second).
    refusal_logged: Option<Instant>,
    /// A descriptor kept free: given back to take (and reset) a connection
    /// when the process is out of them (see `accept`).
    spare: Option<std::fs::File>,
}

impl Server {
    /// Bind the TCP address and set the table up on the RDMA device whose
    /// GID table holds the address's RoCE v2 GID.
    pub fn new(cfg: &Config) -> Result<Server> {
        let gid = rdma::ipv4_gid(*cfg.listen.ip());
        let dev = Device::open(cfg.device.as_deref())?;
        let sgid_index = dev.gid_index(&gid)?;
        // Room for every client's completions: a full CQ would fail every
        // client's QP at once. Clients are as many as the device allows.
        let mut limits = cfg.limits;
        let max_cqe = (dev.dev_attr.max_cqe.max(0) as usize).max(4096);
        if limits.clients > max_cqe / CQES_PER_CLIENT {
            crate::klog!(crate::log::Level::Warn, "meta: {} clients at most (the device's CQ size)", max_cqe / CQES_PER_CLIENT);
            limits.clients = max_cqe / CQES_PER_CLIENT;
        }
        let cq = Arc::new(Cq::new(&dev, (limits.clients * CQES_PER_CLIENT + ProofQp::CQES).clamp(4096, max_cqe) as u32)?);
        let proofs = ProofQp::new(&dev, &cq)?;
        let gid6 = ipv6_gid(&dev);
        let bytes = EndpointTable::bytes_for(cfg.slots);
        let table_mem = Region::new(&dev, bytes, rdma::LOCAL_WRITE | rdma::REMOTE_READ)?;
        let incarnation = rdma::random_u64();
        // SAFETY: the slice covers `table_mem`'s heap allocation, which
        // never moves and lives as long as the server, longer than `table`
        // (dropped first). Only `table` writes it; the NIC reads it.
        let mem = unsafe { std::slice::from_raw_parts_mut(table_mem.ptr(), bytes) };
        let table = EndpointTable::init(mem, cfg.slots, incarnation)?;
        let listener = TcpListener::bind(cfg.listen)?;
        let (brought_tx, brought_rx) = std::sync::mpsc::channel();
        // SAFETY: plain syscall; the fd is checked and then owned.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(Errno::last());
        }
        // SAFETY: a new fd that nothing else owns.
        let brought_fd = Arc::new(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        Ok(Server {
            table,
            table_mem,
            dev,
            sgid_index,
            gid6,
            gid,
            cq,
            proofs,
            slots: cfg.slots,
            incarnation,
            listener,
            clients: HashMap::new(),
            presences: Presences::default(),
            pending: Vec::new(),
            leases: Leases::default(),
            max_lease: cfg.max_lease,
            connecting: HashMap::new(),
            handshakes: 0,
            brought_tx,
            brought_rx,
            brought_fd,
            limits,
            refused: Refused::default(),
            refusal_logged: None,
            spare: std::fs::File::open("/dev/null").ok(),
        })
    }

    /// The address actually bound (port 0 picks one).
    pub fn local_addr(&self) -> Result<std::net::SocketAddr> {
        Ok(self.listener.local_addr()?)
    }

    pub fn device_name(&self) -> &str {
        &self.dev.name
    }

    pub fn gid_index(&self) -> u32 {
        self.sgid_index
    }

    /// The bounds it serves with (clients lowered to what the device's CQ
    /// holds).
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// What it refused so far.
    pub fn refused(&self) -> Refused {
        self.refused
    }

    /// Count a refusal, and say so (at most once a second: a flood of them
    /// does not flood the log).
    fn refuse(&mut self, why: Refusal, who: &dyn std::fmt::Display) {
        self.refused.count(why);
        let now = Instant::now();
        if self.refusal_logged.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1)) {
            self.refusal_logged = Some(now);
            crate::klog!(
                crate::log::Level::Warn,
                "meta: refused {who}: {why:?} (bounds {:?}; refused so far: {:?})",
                self.limits,
                self.refused
            );
        }
    }

    /// Serve until `stop` returns true (checked after every wakeup).
    pub fn run(&mut self, stop: &dyn Fn() -> bool) -> Result<()> {
        // Completions left for the next pass ([`COMPLETIONS_PER_PASS`]).
        let mut more = false;
        while !stop() {
            let mut fds = vec![
                libc::pollfd { fd: self.listener.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                // SAFETY: a live channel.
                libc::pollfd { fd: unsafe { (*self.cq.channel).fd }, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.brought_fd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            ];
            let order: Vec<u32> = self.clients.keys().copied().collect();
            fds.extend(order.iter().map(|q| libc::pollfd { fd: self.clients[q].tcp.as_raw_fd(), events: libc::POLLIN, revents: 0 }));
            let npending = self.pending.len();
            fds.extend(self.pending.iter().map(|p| libc::pollfd { fd: p.tcp.as_raw_fd(), events: libc::POLLIN, revents: 0 }));
            // Wake for the next sweep, and at least once a second so that
            // `stop` is seen (and silent new clients are dropped).
            let wait = self
                .leases
                .next_sweep()
                .map_or(Duration::from_secs(1), |d| d.saturating_duration_since(Instant::now()))
                .min(Duration::from_secs(1));
            // Rounded up: waking before the sweep is due would spin.
            let ms = if more { 0 } else { wait.as_micros().div_ceil(1000) as i32 };
            // SAFETY: fds is a valid array of pollfds.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if rc < 0 && Errno::last().0 != libc::EINTR {
                return Err(Errno::last());
            }
            // Requests first, then the sweep: a renewal that came in time
            // while this loop was starved of CPU (a burst of new processes
            // on the host) renews its leases; swept first, they ran out and
            // lookups found nothing until the binder registered them
            // again. (At most COMPLETIONS_PER_PASS before the sweep.)
            if fds[1].revents != 0 {
                self.cq.wait(Some(Duration::ZERO))?;
            }
            // Completions may have arrived since the last event: always poll.
            more = self.serve_completions()?;
            self.expire(Instant::now());
            if fds[0].revents != 0 {
                self.accept();
            }
            for (i, q) in order.iter().enumerate() {
                if fds[FIXED_FDS + i].revents != 0 {
                    self.check_alive(*q);
                }
            }
            if fds[2].revents != 0 {
                let mut n = [0u8; 8];
                // SAFETY: an 8-byte read of our eventfd into a buffer of 8.
                unsafe { libc::read(self.brought_fd.as_raw_fd(), n.as_mut_ptr().cast(), 8) };
            }
            while let Ok((handshake, r)) = self.brought_rx.try_recv() {
                self.welcome(handshake, r);
            }
            let ready: Vec<bool> = fds[FIXED_FDS + order.len()..][..npending].iter().map(|f| f.revents != 0).collect();
            self.greet(&ready);
            self.expire(Instant::now());
        }
        Ok(())
    }

    /// Connections from `ip`: clients, those being brought up, pending.
    fn connections_from(&self, ip: IpAddr) -> usize {
        self.clients.values().filter(|c| c.ip == ip).count()
            + self.connecting.values().filter(|c| c.peer.ip() == ip).count()
            + self.pending.iter().filter(|p| p.peer.ip() == ip).count()
    }

    /// Clients, and those whose QP is being brought up.
    fn nclients(&self) -> usize {
        self.clients.len() + self.connecting.len()
    }

    /// Queue a new connection until its `Hello` is readable: reading it
    /// here would stall the loop (and the sweep) behind a slow client.
    /// One beyond the [`Limits`] is reset at once.
    fn accept(&mut self) {
        let (tcp, peer) = match self.listener.accept() {
            Ok(c) => c,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                // The connection stays queued and the listener readable:
                // poll would return at once, again and again. Free the
                // spare descriptor, take the connection, reset it.
                self.spare = None;
                if let Ok((tcp, peer)) = self.listener.accept() {
                    reset(tcp);
                    self.refuse(Refusal::Descriptors, &format_args!("connection from {peer}"));
                }
                self.spare = std::fs::File::open("/dev/null").ok();
                return;
            }
            Err(_) => return,
        };
        if let Some(why) = admit(&self.limits, self.nclients(), self.pending.len(), self.connections_from(peer.ip())) {
            reset(tcp);
            self.refuse(why, &format_args!("connection from {peer}"));
            return;
        }
        if let Err(e) = tcp.set_nonblocking(true) {
            crate::klog!(crate::log::Level::Warn, "meta: client {peer}: {e}");
            return;
        }
        let _ = tcp.set_nodelay(true);
        self.pending.push(Pending { tcp, peer, until: Instant::now() + HELLO_TIMEOUT, got: Vec::new(), hello: None });
    }

    /// Read what the readable pending connections sent (`ready`, in
    /// `pending` order; those accepted since are not in it) and serve
    /// their whole messages: a `Query` is answered and the connection
    /// stays pending (more queries, or its `Hello`, may follow); a `Hello`
    /// gets its QP. A partial message waits for its next bytes. Drop those
    /// that stayed without a `Hello` too long, closed, or sent garbage.
    fn greet(&mut self, ready: &[bool]) {
        let now = Instant::now();
        let mut keep = Vec::new();
        let mut hellos = Vec::new();
        for (i, mut p) in std::mem::take(&mut self.pending).into_iter().enumerate() {
            let open = !ready.get(i).copied().unwrap_or(false) || read_available(&p.tcp, &mut p.got);
            // Whole messages in order: queries, then at most a Hello.
            let mut hello = p.hello.take();
            while hello.is_none() && p.got.len() >= proto::BOOT_LEN {
                let msg: Vec<u8> = p.got.drain(..proto::BOOT_LEN).collect();
                match BootMessage::decode(&msg) {
                    Ok(BootMessage::Query(q)) => match self.answer(&p.tcp, &q) {
                        Ok(()) => p.until = now + HELLO_TIMEOUT,
                        Err(e) => crate::klog!(crate::log::Level::Debug, "meta: query from {} not answered: {e:?}", p.peer),
                    },
                    Ok(BootMessage::Presence(q)) => match self.answer_presence(&p.tcp, &q) {
                        Ok(()) => p.until = now + HELLO_TIMEOUT,
                        Err(e) => crate::klog!(crate::log::Level::Debug, "meta: presence query from {} not answered: {e:?}", p.peer),
                    },
                    Ok(BootMessage::Hello(h)) => hello = Some(h),
                    Err(e) => {
                        self.refuse(Refusal::Malformed, &format_args!("a message from {} ({e:?})", p.peer));
                        p.until = now;
                        break;
                    }
                }
            }
            if let Some(h) = hello {
                hellos.push((p, h));
            } else if !open {
                // A querier that is done closes its connection.
                crate::klog!(crate::log::Level::Debug, "meta: {} closed", p.peer);
            } else if now < p.until {
                keep.push(p);
            } else {
                crate::klog!(crate::log::Level::Warn, "meta: client {} sent no Hello", p.peer);
            }
        }
        self.pending = keep;
        // The queries first: a handshake makes a QP (milliseconds), a
        // query only reads the table, and its process waits for it.
        for (mut p, hello) in hellos {
            let peer = p.peer;
            // Clients may have come since it was accepted.
            if self.nclients() >= self.limits.clients {
                refuse_hello(&p.tcp);
                self.refuse(Refusal::Clients, &format_args!("Hello from {peer}"));
                continue;
            }
            if self.connecting.len() >= MAX_CONNECTING {
                // Its turn comes when a helper is done (that wakes us).
                p.hello = Some(hello);
                p.until = now + HELLO_TIMEOUT;
                self.pending.push(p);
                continue;
            }
            if let Err(e) = p.tcp.set_nonblocking(false).map_err(Errno::from).and_then(|()| self.handshake(p.tcp, peer, &hello)) {
                crate::klog!(crate::log::Level::Warn, "meta: client {peer} failed to connect: {e:?}");
            }
        }
    }

    /// A `Query`: what a READ of the table finds now (the sweep ran first,
    /// so an entry past its margin is already gone).
    fn answer(&self, tcp: &TcpStream, q: &Query) -> Result<()> {
        let endpoint = self.leases.get(&q.key).map(|l| l.endpoint);
        let mut out = [0u8; proto::BOOT_LEN];
        Answer { endpoint }.encode(&mut out);
        let mut tcp = tcp;
        tcp.write_all(&out)?;
        Ok(())
    }

    /// A `PresenceQuery`: whether a connection of that process is open.
    fn answer_presence(&self, tcp: &TcpStream, q: &PresenceQuery) -> Result<()> {
        let mut out = [0u8; proto::BOOT_LEN];
        PresenceAnswer { presence: self.presences.of((q.incarnation, q.gid)) }.encode(&mut out);
        let mut tcp = tcp;
        tcp.write_all(&out)?;
        Ok(())
    }

    /// Hello -> a QP for the client, made and brought up (RTR, RTS) on a
    /// helper thread: the RTR may wait for the kernel's address resolution,
    /// and the QP's creation and registration are milliseconds of kernel
    /// work the loop would otherwise do while queries wait (a burst of new
    /// processes each sends one of each). [`Server::welcome`] takes it from
    /// there.
    fn handshake(&mut self, tcp: TcpStream, peer: std::net::SocketAddr, hello: &Hello) -> Result<()> {
        let handshake = self.handshakes;
        self.handshakes += 1;
        let (dev, cq) = (Arc::clone(&self.dev), Arc::clone(&self.cq));
        let (sgid_index, to) = (self.sgid_index, RcPeer { gid: hello.gid, qpn: hello.qpn, psn: hello.psn });
        let (tx, fd) = (self.brought_tx.clone(), Arc::clone(&self.brought_fd));
        std::thread::Builder::new().name("meta-connect".into()).spawn(move || {
            if tx.send((handshake, bring_up(&dev, &cq, sgid_index, &to))).is_ok() {
                let one = 1u64.to_ne_bytes();
                // SAFETY: an 8-byte write to our eventfd.
                unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), 8) };
            }
        })?;
        self.connecting.insert(handshake, Connecting { tcp, peer, incarnation: hello.incarnation });
        Ok(())
    }

    /// A helper thread made and brought up a client's QP (or failed to):
    /// its receives, then the `Welcome`.
    fn welcome(&mut self, handshake: u64, r: Result<BroughtUp>) {
        let Some(c) = self.connecting.remove(&handshake) else { return };
        let peer = c.peer;
        match r.and_then(|b| self.admit_client(c, b)) {
            Ok(qpn) => crate::klog!(crate::log::Level::Info, "meta: client {peer} connected (qp {qpn})"),
            Err(e) => crate::klog!(crate::log::Level::Warn, "meta: client {peer} failed to connect: {e:?}"),
        }
    }

    /// The client's QP number.
    fn admit_client(&mut self, c: Connecting, b: BroughtUp) -> Result<u32> {
        let BroughtUp { qp, bufs, psn } = b;
        let qpn = qp.qpn();
        let token = rdma::random_u64() as u32;
        let client =
            Client { tcp: c.tcp, ip: c.peer.ip(), qp, bufs, token, proven: Vec::new(), incarnation: c.incarnation, vouched: Vec::new() };
        for slot in 0..CREDITS {
            client.post_recv(slot)?;
        }
        let welcome = Welcome {
            status: 0,
            gid: self.gid,
            qpn,
            psn,
            table_addr: self.table_mem.addr(),
            table_rkey: self.table_mem.rkey(),
            table_slots: self.slots,
            incarnation: self.incarnation,
            proof_qpn: self.proofs.qpn(),
            token,
            gid6: self.gid6,
        };
        let mut out = [0u8; proto::BOOT_LEN];
        welcome.encode(&mut out);
        let mut tcp = &client.tcp;
        tcp.write_all(&out)?;
        client.tcp.set_read_timeout(None)?;
        self.clients.insert(qpn, client);
        Ok(qpn)
    }

    /// Serve what the CQ holds, [`COMPLETIONS_PER_PASS`] at most; whether
    /// some may be left.
    fn serve_completions(&mut self) -> Result<bool> {
        // SAFETY: ibv_wc is plain C data.
        let mut wcs: [ibv_wc; 32] = unsafe { std::mem::zeroed() };
        for _ in 0..COMPLETIONS_PER_PASS / wcs.len() {
            let n = self.cq.poll(&mut wcs)?;
            for wc in &wcs[..n] {
                self.on_completion(wc);
            }
            if n < wcs.len() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn on_completion(&mut self, wc: &ibv_wc) {
        let qpn = wc.qp_num;
        if qpn == self.proofs.qpn() {
            return self.on_proof(wc);
        }
        if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
            // Flushes after a client left, or a broken QP: drop the client.
            if self.clients.contains_key(&qpn) {
                crate::klog!(crate::log::Level::Info, "meta: client qp {qpn} failed (status {})", wc.status);
                self.drop_client(qpn);
            }
            return;
        }
        if wc.opcode != ibv_wc_opcode::IBV_WC_RECV {
            return; // a response went out
        }
        let slot = wc.wr_id as usize;
        let Some(client) = self.clients.get(&qpn) else { return };
        // Only a whole message: the slot's other bytes are the client's
        // previous request.
        let req = if wc.byte_len as usize == proto::META_LEN {
            // SAFETY: the receive into this slot completed; nothing else uses it.
            Request::decode(unsafe { client.bufs.bytes(slot * proto::META_LEN, proto::META_LEN) })
        } else {
            Err(Errno(libc::EBADMSG))
        };
        let (req_id, status) = match req {
            Ok(r) => (r.req_id, self.apply(qpn, &r)),
            Err(e) => {
                self.refuse(Refusal::Malformed, &format_args!("a request of client qp {qpn} ({e:?}, {} bytes)", wc.byte_len));
                (0, e)
            }
        };
        let held = self.leases.held(qpn);
        let client = &self.clients[&qpn];
        let resp = Response { req_id, status: status.0 as u32, held };
        if client.reply(slot, &resp).and_then(|_| client.post_recv(slot)).is_err() {
            self.drop_client(qpn);
        }
    }

    /// A proof datagram came: its GID is proven for the client whose token
    /// it carries.
    fn on_proof(&mut self, wc: &ibv_wc) {
        let (proof, gid) = match self.proofs.take(wc) {
            Ok(Ok(got)) => got,
            Ok(Err(e)) => return self.refuse(Refusal::Proof, &format_args!("a proof datagram ({e:?})")),
            Err(e) => {
                // Its receives can no longer be posted: no client proves
                // again, and binds are refused (EAGAIN, then EACCES).
                crate::klog!(crate::log::Level::Error, "meta: the proof QP failed: {e:?}");
                return;
            }
        };
        let limit = self.limits.gids_per_client;
        match self.clients.get_mut(&proof.conn_qpn) {
            Some(c) if c.token == proof.token && c.proven.contains(&gid) => {}
            Some(c) if c.token == proof.token && c.proven.len() < limit => {
                c.proven.push(gid);
                self.presences.connected((c.incarnation, gid));
            }
            Some(c) if c.token == proof.token => {
                self.refuse(Refusal::Proof, &format_args!("a proof of client qp {}: {limit} GIDs proven", proof.conn_qpn))
            }
            _ => self.refuse(Refusal::Proof, &format_args!("a proof naming client qp {} (not its token)", proof.conn_qpn)),
        }
    }

    /// Carry out one request of client `qpn`; the errno to answer (0: done).
    fn apply(&mut self, qpn: u32, r: &Request) -> Errno {
        let lease = Duration::from_millis(r.lease_ms as u64).min(self.max_lease);
        let now = Instant::now();
        match r.op {
            Op::Bind | Op::Renew | Op::Vouch if !self.clients.get(&qpn).is_some_and(|c| c.proven.contains(r.key.gid())) => {
                self.refused.unproven += 1;
                Errno(libc::EAGAIN)
            }
            Op::Bind | Op::Renew if !self.leases.may_change(&r.key, r.secret) => Errno(libc::EADDRINUSE),
            Op::Bind | Op::Renew if !self.leases.may_take(&r.key, qpn, self.limits.entries_per_client) => {
                self.refuse(Refusal::Entries, &format_args!("a Bind of client qp {qpn}"));
                Errno(libc::EDQUOT)
            }
            Op::Bind | Op::Renew => {
                // A Renew of an entry this server does not have (it
                // restarted, or the lease ran out) binds again: renewals
                // repopulate a restarted server.
                if let Err(e) = self.table.insert(r.key, r.endpoint) {
                    return e;
                }
                self.leases.insert(r.key, qpn, r.secret, r.endpoint, now, lease);
                Errno(0)
            }
            Op::RenewAll => {
                // The response says how many entries that was: a client
                // that registered more learns that some were lost.
                self.leases.renew_all(qpn, now, lease);
                Errno(0)
            }
            Op::Vouch | Op::Departed | Op::Released => self.vouch(qpn, r.op, (r.endpoint.incarnation, *r.key.gid())),
            Op::Unbind => match self.leases.get(&r.key) {
                Some(l) if l.secret == r.secret && l.endpoint == r.endpoint => {
                    self.table.remove(r.key);
                    self.leases.remove(&r.key);
                    Errno(0)
                }
                _ => Errno(libc::ENOENT),
            },
        }
    }

    /// Client `qpn` vouches for process `p` (`Op::Vouch`, under a GID it
    /// proved: checked before), or says it exited (`Departed`) or that it
    /// vouches for it no more (`Released`): ENOENT for one it does not
    /// vouch for.
    fn vouch(&mut self, qpn: u32, op: Op, p: super::presence::Proven) -> Errno {
        let Some(c) = self.clients.get_mut(&qpn) else { return Errno(libc::ENOTCONN) };
        let at = c.vouched.iter().position(|v| *v == p);
        match (op, at) {
            (Op::Vouch, _) if p.0 == 0 => Errno(libc::EINVAL),
            (Op::Vouch, Some(_)) => Errno(0),
            (Op::Vouch, None) if c.vouched.len() >= MAX_VOUCHED => {
                self.refuse(Refusal::Entries, &format_args!("a Vouch of client qp {qpn}"));
                Errno(libc::EDQUOT)
            }
            (Op::Vouch, None) => {
                c.vouched.push(p);
                self.presences.connected(p);
                Errno(0)
            }
            (_, None) => Errno(libc::ENOENT),
            (op, Some(i)) => {
                c.vouched.swap_remove(i);
                if op == Op::Departed {
                    self.presences.disconnected(p);
                } else {
                    self.presences.released(p);
                }
                Errno(0)
            }
        }
    }

    /// A client's socket is readable: data is a protocol error, EOF means
    /// the process is gone.
    fn check_alive(&mut self, qpn: u32) {
        let Some(c) = self.clients.get(&qpn) else { return };
        let mut b = [0u8; 1];
        let (gone, why) = match (&c.tcp).read(&mut b) {
            Ok(0) => (true, "closed".to_string()),
            Ok(_) => (true, format!("sent a byte ({:#04x}) after its Hello", b[0])), // nothing ever is
            Err(e) => (e.kind() != std::io::ErrorKind::WouldBlock && e.kind() != std::io::ErrorKind::Interrupted, e.to_string()),
        };
        if gone {
            crate::klog!(crate::log::Level::Info, "meta: client qp {qpn} disconnected ({why})");
            self.drop_client(qpn);
        }
    }

    /// Forget a client and every entry it holds.
    fn drop_client(&mut self, qpn: u32) {
        if let Some(c) = self.clients.remove(&qpn) {
            c.proven.iter().for_each(|g| self.presences.disconnected((c.incarnation, *g)));
            // An agent gone says nothing of its processes.
            c.vouched.iter().for_each(|p| self.presences.released(*p));
        }
        let keys = self.leases.owned_by(qpn);
        self.remove_keys(&keys);
    }

    /// Remove the entries whose sweep is due (a margin before their
    /// deadline). One removed past its deadline means READs may have
    /// found it expired: said loudly, it must not happen.
    fn expire(&mut self, now: Instant) {
        let due = self.leases.due(now);
        if due.is_empty() {
            return;
        }
        crate::klog!(crate::log::Level::Info, "meta: {} lease(s) expired", due.len());
        if let Some(late) = due.iter().map(|(_, l)| *l).max().filter(|l| !l.is_zero()) {
            crate::klog!(crate::log::Level::Warn, "meta: an expired lease was removed {late:?} past its deadline");
        }
        let keys: Vec<Key> = due.into_iter().map(|(k, _)| k).collect();
        self.remove_keys(&keys);
    }

    fn remove_keys(&mut self, keys: &[Key]) {
        for k in keys {
            self.table.remove(*k);
            self.leases.remove(k);
        }
    }

    /// Entries currently served.
    pub fn entries(&self) -> usize {
        self.leases.len()
    }
}

impl Client {
    fn post_recv(&self, slot: usize) -> Result<()> {
        let mut sge = self.bufs.sge(slot * proto::META_LEN, proto::META_LEN);
        // SAFETY: a plain C struct.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = slot as u64;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        // SAFETY: one WR over our own registered buffer.
        unsafe { self.qp.post_recv(&mut wr) }
    }

    fn reply(&self, slot: usize, resp: &Response) -> Result<()> {
        let off = (CREDITS + slot) * proto::META_LEN;
        // SAFETY: the send slot of this request: the client sends its next
        // request in this slot only after it received this response.
        let out = unsafe { self.bufs.bytes_mut(off, proto::META_LEN) };
        resp.encode(out.try_into().expect("a META_LEN slice"));
        let mut sge = self.bufs.sge(off, proto::META_LEN);
        // SAFETY: a plain C struct.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = (CREDITS + slot) as u64;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        // SAFETY: one WR over our own registered buffer.
        unsafe { self.qp.post_send(&mut wr) }
    }
}

/// A client's QP, made, registered and brought up to RTS towards `to`
/// (on a helper thread).
fn bring_up(dev: &Arc<Device>, cq: &Arc<Cq>, sgid_index: u32, to: &RcPeer) -> Result<BroughtUp> {
    let caps = Caps { send_wr: CREDITS as u32 * 2, recv_wr: CREDITS as u32, send_sge: 1, recv_sge: 1, inline: 0 };
    let qp = Qp::new(dev, ibv_qp_type::IBV_QPT_RC, cq, cq, caps)?;
    let bufs = Region::new(dev, 2 * CREDITS * proto::META_LEN, rdma::LOCAL_WRITE)?;
    let psn = rdma::random_psn();
    qp.to_init()?;
    qp.rc_connect(sgid_index, psn, to)?;
    Ok(BroughtUp { qp, bufs, psn })
}

/// The GID of `dev` that clients prove their IPv6 GIDs to: a global one
/// (routed) rather than a link-local one; zero when it has none.
fn ipv6_gid(dev: &Device) -> rdma::Gid {
    let v6: Vec<rdma::Gid> = dev.usable_gids().into_iter().filter(|g| !rdma::is_ipv4_gid(g)).collect();
    let link_local = |g: &rdma::Gid| g[0] == 0xfe && g[1] & 0xc0 == 0x80;
    v6.iter().find(|g| !link_local(g)).or(v6.first()).copied().unwrap_or([0; 16])
}

/// Close a connection refused at accept at once, with a reset: its peer
/// learns at once (ECONNRESET), and nothing of it stays (no TIME_WAIT).
fn reset(tcp: TcpStream) {
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: a live socket, and a valid option of its size.
    unsafe {
        libc::setsockopt(
            tcp.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
}

/// Answer a `Hello` beyond [`Limits::clients`]: a `Welcome` that says
/// EUSERS (the client's caller sees that errno), then the connection
/// closes. Non-blocking: one message into a socket that never sent a reply.
fn refuse_hello(tcp: &TcpStream) {
    let w = Welcome::refusal(libc::EUSERS as u32);
    let mut out = [0u8; proto::BOOT_LEN];
    w.encode(&mut out);
    let _ = (&*tcp).write(&out);
}

/// A connection's next boot message. It is readable (one 128-byte
/// segment): the short timeout only guards a partial one. ECONNRESET when
/// the peer closed.
/// Append what `tcp` (non-blocking) has to `got`, never waiting; false
/// once the peer closed or the connection failed. At most two messages are
/// kept unread: a client that sends more before its answers is dropped.
fn read_available(tcp: &TcpStream, got: &mut Vec<u8>) -> bool {
    let mut buf = [0u8; proto::BOOT_LEN];
    let mut r = tcp;
    loop {
        match r.read(&mut buf) {
            Ok(0) => return false,
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                if got.len() > 2 * proto::BOOT_LEN {
                    return false;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(port: u32) -> Key {
        Key::Port { gid: [1; 16], port }
    }

    fn ep(qpn: u32) -> Endpoint {
        Endpoint { gid: [2; 16], qpn, qkey: 1, incarnation: 3, vqpn: 4 }
    }

    #[test]
    fn margin_is_a_tenth_capped() {
        assert_eq!(sweep_margin(Duration::from_millis(1500)), Duration::from_millis(150));
        assert_eq!(sweep_margin(Duration::from_secs(30)), Duration::from_millis(200));
        assert_eq!(sweep_margin(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn an_entry_is_swept_before_its_deadline() {
        let mut l = Leases::default();
        let t0 = Instant::now();
        let lease = Duration::from_millis(1000);
        l.insert(key(1), 7, SECRET, ep(1), t0, lease);
        assert_eq!(l.next_sweep(), Some(t0 + Duration::from_millis(900)));
        assert!(l.due(t0 + Duration::from_millis(899)).is_empty());
        // Due at the sweep, not late.
        assert_eq!(l.due(t0 + Duration::from_millis(900)), vec![(key(1), Duration::ZERO)]);
        // A sweep that ran after the deadline says how late.
        assert_eq!(l.due(t0 + Duration::from_millis(1030)), vec![(key(1), Duration::from_millis(30))]);
    }

    const SECRET: u64 = 0x5ec2_e7f0;

    #[test]
    fn only_the_secret_a_key_was_bound_with_changes_it() {
        let mut l = Leases::default();
        let t0 = Instant::now();
        assert!(l.may_change(&key(1), 77), "a free key");
        l.insert(key(1), 7, SECRET, ep(1), t0, Duration::from_secs(1));
        assert!(l.may_change(&key(1), SECRET), "its binder, from any connection");
        assert!(!l.may_change(&key(1), 77), "anyone else, though it names the same endpoint");
        l.remove(&key(1));
        assert!(l.may_change(&key(1), 77), "free again");
    }

    #[test]
    fn renew_all_extends_the_owners_leases_and_counts_them() {
        let mut l = Leases::default();
        let t0 = Instant::now();
        let lease = Duration::from_millis(1000);
        l.insert(key(1), 7, SECRET, ep(1), t0, lease);
        l.insert(key(2), 7, SECRET, ep(2), t0, lease);
        l.insert(key(3), 8, SECRET, ep(3), t0, lease);
        assert_eq!(l.renew_all(7, t0 + Duration::from_millis(500), lease), 2);
        let due: Vec<Key> = l.due(t0 + Duration::from_millis(950)).into_iter().map(|(k, _)| k).collect();
        assert_eq!(due, vec![key(3)], "only the unrenewed lease is due");
        // A client the server does not know (it restarted) holds nothing.
        assert_eq!(l.renew_all(9, t0, lease), 0);
    }

    #[test]
    fn a_client_at_its_bound_renews_but_binds_nothing_new() {
        let mut l = Leases::default();
        let t0 = Instant::now();
        let lease = Duration::from_secs(1);
        for p in 1..=3 {
            assert!(l.may_take(&key(p), 7, 3));
            l.insert(key(p), 7, SECRET, ep(p), t0, lease);
        }
        assert!(l.may_take(&key(2), 7, 3), "a renewal of an entry it holds");
        assert!(!l.may_take(&key(4), 7, 3), "a 4th entry");
        assert!(l.may_take(&key(4), 8, 3), "another client's count is its own");
        // Its own entry, taken over by another connection of its process,
        // counts for that connection.
        l.insert(key(1), 8, SECRET, ep(1), t0, lease);
        assert!(l.may_take(&key(4), 7, 3), "room again");
        assert!(!l.may_take(&key(2), 8, 1), "not held by 8: a new entry for it");
        l.remove(&key(2));
        l.remove(&key(3));
        assert!(l.may_take(&key(5), 7, 1));
    }

    #[test]
    fn connections_beyond_a_bound_are_refused() {
        let lim = Limits { clients: 4, clients_per_ip: 2, pending: 3, entries_per_client: 1, gids_per_client: 1 };
        assert_eq!(admit(&lim, 0, 0, 0), None);
        assert_eq!(admit(&lim, 3, 2, 1), None, "each one below its bound");
        assert_eq!(admit(&lim, 0, 0, 2), Some(Refusal::PerIp));
        assert_eq!(admit(&lim, 4, 0, 0), Some(Refusal::Clients));
        assert_eq!(admit(&lim, 0, 3, 0), Some(Refusal::Pending));
        // Its address first: the refusal a flood from one host sees.
        assert_eq!(admit(&lim, 4, 3, 2), Some(Refusal::PerIp));
        let mut r = Refused::default();
        for why in [Refusal::PerIp, Refusal::PerIp, Refusal::Clients, Refusal::Pending, Refusal::Entries] {
            r.count(why);
        }
        assert_eq!(r, Refused { clients: 1, per_ip: 2, pending: 1, entries: 1, ..Refused::default() });
    }

    #[test]
    fn one_address_cannot_take_every_pending_or_client_place_by_default() {
        let d = Limits::default();
        assert!(d.clients_per_ip < d.pending && d.clients_per_ip < d.clients);
        // 1,000 transparent QPs published on 10 GIDs (the testbed's).
        assert!(d.entries_per_client >= 10_000);
    }

    #[test]
    fn held_counts_follow_inserts_removals_and_owner_changes() {
        let mut l = Leases::default();
        let t0 = Instant::now();
        let lease = Duration::from_secs(1);
        l.insert(key(1), 7, SECRET, ep(1), t0, lease);
        l.insert(key(1), 7, SECRET, ep(1), t0, lease); // a renewal by Bind
        l.insert(key(2), 7, SECRET, ep(2), t0, lease);
        assert_eq!(l.held(7), 2);
        // The same process, reconnected: the entry changes owner.
        l.insert(key(2), 9, SECRET, ep(2), t0, lease);
        assert_eq!((l.held(7), l.held(9)), (1, 1));
        assert!(l.remove(&key(1)).is_some());
        assert!(l.remove(&key(1)).is_none());
        assert_eq!((l.held(7), l.held(9), l.len()), (0, 1, 1));
        assert_eq!(l.owned_by(9), vec![key(2)]);
        assert!(!l.held.contains_key(&7), "no count left for an owner without entries");
    }
}
