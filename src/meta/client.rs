//! The process's side of the meta server: lookups by one-sided READ of the
//! server's table (cached locally: the DCCache), and registrations by
//! request messages, each with a lease that a background thread renews.
//!
//! Every replica named in `KRCORE_META` gets one TCP connection (bootstrap,
//! then only a liveness signal: closing it, which the kernel does when the
//! process dies, removes our entries at once) and one RC QP. Registrations
//! go to every replica; a lookup uses the first replica that answers.
//!
//! Lookups run on the caller's thread and poll their own completion (the
//! caller is inside an extended verb that waits for the answer anyway);
//! the renewal thread sleeps on a condition variable and on the replicas'
//! completion channels, never spinning.

use super::proto::{self, Hello, Op, Request, Response, Welcome};
use super::table::{Lookup, RemoteEndpointTable, HEADER_SIZE, NEIGHBORHOOD};
use super::{Endpoint, Key};
use crate::error::{Errno, Result};
use crate::klog;
use crate::log::Level;
use crate::rdma::{self, Caps, Cq, Device, Qp, RcPeer, Region};
use crate::sys::*;
use parking_lot::{Condvar, Mutex};
use rustc_hash::FxHashMap;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Torn reads tolerated in a row before a lookup gives up (EAGAIN).
const TORN_RETRIES: u32 = 64;

/// Offsets in a replica's buffer region.
const RECV_OFF: usize = 0;
const SEND_OFF: usize = proto::META_LEN;
const READ_OFF: usize = 2 * proto::META_LEN;
/// Room for one neighborhood READ (or the table header).
const READ_LEN: usize = NEIGHBORHOOD * 128;

/// How the client behaves (`KRCORE_META*`).
#[derive(Clone, Debug)]
pub struct Options {
    /// Bound on every wait for the meta server.
    pub timeout: Duration,
    /// Lease asked for each registration; renewed every third of it.
    pub lease: Duration,
}

struct Replica {
    addr: SocketAddr,
    /// Held open: the server drops our entries when it closes.
    _tcp: TcpStream,
    cq: Arc<Cq>,
    qp: Qp,
    bufs: Region,
    table_addr: u64,
    table_rkey: u32,
    /// The table's geometry, from its header (read once, at connect).
    table: Option<RemoteEndpointTable>,
    next_req: u32,
    /// A failed QP stays failed: the replica is skipped from then on.
    dead: bool,
}

pub struct MetaClient {
    replicas: Vec<Mutex<Replica>>,
    /// The DCCache: endpoints looked up, valid until the peer is found dead.
    cache: Mutex<FxHashMap<Key, Endpoint>>,
    /// What this process registered, for renewal.
    bound: Mutex<HashMap<Key, Endpoint>>,
    opts: Options,
    renewer: Mutex<Option<std::thread::JoinHandle<()>>>,
    wake: Condvar,
    stop: Mutex<bool>,
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

impl MetaClient {
    /// Connect to every replica from our GID at `sgid_index` on `dev`.
    /// Fails (ECONNREFUSED, ETIMEDOUT, ...) when no replica is reachable.
    pub fn connect(dev: &Arc<Device>, sgid_index: u32, addrs: &[SocketAddr], opts: Options) -> Result<Arc<MetaClient>> {
        let mut replicas = Vec::new();
        let mut last = Errno(libc::ECONNREFUSED);
        for addr in addrs {
            match Replica::connect(dev, sgid_index, *addr, opts.timeout) {
                Ok(r) => replicas.push(Mutex::new(r)),
                Err(e) => {
                    klog!(Level::Warn, "meta server {addr}: cannot connect: {e:?}");
                    last = e;
                }
            }
        }
        if replicas.is_empty() {
            return Err(last);
        }
        Ok(Arc::new(MetaClient {
            replicas,
            cache: Mutex::new(FxHashMap::default()),
            bound: Mutex::new(HashMap::new()),
            opts,
            renewer: Mutex::new(None),
            wake: Condvar::new(),
            stop: Mutex::new(false),
        }))
    }

    /// The endpoint bound at `key`: from the DCCache, else one READ of the
    /// table (re-read while torn). `Ok(None)`: nothing is bound there.
    pub fn lookup(&self, key: &Key) -> Result<Option<Endpoint>> {
        if let Some(ep) = self.cache.lock().get(key) {
            return Ok(Some(*ep));
        }
        let mut last = Errno(libc::ECONNREFUSED);
        for r in &self.replicas {
            let mut r = r.lock();
            if r.dead {
                continue;
            }
            match r.lookup(key, self.opts.timeout) {
                Ok(found) => {
                    if let Some(ep) = found {
                        self.cache.lock().insert(*key, ep);
                    }
                    return Ok(found);
                }
                Err(e) => {
                    klog!(Level::Warn, "meta server {}: lookup failed: {e:?}", r.addr);
                    last = e;
                }
            }
        }
        Err(last)
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

    /// Register `key` -> `ep` on every replica, then keep it alive.
    pub fn bind(self: &Arc<Self>, key: &Key, ep: &Endpoint) -> Result<()> {
        self.request_all(Op::Bind, key, ep)?;
        self.bound.lock().insert(*key, *ep);
        self.start_renewer();
        Ok(())
    }

    pub fn unbind(&self, key: &Key) -> Result<()> {
        let Some(ep) = self.bound.lock().remove(key) else { return Err(Errno(libc::ENOENT)) };
        self.request_all(Op::Unbind, key, &ep)
    }

    fn request_all(&self, op: Op, key: &Key, ep: &Endpoint) -> Result<()> {
        let lease_ms = self.opts.lease.as_millis().min(u32::MAX as u128) as u32;
        let mut ok = 0;
        let mut last = Errno(libc::ECONNREFUSED);
        for r in &self.replicas {
            let mut r = r.lock();
            if r.dead {
                continue;
            }
            match r.request(op, lease_ms, key, ep, self.opts.timeout) {
                Ok(()) => ok += 1,
                // The server's verdict (EADDRINUSE, ENOSPC, ...) is the answer.
                Err(e) if !r.dead => return Err(e),
                Err(e) => last = e,
            }
        }
        if ok == 0 {
            return Err(last);
        }
        Ok(())
    }

    fn start_renewer(self: &Arc<Self>) {
        let mut t = self.renewer.lock();
        if t.is_some() {
            return;
        }
        let me = Arc::downgrade(self);
        let period = self.opts.lease / 3;
        *t = std::thread::Builder::new()
            .name("krcore-meta-renew".into())
            .spawn(move || renew_loop(&me, period))
            .map_err(|e| klog!(Level::Warn, "meta: cannot start the lease renewal thread: {e}"))
            .ok();
    }

    /// Stop renewing (the entries then expire, unless unbound first).
    pub fn shutdown(&self) {
        *self.stop.lock() = true;
        self.wake.notify_all();
        if let Some(h) = self.renewer.lock().take() {
            let _ = h.join();
        }
    }
}

fn renew_loop(me: &std::sync::Weak<MetaClient>, period: Duration) {
    loop {
        let Some(c) = me.upgrade() else { return };
        {
            let mut stop = c.stop.lock();
            if !*stop {
                c.wake.wait_for(&mut stop, period);
            }
            if *stop {
                return;
            }
        }
        // A server holds our entries as long as our connection to it: one
        // request renews them all (a restarted server is a new connection).
        let any = c.bound.lock().iter().next().map(|(k, e)| (*k, *e));
        if let Some((k, ep)) = any {
            if let Err(e) = c.request_all(Op::RenewAll, &k, &ep) {
                klog!(Level::Warn, "meta: lease renewal failed: {e:?}");
            }
        }
    }
}

impl Replica {
    fn connect(dev: &Arc<Device>, sgid_index: u32, addr: SocketAddr, timeout: Duration) -> Result<Replica> {
        let mut tcp = TcpStream::connect_timeout(&addr, timeout)?;
        tcp.set_read_timeout(Some(timeout))?;
        let _ = tcp.set_nodelay(true);
        let cq = Arc::new(Cq::new(dev, 16)?);
        let caps = Caps { send_wr: 4, recv_wr: 2, send_sge: 1, recv_sge: 1, inline: 0 };
        let qp = Qp::new(dev, ibv_qp_type::IBV_QPT_RC, &cq, &cq, caps)?;
        qp.to_init()?;
        let bufs = Region::new(dev, READ_OFF + READ_LEN, rdma::LOCAL_WRITE)?;
        let psn = rdma::random_psn();
        let hello = Hello { gid: dev.gid(sgid_index)?, qpn: qp.qpn(), psn };
        let mut out = [0u8; proto::BOOT_LEN];
        hello.encode(&mut out);
        tcp.write_all(&out)?;
        let mut buf = [0u8; proto::BOOT_LEN];
        tcp.read_exact(&mut buf)?;
        let w = Welcome::decode(&buf)?;
        if w.status != 0 {
            return Err(Errno(w.status as i32));
        }
        qp.rc_connect(sgid_index, psn, &RcPeer { gid: w.gid, qpn: w.qpn, psn: w.psn })?;
        let mut r = Replica {
            addr,
            _tcp: tcp,
            cq,
            qp,
            bufs,
            table_addr: w.table_addr,
            table_rkey: w.table_rkey,
            table: None,
            next_req: 1,
            dead: false,
        };
        r.post_recv()?;
        // The header, once: it says how to find a key's neighborhood.
        r.read(0, HEADER_SIZE, timeout)?;
        // SAFETY: the READ completed; nothing else writes the buffer.
        let table = RemoteEndpointTable::parse(unsafe { r.bufs.bytes(READ_OFF, HEADER_SIZE) })?;
        if table.nslots() != w.table_slots || table.incarnation() != w.incarnation {
            return Err(Errno(libc::EPROTO));
        }
        r.table = Some(table);
        Ok(r)
    }

    fn post_recv(&self) -> Result<()> {
        let mut sge = self.bufs.sge(RECV_OFF, proto::META_LEN);
        // SAFETY: a plain C struct.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        // SAFETY: one WR over our own registered buffer.
        unsafe { self.qp.post_recv(&mut wr) }
    }

    /// One signaled READ of `len` bytes at `off` in the table into our
    /// buffer, waited for.
    fn read(&mut self, off: u64, len: usize, timeout: Duration) -> Result<()> {
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
        unsafe { self.qp.post_send(&mut wr) }.inspect_err(|_| self.dead = true)?;
        match self.wait(timeout, false)? {
            ibv_wc_opcode::IBV_WC_RDMA_READ => Ok(()),
            other => Err(self.protocol_error(other)),
        }
    }

    /// A completion we did not expect: our bookkeeping of this QP is lost.
    fn protocol_error(&mut self, opcode: u32) -> Errno {
        klog!(Level::Warn, "meta server {}: unexpected completion (opcode {opcode})", self.addr);
        self.dead = true;
        Errno(libc::EPROTO)
    }

    fn lookup(&mut self, key: &Key, timeout: Duration) -> Result<Option<Endpoint>> {
        let table = self.table.ok_or(Errno(libc::ENOTCONN))?;
        let (off, len) = table.neighborhood(*key);
        for _ in 0..TORN_RETRIES {
            self.read(off, len, timeout)?;
            // SAFETY: the READ completed; nothing else writes the buffer.
            match table.lookup_in(unsafe { self.bufs.bytes(READ_OFF, len) }, *key) {
                Lookup::Found(ep) => return Ok(Some(ep)),
                Lookup::Absent => return Ok(None),
                Lookup::Torn => continue,
            }
        }
        Err(Errno(libc::EAGAIN))
    }

    fn request(&mut self, op: Op, lease_ms: u32, key: &Key, ep: &Endpoint, timeout: Duration) -> Result<()> {
        let req_id = self.next_req;
        self.next_req = self.next_req.wrapping_add(1);
        let req = Request { op, req_id, lease_ms, key: *key, endpoint: *ep };
        // SAFETY: the send slot is free: requests are one at a time.
        let out = unsafe { self.bufs.bytes_mut(SEND_OFF, proto::META_LEN) };
        req.encode(out.try_into().expect("a META_LEN slice"));
        let mut sge = self.bufs.sge(SEND_OFF, proto::META_LEN);
        // SAFETY: a plain C struct.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        // SAFETY: one WR over our own registered buffer.
        unsafe { self.qp.post_send(&mut wr) }.inspect_err(|_| self.dead = true)?;
        // The response's receive may complete before our send's ACK does:
        // the two queues' completions come in either order.
        let (mut sent, mut answered) = (false, false);
        while !(sent && answered) {
            match self.wait(timeout, true)? {
                ibv_wc_opcode::IBV_WC_SEND if !sent => sent = true,
                ibv_wc_opcode::IBV_WC_RECV if !answered => answered = true,
                other => return Err(self.protocol_error(other)),
            }
        }
        // SAFETY: the receive completed; the next one is posted below.
        let resp = Response::decode(unsafe { self.bufs.bytes(RECV_OFF, proto::META_LEN) });
        self.post_recv().inspect_err(|_| self.dead = true)?;
        let resp = resp?;
        if resp.req_id != req_id {
            return Err(Errno(libc::EPROTO));
        }
        match resp.status {
            0 => Ok(()),
            e => Err(Errno(e as i32)),
        }
    }

    /// Wait for our next completion and return its opcode: polling
    /// (`sleep` false: a lookup on the caller's thread) or sleeping on the
    /// completion channel between polls. A failure or a timeout marks the
    /// replica dead: its QP may hold work we no longer track.
    fn wait(&mut self, timeout: Duration, sleep: bool) -> Result<u32> {
        let deadline = Instant::now() + timeout;
        // SAFETY: plain C data.
        let mut wc: [ibv_wc; 1] = unsafe { std::mem::zeroed() };
        loop {
            if self.cq.poll(&mut wc).inspect_err(|_| self.dead = true)? == 1 {
                if wc[0].status != ibv_wc_status::IBV_WC_SUCCESS {
                    klog!(Level::Warn, "meta server {}: completion status {}", self.addr, wc[0].status);
                    self.dead = true;
                    return Err(Errno(libc::ECONNRESET));
                }
                return Ok(wc[0].opcode);
            }
            let now = Instant::now();
            if now >= deadline {
                self.dead = true;
                return Err(Errno(libc::ETIMEDOUT));
            }
            if sleep {
                self.cq.wait(Some(deadline - now)).inspect_err(|_| self.dead = true)?;
            } else {
                std::hint::spin_loop();
            }
        }
    }
}
