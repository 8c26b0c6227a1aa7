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

/// `klog!(Level::Info, "fmt", args...)`
#[macro_export]
macro_rules! klog {
    ($lvl:expr, $($arg:tt)*) => {
        if $crate::log::enabled($lvl) {
            $crate::log::write_line($lvl, format_args!($($arg)*));
        }
    };
}
