//! `KRCORE_*` configuration: one table, parsed once.

use crate::log::Level;
use once_cell::sync::Lazy;

/// Every variable the library reads: (name, default, description).
pub const VARIABLES: &[(&str, &str, &str)] = &[
    ("KRCORE_LOG", "off", "log level on stderr: off, error, warn, info, debug"),
    ("KRCORE_STATS", "0", "1: print the statistics as one JSON line on stderr at exit"),
    ("KRCORE_STATS_FILE", "", "write the statistics JSON to this path at exit (%p becomes the pid)"),
    ("KRCORE_IBVERBS_LIB", "libibverbs.so.1", "the real libibverbs to dlopen"),
    ("KRCORE_MR_CACHE", "1", "0: no registration cache (every ibv_reg_mr is real)"),
    ("KRCORE_MR_CACHE_BYTES", "1073741824", "most bytes of idle registrations the MR cache keeps (default: at most RLIMIT_MEMLOCK/2 without CAP_IPC_LOCK)"),
    ("KRCORE_MR_CACHE_ENTRIES", "1024", "most idle registrations the MR cache keeps"),
    ("KRCORE_MR_DEREG_BATCH", "16", "evicted registrations are deregistered by a background thread in batches of this many (0: at once, on the application's thread)"),
    ("KRCORE_META", "", "the meta server(s) for qbind/qconnect: <ip>:<port>[,<ip>:<port>...] (krcore-meta --listen)"),
    ("KRCORE_NODE", "", "the host agent's unix socket (krcore-node --socket): lookups go through it and a process that binds nothing makes no meta-server connection of its own (default: $XDG_RUNTIME_DIR/krcore-node.sock, else /tmp/krcore-node-<uid>.sock; off: no agent)"),
    ("KRCORE_GID_INDEX", "", "GID index of the links and the meta-server connection (default: the qbind GID, else the GID of the source address the kernel routes to KRCORE_META from, else the first RoCE v2 / IB GID); transparent QPNs are published under every GID of the port whatever it is"),
    ("KRCORE_CONNECT_TIMEOUT_MS", "2000", "bound on qconnect and on every wait for the meta server or a peer's endpoint"),
    ("KRCORE_META_LEASE_MS", "10000", "lease of a qbind registration; renewed every third of it, dropped after it when not renewed"),
    ("KRCORE_MR_LEASE_MS", "5000", "how long a peer may use a remote MR it checked (from the post of the READ that checked it); the real ibv_dereg_mr of an MR peers can access waits 1.1 times this plus RC's retry time (about 3.76 s)"),
    ("KRCORE_LINKS_PER_PEER", "1", "RC links to each peer process; a process's VQPs are spread over them (more for many threads sending to one peer)"),
    ("KRCORE_STAGING_BYTES", "4194304", "per link: registered memory that holds messages above 4 KiB until the receiver READs them (larger ones get a registration each)"),
    ("KRCORE_LINK_PROBE_MS", "1000", "an idle link is probed (one 8-byte READ) this often: a peer that died is found within this plus the RC retry time (about 3.8 s); 0: never"),
    ("KRCORE_MAX_LINKS", "64", "links (physical RC QPs) a process keeps: above it the least recently used idle ones are closed, and made again when next used; 0: no limit"),
    ("KRCORE_MAX_PEER_LINKS", "4", "links one peer endpoint may hold with this process at once (asked for by it or by us, duplicates included, links closing not; at least twice KRCORE_LINKS_PER_PEER): a request beyond it is refused with EBUSY and counted (links_refused), so that nobody can make this process create RC QPs without bound"),
    ("KRCORE_LINK_WINDOW_BYTES", "1048576", "per link, the bytes of VQP messages (headers included) a peer may send this process and not have granted back: what a peer can make this process hold for VQPs with no receive posted (a sender waits in ibv_post_send for the grant, as for room on the link; a message past the window is refused and counted, msgs_overrun)"),
    ("KRCORE_MAX_GID_LINKS", "256", "links the endpoints of one source GID (one host, whatever its number of processes or UD QPs) may hold with this process at once: a request beyond it is refused with EBUSY and counted (links_refused); the requester's VQP stays on the datagram tier"),
    ("KRCORE_MAX_AHS", "1024", "address handles (one per source GID and peer GID) the service endpoint keeps: beyond, the least recently used one unused for a second is destroyed; when none is, a datagram to a new GID is not sent (the peer's retransmission asks again) and counted (ahs_refused)"),
    ("KRCORE_MAX_SENDERS", "16384", "senders (peer VQPs) a bound VQP takes messages from at once (each gets a src_qp at qpop_msgs, until it is reported closed): a message of a new sender beyond it is dropped and counted (senders_refused), logged at warn level"),
    ("KRCORE_MAX_SENDERS_PER_GID", "1024", "of those, the senders of one source GID"),
    ("KRCORE_DGRAM_FLOWS_PER_GID", "1024", "datagram-tier flows (first contacts in progress) the peers of one source GID may have open to this process at once: a packet of a flow beyond it is dropped and counted (dgram_dropped) and its sender retransmits"),
    ("KRCORE_MR_CHECK_MISSES", "16", "checks of an rkey we have no MR for that one source GID may make a second (as many at once), over links and the datagram tier together: beyond, every check from that GID is answered BUSY (the asker waits and asks again) and counted (mr_checks_busy), so that guessing the application's rkeys takes hours; 0: unbounded"),
    ("KRCORE_LINK_IDLE_MS", "1000", "a link is idle (may be closed to keep KRCORE_MAX_LINKS) when this process posted nothing on it for this long"),
    ("KRCORE_DGRAM", "1", "1: a connected VQP whose peer has no link yet sends at once on the connectionless (datagram) tier while its link is made in the background, and moves onto the link without reordering; qconnect makes no handshake (docs/vqp.md, \"The datagram tier\"); 0: qconnect and a transparent VQP's RTR wait for the link"),
    ("KRCORE_PRESTART", "1", "with KRCORE_META set: the process's first ibv_alloc_pd starts that PD's runtime (service endpoint, meta-server connection) on a thread of its own, overlapping the application's set-up; 0: at the first extended verb (or transparent QP)"),
    ("KRCORE_LINK_AFTER", "0", "with the datagram tier: work requests a VQP posts on the datagram tier before its link is made in the background (0: at first contact: a qconnect'ed VQP once its first work request on the tier completed, a transparent VQP at its RTR)"),
    ("KRCORE_DGRAM_RTO_US", "4000", "the datagram tier's smallest retransmission timeout (it follows the measured round trip above it, doubles per timeout up to 500 ms; 10 in a row, about 2 s, fail the VQP with IBV_WC_RETRY_EXC_ERR)"),
    ("KRCORE_TEST_DGRAM_LOSS", "0", "test hook: N > 0 drops one in N (at random) of the datagrams of the tier this process sends (a lossy network, for the tests; rxe loops same-device traffic past the netdev, where tc netem cannot see it)"),
    ("KRCORE_VIRTUALIZE", "0", "1: the application's RC QPs become virtual QPs on shared links (needs KRCORE_META); auto: as 1, but a QP whose peer does not resolve falls back to a real QP"),
];

/// `KRCORE_VIRTUALIZE`: whether ordinary RC QPs become VQPs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Virtualize {
    Off,
    On,
    /// On, with a real QP behind each VQP for peers that do not resolve.
    Auto,
}

impl Virtualize {
    fn parse(v: Option<String>) -> Virtualize {
        match v.as_deref().map(str::trim) {
            None | Some("0") | Some("off") | Some("no") => Virtualize::Off,
            Some("auto") => Virtualize::Auto,
            _ => Virtualize::On,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Virtualize::Off => "0",
            Virtualize::On => "1",
            Virtualize::Auto => "auto",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    pub log: Level,
    pub stats_at_exit: bool,
    pub stats_file: Option<String>,
    pub ibverbs_lib: String,
    pub mr_cache: bool,
    pub mr_cache_bytes: Option<usize>,
    pub mr_cache_entries: usize,
    pub mr_dereg_batch: usize,
    pub meta: Option<String>,
    /// `KRCORE_NODE`: None is off.
    pub node: Option<std::path::PathBuf>,
    pub gid_index: Option<u32>,
    pub connect_timeout_ms: u64,
    pub meta_lease_ms: u64,
    pub mr_lease_ms: u64,
    pub links_per_peer: u32,
    pub staging_bytes: usize,
    pub link_probe_ms: u64,
    pub max_links: usize,
    pub max_peer_links: usize,
    pub link_window: u32,
    pub max_gid_links: usize,
    pub max_ahs: usize,
    pub dgram_flows_per_gid: usize,
    pub max_senders: usize,
    pub max_senders_per_gid: usize,
    pub mr_check_misses: u32,
    pub link_idle_ms: u64,
    pub dgram: bool,
    pub prestart: bool,
    pub link_after: u64,
    pub dgram_rto_us: u64,
    pub test_dgram_loss: u64,
    pub virtualize: Virtualize,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl Config {
    /// How often the links are looked after (probes, reclaim, closes):
    /// every `KRCORE_LINK_PROBE_MS`, or every second when probes are off.
    pub fn link_tick_ms(&self) -> u64 {
        if self.link_probe_ms > 0 {
            self.link_probe_ms
        } else {
            1000
        }
    }

    pub fn from_env() -> Config {
        let log = var("KRCORE_LOG").map_or(Level::Off, |v| Level::parse(&v).unwrap_or(Level::Info));
        Config {
            log,
            stats_at_exit: var("KRCORE_STATS").is_some_and(|v| v != "0"),
            stats_file: var("KRCORE_STATS_FILE"),
            ibverbs_lib: var("KRCORE_IBVERBS_LIB").unwrap_or_else(|| "libibverbs.so.1".into()),
            mr_cache: var("KRCORE_MR_CACHE").is_none_or(|v| v != "0"),
            mr_cache_bytes: var("KRCORE_MR_CACHE_BYTES").and_then(|v| v.parse().ok()),
            mr_cache_entries: var("KRCORE_MR_CACHE_ENTRIES").and_then(|v| v.parse().ok()).unwrap_or(1024),
            mr_dereg_batch: var("KRCORE_MR_DEREG_BATCH").and_then(|v| v.parse().ok()).unwrap_or(16),
            meta: var("KRCORE_META"),
            node: match var("KRCORE_NODE") {
                Some(v) if v == "off" || v == "0" => None,
                Some(v) => Some(v.into()),
                None => Some(crate::node::default_socket()),
            },
            gid_index: var("KRCORE_GID_INDEX").and_then(|v| v.parse().ok()),
            connect_timeout_ms: var("KRCORE_CONNECT_TIMEOUT_MS").and_then(|v| v.parse().ok()).unwrap_or(2000).max(1),
            meta_lease_ms: var("KRCORE_META_LEASE_MS").and_then(|v| v.parse().ok()).unwrap_or(10_000).max(30),
            mr_lease_ms: var("KRCORE_MR_LEASE_MS").and_then(|v| v.parse().ok()).unwrap_or(5000),
            links_per_peer: var("KRCORE_LINKS_PER_PEER").and_then(|v| v.parse().ok()).unwrap_or(1).clamp(1, 64),
            staging_bytes: var("KRCORE_STAGING_BYTES").and_then(|v| v.parse().ok()).unwrap_or(4 << 20),
            link_probe_ms: var("KRCORE_LINK_PROBE_MS").and_then(|v| v.parse().ok()).unwrap_or(1000),
            max_links: var("KRCORE_MAX_LINKS").and_then(|v| v.parse().ok()).unwrap_or(64),
            max_peer_links: var("KRCORE_MAX_PEER_LINKS").and_then(|v| v.parse().ok()).unwrap_or(4),
            link_window: var("KRCORE_LINK_WINDOW_BYTES")
                .and_then(|v| v.parse().ok())
                .unwrap_or(1 << 20)
                .clamp(crate::service::credit::MIN_WINDOW, 1 << 30),
            max_gid_links: var("KRCORE_MAX_GID_LINKS").and_then(|v| v.parse().ok()).unwrap_or(256).max(1),
            max_ahs: var("KRCORE_MAX_AHS").and_then(|v| v.parse().ok()).unwrap_or(1024).max(1),
            dgram_flows_per_gid: var("KRCORE_DGRAM_FLOWS_PER_GID").and_then(|v| v.parse().ok()).unwrap_or(1024).max(1),
            max_senders: var("KRCORE_MAX_SENDERS").and_then(|v| v.parse().ok()).unwrap_or(16384).max(1),
            max_senders_per_gid: var("KRCORE_MAX_SENDERS_PER_GID").and_then(|v| v.parse().ok()).unwrap_or(1024).max(1),
            mr_check_misses: var("KRCORE_MR_CHECK_MISSES").and_then(|v| v.parse().ok()).unwrap_or(16),
            link_idle_ms: var("KRCORE_LINK_IDLE_MS").and_then(|v| v.parse().ok()).unwrap_or(1000),
            dgram: var("KRCORE_DGRAM").is_none_or(|v| v != "0"),
            prestart: var("KRCORE_PRESTART").is_none_or(|v| v != "0"),
            link_after: var("KRCORE_LINK_AFTER").and_then(|v| v.parse().ok()).unwrap_or(0),
            dgram_rto_us: var("KRCORE_DGRAM_RTO_US").and_then(|v| v.parse().ok()).unwrap_or(4000).max(500),
            test_dgram_loss: var("KRCORE_TEST_DGRAM_LOSS").and_then(|v| v.parse().ok()).unwrap_or(0),
            virtualize: Virtualize::parse(var("KRCORE_VIRTUALIZE")),
        }
    }

    /// `NAME=value` lines, for `krcore_config_dump`.
    pub fn dump(&self) -> String {
        let lvl = format!("{:?}", self.log).to_ascii_lowercase();
        // One value per variable, in their order (checked by the type).
        let vals: [String; VARIABLES.len()] = [
            lvl,
            (self.stats_at_exit as u8).to_string(),
            self.stats_file.clone().unwrap_or_default(),
            self.ibverbs_lib.clone(),
            (self.mr_cache as u8).to_string(),
            self.mr_cache_bytes.map_or("default".into(), |b| b.to_string()),
            self.mr_cache_entries.to_string(),
            self.mr_dereg_batch.to_string(),
            self.meta.clone().unwrap_or_default(),
            self.node.as_ref().map_or("off".into(), |p| p.display().to_string()),
            self.gid_index.map_or("default".into(), |i| i.to_string()),
            self.connect_timeout_ms.to_string(),
            self.meta_lease_ms.to_string(),
            self.mr_lease_ms.to_string(),
            self.links_per_peer.to_string(),
            self.staging_bytes.to_string(),
            self.link_probe_ms.to_string(),
            self.max_links.to_string(),
            self.max_peer_links.to_string(),
            self.link_window.to_string(),
            self.max_gid_links.to_string(),
            self.max_ahs.to_string(),
            self.max_senders.to_string(),
            self.max_senders_per_gid.to_string(),
            self.dgram_flows_per_gid.to_string(),
            self.mr_check_misses.to_string(),
            self.link_idle_ms.to_string(),
            (self.dgram as u8).to_string(),
            (self.prestart as u8).to_string(),
            self.link_after.to_string(),
            self.dgram_rto_us.to_string(),
            self.test_dgram_loss.to_string(),
            self.virtualize.name().to_string(),
        ];
        VARIABLES.iter().zip(vals).map(|((name, _, _), v)| format!("{name}={v}\n")).collect()
    }
}

static CONFIG: Lazy<Config> = Lazy::new(Config::from_env);

pub fn get() -> &'static Config {
    &CONFIG
}
