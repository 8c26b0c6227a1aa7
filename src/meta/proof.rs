//! Proving to `krcore-meta` which GIDs a client's connection comes from.
//!
//! A key names a GID (`Key::Port { gid, .. }`), and a `Bind` makes its
//! sender the one that processes looking that GID's port up reach. So the
//! server takes a key only under a GID its binder has shown to be its own:
//! the client sends a [`Proof`] datagram from that GID (an address handle
//! of its GID table entry) to the server's proof QP, and the server reads
//! the GID from the datagram's GRH. A process can send only from the GIDs
//! of its host's GID table (the host's administrator sets them): a
//! stranger on another host cannot prove ours. The [`Proof`] carries the
//! connection's token (from its `Welcome`, over TCP to it alone), so a
//! datagram proves a GID for the connection that asked, no other.
//!
//! [`Prover`] is the client's half (a small UD QP per connection),
//! [`ProofQp`] the server's.

use super::proto::{Proof, Welcome, PROOF_LEN};
use crate::error::{Errno, Result};
use crate::rdma::{self, Ah, Caps, Cq, Device, Gid, Qp, Region};
use crate::sys::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Proofs a client may have in flight (they complete in microseconds).
const SENDS: u32 = 4;

/// The client's half: sends [`Proof`]s of its connection from any GID of
/// its device.
pub struct Prover {
    cq: Arc<Cq>,
    qp: Qp,
    dev: Arc<Device>,
    /// The server's IPv4 and IPv6 GIDs and proof QP, and what our proofs
    /// say ([`aim`]).
    ///
    /// [`aim`]: Prover::aim
    to: (Gid, Gid, u32),
    proof: Proof,
    /// Address handles to the server, by our GID index.
    ahs: HashMap<u32, Ah>,
}

impl Prover {
    /// A UD QP on `dev` (made while the client waits for its `Welcome`).
    pub fn new(dev: &Arc<Device>) -> Result<Prover> {
        let cq = Arc::new(Cq::new(dev, 2 * SENDS)?);
        let caps = Caps { send_wr: SENDS, recv_wr: 1, send_sge: 1, recv_sge: 1, inline: PROOF_LEN as u32 };
        let qp = Qp::new(dev, ibv_qp_type::IBV_QPT_UD, &cq, &cq, caps)?;
        qp.ud_ready()?;
        let proof = Proof { conn_qpn: 0, token: 0 };
        Ok(Prover { cq, qp, dev: Arc::clone(dev), to: ([0; 16], [0; 16], 0), proof, ahs: HashMap::new() })
    }

    /// Prove to the server whose `Welcome` this is: its GID and proof QP,
    /// the connection's QP there and its token.
    pub fn aim(&mut self, w: &Welcome) {
        self.to = (w.gid, w.gid6, w.proof_qpn);
        self.proof = Proof { conn_qpn: w.qpn, token: w.token };
    }

    /// Send one proof from our `gid` and wait (asleep on the completion
    /// channel), up to `timeout`, for it to leave. EADDRNOTAVAIL: not a GID of our device, or an IPv6 one and
    /// the server has no IPv6 GID (a datagram goes from one family to the
    /// same).
    pub fn prove(&mut self, gid: &Gid, timeout: Duration) -> Result<()> {
        let sgid_index = self.dev.gid_index(gid).map_err(|_| Errno(libc::EADDRNOTAVAIL))?;
        let to = if rdma::is_ipv4_gid(gid) { self.to.0 } else { self.to.1 };
        if to == [0; 16] {
            return Err(Errno(libc::EADDRNOTAVAIL));
        }
        if !self.ahs.contains_key(&sgid_index) {
            let mut attr = self.qp.ah_attr(sgid_index, &to);
            self.ahs.insert(sgid_index, Ah::new(&self.dev, &mut attr)?);
        }
        let mut msg = [0u8; PROOF_LEN];
        self.proof.encode(&mut msg);
        let mut sge = ibv_sge { addr: msg.as_ptr() as u64, length: PROOF_LEN as u32, lkey: 0 };
        // SAFETY: a plain C struct.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0 | ibv_send_flags::IBV_SEND_INLINE.0;
        wr.wr.ud.ah = self.ahs[&sgid_index].ah;
        wr.wr.ud.remote_qpn = self.to.2;
        wr.wr.ud.remote_qkey = rdma::QKEY;
        // SAFETY: inline data is copied at post time; the AH lives in
        // `ahs` as long as the QP.
        unsafe { self.qp.post_send(&mut wr) }?;
        // SAFETY: ibv_wc is plain C data.
        let mut wc: [ibv_wc; 1] = unsafe { std::mem::zeroed() };
        let deadline = Instant::now() + timeout;
        loop {
            if self.cq.poll(&mut wc)? == 1 {
                return match wc[0].status {
                    ibv_wc_status::IBV_WC_SUCCESS => Ok(()),
                    _ => Err(Errno(libc::EIO)),
                };
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Errno(libc::ETIMEDOUT));
            }
            self.cq.wait(Some(deadline - now))?;
        }
    }
}

/// Proof datagrams the server's QP can take at once.
const RECVS: usize = 64;
/// A receive slot: the GRH, then the proof (cache-line aligned).
const SLOT: usize = 128;
const _: () = assert!(rdma::GRH_LEN + PROOF_LEN <= SLOT);

/// The server's half: a UD QP whose receives complete on the server's CQ.
pub struct ProofQp {
    qp: Qp,
    bufs: Region,
}

impl ProofQp {
    pub fn new(dev: &Arc<Device>, cq: &Arc<Cq>) -> Result<ProofQp> {
        let caps = Caps { send_wr: 1, recv_wr: RECVS as u32, send_sge: 1, recv_sge: 1, inline: 0 };
        let qp = Qp::new(dev, ibv_qp_type::IBV_QPT_UD, cq, cq, caps)?;
        qp.ud_ready()?;
        let me = ProofQp { qp, bufs: Region::new(dev, RECVS * SLOT, rdma::LOCAL_WRITE)? };
        for slot in 0..RECVS {
            me.post_recv(slot)?;
        }
        Ok(me)
    }

    /// Completions on the server's CQ that are this QP's.
    pub fn qpn(&self) -> u32 {
        self.qp.qpn()
    }

    /// Completions the server's CQ must have room for.
    pub const CQES: usize = RECVS;

    /// A receive of ours completed: the proof it holds and the GID it came
    /// from, or why it proves nothing (EBADMSG: malformed or without a
    /// GRH; the completion's error). The slot is posted again.
    pub fn take(&self, wc: &ibv_wc) -> Result<Result<(Proof, Gid)>> {
        let slot = wc.wr_id as usize;
        if slot >= RECVS {
            return Ok(Err(Errno(libc::EBADMSG)));
        }
        let got = if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
            Err(Errno(libc::EIO))
        } else if wc.wc_flags & ibv_wc_flags::IBV_WC_GRH.0 == 0 || wc.byte_len as usize != rdma::GRH_LEN + PROOF_LEN {
            Err(Errno(libc::EBADMSG))
        } else {
            // SAFETY: this slot's receive completed; it is reposted below.
            let b = unsafe { self.bufs.bytes(slot * SLOT, rdma::GRH_LEN + PROOF_LEN) };
            match (Proof::decode(&b[rdma::GRH_LEN..]), rdma::grh_gids(&b[..rdma::GRH_LEN])) {
                (Ok(p), Some((gid, _))) => Ok((p, gid)),
                _ => Err(Errno(libc::EBADMSG)),
            }
        };
        if wc.status != ibv_wc_status::IBV_WC_WR_FLUSH_ERR {
            self.post_recv(slot)?;
        }
        Ok(got)
    }

    fn post_recv(&self, slot: usize) -> Result<()> {
        let mut sge = self.bufs.sge(slot * SLOT, rdma::GRH_LEN + PROOF_LEN);
        // SAFETY: a plain C struct.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = slot as u64;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        // SAFETY: one WR over our own registered buffer.
        unsafe { self.qp.post_recv(&mut wr) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grh_names_the_source_gid_for_ipv6_and_ipv4() {
        let mut v6 = [0u8; rdma::GRH_LEN];
        v6[0] = 0x60;
        v6[8..24].copy_from_slice(&[0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]);
        v6[24..40].copy_from_slice(&[0xfe, 0x80, 0, 0, 0, 0, 0, 0, 9, 9, 9, 9, 9, 9, 9, 9]);
        let (src, dst) = rdma::grh_gids(&v6).unwrap();
        assert_eq!(src, [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(dst[8..], [9; 8]);
        // RoCE v2 over IPv4: the IPv4 header in the last 20 bytes.
        let mut v4 = [0u8; rdma::GRH_LEN];
        v4[20] = 0x45;
        v4[32..36].copy_from_slice(&[10, 77, 0, 3]);
        v4[36..40].copy_from_slice(&[10, 77, 0, 1]);
        let (src, dst) = rdma::grh_gids(&v4).unwrap();
        assert_eq!(src, rdma::ipv4_gid(std::net::Ipv4Addr::new(10, 77, 0, 3)));
        assert_eq!(dst, rdma::ipv4_gid(std::net::Ipv4Addr::new(10, 77, 0, 1)));
        // Neither: nothing is proven.
        assert_eq!(rdma::grh_gids(&[0u8; rdma::GRH_LEN]), None);
    }
}
