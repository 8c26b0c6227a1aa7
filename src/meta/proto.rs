//! Wire formats of the control protocols: fixed-size little-endian messages.
//!
//! Three channels, one message family each; every message of a family has
//! the family's length, so receivers post fixed buffers and a message of the
//! wrong length is malformed:
//!
//! | family | channel | messages | length |
//! | --- | --- | --- | --- |
//! | boot | TCP, process <-> `krcore-meta` | [`Hello`] (client), [`Welcome`] (server); [`Query`] (client), [`Answer`] (server); [`PresenceQuery`] (client), [`PresenceAnswer`] (server) | [`BOOT_LEN`] |
//! | meta | RC SEND, process <-> `krcore-meta` | [`Request`], [`Response`] | [`META_LEN`] |
//! | link | UD, service endpoint <-> service endpoint | [`LinkRequest`], [`LinkReply`], [`LinkReady`] | [`LINK_LEN`] |
//! | proof | UD, process -> `krcore-meta`'s proof QP | [`Proof`] | [`PROOF_LEN`] |
//!
//! Every message starts with magic [`MAGIC`] (u16), [`VERSION`] (u8) and a
//! kind byte that is unique across families, so a message that reaches the
//! wrong channel is refused too. A service endpoint receives both link
//! messages on one UD QP and dispatches with [`LinkMessage::decode`]. The
//! layout of each message is in its documentation (offset: field, u32
//! unless said otherwise); bytes not listed are reserved and zero. An
//! [`Endpoint`] takes 40 bytes: +0 gid[16], +16 qpn, +20 qkey,
//! +24 incarnation (u64), +32 vqpn.
//!
//! Decoding never panics and is strict: reserved bytes must be zero, enums
//! must be known, QPNs and PSNs must fit their 24 bits, statuses must be 0
//! or an errno. So every buffer that decodes re-encodes to itself. Errors:
//! EPROTO for another protocol version (checked before the length, so a
//! future version that grows a message is still told apart), EBADMSG for
//! anything else.

use super::{Endpoint, Key};
use crate::codec::{Reader, EBADMSG};
use crate::error::Result;

/// `b"MK"` read as a little-endian u16.
pub const MAGIC: u16 = 0x4b4d;
pub const VERSION: u8 = 5;

/// Length of [`Hello`] and [`Welcome`].
pub const BOOT_LEN: usize = 128;
/// Length of [`Request`] and [`Response`]: the server's receive buffers.
/// Two cache lines, with room for a larger key.
pub const META_LEN: usize = 128;
/// Length of [`LinkRequest`] and [`LinkReply`] (UD payload, GRH excluded).
pub const LINK_LEN: usize = 128;

/// The smallest IB path MTU: a link message fits in any UD datagram.
const UD_MIN_MTU: usize = 256;
const _: () = assert!(LINK_LEN <= UD_MIN_MTU);
/// Length of [`Proof`] (UD payload, GRH excluded).
pub const PROOF_LEN: usize = 32;

const KIND_HELLO: u8 = 1;
const KIND_WELCOME: u8 = 2;
const KIND_REQUEST: u8 = 3;
const KIND_RESPONSE: u8 = 4;
const KIND_LINK_REQUEST: u8 = 5;
const KIND_LINK_REPLY: u8 = 6;
const KIND_LINK_READY: u8 = 7;
const KIND_QUERY: u8 = 8;
const KIND_ANSWER: u8 = 9;
const KIND_PROOF: u8 = 10;
const KIND_PRESENCE_QUERY: u8 = 11;
const KIND_PRESENCE_ANSWER: u8 = 12;

const KEY_PORT: u8 = 1;
const KEY_VQPN: u8 = 2;

/// QPNs and PSNs are 24-bit quantities.
const U24_LIMIT: u32 = 1 << 24;

/// Client -> meta server over TCP: the client's RC QP that will talk to the
/// server, and the incarnation of the process's service endpoint (0: none),
/// whose presence the connection then vouches for ([`PresenceQuery`]).
///
/// 4: qpn, 8: psn, 16: gid[16], 32: incarnation (u64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub gid: [u8; 16],
    pub qpn: u32,
    pub psn: u32,
    pub incarnation: u64,
}

/// Meta server -> client over TCP: the server's RC QP, where its table
/// lives in its registered memory, its incarnation, and where to prove
/// the GIDs the client binds keys under ([`Proof`]).
///
/// 4: status, 8: qpn, 12: psn, 16: gid[16], 32: table_addr (u64),
/// 40: table_rkey, 44: table_slots, 48: incarnation (u64), 56: proof_qpn,
/// 60: token, 64: gid6[16].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Welcome {
    /// 0, or the errno that refused the client.
    pub status: u32,
    pub gid: [u8; 16],
    pub qpn: u32,
    pub psn: u32,
    pub table_addr: u64,
    pub table_rkey: u32,
    pub table_slots: u32,
    /// Changes when the server restarts: cached lookups are then stale.
    pub incarnation: u64,
    /// The server's UD QP that takes [`Proof`]s (qkey `rdma::QKEY`).
    pub proof_qpn: u32,
    /// What this connection's proofs carry: random, told to no one else.
    pub token: u32,
    /// The server's IPv6 GID, where proofs from the client's IPv6 GIDs go
    /// (`gid` is IPv4: the address it listens on); zero when it has none.
    pub gid6: [u8; 16],
}

/// Process -> meta server, a UD datagram to its proof QP sent from the GID
/// at which the process binds keys: the datagram's GRH names that GID, so
/// the server learns that this client's connection comes from it. A
/// `Bind` of a key under a GID its connection has not proven is answered
/// EAGAIN (the proof may still be on its way).
///
/// 4: conn_qpn (the server's QP of the client's connection, its
/// `Welcome`'s qpn), 8: token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Proof {
    pub conn_qpn: u32,
    pub token: u32,
}

/// Client -> meta server over TCP, before (or instead of) a [`Hello`]:
/// who is bound at `key`? A process whose RC connection to the server is
/// not up yet looks up with one TCP round trip, no QP on its path.
///
/// 4: key kind (u8: 1 port, 2 vqpn), 8: key gid[16], 24: key port or vqpn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Query {
    pub key: Key,
}

/// Meta server -> client over TCP: the [`Query`]'s answer, what a READ of
/// the table would find now.
///
/// 4: status (0 found, ENOENT: nothing bound), 8: endpoint (zero unless
/// found).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    pub endpoint: Option<Endpoint>,
}

/// Client -> meta server over TCP: is the process whose service endpoint
/// has `incarnation` and `gid` connected to you? A process that binds
/// nothing has no entry to look up; its connection (the kernel closes it
/// when the process dies) says whether it lives. Only connections that
/// proved `gid` count (as for a binding under it).
///
/// 8: incarnation (u64), 16: gid[16].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PresenceQuery {
    pub incarnation: u64,
    pub gid: [u8; 16],
}

/// Meta server -> client over TCP: the [`PresenceQuery`]'s answer.
///
/// 4: presence (u8: 1 connected, 2 departed, 3 unknown).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PresenceAnswer {
    pub presence: Presence,
}

/// What a meta server knows of a process by its connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Presence {
    /// A connection whose `Hello` named it is open.
    Connected = 1,
    /// Its connections closed (the process exited, or lost the server),
    /// and none is open.
    Departed = 2,
    /// Never connected here, or departed too long ago to be remembered.
    Unknown = 3,
}

/// What a [`Request`] asks of the meta server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Publish `key -> endpoint` with a lease.
    Bind = 1,
    /// Withdraw `key` (the endpoint must match the entry's).
    Unbind = 2,
    /// Extend the lease of `key`.
    Renew = 3,
    /// Extend the lease of every entry the sender holds (`key` and
    /// `endpoint` are ignored): one request per renewal period whatever
    /// the number of entries.
    RenewAll = 4,
    /// The sender (a host's agent) vouches for the process of incarnation
    /// `endpoint.incarnation` at GID `key`'s (one it proved): a presence
    /// query about it says connected while the sender's connection is
    /// open (`super::presence`); `key`'s port and the rest are ignored.
    Vouch = 5,
    /// The process the sender vouched for exited: departed, unless another
    /// connection vouches for it.
    Departed = 6,
    /// The sender vouches for that process no more, not knowing whether it
    /// lives (it lost sight of it): unknown, unless another vouches.
    Released = 7,
}

impl Op {
    const ALL: [Op; 7] = [Op::Bind, Op::Unbind, Op::Renew, Op::RenewAll, Op::Vouch, Op::Departed, Op::Released];
}

/// Process -> meta server, SENT on the process's RC QP.
///
/// 4: op (u8), 5: key kind (u8: 1 port, 2 vqpn), 8: req_id, 12: lease_ms,
/// 16: key gid[16], 32: key port or vqpn, 40: endpoint, 80: secret (u64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub op: Op,
    /// Echoed in the [`Response`].
    pub req_id: u32,
    pub lease_ms: u32,
    pub key: Key,
    pub endpoint: Endpoint,
    /// The binder's secret: a random number its process chose. Only a
    /// request that carries the secret a binding was made with may renew
    /// it, unbind it or bind its key again (from a new connection of the
    /// same process); an endpoint is public, so naming it proves nothing.
    pub secret: u64,
}

/// Meta server -> process, SENT on the same RC QP.
///
/// 4: req_id, 8: status, 12: held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Response {
    pub req_id: u32,
    /// 0, or an errno such as EADDRINUSE or ENOSPC.
    pub status: u32,
    /// The entries the sender holds on this server after the request:
    /// fewer than it registered tells it that some were lost (expired
    /// while it could not renew) and must be registered again.
    pub held: u32,
}

/// What each side of a link announces: the link request carries the
/// requester's, the reply the responder's. Each side then moves one warm QP
/// to RTR with the other's `rc_qpn` and `psn`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkInfo {
    /// The sender's service endpoint; its `incarnation` tells the receiver
    /// whether this is the process it knew at (GID, QPN).
    pub from: Endpoint,
    pub rc_qpn: u32,
    pub psn: u32,
    /// 8 bytes of the sender's that the receiver may READ over the link to
    /// see it alive (a liveness probe); they hold nothing.
    pub probe_addr: u64,
    pub probe_rkey: u32,
    /// The sender's receive window on the link: the bytes of messages
    /// (headers included) its peer may have sent it and not had granted
    /// back (`crate::service::credit`).
    pub window: u32,
    /// Which of the links per peer this is.
    pub link: u16,
    /// The link's two GIDs, as the sender sees them: its own end (its
    /// source GID) and the receiver's (the GID the message was sent to).
    /// The link runs between the GIDs its initiator's application chose,
    /// not only between the endpoints' home GIDs.
    pub src_gid: [u8; 16],
    pub dst_gid: [u8; 16],
}

/// Service endpoint -> service endpoint over UD: "connect one link".
///
/// 4: link (u16), 8: req_id, 12: status (in a request: flags, bit 0
/// [`LINK_OPTIONAL`]), 16: rc_qpn, 20: psn, 24: probe_addr (u64),
/// 32: probe_rkey, 36: window, 40: from (endpoint),
/// 80: src_gid[16], 96: dst_gid[16].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkRequest {
    pub req_id: u32,
    pub info: LinkInfo,
    /// The requester can go on without the link (its VQPs stay on the
    /// datagram tier): a responder at its link limit refuses it.
    pub optional: bool,
}

/// A link request's flag: [`LinkRequest::optional`].
const LINK_OPTIONAL: u32 = 1;

/// The answer to a [`LinkRequest`], same layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkReply {
    /// The request's.
    pub req_id: u32,
    /// 0, or the errno that refused the link (`info` is then the
    /// responder's endpoint and otherwise meaningless).
    pub status: u32,
    pub info: LinkInfo,
}

/// The requester's end of the link of request `req_id` is in RTS (and so
/// receives): the responder may use it. Same layout as the request, whose
/// `info` it repeats; status 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkReady {
    pub req_id: u32,
    pub info: LinkInfo,
}

/// A link message, as received on a service endpoint's UD QP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkMessage {
    Request(LinkRequest),
    Reply(LinkReply),
    Ready(LinkReady),
}

impl Hello {
    pub fn encode(&self, out: &mut [u8; BOOT_LEN]) {
        let mut w = Writer::new(out, KIND_HELLO);
        w.u24(self.qpn);
        w.u24(self.psn);
        w.skip(4);
        w.bytes(&self.gid);
        w.u64(self.incarnation);
    }

    pub fn decode(buf: &[u8]) -> Result<Hello> {
        let (mut r, _) = open(buf, BOOT_LEN, &[KIND_HELLO])?;
        let qpn = r.u24()?;
        let psn = r.u24()?;
        r.reserved(4)?;
        let gid = r.bytes()?;
        let incarnation = r.u64()?;
        r.finish_zeroed()?;
        Ok(Hello { gid, qpn, psn, incarnation })
    }
}

impl Welcome {
    /// A `Welcome` that refuses the client with `status`: nothing else set.
    pub fn refusal(status: u32) -> Welcome {
        Welcome {
            status,
            gid: [0; 16],
            qpn: 0,
            psn: 0,
            table_addr: 0,
            table_rkey: 0,
            table_slots: 0,
            incarnation: 0,
            proof_qpn: 0,
            token: 0,
            gid6: [0; 16],
        }
    }

    pub fn encode(&self, out: &mut [u8; BOOT_LEN]) {
        let mut w = Writer::new(out, KIND_WELCOME);
        w.status(self.status);
        w.u24(self.qpn);
        w.u24(self.psn);
        w.bytes(&self.gid);
        w.u64(self.table_addr);
        w.u32(self.table_rkey);
        w.u32(self.table_slots);
        w.u64(self.incarnation);
        w.u24(self.proof_qpn);
        w.u32(self.token);
        w.bytes(&self.gid6);
    }

    pub fn decode(buf: &[u8]) -> Result<Welcome> {
        let (mut r, _) = open(buf, BOOT_LEN, &[KIND_WELCOME])?;
        let welcome = Welcome {
            status: r.status()?,
            qpn: r.u24()?,
            psn: r.u24()?,
            gid: r.bytes()?,
            table_addr: r.u64()?,
            table_rkey: r.u32()?,
            table_slots: r.u32()?,
            incarnation: r.u64()?,
            proof_qpn: r.u24()?,
            token: r.u32()?,
            gid6: r.bytes()?,
        };
        r.finish_zeroed()?;
        Ok(welcome)
    }
}

impl Proof {
    pub fn encode(&self, out: &mut [u8; PROOF_LEN]) {
        let mut w = Writer::new(out, KIND_PROOF);
        w.u24(self.conn_qpn);
        w.u32(self.token);
    }

    pub fn decode(buf: &[u8]) -> Result<Proof> {
        let (mut r, _) = open(buf, PROOF_LEN, &[KIND_PROOF])?;
        let proof = Proof { conn_qpn: r.u24()?, token: r.u32()? };
        r.finish_zeroed()?;
        Ok(proof)
    }
}

/// The first boot message of a connection, as the server reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BootMessage {
    Hello(Hello),
    Query(Query),
    Presence(PresenceQuery),
}

impl BootMessage {
    pub fn decode(buf: &[u8]) -> Result<BootMessage> {
        let (_, kind) = open(buf, BOOT_LEN, &[KIND_HELLO, KIND_QUERY, KIND_PRESENCE_QUERY])?;
        match kind {
            KIND_HELLO => Hello::decode(buf).map(BootMessage::Hello),
            KIND_QUERY => Query::decode(buf).map(BootMessage::Query),
            _ => PresenceQuery::decode(buf).map(BootMessage::Presence),
        }
    }
}

impl PresenceQuery {
    pub fn encode(&self, out: &mut [u8; BOOT_LEN]) {
        let mut w = Writer::new(out, KIND_PRESENCE_QUERY);
        w.skip(4);
        w.u64(self.incarnation);
        w.bytes(&self.gid);
    }

    pub fn decode(buf: &[u8]) -> Result<PresenceQuery> {
        let (mut r, _) = open(buf, BOOT_LEN, &[KIND_PRESENCE_QUERY])?;
        r.reserved(4)?;
        let incarnation = r.u64()?;
        let gid = r.bytes()?;
        r.finish_zeroed()?;
        Ok(PresenceQuery { incarnation, gid })
    }
}

impl PresenceAnswer {
    pub fn encode(&self, out: &mut [u8; BOOT_LEN]) {
        let mut w = Writer::new(out, KIND_PRESENCE_ANSWER);
        w.u8(self.presence as u8);
    }

    pub fn decode(buf: &[u8]) -> Result<PresenceAnswer> {
        let (mut r, _) = open(buf, BOOT_LEN, &[KIND_PRESENCE_ANSWER])?;
        let presence = match r.u8()? {
            1 => Presence::Connected,
            2 => Presence::Departed,
            3 => Presence::Unknown,
            _ => return Err(EBADMSG),
        };
        r.finish_zeroed()?;
        Ok(PresenceAnswer { presence })
    }
}

impl Query {
    pub fn encode(&self, out: &mut [u8; BOOT_LEN]) {
        let (key_kind, gid, value) = split_key(&self.key);
        let mut w = Writer::new(out, KIND_QUERY);
        w.u8(key_kind);
        w.skip(3);
        w.bytes(&gid);
        w.u32(value);
    }

    pub fn decode(buf: &[u8]) -> Result<Query> {
        let (mut r, _) = open(buf, BOOT_LEN, &[KIND_QUERY])?;
        let key_kind = r.u8()?;
        r.reserved(3)?;
        let gid = r.bytes()?;
        let value = r.u32()?;
        let key = join_key(key_kind, gid, value)?;
        r.finish_zeroed()?;
        Ok(Query { key })
    }
}

impl Answer {
    pub fn encode(&self, out: &mut [u8; BOOT_LEN]) {
        let mut w = Writer::new(out, KIND_ANSWER);
        match &self.endpoint {
            Some(e) => {
                w.status(0);
                w.endpoint(e);
            }
            None => w.status(libc::ENOENT as u32),
        }
    }

    pub fn decode(buf: &[u8]) -> Result<Answer> {
        let (mut r, _) = open(buf, BOOT_LEN, &[KIND_ANSWER])?;
        let endpoint = match r.status()? {
            0 => Some(r.endpoint()?),
            s if s == libc::ENOENT as u32 => None,
            _ => return Err(EBADMSG),
        };
        r.finish_zeroed()?;
        Ok(Answer { endpoint })
    }
}

/// A key's kind byte, GID and number, as the messages carry them.
fn split_key(key: &Key) -> (u8, [u8; 16], u32) {
    match *key {
        Key::Port { gid, port } => (KEY_PORT, gid, port),
        Key::Vqpn { gid, vqpn } => (KEY_VQPN, gid, vqpn),
    }
}

fn join_key(kind: u8, gid: [u8; 16], value: u32) -> Result<Key> {
    match kind {
        KEY_PORT => Ok(Key::Port { gid, port: value }),
        KEY_VQPN => Ok(Key::Vqpn { gid, vqpn: value }),
        _ => Err(EBADMSG),
    }
}

impl Request {
    pub fn encode(&self, out: &mut [u8; META_LEN]) {
        let (key_kind, gid, value) = split_key(&self.key);
        let mut w = Writer::new(out, KIND_REQUEST);
        w.u8(self.op as u8);
        w.u8(key_kind);
        w.skip(2);
        w.u32(self.req_id);
        w.u32(self.lease_ms);
        w.bytes(&gid);
        w.u32(value);
        w.skip(4);
        w.endpoint(&self.endpoint);
        w.u64(self.secret);
    }

    pub fn decode(buf: &[u8]) -> Result<Request> {
        let (mut r, _) = open(buf, META_LEN, &[KIND_REQUEST])?;
        let op = r.u8()?;
        let op = Op::ALL.into_iter().find(|&o| o as u8 == op).ok_or(EBADMSG)?;
        let key_kind = r.u8()?;
        r.reserved(2)?;
        let req_id = r.u32()?;
        let lease_ms = r.u32()?;
        let gid = r.bytes()?;
        let value = r.u32()?;
        let key = join_key(key_kind, gid, value)?;
        r.reserved(4)?;
        let endpoint = r.endpoint()?;
        let secret = r.u64()?;
        r.finish_zeroed()?;
        Ok(Request { op, req_id, lease_ms, key, endpoint, secret })
    }
}

impl Response {
    pub fn encode(&self, out: &mut [u8; META_LEN]) {
        let mut w = Writer::new(out, KIND_RESPONSE);
        w.u32(self.req_id);
        w.status(self.status);
        w.u32(self.held);
    }

    pub fn decode(buf: &[u8]) -> Result<Response> {
        let (mut r, _) = open(buf, META_LEN, &[KIND_RESPONSE])?;
        let response = Response { req_id: r.u32()?, status: r.status()?, held: r.u32()? };
        r.finish_zeroed()?;
        Ok(response)
    }
}

impl LinkRequest {
    pub fn encode(&self, out: &mut [u8; LINK_LEN]) {
        let flags = if self.optional { LINK_OPTIONAL } else { 0 };
        encode_link(out, KIND_LINK_REQUEST, self.req_id, flags, &self.info);
    }
}

impl LinkReply {
    pub fn encode(&self, out: &mut [u8; LINK_LEN]) {
        encode_link(out, KIND_LINK_REPLY, self.req_id, self.status, &self.info);
    }
}

impl LinkReady {
    pub fn encode(&self, out: &mut [u8; LINK_LEN]) {
        encode_link(out, KIND_LINK_READY, self.req_id, 0, &self.info);
    }
}

impl LinkMessage {
    pub fn decode(buf: &[u8]) -> Result<LinkMessage> {
        let (mut r, kind) = open(buf, LINK_LEN, &[KIND_LINK_REQUEST, KIND_LINK_REPLY, KIND_LINK_READY])?;
        let link = r.u16()?;
        r.reserved(2)?;
        let req_id = r.u32()?;
        let status = if kind == KIND_LINK_REQUEST { r.u32()? } else { r.status()? };
        let info = LinkInfo {
            link,
            rc_qpn: r.u24()?,
            psn: r.u24()?,
            probe_addr: r.u64()?,
            probe_rkey: r.u32()?,
            window: r.u32()?,
            from: r.endpoint()?,
            src_gid: r.bytes()?,
            dst_gid: r.bytes()?,
        };
        r.finish_zeroed()?;
        match kind {
            KIND_LINK_REQUEST if status & !LINK_OPTIONAL == 0 => {
                Ok(LinkMessage::Request(LinkRequest { req_id, info, optional: status == LINK_OPTIONAL }))
            }
            KIND_LINK_REPLY => Ok(LinkMessage::Reply(LinkReply { req_id, status, info })),
            KIND_LINK_READY if status == 0 => Ok(LinkMessage::Ready(LinkReady { req_id, info })),
            _ => Err(EBADMSG),
        }
    }
}

/// The one layout of both link messages.
fn encode_link(out: &mut [u8; LINK_LEN], kind: u8, req_id: u32, status: u32, info: &LinkInfo) {
    let mut w = Writer::new(out, kind);
    w.u16(info.link);
    w.skip(2);
    w.u32(req_id);
    w.status(status);
    w.u24(info.rc_qpn);
    w.u24(info.psn);
    w.u64(info.probe_addr);
    w.u32(info.probe_rkey);
    w.u32(info.window);
    w.endpoint(&info.from);
    w.bytes(&info.src_gid);
    w.bytes(&info.dst_gid);
}

/// Fills a message front to back over a zeroed buffer. The layouts are
/// constant and shorter than their buffers (tests encode each one), so
/// writes stay in bounds; the values are the library's own, so range
/// violations are bugs caught by debug assertions.
struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl<'a> Writer<'a> {
    /// Zeroes `buf` (reserved bytes and the tail) and writes the prefix.
    fn new(buf: &'a mut [u8], kind: u8) -> Writer<'a> {
        buf.fill(0);
        let mut w = Writer { buf, pos: 0 };
        w.u16(MAGIC);
        w.u8(VERSION);
        w.u8(kind);
        w
    }

    fn bytes(&mut self, b: &[u8]) {
        self.buf[self.pos..self.pos + b.len()].copy_from_slice(b);
        self.pos += b.len();
    }

    fn skip(&mut self, n: usize) {
        self.pos += n;
    }

    fn u8(&mut self, v: u8) {
        self.bytes(&[v]);
    }

    fn u16(&mut self, v: u16) {
        self.bytes(&v.to_le_bytes());
    }

    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }

    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }

    fn u24(&mut self, v: u32) {
        debug_assert!(v < U24_LIMIT, "QPN or PSN {v:#x}");
        self.u32(v);
    }

    fn status(&mut self, v: u32) {
        debug_assert!(i32::try_from(v).is_ok(), "status {v}");
        self.u32(v);
    }

    fn endpoint(&mut self, e: &Endpoint) {
        self.bytes(&e.gid);
        self.u24(e.qpn);
        self.u32(e.qkey);
        self.u64(e.incarnation);
        self.u32(e.vqpn);
        self.skip(4);
    }
}

/// Checks a message's prefix (magic, then version, then a kind among
/// `kinds`), then that `buf` is exactly `len` bytes; a reader past the
/// prefix, and the kind.
fn open<'a>(buf: &'a [u8], len: usize, kinds: &[u8]) -> Result<(Reader<'a>, u8)> {
    let mut r = Reader::new(buf);
    let kind = r.prefix(MAGIC, VERSION)?;
    if !kinds.contains(&kind) || buf.len() != len {
        return Err(EBADMSG);
    }
    Ok((r, kind))
}

/// The field types of these protocols.
trait Fields {
    fn u24(&mut self) -> Result<u32>;
    fn status(&mut self) -> Result<u32>;
    fn endpoint(&mut self) -> Result<Endpoint>;
}

impl Fields for Reader<'_> {
    fn u24(&mut self) -> Result<u32> {
        let v = self.u32()?;
        if v < U24_LIMIT {
            Ok(v)
        } else {
            Err(EBADMSG)
        }
    }

    fn status(&mut self) -> Result<u32> {
        let v = self.u32()?;
        if i32::try_from(v).is_ok() {
            Ok(v)
        } else {
            Err(EBADMSG)
        }
    }

    fn endpoint(&mut self) -> Result<Endpoint> {
        let e = Endpoint { gid: self.bytes()?, qpn: self.u24()?, qkey: self.u32()?, incarnation: self.u64()?, vqpn: self.u32()? };
        self.reserved(4)?;
        Ok(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::EPROTO;
    use crate::testing::Rng;

    const GID: [u8; 16] = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0x11, 0x22, 0xff, 0xfe, 0x33, 0x44, 0x55];
    const MAX_U24: u32 = U24_LIMIT - 1;
    const ERRNO_MAX: u32 = i32::MAX as u32;

    fn endpoint(fill: u8) -> Endpoint {
        Endpoint { gid: [fill; 16], qpn: 0x12_3456, qkey: 0x1111_1111, incarnation: 0x0102_0304_0506_0708, vqpn: 0x2233_4455 }
    }

    fn endpoint_max() -> Endpoint {
        Endpoint { gid: [0xff; 16], qpn: MAX_U24, qkey: u32::MAX, incarnation: u64::MAX, vqpn: u32::MAX }
    }

    fn endpoint_zero() -> Endpoint {
        Endpoint { gid: [0; 16], qpn: 0, qkey: 0, incarnation: 0, vqpn: 0 }
    }

    fn info(from: Endpoint) -> LinkInfo {
        LinkInfo {
            from,
            rc_qpn: 0x00ab_cdef,
            psn: 0x0012_3456,
            probe_addr: 0x7f00_dead_beef_0000,
            probe_rkey: 0x0abc_0def,
            window: 0x0010_2030,
            link: 3,
            src_gid: [0x5a; 16],
            dst_gid: GID,
        }
    }

    fn info_max() -> LinkInfo {
        LinkInfo {
            from: endpoint_max(),
            rc_qpn: MAX_U24,
            psn: MAX_U24,
            probe_addr: u64::MAX,
            probe_rkey: u32::MAX,
            window: u32::MAX,
            link: u16::MAX,
            src_gid: [0xff; 16],
            dst_gid: [0xff; 16],
        }
    }

    fn info_zero() -> LinkInfo {
        LinkInfo {
            from: endpoint_zero(),
            rc_qpn: 0,
            psn: 0,
            probe_addr: 0,
            probe_rkey: 0,
            window: 0,
            link: 0,
            src_gid: [0; 16],
            dst_gid: [0; 16],
        }
    }

    fn welcome() -> Welcome {
        Welcome {
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
            gid6: [0x6a; 16],
        }
    }

    fn proof(p: &Proof) -> Vec<u8> {
        let mut b = [0xee; PROOF_LEN];
        p.encode(&mut b);
        b.to_vec()
    }

    fn request(op: Op, key: Key) -> Request {
        Request { op, req_id: 42, lease_ms: 1000, key, endpoint: endpoint(0x66), secret: 0x5ec2_e7f0_0d15_ea5e }
    }

    fn boot<M>(encode: impl Fn(&M, &mut [u8; BOOT_LEN]), m: &M) -> Vec<u8> {
        let mut b = [0xee; BOOT_LEN];
        encode(m, &mut b);
        b.to_vec()
    }

    fn meta<M>(encode: impl Fn(&M, &mut [u8; META_LEN]), m: &M) -> Vec<u8> {
        let mut b = [0xee; META_LEN];
        encode(m, &mut b);
        b.to_vec()
    }

    fn link(m: &LinkMessage) -> Vec<u8> {
        let mut b = [0xee; LINK_LEN];
        match m {
            LinkMessage::Request(r) => r.encode(&mut b),
            LinkMessage::Reply(r) => r.encode(&mut b),
            LinkMessage::Ready(r) => r.encode(&mut b),
        }
        b.to_vec()
    }

    /// A buffer of `len` zeros with `parts` written at their offsets.
    fn image(len: usize, parts: &[(usize, &[u8])]) -> Vec<u8> {
        let mut b = vec![0; len];
        for (at, bytes) in parts {
            b[*at..*at + bytes.len()].copy_from_slice(bytes);
        }
        b
    }

    #[test]
    fn layouts_are_exact() {
        let hello = Hello { gid: GID, qpn: 0x12_3456, psn: 0xab_cdef, incarnation: 0x0102_0304_0506_0708 };
        assert_eq!(
            boot(Hello::encode, &hello),
            image(
                BOOT_LEN,
                &[
                    (0, &[0x4d, 0x4b, VERSION, 1]),
                    (4, &[0x56, 0x34, 0x12, 0]),
                    (8, &[0xef, 0xcd, 0xab, 0]),
                    (16, &GID),
                    (32, &[8, 7, 6, 5, 4, 3, 2, 1])
                ]
            )
        );
        let pq = PresenceQuery { incarnation: 0x0102_0304_0506_0708, gid: GID };
        assert_eq!(
            boot(PresenceQuery::encode, &pq),
            image(BOOT_LEN, &[(0, &[0x4d, 0x4b, VERSION, 11]), (8, &[8, 7, 6, 5, 4, 3, 2, 1]), (16, &GID)])
        );
        let pa = PresenceAnswer { presence: Presence::Departed };
        assert_eq!(boot(PresenceAnswer::encode, &pa), image(BOOT_LEN, &[(0, &[0x4d, 0x4b, VERSION, 12]), (4, &[2])]));
        let w = Welcome { status: libc::EAGAIN as u32, ..welcome() };
        assert_eq!(
            boot(Welcome::encode, &w),
            image(
                BOOT_LEN,
                &[
                    (0, &[0x4d, 0x4b, VERSION, 2]),
                    (4, &(libc::EAGAIN as u32).to_le_bytes()),
                    (8, &[0x11, 0, 0, 0]),
                    (12, &[0x44, 0x33, 0x22, 0]),
                    (16, &GID),
                    (32, &[0xcc, 0xbb, 0xaa, 0x99, 0x88, 0x77, 0x66, 0x55]),
                    (40, &[0xdd, 0, 0, 0]),
                    (44, &[0, 0, 1, 0]),
                    (48, &[0xef, 0xcd, 0xab, 0x89, 0x67, 0x45, 0x23, 0x01]),
                    (56, &[0x56, 0x34, 0x12, 0]),
                    (60, &[0x0d, 0x0c, 0x0b, 0x0a]),
                    (64, &[0x6a; 16]),
                ]
            )
        );
        let p = Proof { conn_qpn: 0xab_cdef, token: 0x0102_0304 };
        assert_eq!(proof(&p), image(PROOF_LEN, &[(0, &[0x4d, 0x4b, VERSION, 10]), (4, &[0xef, 0xcd, 0xab, 0]), (8, &[4, 3, 2, 1])]));
        let ep: &[u8] = &[
            0x56, 0x34, 0x12, 0, // qpn
            0x11, 0x11, 0x11, 0x11, // qkey
            8, 7, 6, 5, 4, 3, 2, 1, // incarnation
            0x55, 0x44, 0x33, 0x22, // vqpn
        ];
        let r = request(Op::Renew, Key::Vqpn { gid: GID, vqpn: 0x0a0b_0c0d });
        assert_eq!(
            meta(Request::encode, &r),
            image(
                META_LEN,
                &[
                    (0, &[0x4d, 0x4b, VERSION, 3]),
                    (4, &[3, 2]),
                    (8, &[42, 0, 0, 0]),
                    (12, &[0xe8, 0x03, 0, 0]),
                    (16, &GID),
                    (32, &[0x0d, 0x0c, 0x0b, 0x0a]),
                    (40, &[0x66; 16]),
                    (56, ep),
                    (80, &[0x5e, 0xea, 0x15, 0x0d, 0xf0, 0xe7, 0xc2, 0x5e]),
                ]
            )
        );
        let resp = Response { req_id: 0x0102_0304, status: libc::ENOSPC as u32, held: 0x0a0b_0c0d };
        assert_eq!(
            meta(Response::encode, &resp),
            image(
                META_LEN,
                &[
                    (0, &[0x4d, 0x4b, VERSION, 4]),
                    (4, &[4, 3, 2, 1]),
                    (8, &(libc::ENOSPC as u32).to_le_bytes()),
                    (12, &[0x0d, 0x0c, 0x0b, 0x0a]),
                ]
            )
        );
        let reply = LinkMessage::Reply(LinkReply { req_id: 0x0102_0304, status: libc::EBUSY as u32, info: info(endpoint(0x77)) });
        assert_eq!(
            link(&reply),
            image(
                LINK_LEN,
                &[
                    (0, &[0x4d, 0x4b, VERSION, 6]),
                    (4, &[3, 0]),
                    (8, &[4, 3, 2, 1]),
                    (12, &(libc::EBUSY as u32).to_le_bytes()),
                    (16, &[0xef, 0xcd, 0xab, 0]),
                    (20, &[0x56, 0x34, 0x12, 0]),
                    (24, &[0, 0, 0xef, 0xbe, 0xad, 0xde, 0, 0x7f]),
                    (32, &[0xef, 0x0d, 0xbc, 0x0a]),
                    (36, &[0x30, 0x20, 0x10, 0]),
                    (40, &[0x77; 16]),
                    (56, ep),
                    (80, &[0x5a; 16]),
                    (96, &GID),
                ]
            )
        );
        // A request is the same layout with its own kind and status 0.
        let LinkMessage::Reply(LinkReply { req_id, info, .. }) = reply else { unreachable!() };
        let mut as_request = link(&reply);
        as_request[3] = 5;
        as_request[12..16].fill(0);
        assert_eq!(link(&LinkMessage::Request(LinkRequest { req_id, info, optional: false })), as_request);
        // An optional one: flag bit 0 in the status word.
        as_request[12] = 1;
        assert_eq!(link(&LinkMessage::Request(LinkRequest { req_id, info, optional: true })), as_request);
        assert_eq!(LinkMessage::decode(&as_request), Ok(LinkMessage::Request(LinkRequest { req_id, info, optional: true })));
        // LINK_READY: the request's layout, its own kind, status 0 only.
        let mut as_ready = as_request.clone();
        as_ready[3] = 7;
        as_ready[12] = 0;
        assert_eq!(link(&LinkMessage::Ready(LinkReady { req_id, info })), as_ready);
        assert_eq!(LinkMessage::decode(&as_ready), Ok(LinkMessage::Ready(LinkReady { req_id, info })));
        as_ready[12] = 1;
        assert_eq!(LinkMessage::decode(&as_ready), Err(EBADMSG));
    }

    #[test]
    fn query_and_answer_layouts_are_exact() {
        let q = Query { key: Key::Vqpn { gid: GID, vqpn: 0x0a0b_0c0d } };
        assert_eq!(
            boot(Query::encode, &q),
            image(BOOT_LEN, &[(0, &[0x4d, 0x4b, VERSION, 8]), (4, &[2]), (8, &GID), (24, &[0x0d, 0x0c, 0x0b, 0x0a])])
        );
        let a = Answer { endpoint: Some(endpoint(0x66)) };
        let ep: &[u8] = &[0x56, 0x34, 0x12, 0, 0x11, 0x11, 0x11, 0x11, 8, 7, 6, 5, 4, 3, 2, 1, 0x55, 0x44, 0x33, 0x22];
        assert_eq!(boot(Answer::encode, &a), image(BOOT_LEN, &[(0, &[0x4d, 0x4b, VERSION, 9]), (8, &[0x66; 16]), (24, ep)]));
        let none = Answer { endpoint: None };
        assert_eq!(
            boot(Answer::encode, &none),
            image(BOOT_LEN, &[(0, &[0x4d, 0x4b, VERSION, 9]), (4, &(libc::ENOENT as u32).to_le_bytes())])
        );
        // Any other status is not an answer.
        let mut b = boot(Answer::encode, &none);
        b[4] = libc::EIO as u8;
        assert_eq!(Answer::decode(&b), Err(EBADMSG));
    }

    /// Decodes and re-encodes: `Ok(b)` iff `b` is a valid message.
    type Recode = fn(&[u8]) -> Result<Vec<u8>>;

    fn re_hello(b: &[u8]) -> Result<Vec<u8>> {
        Hello::decode(b).map(|m| boot(Hello::encode, &m))
    }

    fn re_welcome(b: &[u8]) -> Result<Vec<u8>> {
        Welcome::decode(b).map(|m| boot(Welcome::encode, &m))
    }

    fn re_request(b: &[u8]) -> Result<Vec<u8>> {
        Request::decode(b).map(|m| meta(Request::encode, &m))
    }

    fn re_response(b: &[u8]) -> Result<Vec<u8>> {
        Response::decode(b).map(|m| meta(Response::encode, &m))
    }

    fn re_link(b: &[u8]) -> Result<Vec<u8>> {
        LinkMessage::decode(b).map(|m| link(&m))
    }

    fn re_query(b: &[u8]) -> Result<Vec<u8>> {
        Query::decode(b).map(|m| boot(Query::encode, &m))
    }

    fn re_answer(b: &[u8]) -> Result<Vec<u8>> {
        Answer::decode(b).map(|m| boot(Answer::encode, &m))
    }

    fn re_presence_query(b: &[u8]) -> Result<Vec<u8>> {
        PresenceQuery::decode(b).map(|m| boot(PresenceQuery::encode, &m))
    }

    fn re_presence_answer(b: &[u8]) -> Result<Vec<u8>> {
        PresenceAnswer::decode(b).map(|m| boot(PresenceAnswer::encode, &m))
    }

    fn re_proof(b: &[u8]) -> Result<Vec<u8>> {
        Proof::decode(b).map(|m| proof(&m))
    }

    /// Every message at its field boundaries (zero, max, both key kinds,
    /// every op, every status extreme), with its decoder.
    fn all_messages() -> Vec<(Vec<u8>, Recode)> {
        let mut all: Vec<(Vec<u8>, Recode)> = Vec::new();
        for (gid, qpn, psn) in [([0; 16], 0, 0), ([0xff; 16], MAX_U24, MAX_U24), (GID, 1, 2)] {
            all.push((boot(Hello::encode, &Hello { gid, qpn, psn, incarnation: u64::from(qpn) << 40 | 1 }), re_hello));
        }
        let welcomes = [
            welcome(),
            Welcome {
                status: ERRNO_MAX,
                gid: [0xff; 16],
                qpn: MAX_U24,
                psn: MAX_U24,
                table_addr: u64::MAX,
                table_rkey: u32::MAX,
                table_slots: u32::MAX,
                incarnation: u64::MAX,
                proof_qpn: MAX_U24,
                token: u32::MAX,
                gid6: [0xff; 16],
            },
            Welcome::refusal(0),
        ];
        for w in welcomes {
            all.push((boot(Welcome::encode, &w), re_welcome));
        }
        for op in Op::ALL {
            for key in [
                Key::Port { gid: GID, port: 0 },
                Key::Port { gid: [0xff; 16], port: u32::MAX },
                Key::Vqpn { gid: [0; 16], vqpn: 0 },
                Key::Vqpn { gid: GID, vqpn: u32::MAX },
            ] {
                for (lease_ms, endpoint) in [(0, endpoint_zero()), (u32::MAX, endpoint_max())] {
                    let r = Request { lease_ms, endpoint, req_id: lease_ms, ..request(op, key) };
                    all.push((meta(Request::encode, &r), re_request));
                }
            }
        }
        for (req_id, status, held) in [(0, 0, 0), (u32::MAX, ERRNO_MAX, u32::MAX), (7, libc::EADDRINUSE as u32, 3)] {
            all.push((meta(Response::encode, &Response { req_id, status, held }), re_response));
        }
        for key in [Key::Port { gid: [0; 16], port: 0 }, Key::Vqpn { gid: [0xff; 16], vqpn: u32::MAX }] {
            all.push((boot(Query::encode, &Query { key }), re_query));
        }
        for endpoint in [None, Some(endpoint_zero()), Some(endpoint_max())] {
            all.push((boot(Answer::encode, &Answer { endpoint }), re_answer));
        }
        for i in [info_zero(), info_max(), info(endpoint(1))] {
            for req_id in [0, u32::MAX] {
                all.push((link(&LinkMessage::Request(LinkRequest { req_id, info: i, optional: req_id % 2 == 1 })), re_link));
                all.push((link(&LinkMessage::Ready(LinkReady { req_id, info: i })), re_link));
                for status in [0, 1, ERRNO_MAX] {
                    let reply = LinkReply { req_id, status, info: i };
                    all.push((link(&LinkMessage::Reply(reply)), re_link));
                }
            }
        }
        for (conn_qpn, token) in [(0, 0), (MAX_U24, u32::MAX), (7, 0x5eed)] {
            all.push((proof(&Proof { conn_qpn, token }), re_proof));
        }
        for (incarnation, gid) in [(0, [0; 16]), (u64::MAX, [0xff; 16])] {
            all.push((boot(PresenceQuery::encode, &PresenceQuery { incarnation, gid }), re_presence_query));
        }
        for presence in [Presence::Connected, Presence::Departed, Presence::Unknown] {
            all.push((boot(PresenceAnswer::encode, &PresenceAnswer { presence }), re_presence_answer));
        }
        all
    }

    #[test]
    fn round_trips_every_message_at_its_boundaries() {
        let all = all_messages();
        assert_eq!(all.len(), 3 + 3 + 7 * 4 * 2 + 3 + 2 + 3 + 3 * 2 * 5 + 3 + 2 + 3);
        for (bytes, re) in &all {
            assert_eq!(re(bytes).as_ref(), Ok(bytes));
        }
        // And typed: decode gives back the very values.
        let r = request(Op::Unbind, Key::Port { gid: GID, port: 18515 });
        assert_eq!(Request::decode(&meta(Request::encode, &r)), Ok(r));
        let w = welcome();
        assert_eq!(Welcome::decode(&boot(Welcome::encode, &w)), Ok(w));
        let m = LinkMessage::Request(LinkRequest { req_id: 9, info: info_max(), optional: true });
        assert_eq!(LinkMessage::decode(&link(&m)), Ok(m));
        let q = Query { key: Key::Port { gid: GID, port: 18515 } };
        assert_eq!(BootMessage::decode(&boot(Query::encode, &q)), Ok(BootMessage::Query(q)));
        let p = PresenceQuery { incarnation: 9, gid: GID };
        assert_eq!(BootMessage::decode(&boot(PresenceQuery::encode, &p)), Ok(BootMessage::Presence(p)));
        let h = Hello { gid: GID, qpn: 1, psn: 2, incarnation: 3 };
        assert_eq!(BootMessage::decode(&boot(Hello::encode, &h)), Ok(BootMessage::Hello(h)));
        assert_eq!(BootMessage::decode(&boot(Welcome::encode, &w)), Err(EBADMSG));
        let a = Answer { endpoint: Some(endpoint(3)) };
        assert_eq!(Answer::decode(&boot(Answer::encode, &a)), Ok(a));
    }

    #[test]
    fn rejects_wrong_length() {
        for (bytes, re) in all_messages() {
            for n in 0..bytes.len() {
                assert_eq!(re(&bytes[..n]), Err(EBADMSG), "{n} bytes");
            }
            let mut longer = bytes.clone();
            longer.push(0);
            assert_eq!(re(&longer), Err(EBADMSG));
        }
    }

    #[test]
    fn rejects_wrong_magic_version_and_kind() {
        for (bytes, re) in all_messages() {
            let with = |i: usize, v: u8| {
                let mut b = bytes.clone();
                b[i] = v;
                re(&b)
            };
            assert_eq!(with(0, 0x4c), Err(EBADMSG));
            assert_eq!(with(1, 0x52), Err(EBADMSG));
            // The version is judged before the length and the kind.
            for v in [0, VERSION + 1, 0xff] {
                assert_eq!(with(2, v), Err(EPROTO));
                let mut b = bytes.clone();
                b[2] = v;
                b[3] = 0xff;
                assert_eq!(re(&b[..4]), Err(EPROTO));
            }
            let kind = bytes[3];
            for k in (0..=u8::MAX).filter(|&k| k != kind) {
                // The link kinds share a decoder: a request read as a reply
                // (and back) is still a valid message, and so is any of
                // them with status 0 read as a ready.
                let link = |k: u8| (5..=7).contains(&k);
                let same_family =
                    matches!((kind, k), (5, 6) | (6, 5)) || (link(kind) && link(k) && (kind == 7 || k == 7) && bytes[12..16] == [0; 4]);
                if !same_family {
                    assert_eq!(with(3, k), Err(EBADMSG), "kind {kind} as {k}");
                }
            }
        }
    }

    #[test]
    fn rejects_out_of_range_fields() {
        let set = |mut b: Vec<u8>, at: usize, v: &[u8]| {
            b[at..at + v.len()].copy_from_slice(v);
            b
        };
        let too_big = U24_LIMIT.to_le_bytes();
        let not_errno = (ERRNO_MAX + 1).to_le_bytes();
        let hello = boot(Hello::encode, &Hello { gid: GID, qpn: 1, psn: 1, incarnation: 1 });
        for at in [4, 8] {
            assert_eq!(Hello::decode(&set(hello.clone(), at, &too_big)), Err(EBADMSG));
        }
        let w = boot(Welcome::encode, &welcome());
        for at in [8, 12, 56] {
            assert_eq!(Welcome::decode(&set(w.clone(), at, &too_big)), Err(EBADMSG));
        }
        assert_eq!(Proof::decode(&set(proof(&Proof { conn_qpn: 1, token: 2 }), 4, &too_big)), Err(EBADMSG));
        assert_eq!(Welcome::decode(&set(w, 4, &not_errno)), Err(EBADMSG));

        let r = meta(Request::encode, &request(Op::Bind, Key::Port { gid: GID, port: 1 }));
        for op in [0, 8, 0xff] {
            assert_eq!(Request::decode(&set(r.clone(), 4, &[op])), Err(EBADMSG));
        }
        for key_kind in [0, 3, 0xff] {
            assert_eq!(Request::decode(&set(r.clone(), 5, &[key_kind])), Err(EBADMSG));
        }
        assert_eq!(Request::decode(&set(r, 56, &too_big)), Err(EBADMSG));
        let resp = meta(Response::encode, &Response { req_id: 1, status: 0, held: 0 });
        assert_eq!(Response::decode(&set(resp, 8, &not_errno)), Err(EBADMSG));

        let req = link(&LinkMessage::Request(LinkRequest { req_id: 1, info: info(endpoint(1)), optional: false }));
        // A request's status word holds its one flag; a reply's is an errno.
        assert_eq!(LinkMessage::decode(&set(req.clone(), 12, &[2, 0, 0, 0])), Err(EBADMSG));
        assert_eq!(LinkMessage::decode(&set(req.clone(), 12, &[0, 0, 0, 0x80])), Err(EBADMSG));
        let reply = set(req.clone(), 3, &[KIND_LINK_REPLY]);
        assert!(LinkMessage::decode(&reply).is_ok());
        assert_eq!(LinkMessage::decode(&set(reply, 12, &not_errno)), Err(EBADMSG));
        for at in [16, 20, 56] {
            assert_eq!(LinkMessage::decode(&set(req.clone(), at, &too_big)), Err(EBADMSG));
        }
    }

    /// Flipping any bit of any message gives either an error or another
    /// valid message that encodes to exactly the flipped bytes; flips in
    /// reserved bytes are always errors.
    #[test]
    fn every_bit_flip_is_refused_or_canonical() {
        // (kind, [start, end) of each reserved run)
        let reserved: [(u8, &[(usize, usize)]); 12] = [
            (KIND_PRESENCE_QUERY, &[(4, 8), (32, BOOT_LEN)]),
            (KIND_PRESENCE_ANSWER, &[(5, BOOT_LEN)]),
            (KIND_QUERY, &[(5, 8), (28, BOOT_LEN)]),
            // Found: the endpoint's reserved word; absent: all of it.
            (KIND_ANSWER, &[(52, BOOT_LEN)]),
            (KIND_HELLO, &[(12, 16), (40, BOOT_LEN)]),
            (KIND_WELCOME, &[(80, BOOT_LEN)]),
            (KIND_PROOF, &[(12, PROOF_LEN)]),
            (KIND_REQUEST, &[(6, 8), (36, 40), (76, 80), (88, META_LEN)]),
            (KIND_RESPONSE, &[(16, META_LEN)]),
            // Byte 12 of a request holds its flag (bit 0).
            (KIND_LINK_REQUEST, &[(6, 8), (13, 16), (76, 80), (112, LINK_LEN)]),
            (KIND_LINK_REPLY, &[(6, 8), (76, 80), (112, LINK_LEN)]),
            // A ready's status word is 0.
            (KIND_LINK_READY, &[(6, 8), (12, 16), (76, 80), (112, LINK_LEN)]),
        ];
        let mut refused = 0;
        for (bytes, re) in all_messages() {
            let (_, ranges) = reserved.iter().find(|(k, _)| *k == bytes[3]).unwrap();
            for i in 0..bytes.len() {
                for bit in 0..8 {
                    let mut b = bytes.clone();
                    b[i] ^= 1 << bit;
                    match re(&b) {
                        Ok(again) => {
                            assert_eq!(again, b);
                            assert!(!ranges.iter().any(|&(s, e)| (s..e).contains(&i)), "byte {i}");
                        }
                        Err(_) => refused += 1,
                    }
                }
            }
        }
        assert!(refused > 10_000, "{refused}");
    }

    /// Random bytes of random lengths, often behind a valid prefix and
    /// mostly zero so that some decode: no decoder panics, and whatever
    /// decodes re-encodes to the input.
    #[test]
    fn random_garbage_never_panics() {
        let decoders: [Recode; 10] =
            [re_hello, re_welcome, re_request, re_response, re_link, re_query, re_answer, re_proof, re_presence_query, re_presence_answer];
        let mut rng = Rng(0xd1b5_4a32_d192_ed03);
        let mut decoded = 0;
        for _ in 0..20_000 {
            let r = rng.next();
            let len = match r % 5 {
                0 => (r >> 8) as usize % 300,
                1 => BOOT_LEN,
                2 => PROOF_LEN,
                _ => META_LEN,
            };
            let density = 1 + (r >> 20) % 64;
            let mut b: Vec<u8> = (0..len)
                .map(|_| {
                    let x = rng.next();
                    if x % density == 0 {
                        (x >> 32) as u8
                    } else {
                        0
                    }
                })
                .collect();
            if r & (1 << 40) != 0 && len >= 4 {
                b[..4].copy_from_slice(&[0x4d, 0x4b, VERSION, 1 + (r >> 41) as u8 % 12]);
            }
            for decode in decoders {
                if let Ok(again) = decode(&b) {
                    assert_eq!(again, b);
                    decoded += 1;
                }
            }
        }
        assert!(decoded > 100, "{decoded}");
    }
}
