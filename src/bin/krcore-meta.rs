//! `krcore-meta --listen <ip>:<port>`: the meta server (see
//! `krcore::meta::server`). Prints one line when it serves, so that
//! scripts can wait for it; stops on SIGINT or SIGTERM.

use clap::{value_parser, Arg, Command};
use krcore::meta::server::{Config, Server};
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn main() {
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
        .get_matches();
    let cfg = Config {
        listen: *m.get_one::<SocketAddrV4>("listen").expect("required"),
        slots: *m.get_one::<u32>("slots").expect("defaulted"),
        max_lease: Duration::from_millis(*m.get_one::<u64>("max-lease-ms").expect("defaulted")),
        device: m.get_one::<String>("device").cloned(),
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
    if let Err(e) = server.run(&|| STOP.load(Ordering::SeqCst)) {
        eprintln!("krcore-meta: {e:?}");
        std::process::exit(1);
    }
}
