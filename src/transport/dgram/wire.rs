//! Wire format of the datagram tier: what a VQP without a link sends on
//! its service endpoint's UD QP, and what comes back.
//!
//! One family of variable-length little-endian messages, each a common
//! 48-byte head then a kind-specific part then (DATA, REQUEST, RESPONSE) a
//! payload whose length the message states. Offsets (u32 unless said
//! otherwise); bytes not listed are reserved and zero:
//!
//! | at | head field |
//! | --- | --- |
//! | 0 | magic [`MAGIC`] (u16), 2: [`VERSION`] (u8), 3: kind (u8), 4: flags (u8: [`ACK_REQ`] on DATA and REQUEST, [`RNR`] on ACK) |
//! | 8 | src incarnation (u64): the sending endpoint's |
//! | 16 | dst incarnation (u64): the endpoint the sender believes it addresses |
//! | 24 | src vqpn, 28: dst vqpn |
//! | 32 | seq (u64): DATA/REQUEST the packet's; ACK the next one expected; RESPONSE the request's |
//! | 40 | nonce (u64): DATA/REQUEST the packet's (random); ACK the nonce of packet seq - 1 (0 when seq is 0); RESPONSE the request's |
//!
//! | kind | part (from 48) | head + part |
//! | --- | --- | --- |
//! | 1 DATA | 48: msg, 52: total_len, 56: seg, 60: nsegs, 64: opcode (u8: 1 SEND, 2 SEND_WITH_IMM, 3 CLOSE: empty), 68: imm, 72: payload_len | [`DATA_HDR`] = 80 |
//! | 2 ACK | 48: sack (u64): bit i = packet seq + 1 + i arrived; with [`RNR`], the nonce of packet seq | [`ACK_LEN`] = 56 |
//! | 3 REQUEST | 48: op (u8: 1 READ, 2 WRITE, 3 CMP_SWP, 4 FETCH_ADD), 52: rkey, 56: remote_addr (u64), 64: length, 68: offset (WRITE), 72: compare_add (u64), 80: swap (u64), 88: payload_len (WRITE), 92: resp_seg (READ) | [`REQUEST_HDR`] = 96 |
//! | 4 RESPONSE | 48: status (u8), 49: op (u8), 56: length (READ), 60: offset (READ), 64: value (u64, atomics), 72: payload_len (READ) | [`RESPONSE_HDR`] = 80 |
//!
//! The magic differs from the link messages' (`src/meta/proto.rs`), so the
//! service endpoint tells the two families apart on one UD QP by the
//! first two bytes ([`is_dgram`]).
//!
//! Decoding never panics and is strict, as `proto.rs`: reserved bytes and
//! flags must be zero, enums known, fields that a kind does not use zero,
//! lengths consistent (a segment within its message, a WRITE segment
//! within its request, atomics 8 bytes, the buffer exactly head + part +
//! payload). So every buffer that decodes re-encodes to itself. Errors:
//! EPROTO for another version, EBADMSG for anything else.

use crate::codec::{Reader, EBADMSG};
use crate::error::Result;

/// `b"KD"` read as a little-endian u16.
pub const MAGIC: u16 = 0x444b;
pub const VERSION: u8 = 2;

/// The head every message starts with.
pub const HEAD_LEN: usize = 48;
pub const DATA_HDR: usize = 80;
pub const ACK_LEN: usize = 56;
/// A CLOSE's payload: the closing VQP's final ACKs of the flows to it
/// (whole ACK messages), at most this many (they fit the smallest MTU).
pub const MAX_CLOSE_ACKS: usize = (MIN_MTU - DATA_HDR) / ACK_LEN;
pub const REQUEST_HDR: usize = 96;
pub const RESPONSE_HDR: usize = 80;
/// The largest header: a payload of `mtu - MAX_HDR` bytes fits any kind.
pub const MAX_HDR: usize = REQUEST_HDR;
/// The smallest IB path MTU; the tier refuses smaller ones.
pub const MIN_MTU: usize = 256;
/// The largest (4096): no datagram is longer.
pub const MAX_MTU: usize = 4096;

/// DATA and REQUEST flag: the sender wants an ACK now (the last packet it
/// has to send, or a retransmission).
pub const ACK_REQ: u8 = 1;

/// ACK flag: the receiver cannot take packet `seq` now (what the flow's
/// source may make it hold is spent: receiver not ready, as RC's RNR
/// NAK). The sender waits and sends it again, without counting a retry.
pub const RNR: u8 = 2;

const KIND_DATA: u8 = 1;
const KIND_ACK: u8 = 2;
const KIND_REQUEST: u8 = 3;
const KIND_RESPONSE: u8 = 4;

/// Sets or clears [`ACK_REQ`] in an encoded DATA or REQUEST (a
/// retransmission asks for an ACK, the first send may not).
pub fn set_ack_req(buf: &mut [u8], on: bool) {
    debug_assert!(matches!(buf.get(3), Some(&KIND_DATA) | Some(&KIND_REQUEST)));
    if let Some(flags) = buf.get_mut(FLAGS_AT) {
        *flags = if on { ACK_REQ } else { 0 };
    }
}

const FLAGS_AT: usize = 4;

/// Whether a UD payload belongs to this family (its magic), before any
/// decoding.
pub fn is_dgram(buf: &[u8]) -> bool {
    buf.first_chunk::<2>().is_some_and(|m| u16::from_le_bytes(*m) == MAGIC)
}

/// Who sends to whom: a flow is (src incarnation, src vqpn) -> (dst
/// incarnation, dst vqpn), and a reply swaps the two ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Route {
    pub src_incarnation: u64,
    pub dst_incarnation: u64,
    pub src_vqpn: u32,
    pub dst_vqpn: u32,
}

impl Route {
    /// The route of a reply to a message that came on `self`.
    pub fn reverse(&self) -> Route {
        Route {
            src_incarnation: self.dst_incarnation,
            dst_incarnation: self.src_incarnation,
            src_vqpn: self.dst_vqpn,
            dst_vqpn: self.src_vqpn,
        }
    }
}

/// A two-sided message's opcode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum SendOp {
    Send = 1,
    /// `imm` is delivered with the message.
    SendImm = 2,
    /// No payload: the sending VQP was destroyed (what a link's CLOSE
    /// header says), so that a bound VQP reports its sender closed.
    Close = 3,
}

/// One segment of a two-sided message: segments of a message are
/// consecutive packets of its flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Data<'a> {
    pub route: Route,
    pub seq: u64,
    pub nonce: u64,
    pub ack_req: bool,
    /// The message's number in its flow.
    pub msg: u32,
    pub total_len: u32,
    /// This segment's index (< `nsegs`).
    pub seg: u32,
    pub nsegs: u32,
    pub opcode: SendOp,
    /// 0 unless `opcode` is [`SendOp::SendImm`].
    pub imm: u32,
    pub payload: &'a [u8],
}

/// The receiver's acknowledgement: every packet below `next` arrived, and
/// the packets `sack` marks after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ack {
    pub route: Route,
    pub next: u64,
    /// The nonce of packet `next - 1` (0 when `next` is 0): only who saw
    /// that packet can acknowledge it.
    pub nonce: u64,
    /// Which packets after `next` arrived; with `rnr`, the nonce of packet
    /// `next` (only who saw it can refuse it).
    pub sack: u64,
    /// Packet `next` is refused for now ([`RNR`]).
    pub rnr: bool,
}

/// A one-sided operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum OneSided {
    Read = 1,
    Write = 2,
    CmpSwp = 3,
    FetchAdd = 4,
}

impl OneSided {
    pub const ALL: [OneSided; 4] = [OneSided::Read, OneSided::Write, OneSided::CmpSwp, OneSided::FetchAdd];

    pub fn is_atomic(self) -> bool {
        matches!(self, OneSided::CmpSwp | OneSided::FetchAdd)
    }
}

/// The length of an atomic operand.
pub const ATOMIC_LEN: u32 = 8;

/// One packet of a one-sided request. A WRITE longer than a packet is one
/// packet per segment, each naming the whole request (`remote_addr`,
/// `length`) and its own `offset`; the others are one packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request<'a> {
    pub route: Route,
    pub seq: u64,
    pub nonce: u64,
    pub ack_req: bool,
    pub op: OneSided,
    pub rkey: u32,
    pub remote_addr: u64,
    /// The whole request's bytes ([`ATOMIC_LEN`] for atomics).
    pub length: u32,
    /// WRITE: where `payload` goes in the request; else 0.
    pub offset: u32,
    /// CMP_SWP: the compare value; FETCH_ADD: the addend; else 0.
    pub compare_add: u64,
    /// CMP_SWP: the swap value; else 0.
    pub swap: u64,
    /// READ: the payload of each response segment (> 0); else 0.
    pub resp_seg: u32,
    /// WRITE: this segment's bytes; else empty.
    pub payload: &'a [u8],
}

impl Request<'_> {
    /// A request packet without operands, WRITE payload or READ segment
    /// size (set those with struct update syntax), not asking for an ACK.
    pub fn new(route: Route, seq: u64, nonce: u64, op: OneSided, rkey: u32, remote_addr: u64, length: u32) -> Request<'static> {
        Request {
            route,
            seq,
            nonce,
            ack_req: false,
            op,
            rkey,
            remote_addr,
            length,
            offset: 0,
            compare_add: 0,
            swap: 0,
            resp_seg: 0,
            payload: &[],
        }
    }

    /// The packet that ends its request (and gets a response when all is
    /// well): every packet but a WRITE's non-final segments.
    pub fn is_last(&self) -> bool {
        self.op != OneSided::Write || u64::from(self.offset) + self.payload.len() as u64 == u64::from(self.length)
    }
}

/// How the target answered a request; each maps to the work completion
/// status RC gives the requester.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    Ok = 0,
    /// Unknown rkey, out of range or access not granted:
    /// `IBV_WC_REM_ACCESS_ERR`.
    RemoteAccess = 1,
    /// A malformed request (a misaligned atomic, a READ segment the
    /// target cannot send): `IBV_WC_REM_INV_REQ_ERR`.
    InvalidRequest = 2,
    /// The target could not perform a valid request:
    /// `IBV_WC_REM_OP_ERR`.
    RemoteOp = 3,
}

impl Status {
    const ALL: [Status; 4] = [Status::Ok, Status::RemoteAccess, Status::InvalidRequest, Status::RemoteOp];

    /// The `ibv_wc_status` RC reports for this answer.
    pub fn wc_status(self) -> u32 {
        use crate::sys::ibv_wc_status as S;
        match self {
            Status::Ok => S::IBV_WC_SUCCESS,
            Status::RemoteAccess => S::IBV_WC_REM_ACCESS_ERR,
            Status::InvalidRequest => S::IBV_WC_REM_INV_REQ_ERR,
            Status::RemoteOp => S::IBV_WC_REM_OP_ERR,
        }
    }
}

/// The target's answer to the request packet `seq`/`nonce`: a status, an
/// atomic's original value, or one segment of a READ's data. A failed
/// request's answer carries the status alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Response<'a> {
    pub route: Route,
    pub seq: u64,
    pub nonce: u64,
    pub status: Status,
    pub op: OneSided,
    /// READ: the request's length; else 0.
    pub length: u32,
    /// READ: where `payload` goes; else 0.
    pub offset: u32,
    /// Atomics: the value before the operation; else 0.
    pub value: u64,
    pub payload: &'a [u8],
}

/// Any message of the family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Message<'a> {
    Data(Data<'a>),
    Ack(Ack),
    Request(Request<'a>),
    Response(Response<'a>),
}

impl Message<'_> {
    pub fn route(&self) -> &Route {
        match self {
            Message::Data(m) => &m.route,
            Message::Ack(m) => &m.route,
            Message::Request(m) => &m.route,
            Message::Response(m) => &m.route,
        }
    }

    /// A flow packet's sequence number and nonce (DATA and REQUEST; the
    /// answers are not a flow's packets).
    pub fn seq_nonce(&self) -> Option<(u64, u64)> {
        match self {
            Message::Data(m) => Some((m.seq, m.nonce)),
            Message::Request(m) => Some((m.seq, m.nonce)),
            Message::Ack(_) | Message::Response(_) => None,
        }
    }

    /// Appends the encoded message to `out` (cleared first). The values
    /// are the library's own: an inconsistent one is a bug, caught by
    /// debug assertions (and by [`Message::decode`] at the receiver).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.clear();
        match self {
            Message::Data(d) => {
                head(out, KIND_DATA, d.ack_req, &d.route, d.seq, d.nonce);
                debug_assert!(d.seg < d.nsegs && d.payload.len() <= d.total_len as usize);
                debug_assert!(d.opcode == SendOp::SendImm || d.imm == 0);
                put32(out, d.msg);
                put32(out, d.total_len);
                put32(out, d.seg);
                put32(out, d.nsegs);
                out.extend_from_slice(&[d.opcode as u8, 0, 0, 0]);
                put32(out, d.imm);
                put32(out, len32(d.payload));
                put32(out, 0);
                out.extend_from_slice(d.payload);
            }
            Message::Ack(a) => {
                debug_assert!(a.next > 0 || a.nonce == 0);
                head(out, KIND_ACK, false, &a.route, a.next, a.nonce);
                if a.rnr {
                    out[FLAGS_AT] = RNR;
                }
                put64(out, a.sack);
            }
            Message::Request(r) => {
                head(out, KIND_REQUEST, r.ack_req, &r.route, r.seq, r.nonce);
                out.extend_from_slice(&[r.op as u8, 0, 0, 0]);
                put32(out, r.rkey);
                put64(out, r.remote_addr);
                put32(out, r.length);
                put32(out, r.offset);
                put64(out, r.compare_add);
                put64(out, r.swap);
                put32(out, len32(r.payload));
                put32(out, r.resp_seg);
                out.extend_from_slice(r.payload);
            }
            Message::Response(r) => {
                head(out, KIND_RESPONSE, false, &r.route, r.seq, r.nonce);
                out.extend_from_slice(&[r.status as u8, r.op as u8, 0, 0, 0, 0, 0, 0]);
                put32(out, r.length);
                put32(out, r.offset);
                put64(out, r.value);
                put32(out, len32(r.payload));
                put32(out, 0);
                out.extend_from_slice(r.payload);
            }
        }
    }

    /// The encoded message in a new buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(MAX_MTU);
        self.encode(&mut out);
        out
    }

    /// Decodes one datagram (GRH excluded); the payload borrows `buf`.
    pub fn decode(buf: &[u8]) -> Result<Message<'_>> {
        let mut r = Reader::new(buf);
        let kind = r.prefix(MAGIC, VERSION)?;
        let flags = r.u8()?;
        r.reserved(3)?;
        let route = Route { src_incarnation: r.u64()?, dst_incarnation: r.u64()?, src_vqpn: r.u32()?, dst_vqpn: r.u32()? };
        let seq = r.u64()?;
        let nonce = r.u64()?;
        let (ack_req, rnr) = match (kind, flags) {
            (_, 0) => (false, false),
            (KIND_DATA | KIND_REQUEST, ACK_REQ) => (true, false),
            (KIND_ACK, RNR) => (false, true),
            _ => return Err(EBADMSG),
        };
        let m = match kind {
            KIND_DATA => Message::Data(decode_data(&mut r, route, seq, nonce, ack_req)?),
            KIND_ACK => {
                let sack = r.u64()?;
                if seq == 0 && nonce != 0 {
                    return Err(EBADMSG);
                }
                Message::Ack(Ack { route, next: seq, nonce, sack, rnr })
            }
            KIND_REQUEST => Message::Request(decode_request(&mut r, route, seq, nonce, ack_req)?),
            KIND_RESPONSE => Message::Response(decode_response(&mut r, route, seq, nonce)?),
            _ => return Err(EBADMSG),
        };
        r.finish_exact()?;
        Ok(m)
    }
}

fn decode_data<'a>(r: &mut Reader<'a>, route: Route, seq: u64, nonce: u64, ack_req: bool) -> Result<Data<'a>> {
    let (msg, total_len, seg, nsegs) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
    let opcode = match r.u8()? {
        1 => SendOp::Send,
        2 => SendOp::SendImm,
        3 => SendOp::Close,
        _ => return Err(EBADMSG),
    };
    r.reserved(3)?;
    let imm = r.u32()?;
    let payload_len = r.u32()?;
    r.reserved(4)?;
    let payload = r.take(payload_len as usize)?;
    if seg >= nsegs
        || payload_len > total_len
        || (opcode != SendOp::SendImm && imm != 0)
        || (opcode == SendOp::Close && (total_len as usize % ACK_LEN != 0 || total_len as usize > MAX_CLOSE_ACKS * ACK_LEN))
    {
        return Err(EBADMSG);
    }
    Ok(Data { route, seq, nonce, ack_req, msg, total_len, seg, nsegs, opcode, imm, payload })
}

fn decode_request<'a>(r: &mut Reader<'a>, route: Route, seq: u64, nonce: u64, ack_req: bool) -> Result<Request<'a>> {
    let op = op(r)?;
    r.reserved(3)?;
    let rkey = r.u32()?;
    let remote_addr = r.u64()?;
    let length = r.u32()?;
    let offset = r.u32()?;
    let compare_add = r.u64()?;
    let swap = r.u64()?;
    let payload_len = r.u32()?;
    let resp_seg = r.u32()?;
    let payload = r.take(payload_len as usize)?;
    let ok = match op {
        OneSided::Read => offset == 0 && compare_add == 0 && swap == 0 && payload_len == 0 && resp_seg > 0,
        OneSided::Write => {
            compare_add == 0 && swap == 0 && resp_seg == 0 && u64::from(offset) + u64::from(payload_len) <= u64::from(length)
        }
        OneSided::CmpSwp => length == ATOMIC_LEN && offset == 0 && payload_len == 0 && resp_seg == 0,
        OneSided::FetchAdd => length == ATOMIC_LEN && offset == 0 && swap == 0 && payload_len == 0 && resp_seg == 0,
    };
    if !ok {
        return Err(EBADMSG);
    }
    Ok(Request { route, seq, nonce, ack_req, op, rkey, remote_addr, length, offset, compare_add, swap, resp_seg, payload })
}

fn decode_response<'a>(r: &mut Reader<'a>, route: Route, seq: u64, nonce: u64) -> Result<Response<'a>> {
    let status = r.u8()?;
    let status = Status::ALL.into_iter().find(|s| *s as u8 == status).ok_or(EBADMSG)?;
    let op = op(r)?;
    r.reserved(6)?;
    let length = r.u32()?;
    let offset = r.u32()?;
    let value = r.u64()?;
    let payload_len = r.u32()?;
    r.reserved(4)?;
    let payload = r.take(payload_len as usize)?;
    let ok = match (status, op) {
        (Status::Ok, OneSided::Read) => u64::from(offset) + u64::from(payload_len) <= u64::from(length) && value == 0,
        (Status::Ok, OneSided::CmpSwp | OneSided::FetchAdd) => length == 0 && offset == 0 && payload_len == 0,
        _ => length == 0 && offset == 0 && payload_len == 0 && value == 0,
    };
    if !ok {
        return Err(EBADMSG);
    }
    Ok(Response { route, seq, nonce, status, op, length, offset, value, payload })
}

fn head(out: &mut Vec<u8>, kind: u8, ack_req: bool, route: &Route, seq: u64, nonce: u64) {
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&[VERSION, kind, if ack_req { ACK_REQ } else { 0 }, 0, 0, 0]);
    put64(out, route.src_incarnation);
    put64(out, route.dst_incarnation);
    put32(out, route.src_vqpn);
    put32(out, route.dst_vqpn);
    put64(out, seq);
    put64(out, nonce);
}

fn put32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Payloads are at most a datagram long.
fn len32(payload: &[u8]) -> u32 {
    debug_assert!(payload.len() <= MAX_MTU);
    payload.len() as u32
}

/// The opcode field of one-sided requests.
fn op(r: &mut Reader<'_>) -> Result<OneSided> {
    let op = r.u8()?;
    OneSided::ALL.into_iter().find(|o| *o as u8 == op).ok_or(EBADMSG)
}

#[cfg(test)]
#[path = "wire_tests.rs"]
mod tests;
