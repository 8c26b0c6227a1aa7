//! A process's attachment to its host's agent: made at the first need (the
//! runtime's start, maybe at `ibv_alloc_pd`; a lookup), one `SOCK_SEQPACKET`
//! connection at `KRCORE_NODE`, kept for the process's life. The agent
//! must run as this process's user or root (`SO_PEERCRED`) and serve the
//! meta servers of this process's `KRCORE_META`, else it is not used.
//! Without an agent everything works as before: one info line says so,
//! and the process looks again at most once a second.
//!
//! The lock is held across a lookup's round trip (bounded by
//! `KRCORE_CONNECT_TIMEOUT_MS`); a forked child, where the thread that
//! held it does not exist, gets it released by the atfork handler and
//! attaches anew (the parent's connection is not its own).

use super::agent::{peer_cred, same_user, seqpacket, unix_addr};
use super::proto::Message;
use crate::error::{Errno, Result};
use crate::klog;
use crate::log::Level;
use crate::meta::{Endpoint, Key};
use parking_lot::Mutex;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

enum State {
    Unknown,
    /// No agent (or one not to be used): looked for again after this.
    Absent(Instant),
    Attached(Attached),
}

struct Attached {
    fd: OwnedFd,
    pid: libc::pid_t,
    next_id: u32,
}

static NODE: Mutex<State> = Mutex::new(State::Unknown);
/// This process's service endpoints named to the agent (`PRESENT`), named
/// again to an agent attached anew (one restarted); by the pid that named
/// them (a forked child names only its own).
static PRESENTED: Mutex<Vec<(libc::pid_t, u64, [u8; 16])>> = Mutex::new(Vec::new());
/// The first absence is said at info level, later ones at debug.
static SAID: AtomicBool = AtomicBool::new(false);

const LOOK_AGAIN: Duration = Duration::from_secs(1);

extern "C" fn in_forked_child() {
    release_in_child(&NODE);
    release_in_child(&PRESENTED);
}

/// In a forked child (an atfork handler): release `m` if it was held, by
/// a thread that does not exist here. What it guards is checked against
/// the pid at its next use.
pub(crate) fn release_in_child<T>(m: &Mutex<T>) {
    if m.is_locked() {
        // SAFETY: only the forking thread exists in the child; the lock's
        // holder is gone.
        unsafe { m.force_unlock() };
    }
}

pub(crate) fn pid() -> libc::pid_t {
    // SAFETY: getpid has no preconditions.
    unsafe { libc::getpid() }
}

/// Attach now if not yet (and not looked for within the last second):
/// whether this process is attached.
pub fn attach() -> bool {
    with_attached(|_| Ok(())).is_some()
}

/// Name this process's service endpoint (`incarnation`, at `gid`) to the
/// agent, which vouches for it at the meta server while the process is
/// attached (it has no meta-server connection of its own to do so:
/// `src/node/presence.rs`). Nothing without an agent.
pub fn present(incarnation: u64, gid: [u8; 16]) {
    PRESENTED.lock().push((pid(), incarnation, gid));
    if let Some(Err(e)) = with_attached(|a| send(&a.fd, &Message::Present { incarnation, gid })) {
        klog!(Level::Debug, "node: PRESENT not sent: {e:?}");
    }
}

/// The endpoint bound at `key` as the agent finds it (`fresh`: read from
/// the meta server now). None when there is no agent or it could not
/// answer (counted: `node_fallbacks`): the caller looks it up itself.
pub fn lookup(key: &Key, fresh: bool) -> Option<Option<Endpoint>> {
    let r = with_attached(|a| {
        a.next_id = a.next_id.wrapping_add(1);
        let id = a.next_id;
        send(&a.fd, &Message::Lookup { id, key: *key, fresh })?;
        let deadline = Instant::now() + crate::vqp::runtime::connect_timeout();
        loop {
            // Answers to lookups given up on (timed out) come first.
            match receive(&a.fd, deadline)? {
                Message::Found { id: got, result } if got == id => return Ok(result),
                Message::Found { .. } => continue,
                _ => return Err(Errno(libc::EPROTO)),
            }
        }
    });
    match r.map(|r| r.and_then(|answer| answer.map_err(|e| Errno(e as i32)))) {
        Some(Ok(found)) => {
            crate::stats::inc(crate::stats::Stat::KRCORE_STAT_NODE_LOOKUPS);
            Some(found)
        }
        Some(Err(e)) => {
            crate::stats::inc(crate::stats::Stat::KRCORE_STAT_NODE_FALLBACKS);
            klog!(Level::Debug, "node: the agent did not answer a lookup ({e:?}): looked up by this process");
            None
        }
        None => None,
    }
}

/// Run `f` on the attachment (made first if needed). None: no agent. An
/// error of `f` (the connection's: the agent's own answers are in `T`)
/// drops the attachment.
fn with_attached<T>(f: impl FnOnce(&mut Attached) -> Result<T>) -> Option<Result<T>> {
    let path = crate::config::get().node.as_ref()?;
    let mut st = NODE.lock();
    if matches!(&*st, State::Attached(a) if a.pid != pid()) {
        // A forked child's copy of its parent's connection.
        *st = State::Unknown;
    }
    match &*st {
        State::Absent(until) if Instant::now() < *until => return None,
        State::Attached(_) => {}
        _ => match connect(path) {
            Ok(a) => {
                klog!(Level::Info, "node: attached to the agent at {}", path.display());
                *st = State::Attached(a);
            }
            Err(why) => {
                let level = if SAID.swap(true, Ordering::Relaxed) { Level::Debug } else { Level::Info };
                klog!(level, "node: no krcore-node agent at {} ({why}): this process makes its own meta-server connection", path.display());
                *st = State::Absent(Instant::now() + LOOK_AGAIN);
                return None;
            }
        },
    }
    let State::Attached(a) = &mut *st else { unreachable!("attached above") };
    let r = f(a);
    if r.is_err() {
        *st = State::Absent(Instant::now() + LOOK_AGAIN);
    }
    Some(r)
}

/// Connect to the agent at `path`, check who it is, and say hello. Err:
/// why it is not used.
fn connect(path: &std::path::Path) -> std::result::Result<Attached, String> {
    static ATFORK: std::sync::Once = std::sync::Once::new();
    ATFORK.call_once(|| {
        // SAFETY: registers a handler that only releases a lock no
        // thread of the child holds.
        unsafe { libc::pthread_atfork(None, None, Some(in_forked_child)) };
    });
    crate::kmark!("node: attaching");
    let fd = open(path, None)?;
    crate::kmark!("node: attached");
    // Attached anew (the agent restarted): named again. A forked child
    // named none of its parent's (its own runtime names its own).
    let mut presented = PRESENTED.lock();
    presented.retain(|(by, ..)| *by == pid());
    for (_, incarnation, gid) in presented.iter() {
        send(&fd, &Message::Present { incarnation: *incarnation, gid: *gid }).map_err(|e| format!("PRESENT: {e:?}"))?;
    }
    Ok(Attached { fd, pid: pid(), next_id: 0 })
}

/// A second connection to the agent this process is attached to (the
/// data path's: `transport::agent`), welcomed, `first` sent on it right
/// after the `HELLO` (one round trip for both). None when not attached.
pub fn open_another(first: &Message) -> Option<OwnedFd> {
    let path = crate::config::get().node.as_ref()?;
    if !attach() {
        return None;
    }
    open(path, Some(first)).inspect_err(|why| klog!(Level::Info, "node: a second connection to the agent: {why}")).ok()
}

/// A connection to the agent at `path`, its user checked, welcomed
/// (`first` sent behind the `HELLO`, its answer left to the caller).
fn open(path: &std::path::Path, first: Option<&Message>) -> std::result::Result<OwnedFd, String> {
    let fd = seqpacket().map_err(|e| format!("socket: {e:?}"))?;
    let (addr, len) = unix_addr(path).map_err(|e| format!("{e:?}"))?;
    // SAFETY: `addr` is a live sockaddr_un of `len` bytes.
    if unsafe { libc::connect(fd.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len) } != 0 {
        return Err(format!("connect: {}", std::io::Error::last_os_error()));
    }
    let cred = peer_cred(fd.as_raw_fd()).map_err(|e| format!("SO_PEERCRED: {e:?}"))?;
    if !same_user(cred.uid) {
        klog!(Level::Warn, "node: the process at {} (pid {}) runs as uid {}: not used", path.display(), cred.pid, cred.uid);
        return Err(format!("listener of uid {}", cred.uid));
    }
    let deadline = Instant::now() + crate::vqp::runtime::connect_timeout();
    send(&fd, &Message::Hello { pid: pid() as u32 }).map_err(|e| format!("hello: {e:?}"))?;
    if let Some(m) = first {
        send(&fd, m).map_err(|e| format!("{m:?}: {e:?}"))?;
    }
    let Message::Welcome { fingerprint, .. } = receive(&fd, deadline).map_err(|e| format!("welcome: {e:?}"))? else {
        return Err("no welcome".into());
    };
    let ours = crate::config::get().meta.as_deref().and_then(|s| crate::meta::client::parse_addrs(s).ok());
    if ours.as_deref().map(super::meta_fingerprint) != Some(fingerprint) {
        return Err("it serves other meta servers than KRCORE_META".into());
    }
    Ok(fd)
}

pub(crate) fn send(fd: &OwnedFd, m: &Message) -> Result<()> {
    let b = m.encode();
    // SAFETY: `b` is a live buffer of its length.
    let n = unsafe { libc::send(fd.as_raw_fd(), b.as_ptr().cast(), b.len(), libc::MSG_NOSIGNAL) };
    if n == b.len() as isize {
        Ok(())
    } else if n < 0 {
        Err(Errno::last())
    } else {
        Err(Errno(libc::EPIPE))
    }
}

/// The next message, waited for until `deadline` (ETIMEDOUT), asleep; a
/// descriptor passed with it is closed.
pub(crate) fn receive(fd: &OwnedFd, deadline: Instant) -> Result<Message> {
    receive_with_fd(fd, deadline).map(|(m, _)| m)
}

/// The next message and the descriptor passed with it (`SCM_RIGHTS`),
/// waited for until `deadline` (ETIMEDOUT), asleep.
pub(crate) fn receive_with_fd(fd: &OwnedFd, deadline: Instant) -> Result<(Message, Option<OwnedFd>)> {
    use super::agent::{receive, Received};
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one live pollfd.
        let r = unsafe { libc::poll(&mut p, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if r < 0 && Errno::last().0 == libc::EINTR {
            continue;
        }
        if r <= 0 {
            return Err(Errno(if r == 0 { libc::ETIMEDOUT } else { Errno::last().0 }));
        }
        match receive(fd.as_raw_fd()) {
            Received::Nothing => continue,
            Received::Gone => return Err(Errno(libc::ECONNRESET)),
            Received::Message(m, passed) => return Ok((m?, passed)),
        }
    }
}
