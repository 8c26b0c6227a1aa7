//! A staged large message is readable only over the link it was announced
//! on (issue 20), on a real RDMA stack.
//!
//! `vqp_guard stager` (a C test binary on libkrcore, node 1) answers each
//! request with a large message, which its library stages and announces
//! in a LARGE header (address, rkey) on the link the request came on. This
//! test plays two processes with raw service endpoints of their own: the
//! intended peer (node 2), which speaks the protocol (the request, the
//! READ, the DONE), and an intruder (node 3), which links to the stager
//! too (its bound VQP takes anyone's messages) and so has a QP in the very
//! PD the staged message lies in. With the announced rkey the intended
//! peer READs the message byte for byte; the intruder's READ of it must
//! fail with a remote access error, for a message in the link's staging
//! and for one too big for it (a registration of its own). With the
//! staging's MR rkey (main before the fix) the intruder read it all.
//!
//! And a peer cannot make a VQP hold more than its link's window
//! (`KRCORE_LINK_WINDOW_BYTES`) of messages it has no receive for:
//! `vqp_guard holder` posts no receive until told; a raw link that
//! ignores the window sends it more, and the messages past the window are
//! refused and counted, the others delivered byte for byte and granted
//! back; then an honest sender (`vqp_guard flooder`, libkrcore) sends it
//! many windows' worth, which waits for the grants and loses nothing.
//! The same through the datagram tier (the sender never moves onto a
//! link): past what its GID may make the holder's process hold, its
//! packets are answered RNR, and it waits and loses nothing.
//!
//! `#[ignore]`d without an RDMA device; the integration suite runs this in
//! the VM (scripts/rxe-up.sh: 10.77.0.i is GID index i).

use krcore::meta::client::{self, MetaClient};
use krcore::meta::Key;
use krcore::rdma::{ipv4_gid, Device, Region};
use krcore::service::{Link, Options, Service};
use krcore::sys::*;
use krcore::vqp::header::{Flags, Header, LinkOp, HEADER_LEN};
use std::io::{BufRead, BufReader, Lines, Write};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The stager's staging: the first answer fits it, the second does not.
const STAGING: usize = 256 << 10;
const SIZES: [u32; 2] = [128 << 10, 1 << 20];
/// The intended peer's VQP number, as its headers say.
const PEER_VQPN: u32 = 0x42;
/// Receive buffers the intended peer posts on its SRQ.
const RECV_BUF: usize = 4096;
const NRECV: usize = 8;

fn device() -> Arc<Device> {
    Device::open(std::env::var("CT_DEVICE").ok().as_deref()).expect("open the RDMA device")
}

fn gid_index(dev: &Arc<Device>, node: u8) -> u32 {
    dev.gid_index(&ipv4_gid(Ipv4Addr::new(10, 77, 0, node))).expect("node GID")
}

fn stager_bin() -> PathBuf {
    let rel = PathBuf::from("target/c-tests/vqp_guard");
    if rel.exists() {
        return rel;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// The next line of the stager's that starts with "stager ".
fn stager_line(lines: &mut Lines<BufReader<ChildStdout>>) -> String {
    role_line(lines, "stager")
}

/// The next line of a `vqp_guard` role's that starts with its name.
fn role_line(lines: &mut Lines<BufReader<ChildStdout>>, role: &str) -> String {
    loop {
        let line = lines.next().unwrap_or_else(|| panic!("the {role} exited")).unwrap();
        println!("{role}: {line}");
        if line.starts_with(&format!("{role} ")) {
            return line;
        }
    }
}

/// The first completion on `cq` (bounded): (wr_id, status, byte_len).
fn poll_one(cq: &krcore::rdma::Cq, what: &str) -> (u64, u32, u32) {
    // SAFETY: plain C data.
    let mut wc: [ibv_wc; 1] = unsafe { std::mem::zeroed() };
    let t0 = Instant::now();
    while cq.poll(&mut wc).unwrap() == 0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "no completion for {what}");
        std::thread::yield_now();
    }
    (wc[0].wr_id, wc[0].status, wc[0].byte_len)
}

/// Post `wr` (signaled, wr_id 7) on `link`, wait for its completion on
/// `svc`'s link send CQ: its status.
fn post_and_wait(svc: &Service, link: &Link, wr: &mut ibv_send_wr, what: &str) -> u32 {
    wr.wr_id = 7;
    wr.send_flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
    // SAFETY: one WR over registered buffers of ours (or inline data).
    unsafe { link.qp.post_send(wr) }.expect("post");
    let (sends, _) = svc.link_cqs().expect("a link made the link side");
    let (wr_id, status, _) = poll_one(sends, what);
    assert_eq!(wr_id, 7);
    status
}

/// SEND `h` and `payload` (inline) on `link`.
fn send_header(svc: &Service, link: &Link, h: &Header, payload: &[u8]) {
    let mut bytes = vec![0u8; HEADER_LEN + payload.len()];
    let mut hb = [0u8; HEADER_LEN];
    h.encode(&mut hb);
    bytes[..HEADER_LEN].copy_from_slice(&hb);
    bytes[HEADER_LEN..].copy_from_slice(payload);
    let mut sge = ibv_sge { addr: bytes.as_ptr() as u64, length: bytes.len() as u32, lkey: 0 };
    // SAFETY: a plain C struct.
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
    wr.send_flags = ibv_send_flags::IBV_SEND_INLINE.0;
    assert_eq!(post_and_wait(svc, link, &mut wr, "a SEND"), ibv_wc_status::IBV_WC_SUCCESS, "SEND {:?}", h.flags);
}

/// READ `len` bytes at (addr, rkey) over `link` into `into`: the status.
fn read(svc: &Service, link: &Link, into: &Region, addr: u64, rkey: u32, len: u32) -> u32 {
    let mut sge = into.sge(0, len as usize);
    // SAFETY: a plain C struct.
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
    wr.wr.rdma.remote_addr = addr;
    wr.wr.rdma.rkey = rkey;
    post_and_wait(svc, link, &mut wr, "a READ")
}

/// `ct_fill(p, len, seed)` of c-tests/common.c.
fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let mut x = seed.wrapping_mul(0x9e37_79b1).wrapping_add((i as u32).wrapping_mul(0x85eb_ca6b));
            x ^= x >> 13;
            x = x.wrapping_mul(0xc2b2_ae35);
            x ^= x >> 16;
            x as u8
        })
        .collect()
}

/// The intended peer's receive buffers on its SRQ.
struct Receives {
    bufs: Region,
}

impl Receives {
    fn post(svc: &Service, dev: &Arc<Device>) -> Receives {
        let bufs = Region::new(dev, NRECV * RECV_BUF, krcore::rdma::LOCAL_WRITE).unwrap();
        let r = Receives { bufs };
        for i in 0..NRECV {
            r.repost(svc, i);
        }
        r
    }

    fn repost(&self, svc: &Service, i: usize) {
        let mut sge = self.bufs.sge(i * RECV_BUF, RECV_BUF);
        // SAFETY: a plain C struct.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = i as u64;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        // SAFETY: one receive into our own registered buffer.
        unsafe { svc.srq().unwrap().post_recv(&mut wr) }.expect("post a receive");
    }

    /// The next LARGE header that arrives (LINK_READY and the like are
    /// skipped).
    fn next_large(&self, svc: &Service) -> Header {
        self.next_where(svc, |h| h.flags.contains(Flags::LARGE))
    }

    /// The next header `want` takes (the others are skipped).
    fn next_where(&self, svc: &Service, want: impl Fn(&Header) -> bool) -> Header {
        let (_, recvs) = svc.link_cqs().unwrap();
        let t0 = Instant::now();
        loop {
            assert!(t0.elapsed() < Duration::from_secs(60), "no such header came");
            let (wr_id, status, byte_len) = poll_one(recvs, "a message to the intended peer");
            assert_eq!(status, ibv_wc_status::IBV_WC_SUCCESS, "a receive of the intended peer");
            let i = wr_id as usize;
            // SAFETY: this receive completed; it is reposted after the copy.
            let bytes = unsafe { self.bufs.bytes(i * RECV_BUF, byte_len as usize) }.to_vec();
            self.repost(svc, i);
            if let Ok(h) = Header::decode(&bytes) {
                if want(&h) {
                    return h;
                }
            }
        }
    }
}

#[test]
#[ignore = "needs an RDMA device (run by the integration suite in the VM)"]
fn a_staged_message_is_readable_only_over_the_link_it_was_announced_on() {
    let mut child = Command::new(stager_bin())
        .arg("stager")
        // Answers over links (the datagram tier stages nothing).
        .env("KRCORE_DGRAM", "0")
        .env("KRCORE_STAGING_BYTES", STAGING.to_string())
        // It exits without freeing its verbs objects.
        .env("ASAN_OPTIONS", "detect_leaks=0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run target/c-tests/vqp_guard stager (make -C c-tests)");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = stager_line(&mut lines);
    let f: Vec<&str> = ready.strip_prefix("stager ready ").expect("stager ready").split_whitespace().collect();
    let (meta, port) = (f[0].to_string(), f[1].parse::<u32>().unwrap());

    let dev = device();
    let opts = client::Options { timeout: Duration::from_secs(5), lease: Duration::from_secs(3), incarnation: 0 };
    let mc = MetaClient::connect(&dev, gid_index(&dev, 2), &client::parse_addrs(&meta).unwrap(), opts).expect("the stager's meta server");
    let key = Key::Port { gid: ipv4_gid(Ipv4Addr::new(10, 77, 0, 1)), port };
    let ep = mc.lookup(&key).expect("lookup").expect("the stager's binding");

    let peer = Service::start(&dev, gid_index(&dev, 2), Options::default()).unwrap();
    let intruder = Service::start(&dev, gid_index(&dev, 3), Options::default()).unwrap();
    let to_peer = peer.link(&ep, 0, peer.default_path(&ep), Duration::from_secs(10)).expect("the intended peer's link");
    let recvs = Receives::post(&peer, &dev);
    let landing = Region::new(&dev, SIZES[1] as usize, krcore::rdma::LOCAL_WRITE).unwrap();
    let stolen = Region::new(&dev, SIZES[1] as usize, krcore::rdma::LOCAL_WRITE).unwrap();

    for (k, &len) in SIZES.iter().enumerate() {
        let seed = 700 + k as u32;
        let mut req = [0u8; 8];
        req[..4].copy_from_slice(&len.to_le_bytes());
        req[4..].copy_from_slice(&seed.to_le_bytes());
        send_header(&peer, &to_peer, &Header { src_vqpn: PEER_VQPN, dst: ep.vqpn, len: 8, ..Header::default() }, &req);
        let h = recvs.next_large(&peer);
        assert_eq!((h.len, h.dst), (len, PEER_VQPN), "the LARGE answer");
        println!("message {k}: {len} bytes at {:#x}, rkey {:#x}", h.addr, h.rkey);

        // The intended peer READs it, byte for byte.
        assert_eq!(read(&peer, &to_peer, &landing, h.addr, h.rkey, len), ibv_wc_status::IBV_WC_SUCCESS, "the intended peer's READ");
        // SAFETY: the READ completed; nothing else writes there.
        assert!(unsafe { landing.bytes(0, len as usize) } == pattern(len as usize, seed).as_slice(), "the payload, byte for byte");

        // The intruder, linked into the same PD (a link of its own for
        // each message: a remote access error ends an RC link), with the
        // announced key.
        let to_intruder = intruder.link(&ep, k as u16, intruder.default_path(&ep), Duration::from_secs(10)).expect("the intruder's link");
        let s = read(&intruder, &to_intruder, &stolen, h.addr, h.rkey, len);
        // SAFETY: the READ completed (or failed); nothing else writes there.
        let took = unsafe { stolen.bytes(0, len as usize) } == pattern(len as usize, seed).as_slice();
        assert_eq!(
            s,
            ibv_wc_status::IBV_WC_REM_ACCESS_ERR,
            "message {k} ({len} bytes): the intruder's READ over its own link (status {s}; it took the payload: {took})"
        );
        assert!(!took, "the intruder has the payload");

        // The intended link is unharmed: READ again, then the DONE.
        assert_eq!(read(&peer, &to_peer, &landing, h.addr, h.rkey, len), ibv_wc_status::IBV_WC_SUCCESS, "the intended peer's READ again");
        let done = Header { flags: Flags::DONE, src_vqpn: PEER_VQPN, dst: h.src_vqpn, len: h.len, rkey: h.rkey, addr: h.addr, imm: 0 };
        send_header(&peer, &to_peer, &done, &[]);
        assert_eq!(stager_line(&mut lines), format!("stager sent {len} 0"), "the stager's send completed");
    }
    let quit = [0u8; 8];
    send_header(&peer, &to_peer, &Header { src_vqpn: PEER_VQPN, dst: ep.vqpn, len: 8, ..Header::default() }, &quit);
    assert!(child.wait().unwrap().success(), "the stager failed");
}

/// `win_fill` of c-tests/vqp_guard.c: the window test's message `seq`.
const WIN_LEN: usize = 4000;
fn win_message(seq: u32) -> Vec<u8> {
    let mut m = vec![seq as u8; WIN_LEN];
    m[..4].copy_from_slice(&seq.to_le_bytes());
    m
}

/// `vqp_guard holder` (a bound VQP on node 1 that posts no receive until
/// told), ready: its stdin, its output, its meta server and port.
struct Holder {
    child: Child,
    to: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    meta: String,
    port: u32,
}

fn start_holder() -> Holder {
    let mut child = Command::new(stager_bin())
        .arg("holder")
        .env("ASAN_OPTIONS", "detect_leaks=0")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run target/c-tests/vqp_guard holder (make -C c-tests)");
    let to = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = role_line(&mut lines, "holder");
    let f: Vec<&str> = ready.strip_prefix("holder ready ").expect("holder ready").split_whitespace().collect();
    let (meta, port) = (f[0].to_string(), f[1].parse::<u32>().unwrap());
    Holder { child, to, lines, meta, port }
}

/// `vqp_guard flooder <first> 1000` (an honest libkrcore sender on node
/// 2) to the holder behind `meta`, its output piped.
fn flooder_cmd(meta: &str, first: &str) -> Command {
    let mut cmd = Command::new(stager_bin());
    cmd.args(["flooder", first, "1000"])
        .env("KRCORE_META", meta)
        .env("ASAN_OPTIONS", "detect_leaks=0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    cmd
}

#[test]
#[ignore = "needs an RDMA device (run by the integration suite in the VM)"]
fn a_peer_cannot_make_a_vqp_hold_more_than_its_links_window() {
    const WINDOW: u64 = 1 << 20; // KRCORE_LINK_WINDOW_BYTES, untuned
    const COST: u64 = (HEADER_LEN + WIN_LEN) as u64;
    const SENT: u32 = 400;
    let admitted = (WINDOW / COST) as u32;
    let Holder { child: mut holder, to: mut to_holder, mut lines, meta, port } = start_holder();
    let dev = device();
    let opts = client::Options { timeout: Duration::from_secs(5), lease: Duration::from_secs(3), incarnation: 0 };
    let mc = MetaClient::connect(&dev, gid_index(&dev, 3), &client::parse_addrs(&meta).unwrap(), opts).expect("the holder's meta server");
    let ep = mc.lookup(&Key::Port { gid: ipv4_gid(Ipv4Addr::new(10, 77, 0, 1)), port }).expect("lookup").expect("the holder's binding");

    // A raw link that ignores the window: SENT messages to a VQP with no
    // receive posted.
    let flood = Service::start(&dev, gid_index(&dev, 3), Options::default()).unwrap();
    let link = flood.link(&ep, 0, flood.default_path(&ep), Duration::from_secs(10)).expect("a link to the holder");
    let recvs = Receives::post(&flood, &dev);
    let buf = Region::new(&dev, HEADER_LEN + WIN_LEN, krcore::rdma::LOCAL_WRITE).unwrap();
    for seq in 0..SENT {
        let mut hb = [0u8; HEADER_LEN];
        Header { src_vqpn: PEER_VQPN, dst: ep.vqpn, len: WIN_LEN as u32, ..Header::default() }.encode(&mut hb);
        // SAFETY: our own buffer, no WQE in flight on it (each waited for).
        let bytes = unsafe { buf.bytes_mut(0, HEADER_LEN + WIN_LEN) };
        bytes[..HEADER_LEN].copy_from_slice(&hb);
        bytes[HEADER_LEN..].copy_from_slice(&win_message(seq));
        let mut sge = buf.sge(0, HEADER_LEN + WIN_LEN);
        // SAFETY: a plain C struct.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        assert_eq!(post_and_wait(&flood, &link, &mut wr, "a SEND"), ibv_wc_status::IBV_WC_SUCCESS, "message {seq}");
    }
    writeln!(to_holder, "take {admitted} 0").unwrap();
    assert_eq!(
        role_line(&mut lines, "holder"),
        format!("holder took {admitted} overrun {}", SENT - admitted),
        "the window's worth delivered in order, the rest refused and counted"
    );
    // Taken, they were granted back once half the window was owed.
    let grant = recvs.next_where(&flood, |h| h.link_op() == Some(LinkOp::Grant));
    let half = WINDOW / 2;
    assert_eq!(grant.addr, half.div_ceil(COST) * COST, "one GRANT, of the messages taken when half the window was owed");
    drop((recvs, link, flood));

    // An honest sender, many windows' worth: it waits for the grants.
    let mut flooder = flooder_cmd(&meta, "200").spawn().expect("run target/c-tests/vqp_guard flooder");
    let mut flooder_lines = BufReader::new(flooder.stdout.take().unwrap()).lines();
    assert_eq!(role_line(&mut flooder_lines, "flooder"), "flooder posted 200");
    writeln!(to_holder, "take 1000 0").unwrap();
    assert_eq!(role_line(&mut lines, "holder"), format!("holder took 1000 overrun {}", SENT - admitted), "nothing honest refused");
    let done = role_line(&mut flooder_lines, "flooder");
    assert!(done.starts_with("flooder done 1000 "), "{done}");
    println!("the honest sender's longest ibv_post_send: {} us", done.rsplit(' ').next().unwrap());
    assert!(flooder.wait().unwrap().success(), "the flooder failed");
    writeln!(to_holder, "quit").unwrap();
    assert!(holder.wait().unwrap().success(), "the holder failed");
}

/// What a peer can make a VQP hold through the datagram tier (first
/// contact, before its move onto a link) is bounded too: an honest
/// sender kept on the tier (`KRCORE_LINK_AFTER` past its messages) sends
/// 1,000 messages of 4,000 bytes to a bound VQP that posts no receive
/// until told; once its GID's share (`KRCORE_LINK_WINDOW_BYTES`, 1 MiB:
/// 262 of them) is held, its packets are answered RNR and it waits (its
/// 32 sends in flight stay posted, none fails, past its 2 s retry limit);
/// when the VQP receives, all 1,000 arrive byte for byte and in order.
/// Before, the tier delivered every message it was sent into the VQP's
/// queue of held messages, whatever their number.
#[test]
#[ignore = "needs an RDMA device (run by the integration suite in the VM)"]
fn a_peer_on_the_datagram_tier_cannot_make_a_vqp_hold_more_than_its_share() {
    let Holder { child: mut holder, to: mut to_holder, mut lines, meta, .. } = start_holder();
    let mut flooder = flooder_cmd(&meta, "1")
        .env("KRCORE_LINK_AFTER", "1000000")
        .env("KRCORE_STATS", "1")
        .stderr(Stdio::piped())
        .spawn()
        .expect("run target/c-tests/vqp_guard flooder");
    let mut flooder_lines = BufReader::new(flooder.stdout.take().unwrap()).lines();
    assert_eq!(role_line(&mut flooder_lines, "flooder"), "flooder posted 1");
    let t0 = std::time::Instant::now();
    // 100 RNR answers: ten times the tier's retry limit (10 timeouts),
    // had they counted as retries.
    writeln!(to_holder, "wait-rnr 100").unwrap();
    let rnr = role_line(&mut lines, "holder");
    println!("measure: the holder answered RNR 100 times within {:?}: {rnr}", t0.elapsed());
    assert!(rnr.starts_with("holder rnr "), "{rnr}");
    assert!(flooder.try_wait().unwrap().is_none(), "the sender waits, it does not fail");
    writeln!(to_holder, "take 1000 0").unwrap();
    assert_eq!(role_line(&mut lines, "holder"), "holder took 1000 overrun 0", "all of it, in order, byte for byte");
    let done = role_line(&mut flooder_lines, "flooder");
    assert!(done.starts_with("flooder done 1000 "), "{done}");
    let out = flooder.wait_with_output().unwrap();
    let stats = String::from_utf8_lossy(&out.stderr);
    println!("measure: flooder: {done}; links it opened: {}", stat_of(&stats, "links_opened"));
    assert!(out.status.success(), "the flooder failed");
    assert_eq!(stat_of(&stats, "links_opened"), 0, "it stayed on the datagram tier");
    writeln!(to_holder, "quit").unwrap();
    assert!(holder.wait().unwrap().success(), "the holder failed");
}

/// A counter of a `KRCORE_STATS=1` exit line (`"name":N`).
fn stat_of(stats: &str, name: &str) -> u64 {
    let key = format!("\"{name}\":");
    let at = stats.find(&key).unwrap_or_else(|| panic!("no {name} in {stats}")) + key.len();
    stats[at..].chars().take_while(char::is_ascii_digit).collect::<String>().parse().unwrap()
}
