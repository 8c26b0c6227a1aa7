//! `krcore-hostile`: a hostile peer, for the trust-boundary tests (issue
//! 20). It is an ordinary RDMA process on one node with a service endpoint
//! of its own, learns its victim's endpoint as anyone can (a query to
//! krcore-meta: bindings are public), and sends what an attacker on the
//! fabric would. It prints one `hostile: ...` line per action, which the
//! C test reads; it never checks the victim itself.
//!
//!   krcore-hostile --meta IP:PORT [--device DEV] --gid-index I \
//!       --gid VICTIM_GID --port VICTIM_PORT ACTION
//!
//! Actions:
//!   garbage N          N datagrams to the victim's service UD QP: random
//!                      bytes, link requests with random fields, and link
//!                      requests with random bits flipped
//!   forge-request G P  a link request that names the process bound at
//!                      (G, P) as its sender, sent from this process
//!   steal-binding      bind the victim's address to the victim's own
//!                      (public) endpoint from a meta-server connection of
//!                      this process, and if that is accepted unbind it
//!   bind-as P V        bind this process's address (its GID, port P) to
//!                      the victim's endpoint with VQPN V, print
//!                      `hostile: bind-as bound`, and hold the binding
//!                      until stdin closes: a `qconnect` to that address
//!                      sends to VQP V of the victim, whatever VQP that is
//!   tier N G P V       N datagrams of the datagram tier, to the victim
//!                      (a bound VQP's process) and to the process bound
//!                      at (G, P), whose VQP V is connected to the victim:
//!                      bytes behind a valid tier prefix; DATA on the
//!                      pair's route written as the other end's; ACKs of
//!                      each end's flow; one-sided requests with guessed
//!                      rkeys and out-of-bounds or misaligned addresses,
//!                      on routes of this process and on the pair's; and
//!                      bit-flipped copies of those. It counts what comes
//!                      back (a RESPONSE with status Ok would be a request
//!                      served: printed as `served`)
//!   tier-squat G P K   DATA packets (sequence number 1, never delivered)
//!                      to the victim's bound VQP on the routes of the
//!                      process bound at (G, P) for the K VQPNs after the
//!                      bound one: its next VQPs' routes, written first
//!   half-link          a link request to the victim from this process's
//!                      own endpoint, never confirmed (an RC QPN nobody
//!                      holds), while a meta-server connection of this
//!                      process names its incarnation: a requester that
//!                      gave its handshake up and lives. Prints
//!                      `hostile: half-link asked`, holds until stdin
//!                      closes (or it is killed)
//!   meta-garbage N     N TCP connections to krcore-meta, each sending a
//!                      truncated, oversized, wrong-version, random or
//!                      bit-flipped Hello or Query, a Bind (a Request) in
//!                      their place, or messages out of order; a valid
//!                      Query of the victim's binding every 16, its answer
//!                      checked and timed

use clap::{value_parser, Arg, Command};
use krcore::meta::proto::{self, LinkInfo, LinkRequest, LINK_LEN};
use krcore::meta::{client, Endpoint, Key};
use krcore::rdma::{random_u64, Device};
use krcore::service::{Options, Path, Service};
use krcore::transport::dgram::wire::{self, Ack, Data, Message, OneSided, Request, Route, SendOp, Status};
use std::io::{Read, Write};
use std::net::{Ipv6Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a send may wait for a free send buffer before the action
/// gives up (the UD send queue drains in microseconds).
const SEND_WAIT: Duration = Duration::from_secs(10);

fn main() {
    let m = Command::new("krcore-hostile")
        .about("Sends forged and malformed traffic to a krcore process (tests only)")
        .arg(Arg::new("meta").long("meta").required(true).value_name("IP:PORT"))
        .arg(Arg::new("device").long("device").value_name("NAME"))
        .arg(Arg::new("gid-index").long("gid-index").required(true).value_parser(value_parser!(u32)))
        .arg(Arg::new("gid").long("gid").required(true).value_name("IPV6").value_parser(value_parser!(Ipv6Addr)))
        .arg(Arg::new("port").long("port").required(true).value_parser(value_parser!(u32)))
        .arg(Arg::new("action").required(true).num_args(1..).value_name("ACTION"))
        .get_matches();
    let words: Vec<&String> = m.get_many::<String>("action").expect("required").collect();
    let run = || -> Result<String, String> {
        let addrs = client::parse_addrs(m.get_one::<String>("meta").expect("required")).map_err(|e| format!("--meta: {e:?}"))?;
        let victim = lookup(&addrs, m.get_one::<Ipv6Addr>("gid").expect("required"), *m.get_one::<u32>("port").expect("required"))?;
        let dev = Device::open(m.get_one::<String>("device").map(String::as_str)).map_err(|e| format!("device: {e:?}"))?;
        let sgid_index = *m.get_one::<u32>("gid-index").expect("required");
        let svc = Service::start(&dev, sgid_index, Options::default()).map_err(|e| format!("service endpoint: {e:?}"))?;
        let to = Target { svc: &svc, path: Path { sgid_index, dgid: victim.gid }, victim };
        match words.as_slice() {
            [a, n] if a.as_str() == "garbage" => to.garbage(n.parse().map_err(|_| format!("garbage: not a count: {n}"))?),
            [a] if a.as_str() == "steal-binding" => {
                let key = Key::Port { gid: victim.gid, port: *m.get_one::<u32>("port").expect("required") };
                let opts = client::Options { timeout: Duration::from_secs(5), lease: Duration::from_secs(3), incarnation: 0 };
                let mc = client::MetaClient::connect(&dev, sgid_index, &addrs, opts).map_err(|e| format!("meta connection: {e:?}"))?;
                let bound = mc.bind(&key, &victim);
                let unbound = bound.is_ok().then(|| mc.unbind(&key));
                mc.shutdown();
                Ok(format!("steal-binding: bind {bound:?}, unbind {unbound:?}"))
            }
            [a, p, v] if a.as_str() == "bind-as" => {
                let port = p.parse().map_err(|_| format!("bind-as: not a port: {p}"))?;
                let vqpn = parse_u32(v).ok_or_else(|| format!("bind-as: not a VQPN: {v}"))?;
                let key = Key::Port { gid: svc.endpoint().gid, port };
                let opts = client::Options { timeout: Duration::from_secs(5), lease: Duration::from_secs(60), incarnation: 0 };
                let mc = client::MetaClient::connect(&dev, sgid_index, &addrs, opts).map_err(|e| format!("meta connection: {e:?}"))?;
                mc.bind(&key, &Endpoint { vqpn, ..victim }).map_err(|e| format!("bind-as: bind: {e:?}"))?;
                println!("hostile: bind-as bound port {port} to VQP {vqpn:#x} of QP {}", victim.qpn);
                std::io::stdout().flush().map_err(|e| e.to_string())?;
                let _ = std::io::stdin().read_to_end(&mut Vec::new());
                mc.shutdown();
                Ok("bind-as released".to_string())
            }
            [a, n, g, p, v] if a.as_str() == "tier" => {
                let n = n.parse().map_err(|_| format!("tier: not a count: {n}"))?;
                let gid = g.parse().map_err(|_| format!("tier: not a GID: {g}"))?;
                let port = p.parse().map_err(|_| format!("tier: not a port: {p}"))?;
                let vqpn = parse_u32(v).ok_or_else(|| format!("tier: not a VQPN: {v}"))?;
                to.tier(n, &lookup(&addrs, &gid, port)?, vqpn)
            }
            [a, g, p, k] if a.as_str() == "tier-squat" => {
                let gid = g.parse().map_err(|_| format!("tier-squat: not a GID: {g}"))?;
                let port = p.parse().map_err(|_| format!("tier-squat: not a port: {p}"))?;
                let k = k.parse().map_err(|_| format!("tier-squat: not a count: {k}"))?;
                to.squat(&lookup(&addrs, &gid, port)?, k)
            }
            [a, n] if a.as_str() == "meta-garbage" => {
                let n = n.parse().map_err(|_| format!("meta-garbage: not a count: {n}"))?;
                let key = Key::Port { gid: victim.gid, port: *m.get_one::<u32>("port").expect("required") };
                meta_garbage(&addrs, n, &key, &victim, &svc)
            }
            [a] if a.as_str() == "half-link" => {
                let me = svc.endpoint();
                let opts = client::Options { timeout: Duration::from_secs(5), lease: Duration::from_secs(3), incarnation: me.incarnation };
                let mc = client::MetaClient::connect(&dev, sgid_index, &addrs, opts).map_err(|e| format!("meta connection: {e:?}"))?;
                to.send(&to.request(me))?;
                println!("hostile: half-link asked as incarnation {:#x}", me.incarnation);
                std::io::stdout().flush().map_err(|e| e.to_string())?;
                let _ = std::io::stdin().read_to_end(&mut Vec::new());
                mc.shutdown();
                Ok("half-link released".to_string())
            }
            [a, g, p] if a.as_str() == "forge-request" => {
                let gid = g.parse().map_err(|_| format!("forge-request: not a GID: {g}"))?;
                let port = p.parse().map_err(|_| format!("forge-request: not a port: {p}"))?;
                to.forge_request(&lookup(&addrs, &gid, port)?)
            }
            _ => Err(format!("unknown action {words:?}")),
        }
    };
    match run() {
        Ok(line) => println!("hostile: {line}"),
        Err(e) => {
            eprintln!("krcore-hostile: {e}");
            std::process::exit(1);
        }
    }
}

fn lookup(addrs: &[std::net::SocketAddr], gid: &Ipv6Addr, port: u32) -> Result<Endpoint, String> {
    let key = Key::Port { gid: gid.octets(), port };
    match client::query(addrs, &key, Duration::from_secs(5)) {
        Ok(Some(ep)) => Ok(ep),
        Ok(None) => Err(format!("nothing bound at [{gid}]:{port}")),
        Err(e) => Err(format!("query for [{gid}]:{port}: {e:?}")),
    }
}

struct Target<'a> {
    svc: &'a Service,
    path: Path,
    victim: Endpoint,
}

impl Target<'_> {
    fn send(&self, bytes: &[u8]) -> Result<(), String> {
        let deadline = Instant::now() + SEND_WAIT;
        loop {
            match self.svc.send_datagram(self.path, self.victim.qpn, self.victim.qkey, bytes) {
                Ok(()) => return Ok(()),
                Err(e) if e.0 == libc::EAGAIN && Instant::now() < deadline => std::thread::yield_now(),
                Err(e) => return Err(format!("send: {e:?}")),
            }
        }
    }

    /// A link request as a peer would send it, every field but the magic
    /// and the kind random; `from` as given.
    fn request(&self, from: Endpoint) -> [u8; LINK_LEN] {
        let r = |bits: u32| (random_u64() & ((1u64 << bits) - 1)) as u32;
        let req = LinkRequest {
            req_id: random_u64() as u32,
            info: LinkInfo {
                from,
                rc_qpn: r(24),
                psn: r(24),
                probe_addr: random_u64(),
                probe_rkey: random_u64() as u32,
                window: random_u64() as u32,
                link: random_u64() as u16,
                src_gid: from.gid,
                dst_gid: self.victim.gid,
            },
            optional: false,
        };
        let mut out = [0u8; LINK_LEN];
        req.encode(&mut out);
        out
    }

    fn garbage(&self, n: u64) -> Result<String, String> {
        let mtu = self.svc.mtu();
        let mut counts = [0u64; 3];
        for i in 0..n {
            let random_from = || Endpoint {
                gid: random_bytes::<16>(),
                qpn: (random_u64() & 0xff_ffff) as u32,
                qkey: random_u64() as u32,
                incarnation: random_u64(),
                vqpn: 0,
            };
            match i % 3 {
                0 => {
                    let len = 1 + (random_u64() as usize % mtu);
                    let bytes: Vec<u8> = (0..len).map(|_| random_u64() as u8).collect();
                    self.send(&bytes)?;
                }
                1 => self.send(&self.request(random_from()))?,
                _ => {
                    let mut m = self.request(self.svc.endpoint());
                    for _ in 0..1 + random_u64() % 3 {
                        let bit = random_u64() as usize % (LINK_LEN * 8);
                        m[bit / 8] ^= 1 << (bit % 8);
                    }
                    self.send(&m)?;
                }
            }
            counts[(i % 3) as usize] += 1;
        }
        Ok(format!(
            "garbage sent {n} datagrams ({} random, {} link requests with random fields, {} with bits flipped)",
            counts[0], counts[1], counts[2]
        ))
    }

    fn forge_request(&self, named: &Endpoint) -> Result<String, String> {
        self.send(&self.request(*named))?;
        Ok(format!("forge-request sent, naming QP {} incarnation {:#x}", named.qpn, named.incarnation))
    }
}

/// What came back to this process's service QP on the tier while it sent
/// (its own tier is not running: every datagram of the family is seen
/// here).
#[derive(Default)]
struct Returned {
    acks: AtomicU64,
    refusals: AtomicU64,
    /// RESPONSEs with status Ok: a forged request served.
    served: AtomicU64,
    other: AtomicU64,
}

impl Target<'_> {
    /// One datagram to `to` (its service QP on `path`).
    fn send_to(&self, path: Path, to: &Endpoint, bytes: &[u8]) -> Result<(), String> {
        let deadline = Instant::now() + SEND_WAIT;
        loop {
            match self.svc.send_datagram(path, to.qpn, to.qkey, bytes) {
                Ok(()) => return Ok(()),
                Err(e) if e.0 == libc::EAGAIN && Instant::now() < deadline => std::thread::yield_now(),
                Err(e) => return Err(format!("send: {e:?}")),
            }
        }
    }

    /// Counts what the victims send back.
    fn listen(&self) -> Arc<Returned> {
        let back = Arc::new(Returned::default());
        let b = Arc::clone(&back);
        self.svc.on_datagram(Box::new(move |bytes, _from| {
            let c = match Message::decode(bytes) {
                Ok(Message::Ack(_)) => &b.acks,
                Ok(Message::Response(r)) if r.status == Status::Ok => &b.served,
                Ok(Message::Response(_)) => &b.refusals,
                _ => &b.other,
            };
            c.fetch_add(1, Ordering::Relaxed);
        }));
        back
    }

    /// The tier's forgeries; `client` is the process bound at (G, P),
    /// `cvqpn` its VQP connected to the victim's bound VQP.
    fn tier(&self, n: u64, client: &Endpoint, cvqpn: u32) -> Result<String, String> {
        let back = self.listen();
        let (server, me) = (self.victim, self.svc.endpoint());
        let cpath = Path { sgid_index: self.path.sgid_index, dgid: client.gid };
        // The honest pair's flow client -> server, as the client's packets
        // carry it; the server answers from a src_qp whose VQPN is not
        // public: guessed among the next ones after its bound VQP.
        let pair =
            Route { src_incarnation: client.incarnation, dst_incarnation: server.incarnation, src_vqpn: cvqpn, dst_vqpn: server.vqpn };
        let src_qp = || server.vqpn + 1 + (random_u64() % 8) as u32;
        let mtu = self.svc.mtu();
        let mut counts = [0u64; 6];
        let mut skipped = 0u64;
        let mut payload = [0u8; 64];
        for i in 0..n {
            let kind = (i % 6) as usize;
            let to_server = i / 6 % 2 == 0;
            let (path, to) = if to_server { (self.path, server) } else { (cpath, *client) };
            // DATA to the server never has sequence number 0: from this
            // process it is a flow of its own to a bound VQP (which takes
            // anyone), and a packet 0 would be delivered to the server as
            // a new sender's message, which the test's server echoes.
            let seq = |low: u64| if random_u64() % 2 == 0 { low + random_u64() % 128 } else { random_u64() >> 1 };
            payload.iter_mut().for_each(|b| *b = random_u64() as u8);
            let plen = (random_u64() % 65) as usize;
            let data = |route: Route, seq: u64| {
                let (total_len, opcode) =
                    (plen as u32 + (random_u64() % 2) as u32, if random_u64() % 4 == 0 { SendOp::SendImm } else { SendOp::Send });
                let d = Data {
                    route,
                    seq,
                    nonce: random_u64() | 1,
                    ack_req: random_u64() % 2 == 0,
                    msg: random_u64() as u32,
                    total_len,
                    seg: 0,
                    nsegs: 1 + (random_u64() % 2) as u32,
                    opcode,
                    imm: if opcode == SendOp::SendImm { random_u64() as u32 } else { 0 },
                    payload: &payload[..plen],
                };
                Message::Data(d).to_vec()
            };
            let ack = |route: Route| {
                let next = seq(1).max(1);
                Message::Ack(Ack { route, next, nonce: random_u64() | 1, sack: random_u64(), rnr: false }).to_vec()
            };
            let request = |route: Route, seq: u64| {
                let op = OneSided::ALL[(random_u64() % 4) as usize];
                // rxe's rkeys are small (an index and a key byte): guessed
                // among those and at random; addresses out of any MR, at
                // the ends of the address space, or misaligned.
                let rkey = if random_u64() % 2 == 0 { (random_u64() % 0x4000) as u32 } else { random_u64() as u32 };
                let addr = match random_u64() % 4 {
                    0 => 0,
                    1 => u64::MAX - 7,
                    2 => random_u64() | 1,
                    _ => random_u64() & !7,
                };
                let len = if op.is_atomic() { wire::ATOMIC_LEN } else { (random_u64() % 70_000) as u32 };
                let base = Request::new(route, seq, random_u64() | 1, op, rkey, addr, len);
                let r = match op {
                    OneSided::Read => Request { resp_seg: 1 + (random_u64() % 4096) as u32, ..base },
                    OneSided::Write => Request { payload: &payload[..plen.min(len as usize)], ..base },
                    OneSided::CmpSwp => Request { compare_add: random_u64(), swap: random_u64(), ..base },
                    OneSided::FetchAdd => Request { compare_add: random_u64(), ..base },
                };
                Message::Request(r).to_vec()
            };
            let forged = |k: usize| -> Vec<u8> {
                match (k, to_server) {
                    // The client's packets to the server / the server's
                    // (its src_qp's) to the client.
                    (1, true) => data(pair, seq(1).max(1)),
                    (1, false) => data(Route { src_vqpn: src_qp(), ..pair.reverse() }, seq(0)),
                    // ACKs of the server's flow to the client / of the
                    // client's flow to the server.
                    (2, true) => ack(Route { dst_vqpn: src_qp(), ..pair }),
                    (2, false) => ack(pair.reverse()),
                    // Requests: on a route of this process's (a fresh VQPN
                    // each: a new flow, whose first packet is served) and
                    // on the pair's.
                    (_, true) if random_u64() % 2 == 0 => {
                        let own =
                            Route { src_incarnation: me.incarnation, src_vqpn: 0x80_0000 | (random_u64() as u32 & 0x7f_ffff), ..pair };
                        request(own, 0)
                    }
                    (_, true) => request(pair, seq(0)),
                    (_, false) => request(Route { src_vqpn: src_qp(), ..pair.reverse() }, seq(0)),
                }
            };
            let bytes = match kind {
                0 => {
                    let len = 4 + (random_u64() as usize % (mtu - 3));
                    let mut b: Vec<u8> = (0..len).map(|_| random_u64() as u8).collect();
                    b[..2].copy_from_slice(&wire::MAGIC.to_le_bytes());
                    b[2] = wire::VERSION;
                    b[3] = (random_u64() % 6) as u8;
                    b
                }
                1..=3 => forged(kind),
                _ => {
                    // A copy of a forgery with 1 to 3 bits flipped; none
                    // that became a DATA packet 0 to the server (above).
                    let mut b = forged(1 + (random_u64() % 3) as usize);
                    for _ in 0..1 + random_u64() % 3 {
                        let bit = random_u64() as usize % (b.len() * 8);
                        b[bit / 8] ^= 1 << (bit % 8);
                    }
                    if to_server && matches!(Message::decode(&b), Ok(Message::Data(d)) if d.seq == 0) {
                        skipped += 1;
                        continue;
                    }
                    b
                }
            };
            self.send_to(path, &to, &bytes)?;
            counts[kind.min(4)] += 1;
        }
        // What comes back (refusals of the requests, ACKs of this
        // process's flows) comes within a round trip or two.
        std::thread::sleep(Duration::from_millis(200));
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Ok(format!(
            "tier sent {} datagrams ({} behind a valid prefix, {} DATA, {} ACKs, {} requests, {} bit-flipped; {skipped} flips skipped); \
             back: {} refusals, {} ACKs, served {}, {} other",
            n - skipped,
            counts[0],
            counts[1],
            counts[2],
            counts[3],
            counts[4],
            r(&back.refusals),
            r(&back.acks),
            r(&back.served),
            r(&back.other)
        ))
    }

    /// DATA packet 1 on the routes of `owner`'s next `k` VQPs to the
    /// victim's bound VQP.
    fn squat(&self, owner: &Endpoint, k: u32) -> Result<String, String> {
        let payload = [0x5a; 64];
        for i in 1..=k {
            let route = Route {
                src_incarnation: owner.incarnation,
                dst_incarnation: self.victim.incarnation,
                src_vqpn: owner.vqpn + i,
                dst_vqpn: self.victim.vqpn,
            };
            let d = Data {
                route,
                seq: 1,
                nonce: random_u64() | 1,
                ack_req: false,
                msg: 1,
                total_len: 64,
                seg: 0,
                nsegs: 1,
                opcode: SendOp::Send,
                imm: 0,
                payload: &payload,
            };
            self.send(&Message::Data(d).to_vec())?;
        }
        Ok(format!(
            "tier-squat wrote the routes of VQPs {:#x}..={:#x} of incarnation {:#x}",
            owner.vqpn + 1,
            owner.vqpn + k,
            owner.incarnation
        ))
    }
}

/// `meta-garbage`: malformed boot traffic on TCP connections to the meta
/// server, up to [`META_OPEN`] held open at once (the server drops one
/// owing its `Hello` after 2 s), and a checked query every 16.
fn meta_garbage(addrs: &[SocketAddr], n: u64, key: &Key, victim: &Endpoint, svc: &Service) -> Result<String, String> {
    const META_OPEN: usize = 32;
    let addr = addrs[0];
    let mut open: std::collections::VecDeque<TcpStream> = std::collections::VecDeque::new();
    let (mut refused, mut queries, mut slowest) = (0u64, 0u64, Duration::ZERO);
    let mut counts = [0u64; 8];
    let me = svc.endpoint();
    for i in 0..n {
        if i % 16 == 0 {
            let t = Instant::now();
            match client::query(addrs, key, Duration::from_secs(5)) {
                Ok(Some(ep)) if ep == *victim => {}
                other => return Err(format!("meta-garbage: an honest query during the attack: {other:?}")),
            }
            slowest = slowest.max(t.elapsed());
            queries += 1;
        }
        let mut hello = [0u8; proto::BOOT_LEN];
        proto::Hello { gid: me.gid, qpn: (random_u64() & 0xff_ffff) as u32, psn: (random_u64() & 0xff_ffff) as u32, incarnation: 0 }
            .encode(&mut hello);
        let mut query = [0u8; proto::BOOT_LEN];
        proto::Query { key: *key }.encode(&mut query);
        let mut bind = [0u8; proto::META_LEN];
        let req = proto::Request { op: proto::Op::Bind, req_id: 1, lease_ms: 60_000, key: *key, endpoint: me, secret: random_u64() };
        req.encode(&mut bind);
        let valid = if random_u64() % 2 == 0 { hello } else { query };
        let kind = (i % 8) as usize;
        let bytes: Vec<u8> = match kind {
            // Truncated.
            0 => valid[..1 + random_u64() as usize % (proto::BOOT_LEN - 1)].to_vec(),
            // Oversized: a message and more after it.
            1 => {
                let mut b = valid.to_vec();
                b.extend((0..1 + random_u64() % 300).map(|_| random_u64() as u8));
                b
            }
            // Another version.
            2 => {
                let mut b = valid.to_vec();
                b[2] = b[2].wrapping_add(1 + (random_u64() % 255) as u8);
                b
            }
            3 => (0..proto::BOOT_LEN).map(|_| random_u64() as u8).collect(),
            4 => {
                let mut b = valid.to_vec();
                for _ in 0..1 + random_u64() % 3 {
                    let bit = random_u64() as usize % (b.len() * 8);
                    b[bit / 8] ^= 1 << (bit % 8);
                }
                b
            }
            // A Bind, which belongs on the RC connection, before any Hello.
            5 => bind.to_vec(),
            // A query, then a Bind after it.
            6 => [&query[..], &bind[..]].concat(),
            // A Hello (naming a QP nobody has), then a Query after it.
            _ => [&hello[..], &query[..]].concat(),
        };
        counts[kind] += 1;
        match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
            Ok(mut tcp) => {
                // A reset (the server refused it at a bound) is fine.
                let _ = tcp.write_all(&bytes);
                open.push_back(tcp);
                if open.len() > META_OPEN {
                    open.pop_front();
                }
            }
            Err(_) => refused += 1,
        }
    }
    drop(open);
    let t = Instant::now();
    match client::query(addrs, key, Duration::from_secs(5)) {
        Ok(Some(ep)) if ep == *victim => {}
        other => return Err(format!("meta-garbage: the query after the attack: {other:?}")),
    }
    slowest = slowest.max(t.elapsed());
    Ok(format!(
        "meta-garbage sent {n} connections ({} truncated, {} oversized, {} another version, {} random, {} bit-flipped, {} Binds before a Hello, \
         {} Binds after a Query, {} Queries after a Hello), {refused} refused at connect; {} honest queries answered, the slowest in {} ms",
        counts[0],
        counts[1],
        counts[2],
        counts[3],
        counts[4],
        counts[5],
        counts[6],
        counts[7],
        queries + 1,
        slowest.as_millis()
    ))
}

/// Decimal or 0x-hexadecimal.
fn parse_u32(s: &str) -> Option<u32> {
    match s.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    for c in b.chunks_mut(8) {
        let v = random_u64().to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
    b
}
