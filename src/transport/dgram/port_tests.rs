//! The port between two endpoints wired by hand: what it hands its host,
//! and in which order.

use super::*;
use crate::transport::dgram::reliable::Outcome;

/// One `messages` call: the payloads, and the ACK that came with them
/// (the last of its answers; the RESPONSEs before it in `answered`).
type Delivered = (Vec<Vec<u8>>, Option<Vec<u8>>);

/// A host that records what the port does.
#[derive(Default)]
struct Recorder {
    /// The PD whose MRs serve one-sided requests.
    pd: usize,
    sent: Mutex<Vec<Vec<u8>>>,
    delivered: Mutex<Vec<Delivered>>,
    /// The answers `messages` calls carried, in order (ACKs included).
    answered: Mutex<Vec<Vec<u8>>>,
    completed: Mutex<Vec<Completion>>,
    /// Processes the port doubted, and whether the host can find out.
    doubted: Mutex<Vec<u64>>,
    can_vouch: bool,
}

impl Host for Recorder {
    fn send(&self, _to: &Peer, bytes: &[u8]) {
        self.sent.lock().push(bytes.to_vec());
    }
    fn wake_at(&self, _at: Instant) {}
    fn admit(&self, _route: &Route, from: &Source) -> Option<(usize, Peer)> {
        // QPNs from 900 are strangers the VQP does not take from (one
        // connected to another process); the others are taken, as by a
        // bound VQP.
        if from.qpn >= 900 {
            return None;
        }
        Some((self.pd, Peer { sgid_index: 0, dgid: from.gid, qpn: from.qpn, qkey: 1 }))
    }
    fn messages(&self, _route: &Route, _from: &Peer, batch: Vec<Arrived>, answers: &[Vec<u8>]) {
        self.answered.lock().extend(answers.iter().cloned());
        let ack = answers.last().filter(|a| matches!(Message::decode(a), Ok(Message::Ack(_)))).cloned();
        self.delivered.lock().push((batch.into_iter().map(|m| m.data).collect(), ack));
    }
    fn completed(&self, _route: &Route, c: Completion) {
        self.completed.lock().push(c);
    }
    fn doubt(&self, incarnation: u64, _peer: &Peer) -> bool {
        self.doubted.lock().push(incarnation);
        self.can_vouch
    }
}

const A: Source = Source { gid: [1; 16], to_gid: [2; 16], qpn: 100 };
const B: Source = Source { gid: [2; 16], to_gid: [1; 16], qpn: 200 };
/// A third process, taken as a bound VQP takes anyone.
const C: Source = Source { gid: [3; 16], to_gid: [1; 16], qpn: 300 };
const ROUTE: Route = Route { src_incarnation: 1, dst_incarnation: 2, src_vqpn: 10, dst_vqpn: 20 };

fn port() -> Port {
    Port::new(1024, 1000, 2_000_000).expect("port")
}

/// A's flow to B, with `n` SENDs posted; their datagrams.
fn sends(a: &Port, ha: &Recorder, n: u64) -> (Arc<Flow>, Vec<Vec<u8>>) {
    let flow = a.open(ROUTE, Peer { sgid_index: 0, dgid: B.gid, qpn: B.qpn, qkey: 1 }).expect("open");
    for id in 0..n {
        let data = [id as u8; 16];
        a.post(ha, &flow, Op::Send { id, opcode: SendOp::Send, imm: 0, data: &data }).expect("post");
    }
    (flow, std::mem::take(&mut *ha.sent.lock()))
}

/// A's flow to B: one SEND delivered and acknowledged, then a CLOSE
/// (id 9) posted. The flow, the SEND's datagrams and the CLOSE's.
fn one_sent_then_close(a: &Port, b: &Port, ha: &Recorder, hb: &Recorder) -> (Arc<Flow>, Vec<Vec<u8>>, Vec<u8>) {
    let (flow, packets) = sends(a, ha, 1);
    b.on_datagram(hb, &packets[0], &A);
    let (_, ack) = hb.delivered.lock().pop().expect("delivered");
    a.on_datagram(ha, &ack.expect("ACK"), &B);
    a.post(ha, &flow, Op::Send { id: 9, opcode: SendOp::Close, imm: 0, data: &[] }).expect("CLOSE");
    let close = ha.sent.lock().pop().expect("CLOSE sent");
    (flow, packets, close)
}

#[test]
fn a_delivered_message_carries_its_ack() {
    let (a, b) = (port(), port());
    let (ha, hb) = (Recorder::default(), Recorder::default());
    let (_flow, packets) = sends(&a, &ha, 1);
    assert_eq!(packets.len(), 1);
    b.on_datagram(&hb, &packets[0], &A);
    let delivered = std::mem::take(&mut *hb.delivered.lock());
    assert_eq!(delivered.len(), 1);
    let (data, ack) = &delivered[0];
    assert_eq!(data, &vec![vec![0u8; 16]]);
    // Handed over with the message, not sent after it.
    let ack = ack.clone().expect("the ACK goes with the delivery");
    assert!(hb.sent.lock().is_empty(), "nothing sent behind the delivery");
    a.on_datagram(&ha, &ack, &B);
    let done = std::mem::take(&mut *ha.completed.lock());
    assert_eq!(done.len(), 1);
    assert_eq!((done[0].id, &done[0].outcome), (0, &Outcome::Done));
}

#[test]
fn a_filled_gap_delivers_in_one_batch_with_one_ack() {
    let (a, b) = (port(), port());
    let (ha, hb) = (Recorder::default(), Recorder::default());
    let (_flow, packets) = sends(&a, &ha, 3);
    assert_eq!(packets.len(), 3);
    // The first is lost for a while: the others wait behind the gap.
    b.on_datagram(&hb, &packets[1], &A);
    b.on_datagram(&hb, &packets[2], &A);
    assert!(hb.delivered.lock().is_empty());
    hb.sent.lock().clear(); // the ACKs that report the gap
    b.on_datagram(&hb, &packets[0], &A);
    let delivered = std::mem::take(&mut *hb.delivered.lock());
    assert_eq!(delivered.len(), 1, "one batch");
    let (data, ack) = &delivered[0];
    assert_eq!(data, &vec![vec![0u8; 16], vec![1u8; 16], vec![2u8; 16]]);
    a.on_datagram(&ha, ack.as_ref().expect("ACK"), &B);
    let ids: Vec<u64> = ha.completed.lock().iter().map(|c| c.id).collect();
    assert_eq!(ids, vec![0, 1, 2], "one ACK for the three");
}

#[test]
fn a_close_is_delivered_then_acknowledged_and_its_flow_goes() {
    let (a, b) = (port(), port());
    let (ha, hb) = (Recorder::default(), Recorder::default());
    let (_flow, _, close) = one_sent_then_close(&a, &b, &ha, &hb);
    let flows = b.inbound.lock().len();
    b.on_datagram(&hb, &close, &A);
    let (data, ack) = hb.delivered.lock().pop().expect("the CLOSE delivered");
    assert_eq!((data, ack), (vec![Vec::new()], None));
    assert_eq!(b.inbound.lock().len(), flows - 1, "the flow went");
    let final_ack = hb.sent.lock().pop().expect("the final ACK, after");
    a.on_datagram(&ha, &final_ack, &B);
    assert!(ha.completed.lock().iter().any(|c| c.id == 9 && c.outcome == Outcome::Done));
}

#[test]
fn a_closed_flow_answers_its_late_packets_and_its_route_starts_afresh() {
    let (a, b) = (port(), port());
    let (ha, hb) = (Recorder::default(), Recorder::default());
    let (flow, packets, mut close) = one_sent_then_close(&a, &b, &ha, &hb);
    a.linger(&flow);
    b.on_datagram(&hb, &close, &A);
    assert!(hb.delivered.lock().pop().is_some(), "the CLOSE delivered");
    let flows = b.inbound.lock().len();
    // Its final ACK is lost: the CLOSE comes again (a retransmission).
    hb.sent.lock().clear();
    wire::set_ack_req(&mut close, true);
    // (The same bytes from another source are nobody's: dropped.)
    let elsewhere = Source { qpn: 999, ..A };
    b.on_datagram(&hb, &close, &elsewhere);
    assert!(hb.sent.lock().is_empty() && b.inbound.lock().len() == flows, "a closed flow answers only its source");
    b.on_datagram(&hb, &close, &A);
    assert_eq!(b.inbound.lock().len(), flows, "no flow made for a closed one's packet");
    assert!(hb.delivered.lock().is_empty(), "nothing delivered twice");
    let again = hb.sent.lock().pop().expect("the final ACK again");
    a.on_datagram(&ha, &again, &B);
    assert!(ha.completed.lock().iter().any(|c| c.id == 9 && c.outcome == Outcome::Done), "the CLOSE completes");
    assert_eq!(a.out.lock().len(), 0, "the lingering flow went");
    // A late duplicate of the closed flow's first packet: not delivered.
    b.on_datagram(&hb, &packets[0], &A);
    assert!(hb.delivered.lock().is_empty(), "a closed flow's packet is not delivered again");
    // The route's next flow (a new VQP with the same number) starts
    // afresh and is delivered.
    ha.completed.lock().clear();
    let (_next, fresh) = sends(&a, &ha, 1);
    b.on_datagram(&hb, &fresh[0], &A);
    let (data, ack) = hb.delivered.lock().pop().expect("the new flow's message delivered");
    assert_eq!(data, vec![vec![0u8; 16]]);
    a.on_datagram(&ha, &ack.expect("ACK"), &B);
    assert!(ha.completed.lock().iter().any(|c| c.id == 0 && c.outcome == Outcome::Done));
}

#[test]
fn a_writes_first_segments_are_acknowledged_though_unanswered() {
    use crate::sys::ibv_access_flags as Access;
    // A target MR in a PD of this test's own (the registry is the
    // process's).
    let pd = 0x7e57_0001;
    let mut target = vec![0u8; 4096];
    let info = MrInfo { addr: target.as_mut_ptr() as u64, len: 4096, access: Access::IBV_ACCESS_REMOTE_WRITE.0 };
    crate::vqp::mrs::added(pd, 0x11, 0x22, info);
    let (a, b) = (port(), port());
    let (ha, hb) = (Recorder::default(), Recorder { pd, ..Recorder::default() });
    let flow = a.open(ROUTE, Peer { sgid_index: 0, dgid: B.gid, qpn: B.qpn, qkey: 1 }).expect("open");
    let data = vec![7u8; 3000];
    a.post(&ha, &flow, Op::Write { id: 1, rkey: 0x22, addr: info.addr, data: &data }).expect("post");
    let packets = std::mem::take(&mut *ha.sent.lock());
    assert!(packets.len() >= 3, "{} segments", packets.len());
    // The segments before the last get no RESPONSE: what they are owed is
    // the flow's ACK, delayed as for messages.
    for p in &packets[..packets.len() - 1] {
        b.on_datagram(&hb, p, &A);
    }
    // The ACK is delayed 200 µs: a test thread descheduled that long
    // between two segments sees it sent already, else it is due.
    let sent = std::mem::take(&mut *hb.sent.lock());
    assert!(sent.iter().all(|p| matches!(Message::decode(p), Ok(Message::Ack(_)))), "no RESPONSE before the last segment");
    let due = b.inbound.lock().get(&FlowKey::of(ROUTE, &A)).and_then(|f| f.receiver.next_deadline());
    assert!(!sent.is_empty() || due.is_some(), "an ACK is sent or due for the unanswered segments");
    // The last one's RESPONSE completes the WRITE; the bytes landed.
    b.on_datagram(&hb, packets.last().expect("last"), &A);
    for r in std::mem::take(&mut *hb.sent.lock()) {
        a.on_datagram(&ha, &r, &B);
    }
    assert!(ha.completed.lock().iter().any(|c| c.id == 1 && c.outcome == Outcome::Done));
    assert_eq!(&target[..3000], &data[..]);
    crate::vqp::mrs::removed(pd, 0x11);
}

#[test]
fn a_response_goes_with_the_messages_it_acknowledges() {
    use crate::sys::ibv_access_flags as Access;
    // A READ's RESPONSE tells its sender that every message before the
    // READ arrived; sent before they were handed to the VQP, the sender
    // could move onto its link and a message there overtake them.
    let pd = 0x7e57_0002;
    let target = [5u8; 64];
    let info = MrInfo { addr: target.as_ptr() as u64, len: 64, access: Access::IBV_ACCESS_REMOTE_READ.0 };
    crate::vqp::mrs::added(pd, 0x33, 0x44, info);
    let (a, b) = (port(), port());
    let (ha, hb) = (Recorder::default(), Recorder { pd, ..Recorder::default() });
    let (flow, mut packets) = sends(&a, &ha, 1);
    a.post(&ha, &flow, Op::Read { id: 1, rkey: 0x44, addr: info.addr, len: 8 }).expect("post");
    packets.append(&mut ha.sent.lock());
    assert_eq!(packets.len(), 2);
    // The READ comes first and waits behind the gap; the SEND fills it:
    // both are taken in one pass.
    b.on_datagram(&hb, &packets[1], &A);
    hb.sent.lock().clear(); // the ACK that reports the gap
    b.on_datagram(&hb, &packets[0], &A);
    assert!(hb.sent.lock().is_empty(), "nothing sent outside the delivery");
    let (data, _) = hb.delivered.lock().pop().expect("the SEND delivered");
    assert_eq!(data, vec![vec![0u8; 16]]);
    let answers = std::mem::take(&mut *hb.answered.lock());
    assert!(answers.iter().any(|r| matches!(Message::decode(r), Ok(Message::Response(_)))), "the RESPONSE went with it");
    for r in &answers {
        a.on_datagram(&ha, r, &B);
    }
    let ids: Vec<u64> = ha.completed.lock().iter().map(|c| c.id).collect();
    assert_eq!(ids, vec![0, 1]);
    crate::vqp::mrs::removed(pd, 0x33);
}

/// A DATA packet on `route` as a stranger writes it: one segment of a
/// one-byte message.
fn forged_data(route: Route, seq: u64, nonce: u64) -> Vec<u8> {
    let d = wire::Data {
        route,
        seq,
        nonce,
        ack_req: false,
        msg: 0,
        total_len: 1,
        seg: 0,
        nsegs: 1,
        opcode: SendOp::Send,
        imm: 0,
        payload: &[9],
    };
    Message::Data(d).to_vec()
}

#[test]
fn a_stranger_that_sends_first_on_a_route_does_not_take_it() {
    let (a, b) = (port(), port());
    let (ha, hb) = (Recorder::default(), Recorder::default());
    let (_flow, packets) = sends(&a, &ha, 2);
    // C writes A's route (its incarnation, a VQPN it guessed) before A
    // sends: before the fix the route was C's, and A's packets on it
    // were dropped as from another source.
    b.on_datagram(&hb, &forged_data(ROUTE, 1, 7), &C);
    b.on_datagram(&hb, &forged_data(ROUTE, 0, 7), &C);
    hb.delivered.lock().clear();
    for p in &packets {
        b.on_datagram(&hb, p, &A);
    }
    let delivered: Vec<Vec<u8>> = hb.delivered.lock().drain(..).flat_map(|(d, _)| d).collect();
    assert_eq!(delivered, vec![vec![0u8; 16], vec![1u8; 16]], "A's messages, in order");
    assert_eq!(b.inbound.lock().len(), 2, "A's flow and C's");
}

#[test]
fn a_stranger_neither_ends_a_closed_flows_memory_nor_keeps_its_process_alive() {
    let (a, b) = (port(), port());
    let (ha, hb) = (Recorder::default(), Recorder::default());
    let (flow, _packets, mut close) = one_sent_then_close(&a, &b, &ha, &hb);
    a.linger(&flow);
    b.on_datagram(&hb, &close, &A);
    assert!(hb.delivered.lock().pop().is_some(), "the CLOSE delivered");
    hb.sent.lock().clear();
    // C starts "the route's next flow" (sequence number 0, another
    // nonce): before the fix, that erased the closed flow's memory
    // before the source was looked at.
    b.on_datagram(&hb, &forged_data(ROUTE, 0, 12345), &C);
    hb.sent.lock().clear();
    // A's CLOSE again (its final ACK lost): still answered with that ACK.
    wire::set_ack_req(&mut close, true);
    b.on_datagram(&hb, &close, &A);
    let again = hb.sent.lock().pop().expect("the final ACK again");
    a.on_datagram(&ha, &again, &B);
    assert!(ha.completed.lock().iter().any(|c| c.id == 9 && c.outcome == Outcome::Done), "the CLOSE completes");
    // C's flow writes A's incarnation: it is C's, not a sign of A's life.
    let gids = [A.gid];
    assert!(!b.heard_from(ROUTE.src_incarnation, A.qpn, &gids, Duration::from_secs(60)), "A's flow is closed");
    assert!(b.heard_from(ROUTE.src_incarnation, C.qpn, &[C.gid], Duration::from_secs(60)));
}

#[test]
fn one_source_gid_opens_at_most_its_share_of_flows() {
    let b = port().with_flows_per_gid(3);
    let hb = Recorder::default();
    // A's VQPs 10.. each open a flow to B: the fourth is dropped, C's
    // still comes in.
    let (a, ha) = (port(), Recorder::default());
    let mut firsts = Vec::new();
    for i in 0..4 {
        let route = Route { src_vqpn: 10 + i, ..ROUTE };
        let flow = a.open(route, Peer { sgid_index: 0, dgid: B.gid, qpn: B.qpn, qkey: 1 }).expect("open");
        a.post(&ha, &flow, Op::Send { id: 0, opcode: SendOp::Send, imm: 0, data: &[i as u8; 8] }).expect("post");
        firsts.push(ha.sent.lock().pop().expect("sent"));
    }
    for p in &firsts {
        b.on_datagram(&hb, p, &A);
    }
    assert_eq!(hb.delivered.lock().len(), 3, "three of A's flows delivered, the fourth dropped");
    assert_eq!(b.inbound.lock().len(), 3);
    let c_route = Route { src_incarnation: 7, ..ROUTE };
    let (c, hc) = (port(), Recorder::default());
    let flow = c.open(c_route, Peer { sgid_index: 0, dgid: B.gid, qpn: B.qpn, qkey: 1 }).expect("open");
    c.post(&hc, &flow, Op::Send { id: 0, opcode: SendOp::Send, imm: 0, data: &[9; 8] }).expect("post");
    b.on_datagram(&hb, &hc.sent.lock().pop().expect("sent"), &C);
    assert_eq!(hb.delivered.lock().len(), 4, "another GID's flow comes in");
    // One of A's flows goes (its VQP is gone): the fourth comes in at its
    // retransmission.
    b.forget_vqp(ROUTE.dst_vqpn + 1000); // nothing of A's: still full
    b.on_datagram(&hb, &firsts[3], &A);
    assert_eq!(hb.delivered.lock().len(), 4);
    b.forget_process(ROUTE.src_incarnation);
    assert!(b.per_gid.lock().get(&A.gid).is_none(), "A's count went with its flows");
    b.on_datagram(&hb, &firsts[3], &A);
    assert_eq!(hb.delivered.lock().len(), 5, "room again");
}

#[test]
fn packets_past_gaps_are_held_up_to_the_ports_budget() {
    let b = port();
    let hb = Recorder::default();
    // Flows from many VQPs: each one's packet 0 delivered, packet 1 lost,
    // the rest of its first burst held past the gap, until the port
    // holds MAX_AHEAD.
    let (a, ha) = (port(), Recorder::default());
    let mut i = 0;
    let mut lost = Vec::new();
    while b.ahead.load(Ordering::Relaxed) < MAX_AHEAD || i < 2 {
        let route = Route { src_vqpn: 1000 + i, ..ROUTE };
        i += 1;
        let flow = a.open(route, Peer { sgid_index: 0, dgid: B.gid, qpn: B.qpn, qkey: 1 }).expect("open");
        for id in 0..64 {
            a.post(&ha, &flow, Op::Send { id, opcode: SendOp::Send, imm: 0, data: &[1; 8] }).expect("post");
        }
        let sent = std::mem::take(&mut *ha.sent.lock());
        assert!(sent.len() > 3, "a burst");
        b.on_datagram(&hb, &sent[0], &A);
        lost.push(sent[1].clone());
        for p in &sent[2..] {
            b.on_datagram(&hb, p, &A);
        }
    }
    assert_eq!(b.ahead.load(Ordering::Relaxed), MAX_AHEAD, "held up to the budget, no further");
    let held: usize = b.inbound.lock().values().map(|f| f.receiver.ahead()).sum();
    assert_eq!(held, MAX_AHEAD, "the count agrees with the flows");
    // The first flow's gap filled: its held packets are delivered and
    // leave the budget (an in-order packet is taken whatever it holds).
    let first_held = b.inbound.lock().iter().find(|(k, _)| k.route.src_vqpn == 1000).map(|(_, f)| f.receiver.ahead()).expect("flow");
    assert!(first_held > 0);
    let batches = hb.delivered.lock().len();
    b.on_datagram(&hb, &lost[0], &A);
    assert_eq!(b.ahead.load(Ordering::Relaxed), MAX_AHEAD - first_held);
    let last = hb.delivered.lock().last().map(|(d, _)| d.len());
    assert_eq!((hb.delivered.lock().len(), last), (batches + 1, Some(first_held + 1)), "the gap and what it held, in one batch");
    // Flows going give their packets back.
    b.forget_process(ROUTE.src_incarnation);
    assert_eq!(b.ahead.load(Ordering::Relaxed), 0);
    assert!(b.inbound.lock().is_empty());
}

/// Drive A's timers until `done` or 5 s (real time: the port's clock).
fn timers_until(a: &Port, ha: &Recorder, done: impl Fn() -> bool) {
    let end = Instant::now() + Duration::from_secs(5);
    while !done() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(2));
        a.on_timer(ha);
    }
}

#[test]
fn a_silent_peer_is_doubted_and_its_flow_fails_unless_vouched_for() {
    // Past first contact, a host that cannot find out: the flow fails.
    let a = Port::new(1024, 1000, 20_000).expect("port");
    let ha = Recorder::default();
    let (flow, _) = sends(&a, &ha, 1);
    timers_until(&a, &ha, || !ha.completed.lock().is_empty());
    assert_eq!(*ha.doubted.lock(), [ROUTE.dst_incarnation]);
    assert_eq!(ha.completed.lock()[0].outcome, Outcome::RetryExceeded);
    drop(flow);

    // A host that can: the flow waits; vouched for, it goes on; then no
    // proof (the binding went): it fails at once.
    let a = Port::new(1024, 1000, 20_000).expect("port");
    let ha = Recorder { can_vouch: true, ..Recorder::default() };
    let (flow, _) = sends(&a, &ha, 1);
    timers_until(&a, &ha, || !ha.doubted.lock().is_empty());
    a.vouch(&ha, ROUTE.dst_incarnation, Some(Duration::from_secs(10)));
    let resent = ha.sent.lock().len();
    timers_until(&a, &ha, || ha.sent.lock().len() > resent + 1);
    assert!(ha.completed.lock().is_empty(), "vouched for: still retrying");
    assert_eq!(flow.outstanding(), 1);
    // Another process's proof changes nothing here.
    a.vouch(&ha, 77, None);
    assert!(ha.completed.lock().is_empty());
    // Its proof expired: doubted anew; then no proof.
    a.vouch(&ha, ROUTE.dst_incarnation, Some(Duration::ZERO));
    timers_until(&a, &ha, || ha.doubted.lock().len() == 2);
    a.vouch(&ha, ROUTE.dst_incarnation, None);
    assert_eq!(ha.completed.lock().first().map(|c| c.outcome.clone()), Some(Outcome::RetryExceeded));
}
