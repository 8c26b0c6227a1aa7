//! A virtual SRQ: the receive queue that transparent VQPs created with an
//! SRQ share (`KRCORE_VIRTUALIZE`).
//!
//! The application's SRQ decides what it is when its first QP arrives: a
//! VQP makes it virtual (receives are taken from the ring here), a real QP
//! makes it real (what was posted so far goes to the real SRQ, in order).
//! One SRQ never serves both kinds.

use super::precheck::{self, Caps};
use super::queue::{RecvRing, RecvWr};
use super::{mrs, qp};
use crate::error::{Errno, Result};
use crate::sys::*;
use parking_lot::{Mutex, MutexGuard};

/// What the SRQ serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// No QP yet: receives are kept here.
    Open,
    Virtual,
    Real,
}

struct Inner {
    mode: Mode,
    ring: RecvRing,
    /// VQPs holding messages for want of a receive, as (slot, generation),
    /// in the order they ran dry.
    waiting: Vec<(u32, u8)>,
}

pub struct VSrq {
    inner: Mutex<Inner>,
    /// The real PD the receive buffers' MRs belong to.
    real_pd: usize,
    caps: Caps,
    pub max_wr: u32,
}

impl VSrq {
    pub fn new(real_pd: usize, max_wr: u32, max_sge: u32, max_msg_size: u32) -> Result<VSrq> {
        Ok(VSrq {
            inner: Mutex::new(Inner { mode: Mode::Open, ring: RecvRing::new(max_wr, max_sge)?, waiting: Vec::new() }),
            real_pd,
            caps: Caps { max_send_sge: 0, max_recv_sge: max_sge, max_inline_data: 0, max_msg_size, atomics: false },
            max_wr,
        })
    }

    /// A QP of kind `virtual_qp` attaches: whether it may. The first one
    /// decides the mode; a real one first gets what was posted so far
    /// through `to_real` (EINVAL if that fails).
    pub fn attach(&self, virtual_qp: bool, to_real: impl FnMut(u64, &[ibv_sge]) -> Result<()>) -> Result<()> {
        let mut g = self.inner.lock();
        let want = if virtual_qp { Mode::Virtual } else { Mode::Real };
        match g.mode {
            Mode::Open if virtual_qp => g.mode = Mode::Virtual,
            Mode::Open => {
                let mut to_real = to_real;
                while let Some(r) = g.ring.pop_front() {
                    to_real(r.wr_id, r.sg_list)?;
                }
                g.mode = Mode::Real;
            }
            m if m == want => {}
            _ => return Err(Errno::EINVAL),
        }
        Ok(())
    }

    pub fn mode(&self) -> Mode {
        self.inner.lock().mode
    }

    /// `ibv_post_srq_recv` while the SRQ is not real: `Ok(false)` if it
    /// is (post to the real SRQ instead).
    pub fn post(&self, wr_id: u64, sges: &[ibv_sge]) -> Result<bool> {
        // A real SRQ's receives are the device's to judge.
        if self.mode() == Mode::Real {
            return Ok(false);
        }
        if sges.len() > self.caps.max_recv_sge as usize {
            return Err(Errno::EINVAL);
        }
        mrs::with(self.real_pd, |local| precheck::check_recv(&precheck::RecvWr { sge: sges }, &self.caps, local)).map_err(|r| r.errno())?;
        let mut g = self.inner.lock();
        if g.mode == Mode::Real {
            return Ok(false);
        }
        g.ring.push(wr_id, sges)?;
        Ok(true)
    }

    /// After posting: the VQPs that were waiting land their held messages.
    pub fn wake(&self) {
        let waiting = std::mem::take(&mut self.inner.lock().waiting);
        for (slot, gen) in waiting {
            if let Some(v) = qp::lookup(slot, gen) {
                v.deliver_held();
            }
        }
    }

    /// Whether no receive is posted; if so VQP (slot, gen), which has a
    /// message for one, is woken by the next post.
    pub fn empty_or_wait(&self, slot: u32, gen: u8) -> bool {
        let mut g = self.inner.lock();
        if !g.ring.is_empty() {
            return false;
        }
        if !g.waiting.contains(&(slot, gen)) {
            g.waiting.push((slot, gen));
        }
        true
    }

    /// The ring, to take the next receive from (a VQP's lock is held:
    /// the order is VQP, then SRQ).
    pub fn ring(&self) -> SrqRing<'_> {
        SrqRing(self.inner.lock())
    }

    /// `ibv_query_srq`'s posted-receive count is not kept by providers
    /// either; this is what the VQPs have not consumed.
    pub fn posted(&self) -> usize {
        self.inner.lock().ring.len()
    }
}

/// A locked SRQ ring.
pub struct SrqRing<'a>(MutexGuard<'a, Inner>);

impl SrqRing<'_> {
    pub fn pop_front(&mut self) -> Option<RecvWr<'_>> {
        self.0.ring.pop_front()
    }

    pub fn push_front(&mut self, wr_id: u64, sg_list: &[ibv_sge]) -> Result<()> {
        self.0.ring.push_front(wr_id, sg_list)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sge(addr: u64) -> ibv_sge {
        ibv_sge { addr, length: 0, lkey: 0 }
    }

    #[test]
    fn first_qp_decides_and_the_other_kind_is_refused() {
        let s = VSrq::new(1, 4, 1, 1 << 20).unwrap();
        assert_eq!(s.mode(), Mode::Open);
        s.attach(true, |_, _| unreachable!()).unwrap();
        assert_eq!(s.mode(), Mode::Virtual);
        s.attach(true, |_, _| Ok(())).unwrap();
        assert_eq!(s.attach(false, |_, _| Ok(())), Err(Errno::EINVAL));
    }

    #[test]
    fn a_real_first_qp_takes_what_was_posted_in_order() {
        let s = VSrq::new(1, 4, 1, 1 << 20).unwrap();
        // Zero-length SGEs need no MR.
        for id in 1..=3 {
            assert_eq!(s.post(id, &[sge(id)]), Ok(true));
        }
        let mut got = Vec::new();
        s.attach(false, |id, sg| {
            got.push((id, sg[0].addr));
            Ok(())
        })
        .unwrap();
        assert_eq!(got, vec![(1, 1), (2, 2), (3, 3)]);
        assert_eq!(s.post(9, &[sge(9)]), Ok(false), "real now: the caller posts to the real SRQ");
        assert_eq!(s.attach(true, |_, _| Ok(())), Err(Errno::EINVAL));
    }

    #[test]
    fn an_empty_ring_registers_the_waiter_once() {
        let s = VSrq::new(1, 2, 1, 1 << 20).unwrap();
        assert!(s.empty_or_wait(7, 1));
        assert!(s.empty_or_wait(7, 1));
        assert_eq!(s.inner.lock().waiting, vec![(7, 1)]);
        s.post(1, &[sge(1)]).unwrap();
        assert!(!s.empty_or_wait(8, 0), "a receive is there");
        s.wake();
        assert!(s.inner.lock().waiting.is_empty(), "the post's wake took the waiters");
    }

    #[test]
    fn full_and_too_many_sges() {
        let s = VSrq::new(1, 2, 1, 1 << 20).unwrap();
        s.post(1, &[sge(1)]).unwrap();
        s.post(2, &[sge(2)]).unwrap();
        assert_eq!(s.post(3, &[sge(3)]), Err(Errno::ENOMEM));
        assert_eq!(s.post(4, &[sge(4), sge(5)]), Err(Errno::EINVAL));
        assert_eq!(s.ring().pop_front().map(|r| r.wr_id), Some(1));
        assert_eq!(s.posted(), 1);
    }
}
