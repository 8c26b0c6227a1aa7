//! The target of one-sided requests on the datagram tier: what RC's
//! responder does in the NIC, done by the target process against the MRs
//! its application registered.
//!
//! A request is checked before any memory is touched, in this order (the
//! first failure answers):
//!
//! 1. an atomic's address is 8-byte aligned, a READ's response segment fits
//!    a datagram and the READ is at most `max_read` bytes, else
//!    [`Status::InvalidRequest`] (`IBV_WC_REM_INV_REQ_ERR`);
//! 2. the rkey names a registered MR, the MR grants the access
//!    (`REMOTE_READ`, `REMOTE_WRITE`, `REMOTE_ATOMIC`) and is not
//!    zero-based, and `[remote_addr, remote_addr + length)` lies inside it
//!    (computed without overflow), else [`Status::RemoteAccess`]
//!    (`IBV_WC_REM_ACCESS_ERR`).
//!
//! Each WRITE segment is checked against the whole request's range, so a
//! refused WRITE writes nothing. The memory operation goes through
//! [`Memory`], called only with a range the checks passed. A refusal puts
//! the flow in the error state, as an RC responder: the caller calls
//! [`super::reliable::Receiver::fail`].
//!
//! Exactly once: the flow's receiver delivers each packet once, and a
//! retransmitted request whose answer was lost comes back as a duplicate
//! ([`Responder::serve_duplicate`]). Answers of WRITEs and atomics (not
//! idempotent) and refusals are kept per flow, the last [`WINDOW`] of
//! them, keyed by (seq, nonce), and sent again; a READ is run again (as RC
//! does). The sender never retransmits a request more than [`WINDOW`]
//! packets behind its newest, so the cache always holds the answer a
//! genuine duplicate needs.

use super::reliable::WINDOW;
use super::wire::{self, Message, OneSided, Request, Response, Status, ATOMIC_LEN};
use crate::sys::ibv_access_flags as A;
use crate::vqp::precheck::MrInfo;
use std::collections::VecDeque;

/// The target application's registered MRs that peers may access, by rkey
/// (`src/vqp/mrs.rs`'s registry).
pub trait Mrs {
    fn by_rkey(&self, rkey: u32) -> Option<MrInfo>;
}

/// The target's memory, touched only inside ranges the checks passed.
/// `false` / `None`: the operation could not be done
/// ([`Status::RemoteOp`]).
pub trait Memory {
    fn read(&mut self, addr: u64, out: &mut [u8]) -> bool;
    fn write(&mut self, addr: u64, data: &[u8]) -> bool;
    /// Atomically: the 8 bytes at `addr`, replaced by `swap` if they
    /// equal `compare`.
    fn compare_swap(&mut self, addr: u64, compare: u64, swap: u64) -> Option<u64>;
    /// Atomically: the 8 bytes at `addr`, then increased by `add`.
    fn fetch_add(&mut self, addr: u64, add: u64) -> Option<u64>;
}

/// Checks `req` against the MRs: `Ok` means the memory operation stays
/// inside one registered MR that grants it.
pub fn check(req: &Request, mrs: &impl Mrs, max_payload: usize, max_read: u32) -> Result<(), Status> {
    let (need, len) = match req.op {
        OneSided::Read => {
            if req.resp_seg as usize > max_payload || req.length > max_read {
                return Err(Status::InvalidRequest);
            }
            (A::IBV_ACCESS_REMOTE_READ.0, req.length)
        }
        OneSided::Write => (A::IBV_ACCESS_REMOTE_WRITE.0, req.length),
        OneSided::CmpSwp | OneSided::FetchAdd => {
            if req.remote_addr % u64::from(ATOMIC_LEN) != 0 {
                return Err(Status::InvalidRequest);
            }
            (A::IBV_ACCESS_REMOTE_ATOMIC.0, ATOMIC_LEN)
        }
    };
    let mr = mrs.by_rkey(req.rkey).ok_or(Status::RemoteAccess)?;
    // A zero-based MR reads remote addresses as offsets: not served.
    if mr.access & need == 0 || mr.access & A::IBV_ACCESS_ZERO_BASED.0 != 0 {
        return Err(Status::RemoteAccess);
    }
    let end = req.remote_addr.checked_add(u64::from(len)).ok_or(Status::RemoteAccess)?;
    let mr_end = mr.addr.checked_add(mr.len).ok_or(Status::RemoteAccess)?;
    if req.remote_addr < mr.addr || end > mr_end {
        return Err(Status::RemoteAccess);
    }
    Ok(())
}

/// What serving a request gave: the answers to send (in order) and the
/// status (not [`Status::Ok`]: fail the flow).
#[derive(Debug, PartialEq, Eq)]
pub struct Served {
    pub responses: Vec<Vec<u8>>,
    pub status: Status,
}

/// Counts of what a responder could not answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServeStats {
    /// Requests refused (each answered with its status).
    pub refused: u64,
    /// Duplicates of a WRITE or atomic whose answer is not in the cache
    /// (older than the window, or a forged nonce): dropped, never re-run.
    pub uncached: u64,
}

/// One flow's target side: serves its requests and keeps its answers.
#[derive(Debug)]
pub struct Responder {
    /// Largest response payload: the path MTU less the RESPONSE header.
    max_payload: usize,
    max_read: u32,
    /// (seq, nonce, answers) of the last [`WINDOW`] answered WRITEs,
    /// atomics and refusals.
    cache: VecDeque<(u64, u64, Vec<Vec<u8>>)>,
    pub stats: ServeStats,
}

impl Responder {
    /// For a path of `mtu` bytes ([`wire::MIN_MTU`]..=[`wire::MAX_MTU`]);
    /// READs above `max_read` bytes are refused (they are answered from
    /// one buffer).
    pub fn new(mtu: usize, max_read: u32) -> Responder {
        let mtu = mtu.clamp(wire::MIN_MTU, wire::MAX_MTU);
        Responder { max_payload: mtu - wire::RESPONSE_HDR, max_read, cache: VecDeque::new(), stats: ServeStats::default() }
    }

    /// Serves a request packet the flow delivered (once, in order).
    pub fn serve(&mut self, req: &Request, mrs: &impl Mrs, mem: &mut impl Memory) -> Served {
        let (status, responses) = match check(req, mrs, self.max_payload, self.max_read) {
            Ok(()) => self.perform(req, mem),
            Err(status) => (status, vec![refusal(req, status)]),
        };
        if status != Status::Ok {
            self.stats.refused += 1;
        }
        if status != Status::Ok || req.op != OneSided::Read {
            if self.cache.len() as u64 == WINDOW {
                self.cache.pop_front();
            }
            self.cache.push_back((req.seq, req.nonce, responses.clone()));
        }
        Served { responses, status }
    }

    /// Answers a request packet delivered before (its answer was lost):
    /// the cached answer, or a READ run again; never a WRITE or atomic
    /// twice.
    pub fn serve_duplicate(&mut self, req: &Request, mrs: &impl Mrs, mem: &mut impl Memory) -> Vec<Vec<u8>> {
        if let Some((_, _, answers)) = self.cache.iter().find(|(s, n, _)| *s == req.seq && *n == req.nonce) {
            return answers.clone();
        }
        if req.op == OneSided::Read {
            return match check(req, mrs, self.max_payload, self.max_read) {
                Ok(()) => self.perform(req, mem).1,
                Err(status) => vec![refusal(req, status)],
            };
        }
        if req.is_last() {
            self.stats.uncached += 1;
        }
        Vec::new()
    }

    /// The memory operation of a checked request, and its answers (none
    /// for a WRITE's non-final segment: the flow's ACK covers it).
    fn perform(&self, req: &Request, mem: &mut impl Memory) -> (Status, Vec<Vec<u8>>) {
        let answer = |value: u64, length: u32, offset: u32, payload: &[u8]| {
            let r = Response {
                route: req.route.reverse(),
                seq: req.seq,
                nonce: req.nonce,
                status: Status::Ok,
                op: req.op,
                length,
                offset,
                value,
                payload,
            };
            Message::Response(r).to_vec()
        };
        let value = match req.op {
            OneSided::Read => {
                let mut data = vec![0; req.length as usize];
                if !mem.read(req.remote_addr, &mut data) {
                    return (Status::RemoteOp, vec![refusal(req, Status::RemoteOp)]);
                }
                let seg = req.resp_seg as usize;
                let mut out: Vec<_> = data.chunks(seg).enumerate().map(|(i, c)| answer(0, req.length, (i * seg) as u32, c)).collect();
                if out.is_empty() {
                    out.push(answer(0, 0, 0, &[]));
                }
                return (Status::Ok, out);
            }
            OneSided::Write => {
                let at = req.remote_addr + u64::from(req.offset);
                if !mem.write(at, req.payload) {
                    return (Status::RemoteOp, vec![refusal(req, Status::RemoteOp)]);
                }
                if !req.is_last() {
                    return (Status::Ok, Vec::new());
                }
                return (Status::Ok, vec![answer(0, 0, 0, &[])]);
            }
            OneSided::CmpSwp => mem.compare_swap(req.remote_addr, req.compare_add, req.swap),
            OneSided::FetchAdd => mem.fetch_add(req.remote_addr, req.compare_add),
        };
        match value {
            Some(v) => (Status::Ok, vec![answer(v, 0, 0, &[])]),
            None => (Status::RemoteOp, vec![refusal(req, Status::RemoteOp)]),
        }
    }
}

/// The answer that refuses `req` with `status`.
fn refusal(req: &Request, status: Status) -> Vec<u8> {
    let r = Response {
        route: req.route.reverse(),
        seq: req.seq,
        nonce: req.nonce,
        status,
        op: req.op,
        length: 0,
        offset: 0,
        value: 0,
        payload: &[],
    };
    Message::Response(r).to_vec()
}

#[cfg(test)]
#[path = "serve_tests.rs"]
pub(super) mod tests;
