//! Transports under the VQPs: how a VQP's work requests reach its peer.
//!
//! The agent's path ([`agent`], issue 21): a new process's first one-sided
//! work carried by the host's agent until its own runtime is up.
//!
//! Two tiers (issue 19): the RC link (today in `src/service/` and
//! `src/vqp/runtime.rs`, one physical RC QP per peer process, shared by
//! VQPs), and the datagram tier ([`dgram`]), usable at first contact over
//! the service endpoint's UD QP while a link is made, with software
//! reliability and one-sided operations served by the target process.
//!
//! This room holds the transports' own logic; `src/vqp/` keeps VQP
//! semantics (queues, pre-checks, completions) and sends through it.

pub mod agent;
pub mod dgram;
