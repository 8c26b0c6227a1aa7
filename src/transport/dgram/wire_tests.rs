use super::*;
use crate::codec::EPROTO;
use crate::testing::Rng;

const ROUTE: Route =
    Route { src_incarnation: 0x0102_0304_0506_0708, dst_incarnation: 0x1112_1314_1516_1718, src_vqpn: 0x2122_2324, dst_vqpn: 7 };
const ROUTE_MAX: Route = Route { src_incarnation: u64::MAX, dst_incarnation: u64::MAX, src_vqpn: u32::MAX, dst_vqpn: u32::MAX };
const ROUTE_ZERO: Route = Route { src_incarnation: 0, dst_incarnation: 0, src_vqpn: 0, dst_vqpn: 0 };

fn data(payload: &[u8]) -> Data<'_> {
    Data {
        route: ROUTE,
        seq: 0x0a0b_0c0d_0e0f_1011,
        nonce: 0x5555_6666_7777_8888,
        ack_req: true,
        msg: 3,
        total_len: 100,
        seg: 1,
        nsegs: 4,
        opcode: SendOp::SendImm,
        imm: 0xdead_beef,
        payload,
    }
}

fn request(op: OneSided, payload: &[u8]) -> Request<'_> {
    let (length, offset, compare_add, swap, resp_seg) = match op {
        OneSided::Read => (4096, 0, 0, 0, 900),
        OneSided::Write => (payload.len() as u32 + 16, 16, 0, 0, 0),
        OneSided::CmpSwp => (ATOMIC_LEN, 0, 0x1111, 0x2222, 0),
        OneSided::FetchAdd => (ATOMIC_LEN, 0, 0x3333, 0, 0),
    };
    Request {
        route: ROUTE,
        seq: 9,
        nonce: 0xfeed,
        ack_req: false,
        op,
        rkey: 0xabcd,
        remote_addr: 0x7f00_0000_1000,
        length,
        offset,
        compare_add,
        swap,
        resp_seg,
        payload: if op == OneSided::Write { payload } else { &[] },
    }
}

fn response(op: OneSided, status: Status, payload: &[u8]) -> Response<'_> {
    let ok = status == Status::Ok;
    Response {
        route: ROUTE.reverse(),
        seq: 9,
        nonce: 0xfeed,
        status,
        op,
        length: if ok && op == OneSided::Read { payload.len() as u32 + 8 } else { 0 },
        offset: if ok && op == OneSided::Read { 8 } else { 0 },
        value: if ok && op.is_atomic() { 0x0123_4567_89ab_cdef } else { 0 },
        payload: if ok && op == OneSided::Read { payload } else { &[] },
    }
}

/// A buffer of `len` zeros with `parts` written at their offsets.
fn image(len: usize, parts: &[(usize, &[u8])]) -> Vec<u8> {
    let mut b = vec![0; len];
    for (at, bytes) in parts {
        b[*at..*at + bytes.len()].copy_from_slice(bytes);
    }
    b
}

fn recode(b: &[u8]) -> Result<Vec<u8>> {
    Message::decode(b).map(|m| m.to_vec())
}

const HEAD: &[u8] = &[
    8, 7, 6, 5, 4, 3, 2, 1, // src incarnation
    0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11, // dst incarnation
    0x24, 0x23, 0x22, 0x21, // src vqpn
    7, 0, 0, 0, // dst vqpn
];

#[test]
fn layouts_are_exact() {
    let d = Message::Data(data(b"xyz")).to_vec();
    assert_eq!(
        d,
        image(
            DATA_HDR + 3,
            &[
                (0, &[0x4b, 0x44, VERSION, 1, ACK_REQ]),
                (8, HEAD),
                (32, &0x0a0b_0c0d_0e0f_1011u64.to_le_bytes()),
                (40, &0x5555_6666_7777_8888u64.to_le_bytes()),
                (48, &[3, 0, 0, 0, 100, 0, 0, 0, 1, 0, 0, 0, 4, 0, 0, 0, 2, 0, 0, 0]),
                (68, &[0xef, 0xbe, 0xad, 0xde, 3]),
                (80, b"xyz"),
            ]
        )
    );
    let a = Message::Ack(Ack { route: ROUTE, next: 5, nonce: 0x99, sack: 0x8000_0000_0000_0001, rnr: false }).to_vec();
    assert_eq!(
        a,
        image(ACK_LEN, &[(0, &[0x4b, 0x44, VERSION, 2]), (8, HEAD), (32, &[5]), (40, &[0x99]), (48, &[1, 0, 0, 0, 0, 0, 0, 0x80])])
    );
    // RNR: flag 2, the refused packet's nonce where the bitmap was.
    let rnr = Message::Ack(Ack { route: ROUTE, next: 5, nonce: 0x99, sack: 0x77, rnr: true }).to_vec();
    assert_eq!(rnr, image(ACK_LEN, &[(0, &[0x4b, 0x44, VERSION, 2, RNR]), (8, HEAD), (32, &[5]), (40, &[0x99]), (48, &[0x77])]));
    let r = Message::Request(request(OneSided::CmpSwp, &[])).to_vec();
    assert_eq!(
        r,
        image(
            REQUEST_HDR,
            &[
                (0, &[0x4b, 0x44, VERSION, 3]),
                (8, HEAD),
                (32, &[9]),
                (40, &[0xed, 0xfe]),
                (48, &[3, 0, 0, 0, 0xcd, 0xab, 0, 0]),
                (56, &0x7f00_0000_1000u64.to_le_bytes()),
                (64, &[8]),
                (72, &[0x11, 0x11]),
                (80, &[0x22, 0x22]),
            ]
        )
    );
    let w = Message::Request(request(OneSided::Write, b"ab")).to_vec();
    assert_eq!(w[64..72], [18, 0, 0, 0, 16, 0, 0, 0]);
    assert_eq!(w[88..], [2, 0, 0, 0, 0, 0, 0, 0, b'a', b'b']);
    let rd = Message::Request(request(OneSided::Read, &[])).to_vec();
    assert_eq!(rd[88..], [0, 0, 0, 0, 0x84, 3, 0, 0]);
    let resp = Message::Response(response(OneSided::Read, Status::Ok, b"hello")).to_vec();
    assert_eq!(resp.len(), RESPONSE_HDR + 5);
    assert_eq!(resp[3], 4);
    assert_eq!(
        resp[48..],
        [0, 1, 0, 0, 0, 0, 0, 0, 13, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, b'h', b'e', b'l', b'l', b'o']
    );
    let atomic = Message::Response(response(OneSided::FetchAdd, Status::Ok, &[])).to_vec();
    assert_eq!(atomic[48..50], [0, 4]);
    assert_eq!(atomic[64..72], 0x0123_4567_89ab_cdefu64.to_le_bytes());
    let refused = Message::Response(response(OneSided::Write, Status::RemoteAccess, &[])).to_vec();
    assert_eq!(
        (refused.len(), &refused[..4], &refused[8..24]),
        (RESPONSE_HDR, &[0x4b, 0x44, VERSION, 4][..], &[&HEAD[8..16], &HEAD[..8]].concat()[..])
    );
    assert!(refused[50..].iter().all(|&b| b == 0));
    assert_eq!(refused[48..50], [1, 2]);
    assert!(is_dgram(&d) && !is_dgram(&[0x4d, 0x4b]) && !is_dgram(&[0x4b]));
}

/// Every kind at its field boundaries.
fn all_messages() -> Vec<Vec<u8>> {
    let big = vec![0xa5; MAX_MTU - MAX_HDR];
    let mut all = Vec::new();
    for route in [ROUTE, ROUTE_MAX, ROUTE_ZERO] {
        for payload in [&b""[..], b"x", &big] {
            let d = data(payload);
            all.push(Message::Data(Data { route, total_len: payload.len() as u32, seg: 0, nsegs: 1, ..d }).to_vec());
            let last =
                Data { route, seq: u64::MAX, nonce: u64::MAX, msg: u32::MAX, total_len: u32::MAX, seg: u32::MAX - 1, nsegs: u32::MAX, ..d };
            all.push(Message::Data(last).to_vec());
            all.push(
                Message::Data(Data {
                    route,
                    ack_req: false,
                    opcode: SendOp::Send,
                    imm: 0,
                    seq: 0,
                    nonce: 0,
                    total_len: payload.len() as u32 + 1,
                    ..d
                })
                .to_vec(),
            );
            all.push(Message::Request(Request { route, ..request(OneSided::Write, payload) }).to_vec());
            let w = Request {
                route,
                offset: 0,
                length: u32::MAX,
                rkey: u32::MAX,
                remote_addr: u64::MAX,
                ack_req: true,
                ..request(OneSided::Write, payload)
            };
            all.push(Message::Request(w).to_vec());
            all.push(Message::Response(Response { route, ..response(OneSided::Read, Status::Ok, payload) }).to_vec());
        }
        for next in [0, 1, u64::MAX] {
            for sack in [0, 1, u64::MAX] {
                for rnr in [false, true] {
                    all.push(Message::Ack(Ack { route, next, nonce: if next == 0 { 0 } else { next ^ 0x77 }, sack, rnr }).to_vec());
                }
            }
        }
        for op in OneSided::ALL {
            all.push(Message::Request(Request { route, ..request(op, b"pq") }).to_vec());
            for status in Status::ALL {
                all.push(Message::Response(Response { route, ..response(op, status, b"rs") }).to_vec());
            }
        }
        let r = Request { route, remote_addr: u64::MAX, rkey: 0, length: u32::MAX, resp_seg: u32::MAX, ..request(OneSided::Read, &[]) };
        all.push(Message::Request(r).to_vec());
        let r = Request { route, compare_add: u64::MAX, swap: u64::MAX, ..request(OneSided::CmpSwp, &[]) };
        all.push(Message::Request(r).to_vec());
    }
    all
}

#[test]
fn round_trips_every_message_at_its_boundaries() {
    let all = all_messages();
    assert_eq!(all.len(), 3 * (3 * 6 + 18 + 4 * 5 + 2));
    for (i, bytes) in all.iter().enumerate() {
        assert!(recode(bytes).as_ref() == Ok(bytes), "message {i}: {:?}", recode(bytes).map(|_| ()));
    }
    // And typed: decode gives back the very values.
    let d = data(b"0123456789");
    assert_eq!(Message::decode(&Message::Data(d).to_vec()), Ok(Message::Data(d)));
    for op in OneSided::ALL {
        let r = request(op, b"abcdef");
        assert_eq!(Message::decode(&Message::Request(r).to_vec()), Ok(Message::Request(r)));
        for status in Status::ALL {
            let r = response(op, status, b"ghij");
            assert_eq!(Message::decode(&Message::Response(r).to_vec()), Ok(Message::Response(r)));
        }
    }
}

#[test]
fn rejects_wrong_length() {
    for bytes in all_messages() {
        for n in (0..bytes.len()).filter(|n| n % 7 == 0 || bytes.len() - n < 16) {
            assert_eq!(recode(&bytes[..n]), Err(EBADMSG), "{n} bytes");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(recode(&longer), Err(EBADMSG));
    }
}

#[test]
fn rejects_wrong_magic_version_kind_and_flags() {
    for bytes in all_messages() {
        let with = |i: usize, v: u8| {
            let mut b = bytes.clone();
            b[i] = v;
            recode(&b)
        };
        assert_eq!(with(0, 0x4d), Err(EBADMSG));
        assert_eq!(with(1, 0x4b), Err(EBADMSG));
        for v in [0, VERSION + 1, 0xff] {
            assert_eq!(with(2, v), Err(EPROTO));
        }
        for k in [0, 5, 0xff] {
            assert_eq!(with(3, k), Err(EBADMSG));
        }
        for f in [3, 4, 0x80, 0xff] {
            assert_eq!(with(4, f), Err(EBADMSG));
        }
        if matches!(bytes[3], KIND_ACK | KIND_RESPONSE) {
            assert_eq!(with(4, ACK_REQ), Err(EBADMSG));
        }
        if bytes[3] != KIND_ACK {
            assert_eq!(with(4, RNR), Err(EBADMSG));
        }
    }
}

#[test]
fn rejects_inconsistent_fields() {
    let set = |m: Message, at: usize, v: &[u8]| {
        let mut b = m.to_vec();
        b[at..at + v.len()].copy_from_slice(v);
        Message::decode(&b).map(|_| ())
    };
    let d = Message::Data(data(b"abc"));
    assert_eq!(set(d, 56, &4u32.to_le_bytes()), Err(EBADMSG), "seg == nsegs");
    assert_eq!(set(d, 52, &2u32.to_le_bytes()), Err(EBADMSG), "payload above total");
    assert_eq!(set(d, 64, &[1]), Err(EBADMSG), "imm on a SEND");
    assert_eq!(set(d, 64, &[3]), Err(EBADMSG), "imm on a CLOSE");
    assert_eq!(set(d, 64, &[4]), Err(EBADMSG), "opcode");
    let close = Data { opcode: SendOp::Close, imm: 0, total_len: 0, seg: 0, nsegs: 1, ..data(&[]) };
    assert!(Message::decode(&Message::Data(close).to_vec()).is_ok(), "an empty CLOSE");
    assert_eq!(set(Message::Data(close), 52, &[1]), Err(EBADMSG), "a CLOSE with a length not of whole ACKs");
    let acks = [0u8; 2 * ACK_LEN];
    let close2 = Data { opcode: SendOp::Close, imm: 0, total_len: acks.len() as u32, seg: 0, nsegs: 1, ..data(&acks) };
    assert!(Message::decode(&Message::Data(close2).to_vec()).is_ok(), "a CLOSE carrying two ACKs");
    let many = vec![0u8; (MAX_CLOSE_ACKS + 1) * ACK_LEN];
    let close3 = Data { opcode: SendOp::Close, imm: 0, total_len: many.len() as u32, seg: 0, nsegs: 1, ..data(&many) };
    assert_eq!(Message::decode(&Message::Data(close3).to_vec()), Err(EBADMSG), "a CLOSE with too many ACKs");
    assert_eq!(set(d, 72, &4u32.to_le_bytes()), Err(EBADMSG), "payload_len past the end");
    assert_eq!(set(d, 72, &u32::MAX.to_le_bytes()), Err(EBADMSG), "payload_len huge");
    let ack = Message::Ack(Ack { route: ROUTE, next: 0, nonce: 0, sack: 3, rnr: false });
    assert_eq!(set(ack, 40, &[1]), Err(EBADMSG), "a nonce for packet -1");
    let w = Message::Request(request(OneSided::Write, b"abcd"));
    assert_eq!(set(w, 64, &19u32.to_le_bytes()), Err(EBADMSG), "segment past the request");
    assert_eq!(set(w, 68, &u32::MAX.to_le_bytes()), Err(EBADMSG), "offset overflow");
    assert_eq!(set(w, 72, &[1]), Err(EBADMSG), "operand on a WRITE");
    assert_eq!(set(w, 92, &[1]), Err(EBADMSG), "resp_seg on a WRITE");
    let rd = Message::Request(request(OneSided::Read, &[]));
    assert_eq!(set(rd, 92, &[0, 0]), Err(EBADMSG), "READ without a segment size");
    assert_eq!(set(rd, 68, &[1]), Err(EBADMSG), "offset on a READ");
    for op in [OneSided::CmpSwp, OneSided::FetchAdd] {
        let a = Message::Request(request(op, &[]));
        assert_eq!(set(a, 64, &[16]), Err(EBADMSG), "atomic of 16 bytes");
        assert_eq!(set(a, 88, &[1]), Err(EBADMSG), "atomic with a payload");
    }
    assert_eq!(set(Message::Request(request(OneSided::FetchAdd, &[])), 80, &[1]), Err(EBADMSG), "swap on FETCH_ADD");
    assert_eq!(set(rd, 48, &[5]), Err(EBADMSG), "op");
    let refused = Message::Response(response(OneSided::FetchAdd, Status::RemoteAccess, &[]));
    assert_eq!(set(refused, 64, &[1]), Err(EBADMSG), "a value with an error");
    assert_eq!(set(refused, 48, &[4]), Err(EBADMSG), "status");
    let ok = Message::Response(response(OneSided::Read, Status::Ok, b"abc"));
    assert_eq!(set(ok, 56, &[10]), Err(EBADMSG), "segment past the READ");
    assert_eq!(set(ok, 64, &[1]), Err(EBADMSG), "a value on a READ");
}

/// Flipping any bit of any message gives either an error or another valid
/// message that encodes to exactly the flipped bytes; reserved bytes never
/// decode flipped.
#[test]
fn every_bit_flip_is_refused_or_canonical() {
    let reserved: [(u8, &[(usize, usize)]); 4] = [
        (KIND_DATA, &[(5, 8), (65, 68), (76, 80)]),
        (KIND_ACK, &[(5, 8)]),
        (KIND_REQUEST, &[(5, 8), (49, 52)]),
        (KIND_RESPONSE, &[(4, 8), (50, 56), (76, 80)]),
    ];
    let mut refused = 0;
    for bytes in all_messages().into_iter().filter(|b| b.len() < 200) {
        let (_, ranges) = reserved.iter().find(|(k, _)| *k == bytes[3]).unwrap();
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                match recode(&b) {
                    Ok(again) => {
                        assert_eq!(again, b);
                        assert!(!ranges.iter().any(|&(s, e)| (s..e).contains(&i)), "byte {i} of kind {}", bytes[3]);
                    }
                    Err(_) => refused += 1,
                }
            }
        }
    }
    assert!(refused > 10_000, "{refused}");
}

/// Random bytes behind a valid prefix, mostly zero so that some decode: no
/// panic, and whatever decodes re-encodes to the input.
#[test]
fn random_garbage_never_panics() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut decoded = 0;
    for _ in 0..50_000 {
        let r = rng.next();
        let len = match r % 3 {
            0 => (r >> 8) as usize % 300,
            _ => [ACK_LEN, DATA_HDR, REQUEST_HDR, RESPONSE_HDR][(r >> 8) as usize % 4] + (r >> 16) as usize % 3,
        };
        let density = 1 + (r >> 20) % 64;
        let mut b: Vec<u8> = (0..len).map(|_| rng.next()).map(|x| if x % density == 0 { (x >> 32) as u8 } else { 0 }).collect();
        if r & (1 << 40) != 0 && len >= 5 {
            b[..5].copy_from_slice(&[0x4b, 0x44, VERSION, 1 + (r >> 41) as u8 % 4, 0]);
        }
        if let Ok(again) = recode(&b) {
            assert_eq!(again, b);
            decoded += 1;
        }
    }
    assert!(decoded > 100, "{decoded}");
}
