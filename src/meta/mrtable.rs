//! This process's MR table ("ValidMR" in the paper): rkey -> (address,
//! length, access) of the MRs it registered, kept in its own registered
//! memory and READ by the peers it has links with, which check a remote
//! address and rkey there before posting a one-sided verb against them (and
//! cache what they READ, with a lease: the MRStore).
//!
//! It is a [`table`](super::table) with 64-byte slots and 512-byte
//! neighborhood READs; hashing, the seq/checksum protocol and the reader's
//! rules are that module's, this one only defines the entry. One table per
//! device context, as rkeys are unique per device, not per process. Its
//! region needs REMOTE_READ only; its address, rkey and the owner's
//! incarnation travel in the link request.
//!
//! # A reused rkey
//!
//! After `ibv_dereg_mr` the NIC may give the same rkey to a new MR. A peer
//! never checks a WR against the old MR's bounds while the key names the
//! new one, because:
//!
//! - Within one READ, seq and checksum: a READ that overlaps the owner
//!   rewriting a slot returns the old entry, the new one, or Torn, never the
//!   old address with the new length.
//! - Across READs, what the table guarantees: it never rebinds a present
//!   rkey (inserting another `MrInfo` for it is EADDRINUSE), so an entry for
//!   the new MR can only follow the removal of the old one; `Found(info)`
//!   means the rkey named `info` at some instant during the READ, `Absent`
//!   that it named nothing at some instant during it. A peer may keep a
//!   `Found` for its lease, counted from when it posted the READ. So the
//!   owner removes the entry first and deregisters for real only a lease
//!   (plus a margin for clock rate drift; each side measures a duration on
//!   its own monotonic clock, no synchronized clocks) later: every cached
//!   copy of the old entry expires before the NIC can reuse the key. That
//!   delay is the owner's MR code's job, not this module's.

use super::table::{FieldReader, FieldWriter, RemoteTable, Schema, Table};

/// An MR as its peers check it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MrInfo {
    pub addr: u64,
    pub len: u64,
    /// `ibv_access_flags` bits the MR was registered with.
    pub access: u32,
}

/// The MR table: rkey -> [`MrInfo`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MrSchema;

impl Schema for MrSchema {
    type Key = u32;
    type Value = MrInfo;
    const MAGIC: u64 = u64::from_le_bytes(*b"KRCMRTBL");
    const SLOT_SIZE: usize = 64;
    const KEY_LEN: usize = 4;
    /// Address, length, access.
    const VALUE_LEN: usize = 8 + 8 + 4;

    fn encode_key(rkey: &u32, out: &mut [u8]) {
        FieldWriter(out).put(&rkey.to_le_bytes());
    }

    fn encode_value(mr: &MrInfo, out: &mut [u8]) {
        FieldWriter(out).put(&mr.addr.to_le_bytes()).put(&mr.len.to_le_bytes()).put(&mr.access.to_le_bytes());
    }

    fn decode_value(bytes: &[u8]) -> MrInfo {
        let mut fields = FieldReader(bytes);
        MrInfo { addr: fields.u64(), len: fields.u64(), access: fields.u32() }
    }
}

/// This process's MR table, owner side.
pub type MrTable<'a> = Table<'a, MrSchema>;

/// A peer's MR table, reader side.
pub type RemoteMrTable = RemoteTable<MrSchema>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Errno;
    use crate::meta::table::testing::*;
    use crate::meta::table::{EndpointTable, Lookup, HEADER_SIZE, NEIGHBORHOOD};

    fn mr(n: u64) -> MrInfo {
        MrInfo { addr: 0x7f00_0000_0000 + (n << 20), len: 0x1000 * (n + 1), access: 0x7 ^ n as u32 }
    }

    #[test]
    fn layout_constants() {
        assert_eq!(MrTable::bytes_for(1), 64 + 8 * 64);
        assert_eq!(MrTable::bytes_for(1000), 64 + 1007 * 64);
        let mut buf = Vec::new();
        let mem = aligned(&mut buf, MrTable::bytes_for(16));
        let table = MrTable::init(mem, 16, 5).unwrap();
        let remote = RemoteMrTable::parse(table.as_bytes()).unwrap();
        assert_eq!((remote.nslots(), remote.incarnation()), (16, 5));
        let (offset, len) = remote.neighborhood(0x1234);
        assert_eq!(len, NEIGHBORHOOD * 64);
        assert_eq!((offset - HEADER_SIZE as u64) % 64, 0);
        assert!(offset as usize + len <= MrTable::bytes_for(16));
    }

    #[test]
    fn slot_layout_is_pinned() {
        let mut buf = Vec::new();
        let mut table = MrTable::init(aligned(&mut buf, MrTable::bytes_for(1)), 1, 0).unwrap();
        table.insert(0xa1b2_c3d4, mr(3)).unwrap();
        let slot = &table.as_bytes()[HEADER_SIZE..][..64];
        assert_eq!(slot[..8], 2u64.to_le_bytes());
        assert_eq!(slot[8], 1);
        assert_eq!(slot[9..13], 0xa1b2_c3d4u32.to_le_bytes());
        assert_eq!(slot[13..21], mr(3).addr.to_le_bytes());
        assert_eq!(slot[21..29], mr(3).len.to_le_bytes());
        assert_eq!(slot[29..33], mr(3).access.to_le_bytes());
        assert!(slot[33..56].iter().all(|&b| b == 0));
        // FNV-1a 64 of seq then payload, pinned: peers of other versions
        // must compute the same.
        assert_eq!(slot[56..], 0xe24d_d412_7787_1249u64.to_le_bytes());
    }

    /// What a link's handshake says (slots, incarnation) finds every MR
    /// as the header READ did: the first post needs no READ of the header.
    #[test]
    fn a_table_known_from_the_link_finds_what_the_header_finds() {
        let mut buf = Vec::new();
        let mut table = MrTable::init(aligned(&mut buf, MrTable::bytes_for(37)), 37, 0x5eed).unwrap();
        let parsed = RemoteMrTable::parse(table.as_bytes()).unwrap();
        let known = RemoteMrTable::known(37, 0x5eed).unwrap();
        assert_eq!(known, parsed);
        for rkey in (0..30).map(|i| (i << 8) | 0x11) {
            table.insert(rkey, mr(u64::from(rkey & 7))).unwrap();
        }
        for rkey in (0..40).map(|i| (i << 8) | 0x11) {
            assert_eq!(known.neighborhood(rkey), parsed.neighborhood(rkey));
            let bytes = read(&table, &known, rkey);
            let expected = (rkey >> 8 < 30).then(|| mr(u64::from(rkey & 7)));
            assert_eq!(known.lookup_in(bytes, rkey), expected.map_or(Lookup::Absent, Lookup::Found));
        }
        assert_eq!(RemoteMrTable::known(0, 1), Err(Errno(libc::EPROTO)));
    }

    #[test]
    fn tables_of_other_kinds_are_rejected() {
        let mut buf = Vec::new();
        let mem = aligned(&mut buf, EndpointTable::bytes_for(4));
        let endpoints = EndpointTable::init(mem, 4, 0).unwrap();
        let parsed = RemoteMrTable::parse(endpoints.as_bytes());
        assert_eq!(parsed, Err(Errno(libc::EPROTO)));
    }

    #[test]
    fn insert_get_remove_and_lookup_in() {
        let mut buf = Vec::new();
        let mut table = MrTable::init(aligned(&mut buf, MrTable::bytes_for(8)), 8, 0).unwrap();
        let remote = RemoteMrTable::parse(table.as_bytes()).unwrap();
        for rkey in 0..6 {
            table.insert(rkey << 8, mr(u64::from(rkey))).unwrap();
        }
        assert!(table.remove(2 << 8));
        assert_eq!(table.len(), 5);
        for rkey in 0..8 {
            let expected = (rkey != 2 && rkey < 6).then(|| mr(u64::from(rkey)));
            assert_eq!(table.get(rkey << 8), expected);
            let bytes = read(&table, &remote, rkey << 8);
            let found = remote.lookup_in(bytes, rkey << 8);
            assert_eq!(found, expected.map_or(Lookup::Absent, Lookup::Found));
        }
    }

    #[test]
    fn a_reused_rkey_reads_as_the_old_mr_the_new_one_or_torn() {
        let mut buf = Vec::new();
        let mut table = MrTable::init(aligned(&mut buf, MrTable::bytes_for(4)), 4, 0).unwrap();
        let rkey = 0x0000_2a07;
        table.insert(rkey, mr(1)).unwrap();
        // The NIC hands the key to a new MR: no rebinding in place...
        assert_eq!(table.insert(rkey, mr(2)), Err(Errno(libc::EADDRINUSE)));
        assert_eq!(table.get(rkey), Some(mr(1)));
        // ... only removal, then insertion (a lease apart, in the owner).
        let reuse = |table: &mut MrTable| {
            assert!(table.remove(rkey));
            table.insert(rkey, mr(2)).unwrap();
        };
        let found = Lookup::Found;
        assert_eq!(check_torn_reads(&mut table, rkey, reuse), (found(mr(1)), found(mr(2))));
    }

    #[test]
    fn random_operations_match_a_hashmap() {
        // rkeys shaped like mlx5's (index << 8 | variant), some sharing an
        // index.
        let rkey = |i: u64| (((i / 3) << 8) | (i % 3)) as u32;
        check_against_model::<MrSchema>(0xdead_beef_0bad_f00d, 16, rkey, mr);
    }
}
