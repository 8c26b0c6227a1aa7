//! Statistics: an enum of counters plus a names table, relaxed atomics on
//! separate cache lines (the data-path counters are bumped per post/poll).

use std::sync::atomic::{AtomicU64, Ordering};

/// Library statistics counters (`krcore_stat_get`). Values never change
/// meaning; new counters are appended before `KRCORE_STAT_COUNT`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum krcore_stat {
    /// Devices opened through the library (wrapped contexts).
    KRCORE_STAT_CONTEXTS_OPENED = 0,
    /// Protection domains allocated on wrapped contexts.
    KRCORE_STAT_PDS_ALLOCATED,
    /// Memory regions registered on wrapped PDs.
    KRCORE_STAT_MRS_REGISTERED,
    /// Completion queues created (plain and extended).
    KRCORE_STAT_CQS_CREATED,
    /// Queue pairs created (plain and extended).
    KRCORE_STAT_QPS_CREATED,
    /// Shared receive queues created.
    KRCORE_STAT_SRQS_CREATED,
    /// Address handles created.
    KRCORE_STAT_AHS_CREATED,
    /// Memory windows allocated.
    KRCORE_STAT_MWS_ALLOCATED,
    /// `ibv_post_send` calls on wrapped QPs.
    KRCORE_STAT_POST_SEND,
    /// `ibv_post_recv` calls on wrapped QPs.
    KRCORE_STAT_POST_RECV,
    /// `ibv_post_srq_recv` calls on wrapped SRQs.
    KRCORE_STAT_POST_SRQ_RECV,
    /// `ibv_poll_cq` calls and `ibv_start_poll` calls on wrapped CQs.
    KRCORE_STAT_POLL_CQ,
    /// `ibv_req_notify_cq` calls on wrapped CQs.
    KRCORE_STAT_REQ_NOTIFY_CQ,
    /// Work requests built with the `ibv_wr_*` API on wrapped QPs.
    KRCORE_STAT_WR_CALLS,
    /// Completion events returned by `ibv_get_cq_event`.
    KRCORE_STAT_CQ_EVENTS,
    /// Asynchronous events returned by `ibv_get_async_event`.
    KRCORE_STAT_ASYNC_EVENTS,
    /// Calls that carried foreign (real) objects and were passed straight through.
    KRCORE_STAT_FOREIGN_CALLS,
    /// Post calls that failed (a `*bad_wr` was returned).
    KRCORE_STAT_POST_ERRORS,
    /// Registrations served from the MR cache.
    KRCORE_STAT_MR_CACHE_HITS,
    /// Registrations the MR cache had to make.
    KRCORE_STAT_MR_CACHE_MISSES,
    /// Idle cached registrations evicted (size-and-recency policy).
    KRCORE_STAT_MR_CACHE_EVICTIONS,
    /// Cached registrations dropped because their memory was unmapped or replaced.
    KRCORE_STAT_MR_CACHE_INVALIDATIONS,
    /// Bytes currently registered by the MR cache (a gauge).
    KRCORE_STAT_MR_CACHE_PINNED_BYTES,
    /// Eviction batches (one deregistration batch each).
    KRCORE_STAT_MR_CACHE_DEREG_BATCHES,
    /// Registrations the monitor could not watch (kept only while held).
    KRCORE_STAT_MR_CACHE_UNCACHEABLE,
    /// MR cache mode (a gauge): 0 off, 1 caching, 2 hold-only (no sound
    /// unmap monitor), 3 forked child (cache unused).
    KRCORE_STAT_MR_CACHE_MODE,
    /// Bytes of idle cached registrations (a gauge; what the
    /// `KRCORE_MR_CACHE_BYTES` budget limits).
    KRCORE_STAT_MR_CACHE_IDLE_BYTES,
    /// Registrations that hit the pinned-memory limit and were retried
    /// after the idle regions were deregistered.
    KRCORE_STAT_MR_CACHE_LIMIT_RETRIES,
    /// Evicted registrations waiting for (or in) deregistration by the
    /// background thread (a gauge).
    KRCORE_STAT_MR_CACHE_DEREG_PENDING,
    /// Evicted registrations deregistered by the background thread.
    KRCORE_STAT_MR_CACHE_DEREG_BACKGROUND,
    /// VQP completions kept beyond their CQ's size until polled (a real CQ
    /// would have overrun).
    KRCORE_STAT_CQ_SPILLS,
    /// VQP messages above 4 KiB sent (the receiver READs their payload).
    KRCORE_STAT_LARGE_SENT,
    /// Of those, the ones that did not fit the link's staging and were
    /// registered on their own (`KRCORE_STAGING_BYTES`).
    KRCORE_STAT_LARGE_OWN_REGISTRATIONS,
    /// Live virtual QPs, `qpop_msgs` src_qps included (a gauge).
    KRCORE_STAT_VQPS,
    /// Live links: physical RC QPs to peer processes (a gauge).
    KRCORE_STAT_LINKS,
    /// Deregistered MRs that peers may still use, or that WQEs queued on
    /// a link may, really deregistered when the MR lease runs out
    /// (`KRCORE_MR_LEASE_MS`, plus RC's retry time) and those WQEs
    /// completed (a gauge).
    KRCORE_STAT_MR_DEREG_DELAYED,
    /// Evicted registrations deregistered on the application's thread:
    /// no deregistration thread, the thread a full batch behind, or a
    /// flush (`ibv_dealloc_pd`, `ibv_close_device`, the pinned-memory retry).
    KRCORE_STAT_MR_CACHE_DEREG_INLINE,
    /// Application RC QPs made virtual by `KRCORE_VIRTUALIZE` (cumulative:
    /// proves a run was virtualized after its QPs are gone).
    KRCORE_STAT_QPS_VIRTUALIZED,
    /// Of those, the ones `KRCORE_VIRTUALIZE=auto` turned back into real QPs
    /// because their peer did not resolve.
    KRCORE_STAT_QPS_FALLBACK,
    /// Links opened since start (cumulative; `links` is the live count).
    KRCORE_STAT_LINKS_OPENED,
    /// Links that failed (an error completion: the peer died or cannot be
    /// reached); their VQPs moved to the error state.
    KRCORE_STAT_LINKS_FAILED,
    /// Liveness probes posted on idle links (`KRCORE_LINK_PROBE_MS`).
    KRCORE_STAT_LINK_PROBES,
    /// Meta-server replicas connected again after their connection failed
    /// or they were down (a restart, a network failure).
    KRCORE_STAT_META_RECONNECTS,
    /// Bindings registered again on a replica that was reconnected or had
    /// lost them (the repopulation of a restarted meta server).
    KRCORE_STAT_META_REBINDS,
    /// Lookups answered by a replica other than the first in `KRCORE_META`
    /// (the first was down, busy or did not have the entry).
    KRCORE_STAT_META_LOOKUP_FAILOVERS,
    /// Links closed by agreement with their peer (`KRCORE_MAX_LINKS`
    /// reclaim, or the second link two processes made by connecting to
    /// each other at once); their VQPs move to a new link when next used.
    KRCORE_STAT_LINKS_CLOSED,
    /// Messages dropped as malformed (a header that does not decode, or
    /// claims another length than arrived); each fails its sender's link.
    KRCORE_STAT_MSGS_MALFORMED,
    /// Panics caught on a service endpoint's progress thread (each logged;
    /// the endpoint's links were failed and the thread went on).
    KRCORE_STAT_SERVICE_PANICS,
    /// Work requests VQPs posted on the datagram tier (no link to their
    /// peer yet).
    KRCORE_STAT_DGRAM_WRS,
    /// Datagrams of the tier sent (first transmissions, retransmissions,
    /// ACKs and one-sided answers).
    KRCORE_STAT_DGRAM_SENT,
    /// Datagrams of the tier dropped: malformed, from another source than
    /// their flow's, unmatched (a forged or late ACK or answer), duplicate,
    /// out of window, or for no VQP here.
    KRCORE_STAT_DGRAM_DROPPED,
    /// One-sided requests served for peers on the datagram tier.
    KRCORE_STAT_DGRAM_SERVED,
    /// Of those, refused (unknown rkey, out of range, access not granted,
    /// malformed): answered with an error status.
    KRCORE_STAT_DGRAM_REFUSED,
    /// VQPs that moved from the datagram tier onto a link (everything they
    /// sent on the tier acknowledged first).
    KRCORE_STAT_DGRAM_MOVES,
    /// Flows of the datagram tier held: ours to peers' VQPs and theirs to
    /// ours (a gauge; a flow goes with its VQP, the peer VQP's CLOSE or
    /// its process's death).
    KRCORE_STAT_DGRAM_FLOWS,
    /// Runtimes started in the background at a process's first
    /// `ibv_alloc_pd` (`KRCORE_PRESTART`), counted once started.
    KRCORE_STAT_RUNTIMES_PRESTARTED,
    /// Connections to the meta server that failed (the runtime's own at
    /// its start, a verb's): a verb after a failed one at the start tries
    /// again.
    KRCORE_STAT_META_CONNECT_FAILURES,
    /// Lookups answered over TCP (a `Query`) because the meta-server RC
    /// connection was still being made.
    KRCORE_STAT_META_QUERIES,
    /// Peer processes taken for gone because a link handshake to them got
    /// no answer within `KRCORE_CONNECT_TIMEOUT_MS` (and nothing came from
    /// them on the datagram tier); their VQPs moved to the error state.
    KRCORE_STAT_PEERS_UNREACHABLE,
    /// Link handshake messages dropped: malformed, or not from the
    /// endpoint they name (GRH source GID and `src_qp`), or a reply from
    /// another endpoint than the one asked, or a request naming a GID
    /// that is not ours.
    KRCORE_STAT_LINK_MSGS_DROPPED,
    /// Link requests refused because their sender already held
    /// `KRCORE_MAX_PEER_LINKS` links with this process, or the endpoints
    /// of its GID `KRCORE_MAX_GID_LINKS`.
    KRCORE_STAT_LINKS_REFUSED,
    /// Messages dropped because they came to a connected VQP from another
    /// process than its peer (over a link or the datagram tier), or on a
    /// link of another PD than their VQP's.
    KRCORE_STAT_MSGS_REFUSED,
    /// Link requests dropped because no VQP here is bound or connected to
    /// their sender (each copy counted; an honest peer's are answered once
    /// a VQP of ours connects to it).
    KRCORE_STAT_LINKS_UNWANTED,
    /// Peers' checks of an rkey of ours answered (over a link).
    KRCORE_STAT_MR_CHECKS,
    /// Checks of an rkey we have no MR for (links and the datagram
    /// tier's one-sided requests): what guessing costs, bounded per
    /// source GID by `KRCORE_MR_CHECK_MISSES`.
    KRCORE_STAT_MR_CHECK_MISSES,
    /// Checks answered BUSY, and datagram-tier one-sided requests held
    /// back, because their source GID spent its misses.
    KRCORE_STAT_MR_CHECKS_BUSY,
    /// Datagrams not sent because the service endpoint held
    /// `KRCORE_MAX_AHS` address handles, each used within the last second.
    KRCORE_STAT_AHS_REFUSED,
    /// Messages refused because their sender went past the link's window
    /// (`KRCORE_LINK_WINDOW_BYTES`), and grants of more than was sent.
    KRCORE_STAT_MSGS_OVERRUN,
    /// `Bind`s sent again because the meta server had not seen the proof
    /// of their GID yet (it came after the request, or was lost).
    KRCORE_STAT_META_PROOF_RETRIES,
    /// Datagram-tier packets answered RNR: what their source GID may make
    /// this process hold was spent (`KRCORE_LINK_WINDOW_BYTES`); their
    /// senders wait and send them again.
    KRCORE_STAT_DGRAM_RNR,
    /// Messages dropped because their bound VQP took messages from
    /// `KRCORE_MAX_SENDERS` senders (or `KRCORE_MAX_SENDERS_PER_GID` of
    /// their GID) and theirs was a new one.
    KRCORE_STAT_SENDERS_REFUSED,
    /// Lookups answered by the host's agent (`krcore-node`, `KRCORE_NODE`).
    KRCORE_STAT_NODE_LOOKUPS,
    /// Lookups the agent could not answer (gone, too slow, or its meta
    /// server unreachable): made by the process itself instead.
    KRCORE_STAT_NODE_FALLBACKS,
    /// Connections to the meta server this process made (its runtime's
    /// own; none while the host's agent looks up for it and it binds
    /// nothing).
    KRCORE_STAT_META_CONNECTIONS,
    /// VQPs connected through the host's agent (their first one-sided
    /// work goes through it until the process's runtime is up).
    KRCORE_STAT_NODE_CONNECTS,
    /// Work requests the agent carried for this process.
    KRCORE_STAT_NODE_WRS,
    /// Times a peer process that did not answer (a link handshake timed
    /// out, or a flow of the datagram tier ran out of retries) was found
    /// alive (still bound at the meta server, or, with no binding known,
    /// connected to it, or, with neither to ask, sending to us lately),
    /// so waited for instead of taken for gone.
    KRCORE_STAT_PEERS_VOUCHED,
    /// Peer processes taken for gone (a link to one failed, or it did not
    /// answer and nothing vouched for it): their VQPs moved to the error
    /// state.
    KRCORE_STAT_PEERS_GONE,
    /// Times the meta server was asked whether a silent peer's own
    /// connection to it is open (a peer with no binding known here).
    KRCORE_STAT_PRESENCE_QUERIES,
    /// Lease renewals sent to meta servers (one request per replica
    /// renews every binding of the process there).
    KRCORE_STAT_META_RENEWALS,
    /// Number of counters (not a counter).
    KRCORE_STAT_COUNT,
}

pub use krcore_stat as Stat;

pub const COUNT: usize = krcore_stat::KRCORE_STAT_COUNT as usize;

/// Counter names, indexed by counter, NUL-terminated so that C can use
/// them as they are (`name()` gives the Rust view).
const NAMES_NUL: [&str; COUNT] = [
    "contexts_opened\0",
    "pds_allocated\0",
    "mrs_registered\0",
    "cqs_created\0",
    "qps_created\0",
    "srqs_created\0",
    "ahs_created\0",
    "mws_allocated\0",
    "post_send\0",
    "post_recv\0",
    "post_srq_recv\0",
    "poll_cq\0",
    "req_notify_cq\0",
    "wr_calls\0",
    "cq_events\0",
    "async_events\0",
    "foreign_calls\0",
    "post_errors\0",
    "mr_cache_hits\0",
    "mr_cache_misses\0",
    "mr_cache_evictions\0",
    "mr_cache_invalidations\0",
    "mr_cache_pinned_bytes\0",
    "mr_cache_dereg_batches\0",
    "mr_cache_uncacheable\0",
    "mr_cache_mode\0",
    "mr_cache_idle_bytes\0",
    "mr_cache_limit_retries\0",
    "mr_cache_dereg_pending\0",
    "mr_cache_dereg_background\0",
    "cq_spills\0",
    "large_sent\0",
    "large_own_registrations\0",
    "vqps\0",
    "links\0",
    "mr_dereg_delayed\0",
    "mr_cache_dereg_inline\0",
    "qps_virtualized\0",
    "qps_fallback\0",
    "links_opened\0",
    "links_failed\0",
    "link_probes\0",
    "meta_reconnects\0",
    "meta_rebinds\0",
    "meta_lookup_failovers\0",
    "links_closed\0",
    "msgs_malformed\0",
    "service_panics\0",
    "dgram_wrs\0",
    "dgram_sent\0",
    "dgram_dropped\0",
    "dgram_served\0",
    "dgram_refused\0",
    "dgram_moves\0",
    "dgram_flows\0",
    "runtimes_prestarted\0",
    "meta_connect_failures\0",
    "meta_queries\0",
    "peers_unreachable\0",
    "link_msgs_dropped\0",
    "links_refused\0",
    "msgs_refused\0",
    "links_unwanted\0",
    "mr_checks\0",
    "mr_check_misses\0",
    "mr_checks_busy\0",
    "ahs_refused\0",
    "msgs_overrun\0",
    "meta_proof_retries\0",
    "dgram_rnr\0",
    "senders_refused\0",
    "node_lookups\0",
    "node_fallbacks\0",
    "meta_connections\0",
    "node_connects\0",
    "node_wrs\0",
    "peers_vouched\0",
    "peers_gone\0",
    "presence_queries\0",
    "meta_renewals\0",
];

/// A counter's name ("post_send").
pub fn name(index: usize) -> Option<&'static str> {
    NAMES_NUL.get(index).map(|n| &n[..n.len() - 1])
}

/// A counter's name as a NUL-terminated C string.
pub fn name_c(index: usize) -> Option<*const libc::c_char> {
    NAMES_NUL.get(index).map(|n| n.as_ptr().cast())
}

#[repr(align(64))]
struct Padded(AtomicU64);

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: Padded = Padded(AtomicU64::new(0));
static COUNTERS: [Padded; COUNT] = [ZERO; COUNT];

/// Add one to a counter. Relaxed: counters order nothing, they only count.
#[inline(always)]
pub fn inc(stat: Stat) {
    COUNTERS[stat as usize].0.fetch_add(1, Ordering::Relaxed);
}

#[inline]
pub fn add(stat: Stat, n: u64) {
    COUNTERS[stat as usize].0.fetch_add(n, Ordering::Relaxed);
}

#[inline]
pub fn sub(stat: Stat, n: u64) {
    COUNTERS[stat as usize].0.fetch_sub(n, Ordering::Relaxed);
}

/// Add to a counter whose every update happens under one lock (the
/// registration cache's): a plain load and store, no locked instruction
/// (those cost about a microsecond each under emulation).
#[inline]
pub fn add_locked(stat: Stat, n: u64) {
    let c = &COUNTERS[stat as usize].0;
    c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// For gauges.
pub fn set(stat: Stat, v: u64) {
    COUNTERS[stat as usize].0.store(v, Ordering::Relaxed);
}

pub fn get(index: usize) -> Option<u64> {
    COUNTERS.get(index).map(|c| c.0.load(Ordering::Relaxed))
}

/// `{"krcore":"<version>","pid":N,"counters":{...}}`
pub fn to_json() -> String {
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    let counters: Vec<String> = (0..COUNT).map(|i| format!("\"{}\":{}", name(i).unwrap_or("?"), get(i).unwrap_or(0))).collect();
    format!("{{\"krcore\":\"{}\",\"pid\":{pid},\"counters\":{{{}}}}}", env!("CARGO_PKG_VERSION"), counters.join(","))
}

/// At process exit: `KRCORE_STATS=1` prints the JSON on stderr,
/// `KRCORE_STATS_FILE` writes it to a file (`%p` becomes the pid).
pub fn report_at_exit() {
    let cfg = crate::config::get();
    if !cfg.stats_at_exit && cfg.stats_file.is_none() {
        return;
    }
    let json = to_json();
    if cfg.stats_at_exit {
        let line = format!("krcore-stats: {json}\n");
        // SAFETY: writing an initialised buffer to fd 2.
        unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
    }
    if let Some(path) = &cfg.stats_file {
        // SAFETY: getpid has no preconditions.
        let path = path.replace("%p", &unsafe { libc::getpid() }.to_string());
        if let Err(e) = std::fs::write(&path, json + "\n") {
            crate::klog!(crate::log::Level::Error, "cannot write stats to {path}: {e}");
        }
    }
}

#[cfg(test)]
#[allow(clippy::undocumented_unsafe_blocks)]
mod tests {
    use super::*;

    #[test]
    fn names_cover_every_counter() {
        assert!(NAMES_NUL.iter().all(|n| n.ends_with('\0') && n.len() > 1));
        assert_eq!(name(Stat::KRCORE_STAT_POST_SEND as usize), Some("post_send"));
        assert_eq!(name(Stat::KRCORE_STAT_WR_CALLS as usize), Some("wr_calls"));
        assert_eq!(name(Stat::KRCORE_STAT_POST_ERRORS as usize), Some("post_errors"));
        assert_eq!(name(COUNT), None);
    }

    #[test]
    fn json_lists_counters() {
        inc(Stat::KRCORE_STAT_AHS_CREATED);
        let j = to_json();
        assert!(j.contains("\"ahs_created\":"), "{j}");
        assert!(j.starts_with("{\"krcore\":\""));
        assert!(get(COUNT).is_none());
    }
}
