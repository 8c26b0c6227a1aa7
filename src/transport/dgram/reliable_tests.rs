//! A flow's ends on their own, then two endpoints over a simulated lossy,
//! duplicating, reordering channel (deterministic: a seeded xorshift and a
//! virtual clock).

use super::*;
use crate::testing::Rng;
use crate::transport::dgram::serve::tests::{target, HostMem, HostMrs, ATOMIC, BASE, RW};
use crate::transport::dgram::serve::Responder;

const A_TO_B: Route = Route { src_incarnation: 0xa, dst_incarnation: 0xb, src_vqpn: 1, dst_vqpn: 2 };

fn cfg() -> Config {
    Config { window: 8, max_queued: 16, ack_delay_us: 50, ..Config::default() }
}

fn decode(b: &[u8]) -> Message<'_> {
    Message::decode(b).expect("the flow's own datagrams decode")
}

fn seq_of(b: &[u8]) -> u64 {
    match decode(b) {
        Message::Data(d) => d.seq,
        Message::Request(r) => r.seq,
        m => panic!("{m:?}"),
    }
}

#[test]
fn config_is_checked() {
    for bad in [
        Config { mtu: 255, ..cfg() },
        Config { mtu: 4097, ..cfg() },
        Config { window: 0, ..cfg() },
        Config { window: WINDOW + 1, ..cfg() },
        Config { max_queued: 0, ..cfg() },
        Config { rto_max_us: 1, ..cfg() },
        Config { ack_every: 0, ..cfg() },
        Config { ack_delay_us: 2_000, ..cfg() },
    ] {
        assert_eq!(Sender::new(bad, A_TO_B, 1).err(), Some(Errno::EINVAL), "{bad:?}");
        assert_eq!(Receiver::new(bad, A_TO_B).err(), Some(Errno::EINVAL));
    }
}

#[test]
fn window_and_queue_are_bounded_and_completion_waits_for_the_ack() {
    let mut s = Sender::new(cfg(), A_TO_B, 7).unwrap();
    let mut r = Receiver::new(cfg(), A_TO_B).unwrap();
    for id in 0..16 {
        s.post_send(id, SendOp::Send, 0, &[id as u8; 10]).unwrap();
    }
    assert_eq!(s.post_send(16, SendOp::Send, 0, b"x"), Err(Errno::ENOMEM));
    let burst = s.poll(0);
    assert_eq!(burst.iter().map(|b| seq_of(b)).collect::<Vec<_>>(), (0..8).collect::<Vec<_>>());
    // Only the last of a burst asks for an ACK.
    assert_eq!(burst.iter().map(|b| b[4]).collect::<Vec<_>>(), [0, 0, 0, 0, 0, 0, 0, wire::ACK_REQ]);
    assert!(s.poll(1).is_empty(), "window full");
    assert_eq!(s.next_deadline(), Some(cfg().rto_initial_us));
    for b in &burst[..3] {
        assert_eq!(r.on_message(5, &decode(b)), Received::Taken);
    }
    assert!(s.pop_completion().is_none(), "nothing acknowledged yet");
    // Three delivered, fewer than ack_every: the ACK waits ack_delay_us.
    assert_eq!(r.next_deadline(), Some(5 + cfg().ack_delay_us));
    assert_eq!(r.poll_ack(5 + cfg().ack_delay_us - 1), None);
    let ack = r.poll_ack(5 + cfg().ack_delay_us).unwrap();
    s.on_message(300, &decode(&ack));
    let done: Vec<_> = std::iter::from_fn(|| s.pop_completion()).collect();
    assert_eq!(done, (0..3).map(|id| Completion { id, outcome: Outcome::Done }).collect::<Vec<_>>());
    // The window slid by three.
    assert_eq!(s.poll(301).iter().map(|b| seq_of(b)).collect::<Vec<_>>(), [8, 9, 10]);
    for (id, d) in std::iter::from_fn(|| r.pop()).enumerate() {
        assert_eq!(d, Delivery::Message { opcode: SendOp::Send, imm: 0, data: vec![id as u8; 10], held: None });
    }
}

#[test]
fn forged_acks_and_responses_change_nothing() {
    let mut s = Sender::new(cfg(), A_TO_B, 7).unwrap();
    let mut r = Receiver::new(cfg(), A_TO_B).unwrap();
    s.post_send(1, SendOp::Send, 0, b"hello").unwrap();
    s.post_atomic(2, Atomic::FetchAdd { add: 1 }, ATOMIC, BASE + 0xc000).unwrap();
    let sent = s.poll(0);
    for b in &sent {
        r.on_message(1, &decode(b));
    }
    let Message::Ack(ack) = decode(&r.poll_ack(1).unwrap()) else { panic!() };
    assert_eq!(ack.next, 2);
    // A wrong nonce, a wrong route, an ACK past what was sent.
    for forged in [
        Ack { nonce: ack.nonce ^ 1, ..ack },
        Ack { route: A_TO_B, ..ack },
        Ack { route: Route { src_incarnation: 0xbad, ..ack.route }, ..ack },
        Ack { next: 3, ..ack },
    ] {
        s.on_message(2, &Message::Ack(forged));
    }
    assert_eq!((s.pop_completion(), s.drops.unmatched, s.drops.wrong_route), (None, 2, 2));
    let Message::Request(req) = decode(&sent[1]) else { panic!() };
    let resp = Response {
        route: A_TO_B.reverse(),
        seq: req.seq,
        nonce: req.nonce,
        status: Status::Ok,
        op: OneSided::FetchAdd,
        length: 0,
        offset: 0,
        value: 41,
        payload: &[],
    };
    for forged in [
        Response { nonce: 9, ..resp },
        Response { seq: 0, ..resp },
        Response { op: OneSided::Read, ..resp },
        Response { op: OneSided::CmpSwp, ..resp },
    ] {
        s.on_message(3, &Message::Response(forged));
    }
    assert_eq!(s.pop_completion(), None);
    assert_eq!((s.drops.unmatched, s.drops.malformed), (4, 2));
    // The genuine ones.
    s.on_message(4, &Message::Ack(ack));
    s.on_message(4, &Message::Response(resp));
    assert_eq!(s.pop_completion(), Some(Completion { id: 1, outcome: Outcome::Done }));
    assert_eq!(s.pop_completion(), Some(Completion { id: 2, outcome: Outcome::Atomic(41) }));
    assert_eq!(s.next_deadline(), None, "nothing in flight: no timer");
    // The receiver drops a packet of another flow.
    let mut other = s.poll(5);
    assert!(other.is_empty());
    s.post_send(3, SendOp::SendImm, 0x55, b"x").unwrap();
    other = s.poll(5);
    let Message::Data(d) = decode(&other[0]) else { panic!() };
    let wrong = Data { route: Route { dst_vqpn: 9, ..d.route }, ..d };
    assert_eq!(r.on_message(6, &Message::Data(wrong)), Received::Dropped);
    assert_eq!(r.drops.wrong_route, 1);
}

#[test]
fn retries_back_off_then_fail_with_retry_exceeded_and_flush() {
    let c = Config { rto_initial_us: 100, rto_max_us: 1000, retry_limit: 5, ..cfg() };
    let mut s = Sender::new(c, A_TO_B, 7).unwrap();
    s.post_send(1, SendOp::Send, 0, &[1; 3000]).unwrap();
    s.post_read(2, RW, BASE, 8).unwrap();
    s.post_send(3, SendOp::Send, 0, b"z").unwrap();
    let first = s.poll(0);
    assert_eq!(first.len(), 6, "4 segments, the READ, 1 segment");
    // Nothing ever comes back: the timer doubles up to the cap.
    let mut now = 0;
    let mut gaps = Vec::new();
    while let Some(d) = s.next_deadline() {
        gaps.push(d - now);
        now = d;
        let again = s.poll(now);
        if s.failed() {
            assert!(again.is_empty());
            break;
        }
        assert_eq!(again.len(), 6, "every unacknowledged packet again");
        assert!(again.iter().all(|b| b[4] == wire::ACK_REQ), "a retransmission asks for an ACK");
    }
    assert_eq!(gaps, [100, 200, 400, 800, 1000, 1000]);
    let done: Vec<_> = std::iter::from_fn(|| s.pop_completion()).map(|c| (c.id, c.outcome.wc_status())).collect();
    use crate::sys::ibv_wc_status as S;
    assert_eq!(done, [(1, S::IBV_WC_RETRY_EXC_ERR), (2, S::IBV_WC_WR_FLUSH_ERR), (3, S::IBV_WC_WR_FLUSH_ERR)]);
    // Posting after the failure completes flushed, as on an RC QP in ERR.
    s.post_send(4, SendOp::Send, 0, b"late").unwrap();
    assert_eq!(s.pop_completion(), Some(Completion { id: 4, outcome: Outcome::Flushed }));
    assert!(s.poll(now + 10_000).is_empty());
}

#[test]
fn progress_resets_the_backoff() {
    let c = Config { rto_initial_us: 100, rto_max_us: 1000, retry_limit: 2, ..cfg() };
    let mut s = Sender::new(c, A_TO_B, 7).unwrap();
    let mut r = Receiver::new(c, A_TO_B).unwrap();
    s.post_send(1, SendOp::Send, 0, b"a").unwrap();
    s.post_send(2, SendOp::Send, 0, b"b").unwrap();
    let sent = s.poll(0);
    // Two timeouts, then the first packet gets through and is acknowledged.
    assert_eq!(s.poll(100).len(), 2);
    assert_eq!(s.poll(300).len(), 2);
    r.on_message(301, &decode(&sent[0]));
    s.on_message(302, &decode(&r.poll_ack(301 + c.ack_delay_us).unwrap()));
    assert_eq!(s.pop_completion(), Some(Completion { id: 1, outcome: Outcome::Done }));
    // The count and the timer start again: two more timeouts are allowed.
    assert_eq!(s.next_deadline(), Some(402));
    assert_eq!(s.poll(402).len(), 1);
    assert_eq!(s.poll(602).len(), 1);
    assert!(!s.failed());
    assert!(s.poll(1002).is_empty());
    assert!(s.failed());
}

#[test]
fn first_contact_ends_at_its_bound_unless_the_peer_answered() {
    let c = Config { rto_initial_us: 100, rto_max_us: 1000, retry_limit: 50, first_contact_us: 650, ..cfg() };
    // Never answered: the last timeout is cut to the bound.
    let mut s = Sender::new(c, A_TO_B, 7).unwrap();
    s.post_send(1, SendOp::Send, 0, b"a").unwrap();
    assert_eq!(s.poll(10).len(), 1);
    let mut fired = Vec::new();
    while let Some(d) = s.next_deadline() {
        fired.push(d);
        s.poll(d);
    }
    assert_eq!(fired, [110, 310, 660]);
    assert!(s.failed());
    assert_eq!(s.pop_completion().map(|c| c.outcome.wc_status()), Some(crate::sys::ibv_wc_status::IBV_WC_RETRY_EXC_ERR));
    // Answered once: only the retry limit bounds it afterwards.
    let mut s = Sender::new(c, A_TO_B, 7).unwrap();
    let mut r = Receiver::new(c, A_TO_B).unwrap();
    s.post_send(1, SendOp::Send, 0, b"a").unwrap();
    let sent = s.poll(0);
    r.on_message(1, &decode(&sent[0]));
    s.on_message(2, &decode(&r.poll_ack(1 + c.ack_delay_us).unwrap()));
    s.post_send(2, SendOp::Send, 0, b"b").unwrap();
    s.poll(100);
    let mut now = 100;
    while now < 5_000 {
        now = s.next_deadline().unwrap();
        s.poll(now);
    }
    assert!(!s.failed(), "a peer that answered is not a first contact");
}

#[test]
fn out_of_retries_a_flow_waits_for_a_proof_goes_on_while_vouched_for_and_stops_at_its_bound() {
    let c = Config { rto_initial_us: 100, rto_max_us: 1000, retry_limit: 2, live_bound_us: 20_000, proof_wait_us: 3_000, ..cfg() };
    let mut s = Sender::new(c, A_TO_B, 7).unwrap();
    s.post_send(1, SendOp::Send, 0, b"a").unwrap();
    s.poll(0);
    let step = |s: &mut Sender| {
        let now = s.next_deadline().expect("armed");
        s.poll(now);
        now
    };
    // Two retries, then out of them: in doubt, told once.
    step(&mut s);
    step(&mut s);
    assert!(!s.take_doubt());
    let doubted_at = step(&mut s);
    assert!(!s.failed(), "waits for the proof");
    assert!(s.take_doubt());
    assert!(!s.take_doubt(), "told once per doubt");
    // Vouched for: it goes on past the proof's wait.
    s.vouch(Some(doubted_at + 10_000));
    let mut now = doubted_at;
    while now < doubted_at + 10_000 {
        now = step(&mut s);
        assert!(!s.failed(), "vouched for at {now}");
    }
    // The proof ran out: a new doubt, then no proof: it fails at once.
    assert!(s.take_doubt());
    s.vouch(None);
    assert!(s.failed());
    use crate::sys::ibv_wc_status as S;
    assert_eq!(s.pop_completion().map(|c| c.outcome.wc_status()), Some(S::IBV_WC_RETRY_EXC_ERR));

    // No answer to the doubt: it fails once the proof's wait is over.
    let mut s = Sender::new(c, A_TO_B, 7).unwrap();
    s.post_send(1, SendOp::Send, 0, b"a").unwrap();
    let mut now = 0;
    s.poll(now);
    let mut doubted = None;
    while !s.failed() {
        now = s.next_deadline().expect("armed");
        s.poll(now);
        if s.take_doubt() {
            doubted = Some(now);
        }
    }
    let doubted = doubted.expect("doubted");
    assert!(now >= doubted + 3_000 && now <= doubted + 3_000 + 1_000, "failed at {now}, doubted at {doubted}");

    // Vouched for again and again: the bound still ends it.
    let mut s = Sender::new(c, A_TO_B, 7).unwrap();
    s.post_send(1, SendOp::Send, 0, b"a").unwrap();
    let mut now = 0;
    s.poll(now);
    let mut out_at = None;
    while !s.failed() {
        now = s.next_deadline().expect("armed");
        s.poll(now);
        if s.take_doubt() {
            out_at.get_or_insert(now);
            s.vouch(Some(now + 5_000));
        }
    }
    let out_at = out_at.expect("ran out");
    assert!(now >= out_at + 20_000 && now <= out_at + 21_000, "failed at {now}, out of retries at {out_at}");
}

#[test]
fn a_vouched_first_contact_goes_on_and_an_answer_ends_the_doubt() {
    let c = Config {
        rto_initial_us: 100,
        rto_max_us: 1000,
        retry_limit: 50,
        first_contact_us: 650,
        live_bound_us: 50_000,
        proof_wait_us: 3_000,
        ..cfg()
    };
    let mut s = Sender::new(c, A_TO_B, 7).unwrap();
    let mut r = Receiver::new(c, A_TO_B).unwrap();
    s.post_send(1, SendOp::Send, 0, b"a").unwrap();
    let sent = s.poll(0);
    let mut now = 0;
    while !s.take_doubt() {
        now = s.next_deadline().expect("armed");
        s.poll(now);
    }
    assert_eq!(now, 650, "the first contact's bound");
    s.vouch(Some(now + 30_000));
    // Later timeouts follow the backoff, not the first contact's bound.
    let next = s.next_deadline().expect("armed");
    assert!(next > now, "no timer in the past");
    now = next;
    s.poll(now);
    // The starved peer answers at last.
    r.on_message(now + 1, &decode(&sent[0]));
    s.on_message(now + 2, &decode(&r.poll_ack(now + 1 + c.ack_delay_us).unwrap()));
    assert_eq!(s.pop_completion(), Some(Completion { id: 1, outcome: Outcome::Done }));
    assert!(!s.failed());
    assert!(!s.take_doubt(), "no doubt after the answer");
}

/// One endpoint: a flow out and a flow in, and the target side of the
/// flow in.
struct Node {
    tx: Sender,
    rx: Receiver,
    responder: Responder,
    mrs: HostMrs,
    mem: HostMem,
    got: Vec<(SendOp, u32, Vec<u8>)>,
    done: Vec<Completion>,
}

impl Node {
    fn new(c: Config, out: Route, seed: u64) -> Node {
        let (mrs, mem) = target();
        Node {
            tx: Sender::new(c, out, seed).unwrap(),
            rx: Receiver::new(c, out.reverse()).unwrap(),
            responder: Responder::new(c.mtu, 1 << 20),
            mrs,
            mem,
            got: Vec::new(),
            done: Vec::new(),
        }
    }

    /// A datagram arrived; what it makes us send goes to `out`.
    fn handle(&mut self, now: u64, bytes: &[u8], out: &mut Vec<Vec<u8>>) {
        let m = Message::decode(bytes).expect("the channel does not corrupt");
        match m {
            Message::Data(_) | Message::Request(_) => {
                if self.rx.on_message(now, &m) == Received::DuplicateRequest {
                    let Message::Request(r) = &m else { unreachable!() };
                    out.extend(self.responder.serve_duplicate(r, &self.mrs, &mut self.mem));
                }
                while let Some(d) = self.rx.pop() {
                    match &d {
                        Delivery::Message { opcode, imm, data, .. } => self.got.push((*opcode, *imm, data.clone())),
                        Delivery::Request(_) => {
                            let served = self.responder.serve(&d.request().unwrap(), &self.mrs, &mut self.mem);
                            out.extend(served.responses);
                            if served.status != Status::Ok {
                                self.rx.fail();
                            }
                        }
                    }
                }
            }
            Message::Ack(_) | Message::Response(_) => self.tx.on_message(now, &m),
        }
    }

    fn poll(&mut self, now: u64, out: &mut Vec<Vec<u8>>) {
        out.extend(self.tx.poll(now));
        out.extend(self.rx.poll_ack(now));
        self.done.extend(std::iter::from_fn(|| self.tx.pop_completion()));
    }

    fn next_deadline(&self) -> Option<u64> {
        [self.tx.next_deadline(), self.rx.next_deadline()].into_iter().flatten().min()
    }
}

/// The channel: each datagram is lost, duplicated and delayed at random.
struct Net {
    rng: Rng,
    loss: u64,
    dup: u64,
    jitter_us: u64,
    /// (arrival, order, to node, bytes)
    flight: Vec<(u64, u64, usize, Vec<u8>)>,
    order: u64,
    sent: u64,
}

impl Net {
    fn send(&mut self, now: u64, to: usize, datagrams: Vec<Vec<u8>>) {
        for b in datagrams {
            assert!(b.len() <= cfg().mtu, "a datagram above the MTU");
            self.sent += 1;
            if self.rng.chance(self.loss) {
                continue;
            }
            let copies = if self.rng.chance(self.dup) { 2 } else { 1 };
            for _ in 0..copies {
                let at = now + 5 + self.rng.below(self.jitter_us + 1);
                self.order += 1;
                self.flight.push((at, self.order, to, b.clone()));
            }
        }
    }
}

/// Runs both nodes until `done` holds or nothing is left to happen;
/// `post` posts work on node 0 whenever it runs. Returns the final time.
fn run(nodes: &mut [Node; 2], net: &mut Net, mut post: impl FnMut(&mut Node), done: impl Fn(&[Node; 2]) -> bool) -> u64 {
    let mut now = 0;
    for _ in 0..2_000_000 {
        post(&mut nodes[0]);
        net.flight.sort_by_key(|&(at, order, ..)| (at, order));
        let due = net.flight.iter().take_while(|f| f.0 <= now).count();
        for (_, _, to, bytes) in net.flight.drain(..due).collect::<Vec<_>>() {
            let mut out = Vec::new();
            nodes[to].handle(now, &bytes, &mut out);
            net.send(now, 1 - to, out);
        }
        for (i, n) in nodes.iter_mut().enumerate() {
            let mut out = Vec::new();
            n.poll(now, &mut out);
            net.send(now, 1 - i, out);
        }
        if done(nodes) {
            return now;
        }
        let next = nodes.iter().filter_map(Node::next_deadline).chain(net.flight.iter().map(|f| f.0)).min();
        match next {
            Some(t) => now = t.max(now + 1),
            None => return now,
        }
    }
    panic!("the simulation did not settle");
}

/// What node 0 posts, and what its completion must be.
#[derive(Debug)]
enum Planned {
    Send(Vec<u8>, Option<u32>),
    Write(u64, Vec<u8>),
    Read(u64, u32, Vec<u8>),
    FetchAdd(u64),
    CmpSwp(u64, u64),
}

fn workload(rng: &mut Rng, n: usize) -> Vec<Planned> {
    let mut plan = Vec::new();
    let mut written: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut next_free = BASE;
    let mut counter = 0u64;
    for i in 0..n {
        let len = match rng.below(4) {
            0 => 0,
            1 => rng.below(64) as usize,
            2 => rng.below(1000) as usize,
            _ => 1000 + rng.below(4000) as usize,
        };
        let bytes: Vec<u8> = (0..len).map(|j| (i * 31 + j) as u8).collect();
        match rng.below(6) {
            0 | 1 => plan.push(Planned::Send(bytes, rng.chance(50).then_some(i as u32))),
            2 if next_free + len as u64 <= BASE + 0x8000 => {
                written.push((next_free, bytes.clone()));
                plan.push(Planned::Write(next_free, bytes));
                next_free += len as u64;
            }
            3 if !written.is_empty() => {
                let (at, data) = &written[rng.below(written.len() as u64) as usize];
                plan.push(Planned::Read(*at, data.len() as u32, data.clone()));
            }
            4 => {
                let add = rng.below(1000);
                plan.push(Planned::FetchAdd(add));
                counter += add;
            }
            _ => {
                // Swap in a new value only if the counter is what the
                // in-order history says.
                plan.push(Planned::CmpSwp(counter, counter + 1));
                counter += 1;
            }
        }
    }
    plan
}

fn post(n: &mut Node, id: u64, p: &Planned) -> Result<()> {
    let counter = BASE + 0xc000;
    match p {
        Planned::Send(data, None) => n.tx.post_send(id, SendOp::Send, 0, data),
        Planned::Send(data, Some(imm)) => n.tx.post_send(id, SendOp::SendImm, *imm, data),
        Planned::Write(at, data) => n.tx.post_write(id, RW, *at, data),
        Planned::Read(at, len, _) => n.tx.post_read(id, RW, *at, *len),
        Planned::FetchAdd(add) => n.tx.post_atomic(id, Atomic::FetchAdd { add: *add }, ATOMIC, counter),
        Planned::CmpSwp(compare, swap) => n.tx.post_atomic(id, Atomic::CmpSwp { compare: *compare, swap: *swap }, ATOMIC, counter),
    }
}

/// Two endpoints over a channel that loses, duplicates and reorders:
/// every message arrives once, in order, byte for byte, in both
/// directions; every READ returns what the WRITEs before it wrote; the
/// atomics return the in-order history (so none ran twice).
#[test]
fn lossy_duplicating_reordering_channel_delivers_once_and_in_order() {
    let mut seen_retransmits = 0;
    for seed in 1..=12u64 {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let c = Config { rto_initial_us: 300, retry_limit: 30, ..cfg() };
        let mut nodes = [Node::new(c, A_TO_B, seed), Node::new(c, A_TO_B.reverse(), !seed)];
        nodes[1].mem.bytes[0xc000..0xc008].fill(0);
        let plan = workload(&mut rng, 150);
        // Node 1 sends its own stream at once (as much as its queue takes).
        let back: Vec<Vec<u8>> = (0..c.max_queued).map(|i| vec![i as u8; (i * 97) % 3000]).collect();
        for (i, m) in back.iter().enumerate() {
            nodes[1].tx.post_send(1000 + i as u64, SendOp::Send, 0, m).unwrap();
        }
        let (loss, dup, jitter_us) = (5 + seed % 3 * 5, 5, 50 + seed * 20);
        let mut net = Net { rng: Rng(seed * 7919 + 1), loss, dup, jitter_us, flight: Vec::new(), order: 0, sent: 0 };
        let mut next = 0;
        let end = run(
            &mut nodes,
            &mut net,
            |n| {
                while next < plan.len() {
                    match post(n, next as u64, &plan[next]) {
                        Ok(()) => next += 1,
                        Err(e) => {
                            assert_eq!(e, Errno::ENOMEM);
                            break;
                        }
                    }
                }
            },
            |n| n[0].done.len() == plan.len() && n[1].done.len() == back.len() && n[0].got.len() == back.len(),
        );
        assert!(end > 0);
        let [a, b] = &nodes;
        // Completions in post order, each with its result.
        let mut counter = 0u64;
        let mut sends = Vec::new();
        for (i, (done, p)) in a.done.iter().zip(&plan).enumerate() {
            assert_eq!(done.id, i as u64, "seed {seed}: completions in post order");
            let want = match p {
                Planned::Send(data, imm) => {
                    sends.push((if imm.is_some() { SendOp::SendImm } else { SendOp::Send }, imm.unwrap_or(0), data.clone()));
                    Outcome::Done
                }
                Planned::Write(..) => Outcome::Done,
                Planned::Read(_, _, data) => Outcome::Read(data.clone()),
                Planned::FetchAdd(add) => {
                    counter += add;
                    Outcome::Atomic(counter - add)
                }
                Planned::CmpSwp(compare, _) => {
                    counter += 1;
                    Outcome::Atomic(*compare)
                }
            };
            assert_eq!(done.outcome, want, "seed {seed}, work {i}: {p:?}");
        }
        assert_eq!(b.got, sends, "seed {seed}: every message once, in order");
        assert_eq!(b.mem.u64_at(BASE + 0xc000), counter);
        let want_back: Vec<_> = back.iter().map(|m| (SendOp::Send, 0, m.clone())).collect();
        assert_eq!(a.got, want_back, "seed {seed}: the other direction too");
        assert!(b.done.iter().all(|d| d.outcome == Outcome::Done));
        assert_eq!((a.rx.drops.wrong_route, a.rx.drops.malformed, b.rx.drops.malformed), (0, 0, 0));
        seen_retransmits += a.rx.drops.duplicate + b.rx.drops.duplicate;
        assert!(net.sent > plan.len() as u64);
    }
    assert!(seen_retransmits > 100, "the channel exercised duplicates: {seen_retransmits}");
}

/// A refused request mid-stream: the ones before it complete, it gets its
/// status, the ones after are flushed and never reach the target, as RC.
#[test]
fn a_remote_access_error_fails_the_flow_at_both_ends() {
    let c = Config { rto_initial_us: 300, ..cfg() };
    let mut nodes = [Node::new(c, A_TO_B, 3), Node::new(c, A_TO_B.reverse(), 4)];
    let mut net = Net { rng: Rng(99), loss: 10, dup: 10, jitter_us: 100, flight: Vec::new(), order: 0, sent: 0 };
    let a = &mut nodes[0];
    a.tx.post_send(0, SendOp::Send, 0, b"before").unwrap();
    a.tx.post_write(1, RW, BASE, &[7; 2000]).unwrap();
    a.tx.post_read(2, RW, BASE + 0x7ff0, 0x20).unwrap(); // past the MR
    a.tx.post_send(3, SendOp::Send, 0, b"after").unwrap();
    a.tx.post_atomic(4, Atomic::FetchAdd { add: 1 }, ATOMIC, BASE + 0xc000).unwrap();
    run(&mut nodes, &mut net, |_| {}, |n| n[0].done.len() == 5 && n[1].rx.failed());
    use crate::sys::ibv_wc_status as S;
    let statuses: Vec<_> = nodes[0].done.iter().map(|d| (d.id, d.outcome.wc_status())).collect();
    assert_eq!(
        statuses,
        [
            (0, S::IBV_WC_SUCCESS),
            (1, S::IBV_WC_SUCCESS),
            (2, S::IBV_WC_REM_ACCESS_ERR),
            (3, S::IBV_WC_WR_FLUSH_ERR),
            (4, S::IBV_WC_WR_FLUSH_ERR)
        ]
    );
    let b = &nodes[1];
    assert_eq!(b.got, [(SendOp::Send, 0, b"before".to_vec())]);
    assert_eq!(b.mem.bytes[..2000], [7; 2000]);
    assert_eq!(b.mem.u64_at(BASE + 0xc000), target().1.u64_at(BASE + 0xc000), "the atomic after it never ran");
    assert_eq!(b.responder.stats.refused, 1);
}

/// The answer to an earlier READ is lost and a later request is refused:
/// the READ is retransmitted, answered again (the target's receiver has
/// failed but still answers what it delivered), and completes before the
/// refusal, as on RC.
#[test]
fn an_earlier_answer_lost_before_a_refusal_is_still_recovered() {
    let c = Config { rto_initial_us: 100, ..cfg() };
    let mut a = Node::new(c, A_TO_B, 1);
    let mut b = Node::new(c, A_TO_B.reverse(), 2);
    a.tx.post_read(0, RW, BASE + 8, 16).unwrap();
    a.tx.post_read(1, 0x99, BASE, 8).unwrap();
    a.tx.post_send(2, SendOp::Send, 0, b"after").unwrap();
    let mut answers = Vec::new();
    for d in a.tx.poll(0) {
        b.handle(1, &d, &mut answers);
    }
    assert!(b.rx.failed());
    assert_eq!(b.got, []);
    // Both answers, and the ACK for the READ; the first answer is lost.
    assert_eq!(answers.len(), 2);
    let mut to_a = Vec::new();
    a.handle(2, &answers[1], &mut to_a);
    a.poll(2, &mut to_a);
    assert!(to_a.is_empty());
    assert!(a.done.is_empty(), "the READ before the refusal completes first");
    assert_eq!(a.tx.next_deadline(), Some(102));
    let again = a.tx.poll(102);
    assert_eq!(again.len(), 1, "only the unanswered READ");
    let mut answers = Vec::new();
    b.handle(103, &again[0], &mut answers);
    for x in &answers {
        a.handle(104, x, &mut Vec::new());
    }
    a.poll(104, &mut Vec::new());
    let want = vec![
        Completion { id: 0, outcome: Outcome::Read(b.mem.bytes[8..24].to_vec()) },
        Completion { id: 1, outcome: Outcome::Remote(Status::RemoteAccess) },
        Completion { id: 2, outcome: Outcome::Flushed },
    ];
    assert_eq!(a.done, want);
    assert_eq!(a.tx.next_deadline(), None);
}

/// Segmented messages of every size around the segment boundaries, over
/// a channel that loses a third of the datagrams.
#[test]
fn segmented_messages_reassemble_byte_for_byte() {
    let room = cfg().mtu - wire::DATA_HDR;
    let sizes: Vec<usize> = vec![0, 1, room - 1, room, room + 1, 2 * room, 3 * room + 5, 20_000];
    let c = Config { rto_initial_us: 200, retry_limit: 40, ..cfg() };
    let mut nodes = [Node::new(c, A_TO_B, 5), Node::new(c, A_TO_B.reverse(), 6)];
    let mut net = Net { rng: Rng(1234), loss: 33, dup: 0, jitter_us: 300, flight: Vec::new(), order: 0, sent: 0 };
    let msgs: Vec<Vec<u8>> = sizes.iter().map(|&n| (0..n).map(|i| (i % 251) as u8 ^ (n as u8)).collect()).collect();
    for (i, m) in msgs.iter().enumerate() {
        nodes[0].tx.post_send(i as u64, SendOp::SendImm, i as u32, m).unwrap();
    }
    run(&mut nodes, &mut net, |_| {}, |n| n[0].done.len() == msgs.len());
    let want: Vec<_> = msgs.iter().enumerate().map(|(i, m)| (SendOp::SendImm, i as u32, m.clone())).collect();
    assert_eq!(nodes[1].got, want);
    assert!(nodes[0].done.iter().all(|d| d.outcome == Outcome::Done));
}

/// A path slower than the first timeout: once a round trip was measured,
/// the timeout covers it (no retransmission on the first try), and a
/// retransmitted packet gives no sample.
#[test]
fn the_timeout_follows_the_measured_round_trip() {
    let c = Config { rto_initial_us: 1_000, rto_min_us: 1_000, rto_max_us: 100_000, ..cfg() };
    let mut s = Sender::new(c, A_TO_B, 3).unwrap();
    let mut r = Receiver::new(c, A_TO_B).unwrap();
    // Round trips of 20 ms: the first packet times out once (resent, no
    // sample), the second is answered in time and measured.
    s.post_send(1, SendOp::Send, 0, b"a").unwrap();
    let first = s.poll(0);
    assert_eq!(s.next_deadline(), Some(1_000));
    assert_eq!(s.poll(1_000).len(), 1, "a timeout resends");
    r.on_message(1_000, &decode(&first[0]));
    let ack = r.poll_ack(1_000).unwrap();
    s.on_message(20_000, &decode(&ack));
    assert_eq!(s.pop_completion().map(|c| c.id), Some(1));
    s.post_send(2, SendOp::Send, 0, b"b").unwrap();
    let second = s.poll(20_000);
    assert_eq!(s.next_deadline(), Some(21_000), "a resent packet gave no sample");
    r.on_message(20_000, &decode(&second[0]));
    let ack = r.poll_ack(20_000).unwrap();
    s.on_message(40_000, &decode(&ack));
    assert_eq!(s.pop_completion().map(|c| c.id), Some(2));
    s.post_send(3, SendOp::Send, 0, b"c").unwrap();
    s.poll(40_000);
    // srtt 20 ms, rttvar 10 ms: 60 ms.
    assert_eq!(s.next_deadline(), Some(100_000));
    assert!(s.poll(99_999).is_empty(), "no retransmission before the measured timeout");
}

#[test]
fn an_answered_request_needs_no_ack_but_what_follows_it_does() {
    let mut s = Sender::new(cfg(), A_TO_B, 7).unwrap();
    let mut r = Receiver::new(cfg(), A_TO_B).unwrap();
    s.post_read(1, RW, BASE, 8).unwrap();
    let read = s.poll(0);
    assert_eq!(read.len(), 1);
    assert_eq!(r.on_message(1, &decode(&read[0])), Received::Taken);
    assert_eq!(r.next_deadline(), Some(0), "a lone request asks for an ACK");
    let Some(Delivery::Request(req)) = r.pop() else { panic!("the request is delivered") };
    let Message::Request(req) = decode(&req) else { panic!() };
    r.answered(req.seq);
    assert_eq!(r.next_deadline(), None, "its response is the acknowledgement");
    assert_eq!(r.poll_ack(1_000), None);

    // A message behind the request is not acknowledged by its response.
    s.post_read(2, RW, BASE, 8).unwrap();
    s.post_send(3, SendOp::Send, 0, b"after").unwrap();
    let two = s.poll(2);
    for b in &two {
        assert_eq!(r.on_message(3, &decode(b)), Received::Taken);
    }
    r.answered(seq_of(&two[0]));
    assert!(r.next_deadline().is_some(), "the SEND after the READ still needs its ACK");
    let ack = r.poll_ack(3 + cfg().ack_delay_us).unwrap();
    let Message::Ack(a) = decode(&ack) else { panic!() };
    assert_eq!(a.next, seq_of(&two[1]) + 1);
}

/// What one source GID may make the receiver's process hold: a message
/// beyond it is answered RNR, its sender waits (past its retry limit:
/// the peer answers, it is alive) and sends it again once the held one
/// went; nothing is lost, nothing fails, a forged RNR changes nothing.
#[test]
fn a_receiver_past_its_sources_budget_answers_rnr_and_the_sender_waits() {
    use crate::transport::dgram::budget;
    let gid = [0xc5; 16];
    let c = Config { rto_initial_us: 100, rto_max_us: 1000, retry_limit: 3, hold_bytes: 100, ..cfg() };
    let mut s = Sender::new(c, A_TO_B, 7).unwrap();
    let mut r = Receiver::new(c, A_TO_B).unwrap().with_source(gid);
    for id in 0..3 {
        s.post_send(id, SendOp::Send, 0, &[id as u8; 80]).unwrap();
    }
    let burst = s.poll(0);
    assert_eq!(burst.len(), 3);
    // The first is taken (and held: the application posted no receive).
    assert_eq!(r.on_message(1, &decode(&burst[0])), Received::Taken);
    let Some(Delivery::Message { data, held: Some(first), .. }) = r.pop() else { panic!("the first message") };
    assert_eq!((data, first.bytes(), budget::held(&gid)), (vec![0; 80], 80, 80));
    // The second does not fit: RNR; the third waits past the gap.
    assert_eq!(r.on_message(2, &decode(&burst[1])), Received::Rnr);
    assert_eq!(r.on_message(3, &decode(&burst[2])), Received::Taken);
    assert!(r.pop().is_none());
    let rnr = r.poll_ack(3).expect("an RNR ACK at once");
    let Message::Ack(a) = decode(&rnr) else { panic!() };
    assert!(a.rnr && a.next == 1);
    // A forged RNR (another nonce) is not taken.
    s.on_message(4, &Message::Ack(Ack { sack: a.sack ^ 1, ..a }));
    assert_eq!((s.drops.unmatched, s.drops.rnr), (1, 0));
    s.on_message(4, &decode(&rnr));
    assert_eq!(s.drops.rnr, 1);
    assert_eq!(s.pop_completion(), Some(Completion { id: 0, outcome: Outcome::Done }), "the first was acknowledged");
    // Ten RNR rounds (the retry limit is 3): the sender keeps waiting.
    let mut now = 4;
    for round in 0..10 {
        let d = s.next_deadline().expect("waiting to send again");
        assert!(d - now <= RNR_MAX_US.max(c.rto_max_us), "round {round}: waits {} µs", d - now);
        now = d;
        let again = s.poll(now);
        assert!(!s.failed(), "round {round}");
        assert_eq!(seq_of(&again[0]), 1);
        for b in &again {
            r.on_message(now, &decode(b));
        }
        s.on_message(now, &decode(&r.poll_ack(now).expect("an ACK")));
    }
    assert!(r.drops.rnr >= 10 && s.pop_completion().is_none());
    // The held message leaves its VQP: the next try is taken; the third,
    // past the gap, waits for the second to leave in turn (both do not fit
    // at once); in order, once each, and all complete.
    drop(first);
    assert_eq!(budget::held(&gid), 0);
    let mut got = Vec::new();
    for _ in 0..2 {
        now = s.next_deadline().expect("a packet left to send");
        for b in s.poll(now) {
            r.on_message(now, &decode(&b));
        }
        s.on_message(now, &decode(&r.final_ack()));
        got.extend(std::iter::from_fn(|| r.pop()).map(|d| match d {
            Delivery::Message { data, .. } => data,
            Delivery::Request(_) => panic!(),
        }));
    }
    assert_eq!(got, [vec![1; 80], vec![2; 80]]);
    let done: Vec<_> = std::iter::from_fn(|| s.pop_completion()).collect();
    assert_eq!(done, [Completion { id: 1, outcome: Outcome::Done }, Completion { id: 2, outcome: Outcome::Done }]);
    assert!(!s.failed() && s.outstanding() == 0);
    assert_eq!(budget::held(&gid), 0, "delivered and dropped: nothing held");
}
