//! The datagram tier's core: pure logic driven by explicit inputs (the
//! bytes that arrived, a clock in microseconds), no verbs and no threads,
//! so that it is tested on the host and wired to the service endpoint's UD
//! QP by its caller.
//!
//! - [`wire`]: the messages (DATA segments, ACKs, one-sided REQUESTs and
//!   their RESPONSEs) and their strict codec.
//! - [`reliable`]: one flow (a src VQP -> dst VQP): the sender's window,
//!   retransmission with backoff, the retry limit, completions; the
//!   receiver's duplicate suppression, in-order delivery, reassembly and
//!   ACKs.
//! - [`budget`]: what the messages of one source GID may hold in the
//!   process (RNR beyond).
//! - [`serve`]: the target of one-sided requests: checks against the
//!   application's registered MRs, the memory operation, the cache of
//!   answers that keeps a retransmitted WRITE or atomic from running twice.
//!
//! docs/vqp.md, "The datagram tier (core)", describes the protocol and its
//! limits.

pub mod budget;
pub mod port;
pub mod reliable;
pub mod serve;
pub mod wire;
