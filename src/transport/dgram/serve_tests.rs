use super::*;
use crate::transport::dgram::wire::Route;

/// Host memory at a pretend address: any access outside it fails the test
/// (the checks must never let one through).
pub struct HostMem {
    pub base: u64,
    pub bytes: Vec<u8>,
    pub touched: usize,
}

impl HostMem {
    pub fn new(base: u64, len: usize) -> HostMem {
        HostMem { base, bytes: (0..len).map(|i| (i * 7 + 3) as u8).collect(), touched: 0 }
    }

    fn range(&mut self, addr: u64, len: usize) -> std::ops::Range<usize> {
        let start = addr.checked_sub(self.base).expect("below the memory") as usize;
        assert!(start + len <= self.bytes.len(), "past the memory: {addr:#x}+{len}");
        self.touched += 1;
        start..start + len
    }

    fn word(&mut self, addr: u64) -> std::ops::Range<usize> {
        assert_eq!(addr % 8, 0, "misaligned atomic reached memory");
        self.range(addr, 8)
    }

    pub fn u64_at(&self, addr: u64) -> u64 {
        let at = (addr - self.base) as usize;
        u64::from_le_bytes(self.bytes[at..at + 8].try_into().unwrap())
    }
}

impl Memory for HostMem {
    fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
        let r = self.range(addr, out.len());
        out.copy_from_slice(&self.bytes[r]);
        true
    }

    fn write(&mut self, addr: u64, data: &[u8]) -> bool {
        let r = self.range(addr, data.len());
        self.bytes[r].copy_from_slice(data);
        true
    }

    fn compare_swap(&mut self, addr: u64, compare: u64, swap: u64) -> Option<u64> {
        let r = self.word(addr);
        let old = u64::from_le_bytes(self.bytes[r.clone()].try_into().unwrap());
        if old == compare {
            self.bytes[r].copy_from_slice(&swap.to_le_bytes());
        }
        Some(old)
    }

    fn fetch_add(&mut self, addr: u64, add: u64) -> Option<u64> {
        let r = self.word(addr);
        let old = u64::from_le_bytes(self.bytes[r.clone()].try_into().unwrap());
        self.bytes[r].copy_from_slice(&old.wrapping_add(add).to_le_bytes());
        Some(old)
    }
}

/// MRs by rkey.
pub struct HostMrs(pub Vec<(u32, MrInfo)>);

impl Mrs for HostMrs {
    fn by_rkey(&self, rkey: u32) -> Option<MrInfo> {
        self.0.iter().find(|(k, _)| *k == rkey).map(|(_, i)| *i)
    }
}

pub const BASE: u64 = 0x7f00_0000_0000;
pub const RW: u32 = 0x11;
pub const RO: u32 = 0x22;
pub const ATOMIC: u32 = 0x33;
const ZERO_BASED: u32 = 0x44;
const WRAPS: u32 = 0x55;

/// One 64 KiB buffer; MRs over parts of it with different rights.
pub fn target() -> (HostMrs, HostMem) {
    let all = A::IBV_ACCESS_LOCAL_WRITE.0 | A::IBV_ACCESS_REMOTE_READ.0 | A::IBV_ACCESS_REMOTE_WRITE.0;
    let mrs = HostMrs(vec![
        (RW, MrInfo { addr: BASE, len: 0x8000, access: all }),
        (RO, MrInfo { addr: BASE + 0x8000, len: 0x4000, access: A::IBV_ACCESS_REMOTE_READ.0 }),
        (ATOMIC, MrInfo { addr: BASE + 0xc000, len: 0x4000, access: A::IBV_ACCESS_REMOTE_ATOMIC.0 | A::IBV_ACCESS_LOCAL_WRITE.0 }),
        (ZERO_BASED, MrInfo { addr: BASE, len: 0x1000, access: all | A::IBV_ACCESS_ZERO_BASED.0 }),
        (WRAPS, MrInfo { addr: u64::MAX - 0xf, len: 0x20, access: all }),
    ]);
    (mrs, HostMem::new(BASE, 0x10000))
}

const ROUTE: Route = Route { src_incarnation: 1, dst_incarnation: 2, src_vqpn: 3, dst_vqpn: 4 };

fn req(op: OneSided, rkey: u32, remote_addr: u64, length: u32) -> Request<'static> {
    let resp_seg = if op == OneSided::Read { 900 } else { 0 };
    Request { resp_seg, ..Request::new(ROUTE, 5, 0xabc, op, rkey, remote_addr, length) }
}

fn decoded(bytes: &[u8]) -> Response<'_> {
    match Message::decode(bytes) {
        Ok(Message::Response(r)) => r,
        other => panic!("not a response: {other:?}"),
    }
}

#[test]
fn every_refusal_answers_its_status_and_touches_nothing() {
    let (mrs, mut mem) = target();
    let before = mem.bytes.clone();
    let write = |rkey, addr, data: &'static [u8]| Request { payload: data, ..req(OneSided::Write, rkey, addr, data.len() as u32) };
    let cas = |rkey, addr| Request { compare_add: 1, swap: 2, ..req(OneSided::CmpSwp, rkey, addr, 8) };
    let cases: Vec<(&str, Request, Status)> = vec![
        ("unknown rkey", req(OneSided::Read, 0x99, BASE, 8), Status::RemoteAccess),
        ("below the MR", req(OneSided::Read, RO, BASE + 0x7fff, 8), Status::RemoteAccess),
        ("past the MR", req(OneSided::Read, RW, BASE + 0x7ff9, 8), Status::RemoteAccess),
        ("past the MR, WRITE", write(RW, BASE + 0x7ffe, b"abc"), Status::RemoteAccess),
        ("address overflow", req(OneSided::Read, RW, u64::MAX - 3, 8), Status::RemoteAccess),
        ("MR end overflows", req(OneSided::Read, WRAPS, u64::MAX - 0xf, 8), Status::RemoteAccess),
        ("WRITE to a read-only MR", write(RO, BASE + 0x8000, b"x"), Status::RemoteAccess),
        ("READ without REMOTE_READ", req(OneSided::Read, ATOMIC, BASE + 0xc000, 8), Status::RemoteAccess),
        ("atomic without REMOTE_ATOMIC", cas(RW, BASE), Status::RemoteAccess),
        ("FETCH_ADD without REMOTE_ATOMIC", req(OneSided::FetchAdd, RO, BASE + 0x8000, 8), Status::RemoteAccess),
        ("zero-based MR", req(OneSided::Read, ZERO_BASED, 0, 8), Status::RemoteAccess),
        ("atomic past the MR", cas(ATOMIC, BASE + 0x10000), Status::RemoteAccess),
        ("misaligned atomic", cas(ATOMIC, BASE + 0xc004), Status::InvalidRequest),
        ("misaligned FETCH_ADD", req(OneSided::FetchAdd, ATOMIC, BASE + 0xc001, 8), Status::InvalidRequest),
        ("READ segment above the MTU", Request { resp_seg: 1024, ..req(OneSided::Read, RW, BASE, 8) }, Status::InvalidRequest),
        ("READ above max_read", req(OneSided::Read, RW, BASE, 0x8000), Status::InvalidRequest),
    ];
    let mut r = Responder::new(1024, 0x4000);
    for (i, (what, q, status)) in cases.iter().enumerate() {
        let q = Request { seq: i as u64, ..*q };
        let served = r.serve(&q, &mrs, &mut mem);
        assert_eq!(served.status, *status, "{what}");
        let [answer] = &served.responses[..] else { panic!("{what}: {} answers", served.responses.len()) };
        let a = decoded(answer);
        assert_eq!((a.status, a.seq, a.nonce, a.op, a.route), (*status, i as u64, q.nonce, q.op, ROUTE.reverse()), "{what}");
        assert!(a.payload.is_empty() && a.value == 0);
    }
    assert_eq!(mem.touched, 0);
    assert_eq!(mem.bytes, before);
    assert_eq!(r.stats.refused, cases.len() as u64);
    // A WRITE refused at its first segment is refused at every one: no
    // segment of it lands.
    let first = Request { payload: b"abcd", length: 0x10, ..req(OneSided::Write, RW, BASE + 0x7ff8, 0) };
    let last = Request { offset: 0xc, seq: 99, ..first };
    for q in [first, last] {
        assert_eq!(r.serve(&q, &mrs, &mut mem).status, Status::RemoteAccess);
    }
    assert_eq!(mem.bytes, before);
    // The edges are inside.
    for q in [
        req(OneSided::Read, RW, BASE + 0x7ff8, 8),
        req(OneSided::Read, RO, BASE + 0x8000, 0x4000),
        req(OneSided::Read, RW, BASE + 0x8000, 0),
    ] {
        let q = Request { resp_seg: 900, ..q };
        assert_eq!(Responder::new(1024, 1 << 20).serve(&q, &mrs, &mut mem).status, Status::Ok, "{q:?}");
    }
}

#[test]
fn read_write_and_atomics_on_memory() {
    let (mrs, mut mem) = target();
    let mut r = Responder::new(1024, 1 << 20);
    // A READ in segments of resp_seg bytes.
    let q = Request { resp_seg: 900, ..req(OneSided::Read, RW, BASE + 100, 2500) };
    let served = r.serve(&q, &mrs, &mut mem);
    assert_eq!((served.status, served.responses.len()), (Status::Ok, 3));
    let mut got = Vec::new();
    for (i, b) in served.responses.iter().enumerate() {
        let a = decoded(b);
        assert_eq!((a.status, a.length, a.offset as usize, a.seq), (Status::Ok, 2500, i * 900, 5));
        got.extend_from_slice(a.payload);
    }
    assert_eq!(got, mem.bytes[100..2600]);
    // A WRITE in two segments: the first is acknowledged by the flow, the
    // last answered.
    let w1 = Request { payload: b"hello ", length: 11, ..req(OneSided::Write, RW, BASE + 0x10, 0) };
    let w2 = Request { payload: b"world", offset: 6, seq: 6, ..w1 };
    assert_eq!(r.serve(&w1, &mrs, &mut mem), Served { responses: vec![], status: Status::Ok });
    let served = r.serve(&w2, &mrs, &mut mem);
    assert_eq!(decoded(&served.responses[0]).status, Status::Ok);
    assert_eq!(&mem.bytes[0x10..0x1b], b"hello world");
    // Atomics answer the value before.
    let at = BASE + 0xc008;
    mem.bytes[0xc008..0xc010].copy_from_slice(&41u64.to_le_bytes());
    let fa = Request { compare_add: 1, seq: 7, ..req(OneSided::FetchAdd, ATOMIC, at, 8) };
    assert_eq!(decoded(&r.serve(&fa, &mrs, &mut mem).responses[0]).value, 41);
    let miss = Request { compare_add: 41, swap: 7, seq: 8, ..req(OneSided::CmpSwp, ATOMIC, at, 8) };
    assert_eq!(decoded(&r.serve(&miss, &mrs, &mut mem).responses[0]).value, 42);
    assert_eq!(mem.u64_at(at), 42);
    let hit = Request { compare_add: 42, swap: 7, seq: 9, ..miss };
    assert_eq!(decoded(&r.serve(&hit, &mrs, &mut mem).responses[0]).value, 42);
    assert_eq!(mem.u64_at(at), 7);
}

#[test]
fn duplicates_are_answered_from_the_cache_never_run_twice() {
    let (mrs, mut mem) = target();
    let mut r = Responder::new(1024, 1 << 20);
    let at = BASE + 0xc000;
    let fa = Request { compare_add: 5, seq: 1, ..req(OneSided::FetchAdd, ATOMIC, at, 8) };
    let first = r.serve(&fa, &mrs, &mut mem).responses;
    let v = mem.u64_at(at);
    assert_eq!(r.serve_duplicate(&fa, &mrs, &mut mem), first);
    assert_eq!(mem.u64_at(at), v, "not added twice");
    let w = Request { payload: b"once", seq: 2, ..req(OneSided::Write, RW, BASE, 4) };
    let answer = r.serve(&w, &mrs, &mut mem).responses;
    mem.bytes[..4].copy_from_slice(b"next");
    assert_eq!(r.serve_duplicate(&w, &mrs, &mut mem), answer);
    assert_eq!(&mem.bytes[..4], b"next", "not written twice");
    // A READ runs again and sees memory as it is now.
    let rd = Request { seq: 3, ..req(OneSided::Read, RW, BASE, 4) };
    r.serve(&rd, &mrs, &mut mem);
    mem.bytes[..4].copy_from_slice(b"late");
    assert_eq!(decoded(&r.serve_duplicate(&rd, &mrs, &mut mem)[0]).payload, b"late");
    // A refusal is cached too.
    let bad = Request { seq: 4, ..req(OneSided::Read, 0x99, BASE, 4) };
    let refused = r.serve(&bad, &mrs, &mut mem).responses;
    assert_eq!(r.serve_duplicate(&bad, &mrs, &mut mem), refused);
    // A forged nonce gets nothing and runs nothing.
    let touched = mem.touched;
    assert!(r.serve_duplicate(&Request { nonce: 1, ..fa }, &mrs, &mut mem).is_empty());
    assert!(r.serve_duplicate(&Request { nonce: 1, ..w }, &mrs, &mut mem).is_empty());
    assert_eq!((mem.touched, r.stats.uncached), (touched, 2));
    // The cache keeps the last WINDOW answers.
    for seq in 10..10 + WINDOW {
        r.serve(&Request { seq, ..fa }, &mrs, &mut mem);
    }
    assert!(r.serve_duplicate(&fa, &mrs, &mut mem).is_empty(), "evicted");
    assert_eq!(r.serve_duplicate(&Request { seq: 10, ..fa }, &mrs, &mut mem).len(), 1);
    // A non-final WRITE segment needs no answer: the flow's ACK covers it.
    let part = Request { payload: b"ab", length: 4, seq: 200, ..req(OneSided::Write, RW, BASE, 0) };
    r.serve(&part, &mrs, &mut mem);
    assert!(r.serve_duplicate(&part, &mrs, &mut mem).is_empty());
    assert_eq!(r.stats.uncached, 3);
}

/// Random requests aimed at the MRs' edges: each gets the status an
/// independent model (u128 arithmetic) gives, and none reaches memory
/// outside a permitted MR (`HostMem` would panic).
#[test]
fn random_requests_never_reach_memory_outside_a_permitted_mr() {
    use crate::testing::Rng;
    let (mrs, mut mem) = target();
    let mut r = Responder::new(1024, 1 << 16);
    let mut rng = Rng(0x0bad_5eed_1234_5678);
    let edges: Vec<u64> = mrs.0.iter().flat_map(|(_, m)| [m.addr, m.addr.wrapping_add(m.len)]).chain([0, u64::MAX]).collect();
    let mut served = 0;
    for seq in 0..100_000u64 {
        let op = rng.pick(&OneSided::ALL);
        let rkey = rng.pick(&[RW, RO, ATOMIC, ZERO_BASED, WRAPS, 0x99]);
        let addr = rng.pick(&edges).wrapping_add(rng.below(64)).wrapping_sub(32);
        let length = match op {
            OneSided::CmpSwp | OneSided::FetchAdd => ATOMIC_LEN,
            _ => rng.pick(&[0, 1, 8, 100, 0x4000, 0x8000, 1 << 17, u32::MAX]),
        };
        let payload = [0x5a; 64];
        let q = Request {
            seq,
            offset: if op == OneSided::Write { length.saturating_sub(64) } else { 0 },
            payload: if op == OneSided::Write { &payload[..length.min(64) as usize] } else { &[] },
            resp_seg: if op == OneSided::Read { rng.pick(&[100, 944, 945]) } else { 0 },
            ..req(op, rkey, addr, length)
        };
        let want = {
            let need = match op {
                OneSided::Read => A::IBV_ACCESS_REMOTE_READ.0,
                OneSided::Write => A::IBV_ACCESS_REMOTE_WRITE.0,
                _ => A::IBV_ACCESS_REMOTE_ATOMIC.0,
            };
            let inside = mrs.by_rkey(rkey).is_some_and(|m| {
                m.access & need != 0
                    && m.access & A::IBV_ACCESS_ZERO_BASED.0 == 0
                    && u128::from(m.addr) + u128::from(m.len) <= u128::from(u64::MAX)
                    && addr >= m.addr
                    && u128::from(addr) + u128::from(length) <= u128::from(m.addr) + u128::from(m.len)
            });
            if (op.is_atomic() && addr % 8 != 0) || (op == OneSided::Read && (q.resp_seg > 944 || length > 1 << 16)) {
                Status::InvalidRequest
            } else if !inside {
                Status::RemoteAccess
            } else {
                Status::Ok
            }
        };
        let got = r.serve(&q, &mrs, &mut mem);
        assert_eq!(got.status, want, "{q:?}");
        served += usize::from(want == Status::Ok);
    }
    assert!(served > 1000, "{served}");
}
