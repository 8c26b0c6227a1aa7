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
//!
//! One thread, event driven: `poll(2)` on the listening socket, every
//! client's socket (and those still owing their `Hello`) and the
//! completion channel, with the next lease sweep as timeout. No locks;
//! nothing spins.
//!
//! An expired entry must never resolve, yet lookups are READs the server
//! does not see: so an entry is removed a margin *before* its deadline
//! ([`sweep_margin`]), and nothing in the loop blocks for longer than that
//! margin (a new client's `Hello` is read when its socket is readable, not
//! waited for).

use super::proto::{self, Answer, BootMessage, Hello, Op, Query, Request, Response, Welcome};
use super::table::EndpointTable;
use super::{Endpoint, Key};
use crate::error::{Errno, Result};
use crate::rdma::{self, Caps, Cq, Device, Qp, RcPeer, Region};
use crate::sys::*;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Requests a client may have in flight (receive buffers per client).
pub(crate) const CREDITS: usize = 8;

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
}

struct Client {
    tcp: TcpStream,
    qp: Qp,
    /// CREDITS receive slots, then CREDITS send slots, of `proto::META_LEN`.
    bufs: Region,
}

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
}

pub struct Server {
    /// Declared before `table_mem`, whose memory it points into, so that
    /// it is dropped first.
    table: EndpointTable<'static>,
    table_mem: Region,
    dev: Arc<Device>,
    sgid_index: u32,
    gid: rdma::Gid,
    cq: Arc<Cq>,
    slots: u32,
    incarnation: u64,
    listener: TcpListener,
    clients: HashMap<u32, Client>,
    /// Accepted connections whose `Hello` has not come yet.
    pending: Vec<Pending>,
    leases: Leases,
    max_lease: Duration,
}

impl Server {
    /// Bind the TCP address and set the table up on the RDMA device whose
    /// GID table holds the address's RoCE v2 GID.
    pub fn new(cfg: &Config) -> Result<Server> {
        let gid = rdma::ipv4_gid(*cfg.listen.ip());
        let dev = Device::open(cfg.device.as_deref())?;
        let sgid_index = dev.gid_index(&gid)?;
        let cq = Arc::new(Cq::new(&dev, 4096)?);
        let bytes = EndpointTable::bytes_for(cfg.slots);
        let table_mem = Region::new(&dev, bytes, rdma::LOCAL_WRITE | rdma::REMOTE_READ)?;
        let incarnation = rdma::random_u64();
        // SAFETY: the slice covers `table_mem`'s heap allocation, which
        // never moves and lives as long as the server, longer than `table`
        // (dropped first). Only `table` writes it; the NIC reads it.
        let mem = unsafe { std::slice::from_raw_parts_mut(table_mem.ptr(), bytes) };
        let table = EndpointTable::init(mem, cfg.slots, incarnation)?;
        let listener = TcpListener::bind(cfg.listen)?;
        Ok(Server {
            table,
            table_mem,
            dev,
            sgid_index,
            gid,
            cq,
            slots: cfg.slots,
            incarnation,
            listener,
            clients: HashMap::new(),
            pending: Vec::new(),
            leases: Leases::default(),
            max_lease: cfg.max_lease,
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

    /// Serve until `stop` returns true (checked after every wakeup).
    pub fn run(&mut self, stop: &dyn Fn() -> bool) -> Result<()> {
        while !stop() {
            let mut fds = vec![
                libc::pollfd { fd: self.listener.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                // SAFETY: a live channel.
                libc::pollfd { fd: unsafe { (*self.cq.channel).fd }, events: libc::POLLIN, revents: 0 },
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
            let ms = wait.as_micros().div_ceil(1000) as i32;
            // SAFETY: fds is a valid array of pollfds.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if rc < 0 && Errno::last().0 != libc::EINTR {
                return Err(Errno::last());
            }
            // Sweep first: requests served below must not delay it.
            self.expire(Instant::now());
            if fds[0].revents != 0 {
                self.accept();
            }
            if fds[1].revents != 0 {
                self.cq.wait(Some(Duration::ZERO))?;
            }
            // Completions may have arrived since the last event: always poll.
            self.serve_completions()?;
            for (i, q) in order.iter().enumerate() {
                if fds[2 + i].revents != 0 {
                    self.check_alive(*q);
                }
            }
            let ready: Vec<bool> = fds[2 + order.len()..][..npending].iter().map(|f| f.revents != 0).collect();
            self.greet(&ready);
            self.expire(Instant::now());
        }
        Ok(())
    }

    /// Queue a new connection until its `Hello` is readable: reading it
    /// here would stall the loop (and the sweep) behind a slow client.
    fn accept(&mut self) {
        let Ok((tcp, peer)) = self.listener.accept() else { return };
        if let Err(e) = tcp.set_nonblocking(true) {
            crate::klog!(crate::log::Level::Warn, "meta: client {peer}: {e}");
            return;
        }
        let _ = tcp.set_nodelay(true);
        self.pending.push(Pending { tcp, peer, until: Instant::now() + HELLO_TIMEOUT, got: Vec::new() });
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
            let mut hello = None;
            while hello.is_none() && p.got.len() >= proto::BOOT_LEN {
                let msg: Vec<u8> = p.got.drain(..proto::BOOT_LEN).collect();
                match BootMessage::decode(&msg) {
                    Ok(BootMessage::Query(q)) => match self.answer(&p.tcp, &q) {
                        Ok(()) => p.until = now + HELLO_TIMEOUT,
                        Err(e) => crate::klog!(crate::log::Level::Debug, "meta: query from {} not answered: {e:?}", p.peer),
                    },
                    Ok(BootMessage::Hello(h)) => hello = Some(h),
                    Err(e) => {
                        crate::klog!(crate::log::Level::Warn, "meta: client {} sent a malformed message: {e:?}", p.peer);
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
        for (p, hello) in hellos {
            let peer = p.peer;
            match p.tcp.set_nonblocking(false).map_err(Errno::from).and_then(|()| self.handshake(p.tcp, &hello)) {
                Ok(qpn) => crate::klog!(crate::log::Level::Info, "meta: client {peer} connected (qp {qpn})"),
                Err(e) => crate::klog!(crate::log::Level::Warn, "meta: client {peer} failed to connect: {e:?}"),
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

    /// Hello -> a QP for the client -> Welcome.
    fn handshake(&mut self, tcp: TcpStream, hello: &Hello) -> Result<u32> {
        let caps = Caps { send_wr: CREDITS as u32 * 2, recv_wr: CREDITS as u32, send_sge: 1, recv_sge: 1, inline: 0 };
        let qp = Qp::new(&self.dev, ibv_qp_type::IBV_QPT_RC, &self.cq, &self.cq, caps)?;
        let bufs = Region::new(&self.dev, 2 * CREDITS * proto::META_LEN, rdma::LOCAL_WRITE)?;
        let psn = rdma::random_psn();
        qp.to_init()?;
        qp.rc_connect(self.sgid_index, psn, &RcPeer { gid: hello.gid, qpn: hello.qpn, psn: hello.psn })?;
        let qpn = qp.qpn();
        let client = Client { tcp, qp, bufs };
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
        };
        let mut out = [0u8; proto::BOOT_LEN];
        welcome.encode(&mut out);
        let mut tcp = &client.tcp;
        tcp.write_all(&out)?;
        client.tcp.set_read_timeout(None)?;
        self.clients.insert(qpn, client);
        Ok(qpn)
    }

    fn serve_completions(&mut self) -> Result<()> {
        // SAFETY: ibv_wc is plain C data.
        let mut wcs: [ibv_wc; 32] = unsafe { std::mem::zeroed() };
        loop {
            let n = self.cq.poll(&mut wcs)?;
            for wc in &wcs[..n] {
                self.on_completion(wc);
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    fn on_completion(&mut self, wc: &ibv_wc) {
        let qpn = wc.qp_num;
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
        // SAFETY: the receive into this slot completed; nothing else uses it.
        let req = Request::decode(unsafe { client.bufs.bytes(slot * proto::META_LEN, proto::META_LEN) });
        let (req_id, status) = match req {
            Ok(r) => (r.req_id, self.apply(qpn, &r)),
            Err(e) => (0, e),
        };
        let held = self.leases.held(qpn);
        let client = &self.clients[&qpn];
        let resp = Response { req_id, status: status.0 as u32, held };
        if client.reply(slot, &resp).and_then(|_| client.post_recv(slot)).is_err() {
            self.drop_client(qpn);
        }
    }

    /// Carry out one request of client `qpn`; the errno to answer (0: done).
    fn apply(&mut self, qpn: u32, r: &Request) -> Errno {
        let lease = Duration::from_millis(r.lease_ms as u64).min(self.max_lease);
        let now = Instant::now();
        match r.op {
            Op::Bind | Op::Renew if !self.leases.may_change(&r.key, r.secret) => Errno(libc::EADDRINUSE),
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
        self.clients.remove(&qpn);
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

/// A connection's next boot message. It is readable (one 64-byte
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
