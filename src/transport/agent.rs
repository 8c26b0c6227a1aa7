//! The agent's path: a VQP's first one-sided work requests carried by the
//! host's agent (`krcore-node`, `src/node/`) until this process's own link
//! to the peer is up (`src/vqp/qp/agent.rs` decides and makes the move).
//!
//! One per process, made at the first need (the runtime's start, when the
//! process is attached): a connection of its own to the agent, and a
//! staging region the agent made and registered before it was asked for
//! (a memfd, passed with `STAGED`), mapped here. A work request takes a
//! slot of the region: a WRITE's bytes are copied in before the request
//! goes into the region's ring (`crate::node::ring`), a READ's copied out
//! when its completion comes back in the other ring. A thread of its own
//! takes the completions and the agent's answers (asleep in `recv` when
//! there are none: the agent rings its doorbell then) and hands each
//! completion to the VQP that posted it ([`User`]). Should the agent go (its connection closes),
//! everything outstanding completes with `IBV_WC_RETRY_EXC_ERR`, as work on
//! an RC QP whose peer went, and the path is not used again.

use crate::error::{Errno, Result};
use crate::klog;
use crate::log::Level;
use crate::meta::Key;
use crate::node::client::{pid, release_in_child};
use crate::node::proto::{Message, Post};
use crate::node::ring::Rings;
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// A unit of the staging region: a work request takes one or more in a
/// row.
pub const SLOT: usize = 16 << 10;
const SLOTS: usize = 64;
/// The largest work request the path carries, 4 slots (a new process's
/// first READ of an object up to 64 KiB; a larger one waits for the
/// process's own runtime, whose path has no copy).
pub const MAX_WR: usize = 4 * SLOT;
// The agent's VQP carries it on its datagram tier until its link is up.
const _: () = assert!(MAX_WR <= crate::transport::dgram::port::MAX_MSG as usize);
/// 1 MiB: the region the agent registered for a process before it asked.
pub const STAGING: usize = SLOT * SLOTS;
/// The region as mapped: its slots, then its rings.
const MAPPED: usize = STAGING + crate::node::ring::LEN;
const _: () = assert!(SLOTS == crate::node::ring::SLOTS && SLOTS == u64::BITS as usize);
/// Work requests one VQP keeps outstanding on the path (the agent's VQP
/// holds more).
pub const WINDOW: usize = 16;

/// What posted work on the path: told of its completions, in order.
pub trait User: Send + Sync {
    fn done(&self, token: u32, status: u32, byte_len: u32);
}

/// A `CONNECTED`: the handle and endpoint, or an errno.
type Connected = std::result::Result<(u32, crate::meta::Endpoint), u32>;

pub struct AgentPath {
    fd: OwnedFd,
    map: *mut u8,
    rings: Rings,
    /// The requests published (and the lock of publishing).
    req_head: Mutex<u32>,
    /// The completions taken (and the lock of taking them, so that they
    /// are delivered in order).
    done_tail: Mutex<u32>,
    /// The turn to receive from the socket and act on what came: the
    /// reader thread's, or a caller's that waits for its `CONNECTED` (it
    /// takes its own answer: no second wake-up).
    turn: Mutex<()>,
    free: Mutex<FreeSlots>,
    /// Work outstanding: token -> who posted it.
    pending: Mutex<HashMap<u32, Weak<dyn User>>>,
    /// Answers to `CONNECT`s, by request id.
    answers: Mutex<HashMap<u32, Connected>>,
    next: AtomicU32,
    dead: AtomicBool,
    pid: libc::pid_t,
}

// SAFETY: `map` is a shared mapping owned by the path for its life; slots
// are handed to one work request at a time (`free`'s lock).
unsafe impl Send for AgentPath {}
// SAFETY: as above.
unsafe impl Sync for AgentPath {}

/// How many slots `len` bytes take (at least one).
fn slots_for(len: usize) -> u16 {
    len.div_ceil(SLOT).max(1) as u16
}

/// The staging region's free slots, a bit each (set: free). A work
/// request takes the lowest free run long enough for its bytes.
struct FreeSlots(u64);

impl Default for FreeSlots {
    fn default() -> Self {
        FreeSlots(u64::MAX)
    }
}

impl FreeSlots {
    /// The first of `n` free slots in a row (taken), if there are.
    fn take(&mut self, n: u16) -> Option<u16> {
        if n == 0 || n as usize > SLOTS {
            return None;
        }
        let run = Self::run(n);
        let first = (0..=SLOTS as u16 - n).find(|&i| self.0 & (run << i) == run << i)?;
        self.0 &= !(run << first);
        Some(first)
    }

    fn give(&mut self, first: u16, n: u16) {
        let run = Self::run(n) << first;
        debug_assert_eq!(self.0 & run, 0, "slots given back twice");
        self.0 |= run;
    }

    fn run(n: u16) -> u64 {
        u64::MAX >> (SLOTS - n as usize)
    }
}

static PATH: Mutex<Option<Arc<AgentPath>>> = Mutex::new(None);

/// The process's first work through the agent, and whether its runtime is
/// needed: an attached process makes its own runtime only when a caller
/// needs it or a VQP still posts through the agent [`OWN_AFTER`] after its
/// connect (a short-lived process, a serverless function's fetch, never
/// does, however loaded the host); and on a host short of CPUs the
/// start's steps (QP commands, registrations: milliseconds each) give way
/// to the first work, which they would otherwise delay.
struct FirstWork {
    pid: libc::pid_t,
    /// When the first `CONNECT` went out.
    since: Option<Instant>,
    /// Its first completion came, the path went, or a caller needs the
    /// runtime now: the start no longer gives way.
    over: bool,
    /// The runtime is needed (a caller, a VQP long on the path, or the
    /// path went): a start waiting for that begins.
    needed: bool,
}
static FIRST_WORK: Mutex<FirstWork> = Mutex::new(FirstWork { pid: 0, since: None, over: false, needed: false });
static FIRST_WORK_CHANGED: Condvar = Condvar::new();
/// The longest a background start gives way.
const GIVE_WAY: Duration = Duration::from_millis(200);
/// A VQP that still posts through the agent this long after its connect
/// wants the process's own runtime (and link), to move onto.
pub const OWN_AFTER: Duration = Duration::from_millis(200);

/// Between the steps of a runtime's start in the background: wait while
/// the process's first work through the agent is under way (from its
/// first `CONNECT` until its first completion, at most [`GIVE_WAY`]).
pub fn give_way() {
    let mut w = FIRST_WORK.lock();
    fresh(&mut w);
    while !w.over {
        let Some(since) = w.since else { return };
        crate::kmark!("node: the runtime's start gives way to the first work");
        if FIRST_WORK_CHANGED.wait_until(&mut w, since + GIVE_WAY).timed_out() {
            return;
        }
    }
}

/// Before an attached process's runtime starts in the background: wait
/// (asleep) until it is needed ([`runtime_needed`]). False when `cancel`
/// was set meanwhile ([`wake_deferred`]): its PD goes.
pub fn wait_until_needed(cancel: &AtomicBool) -> bool {
    let mut w = FIRST_WORK.lock();
    fresh(&mut w);
    loop {
        if cancel.load(Ordering::Acquire) {
            return false;
        }
        if w.needed {
            return true;
        }
        FIRST_WORK_CHANGED.wait(&mut w);
    }
}

/// Wake the starts waiting in [`wait_until_needed`] (one was cancelled).
pub fn wake_deferred() {
    let _w = FIRST_WORK.lock();
    FIRST_WORK_CHANGED.notify_all();
}

/// A forked child's own record, not its parent's.
fn fresh(w: &mut FirstWork) {
    if w.pid != pid() {
        *w = FirstWork { pid: pid(), since: None, over: false, needed: false };
    }
}

fn first_work_begun() {
    let mut w = FIRST_WORK.lock();
    fresh(&mut w);
    if w.since.is_none() {
        w.since = Some(Instant::now());
    }
}

/// The first work through the agent is over: a start that gave way goes
/// on.
fn first_work_over() {
    let mut w = FIRST_WORK.lock();
    fresh(&mut w);
    if !w.over {
        w.over = true;
        FIRST_WORK_CHANGED.notify_all();
    }
}

/// The runtime is needed (a caller needs it now, a VQP posted through the
/// agent [`OWN_AFTER`] after its connect, or the path went): a start
/// neither waits for that nor gives way.
pub fn runtime_needed() {
    let mut w = FIRST_WORK.lock();
    fresh(&mut w);
    if !w.needed {
        (w.over, w.needed) = (true, true);
        FIRST_WORK_CHANGED.notify_all();
    }
}

/// Work requests outstanding on the path (a poll of a CQ looks for their
/// completions itself while there are any).
static OUTSTANDING: AtomicUsize = AtomicUsize::new(0);
/// Made once per process: a failure is not tried again.
static TRIED: Mutex<Option<libc::pid_t>> = Mutex::new(None);

extern "C" fn in_forked_child() {
    // The path found then is the parent's, replaced at the next use.
    release_in_child(&PATH);
    release_in_child(&TRIED);
    release_in_child(&FIRST_WORK);
    OUTSTANDING.store(0, Ordering::Relaxed);
}

impl AgentPath {
    /// The process's path, made at the first call when the process is
    /// attached to an agent; None otherwise, once it went, or in a forked
    /// child of the process that made it.
    pub fn get() -> Option<Arc<AgentPath>> {
        let mut p = PATH.lock();
        if let Some(a) = p.as_ref() {
            if a.pid == pid() && !a.dead.load(Ordering::Acquire) {
                return Some(Arc::clone(a));
            }
            if a.pid != pid() {
                *p = None;
            } else {
                return None;
            }
        }
        let mut tried = TRIED.lock();
        if *tried == Some(pid()) {
            return None;
        }
        *tried = Some(pid());
        match AgentPath::open() {
            Ok(a) => {
                *p = Some(Arc::clone(&a));
                Some(a)
            }
            Err(e) => {
                klog!(Level::Info, "node: no path through the agent ({e:?}): first operations wait for this process's runtime");
                None
            }
        }
    }

    fn open() -> Result<Arc<AgentPath>> {
        static ATFORK: std::sync::Once = std::sync::Once::new();
        ATFORK.call_once(|| {
            // SAFETY: registers a handler that only releases locks no
            // thread of the child holds.
            unsafe { libc::pthread_atfork(None, None, Some(in_forked_child)) };
        });
        crate::kmark!("node: path: opening");
        let fd = crate::node::client::open_another(&Message::Stage { len: STAGING as u64 }).ok_or(Errno(libc::ENOTCONN))?;
        let deadline = Instant::now() + crate::vqp::runtime::connect_timeout();
        let mem = match crate::node::client::receive_with_fd(&fd, deadline)? {
            (Message::Staged { status: 0, len }, Some(mem)) if len == STAGING as u64 => mem,
            (Message::Staged { status, .. }, _) if status != 0 => return Err(Errno(status as i32)),
            _ => return Err(Errno(libc::EPROTO)),
        };
        // SAFETY: a shared mapping of the agent's region (its slots, then
        // its rings), for the path's life.
        let map =
            unsafe { libc::mmap(std::ptr::null_mut(), MAPPED, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, mem.as_raw_fd(), 0) };
        if map == libc::MAP_FAILED {
            return Err(Errno::last());
        }
        let map: *mut u8 = map.cast();
        let path = Arc::new(AgentPath {
            fd,
            map,
            // SAFETY: the rings follow the slots in the mapping (page aligned).
            rings: unsafe { Rings::at(map.add(STAGING)) },
            req_head: Mutex::new(0),
            done_tail: Mutex::new(0),
            turn: Mutex::new(()),
            free: Mutex::new(FreeSlots::default()),
            pending: Mutex::new(HashMap::new()),
            answers: Mutex::new(HashMap::new()),
            next: AtomicU32::new(1),
            dead: AtomicBool::new(false),
            pid: pid(),
        });
        let reader = Arc::downgrade(&path);
        std::thread::Builder::new().name("krcore-node-path".into()).spawn(move || read_answers(reader)).map_err(|_| Errno(libc::EAGAIN))?;
        crate::kmark!("node: path: open");
        Ok(path)
    }

    /// Connect a VQP of the agent's to `key`: its handle, and the endpoint
    /// the agent found there (looked up fresh).
    pub fn connect(&self, key: &Key) -> Result<(u32, crate::meta::Endpoint)> {
        let id = self.token();
        first_work_begun();
        crate::node::client::send(&self.fd, &Message::Connect { id, key: *key })?;
        let deadline = Instant::now() + crate::vqp::runtime::connect_timeout();
        loop {
            // Our turn to receive: what comes meanwhile (another caller's
            // answer, a doorbell) is acted on here too.
            let _turn = self.turn.lock();
            if let Some(r) = self.answers.lock().remove(&id) {
                return r.map_err(|e| Errno(e as i32));
            }
            if self.dead.load(Ordering::Acquire) {
                return Err(Errno(libc::ECONNRESET));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !crate::poll::readable(self.fd.as_raw_fd(), left.as_millis().clamp(1, i32::MAX as u128) as i32) {
                if Instant::now() >= deadline {
                    return Err(Errno(libc::ETIMEDOUT));
                }
                continue;
            }
            self.pump();
        }
    }

    /// Act on everything the agent sent (the caller has the turn): a
    /// doorbell delivers the completions, an answer goes to its caller; a
    /// hang-up or anything else fails the path.
    fn pump(&self) {
        use crate::node::agent::{receive, Received};
        loop {
            match receive(self.fd.as_raw_fd()) {
                Received::Nothing => return,
                Received::Message(Ok(Message::Ring), None) => {
                    if self.deliver().is_err() {
                        return self.fail_all("its completions' ring broken");
                    }
                }
                Received::Message(Ok(Message::Connected { id, result }), None) => {
                    crate::kmark!("node: path: CONNECTED {id} received");
                    self.answers.lock().insert(id, result);
                }
                Received::Gone => {
                    // What the agent published before it went is delivered.
                    let _ = self.deliver();
                    return self.fail_all("closed");
                }
                Received::Message(m, _) => {
                    let _ = self.deliver();
                    return self.fail_all(&format!("{m:?}"));
                }
            }
        }
    }

    pub fn token(&self) -> u32 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// The first of the free slots in a row of the staging region that
    /// hold `len` bytes (at least one), if there are.
    pub fn slots(&self, len: usize) -> Option<u16> {
        self.free.lock().take(slots_for(len))
    }

    /// Give back what [`Self::slots`] took for `len` bytes from `first` on.
    pub fn release(&self, first: u16, len: usize) {
        self.free.lock().give(first, slots_for(len));
    }

    /// The first `len` bytes of the slots from `first` on.
    ///
    /// # Safety
    /// The caller holds those slots (from [`Self::slots`], not released;
    /// `len` within them) and no work request of them is with the agent
    /// while the slice is used.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes(&self, first: u16, len: usize) -> &mut [u8] {
        debug_assert!(first as usize * SLOT + len <= STAGING);
        // SAFETY: the slots lie inside the mapping; their holder is the only user.
        unsafe { std::slice::from_raw_parts_mut(self.map.add(first as usize * SLOT), len) }
    }

    /// Hand `post` (its bytes in place in the slots from `first` on) to
    /// the agent; `user` hears of its completion.
    pub fn post(&self, post: Post, first: u16, user: Weak<dyn User>) -> Result<()> {
        if self.dead.load(Ordering::Acquire) {
            return Err(Errno(libc::ECONNRESET));
        }
        self.pending_mut(|p| {
            p.insert(post.token, user);
        });
        let mut head = self.req_head.lock();
        if self.rings.push_request(&mut head, &Post { offset: (first as usize * SLOT) as u64, ..post }) {
            // The agent sleeps: its doorbell. (Failing, the agent is gone:
            // the reader fails the request with the rest.)
            crate::kmark!("node: path: doorbell");
            let _ = crate::node::client::send(&self.fd, &Message::Ring);
        }
        drop(head);
        // The agent went meanwhile, after the reader failed what was
        // outstanding: this one was not among them.
        if self.dead.load(Ordering::Acquire) && self.pending_mut(|p| p.remove(&post.token)).is_some() {
            return Err(Errno(libc::ECONNRESET));
        }
        Ok(())
    }

    /// Hand the completions the agent published to their VQPs, in order
    /// (Err: the ring is broken).
    fn deliver(&self) -> std::result::Result<(), crate::node::ring::Broken> {
        self.deliver_from(&mut self.done_tail.lock())
    }

    fn deliver_from(&self, tail: &mut u32) -> std::result::Result<(), crate::node::ring::Broken> {
        for d in self.rings.take_done(tail)? {
            crate::kmark!("node: path: completion {} taken", d.token);
            let user = self.pending_mut(|p| p.remove(&d.token)).and_then(|w| w.upgrade());
            if let Some(u) = user {
                u.done(d.token, d.status, d.byte_len);
            }
            first_work_over();
        }
        Ok(())
    }

    /// Forget `tokens` (their VQP went: no completion for them).
    pub fn forget(&self, tokens: impl Iterator<Item = u32>) {
        self.pending_mut(|p| tokens.for_each(|t| drop(p.remove(&t))));
    }

    /// Change the outstanding work, counted for [`poll`].
    fn pending_mut<T>(&self, f: impl FnOnce(&mut HashMap<u32, Weak<dyn User>>) -> T) -> T {
        let mut p = self.pending.lock();
        let before = p.len();
        let r = f(&mut p);
        let after = p.len();
        if after > before {
            OUTSTANDING.fetch_add(after - before, Ordering::Relaxed);
        } else if before > after {
            OUTSTANDING.fetch_sub(before - after, Ordering::Relaxed);
        }
        r
    }

    pub fn close(&self, handle: u32) {
        let _ = crate::node::client::send(&self.fd, &Message::Close { handle });
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }
}

impl Drop for AgentPath {
    fn drop(&mut self) {
        // SAFETY: our mapping, once.
        unsafe { libc::munmap(self.map.cast(), MAPPED) };
    }
}

/// A poll of an application's CQ: while work through the agent is
/// outstanding, take the completions the agent published on the polling
/// thread, unless another thread is at it (the reader thread otherwise
/// wakes for them, a wake-up the application waits behind).
pub fn poll() {
    if OUTSTANDING.load(Ordering::Relaxed) == 0 {
        return;
    }
    let Some(p) = PATH.try_lock().and_then(|g| g.clone()) else { return };
    let Some(mut tail) = p.done_tail.try_lock() else { return };
    // A broken ring: the reader finds it too, and fails the rest.
    let _ = p.deliver_from(&mut tail);
}

/// The reader thread: the completions and the agent's answers until its
/// connection closes (or the path is dropped), then every outstanding work
/// request fails. Asleep in `poll` when there are none (the agent rings
/// the doorbell then).
fn read_answers(path: Weak<AgentPath>) {
    let fd = match path.upgrade() {
        // SAFETY: dup of a live descriptor; owned below.
        Some(p) => unsafe { libc::dup(p.fd.as_raw_fd()) },
        None => return,
    };
    if fd < 0 {
        return;
    }
    // SAFETY: the new descriptor from dup, owned here.
    let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    loop {
        {
            let Some(p) = path.upgrade() else { return };
            if p.dead.load(Ordering::Acquire) {
                return;
            }
            if p.deliver().is_err() {
                return p.fail_all("its completions' ring broken");
            }
            // About to sleep: say so, then look once more (a completion
            // published meanwhile was not followed by the doorbell).
            p.rings.set_reader_asleep(true);
            if p.rings.done_after(*p.done_tail.lock()) {
                p.rings.set_reader_asleep(false);
                continue;
            }
        }
        let woke = crate::poll::readable(fd.as_raw_fd(), -1);
        let Some(p) = path.upgrade() else { return };
        p.rings.set_reader_asleep(false);
        if woke {
            let _turn = p.turn.lock();
            p.pump();
        }
    }
}

impl AgentPath {
    /// The agent went: everything outstanding fails, in the order it was
    /// posted, and the path is not used again.
    fn fail_all(&self, why: &str) {
        if self.dead.swap(true, Ordering::AcqRel) {
            return;
        }
        klog!(Level::Warn, "node: the agent's path closed ({why}): its outstanding work fails");
        runtime_needed();
        let mut all: Vec<(u32, Weak<dyn User>)> = self.pending_mut(|p| p.drain().collect());
        // Tokens grow; a VQP's completions are delivered in order.
        all.sort_unstable_by_key(|(token, _)| token.wrapping_sub(self.next.load(Ordering::Relaxed)));
        for (token, w) in all {
            if let Some(u) = w.upgrade() {
                u.done(token, crate::sys::ibv_wc_status::IBV_WC_RETRY_EXC_ERR, 0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one test of the process's `FIRST_WORK` (tests run in parallel).
    #[test]
    fn a_deferred_start_waits_until_needed_or_cancelled() {
        let reset = || *FIRST_WORK.lock() = FirstWork { pid: pid(), since: Some(Instant::now()), over: false, needed: false };
        let cancel = AtomicBool::new(false);
        reset();
        std::thread::scope(|s| {
            let waiter = s.spawn(|| wait_until_needed(&cancel));
            cancel.store(true, Ordering::Release);
            wake_deferred();
            assert!(!waiter.join().unwrap(), "cancelled: no start");
        });
        cancel.store(false, Ordering::Release);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| wait_until_needed(&cancel));
            runtime_needed();
            assert!(waiter.join().unwrap());
        });
        // Needed once, needed for good (a later start does not wait).
        assert!(wait_until_needed(&cancel));
        assert!(FIRST_WORK.lock().over, "a needed runtime's start gives way no more");
    }

    #[test]
    fn work_requests_take_the_lowest_free_run_of_slots() {
        let mut f = FreeSlots::default();
        assert_eq!(f.take(1), Some(0));
        assert_eq!(f.take(4), Some(1));
        assert_eq!(f.take(2), Some(5));
        f.give(1, 4);
        // The hole of 4 takes 3, then 1; a run of 2 goes past it.
        assert_eq!(f.take(3), Some(1));
        assert_eq!(f.take(2), Some(7));
        assert_eq!(f.take(1), Some(4));
        assert_eq!(f.take(0), None);
        assert_eq!(f.take(65), None);
        // Full, but for one run of 4 at the end.
        while f.take(1).is_some() {}
        assert_eq!(f.0, 0);
        f.give(60, 4);
        assert_eq!(f.take(5), None);
        assert_eq!(f.take(4), Some(60));
        f.give(0, 64);
        assert_eq!(f.0, u64::MAX);
        assert_eq!(f.take(64), Some(0));
    }
}
