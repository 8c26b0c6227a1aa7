//! Waiting on one descriptor, as the library's sockets and process
//! handles need (the agent's path, a meta server's connection, an attached
//! process's pidfd).

use std::os::fd::RawFd;

/// Whether `fd` has something to read, or hung up, within `ms`
/// milliseconds (0: look only; -1: no bound).
pub fn readable(fd: RawFd, ms: i32) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd; the caller's descriptor stays open across
    // the call.
    unsafe { libc::poll(&mut p, 1, ms) > 0 }
}
