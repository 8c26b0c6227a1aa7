//! Service endpoints and links against a real RDMA stack: two processes on
//! two emulated nodes make a link with the UD handshake, move data over it
//! with a one-sided READ, and reuse it without any communication.
//!
//! `#[ignore]`d without an RDMA device; the integration suite runs these in
//! the VM (scripts/rxe-up.sh: 10.77.0.i is GID index i).

use krcore::error::Errno;
use krcore::meta::Endpoint;
use krcore::rdma::{ipv4_gid, Device, Region};
use krcore::service::{Options, Path, Service};
use krcore::sys::*;
use std::io::{BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn device() -> Arc<Device> {
    Device::open(std::env::var("CT_DEVICE").ok().as_deref()).expect("open the RDMA device")
}

fn service_on(dev: &Arc<Device>, node: u8) -> Service {
    let gi = dev.gid_index(&ipv4_gid(Ipv4Addr::new(10, 77, 0, node))).expect("node GID");
    Service::start(dev, gi, Options::default()).expect("start the service endpoint")
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> [u8; 16] {
    let mut g = [0u8; 16];
    for (i, b) in g.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
    }
    g
}

/// Wait (bounded) for `cond`.
fn eventually(what: &str, limit: Duration, cond: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < limit, "timed out after {limit:?} waiting for: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// READ `len` bytes at (addr, rkey) over the link into `dst` and wait.
fn read(svc: &Service, link: &krcore::service::Link, dst: &Region, addr: u64, rkey: u32, len: usize) {
    let mut sge = dst.sge(0, len);
    // SAFETY: a plain C struct.
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = 7;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
    wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
    wr.wr.rdma.remote_addr = addr;
    wr.wr.rdma.rkey = rkey;
    // As the library posts: under the link's send lock, which the link's
    // maker holds until its QP is in RTS (a link is in the table from
    // just before, so that its first message finds it).
    let sends = link.sq.lock();
    // SAFETY: one WR into a registered buffer of ours.
    unsafe { link.qp.post_send(&mut wr) }.expect("post READ");
    drop(sends);
    // SAFETY: plain C data.
    let mut wc: [ibv_wc; 1] = unsafe { std::mem::zeroed() };
    let t0 = Instant::now();
    let (sends, _) = svc.link_cqs().expect("a link made the link side");
    while sends.poll(&mut wc).unwrap() == 0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "READ did not complete");
    }
    assert_eq!(wc[0].status, ibv_wc_status::IBV_WC_SUCCESS, "READ status");
    assert_eq!(wc[0].wr_id, 7);
}

#[test]
#[ignore = "needs an RDMA device (run by the integration suite in the VM)"]
fn link_handshake_read_and_reuse() {
    if std::env::var("KRCORE_TEST_ROLE").as_deref() == Ok("peer") {
        return peer();
    }
    let dev = device();
    let svc = service_on(&dev, 2);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "link_handshake_read_and_reuse", "--nocapture"])
        .env("KRCORE_TEST_ROLE", "peer")
        // Six links with us (four is the default bound per peer).
        .env("KRCORE_MAX_PEER_LINKS", "8")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ep = loop {
        let line = lines.next().expect("peer exited").unwrap();
        if let Some(rest) = line.strip_prefix("peer endpoint ") {
            let f: Vec<&str> = rest.split_whitespace().collect();
            break Endpoint {
                gid: unhex(f[0]),
                qpn: f[1].parse().unwrap(),
                qkey: f[2].parse().unwrap(),
                incarnation: f[3].parse().unwrap(),
                vqpn: 0,
            };
        }
    };
    assert_eq!(ep.gid, ipv4_gid(Ipv4Addr::new(10, 77, 0, 3)));

    // Cold: the UD handshake and two modifies per side.
    let t0 = Instant::now();
    let link = svc.link(&ep, 0, svc.default_path(&ep), Duration::from_secs(5)).expect("cold link");
    let cold = t0.elapsed();
    assert!(link.initiated);

    // Data over it: READ the peer's probe target (one-sided), which holds
    // nothing.
    let buf = Region::new(&dev, 4096, krcore::rdma::LOCAL_WRITE).unwrap();
    // SAFETY: nobody else uses `buf` yet.
    unsafe { buf.ptr().write_bytes(0xee, 8) };
    let (addr, rkey) = link.peer_probe;
    read(&svc, &link, &buf, addr, rkey, 8);
    // SAFETY: the READ completed.
    assert_eq!(unsafe { buf.bytes(0, 8) }, &[0; 8], "the probe target holds nothing");

    // Warm: the same link, no communication (best of 100: the VM's clock
    // reads and scheduling are noisy).
    let mut warm = Duration::MAX;
    for _ in 0..100 {
        let t0 = Instant::now();
        let again = svc.link(&ep, 0, svc.default_path(&ep), Duration::from_secs(5)).unwrap();
        warm = warm.min(t0.elapsed());
        assert!(Arc::ptr_eq(&link, &again), "a second connect reuses the link");
    }

    // A second link to the same peer, and the pool refilled behind them.
    let second = svc.link(&ep, 1, svc.default_path(&ep), Duration::from_secs(5)).expect("link 1");
    assert!(!Arc::ptr_eq(&link, &second));
    read(&svc, &second, &buf, addr, rkey, 8);
    assert_eq!(svc.links(), 2);
    eventually("the warm pool refilled", Duration::from_secs(5), || svc.warm_qps() == Options::default().warm_qps);

    // A link between other GIDs than the endpoints' (a transparent VQP's
    // RTR names them): from our node 4 to the peer's node 5. The peer's
    // UD QP answers on that GID, and both QPs run that path.
    let node = |n: u8| ipv4_gid(Ipv4Addr::new(10, 77, 0, n));
    let path = Path { sgid_index: dev.gid_index(&node(4)).unwrap(), dgid: node(5) };
    let third = svc.link(&ep, 0, path, Duration::from_secs(5)).expect("a link from node 4 to node 5");
    assert!(!Arc::ptr_eq(&link, &third), "another path, another link");
    assert_eq!(third.path, path);
    assert_eq!(third.qp.path().unwrap(), (path.sgid_index, node(5)), "the device's view of our end");
    read(&svc, &third, &buf, addr, rkey, 8);
    assert_eq!(svc.links(), 3);
    // A GID the peer does not have: its UD QP never sees the request.
    let nowhere = Path { dgid: node(200), ..path };
    assert!(svc.link(&ep, 0, nowhere, Duration::from_millis(300)).is_err());

    // Another process at that address (different incarnation): refused.
    let stale = Endpoint { incarnation: ep.incarnation ^ 1, ..ep };
    assert_eq!(svc.link(&stale, 0, svc.default_path(&stale), Duration::from_secs(5)).unwrap_err(), Errno(libc::ECONNREFUSED));
    // Nobody at that QPN: times out within the bound.
    let nobody = Endpoint { qpn: 0xfff0, ..ep };
    let t0 = Instant::now();
    assert_eq!(svc.link(&nobody, 0, svc.default_path(&nobody), Duration::from_millis(300)).unwrap_err(), Errno(libc::ETIMEDOUT));
    assert!(t0.elapsed() < Duration::from_secs(2));

    // The peer saw two links (it counts the ones we asked for).
    child.stdin.as_mut().unwrap().write_all(b"links?\n").unwrap();
    let line = lines.next().expect("peer answer").unwrap();
    assert_eq!(line, "peer links 3", "the peer's view");
    child.stdin.as_mut().unwrap().write_all(b"paths?\n").unwrap();
    let line = lines.next().expect("peer answer").unwrap();
    let want = format!("{} {} {}", dev.gid_index(&node(3)).unwrap(), hex(&node(2)), hex(&node(2)));
    assert!(line.contains(&want), "the peer's links run node 3 -> node 2 ({want}): {line}");
    let want = format!("{} {} {}", dev.gid_index(&node(5)).unwrap(), hex(&node(4)), hex(&node(4)));
    assert!(line.contains(&want), "and node 5 -> node 4 ({want}): {line}");

    // A peer whose runtime wants no link with us (no VQP of it bound or
    // connected to us): our request is dropped, we time out; once it
    // wants one, the same request is answered.
    let mut ask = |cmd: &str| {
        child.stdin.as_mut().unwrap().write_all(format!("{cmd}\n").as_bytes()).unwrap();
        assert_eq!(lines.next().expect("peer answer").unwrap(), format!("peer {cmd}"));
    };
    ask("want none");
    let t0 = Instant::now();
    assert_eq!(svc.link(&ep, 2, svc.default_path(&ep), Duration::from_millis(500)).unwrap_err(), Errno(libc::ETIMEDOUT));
    assert!(t0.elapsed() < Duration::from_secs(3));
    ask("want all");
    svc.link(&ep, 2, svc.default_path(&ep), Duration::from_secs(5)).expect("a wanted link");

    // A reply that comes after our handshake gave up (a bound of 0: the
    // request goes, its reply cannot be here yet) still makes the link:
    // the peer made its end and may use it. Ours is handed out only once
    // the peer is heard on it (the runtime's probe READ), and the peer
    // holds one link for it, not two.
    let home = svc.default_path(&ep);
    let before = svc.links();
    assert_eq!(svc.link(&ep, 3, home, Duration::ZERO).unwrap_err(), Errno(libc::ETIMEDOUT));
    eventually("the late reply made the link", Duration::from_secs(5), || svc.links() == before + 1);
    let late = svc.all_links().into_iter().find(|l| l.index == 3).expect("the late link");
    assert!(late.initiated && !late.confirmed());
    assert!(svc.link_to(ep.incarnation, 3, home).is_none(), "handed out before the peer is heard on it");
    read(&svc, &late, &buf, addr, rkey, 8);
    svc.heard_on(&late);
    assert!(svc.link_to(ep.incarnation, 3, home).is_some_and(|l| Arc::ptr_eq(&l, &late)), "handed out once heard on");
    child.stdin.as_mut().unwrap().write_all(b"links?\n").unwrap();
    assert_eq!(lines.next().expect("peer answer").unwrap(), "peer links 5", "the peer made one link for the late request");
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    println!("cold link {cold:?}, warm link {warm:?}");
}

/// The other process: a service endpoint on node 3 that answers link
/// requests on its progress thread while this thread waits on stdin.
fn peer() {
    let dev = device();
    let svc = service_on(&dev, 3);
    let ep = svc.endpoint();
    println!("peer endpoint {} {} {} {}", hex(&ep.gid), ep.qpn, ep.qkey, ep.incarnation);
    std::io::stdout().flush().unwrap();
    for line in std::io::stdin().lines().map_while(Result::ok) {
        if let Some(which) = line.strip_prefix("want ") {
            let all = which == "all";
            svc.on_link_wanted(Box::new(move |_, _| all));
            println!("peer want {which}");
            std::io::stdout().flush().unwrap();
        }
        if line == "links?" {
            println!("peer links {}", svc.links());
            std::io::stdout().flush().unwrap();
        }
        // Each link: our GID index, destination GID as kept, as the device has it.
        if line == "paths?" {
            let paths: Vec<String> = svc
                .all_links()
                .iter()
                .map(|l| format!("{} {} {}", l.path.sgid_index, hex(&l.path.dgid), hex(&l.qp.path().unwrap().1)))
                .collect();
            println!("peer paths {}", paths.join(", "));
            std::io::stdout().flush().unwrap();
        }
    }
}

/// What a link's responder relies on when it replies before its RTS
/// (issue 19): an RC QP in RTR already answers the peer's READs and takes
/// its SENDs, so the requester may use the link as soon as it has the
/// reply. Two QPs of this process on nodes 2 and 3; `rtr` stays in RTR
/// throughout; `rts` READs 4 KiB of it (checked byte for byte) and SENDs
/// into it (the message checked where it landed).
#[test]
#[ignore = "needs an RDMA device (run by the integration suite in the VM)"]
fn a_qp_in_rtr_answers_reads_and_takes_sends() {
    use krcore::rdma::{Caps, Cq, Qp, RcPeer};
    let dev = device();
    let gi = |node: u8| dev.gid_index(&ipv4_gid(Ipv4Addr::new(10, 77, 0, node))).expect("node GID");
    let (g2, g3) = (gi(2), gi(3));
    let cq = Arc::new(Cq::new(&dev, 16).unwrap());
    let caps = Caps { send_wr: 4, recv_wr: 4, send_sge: 1, recv_sge: 1, inline: 0 };
    let rtr = Qp::new(&dev, ibv_qp_type::IBV_QPT_RC, &cq, &cq, caps).unwrap();
    let rts = Qp::new(&dev, ibv_qp_type::IBV_QPT_RC, &cq, &cq, caps).unwrap();
    rtr.to_init().unwrap();
    rts.to_init().unwrap();
    let (psn_rtr, psn_rts) = (0x1234, 0x5678);
    rtr.to_rtr(g2, &RcPeer { gid: dev.gid(g3).unwrap(), qpn: rts.qpn(), psn: psn_rts }).unwrap();
    rts.rc_connect(g3, psn_rts, &RcPeer { gid: dev.gid(g2).unwrap(), qpn: rtr.qpn(), psn: psn_rtr }).unwrap();

    let access = krcore::rdma::LOCAL_WRITE | krcore::rdma::REMOTE_READ;
    let src = Region::new(&dev, 4096, access).unwrap();
    let dst = Region::new(&dev, 4096, krcore::rdma::LOCAL_WRITE).unwrap();
    let pattern = |i: usize| (i as u8).wrapping_mul(31) ^ 0x5a;
    // SAFETY: our regions, nothing posted on them yet.
    unsafe { src.bytes_mut(0, 4096) }.iter_mut().enumerate().for_each(|(i, b)| *b = pattern(i));
    // SAFETY: as above.
    unsafe { dst.bytes_mut(0, 4096) }.fill(0);

    // A receive on the QP in RTR, into the second half of `src`.
    let mut rsge = src.sge(2048, 64);
    // SAFETY: a plain C struct.
    let mut rwr: ibv_recv_wr = unsafe { std::mem::zeroed() };
    rwr.wr_id = 20;
    rwr.sg_list = &mut rsge;
    rwr.num_sge = 1;
    // SAFETY: one WR into our registered buffer.
    unsafe { rtr.post_recv(&mut rwr) }.expect("post a receive on the QP in RTR");

    let wait = |wr_id: u64, opcode: u32| {
        // SAFETY: plain C data.
        let mut wc: [ibv_wc; 1] = unsafe { std::mem::zeroed() };
        let t0 = Instant::now();
        while cq.poll(&mut wc).unwrap() == 0 {
            assert!(t0.elapsed() < Duration::from_secs(10), "no completion for wr_id {wr_id}");
        }
        assert_eq!(wc[0].status, ibv_wc_status::IBV_WC_SUCCESS, "wr_id {wr_id}: status");
        assert_eq!((wc[0].wr_id, wc[0].opcode), (wr_id, opcode));
    };

    // The READ, answered by the QP in RTR.
    let mut sge = dst.sge(0, 2048);
    // SAFETY: a plain C struct.
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = 10;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
    wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
    wr.wr.rdma.remote_addr = src.addr();
    wr.wr.rdma.rkey = src.rkey();
    // SAFETY: one WR into our registered buffer.
    unsafe { rts.post_send(&mut wr) }.expect("post the READ");
    wait(10, ibv_wc_opcode::IBV_WC_RDMA_READ);
    // SAFETY: the READ completed.
    let got = unsafe { dst.bytes(0, 2048) };
    assert!(got.iter().enumerate().all(|(i, &b)| b == pattern(i)), "the READ from the QP in RTR returned other bytes");

    // The SEND, taken by the QP in RTR: the first 64 bytes READ just now.
    let mut sge = dst.sge(0, 64);
    // SAFETY: a plain C struct.
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = 11;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
    wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
    // SAFETY: one WR from our registered buffer.
    unsafe { rts.post_send(&mut wr) }.expect("post the SEND");
    // Both completions on the shared CQ, in either order.
    let mut seen = Vec::new();
    for _ in 0..2 {
        // SAFETY: plain C data.
        let mut wc: [ibv_wc; 1] = unsafe { std::mem::zeroed() };
        let t0 = Instant::now();
        while cq.poll(&mut wc).unwrap() == 0 {
            assert!(t0.elapsed() < Duration::from_secs(10), "no completion of the SEND or its receive");
        }
        assert_eq!(wc[0].status, ibv_wc_status::IBV_WC_SUCCESS, "wr_id {}: status", wc[0].wr_id);
        seen.push((wc[0].wr_id, wc[0].opcode, wc[0].byte_len));
    }
    seen.sort();
    assert_eq!(seen[0].0, 11);
    assert_eq!(seen[1], (20, ibv_wc_opcode::IBV_WC_RECV, 64));
    // SAFETY: the receive completed.
    let landed = unsafe { src.bytes(2048, 64) };
    assert!(landed.iter().enumerate().all(|(i, &b)| b == pattern(i)), "the SEND landed other bytes");
}

/// Run `ip` with `args`; whether it succeeded.
fn ip(args: &[&str]) -> bool {
    Command::new("ip").args(args).status().is_ok_and(|s| s.success())
}

/// Run `rdma` with `args`; whether it succeeded.
fn rdma_cmd(args: &[&str]) -> bool {
    Command::new("rdma").args(args).status().is_ok_and(|s| s.success())
}

/// Link requests naming, as their own end of the link, a GID whose address
/// nobody answers ARP for. The requester is honest about who it is (it
/// passes the identity checks); the link's GIDs are its to choose. Our
/// QP's RTR towards such a GID waits in the kernel for ARP (about a second
/// per request, which the testbed's dummy netdev never does: the
/// endpoints here are on a second rxe device over a veth, which ARPs).
/// Requests are accepted on threads of their own (two at once from one
/// GID), so that the wait holds up nobody else: a link from another node
/// is made meanwhile within a bound.
#[test]
#[ignore = "needs an RDMA device (run by the integration suite in the VM)"]
fn requests_naming_unresolvable_gids_do_not_hold_up_other_links() {
    use krcore::meta::proto::{LinkInfo, LinkRequest, LINK_LEN};
    const VETH: &str = "krcore-arp0";
    const RXE: &str = "krcore-arp";
    const FORGED: u16 = 6;
    let _ = rdma_cmd(&["link", "delete", RXE]);
    let _ = ip(&["link", "del", VETH]);
    assert!(
        ip(&["link", "add", VETH, "type", "veth", "peer", "name", "krcore-arp1"])
            && ["10.88.0.1/24", "10.88.0.3/24", "10.88.0.4/24"].iter().all(|a| ip(&["addr", "add", a, "dev", VETH]))
            && ip(&["link", "set", VETH, "up"])
            && ip(&["link", "set", "krcore-arp1", "up"])
            && rdma_cmd(&["link", "add", RXE, "type", "rxe", "netdev", VETH]),
        "cannot set up rxe on a veth (root, iproute2)"
    );
    let dev = Device::open(Some(RXE)).expect("open the veth's rxe device");
    let on = |last: u8| {
        let gid = ipv4_gid(Ipv4Addr::new(10, 88, 0, last));
        let mut gi = dev.gid_index(&gid);
        let t0 = Instant::now();
        while gi.is_err() && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
            gi = dev.gid_index(&gid);
        }
        Service::start(&dev, gi.expect("the veth address's GID"), Options::default()).expect("start the service endpoint")
    };
    let (a, b, c) = (on(1), on(3), on(4));
    let a_ep = a.endpoint();
    let nowhere = ipv4_gid(Ipv4Addr::new(10, 88, 0, 2));
    for i in 0..FORGED {
        let req = LinkRequest {
            req_id: 1000 + u32::from(i),
            info: LinkInfo {
                from: b.endpoint(),
                rc_qpn: 0x1000 + u32::from(i),
                psn: 7,
                probe_addr: 0,
                probe_rkey: 0,
                window: 1 << 20,
                link: i,
                src_gid: nowhere,
                dst_gid: a_ep.gid,
            },
            optional: false,
        };
        let mut msg = [0u8; LINK_LEN];
        req.encode(&mut msg);
        b.send_datagram(b.default_path(&a_ep), a_ep.qpn, a_ep.qkey, &msg).expect("send a request");
    }
    let t0 = Instant::now();
    let link = c.link(&a_ep, 0, c.default_path(&a_ep), Duration::from_secs(20)).expect("a link from another address");
    let took = t0.elapsed();
    println!("a link beside {FORGED} requests naming an address nobody answers ARP for: {took:?}");
    let buf = Region::new(&dev, 4096, krcore::rdma::LOCAL_WRITE).unwrap();
    read(&c, &link, &buf, link.peer_probe.0, link.peer_probe.1, 8);
    drop((link, a, b, c, buf, dev));
    assert!(rdma_cmd(&["link", "delete", RXE]) && ip(&["link", "del", VETH]), "remove the rxe device and the veth");
    assert!(took < Duration::from_millis(700), "the link waited {took:?} behind the unresolvable requests");
}

#[test]
#[ignore = "needs an RDMA device (run by the integration suite in the VM)"]
fn the_endpoints_of_one_gid_hold_at_most_their_links() {
    let dev = device();
    let gi = dev.gid_index(&ipv4_gid(Ipv4Addr::new(10, 77, 0, 2))).expect("node GID");
    let a = Service::start(&dev, gi, Options { max_gid_links: 2, ..Options::default() }).expect("start");
    let a_ep = a.endpoint();
    // Three endpoints (processes, or UD QPs of one) on node 3: two links,
    // the third refused though each endpoint holds one link only.
    let node3: Vec<Service> = (0..3).map(|_| service_on(&dev, 3)).collect();
    let t = Duration::from_secs(5);
    let l1 = node3[0].link(&a_ep, 0, node3[0].default_path(&a_ep), t).expect("first link from node 3");
    let l2 = node3[1].link(&a_ep, 0, node3[1].default_path(&a_ep), t).expect("second link from node 3");
    let third = node3[2].link(&a_ep, 0, node3[2].default_path(&a_ep), t);
    assert_eq!(third.as_ref().err().map(|e| e.0), Some(libc::EBUSY), "a third link from node 3: {:?}", third.as_ref().map(|_| ()));
    // Another host's endpoint is not held up.
    let d = service_on(&dev, 4);
    let l4 = d.link(&a_ep, 0, d.default_path(&a_ep), t).expect("a link from node 4");
    let buf = Region::new(&dev, 4096, krcore::rdma::LOCAL_WRITE).unwrap();
    for (svc, l) in [(&node3[0], &l1), (&node3[1], &l2)] {
        read(svc, l, &buf, l.peer_probe.0, l.peer_probe.1, 8);
    }
    read(&d, &l4, &buf, l4.peer_probe.0, l4.peer_probe.1, 8);
    // Links we ask for ourselves are not node 3's to count.
    let b3 = node3[2].endpoint();
    a.link(&b3, 0, a.default_path(&b3), t).expect("our own link to node 3");
    drop((l1, l2, l4, node3, d, a));
}

#[test]
#[ignore = "needs an RDMA device (run by the integration suite in the VM)"]
fn address_handles_are_bounded_and_the_idle_ones_make_room() {
    let dev = device();
    let gi = dev.gid_index(&ipv4_gid(Ipv4Addr::new(10, 77, 0, 2))).expect("node GID");
    let a = Service::start(&dev, gi, Options { max_ahs: 2, ..Options::default() }).expect("start");
    let peers: Vec<Service> = (3..6).map(|n| service_on(&dev, n)).collect();
    let send = |p: &Service| {
        let ep = p.endpoint();
        a.send_datagram(a.default_path(&ep), ep.qpn, ep.qkey, &[0u8; 16])
    };
    // Node 3's address handle is used at t0 at the earliest: it may go a
    // second after that, not before (less the resolution of the coarse
    // clock its last use is stamped with).
    let t0 = Instant::now();
    send(&peers[0]).expect("to node 3");
    send(&peers[1]).expect("to node 4");
    assert_eq!(a.address_handles(), 2);
    // Both used within the second: no room for a third.
    assert_eq!(send(&peers[2]).err().map(|e| e.0), Some(libc::EAGAIN), "a third GID at once");
    assert_eq!(a.address_handles(), 2);
    // A used one stays usable meanwhile.
    send(&peers[1]).expect("node 4 again");
    eventually("room for a third address handle", Duration::from_secs(5), || send(&peers[2]).is_ok());
    let mut res = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec.
    unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut res) };
    let tick = Duration::new(res.tv_sec as u64, res.tv_nsec as u32);
    assert!(t0.elapsed() + tick >= Duration::from_secs(1), "an address handle went within a second of its use ({:?})", t0.elapsed());
    assert_eq!(a.address_handles(), 2, "node 3's went, node 5's came");
    send(&peers[1]).expect("node 4 kept (used last)");
    drop((peers, a));
}

#[test]
#[ignore = "needs an RDMA device (run by the integration suite in the VM)"]
fn a_flood_of_datagrams_leaves_the_progress_thread_its_turn() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    let dev = device();
    let a = Arc::new(service_on(&dev, 2));
    let b = Arc::new(service_on(&dev, 3));
    // Every datagram costs its handler 1 ms (a server starved of CPU):
    // the flood below arrives faster than that.
    let handled = Arc::new(AtomicUsize::new(0));
    let h = Arc::clone(&handled);
    a.on_datagram(Box::new(move |_, _| {
        h.fetch_add(1, SeqCst);
        std::thread::sleep(Duration::from_millis(1));
    }));
    let stop = Arc::new(AtomicBool::new(false));
    // The application's thread takes datagrams without pause.
    let poller = {
        let (a, stop) = (Arc::clone(&a), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !stop.load(SeqCst) {
                a.poll_datagrams();
            }
        })
    };
    let flood = {
        let (b, stop, to) = (Arc::clone(&b), Arc::clone(&stop), a.endpoint());
        std::thread::spawn(move || {
            let mut msg = [0u8; 64];
            msg[..2].copy_from_slice(&0x444bu16.to_le_bytes()); // the tier's magic
            while !stop.load(SeqCst) {
                let _ = b.send_datagram(b.default_path(&to), to.qpn, to.qkey, &msg);
            }
        })
    };
    eventually("the flood arriving", Duration::from_secs(10), || handled.load(SeqCst) >= 300);
    // Work of the progress thread (timers, link requests) runs meanwhile:
    // it waits for the UD queue's turn, which a poll gives back after a
    // queue's worth (before: a poll kept it as long as datagrams came).
    let ran = Arc::new(AtomicBool::new(false));
    let r = Arc::clone(&ran);
    let t0 = Instant::now();
    a.defer(t0, Box::new(move || r.store(true, SeqCst)));
    eventually("deferred work run during the flood", Duration::from_secs(3), || ran.load(SeqCst));
    let waited = t0.elapsed();
    let during = handled.load(SeqCst);
    stop.store(true, SeqCst);
    poller.join().expect("poller");
    flood.join().expect("flood");
    eprintln!("deferred work ran {waited:?} after it was due, {during} datagrams handled by then");
}
