//! The messages between a process and its host's agent, one per
//! `SOCK_SEQPACKET` datagram, all [`LEN`] bytes, decoded with the
//! bounds-checked reader (`codec.rs`): the agent decodes whatever a local
//! process sends it, and a process whatever is listening at the socket's
//! path.
//!
//! Layout: 0 magic (u16 "KN"), 2 version (u8), 3 kind (u8), 4 request id
//! (u32, echoed in its answer), 8 status (u32: 0, else an errno), 12 flags
//! (u32), 16 body ([`BODY_LEN`] bytes; reserved bytes zero):
//! - `HELLO` (process): 16 pid (u32);
//! - `WELCOME` (agent): 16 the agent's incarnation (u64), 24 the
//!   fingerprint of the meta servers it serves (u64, [`super::meta_fingerprint`]);
//! - `LOOKUP` (process), flags [`FRESH`]: the body is a meta-server
//!   [`Query`] (its own prefix and key);
//! - `FOUND` (agent): status 0 and the body a meta-server [`Answer`]
//!   (found, or ENOENT: nothing bound), or the errno of a lookup that
//!   failed (ETIMEDOUT, ECONNREFUSED: no meta server reached) and a zero
//!   body;
//! - `STAGE` (process): 16 the length it wants (u64) of a staging region
//!   for its work through the agent; `STAGED` (agent): status 0 and 16 the
//!   region's length (u64), its memfd passed with it (`SCM_RIGHTS`: one of
//!   the agent's regions, registered before it was asked for), else an
//!   errno and no length;
//! - `CONNECT` (process): a `Query` body: connect a VQP of the agent's to
//!   that key; `CONNECTED` (agent): status 0, 12 the VQP's handle (u32, in
//!   the flags' place) and a meta-server `Answer` body (the endpoint the
//!   agent looked up, fresh), else an errno, no handle and a zero body;
//! - `RING` (either side), no body: look at the rings (`ring.rs`: the
//!   work requests and their completions are in the staging region's
//!   shared memory; this doorbell is rung only when the other side said it
//!   sleeps);
//! - `CLOSE` (process): 16 handle (u32): that VQP goes;
//! - `PRESENT` (process), no answer: 16 the incarnation of one of its
//!   service endpoints (u64), 24 that endpoint's GID: the agent vouches
//!   for it at the meta server while the process is attached
//!   (docs/node.md, "Presence of attached processes").

use crate::codec::{Reader, EBADMSG};
use crate::error::Result;
use crate::meta::proto::{Answer, Query, BOOT_LEN};
use crate::meta::{Endpoint, Key};

pub const MAGIC: u16 = 0x4e4b;
pub const VERSION: u8 = 5;
pub const BODY_LEN: usize = BOOT_LEN;
pub const LEN: usize = 16 + BODY_LEN;

const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const LOOKUP: u8 = 3;
const FOUND: u8 = 4;
const STAGE: u8 = 5;
const STAGED: u8 = 6;
const CONNECT: u8 = 7;
const CONNECTED: u8 = 8;
const CLOSE: u8 = 11;
const RING: u8 = 12;
const PRESENT: u8 = 13;

/// Opcodes a request of the rings carries (`ibv_wr_opcode`).
pub const OP_WRITE: u32 = 0;
pub const OP_READ: u32 = 4;
pub const OP_CMP_AND_SWP: u32 = 5;
pub const OP_FETCH_AND_ADD: u32 = 6;

/// `LOOKUP`: read the meta server's table now, whatever is cached (an
/// address may have been bound anew since).
pub const FRESH: u32 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Message {
    Hello {
        pid: u32,
    },
    Welcome {
        incarnation: u64,
        fingerprint: u64,
    },
    Lookup {
        id: u32,
        key: Key,
        fresh: bool,
    },
    /// `Err(errno)`: the lookup failed; `Ok(None)`: nothing bound there.
    Found {
        id: u32,
        result: std::result::Result<Option<Endpoint>, u32>,
    },
    Stage {
        len: u64,
    },
    Staged {
        status: u32,
        len: u64,
    },
    Connect {
        id: u32,
        key: Key,
    },
    /// `Err(errno)`: no VQP (the key unbound, the agent's own path down).
    Connected {
        id: u32,
        result: std::result::Result<(u32, Endpoint), u32>,
    },
    Ring,
    Close {
        handle: u32,
    },
    Present {
        incarnation: u64,
        gid: [u8; 16],
    },
}

/// One work request through the agent (an entry of the requests' ring):
/// its bytes at `offset` of the staging region (an atomic's result: 8
/// bytes there; `compare_add` and `swap` as in `ibv_send_wr.wr.atomic`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Post {
    pub token: u32,
    pub handle: u32,
    pub opcode: u32,
    pub len: u32,
    pub rkey: u32,
    pub offset: u64,
    pub remote: u64,
    pub compare_add: u64,
    pub swap: u64,
}

impl Message {
    pub fn encode(&self) -> [u8; LEN] {
        let mut out = [0u8; LEN];
        let (kind, id, status, flags) = match *self {
            Message::Hello { pid } => {
                out[16..20].copy_from_slice(&pid.to_le_bytes());
                (HELLO, 0, 0, 0)
            }
            Message::Welcome { incarnation, fingerprint } => {
                out[16..24].copy_from_slice(&incarnation.to_le_bytes());
                out[24..32].copy_from_slice(&fingerprint.to_le_bytes());
                (WELCOME, 0, 0, 0)
            }
            Message::Lookup { id, key, fresh } => {
                Query { key }.encode(body(&mut out));
                (LOOKUP, id, 0, if fresh { FRESH } else { 0 })
            }
            Message::Found { id, result } => match result {
                Ok(endpoint) => {
                    Answer { endpoint }.encode(body(&mut out));
                    (FOUND, id, 0, 0)
                }
                Err(errno) => (FOUND, id, errno, 0),
            },
            Message::Stage { len } => {
                out[16..24].copy_from_slice(&len.to_le_bytes());
                (STAGE, 0, 0, 0)
            }
            Message::Staged { status, len } => {
                out[16..24].copy_from_slice(&len.to_le_bytes());
                (STAGED, 0, status, 0)
            }
            Message::Connect { id, key } => {
                Query { key }.encode(body(&mut out));
                (CONNECT, id, 0, 0)
            }
            Message::Connected { id, result } => match result {
                Ok((handle, endpoint)) => {
                    Answer { endpoint: Some(endpoint) }.encode(body(&mut out));
                    (CONNECTED, id, 0, handle)
                }
                Err(errno) => (CONNECTED, id, errno, 0),
            },
            Message::Ring => (RING, 0, 0, 0),
            Message::Close { handle } => {
                out[16..20].copy_from_slice(&handle.to_le_bytes());
                (CLOSE, 0, 0, 0)
            }
            Message::Present { incarnation, gid } => {
                out[16..24].copy_from_slice(&incarnation.to_le_bytes());
                out[24..40].copy_from_slice(&gid);
                (PRESENT, 0, 0, 0)
            }
        };
        out[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        out[2] = VERSION;
        out[3] = kind;
        out[4..8].copy_from_slice(&id.to_le_bytes());
        out[8..12].copy_from_slice(&status.to_le_bytes());
        out[12..16].copy_from_slice(&flags.to_le_bytes());
        out
    }

    /// EBADMSG for anything but a well-formed message of [`LEN`] bytes
    /// (EPROTO: another version of the protocol).
    pub fn decode(buf: &[u8]) -> Result<Message> {
        let mut r = Reader::new(buf);
        let kind = r.prefix(MAGIC, VERSION)?;
        if buf.len() != LEN {
            return Err(EBADMSG);
        }
        let id = r.u32()?;
        let status = r.u32()?;
        let flags = r.u32()?;
        let body = &buf[16..];
        // Fields a kind does not use are zero.
        let quiet = |id: u32, status: u32, flags: u32| if id | status | flags == 0 { Ok(()) } else { Err(EBADMSG) };
        let m = match kind {
            HELLO => {
                quiet(id, status, flags)?;
                let pid = r.u32()?;
                r.finish_zeroed()?;
                Message::Hello { pid }
            }
            WELCOME => {
                quiet(id, status, flags)?;
                let incarnation = r.u64()?;
                let fingerprint = r.u64()?;
                r.finish_zeroed()?;
                Message::Welcome { incarnation, fingerprint }
            }
            LOOKUP => {
                quiet(0, status, flags & !FRESH)?;
                Message::Lookup { id, key: Query::decode(body)?.key, fresh: flags & FRESH != 0 }
            }
            FOUND => {
                quiet(0, 0, flags)?;
                let result = match status {
                    0 => Ok(Answer::decode(body)?.endpoint),
                    // An errno, never "found" in disguise.
                    e if e < 4096 => {
                        r.finish_zeroed()?;
                        Err(e)
                    }
                    _ => return Err(EBADMSG),
                };
                Message::Found { id, result }
            }
            STAGE => {
                quiet(id, status, flags)?;
                let len = r.u64()?;
                r.finish_zeroed()?;
                Message::Stage { len }
            }
            STAGED => {
                quiet(id, errno_or_zero(status)?, flags)?;
                let len = r.u64()?;
                if status != 0 && len != 0 {
                    return Err(EBADMSG);
                }
                r.finish_zeroed()?;
                Message::Staged { status, len }
            }
            CONNECT => {
                quiet(0, status, flags)?;
                Message::Connect { id, key: Query::decode(body)?.key }
            }
            CONNECTED => {
                quiet(0, errno_or_zero(status)?, 0)?;
                if status != 0 {
                    quiet(0, 0, flags)?;
                    r.finish_zeroed()?;
                    Message::Connected { id, result: Err(status) }
                } else {
                    let endpoint = Answer::decode(body)?.endpoint.ok_or(EBADMSG)?;
                    Message::Connected { id, result: Ok((flags, endpoint)) }
                }
            }
            RING => {
                quiet(id, status, flags)?;
                r.finish_zeroed()?;
                Message::Ring
            }
            CLOSE => {
                quiet(id, status, flags)?;
                let handle = r.u32()?;
                r.finish_zeroed()?;
                Message::Close { handle }
            }
            PRESENT => {
                quiet(id, status, flags)?;
                let incarnation = r.u64()?;
                let gid = r.bytes()?;
                r.finish_zeroed()?;
                Message::Present { incarnation, gid }
            }
            _ => return Err(EBADMSG),
        };
        Ok(m)
    }
}

/// A status that is 0 or an errno (for the quiet check: 0 when it is).
fn errno_or_zero(status: u32) -> Result<u32> {
    if status < 4096 {
        Ok(0)
    } else {
        Err(EBADMSG)
    }
}

fn body(out: &mut [u8; LEN]) -> &mut [u8; BODY_LEN] {
    (&mut out[16..]).try_into().expect("LEN is 16 + BODY_LEN")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::EPROTO;
    use crate::testing::Rng;

    fn endpoint() -> Endpoint {
        Endpoint { gid: [7; 16], qpn: 0x12_3456, qkey: 0x1111_1111, incarnation: 0x0102_0304_0506_0708, vqpn: 0x80_0001 }
    }

    fn all() -> Vec<Message> {
        let key = Key::Port { gid: [3; 16], port: 5000 };
        vec![
            Message::Hello { pid: 4242 },
            Message::Welcome { incarnation: u64::MAX, fingerprint: 0x1234 },
            Message::Lookup { id: 9, key, fresh: true },
            Message::Lookup { id: u32::MAX, key: Key::Vqpn { gid: [1; 16], vqpn: 0x80_0002 }, fresh: false },
            Message::Found { id: 9, result: Ok(Some(endpoint())) },
            Message::Found { id: 10, result: Ok(None) },
            Message::Found { id: 11, result: Err(libc::ETIMEDOUT as u32) },
            Message::Stage { len: 4 << 20 },
            Message::Staged { status: 0, len: 1 << 20 },
            Message::Staged { status: libc::ENOMEM as u32, len: 0 },
            Message::Connect { id: 12, key },
            Message::Connected { id: 12, result: Ok((7, endpoint())) },
            Message::Connected { id: 13, result: Err(libc::ECONNREFUSED as u32) },
            Message::Ring,
            Message::Close { handle: 7 },
            Message::Present { incarnation: u64::MAX, gid: [9; 16] },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for m in all() {
            assert_eq!(Message::decode(&m.encode()), Ok(m), "{m:?}");
        }
    }

    #[test]
    fn a_malformed_message_is_refused() {
        let hello = Message::Hello { pid: 1 }.encode();
        assert_eq!(Message::decode(&hello[..LEN - 1]), Err(EBADMSG), "short");
        let mut long = hello.to_vec();
        long.push(0);
        assert_eq!(Message::decode(&long), Err(EBADMSG), "long");
        let mut v = hello;
        v[2] = VERSION + 1;
        assert_eq!(Message::decode(&v), Err(EPROTO), "another version");
        let mut k = hello;
        k[3] = 99;
        assert_eq!(Message::decode(&k), Err(EBADMSG), "unknown kind");
        let mut r = hello;
        r[LEN - 1] = 1;
        assert_eq!(Message::decode(&r), Err(EBADMSG), "reserved byte set");
        let mut f = Message::Lookup { id: 1, key: Key::Port { gid: [0; 16], port: 1 }, fresh: false }.encode();
        f[12] = 2;
        assert_eq!(Message::decode(&f), Err(EBADMSG), "unknown flag");
        let mut s = Message::Found { id: 1, result: Err(5) }.encode();
        s[16] = 1;
        assert_eq!(Message::decode(&s), Err(EBADMSG), "an error with a body");
        let mut big = Message::Found { id: 1, result: Err(5) }.encode();
        big[8..12].copy_from_slice(&5000u32.to_le_bytes());
        assert_eq!(Message::decode(&big), Err(EBADMSG), "not an errno");
        let mut h = hello;
        h[4] = 1;
        assert_eq!(Message::decode(&h), Err(EBADMSG), "an id on a hello");
        let mut p = Message::Ring.encode();
        p[20] = 2;
        assert_eq!(Message::decode(&p), Err(EBADMSG), "a doorbell with a body");
        let mut c = Message::Connected { id: 1, result: Err(5) }.encode();
        c[12] = 1;
        assert_eq!(Message::decode(&c), Err(EBADMSG), "a handle with an error");
    }

    #[test]
    fn random_bytes_never_panic_and_bit_flips_are_caught_or_decode_to_a_message() {
        let mut rng = Rng(21);
        for m in all() {
            let good = m.encode();
            for _ in 0..2000 {
                let mut b = good;
                let i = rng.below(LEN as u64) as usize;
                b[i] ^= 1 << rng.below(8);
                // Either refused or a well-formed message that encodes back.
                if let Ok(d) = Message::decode(&b) {
                    assert_eq!(Message::decode(&d.encode()), Ok(d));
                }
            }
        }
        for _ in 0..2000 {
            let n = rng.below(LEN as u64 + 8) as usize;
            let b: Vec<u8> = (0..n).map(|_| rng.below(256) as u8).collect();
            let _ = Message::decode(&b);
        }
    }
}
