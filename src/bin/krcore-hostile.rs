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

use clap::{value_parser, Arg, Command};
use krcore::meta::proto::{LinkInfo, LinkRequest, LINK_LEN};
use krcore::meta::{client, Endpoint, Key};
use krcore::rdma::{random_u64, Device};
use krcore::service::{Options, Path, Service};
use std::io::{Read, Write};
use std::net::Ipv6Addr;
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
                let opts = client::Options { timeout: Duration::from_secs(5), lease: Duration::from_secs(3) };
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
                let opts = client::Options { timeout: Duration::from_secs(5), lease: Duration::from_secs(60) };
                let mc = client::MetaClient::connect(&dev, sgid_index, &addrs, opts).map_err(|e| format!("meta connection: {e:?}"))?;
                mc.bind(&key, &Endpoint { vqpn, ..victim }).map_err(|e| format!("bind-as: bind: {e:?}"))?;
                println!("hostile: bind-as bound port {port} to VQP {vqpn:#x} of QP {}", victim.qpn);
                std::io::stdout().flush().map_err(|e| e.to_string())?;
                let _ = std::io::stdin().read_to_end(&mut Vec::new());
                mc.shutdown();
                Ok("bind-as released".to_string())
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
