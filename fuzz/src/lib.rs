//! What the fuzz targets share: the input layout of the ones whose input
//! is more than one message, and the seed corpus, made with the library's
//! own encoders (`tests/seeds.rs` writes it to `corpus/<target>/` and checks
//! that the committed files are still these bytes).

use krcore::meta::proto::{
    Answer, Hello, LinkInfo, LinkReady, LinkReply, LinkRequest, Op, Presence, PresenceAnswer, PresenceQuery, Proof, Query, Request,
    Response, Welcome, BOOT_LEN, LINK_LEN, META_LEN, PROOF_LEN,
};
use krcore::meta::table::{EndpointSchema, RemoteTable, Schema, Table, HEADER_SIZE};
use krcore::meta::{Endpoint, Key};
use krcore::transport::dgram::wire::{self, Ack, Data, Message, OneSided, Route, SendOp, Status};
use krcore::vqp::header::{Flags, Header, LinkOp, HEADER_LEN};
use krcore::vqp::mrcheck::Answer as MrAnswer;
use krcore::vqp::precheck::MrInfo;
use krcore::vqp::wrid::{SendId, WrId};

/// The fuzz targets, as named in Cargo.toml and under `corpus/`.
pub const TARGETS: [&str; 7] = ["dgram_wire", "link_msg", "meta_proto", "meta_table", "node_msg", "vqp_header", "wrid"];

/// `meta_table`'s input: the meta server's endpoint table's header as READ
/// from it ([`HEADER_SIZE`] bytes), the key looked up (`KEY_LEN` bytes, as
/// `encode_key` writes it), then the bytes a READ of the key's
/// neighborhood returned (any length: a short READ is possible).
pub mod table_input {
    use super::*;

    /// Bytes of a key in the input.
    pub const ENDPOINT_KEY_LEN: usize = EndpointSchema::KEY_LEN;

    /// An endpoint-table key from its encoding (tag 1 a port, anything
    /// else a VQPN: the tag byte is not fuzzed further than that).
    pub fn endpoint_key(b: &[u8; ENDPOINT_KEY_LEN]) -> Key {
        let gid = *b[1..17].first_chunk().unwrap();
        let number = u32::from_le_bytes(*b[17..21].first_chunk().unwrap());
        if b[0] == 1 {
            Key::Port { gid, port: number }
        } else {
            Key::Vqpn { gid, vqpn: number }
        }
    }

    /// The input `meta_table` is given for a lookup of `key` (encoded as
    /// `key_bytes`) in `table`: its header and the neighborhood READ.
    pub fn build<S: Schema>(table: &Table<'_, S>, key: S::Key, key_bytes: &[u8], read_len: usize) -> Vec<u8> {
        let bytes = table.as_bytes();
        let remote = RemoteTable::<S>::parse(bytes).expect("our own header");
        let (offset, len) = remote.neighborhood(key);
        let read = &bytes[offset as usize..][..len.min(read_len)];
        [&bytes[..HEADER_SIZE], key_bytes, read].concat()
    }
}

/// One seed: its file name and bytes.
pub type Seed = (&'static str, Vec<u8>);

/// The seed corpus of `target`: valid encodings of each message kind, at
/// ordinary and extreme field values.
pub fn seeds(target: &str) -> Vec<Seed> {
    match target {
        "dgram_wire" => dgram_seeds(),
        "link_msg" => link_seeds(),
        "meta_proto" => meta_seeds(),
        "meta_table" => table_seeds(),
        "node_msg" => node_seeds(),
        "vqp_header" => header_seeds(),
        "wrid" => wrid_seeds(),
        _ => panic!("no target {target}"),
    }
}

const GID: [u8; 16] = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0x11, 0x22, 0xff, 0xfe, 0x33, 0x44, 0x55];
const U24_MAX: u32 = (1 << 24) - 1;
/// Linux errnos, as statuses (no libc dependency for three numbers).
const EBUSY: u32 = 16;
const ENOSPC: u32 = 28;
const EADDRINUSE: u32 = 98;

fn endpoint() -> Endpoint {
    Endpoint { gid: GID, qpn: 0x12_3456, qkey: 0x1111_1111, incarnation: 0x0102_0304_0506_0708, vqpn: 0x2233_4455 }
}

fn endpoint_max() -> Endpoint {
    Endpoint { gid: [0xff; 16], qpn: U24_MAX, qkey: u32::MAX, incarnation: u64::MAX, vqpn: u32::MAX }
}

fn info(from: Endpoint) -> LinkInfo {
    LinkInfo {
        from,
        rc_qpn: 0xab_cdef,
        psn: 0x12_3456,
        probe_addr: 0x7f00_dead_beef_0000,
        probe_rkey: 0x0abc_0def,
        window: 1 << 20,
        link: 3,
        src_gid: [0x5a; 16],
        dst_gid: GID,
    }
}

fn encoded<const N: usize>(encode: impl FnOnce(&mut [u8; N])) -> Vec<u8> {
    let mut b = [0; N];
    encode(&mut b);
    b.to_vec()
}

fn link_seeds() -> Vec<Seed> {
    let max = LinkInfo {
        from: endpoint_max(),
        rc_qpn: U24_MAX,
        psn: U24_MAX,
        probe_addr: u64::MAX,
        probe_rkey: u32::MAX,
        window: u32::MAX,
        link: u16::MAX,
        src_gid: [0xff; 16],
        dst_gid: [0xff; 16],
    };
    vec![
        ("request", encoded::<LINK_LEN>(|b| LinkRequest { req_id: 7, info: info(endpoint()), optional: false }.encode(b))),
        ("request_optional_max", encoded::<LINK_LEN>(|b| LinkRequest { req_id: u32::MAX, info: max, optional: true }.encode(b))),
        ("reply", encoded::<LINK_LEN>(|b| LinkReply { req_id: 7, status: 0, info: info(endpoint()) }.encode(b))),
        ("reply_refused", encoded::<LINK_LEN>(|b| LinkReply { req_id: 8, status: EBUSY, info: info(endpoint()) }.encode(b))),
        ("ready", encoded::<LINK_LEN>(|b| LinkReady { req_id: 7, info: info(endpoint()) }.encode(b))),
    ]
}

fn node_seeds() -> Vec<Seed> {
    use krcore::node::proto::Message;
    let key = Key::Port { gid: GID, port: 18515 };
    let all = [
        ("hello", Message::Hello { pid: 4242 }),
        ("welcome", Message::Welcome { incarnation: u64::MAX, fingerprint: 0x0123_4567_89ab_cdef }),
        ("lookup_fresh", Message::Lookup { id: 7, key, fresh: true }),
        ("lookup_cached", Message::Lookup { id: u32::MAX, key: Key::Vqpn { gid: [0xff; 16], vqpn: u32::MAX }, fresh: false }),
        ("found", Message::Found { id: 7, result: Ok(Some(endpoint_max())) }),
        ("found_none", Message::Found { id: 8, result: Ok(None) }),
        ("found_error", Message::Found { id: 9, result: Err(EBUSY) }),
        ("stage", Message::Stage { len: 2 << 20 }),
        ("staged", Message::Staged { status: 0, len: 1 << 20 }),
        ("connect", Message::Connect { id: 10, key }),
        ("connected", Message::Connected { id: 10, result: Ok((1, endpoint_max())) }),
        ("connected_error", Message::Connected { id: 11, result: Err(EBUSY) }),
        ("ring", Message::Ring),
        ("close", Message::Close { handle: 1 }),
        ("present", Message::Present { incarnation: 0x0123_4567_89ab_cdef, gid: [7; 16] }),
    ];
    all.into_iter().map(|(n, m)| (n, m.encode().to_vec())).collect()
}

fn meta_seeds() -> Vec<Seed> {
    let port = Key::Port { gid: GID, port: 18515 };
    let vqpn = Key::Vqpn { gid: [0xff; 16], vqpn: u32::MAX };
    let welcome = Welcome {
        status: 0,
        gid: GID,
        qpn: 0x11,
        psn: 0x22_3344,
        table_addr: 0x5566_7788_99aa_bbcc,
        table_rkey: 0xdd,
        table_slots: 1 << 16,
        incarnation: 0x0123_4567_89ab_cdef,
        proof_qpn: 0x12_3456,
        token: 0x0a0b_0c0d,
        gid6: [0xfe; 16],
    };
    let request = |op, key| Request { op, req_id: 42, lease_ms: 1000, key, endpoint: endpoint(), secret: 0x5ec2_e7f0_0d15_ea5e };
    vec![
        ("hello", encoded::<BOOT_LEN>(|b| Hello { gid: GID, qpn: 0x12_3456, psn: U24_MAX, incarnation: 0x0123_4567_89ab_cdef }.encode(b))),
        ("welcome", encoded::<BOOT_LEN>(|b| welcome.encode(b))),
        ("welcome_refused", encoded::<BOOT_LEN>(|b| Welcome { status: ENOSPC, ..welcome }.encode(b))),
        ("query_port", encoded::<BOOT_LEN>(|b| Query { key: port }.encode(b))),
        ("query_vqpn", encoded::<BOOT_LEN>(|b| Query { key: vqpn }.encode(b))),
        ("answer_found", encoded::<BOOT_LEN>(|b| Answer { endpoint: Some(endpoint_max()) }.encode(b))),
        ("answer_none", encoded::<BOOT_LEN>(|b| Answer { endpoint: None }.encode(b))),
        ("presence_query", encoded::<BOOT_LEN>(|b| PresenceQuery { incarnation: 0x0123_4567_89ab_cdef, gid: GID }.encode(b))),
        ("presence_answer", encoded::<BOOT_LEN>(|b| PresenceAnswer { presence: Presence::Departed }.encode(b))),
        ("request_bind", encoded::<META_LEN>(|b| request(Op::Bind, port).encode(b))),
        ("request_unbind", encoded::<META_LEN>(|b| request(Op::Unbind, vqpn).encode(b))),
        ("request_renew", encoded::<META_LEN>(|b| request(Op::Renew, port).encode(b))),
        ("request_renew_all", encoded::<META_LEN>(|b| request(Op::RenewAll, vqpn).encode(b))),
        ("request_vouch", encoded::<META_LEN>(|b| request(Op::Vouch, port).encode(b))),
        ("request_departed", encoded::<META_LEN>(|b| request(Op::Departed, port).encode(b))),
        ("request_released", encoded::<META_LEN>(|b| request(Op::Released, port).encode(b))),
        ("response", encoded::<META_LEN>(|b| Response { req_id: 42, status: EADDRINUSE, held: 3 }.encode(b))),
        ("proof", encoded::<PROOF_LEN>(|b| Proof { conn_qpn: 0x12_3456, token: 0x0a0b_0c0d }.encode(b))),
    ]
}

/// Registered memory is page-aligned; a table needs 8-byte alignment.
fn aligned(words: &mut [u64]) -> &mut [u8] {
    // SAFETY: the u64s' memory viewed as bytes, borrowed as long as they are.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 8) }
}

fn table_seeds() -> Vec<Seed> {
    let mut out = Vec::new();
    let full = 8 * EndpointSchema::SLOT_SIZE;

    // The meta server's table: two entries; keys found, one absent, and a
    // short READ (not Absent but Torn: a slot is missing).
    let nslots = 16;
    let mut words = vec![0u64; Table::<EndpointSchema>::bytes_for(nslots).div_ceil(8)];
    let mut t = Table::<EndpointSchema>::init(aligned(&mut words), nslots, 0x1234).unwrap();
    let bound = Key::Port { gid: GID, port: 18515 };
    let other = Key::Vqpn { gid: GID, vqpn: 0x1000 };
    t.insert(bound, endpoint()).unwrap();
    t.insert(other, endpoint_max()).unwrap();
    let key_bytes = |key: &Key| {
        let mut b = [0; table_input::ENDPOINT_KEY_LEN];
        EndpointSchema::encode_key(key, &mut b);
        b
    };
    let absent = Key::Port { gid: [0xff; 16], port: 1 };
    out.push(("endpoint_found", table_input::build(&t, bound, &key_bytes(&bound), full)));
    out.push(("endpoint_found_vqpn", table_input::build(&t, other, &key_bytes(&other), full)));
    out.push(("endpoint_absent", table_input::build(&t, absent, &key_bytes(&absent), full)));
    out.push(("endpoint_short_read", table_input::build(&t, absent, &key_bytes(&absent), full / 2)));

    out
}

fn header_seeds() -> Vec<Seed> {
    let h = |flags, src_vqpn, dst, imm, len, rkey, addr| Header { flags, src_vqpn, dst, imm, len, rkey, addr };
    let header = |h: Header, payload: &[u8]| {
        let mut b = [0; HEADER_LEN];
        h.encode(&mut b);
        [&b[..], payload].concat()
    };
    let imm = u32::from_be(0x1122_3344);
    let mr = MrInfo { addr: 0x7f00_0000_1000, len: 1 << 20, access: 0xf };
    vec![
        ("data", header(h(Flags::empty(), 1, 2, 0, 5, 0, 0), b"hello")),
        ("data_empty", header(h(Flags::empty(), 1, 2, 0, 0, 0, 0), b"")),
        ("data_imm_port", header(h(Flags::HAS_IMM | Flags::TO_PORT | Flags::SOLICITED, 3, 18515, imm, 4, 0, 0), b"abcd")),
        ("write_imm", header(h(Flags::WRITE_IMM | Flags::HAS_IMM, 7, 9, imm, 4096, 0, 0), b"")),
        ("large", header(h(Flags::LARGE | Flags::HAS_IMM, 7, 9, imm, 1 << 20, 0x1314_1516, 0x7f00_0000_2000), b"")),
        ("done", header(h(Flags::DONE, 9, 7, 0, 1 << 20, 0x1314_1516, 0x7f00_0000_2000), b"")),
        ("done_failed", header(h(Flags::DONE | Flags::TO_PORT, 9, 7, 5, 1 << 20, 0x1314_1516, 0x7f00_0000_2000), b"")),
        ("close", header(h(Flags::CLOSE, 3, 4, 0, 0, 0, 0), b"")),
        ("link_close", header(Header::link(LinkOp::Close, 0, 0, 0), b"")),
        ("mr_check", header(Header::link(LinkOp::MrCheck, 0x0abc_0def, 0x7f00_0000_1000, 7), b"")),
        ("mr_found", header(Header::link(LinkOp::MrAnswer, 0x0abc_0def, 0x7f00_0000_1000, 7), &MrAnswer::Found(mr).encode())),
        ("mr_absent", header(Header::link(LinkOp::MrAnswer, u32::MAX, u64::MAX, u32::MAX), &MrAnswer::Absent.encode())),
        ("mr_busy", header(Header::link(LinkOp::MrAnswer, 5, 0, 0), &MrAnswer::Busy { retry_ms: 63 }.encode())),
        ("grant", header(Header::grant(1 << 19), b"")),
    ]
}

fn wrid_seeds() -> Vec<Seed> {
    let send = |slot, generation, seq, retired, forced| WrId::Send(SendId::new(slot, generation, seq, retired, forced).unwrap());
    [
        ("send", send(5, 1, 100, 1, false)),
        ("send_forced_max", send(krcore::vqp::wrid::MAX_SLOTS - 1, u8::MAX, u16::MAX, u16::MAX, true)),
        ("recv", WrId::Recv { buf: 17 }),
        ("control", WrId::Control { tag: 0x1234_5678 }),
    ]
    .into_iter()
    .map(|(name, w)| (name, w.encode().to_le_bytes().to_vec()))
    .collect()
}

fn dgram_seeds() -> Vec<Seed> {
    let route =
        Route { src_incarnation: 0x0102_0304_0506_0708, dst_incarnation: 0x1112_1314_1516_1718, src_vqpn: 0x2122_2324, dst_vqpn: 7 };
    let data = |opcode, imm, total_len, seg, nsegs, payload| {
        Message::Data(Data { route, seq: 9, nonce: 0x5555_6666, ack_req: true, msg: 3, total_len, seg, nsegs, opcode, imm, payload })
    };
    let ack = Message::Ack(Ack { route: route.reverse(), next: 10, nonce: 0x5555_6666, sack: 0b101, rnr: false });
    let mut close_acks = ack.to_vec();
    close_acks.extend(Message::Ack(Ack { route: route.reverse(), next: 0, nonce: 0, sack: 0, rnr: false }).to_vec());
    let request = |op, length, offset, compare_add, swap, resp_seg, payload| {
        let mut r = wire::Request::new(route, 11, 0xfeed, op, 0xabcd, 0x7f00_0000_1000, length);
        r = wire::Request { offset, compare_add, swap, resp_seg, payload, ..r };
        Message::Request(r)
    };
    let response = |status, op, length, offset, value, payload| {
        Message::Response(wire::Response { route: route.reverse(), seq: 11, nonce: 0xfeed, status, op, length, offset, value, payload })
    };
    let big = [0x5a; wire::MIN_MTU - wire::MAX_HDR];
    [
        ("data", data(SendOp::Send, 0, 100, 1, 4, &b"segment"[..])),
        ("data_imm", data(SendOp::SendImm, 0xdead_beef, 3, 0, 1, &b"abc"[..])),
        ("data_close", data(SendOp::Close, 0, close_acks.len() as u32, 0, 1, &close_acks[..])),
        ("ack", ack),
        ("ack_rnr", Message::Ack(Ack { route: route.reverse(), next: 10, nonce: 0x5555_6666, sack: 0x7777_8888, rnr: true })),
        ("request_read", request(OneSided::Read, 4096, 0, 0, 0, 900, &[][..])),
        ("request_write", request(OneSided::Write, 200, 16, 0, 0, 0, &big[..])),
        ("request_cmp_swp", request(OneSided::CmpSwp, wire::ATOMIC_LEN, 0, 0x1111, 0x2222, 0, &[][..])),
        ("request_fetch_add", request(OneSided::FetchAdd, wire::ATOMIC_LEN, 0, 0x3333, 0, 0, &[][..])),
        ("response_read", response(Status::Ok, OneSided::Read, 4096, 8, 0, &b"data"[..])),
        ("response_atomic", response(Status::Ok, OneSided::FetchAdd, 0, 0, 0x0123_4567_89ab_cdef, &[][..])),
        ("response_refused", response(Status::RemoteAccess, OneSided::Write, 0, 0, 0, &[][..])),
    ]
    .into_iter()
    .map(|(name, m)| (name, m.to_vec()))
    .collect()
}
