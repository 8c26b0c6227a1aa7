//! `krcore-node --meta <ip>:<port>`: the per-host agent (see
//! `krcore::node`). Prints one line when it serves, so that scripts and
//! service managers can wait for it; SIGUSR1 prints its statistics;
//! stops on SIGINT or SIGTERM (and removes its socket).

use clap::{value_parser, Arg, Command};
use krcore::node::agent::{Agent, Config};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

static STOP: AtomicBool = AtomicBool::new(false);
static STATS: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

extern "C" fn on_stats(_: libc::c_int) {
    STATS.store(true, Ordering::SeqCst);
}

fn main() {
    let m = Command::new("krcore-node")
        .about("krcore's per-host agent: the host's meta-server connection and lookup cache, shared by its processes over a unix socket")
        .arg(
            Arg::new("meta")
                .long("meta")
                .value_name("IP:PORT[,IP:PORT...]")
                .help("the meta server(s), as the processes' KRCORE_META names them (default: KRCORE_META)"),
        )
        .arg(
            Arg::new("socket")
                .long("socket")
                .value_name("PATH")
                .value_parser(value_parser!(PathBuf))
                .help("where to listen (default: KRCORE_NODE, else $XDG_RUNTIME_DIR/krcore-node.sock, else /tmp/krcore-node-<uid>.sock)"),
        )
        .arg(Arg::new("device").long("device").value_name("NAME").help("RDMA device of the meta-server connection (default: the first)"))
        .arg(
            Arg::new("gid-index")
                .long("gid-index")
                .value_name("N")
                .value_parser(value_parser!(u32))
                .help("its GID (default: the one the kernel routes to the first meta server from, else the first RoCE v2 / IB GID)"),
        )
        .arg(
            Arg::new("max-clients")
                .long("max-clients")
                .value_name("N")
                .default_value("4096")
                .value_parser(value_parser!(u32).range(1..))
                .help("processes attached at once; one beyond is refused (it then looks up by itself)"),
        )
        .arg(
            Arg::new("timeout-ms")
                .long("timeout-ms")
                .value_name("MS")
                .default_value("1000")
                .value_parser(value_parser!(u64).range(1..))
                .help(
                    "bound on a wait for the meta server (below the processes' KRCORE_CONNECT_TIMEOUT_MS, so that they hear of a failure)",
                ),
        )
        .get_matches();
    let spec = m.get_one::<String>("meta").cloned().or_else(|| std::env::var("KRCORE_META").ok().filter(|v| !v.is_empty()));
    let Some(spec) = spec else {
        eprintln!("krcore-node: no meta server: --meta <ip>:<port> (or KRCORE_META)");
        std::process::exit(2);
    };
    let meta = match krcore::meta::client::parse_addrs(&spec) {
        Ok(a) => a,
        Err(_) => {
            eprintln!("krcore-node: --meta {spec}: not <ip>:<port>[,<ip>:<port>...]");
            std::process::exit(2);
        }
    };
    // The agent's own VQPs (the library in this process) use these meta
    // servers, and never look for an agent.
    std::env::set_var("KRCORE_META", &spec);
    let node_env = std::env::var_os("KRCORE_NODE");
    std::env::set_var("KRCORE_NODE", "off");
    // Its registrations are its staging regions, each for a process's
    // life: registered and deregistered for real (a cache would hold the
    // pages of regions already gone).
    std::env::set_var("KRCORE_MR_CACHE", "0");
    // Its own VQPs leave from the GID it serves (else the library's
    // default: the one routed to the meta server).
    if let Some(i) = m.get_one::<u32>("gid-index") {
        std::env::set_var("KRCORE_GID_INDEX", i.to_string());
    }
    let socket = m.get_one::<PathBuf>("socket").cloned().unwrap_or_else(|| match node_env {
        Some(p) if !p.is_empty() && p != "off" => p.into(),
        _ => krcore::node::default_socket(),
    });
    let cfg = Config {
        socket,
        meta,
        device: m.get_one::<String>("device").cloned(),
        gid_index: m.get_one::<u32>("gid-index").copied(),
        max_clients: *m.get_one::<u32>("max-clients").expect("defaulted") as usize,
        timeout: Duration::from_millis(*m.get_one::<u64>("timeout-ms").expect("defaulted")),
    };
    // SAFETY: the handlers only store atomics.
    unsafe {
        libc::signal(libc::SIGINT, on_stop as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_stop as *const () as libc::sighandler_t);
        libc::signal(libc::SIGUSR1, on_stats as *const () as libc::sighandler_t);
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    let mut agent = match Agent::new(&cfg) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("krcore-node: cannot serve at {}: {e:?}", cfg.socket.display());
            std::process::exit(1);
        }
    };
    println!(
        "krcore-node: serving at {} (meta {spec}, device {}, GID index {}, meta server {})",
        agent.socket().display(),
        agent.device_name(),
        agent.gid_index(),
        if agent.meta_connected() { "connected" } else { "not reached yet" }
    );
    let print = |a: &Agent| {
        println!("krcore-node: stats attached={} spares={}/{} {:?}", a.attached(), a.spares(), krcore::node::agent::SPARES, a.counts())
    };
    let r = agent.run(&|| STOP.load(Ordering::SeqCst), &mut |a| {
        if STATS.swap(false, Ordering::SeqCst) {
            print(a);
        }
    });
    print(&agent);
    if let Err(e) = r {
        eprintln!("krcore-node: {e:?}");
        std::process::exit(1);
    }
}
