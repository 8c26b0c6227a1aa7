//! The agent's loop: a unix `SOCK_SEQPACKET` listener at its socket path,
//! each process checked with `SO_PEERCRED` when it connects, and lookups
//! answered from the host's one meta-server connection and DCCache.
//!
//! One thread, asleep in `poll(2)` until a process connects, sends or
//! hangs up (or half a second passes, to see a stop asked from another
//! thread's signal). A wake-up reads what every ready process sent, then
//! answers the lookups with one look at the meta server per distinct key:
//! a burst of new processes asking for one address costs one READ. Work
//! requests come through the staging regions' rings (`super::ring`):
//! after any, the thread keeps looking at the rings and at its VQPs'
//! completions without sleeping for a moment ([`SPIN`]), so that a
//! process's next request, or a completion that comes soon, needs no
//! wake-up on either side.

use super::proto::Message;
use crate::error::{Errno, Result};
use crate::meta::client::{MetaClient, Options};
use crate::meta::{Endpoint, Key};
use crate::rdma::Device;
use libc::c_int;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the agent runs (`krcore-node`'s command line).
#[derive(Clone, Debug)]
pub struct Config {
    pub socket: PathBuf,
    pub meta: Vec<SocketAddr>,
    pub device: Option<String>,
    /// GID of the meta-server connection (default: the one the kernel
    /// routes to the first meta server from, else the first usable one).
    pub gid_index: Option<u32>,
    /// Processes attached at once; one beyond is refused (closed).
    pub max_clients: usize,
    /// Bound on every wait for the meta server.
    pub timeout: Duration,
}

/// What the agent did, for its statistics line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub attached: u64,
    /// Processes of another user, or beyond `max_clients`.
    pub refused: u64,
    /// Processes dropped for a malformed message or one out of turn.
    pub dropped: u64,
    pub lookups: u64,
    /// Looks at the meta server (one per distinct key of a wake-up).
    pub meta_lookups: u64,
    pub failed_lookups: u64,
    /// VQPs of the agent's connected for processes.
    pub connects: u64,
    /// Checks of peers' rkeys made again to keep them warm (`super::warm`).
    pub mr_rechecks: u64,
    /// Service endpoints of attached processes vouched for at the meta
    /// server (`super::presence`), said departed (exited), released.
    pub vouched: u64,
    pub departed: u64,
    pub released: u64,
    /// `PRESENT`s not vouched for (a GID not on the agent's device, an
    /// incarnation another process presented, no meta server).
    pub unvouched: u64,
}

struct Process {
    fd: OwnedFd,
    pid: i32,
    welcomed: bool,
    /// Names the process in its work requests' wr_ids (never reused).
    serial: u32,
    /// Its staging region and VQPs, once it sent `STAGE`.
    staging: Option<super::path::Staging>,
    /// What the agent vouches for it at the meta server.
    vouched: super::presence::Vouched,
}

/// The host's meta-server connection, made at the start and again (at
/// most once a second) at a lookup while it is missing.
struct Meta {
    dev: Arc<Device>,
    gid_index: u32,
    addrs: Vec<SocketAddr>,
    timeout: Duration,
    client: Option<Arc<MetaClient>>,
    tried: Option<Instant>,
}

impl Meta {
    fn client(&mut self) -> Result<Arc<MetaClient>> {
        if let Some(c) = &self.client {
            return Ok(Arc::clone(c));
        }
        if self.tried.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return Err(Errno(libc::ECONNREFUSED));
        }
        self.tried = Some(Instant::now());
        // Lookups only: the lease is the library's default, unused; it
        // vouches for no process (its attached ones have their own
        // incarnations, and their presence is not told: docs/node.md).
        let opts = Options { timeout: self.timeout, lease: Duration::from_millis(3000), incarnation: 0 };
        match MetaClient::connect(&self.dev, self.gid_index, &self.addrs, opts) {
            Ok(c) => {
                self.client = Some(Arc::clone(&c));
                Ok(c)
            }
            Err(e) => {
                eprintln!("krcore-node: meta server {:?}: cannot connect: {e:?} (tried again at a lookup, once a second)", self.addrs);
                Err(e)
            }
        }
    }
}

pub struct Agent {
    listener: OwnedFd,
    path: PathBuf,
    processes: Vec<Process>,
    max_clients: usize,
    meta: Meta,
    incarnation: u64,
    fingerprint: u64,
    counts: Counts,
    /// The device of the agent's own VQPs, opened at the start (else at
    /// the first `STAGE`).
    device: Option<String>,
    verbs: Option<super::path::Verbs>,
    /// Staging regions made and registered ahead of the processes.
    spares: Vec<super::path::Region>,
    serials: u32,
    /// Keeps the rkeys the processes use checked (None: lease 0).
    warm: Option<super::warm::Warm>,
    /// Processes gone from their socket, watched for their exit.
    leaving: super::presence::Leaving,
}

/// A process's staging region (`transport::agent` slices it).
pub const STAGING: usize = crate::transport::agent::STAGING;
/// Regions kept ready.
pub const SPARES: usize = 2;
/// Nothing asked for this long: the agent is idle (makes a spare region).
const IDLE_MS: i32 = 2;
/// How long the loop keeps looking at the rings and its CQ after work
/// came or completed, without sleeping (the agent may poll; a process
/// never does): short, because on a small host a polling agent takes a
/// CPU from the processes it serves and from their peers (a burst of new
/// processes then starves a server that must answer their first
/// contacts).
const SPIN: Duration = Duration::from_micros(200);

/// What a process asked in one wake-up, answered after the reads.
enum Asked {
    Lookup(u32, Key, bool),
    Connect(u32, Key),
    /// Not answered: vouched for.
    Present(u64, crate::rdma::Gid),
}

impl Agent {
    /// Open the device, listen at the socket path (EADDRINUSE when an
    /// agent answers there; a stale socket file is replaced), and connect
    /// to the meta server (a failure is logged and tried again later).
    pub fn new(cfg: &Config) -> Result<Agent> {
        if cfg.meta.is_empty() {
            return Err(Errno::EINVAL);
        }
        let dev = Device::open(cfg.device.as_deref())?;
        let gid_index = match cfg.gid_index {
            Some(i) => i,
            None => dev.route_gid_index(&cfg.meta[0]).map_or_else(|| dev.default_gid_index(), Ok)?,
        };
        let listener = listen(&cfg.socket)?;
        let mut meta = Meta { dev, gid_index, addrs: cfg.meta.clone(), timeout: cfg.timeout, client: None, tried: None };
        let _ = meta.client();
        // Pre-initialized: the agent's own verbs (their runtime starts in
        // the background at this PD) before any process needs them.
        let verbs = super::path::Verbs::open(cfg.device.as_deref())
            .inspect_err(|e| eprintln!("krcore-node: its own VQPs: cannot open the device: {e:?} (tried again at a process's STAGE)"))
            .ok();
        Ok(Agent {
            listener,
            path: cfg.socket.clone(),
            processes: Vec::new(),
            max_clients: cfg.max_clients,
            meta,
            incarnation: crate::rdma::random_u64(),
            fingerprint: super::meta_fingerprint(&cfg.meta),
            counts: Counts::default(),
            device: cfg.device.clone(),
            verbs,
            spares: Vec::new(),
            serials: 0,
            warm: super::warm::Warm::start(),
            leaving: Default::default(),
        })
    }

    pub fn socket(&self) -> &Path {
        &self.path
    }

    pub fn device_name(&self) -> &str {
        &self.meta.dev.name
    }

    pub fn gid_index(&self) -> u32 {
        self.meta.gid_index
    }

    pub fn meta_connected(&self) -> bool {
        self.meta.client.is_some()
    }

    pub fn counts(&self) -> Counts {
        Counts {
            mr_rechecks: self.warm.as_ref().map_or(0, super::warm::Warm::renewed),
            departed: self.leaving.departed,
            released: self.leaving.released,
            ..self.counts
        }
    }

    /// Processes attached now.
    pub fn attached(&self) -> usize {
        self.processes.len()
    }

    /// Staging regions made ahead now (refilled when idle).
    pub fn spares(&self) -> usize {
        self.spares.len()
    }

    /// Serve until `stop` says so; `tick` runs at every wake-up (the
    /// binary prints its statistics there when asked).
    pub fn run(&mut self, stop: &dyn Fn() -> bool, tick: &mut dyn FnMut(&Agent)) -> Result<()> {
        let mut spin_until: Option<Instant> = None;
        while !stop() {
            let mut spinning = spin_until.is_some_and(|t| Instant::now() < t);
            if !spinning && spin_until.take().is_some() {
                // About to sleep: say so, then look once more (a process
                // that published meanwhile saw us awake: no doorbell).
                self.set_awake(false);
                if self.processes.iter().any(|p| p.staging.as_ref().is_some_and(|s| s.requests_waiting())) {
                    self.set_awake(true);
                    spinning = true;
                    spin_until = Some(Instant::now() + SPIN);
                }
            }
            let events = self.verbs.as_ref().map(super::path::Verbs::event_fd);
            let n_proc = self.processes.len();
            let mut fds: Vec<libc::pollfd> = std::iter::once(self.listener.as_raw_fd())
                .chain(self.processes.iter().map(|p| p.fd.as_raw_fd()))
                .chain(events)
                .chain(self.leaving.fds())
                .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
                .collect();
            // Spare regions are made when nothing else is asked (a
            // registration takes milliseconds: not in front of a
            // process's CONNECT or work request).
            let short = self.verbs.is_some() && self.spares.len() < SPARES;
            let timeout = if spinning {
                0
            } else if short {
                IDLE_MS
            } else {
                self.leaving.next_ms().map_or(500, |ms| ms.min(500))
            };
            // SAFETY: `fds` is a live array of fds.len() pollfds.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
            if n < 0 {
                let e = Errno::last();
                if e.0 == libc::EINTR {
                    continue;
                }
                return Err(e);
            }
            let mut asked = Vec::new();
            let mut gone = Vec::new();
            let event = events.is_some() && fds[1 + n_proc].revents != 0;
            let mut worked = if event || spinning { self.complete(event, &mut gone) } else { false };
            for (i, pfd) in fds.iter().enumerate().skip(1).take(n_proc) {
                // The ring first: a CLOSE on the socket comes after the
                // requests the process published before it.
                if !self.drain_ring(i - 1, &mut worked) {
                    gone.push(i - 1);
                    continue;
                }
                if pfd.revents == 0 {
                    continue;
                }
                // Then the ring again: a doorbell read here may follow a
                // request published after the first look.
                let hung_up = pfd.revents & (libc::POLLHUP | libc::POLLERR) != 0 && !readable(pfd);
                if !self.read_from(i - 1, &mut asked) || hung_up || !self.drain_ring(i - 1, &mut worked) {
                    gone.push(i - 1);
                }
            }
            self.answer(&asked, &mut gone);
            gone.sort_unstable();
            gone.dedup();
            for i in gone.into_iter().rev() {
                let p = self.processes.swap_remove(i);
                self.leaving.add(p.vouched, self.meta.client.as_deref());
            }
            self.leaving.check(self.meta.client.as_deref());
            if fds[0].revents & libc::POLLIN != 0 {
                self.accept_all();
            }
            if worked {
                if !spinning {
                    self.set_awake(true);
                }
                spin_until = Some(Instant::now() + SPIN);
            } else if n == 0 && !spinning {
                self.refill_one();
            }
            tick(self);
        }
        Ok(())
    }

    /// Tell every process whether the loop looks at the rings.
    fn set_awake(&self, awake: bool) {
        for s in self.processes.iter().filter_map(|p| p.staging.as_ref()) {
            s.set_awake(awake);
        }
    }

    /// Post what process `i` published in its ring; false when it must go
    /// (its ring broken). `worked` when there was any.
    fn drain_ring(&mut self, i: usize, worked: &mut bool) -> bool {
        let Some(s) = self.processes[i].staging.as_mut() else { return true };
        let Ok(posts) = s.take_requests() else {
            eprintln!("krcore-node: pid {}: dropped for a broken ring", self.processes[i].pid);
            self.counts.dropped += 1;
            return false;
        };
        *worked |= !posts.is_empty();
        posts.iter().all(|p| self.post(i, p))
    }

    fn accept_all(&mut self) {
        loop {
            // SAFETY: plain syscall; the fd returned is owned below.
            let fd = unsafe {
                libc::accept4(
                    self.listener.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                )
            };
            if fd < 0 {
                return;
            }
            // SAFETY: a new fd that nothing else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            let Ok(cred) = peer_cred(fd.as_raw_fd()) else {
                self.counts.refused += 1;
                continue;
            };
            if !same_user(cred.uid) {
                self.counts.refused += 1;
                eprintln!("krcore-node: refused pid {} of uid {}: it serves only its own user's processes", cred.pid, cred.uid);
                continue;
            }
            if self.processes.len() >= self.max_clients {
                self.counts.refused += 1;
                eprintln!("krcore-node: refused pid {}: {} processes attached (--max-clients)", cred.pid, self.processes.len());
                continue;
            }
            self.serials = self.serials.wrapping_add(1);
            self.processes.push(Process {
                fd,
                pid: cred.pid,
                welcomed: false,
                serial: self.serials,
                staging: None,
                vouched: Default::default(),
            });
        }
    }

    /// Read what process `i` sent; false when it must go (hung up, or
    /// sent what it must not).
    fn read_from(&mut self, i: usize, asked: &mut Vec<(usize, Asked)>) -> bool {
        // A bounded batch per wake-up, so one process cannot starve the others.
        for _ in 0..64 {
            let (m, fd) = match receive(self.processes[i].fd.as_raw_fd()) {
                Received::Nothing => return true,
                Received::Gone => return false,
                Received::Message(m, fd) => (m, fd),
            };
            crate::kmark!("node: got {:?}", m.as_ref().ok());
            let p = &mut self.processes[i];
            let ok = match (m, p.welcomed, fd) {
                (Ok(Message::Hello { .. }), false, None) => {
                    p.welcomed = true;
                    self.counts.attached += 1;
                    let w = Message::Welcome { incarnation: self.incarnation, fingerprint: self.fingerprint };
                    send(p.fd.as_raw_fd(), &w)
                }
                (Ok(Message::Lookup { id, key, fresh }), true, None) => {
                    asked.push((i, Asked::Lookup(id, key, fresh)));
                    true
                }
                (Ok(Message::Stage { len }), true, None) if p.staging.is_none() => self.stage(i, len),
                (Ok(Message::Connect { id, key }), true, None) if p.staging.is_some() => {
                    asked.push((i, Asked::Connect(id, key)));
                    true
                }
                // The doorbell: the ring is drained after each read.
                (Ok(Message::Ring), true, None) if p.staging.is_some() => true,
                (Ok(Message::Present { incarnation, gid }), true, None) => {
                    asked.push((i, Asked::Present(incarnation, gid)));
                    true
                }
                (Ok(Message::Close { handle }), true, None) if p.staging.is_some() => {
                    if let Some(s) = p.staging.as_mut() {
                        s.close(handle);
                    }
                    true
                }
                (m, _, _) => {
                    eprintln!("krcore-node: pid {}: dropped for {:?}", p.pid, m.map(|m| format!("{m:?} out of turn")));
                    false
                }
            };
            if !ok {
                self.counts.dropped += 1;
                return false;
            }
        }
        true
    }

    /// `STAGE`: a region for the process, from the spares (made now if
    /// none is left), passed with `STAGED`.
    fn stage(&mut self, i: usize, len: u64) -> bool {
        if self.verbs.is_none() {
            match super::path::Verbs::open(self.device.as_deref()) {
                Ok(v) => self.verbs = Some(v),
                Err(e) => eprintln!("krcore-node: its own VQPs: cannot open the device: {e:?}"),
            }
        }
        let region = match (&self.verbs, len == STAGING as u64) {
            (_, false) => Err(Errno::EINVAL),
            (None, _) => Err(Errno(libc::ENODEV)),
            (Some(v), true) => self.spares.pop().map_or_else(|| super::path::Region::new(v, STAGING), Ok),
        };
        let p = &mut self.processes[i];
        match region {
            Ok(r) => {
                let sent = send_fd(p.fd.as_raw_fd(), &Message::Staged { status: 0, len: r.len() as u64 }, r.fd());
                p.staging = Some(super::path::Staging::new(r));
                sent
            }
            Err(e) => send(p.fd.as_raw_fd(), &Message::Staged { status: e.0 as u32, len: 0 }),
        }
    }

    /// One more spare region, if short of `SPARES` (when idle: off a
    /// process's path).
    fn refill_one(&mut self) {
        let Some(v) = self.verbs.as_ref() else { return };
        if self.spares.len() < SPARES {
            match super::path::Region::new(v, STAGING) {
                Ok(r) => self.spares.push(r),
                Err(e) => eprintln!("krcore-node: a staging region: {e:?}"),
            }
        }
    }

    /// A request of process `i`'s ring: on its VQP; one it cannot take
    /// completes at once with a local error. False when the process must
    /// go (its doorbell cannot be rung).
    fn post(&mut self, i: usize, post: &super::proto::Post) -> bool {
        let p = &mut self.processes[i];
        let wr_id = (p.serial as u64) << 32 | post.token as u64;
        let Some(s) = p.staging.as_mut() else { return false };
        if s.post(post, wr_id).is_ok() {
            crate::kmark!("node: request {} posted", post.token);
            return true;
        }
        let status = crate::sys::ibv_wc_status::IBV_WC_LOC_QP_OP_ERR;
        !s.push_done(super::ring::Done { token: post.token, status, byte_len: 0 }) || send(p.fd.as_raw_fd(), &Message::Ring)
    }

    /// The agent's VQPs' completions (after their channel's `event`, or
    /// polled while the loop spins), each into its process's ring: whether
    /// there were any.
    fn complete(&mut self, event: bool, gone: &mut Vec<usize>) -> bool {
        let Some(v) = self.verbs.as_ref() else { return false };
        let done = v.completions(event);
        for &(wr_id, status, byte_len) in &done {
            let serial = (wr_id >> 32) as u32;
            // A process that went meanwhile: nothing to tell.
            let Some(i) = self.processes.iter().position(|p| p.serial == serial) else { continue };
            let p = &mut self.processes[i];
            let Some(s) = p.staging.as_mut() else { continue };
            crate::kmark!("node: completion {} published", wr_id as u32);
            if s.push_done(super::ring::Done { token: wr_id as u32, status, byte_len }) && !send(p.fd.as_raw_fd(), &Message::Ring) {
                gone.push(i);
            }
        }
        !done.is_empty()
    }

    /// Answer `asked`: each distinct key looked at once (fresh when any
    /// asker wants it fresh); connects in order.
    fn answer(&mut self, asked: &[(usize, Asked)], gone: &mut Vec<usize>) {
        let mut keys: HashMap<Key, bool> = HashMap::new();
        for (_, a) in asked {
            if let Asked::Lookup(_, key, fresh) = a {
                *keys.entry(*key).or_default() |= fresh;
            }
        }
        let mut found: HashMap<Key, std::result::Result<Option<Endpoint>, u32>> = HashMap::new();
        for (key, fresh) in keys {
            self.counts.meta_lookups += 1;
            let r = self.meta.client().and_then(|m| if fresh { m.lookup_fresh(&key) } else { m.lookup(&key) });
            if r.is_err() {
                self.counts.failed_lookups += 1;
            }
            found.insert(key, r.map_err(|e| e.0 as u32));
        }
        for (i, a) in asked {
            let m = match a {
                Asked::Present(incarnation, gid) => {
                    self.present(*i, *incarnation, gid);
                    continue;
                }
                Asked::Lookup(id, key, _) => {
                    self.counts.lookups += 1;
                    Message::Found { id: *id, result: found[key] }
                }
                Asked::Connect(id, key) => {
                    self.counts.connects += 1;
                    let (v, p) = (self.verbs.as_ref(), &mut self.processes[*i]);
                    let r = match (v, p.staging.as_mut()) {
                        (Some(v), Some(s)) => s.connect(v, key),
                        _ => Err(Errno(libc::ENODEV)),
                    };
                    crate::kmark!("node: CONNECT {id} answered");
                    Message::Connected { id: *id, result: r.map_err(|e| e.0 as u32) }
                }
            };
            if !send(self.processes[*i].fd.as_raw_fd(), &m) {
                gone.push(*i);
            }
        }
    }

    /// `PRESENT` of process `i`: vouch for that endpoint of it at the meta
    /// server, if it is on a GID of the agent's device (its connection
    /// proves it, as a process of this host could itself) and no other
    /// process presented that incarnation.
    fn present(&mut self, i: usize, incarnation: u64, gid: &crate::rdma::Gid) {
        let pid = self.processes[i].pid;
        let ours = self.meta.dev.gid_index(gid).is_ok();
        let taken = self.leaving.vouches_for(incarnation)
            || self.processes.iter().enumerate().any(|(j, p)| j != i && p.vouched.vouches_for(incarnation));
        let r = match (ours, taken) {
            (false, _) => Err(Errno(libc::EADDRNOTAVAIL)),
            (_, true) => Err(Errno(libc::EADDRINUSE)),
            _ => self.meta.client().and_then(|m| self.processes[i].vouched.add(&m, pid, incarnation, gid)),
        };
        match r {
            Ok(()) => self.counts.vouched += 1,
            Err(e) => {
                self.counts.unvouched += 1;
                // The first ones said (a process on another GID of the
                // host is an expected case, at every attach); all counted.
                if self.counts.unvouched <= 10 {
                    eprintln!(
                        "krcore-node: pid {pid}: its endpoint {incarnation:#x} is not vouched for at the meta server: {e:?}{}",
                        if self.counts.unvouched == 10 { " (further ones counted only: unvouched)" } else { "" }
                    );
                }
            }
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // First: it uses the runtime of the VQPs dropped below.
        self.warm.take();
        if let Some(m) = &self.meta.client {
            m.shutdown();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn readable(p: &libc::pollfd) -> bool {
    p.revents & libc::POLLIN != 0
}

pub(crate) enum Received {
    Nothing,
    Gone,
    /// A message (or why it is not one) and the descriptor passed with it.
    Message(Result<Message>, Option<OwnedFd>),
}

/// The next message of `fd`, with a descriptor passed with it
/// (`SCM_RIGHTS`, at most one).
pub(crate) fn receive(fd: RawFd) -> Received {
    let mut buf = [0u8; super::proto::LEN + 1];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // Room for one descriptor's control message (u64 words: aligned).
    let mut ctl = [0u64; 4];
    // SAFETY: a plain C struct, filled below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&ctl);
    // SAFETY: `msg` points at live buffers of the lengths it gives.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC) };
    if n == 0 {
        return Received::Gone;
    }
    if n < 0 {
        return if Errno::last().0 == libc::EAGAIN { Received::Nothing } else { Received::Gone };
    }
    let mut passed = None;
    let mut extra = false;
    // SAFETY: the control buffer the kernel filled, walked with its macros.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<c_int>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<c_int>();
                for k in 0..count {
                    let fd = OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(k)));
                    if passed.is_none() {
                        passed = Some(fd);
                    } else {
                        extra = true;
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    let truncated = msg.msg_flags & (libc::MSG_CTRUNC | libc::MSG_TRUNC) != 0;
    let m = if extra || truncated { Err(crate::codec::EBADMSG) } else { Message::decode(&buf[..n as usize]) };
    Received::Message(m, passed)
}

/// Send `m` with descriptor `pass` (`SCM_RIGHTS`); false as [`send`].
pub(crate) fn send_fd(fd: RawFd, m: &Message, pass: RawFd) -> bool {
    let b = m.encode();
    let mut iov = libc::iovec { iov_base: b.as_ptr() as *mut libc::c_void, iov_len: b.len() };
    let mut ctl = [0u64; 4];
    // SAFETY: a plain C struct; the control buffer (32 bytes, aligned)
    // holds one descriptor's message, filled with the kernel's macros.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = ctl.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<c_int>() as u32) as usize;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<c_int>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<c_int>(), pass);
        libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) == b.len() as isize
    }
}

/// Send `m`; false when the process cannot take it (gone, or not reading
/// its answers: its socket buffer is full).
fn send(fd: RawFd, m: &Message) -> bool {
    let b = m.encode();
    // SAFETY: `b` is a live buffer of its length.
    let n = unsafe { libc::send(fd, b.as_ptr().cast(), b.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    n == b.len() as isize
}

/// A socket's peer as the kernel saw it connect.
pub fn peer_cred(fd: RawFd) -> Result<libc::ucred> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a live ucred and `len` its size.
    let r = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len) };
    if r != 0 {
        return Err(Errno::last());
    }
    Ok(cred)
}

/// Whether a peer of `uid` is one this process serves or trusts: its own
/// user, or root.
pub fn same_user(uid: libc::uid_t) -> bool {
    // SAFETY: geteuid has no preconditions.
    uid == unsafe { libc::geteuid() } || uid == 0
}

/// A unix address for `path` (ENAMETOOLONG past sun_path).
pub fn unix_addr(path: &Path) -> Result<(libc::sockaddr_un, libc::socklen_t)> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: a plain C struct; all zeroes is valid.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.is_empty() || bytes.len() >= a.sun_path.len() || bytes.contains(&0) {
        return Err(Errno(libc::ENAMETOOLONG));
    }
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in a.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    Ok((a, std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t))
}

/// A new `SOCK_SEQPACKET` unix socket.
pub fn seqpacket() -> Result<OwnedFd> {
    // SAFETY: plain syscall; the fd is checked and then owned.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Listen at `path`, readable and writable by this user only. A socket
/// file nobody answers at (an agent that was killed) is replaced; one an
/// agent answers at is EADDRINUSE.
fn listen(path: &Path) -> Result<OwnedFd> {
    let (addr, len) = unix_addr(path)?;
    if path.exists() {
        let probe = seqpacket()?;
        // SAFETY: `addr` is a live sockaddr_un of `len` bytes.
        if unsafe { libc::connect(probe.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len) } == 0 {
            return Err(Errno(libc::EADDRINUSE));
        }
        std::fs::remove_file(path)?;
    }
    let fd = seqpacket()?;
    // The mode comes from the umask at bind: owner only. The agent binds
    // before it starts any thread, so the umask is nobody else's meanwhile.
    // SAFETY: umask has no preconditions.
    let old = unsafe { libc::umask(0o177) };
    // SAFETY: as above.
    let r = unsafe { libc::bind(fd.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len) };
    // SAFETY: umask has no preconditions.
    unsafe { libc::umask(old) };
    if r != 0 {
        return Err(Errno::last());
    }
    // SAFETY: plain syscalls on our fd.
    unsafe {
        if libc::listen(fd.as_raw_fd(), 1024) != 0 {
            return Err(Errno::last());
        }
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
    Ok(fd)
}
