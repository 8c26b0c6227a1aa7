//! `KRCORE_LOG` logging to stderr, off by default.
//!
//! We live inside other people's processes: no global logger is installed,
//! lines are formatted into one buffer and written with a single `write(2)`
//! so they never interleave with the application's own output mid-line.

use std::sync::atomic::{AtomicU8, Ordering};

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
#[repr(u8)]
pub enum Level {
    Off = 0,
    Error = 1,
    Warn = 2,
    Info = 3,
    Debug = 4,
}

impl Level {
    pub fn parse(s: &str) -> Option<Level> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "" | "0" | "off" | "none" => Level::Off,
            "error" => Level::Error,
            "warn" | "warning" => Level::Warn,
            "1" | "info" => Level::Info,
            "debug" | "trace" | "2" => Level::Debug,
            _ => return None,
        })
    }
}

/// 0xff: not read from the environment yet.
static LEVEL: AtomicU8 = AtomicU8::new(0xff);

#[inline]
pub fn enabled(level: Level) -> bool {
    let mut cur = LEVEL.load(Ordering::Relaxed);
    if cur == 0xff {
        cur = crate::config::get().log as u8;
        LEVEL.store(cur, Ordering::Relaxed);
    }
    level as u8 <= cur
}

#[doc(hidden)]
pub fn write_line(level: Level, args: std::fmt::Arguments<'_>) {
    let tag = match level {
        Level::Error => "error",
        Level::Warn => "warn",
        Level::Info => "info",
        _ => "debug",
    };
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    let line = format!("krcore[{pid}] {tag}: {args}\n");
    // SAFETY: writing an initialised buffer of the given length to fd 2.
    unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
}

/// CLOCK_MONOTONIC in microseconds: the clock of [`kmark!`] lines, one
/// clock for every process of the machine, so that the lines of two peers
/// (and a benchmark's own stamps) merge into one timeline.
pub fn mono_us() -> u64 {
    // SAFETY: a plain C struct, filled by the call.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to it.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1_000
}

#[doc(hidden)]
pub fn mark(args: std::fmt::Arguments<'_>) {
    let t = mono_us();
    let me = std::thread::current();
    write_line(Level::Debug, format_args!("mark {t} {}: {args}", me.name().unwrap_or("app")));
}

/// `kmark!("fmt", args...)`: one point of the cold-path timeline (issue
/// 19; `bench/coldpath.sh` reads them), a debug line
/// `mark <CLOCK_MONOTONIC µs> <thread>: <what>`. Off unless
/// `KRCORE_LOG=debug`; only on the control path (runtime start, link
/// handshake, meta-server bootstrap and lookups, control READs), never per
/// data-path operation.
#[macro_export]
macro_rules! kmark {
    ($($arg:tt)*) => {
        if $crate::log::enabled($crate::log::Level::Debug) {
            $crate::log::mark(format_args!($($arg)*));
        }
    };
}

/// `klog!(Level::Info, "fmt", args...)`
#[macro_export]
macro_rules! klog {
    ($lvl:expr, $($arg:tt)*) => {
        if $crate::log::enabled($lvl) {
            $crate::log::write_line($lvl, format_args!($($arg)*));
        }
    };
}
