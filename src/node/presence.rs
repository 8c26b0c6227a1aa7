//! The agent vouches at the meta server for its attached processes: one
//! that binds nothing has no meta-server connection of its own, so a peer
//! in doubt about it would otherwise learn nothing there (docs/vqp.md,
//! "Presence"; docs/node.md, "Presence of attached processes").
//!
//! A process names each of its service endpoints (`PRESENT`: incarnation
//! and GID); the agent vouches for it on its own connection, under a GID
//! of its device (its connection proves it first, as the process could:
//! one on another device is not vouched for), never for an incarnation
//! another process presented.
//! When the process's socket closes, its pidfd says whether it exited:
//! then it departed; a process that closed its socket and lives (it gave
//! the agent up after a slow answer) is released, unknown, as is every
//! process of an agent that dies (the meta server releases what a closed
//! connection vouched for).

use crate::error::{Errno, Result};
use crate::meta::client::MetaClient;
use crate::rdma::Gid;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// Service endpoints (one per protection domain's runtime) one process
/// may present.
pub const MAX_PER_PROCESS: usize = 8;

/// How long a process whose socket closed is watched for its exit (the
/// kernel closes a dying process's files before it reports the exit).
pub const EXIT_WAIT: Duration = Duration::from_secs(1);

/// What the agent vouches for one attached process.
#[derive(Default)]
pub struct Vouched {
    /// Readable once the process exited (`pidfd_open`, made at its first
    /// `PRESENT`; None where the kernel has none).
    pidfd: Option<OwnedFd>,
    /// Exited before its first `PRESENT` was read (`pidfd_open` found no
    /// such process: it was killed and reaped meanwhile).
    gone: bool,
    endpoints: Vec<(u64, Gid)>,
}

impl Vouched {
    pub fn vouches_for(&self, incarnation: u64) -> bool {
        self.endpoints.iter().any(|(i, _)| *i == incarnation)
    }

    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }

    /// Vouch for endpoint `incarnation` at `gid` of process `pid` on
    /// `meta` (the caller checked that `gid` is on the agent's device and
    /// that no other process presented `incarnation`).
    pub fn add(&mut self, meta: &MetaClient, pid: i32, incarnation: u64, gid: &Gid) -> Result<()> {
        if incarnation == 0 {
            return Err(Errno::EINVAL);
        }
        if self.vouches_for(incarnation) {
            return Ok(());
        }
        if self.endpoints.len() >= MAX_PER_PROCESS {
            return Err(Errno(libc::EDQUOT));
        }
        if self.pidfd.is_none() && !self.gone {
            match pidfd_open(pid) {
                Ok(fd) => self.pidfd = Some(fd),
                Err(e) => self.gone = e.0 == libc::ESRCH,
            }
        }
        meta.vouch(incarnation, gid)?;
        self.endpoints.push((incarnation, *gid));
        Ok(())
    }

    /// Whether the process exited (false: it lives, or we cannot tell).
    fn exited(&self) -> bool {
        self.gone || self.pidfd.as_ref().is_some_and(|fd| crate::poll::readable(fd.as_raw_fd(), 0))
    }

    /// Vouch for none of its endpoints any more: `departed` or released.
    fn end(self, meta: Option<&MetaClient>, departed: bool) {
        if let Some(m) = meta {
            for (incarnation, gid) in &self.endpoints {
                m.unvouch(*incarnation, gid, departed);
            }
        }
    }
}

/// Processes whose socket closed, watched until their exit is seen or
/// [`EXIT_WAIT`] passed.
#[derive(Default)]
pub struct Leaving {
    watched: Vec<(Vouched, Instant)>,
    /// Endpoints said departed and released so far (statistics).
    pub departed: u64,
    pub released: u64,
}

impl Leaving {
    /// A process's socket closed: what the agent vouched for it ends now
    /// (it exited, or it cannot be watched) or once it is seen to exit.
    pub fn add(&mut self, v: Vouched, meta: Option<&MetaClient>) {
        if v.is_empty() {
            return;
        }
        if v.exited() || v.pidfd.is_none() {
            let departed = v.exited();
            self.count(&v, departed);
            v.end(meta, departed);
            return;
        }
        self.watched.push((v, Instant::now() + EXIT_WAIT));
    }

    /// Whether a leaving process presented `incarnation` (still vouched for).
    pub fn vouches_for(&self, incarnation: u64) -> bool {
        self.watched.iter().any(|(v, _)| v.vouches_for(incarnation))
    }

    /// The descriptors to wait on (readable: a process exited).
    pub fn fds(&self) -> impl Iterator<Item = i32> + '_ {
        self.watched.iter().filter_map(|(v, _)| v.pidfd.as_ref().map(AsRawFd::as_raw_fd))
    }

    /// Milliseconds until the next one's watch ends (None: none watched).
    pub fn next_ms(&self) -> Option<i32> {
        let next = self.watched.iter().map(|(_, until)| *until).min()?;
        Some(next.saturating_duration_since(Instant::now()).as_millis().min(i32::MAX as u128) as i32 + 1)
    }

    /// End the watches that are over: exited (departed), or past their
    /// time (released).
    pub fn check(&mut self, meta: Option<&MetaClient>) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.watched.len() {
            let (v, until) = &self.watched[i];
            let departed = v.exited();
            if departed || now >= *until {
                let (v, _) = self.watched.swap_remove(i);
                self.count(&v, departed);
                v.end(meta, departed);
            } else {
                i += 1;
            }
        }
    }

    fn count(&mut self, v: &Vouched, departed: bool) {
        let n = v.endpoints.len() as u64;
        if departed {
            self.departed += n;
        } else {
            self.released += n;
        }
    }
}

/// A pidfd for `pid` (ESRCH: no such process, it exited; ENOSYS: no
/// `pidfd_open` on this kernel).
fn pidfd_open(pid: i32) -> Result<OwnedFd> {
    // SAFETY: plain syscall; the fd returned is owned below.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_process_has_not_exited_and_a_reaped_child_has() {
        // SAFETY: getpid has no preconditions.
        let me = Vouched { pidfd: pidfd_open(unsafe { libc::getpid() }).ok(), gone: false, endpoints: vec![(7, [1; 16])] };
        if me.pidfd.is_none() {
            return; // no pidfd_open on this kernel: processes are released, never departed
        }
        assert!(!me.exited());
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let v = Vouched { pidfd: pidfd_open(child.id() as i32).ok(), gone: false, endpoints: vec![(8, [1; 16])] };
        child.wait().expect("wait");
        assert!(v.exited());
        let mut l = Leaving::default();
        l.add(v, None);
        assert_eq!((l.departed, l.released), (1, 0));
        assert!(!l.vouches_for(8));
        // Reaped before its pidfd was asked for: no such process, exited.
        assert_eq!(pidfd_open(child.id() as i32).err(), Some(Errno(libc::ESRCH)));
        l.add(Vouched { pidfd: None, gone: true, endpoints: vec![(9, [1; 16])] }, None);
        assert_eq!((l.departed, l.released), (2, 0));
        // No pidfd (none on this kernel): released, never departed.
        l.add(Vouched { pidfd: None, gone: false, endpoints: vec![(10, [1; 16])] }, None);
        assert_eq!((l.departed, l.released), (2, 1));
    }

    #[test]
    fn a_watch_that_outlives_its_wait_is_released() {
        // SAFETY: getpid has no preconditions.
        let me = Vouched { pidfd: pidfd_open(unsafe { libc::getpid() }).ok(), gone: false, endpoints: vec![(9, [1; 16]), (10, [1; 16])] };
        if me.pidfd.is_none() {
            return;
        }
        let mut l = Leaving::default();
        l.add(me, None);
        assert!(l.vouches_for(10));
        assert_eq!(l.fds().count(), 1);
        l.check(None);
        assert_eq!((l.departed, l.released), (0, 0), "watched until EXIT_WAIT");
        l.watched[0].1 = Instant::now();
        l.check(None);
        assert_eq!((l.departed, l.released), (0, 2));
        assert!(l.next_ms().is_none());
        // Nothing presented: nothing watched.
        l.add(Vouched::default(), None);
        assert_eq!(l.fds().count(), 0);
    }
}
