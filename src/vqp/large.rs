//! Messages larger than a receive buffer (above [`MAX_MSG`] bytes).
//!
//! The sender copies the payload into its link's staging region or, when
//! the staging has no room for it, into a registration of its own, and
//! sends a LARGE header naming (address, rkey, length). The receiver READs
//! the payload straight into the buffer the application posted, in READs
//! of up to [`LINK_SEND_SGE`] pieces, then answers with a DONE (inline,
//! naming the same address) and completes the receive. The sender's send
//! completes when the DONE arrives, and only then is the staged copy freed.
//!
//! Only the peer of the link a message was announced on can READ it
//! (issue 20): a staged region's MR has no remote access; the rkey in the
//! header is a type 2 memory window's, bound by a WQE on that link's QP
//! (posted once per region, before the first header naming it, in the
//! link's send-queue accounting), and a window's rkey is valid on that QP
//! only. Every link of a runtime is in the same PD: with the MR's rkey any
//! linked process could READ what is staged for any other.
//!
//! This module keeps the sender's side (staging, the messages awaiting
//! their DONE) and the runtime's control WQEs in flight (the receiver's
//! READs and DONEs, whose state lives in the receiving VQP in qp.rs, and
//! CLOSE headers, MR checks, window binds and probes), each with what its
//! completion retires on its link.
//!
//! [`MAX_MSG`]: super::runtime::MAX_MSG
//! [`LINK_SEND_SGE`]: crate::service::LINK_SEND_SGE

use super::queue::PhysSq;
use super::runtime::{Ranges, Runtime};
use super::wrid::WrId;
use crate::error::{Errno, Result};
use crate::klog;
use crate::log::Level;
use crate::rdma::{self, Device, Region, Window};
use crate::service::Link;
use crate::sys::*;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Staging is handed out in units of this many bytes.
const UNIT: usize = 4096;

/// A region the peer of one link may READ: through a window bound on that
/// link's QP, never through the MR (registered without remote access).
struct Exposed {
    // Dropped in this order (see `Drop`): the window (its MR cannot be
    // deregistered while it is bound), then the region, then the link
    // (its QP outlives the window bound on it).
    window: ManuallyDrop<Window>,
    region: ManuallyDrop<Region>,
    /// Its bind was posted on the link: set under the link's `sq` lock,
    /// which every post on the link holds, so every header naming the
    /// region is posted behind the bind (RC executes them in order).
    bound: AtomicBool,
    link: Arc<Link>,
}

impl Exposed {
    fn new(dev: &Arc<Device>, link: &Arc<Link>, len: usize) -> Result<Exposed> {
        let region = Region::new(dev, len, rdma::LOCAL_WRITE | rdma::MW_BIND)?;
        let window = Window::new(dev).inspect_err(|e| {
            klog!(Level::Error, "vqp: no type 2 memory window on {} ({e:?}): a message above 4 KiB cannot be staged", dev.name);
        })?;
        Ok(Exposed {
            window: ManuallyDrop::new(window),
            region: ManuallyDrop::new(region),
            bound: AtomicBool::new(false),
            link: Arc::clone(link),
        })
    }
}

impl Drop for Exposed {
    fn drop(&mut self) {
        // SAFETY: taken once, here; never used after.
        let window = unsafe { ManuallyDrop::take(&mut self.window) };
        if let Err(e) = window.dealloc() {
            // Still open to the link's peer, perhaps: its memory must not
            // be freed (and reused) under it. Kept, registered, for good.
            klog!(Level::Error, "vqp: a staging window could not be deallocated ({e:?}): its region is kept");
            return;
        }
        // SAFETY: dropped once, here; never used after.
        unsafe { ManuallyDrop::drop(&mut self.region) };
    }
}

/// One link's staging region and its free units.
struct Staging {
    exposed: Exposed,
    free: Mutex<Ranges>,
}

/// Where a message's payload waits for the receiver's READ.
pub struct Staged {
    addr: u64,
    rkey: u32,
    /// Freed (units back to the staging, or deregistered) on drop.
    storage: Storage,
}

enum Storage {
    Shared {
        staging: Arc<Staging>,
        start: u32,
        units: u32,
    },
    /// Its window deallocated and its region deregistered when dropped.
    Own(Exposed),
}

impl Drop for Storage {
    fn drop(&mut self) {
        if let Storage::Shared { staging, start, units } = self {
            staging.free.lock().free(*start, *units);
        }
    }
}

impl Staged {
    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    fn exposed(&self) -> &Exposed {
        match &self.storage {
            Storage::Shared { staging, .. } => &staging.exposed,
            Storage::Own(e) => e,
        }
    }

    /// Whether it may go on `link`: only its peer can READ it.
    pub fn is_for(&self, link: &Arc<Link>) -> bool {
        Arc::ptr_eq(&self.exposed().link, link)
    }

    /// Whether its window's bind is still to be posted (before its header).
    pub fn needs_bind(&self) -> bool {
        !self.exposed().bound.load(Ordering::Acquire)
    }

    /// Post its window's bind on its link, unless posted already; `sq`
    /// is that link's accounting, held, with room for one WQE. Posted
    /// signaled, as a control WQE: its completion retires it.
    pub fn bind(&self, rt: &Runtime, sq: &mut PhysSq) -> Result<()> {
        let e = self.exposed();
        if e.bound.load(Ordering::Acquire) {
            return Ok(());
        }
        let d = sq.try_post(true).ok_or(Errno::ENOMEM)?;
        let tag = rt.next_tag();
        rt.large.track(tag, Control::Bind { retired: d.retired });
        let mut wr = e.window.bind_wr(&e.region, WrId::Control { tag }.encode());
        // SAFETY: a bind of our window to our region, both kept until the
        // link's QP is done with them (see `Exposed`).
        match unsafe { e.link.qp.post_send(&mut wr) } {
            Ok(()) => {
                e.bound.store(true, Ordering::Release);
                Ok(())
            }
            Err(err) => {
                rt.large.take(tag);
                let _ = sq.on_completion(d.retired);
                Err(err)
            }
        }
    }
}

/// A large message sent and awaiting its DONE.
struct Pending {
    /// The sending VQP (slot, generation) and the WR's sequence number.
    slot: u32,
    gen: u8,
    seq: u16,
    /// The link it went on: only that link's peer may answer.
    link_qpn: u32,
    _staged: Staged,
}

/// A control WQE in flight, by its tag: what its completion does besides
/// retiring `retired` WQEs of its link.
#[derive(Clone, Copy, Debug)]
pub enum Control {
    /// One READ of a large payload for VQP (slot, generation).
    Read { slot: u32, gen: u8, retired: u16 },
    /// A bare header (DONE, CLOSE, an MR check or answer): nothing more.
    Header { retired: u16 },
    /// A window's bind (a staged region opened to the link's peer):
    /// nothing more (a failed one fails the link, as any error does).
    Bind { retired: u16 },
    /// A liveness probe of an idle link (an 8-byte READ of the peer's
    /// probe target): only its status matters.
    Probe { retired: u16 },
    /// Posted on a failed link after moving it to ERR: flushed behind every
    /// WQE still on it, so its completion says all of theirs were seen.
    Fence { link_qpn: u32 },
    /// Our LINK_CLOSE: its completion says every WQE before it completed.
    LinkClose { retired: u16 },
}

impl Control {
    /// What its signaled completion retires on the link.
    pub fn retired(self) -> u16 {
        match self {
            Control::Read { retired, .. }
            | Control::Header { retired }
            | Control::Bind { retired }
            | Control::Probe { retired }
            | Control::LinkClose { retired } => retired,
            Control::Fence { .. } => 0,
        }
    }
}

/// The large-message state of one runtime.
#[derive(Default)]
pub struct Large {
    staging: Mutex<FxHashMap<u32, Arc<Staging>>>,
    sent: Mutex<FxHashMap<u64, Pending>>,
    /// How many of `sent` there are (set under its lock): their DONEs
    /// arrive on the links' receive CQ.
    awaiting_done: AtomicUsize,
    control: Mutex<FxHashMap<u32, Control>>,
    /// Receiving VQPs (slot, generation) that found their link's queue full.
    waiting: Mutex<Vec<(u32, u8)>>,
    /// Whether `waiting` may hold any: every progress run asks.
    any_waiting: AtomicBool,
}

impl Large {
    /// Copy the payload the application's `sges` describe (pre-checked:
    /// inside its registrations) to where the peer of `link` alone can
    /// READ it (once the window's bind is posted: [`Staged::bind`]).
    /// ENOTCONN when the link no longer takes new work.
    pub fn stage(&self, dev: &Arc<Device>, link: &Arc<Link>, sges: &[ibv_sge], total: usize) -> Result<Staged> {
        let staging = self.staging_of(dev, link)?;
        let units = total.div_ceil(UNIT) as u32;
        let alloc = staging.free.lock().alloc(units);
        let staged = match alloc {
            Some(start) => Staged {
                addr: staging.exposed.region.addr() + start as u64 * UNIT as u64,
                rkey: staging.exposed.window.rkey(),
                storage: Storage::Shared { staging: Arc::clone(&staging), start, units },
            },
            None => {
                crate::stats::inc(crate::stats::Stat::KRCORE_STAT_LARGE_OWN_REGISTRATIONS);
                // A window of its own too, bound for this message alone:
                // the staging's window covers the staging region only.
                let e = Exposed::new(dev, link, total)?;
                Staged { addr: e.region.addr(), rkey: e.window.rkey(), storage: Storage::Own(e) }
            }
        };
        let mut at = staged.addr as usize;
        // Zero-length SGEs are skipped: their address may be anything,
        // NULL included, and is never read.
        for s in sges.iter().filter(|s| s.length > 0) {
            // SAFETY: the application's SGE lies inside one of its MRs
            // (pre-checked, non-empty); the destination is our unit range
            // or region, `total` bytes long, used by no other message.
            unsafe { std::ptr::copy_nonoverlapping(s.addr as *const u8, at as *mut u8, s.length as usize) };
            at += s.length as usize;
        }
        Ok(staged)
    }

    fn staging_of(&self, dev: &Arc<Device>, link: &Arc<Link>) -> Result<Arc<Staging>> {
        let qpn = link.qp.qpn();
        let mut map = self.staging.lock();
        // Checked under the map's lock, which `forget_link` takes after
        // the link stopped being open: no staging is made for a link
        // already forgotten (it would hold the link's QP for good).
        if !link.is_open() {
            return Err(Errno(libc::ENOTCONN));
        }
        if let Some(s) = map.get(&qpn) {
            return Ok(Arc::clone(s));
        }
        let units = (crate::config::get().staging_bytes / UNIT).max(1);
        let exposed = Exposed::new(dev, link, units * UNIT)?;
        let s = Arc::new(Staging { exposed, free: Mutex::new(Ranges::new(units as u32)) });
        map.insert(qpn, Arc::clone(&s));
        Ok(s)
    }

    /// The message `seq` of VQP (slot, gen) went out on link `link_qpn`
    /// with `staged`: keep it until the DONE.
    pub fn sent(&self, staged: Staged, slot: u32, gen: u8, seq: u16, link_qpn: u32) {
        let mut sent = self.sent.lock();
        sent.insert(staged.addr, Pending { slot, gen, seq, link_qpn, _staged: staged });
        self.awaiting_done.store(sent.len(), Ordering::Release);
    }

    /// The message at `addr` could not be posted after all.
    pub fn unsend(&self, addr: u64) {
        let mut sent = self.sent.lock();
        sent.remove(&addr);
        self.awaiting_done.store(sent.len(), Ordering::Release);
    }

    /// Whether a sent large message still awaits its DONE.
    pub fn awaits_done(&self) -> bool {
        self.awaiting_done.load(Ordering::Acquire) > 0
    }

    /// A DONE for `addr` arrived on link `link_qpn`: frees the staged copy
    /// and names the WR it completes, (slot, generation, seq). None when no
    /// such message was sent on that link (a stale or forged DONE).
    pub fn on_done(&self, addr: u64, link_qpn: u32) -> Option<(u32, u8, u16)> {
        let mut sent = self.sent.lock();
        match sent.get(&addr) {
            Some(p) if p.link_qpn == link_qpn => {}
            _ => return None,
        }
        let p = sent.remove(&addr)?;
        self.awaiting_done.store(sent.len(), Ordering::Release);
        Some((p.slot, p.gen, p.seq))
    }

    /// Link `link_qpn` failed or was closed: its staging goes once no
    /// message uses it, and no DONE will come for what was sent on it
    /// (failed: the senders' VQPs are in the error state, their WRs
    /// reported; closed: none was awaited). Their windows are deallocated
    /// then, and the link's QP can go.
    pub fn forget_link(&self, link_qpn: u32) {
        self.staging.lock().remove(&link_qpn);
        let mut sent = self.sent.lock();
        sent.retain(|_, p| p.link_qpn != link_qpn);
        self.awaiting_done.store(sent.len(), Ordering::Release);
    }

    /// Whether a large message sent on link `link_qpn` awaits its DONE
    /// (the peer READs it over that link: it cannot close yet).
    pub fn sent_on(&self, link_qpn: u32) -> bool {
        self.awaits_done() && self.sent.lock().values().any(|p| p.link_qpn == link_qpn)
    }

    pub fn track(&self, tag: u32, c: Control) {
        self.control.lock().insert(tag, c);
    }

    /// The control WQE with `tag`, if it is one of ours.
    pub fn take(&self, tag: u32) -> Option<Control> {
        self.control.lock().remove(&tag)
    }

    pub fn wait_for_room(&self, slot: u32, gen: u8) {
        let mut w = self.waiting.lock();
        if !w.contains(&(slot, gen)) {
            w.push((slot, gen));
        }
        self.any_waiting.store(true, Ordering::Release);
    }

    pub fn take_waiting(&self) -> Vec<(u32, u8)> {
        // Set under the lock after a push: a push racing this load is
        // seen by the next progress run.
        if !self.any_waiting.load(Ordering::Acquire) {
            return Vec::new();
        }
        let mut w = self.waiting.lock();
        self.any_waiting.store(false, Ordering::Release);
        std::mem::take(&mut *w)
    }
}
