//! Work that waits for WQEs on the links to complete: a VQP's flush
//! completions (ERR) held until the link completed the WQEs they report,
//! and MR deregistrations deferred while a queued WQE may use the MR.
//!
//! RC's rule is that once a flush completion is reported, or
//! `ibv_destroy_qp` returned, or an MR is deregistered, the NIC touches
//! none of that memory. On a shared link a VQP's WQEs stay in flight
//! (behind other VQPs' work, a large transfer, RNR) after the VQP gave
//! them up, so these wait for the link: its send queue completes in order
//! (`PhysSq::mark` / `reached`), a signaled WQE behind the last one makes
//! sure a completion comes (`Runtime::fence_after`), and a failed link is
//! done once its fence came back (every WQE flushed).
//!
//! Waiters are looked at after each progress pass (`Runtime::drain`).
//! While any waits, the service thread makes progress every few
//! milliseconds too (a timer, not a spin), so that they finish while the
//! application does not poll.

use super::runtime::Runtime;
use crate::service::Link;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Returns true once done (then dropped); called with the runtime after
/// each progress pass. With `force` it must finish now (the PD is being
/// released: no VQP is left, and the links go).
pub type Waiter = Box<dyn FnMut(&Runtime, bool) -> bool + Send>;

/// How often the service thread makes progress while something waits:
/// the waits are for a link's transfers (milliseconds and more).
const TICK: Duration = Duration::from_millis(2);

#[derive(Default)]
pub struct Waiters {
    list: Mutex<Vec<Waiter>>,
    /// Whether `list` may hold any: every progress pass asks.
    any: AtomicBool,
    /// The service thread's timer is scheduled.
    ticking: AtomicBool,
}

impl Waiters {
    /// Run `w` after each progress pass until it says it is done (at once
    /// first).
    pub fn wait(&self, rt: &Arc<Runtime>, mut w: Waiter) {
        if w(rt, false) {
            return;
        }
        self.list.lock().push(w);
        self.any.store(true, Ordering::Release);
        if let Err(e) = rt.svc.want_link_events() {
            crate::klog!(crate::log::Level::Warn, "vqp: arming the links' CQ: {e:?}");
        }
        if !self.ticking.swap(true, Ordering::AcqRel) {
            schedule_tick(Arc::downgrade(rt));
        }
    }

    /// After a progress pass: run the waiters (not under the list's lock:
    /// they deliver completions and post fences).
    pub fn check(&self, rt: &Runtime) {
        if !self.any.load(Ordering::Acquire) {
            return;
        }
        let mut taken = std::mem::take(&mut *self.list.lock());
        taken.retain_mut(|w| !w(rt, false));
        let mut list = self.list.lock();
        list.append(&mut taken);
        self.any.store(!list.is_empty(), Ordering::Release);
    }

    /// Finish every waiter now (`ibv_dealloc_pd`: what they hold, MRs
    /// among it, must go before the PD).
    pub fn force(&self, rt: &Runtime) {
        let taken = std::mem::take(&mut *self.list.lock());
        for mut w in taken {
            w(rt, true);
        }
        self.any.store(false, Ordering::Release);
    }

    fn pending(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }
}

fn schedule_tick(rt: Weak<Runtime>) {
    let Some(strong) = rt.upgrade() else { return };
    strong.svc.defer(
        Instant::now() + TICK,
        Box::new(move || {
            let Some(rt) = rt.upgrade() else { return };
            rt.progress();
            if rt.wire.pending() {
                schedule_tick(Arc::downgrade(&rt));
            } else {
                rt.wire.ticking.store(false, Ordering::Release);
                // A waiter added between the look and the store.
                if rt.wire.pending() && !rt.wire.ticking.swap(true, Ordering::AcqRel) {
                    schedule_tick(Arc::downgrade(&rt));
                }
            }
        }),
    );
}

/// Whether every WQE before each mark completed (a link that is gone has
/// nothing in flight); posts the fence a mark still needs (see
/// `Runtime::fence_after`).
pub fn marks_reached(rt: &Runtime, marks: &[(Weak<Link>, u64)]) -> bool {
    let mut all = true;
    for (link, mark) in marks {
        let Some(link) = link.upgrade() else { continue };
        if !link.sq.lock().reached(*mark) {
            all = false;
            rt.fence_after(&link, *mark);
        }
    }
    all
}
