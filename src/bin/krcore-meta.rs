//! `krcore-meta --listen <ip>:<port>`: the meta server (see
//! `krcore::meta::server`). Prints one line when it serves, so that
//! scripts can wait for it; stops on SIGINT or SIGTERM.
//!
//! The `--max-*` options bound what the processes that connect make it
//! hold (`Limits`); their defaults are far above an honest deployment.

use clap::{value_parser, Arg, Command};
use krcore::meta::server::{Config, Limits, Server};
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn main() {
    raise_nofile();
    let d = Limits::default();
    let m = Command::new("krcore-meta")
        .about("Serves krcore's (GID, port) -> endpoint table over RDMA")
        .arg(
            Arg::new("listen")
                .long("listen")
                .required(true)
                .value_name("IP:PORT")
                .value_parser(value_parser!(SocketAddrV4))
                .help("TCP address for bootstrap; the RDMA device whose GIDs include IP serves the table"),
        )
        .arg(
            Arg::new("slots")
                .long("slots")
                .value_name("N")
                .default_value("65536")
                .value_parser(value_parser!(u32).range(8..=(1 << 24)))
                .help("table slots (entries it can hold, about)"),
        )
        .arg(
            Arg::new("max-lease-ms")
                .long("max-lease-ms")
                .value_name("MS")
                .default_value("30000")
                .value_parser(value_parser!(u64).range(1..))
                .help("longest lease granted to a registration"),
        )
        .arg(Arg::new("device").long("device").value_name("NAME").help("RDMA device (default: the first)"))
        .arg(bound("max-clients", d.clients, "connected clients (each holds an RC QP here); a connection or Hello beyond is refused"))
        .arg(bound(
            "max-clients-per-ip",
            d.clients_per_ip,
            "connections from one source address (clients and those owing their Hello); one beyond is reset",
        ))
        .arg(bound("max-pending", d.pending, "connections owing their Hello (queriers included); one beyond is reset"))
        .arg(bound("max-entries-per-client", d.entries_per_client, "entries one client holds; a Bind beyond is answered EDQUOT"))
        .arg(bound(
            "max-gids-per-client",
            d.gids_per_client as u32,
            "GIDs one client proves (it binds keys under proven GIDs only); a proof beyond is dropped",
        ))
        .get_matches();
    let n = |name: &str| *m.get_one::<u32>(name).expect("defaulted");
    let limits = Limits {
        clients: n("max-clients") as usize,
        clients_per_ip: n("max-clients-per-ip") as usize,
        pending: n("max-pending") as usize,
        entries_per_client: n("max-entries-per-client"),
        gids_per_client: n("max-gids-per-client") as usize,
    };
    let cfg = Config {
        listen: *m.get_one::<SocketAddrV4>("listen").expect("required"),
        slots: *m.get_one::<u32>("slots").expect("defaulted"),
        max_lease: Duration::from_millis(*m.get_one::<u64>("max-lease-ms").expect("defaulted")),
        device: m.get_one::<String>("device").cloned(),
        limits,
    };
    // SAFETY: the handler only stores an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let mut server = match Server::new(&cfg) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("krcore-meta: cannot serve on {}: {e:?}", cfg.listen);
            std::process::exit(1);
        }
    };
    println!(
        "krcore-meta: serving on {} (device {}, GID index {}, {} slots)",
        server.local_addr().map_or_else(|_| cfg.listen.to_string(), |a| a.to_string()),
        server.device_name(),
        server.gid_index(),
        cfg.slots
    );
    let r = server.run(&|| STOP.load(Ordering::SeqCst));
    let refused = server.refused();
    if refused != Default::default() {
        eprintln!("krcore-meta: refused {refused:?} (bounds {:?})", server.limits());
    }
    if let Err(e) = r {
        eprintln!("krcore-meta: {e:?}");
        std::process::exit(1);
    }
}

/// A `--max-*` bound of `Limits`: a positive count, its default shown.
fn bound(name: &'static str, default: impl ToString, help: &'static str) -> Arg {
    Arg::new(name)
        .long(name)
        .value_name("N")
        .default_value(default.to_string().leak() as &str)
        .value_parser(value_parser!(u32).range(1..))
        .help(help)
}

/// Each client and each connection owing its `Hello` holds a descriptor:
/// as many as the hard limit allows (out of them, the server resets new
/// connections).
fn raise_nofile() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain syscalls on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}
