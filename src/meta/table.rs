//! A hash table in registered memory that other processes read with
//! one-sided RDMA READs (DrTM/FaRM style), and the meta server's endpoint
//! table built on it.
//!
//! The owner inserts and removes with its CPU while READs may be in flight;
//! a reader finds a key with ONE READ and interprets the bytes it got with a
//! pure function. An RDMA READ is not atomic across its bytes (not even per
//! 8-byte word on every NIC), so it may return a slot that is part old, part
//! new: every slot carries what a reader needs to detect that.
//!
//! # Layout
//!
//! All integers little-endian; any change to what follows, to the hash or to
//! a schema's encoding is a new [`LAYOUT_VERSION`].
//!
//! ```text
//! offset 0    header, 64 B: magic u64 | version u32 | slot size u32 |
//!             nslots u32 | neighborhood u32 | owner incarnation u64 | zeroes
//! offset 64   nslots + NEIGHBORHOOD - 1 slots, `slot size` bytes each
//! slot        seq u64 | payload: used u8, key, value, zeroes | checksum u64
//! ```
//!
//! The used byte is there because an encoded key may be all zeroes, like an
//! empty slot's payload.
//!
//! The header is written once, by [`Table::init`], before the region is
//! published; a reader validates it with [`RemoteTable::parse`].
//!
//! A key's home slot is `fnv1a64(encoded key) % nslots` (FNV-1a 64: fixed and
//! the same in every process, unlike a seeded std hasher); the key lives in
//! one of the [`NEIGHBORHOOD`] slots from its home. Homes range over the
//! first `nslots` slots and `NEIGHBORHOOD - 1` extra slots follow them, so a
//! neighborhood never wraps around: one READ at
//! [`RemoteTable::neighborhood`] always covers it.
//!
//! Entries never move while present (no hopscotch displacement), and a
//! present key's value never changes in place: inserting another value is
//! refused, a change is remove + insert. That is what lets a READ that is not
//! atomic across slots still answer correctly: `Found(v)` means the key
//! mapped to `v` at some instant during the READ, `Absent` that it mapped to
//! nothing at some instant during it (a key present throughout sits in one
//! slot that nobody writes). The price is the load factor: without
//! displacement a neighborhood fills up well before the table does (with
//! uniform homes in a large table, the first ENOSPC comes near 25% load and
//! about 0.5% of the inserts up to 50% load fail), so size `nslots` at about
//! four times the entries expected.
//!
//! # Torn reads
//!
//! The owner writes a slot as: `seq <- seq + 1` (odd: being written),
//! fence, payload, checksum over (`seq + 2`, payload), fence,
//! `seq <- seq + 2`. A reader accepts a slot only when its seq is even and
//! the checksum matches (seq, payload). Bytes mixed from two versions fail
//! the checksum (but for a 2^-64 chance) whatever order the NIC read them
//! in, and since it covers the seq too, a slot that passes is one version
//! whole. So correctness does not rest on the fences, which only make the
//! odd seq visible before the payload changes, a cheap "torn" in practice.
//! (It could not: `fence(Release)` orders stores for other CPUs, and on
//! weakly ordered CPUs a device may need a stronger barrier, as rdma-core's
//! `udma_to_device_barrier` shows.)
//!
//! A slot that fails validation says nothing, however empty it looks: it
//! may be the key's own slot caught mid-insert. So only a validated slot
//! holding the key is `Found`, only a neighborhood whose every slot validated
//! is `Absent`, and anything else is `Torn`: the caller READs again (how many
//! times is its business).
//!
//! # Slot sizes
//!
//! Each table kind (a [`Schema`]) picks its slot size, a multiple of 64
//! bytes. The endpoint table's key and value take 1 + 21 + 36 = 58 bytes,
//! which do not fit next to seq and checksum in 64, so its slots are 128
//! bytes and its neighborhood READ is 1 KiB (one packet even at the smallest
//! RoCE MTU, 1024).

use crate::error::{Errno, Result};
use crate::meta::{Endpoint, Key};
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::{fence, AtomicU64, Ordering};

/// Bytes of the header in front of the slots.
pub const HEADER_SIZE: usize = 64;

/// Slots a key may live in, counted from its home slot.
pub const NEIGHBORHOOD: usize = 8;

/// Version of the layout in the module documentation.
pub const LAYOUT_VERSION: u32 = 1;

/// A slot's sequence number in front of its payload, its checksum after it.
const SEQ_LEN: usize = 8;
const CHECKSUM_LEN: usize = 8;

/// First payload byte of a slot that holds an entry (an empty slot's payload
/// is all zeroes).
const USED: u8 = 1;

/// Longest encoded key a schema may have: lookups encode on the stack.
const MAX_KEY_LEN: usize = 32;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// One kind of table: how its entries are encoded in a slot's payload.
///
/// Keys are hashed and compared in their encoded form, so `encode_key` must
/// be canonical (one encoding per key). Everything here is part of the layout
/// that other processes read.
pub trait Schema {
    type Key;
    type Value: PartialEq;
    /// Tells this kind of table from other kinds (and from garbage).
    const MAGIC: u64;
    /// A multiple of 64 with room for seq, checksum, used byte, key and value.
    const SLOT_SIZE: usize;
    const KEY_LEN: usize;
    const VALUE_LEN: usize;
    /// Writes `key` into `out`, exactly `KEY_LEN` bytes.
    fn encode_key(key: &Self::Key, out: &mut [u8]);
    /// Writes `value` into `out`, exactly `VALUE_LEN` bytes.
    fn encode_value(value: &Self::Value, out: &mut [u8]);
    /// Decodes `VALUE_LEN` bytes; any bytes decode (they come from a peer).
    fn decode_value(bytes: &[u8]) -> Self::Value;
}

/// What a reader made of a neighborhood it READ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup<V> {
    Found(V),
    /// Every slot validated and none holds the key.
    Absent,
    /// Some slot did not validate and none that did holds the key: READ again.
    Torn,
}

/// The owner's side: the table over its registered memory.
pub struct Table<'a, S> {
    /// Exactly `bytes_for(nslots)` bytes, aligned for [`AtomicU64`].
    mem: &'a mut [u8],
    nslots: u32,
    len: usize,
    schema: PhantomData<S>,
}

impl<'a, S: Schema> Table<'a, S> {
    /// Bytes of registered memory a table of `nslots` home slots needs
    /// (no overflow: `nslots` is a u32 and RDMA hosts have a 64-bit usize).
    pub fn bytes_for(nslots: u32) -> usize {
        HEADER_SIZE + (nslots as usize + NEIGHBORHOOD - 1) * S::SLOT_SIZE
    }

    /// Lays out an empty table at the start of `mem`, which must be aligned
    /// for [`AtomicU64`] (registered memory is page-aligned) and at least
    /// `bytes_for(nslots)` long. Call it before the region is published:
    /// these writes are not protected against concurrent READs.
    pub fn init(mem: &'a mut [u8], nslots: u32, incarnation: u64) -> Result<Self> {
        let () = SchemaCheck::<S>::VALID;
        let size = Self::bytes_for(nslots);
        let aligned = mem.as_ptr().align_offset(align_of::<AtomicU64>()) == 0;
        if nslots == 0 || mem.len() < size || !aligned {
            return Err(Errno::EINVAL);
        }
        let mem = &mut mem[..size];
        mem.fill(0);
        let (header, slots) = mem.split_at_mut(HEADER_SIZE);
        FieldWriter(header)
            .put(&S::MAGIC.to_le_bytes())
            .put(&LAYOUT_VERSION.to_le_bytes())
            .put(&(S::SLOT_SIZE as u32).to_le_bytes())
            .put(&nslots.to_le_bytes())
            .put(&(NEIGHBORHOOD as u32).to_le_bytes())
            .put(&incarnation.to_le_bytes());
        for slot in slots.chunks_exact_mut(S::SLOT_SIZE) {
            seal(slot, 0);
        }
        Ok(Table { mem, nslots, len: 0, schema: PhantomData })
    }

    /// Maps `key` to `value`. Inserting the value the key already has is a
    /// no-op (a lease renewal); EADDRINUSE if it has another one, ENOSPC if
    /// the key's neighborhood is full.
    pub fn insert(&mut self, key: S::Key, value: S::Value) -> Result<()> {
        let key = EncodedKey::new::<S>(&key);
        if let Some(i) = self.find(&key) {
            return if slot_value::<S>(self.slot(i)) == value { Ok(()) } else { Err(Errno(libc::EADDRINUSE)) };
        }
        let free = self.neighborhood(&key).find(|&i| payload(self.slot(i))[0] != USED).ok_or(Errno(libc::ENOSPC))?;
        self.write(free, |payload| {
            let mut fields = FieldWriter(payload);
            fields.put(&[USED]).put(key.bytes());
            S::encode_value(&value, &mut fields.0[..S::VALUE_LEN]);
        });
        self.len += 1;
        Ok(())
    }

    /// Removes `key`; false if it was not present.
    pub fn remove(&mut self, key: S::Key) -> bool {
        let Some(i) = self.find(&EncodedKey::new::<S>(&key)) else {
            return false;
        };
        self.write(i, |_| {});
        self.len -= 1;
        true
    }

    pub fn get(&self, key: S::Key) -> Option<S::Value> {
        let i = self.find(&EncodedKey::new::<S>(&key))?;
        Some(slot_value::<S>(self.slot(i)))
    }

    /// Entries present.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole region as a READ sees it (the header comes first).
    pub fn as_bytes(&self) -> &[u8] {
        self.mem
    }

    /// Indices of the slots `key` may live in.
    fn neighborhood(&self, key: &EncodedKey) -> Range<usize> {
        let home = key.home(self.nslots) as usize;
        home..home + NEIGHBORHOOD
    }

    fn find(&self, key: &EncodedKey) -> Option<usize> {
        self.neighborhood(key).find(|&i| holds(self.slot(i), key))
    }

    fn slot(&self, i: usize) -> &[u8] {
        &self.mem[Self::slot_range(i)]
    }

    fn slot_mut(&mut self, i: usize) -> &mut [u8] {
        &mut self.mem[Self::slot_range(i)]
    }

    fn slot_range(i: usize) -> Range<usize> {
        let start = HEADER_SIZE + i * S::SLOT_SIZE;
        start..start + S::SLOT_SIZE
    }

    /// Rewrites slot `i` with the protocol of the module documentation;
    /// `fill` writes the new payload over zeroes (leaving it zero empties
    /// the slot).
    fn write(&mut self, i: usize, fill: impl FnOnce(&mut [u8])) {
        let odd = self.begin_write(i);
        self.end_write(i, odd, fill);
    }

    /// The first step of a write: an odd seq, made visible before any
    /// payload byte changes. Returns that seq.
    fn begin_write(&mut self, i: usize) -> u64 {
        let slot = self.slot_mut(i);
        let odd = le_u64(&slot[..SEQ_LEN]) + 1;
        store_seq(slot, odd);
        fence(Ordering::Release);
        odd
    }

    /// The other steps: payload, checksum for the next even seq, then that
    /// seq, made visible after them.
    fn end_write(&mut self, i: usize, odd: u64, fill: impl FnOnce(&mut [u8])) {
        let slot = self.slot_mut(i);
        let len = slot.len();
        let payload = &mut slot[SEQ_LEN..len - CHECKSUM_LEN];
        payload.fill(0);
        fill(payload);
        seal(slot, odd + 1);
        fence(Ordering::Release);
        store_seq(slot, odd + 1);
    }
}

/// A table as a reader knows it: from its validated header. Locating a key
/// and interpreting the bytes READ there both go through it, so no slot is
/// interpreted with a slot size or hash the owner did not use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteTable<S> {
    nslots: u32,
    incarnation: u64,
    schema: PhantomData<S>,
}

impl<S: Schema> RemoteTable<S> {
    /// Validates a header READ from a table or received at bootstrap (at
    /// least [`HEADER_SIZE`] bytes). EPROTO when it is not a header of this
    /// kind of table (length, magic, slot size, neighborhood, zero slots),
    /// EPROTONOSUPPORT when it is one of another layout version.
    pub fn parse(header: &[u8]) -> Result<Self> {
        let () = SchemaCheck::<S>::VALID;
        let malformed = Errno(libc::EPROTO);
        let mut fields = FieldReader(header.get(..HEADER_SIZE).ok_or(malformed)?);
        if fields.u64() != S::MAGIC {
            return Err(malformed);
        }
        if fields.u32() != LAYOUT_VERSION {
            return Err(Errno(libc::EPROTONOSUPPORT));
        }
        let slot_size = fields.u32();
        let nslots = fields.u32();
        let neighborhood = fields.u32();
        let incarnation = fields.u64();
        if slot_size as usize != S::SLOT_SIZE || neighborhood as usize != NEIGHBORHOOD || nslots == 0 {
            return Err(malformed);
        }
        Ok(RemoteTable { nslots, incarnation, schema: PhantomData })
    }

    /// Home slots (the region is `Table::bytes_for(nslots)` bytes).
    pub fn nslots(&self) -> u32 {
        self.nslots
    }

    /// The owner's incarnation, to compare with the one learned elsewhere:
    /// tells a restarted owner's table from the one that was cached.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The one READ that finds `key`: (byte offset from the start of the
    /// table, byte length).
    pub fn neighborhood(&self, key: S::Key) -> (u64, usize) {
        let home = EncodedKey::new::<S>(&key).home(self.nslots);
        let offset = HEADER_SIZE as u64 + home * S::SLOT_SIZE as u64;
        (offset, NEIGHBORHOOD * S::SLOT_SIZE)
    }

    /// Looks `key` up in the bytes a READ of its neighborhood returned.
    /// Slots missing from a short `bytes` count as not validated.
    pub fn lookup_in(&self, bytes: &[u8], key: S::Key) -> Lookup<S::Value> {
        let key = EncodedKey::new::<S>(&key);
        let mut validated = 0;
        for slot in bytes.chunks_exact(S::SLOT_SIZE).take(NEIGHBORHOOD) {
            if !is_valid(slot) {
                continue;
            }
            if holds(slot, &key) {
                return Lookup::Found(slot_value::<S>(slot));
            }
            validated += 1;
        }
        if validated == NEIGHBORHOOD {
            Lookup::Absent
        } else {
            Lookup::Torn
        }
    }
}

/// A schema's constants checked at compile time; every way to build a
/// [`Table`] or a [`RemoteTable`] evaluates this.
struct SchemaCheck<S>(PhantomData<S>);

impl<S: Schema> SchemaCheck<S> {
    const VALID: () = assert!(
        S::SLOT_SIZE % 64 == 0 && S::KEY_LEN <= MAX_KEY_LEN && SEQ_LEN + 1 + S::KEY_LEN + S::VALUE_LEN + CHECKSUM_LEN <= S::SLOT_SIZE
    );
}

/// A key in its canonical encoding: what is hashed and compared.
struct EncodedKey {
    buf: [u8; MAX_KEY_LEN],
    len: usize,
}

impl EncodedKey {
    fn new<S: Schema>(key: &S::Key) -> Self {
        let mut buf = [0; MAX_KEY_LEN];
        S::encode_key(key, &mut buf[..S::KEY_LEN]);
        EncodedKey { buf, len: S::KEY_LEN }
    }

    fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    fn home(&self, nslots: u32) -> u64 {
        fnv1a64(FNV_OFFSET, self.bytes()) % u64::from(nslots)
    }
}

/// FNV-1a 64 of `bytes`, continuing from `hash` (start from `FNV_OFFSET`).
fn fnv1a64(hash: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(hash, |hash, &byte| (hash ^ u64::from(byte)).wrapping_mul(FNV_PRIME))
}

fn checksum(seq: u64, payload: &[u8]) -> u64 {
    fnv1a64(fnv1a64(FNV_OFFSET, &seq.to_le_bytes()), payload)
}

fn payload(slot: &[u8]) -> &[u8] {
    &slot[SEQ_LEN..slot.len() - CHECKSUM_LEN]
}

/// Stable (even seq) and consistent (checksum of seq and payload).
fn is_valid(slot: &[u8]) -> bool {
    let seq = le_u64(&slot[..SEQ_LEN]);
    let stored = le_u64(&slot[slot.len() - CHECKSUM_LEN..]);
    seq % 2 == 0 && checksum(seq, payload(slot)) == stored
}

fn holds(slot: &[u8], key: &EncodedKey) -> bool {
    let payload = payload(slot);
    payload[0] == USED && payload[1..=key.len] == *key.bytes()
}

fn slot_value<S: Schema>(slot: &[u8]) -> S::Value {
    S::decode_value(&payload(slot)[1 + S::KEY_LEN..][..S::VALUE_LEN])
}

/// Writes the checksum of (`seq`, the slot's payload) into the slot.
fn seal(slot: &mut [u8], seq: u64) {
    let sum = checksum(seq, payload(slot));
    let at = slot.len() - CHECKSUM_LEN;
    slot[at..].copy_from_slice(&sum.to_le_bytes());
}

/// Stores a slot's sequence number as one 8-byte atomic store. The NIC reads
/// this memory concurrently, but through `&mut` the compiler may assume
/// nobody does: a plain store could be merged with the next one (no odd seq
/// would ever be visible), split, or moved across the fences.
fn store_seq(slot: &mut [u8], seq: u64) {
    let word = slot[..SEQ_LEN].as_mut_ptr().cast::<u64>();
    debug_assert!(word.is_aligned());
    // SAFETY: `word` points to 8 bytes of `slot`, which we borrow mutably, so
    // nothing else in this process accesses them while the atomic exists;
    // it is aligned because `Table::init` checked the region's alignment
    // and every slot starts a multiple of 64 bytes after it.
    let atomic = unsafe { AtomicU64::from_ptr(word) };
    // Relaxed: the fences around the call order it.
    atomic.store(seq.to_le(), Ordering::Relaxed);
}

fn le_u64(bytes: &[u8]) -> u64 {
    FieldReader(bytes).u64()
}

/// Writes fixed-size fields one after the other: the header and the
/// schemas' encodings.
pub(super) struct FieldWriter<'b>(pub(super) &'b mut [u8]);

impl FieldWriter<'_> {
    /// Panics past the end of the buffer, which callers size from layout
    /// constants, never from input.
    pub(super) fn put(&mut self, field: &[u8]) -> &mut Self {
        let (head, rest) = std::mem::take(&mut self.0).split_at_mut(field.len());
        head.copy_from_slice(field);
        self.0 = rest;
        self
    }
}

/// Reads little-endian fields one after the other.
pub(super) struct FieldReader<'b>(pub(super) &'b [u8]);

impl FieldReader<'_> {
    /// Panics past the end of the buffer, which callers size from layout
    /// constants, never from input.
    pub(super) fn array<const N: usize>(&mut self) -> [u8; N] {
        let (head, rest) = self.0.split_first_chunk().expect("field inside its fixed-size buffer");
        self.0 = rest;
        *head
    }

    pub(super) fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }

    pub(super) fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
}

/// The meta server's table: [`Key`] -> [`Endpoint`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointSchema;

/// Tags of the key encoding (0, an empty slot's byte, is neither).
const KEY_PORT: u8 = 1;
const KEY_VQPN: u8 = 2;

impl Schema for EndpointSchema {
    type Key = Key;
    type Value = Endpoint;
    const MAGIC: u64 = u64::from_le_bytes(*b"KRCEPTBL");
    const SLOT_SIZE: usize = 128;
    /// Tag, GID, port or VQPN.
    const KEY_LEN: usize = 1 + 16 + 4;
    /// GID, QPN, qkey, incarnation, VQPN.
    const VALUE_LEN: usize = 16 + 4 + 4 + 8 + 4;

    fn encode_key(key: &Key, out: &mut [u8]) {
        let (tag, gid, number) = match *key {
            Key::Port { gid, port } => (KEY_PORT, gid, port),
            Key::Vqpn { gid, vqpn } => (KEY_VQPN, gid, vqpn),
        };
        FieldWriter(out).put(&[tag]).put(&gid).put(&number.to_le_bytes());
    }

    fn encode_value(endpoint: &Endpoint, out: &mut [u8]) {
        FieldWriter(out)
            .put(&endpoint.gid)
            .put(&endpoint.qpn.to_le_bytes())
            .put(&endpoint.qkey.to_le_bytes())
            .put(&endpoint.incarnation.to_le_bytes())
            .put(&endpoint.vqpn.to_le_bytes());
    }

    fn decode_value(bytes: &[u8]) -> Endpoint {
        let mut fields = FieldReader(bytes);
        Endpoint { gid: fields.array(), qpn: fields.u32(), qkey: fields.u32(), incarnation: fields.u64(), vqpn: fields.u32() }
    }
}

/// The meta server's endpoint table, owner side.
pub type EndpointTable<'a> = Table<'a, EndpointSchema>;

/// The meta server's endpoint table, client side.
pub type RemoteEndpointTable = RemoteTable<EndpointSchema>;

/// Helpers of the tests: memory, a PRNG, simulated READs.
#[cfg(test)]
mod testing {
    use super::*;
    pub use crate::testing::Rng;
    use std::collections::HashMap;
    use std::fmt::Debug;
    use std::hash::Hash;

    /// `len` bytes of `buf` starting on a 64-byte boundary, as registered
    /// memory would (a `Vec<u8>` alone promises no alignment).
    pub fn aligned(buf: &mut Vec<u8>, len: usize) -> &mut [u8] {
        buf.resize(len + 64, 0);
        let offset = buf.as_ptr().align_offset(64);
        &mut buf[offset..offset + len]
    }

    /// The bytes a READ of `key`'s neighborhood would return now.
    pub fn read<'t, S: Schema>(table: &'t Table<'_, S>, remote: &RemoteTable<S>, key: S::Key) -> &'t [u8] {
        let (offset, len) = remote.neighborhood(key);
        &table.as_bytes()[offset as usize..][..len]
    }

    /// Calls `f` with bytes a READ could return while the neighborhood
    /// changed from `a` to `b`: cut at every byte offset (so at every 8-byte
    /// boundary too) either way round, and interleaved at random word by
    /// word and byte by byte (a NIC may read in any order).
    fn for_each_mix(a: &[u8], b: &[u8], mut f: impl FnMut(&[u8])) {
        let mut mixed = vec![0; a.len()];
        for cut in 0..=a.len() {
            for (first, second) in [(a, b), (b, a)] {
                mixed[..cut].copy_from_slice(&first[..cut]);
                mixed[cut..].copy_from_slice(&second[cut..]);
                f(&mixed);
            }
        }
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for grain in [8, 1] {
            for _ in 0..200 {
                for (i, chunk) in mixed.chunks_mut(grain).enumerate() {
                    let source = if rng.next() & 1 == 0 { a } else { b };
                    chunk.copy_from_slice(&source[i * grain..][..chunk.len()]);
                }
                f(&mixed);
            }
        }
    }

    /// Snapshots `key`'s neighborhood, applies `update`, snapshots again and
    /// checks that every mix of the two snapshots reads as the first, as the
    /// second, or as Torn. Returns what the two snapshots read as.
    pub fn check_torn_reads<S: Schema>(
        table: &mut Table<'_, S>,
        key: S::Key,
        update: impl FnOnce(&mut Table<'_, S>),
    ) -> (Lookup<S::Value>, Lookup<S::Value>)
    where
        S::Key: Copy,
        S::Value: Debug,
    {
        let remote = RemoteTable::<S>::parse(table.as_bytes()).unwrap();
        let before = read(table, &remote, key).to_vec();
        update(table);
        let after = read(table, &remote, key).to_vec();
        let old = remote.lookup_in(&before, key);
        let new = remote.lookup_in(&after, key);
        let mut torn = 0;
        for_each_mix(&before, &after, |mixed| {
            let got = remote.lookup_in(mixed, key);
            assert!(got == old || got == new || got == Lookup::Torn, "{got:?} is neither {old:?} nor {new:?}");
            torn += usize::from(got == Lookup::Torn);
        });
        // A key found unchanged reads the same whatever the other slots
        // hold; any other change must be caught tearing by some mix.
        let unchanged = old == new && matches!(old, Lookup::Found(_));
        assert!(torn > 0 || unchanged || before == after);
        (old, new)
    }

    /// Random inserts and removes over a few keys, crowded into few slots,
    /// against a `HashMap`: results, `len`, `get` and `lookup_in` on the
    /// bytes of the table must all agree with the model.
    pub fn check_against_model<S: Schema>(seed: u64, nslots: u32, make_key: impl Fn(u64) -> S::Key, make_value: impl Fn(u64) -> S::Value)
    where
        S::Key: Copy + Eq + Hash + Debug,
        S::Value: Copy + Debug,
    {
        const KEYS: u64 = 48;
        let mut buf = Vec::new();
        let mem = aligned(&mut buf, Table::<S>::bytes_for(nslots));
        let mut table = Table::<S>::init(mem, nslots, seed).unwrap();
        let remote = RemoteTable::<S>::parse(table.as_bytes()).unwrap();
        let mut model = HashMap::new();
        let mut rng = Rng(seed);
        let (mut renewals, mut in_use, mut full) = (0, 0, 0);
        for op in 0..3000 {
            let key = make_key(rng.below(KEYS));
            if rng.below(3) < 2 {
                let value = make_value(rng.below(3));
                match (table.insert(key, value), model.get(&key)) {
                    (Ok(()), None) => {
                        model.insert(key, value);
                    }
                    (Ok(()), Some(&old)) if old == value => renewals += 1,
                    (Err(e), Some(&old)) if e == Errno(libc::EADDRINUSE) && old != value => in_use += 1,
                    (Err(e), None) if e == Errno(libc::ENOSPC) => {
                        let bytes = read(&table, &remote, key);
                        let used = |slot: &[u8]| payload(slot)[0] == USED;
                        assert!(bytes.chunks_exact(S::SLOT_SIZE).all(used));
                        full += 1;
                    }
                    (result, old) => panic!("insert {key:?}: {result:?}, model had {old:?}"),
                }
            } else {
                assert_eq!(table.remove(key), model.remove(&key).is_some());
            }
            assert_eq!(table.len(), model.len());
            let checked = if op % 100 == 0 { 0..KEYS } else { 0..0 };
            for key in checked.map(&make_key).chain([key]) {
                let expected = model.get(&key).copied();
                assert_eq!(table.get(key), expected, "{key:?}");
                let found = remote.lookup_in(read(&table, &remote, key), key);
                assert_eq!(found, expected.map_or(Lookup::Absent, Lookup::Found));
            }
        }
        // Every outcome was exercised.
        assert!(renewals > 0 && in_use > 0 && full > 0, "{renewals} {in_use} {full}");
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    const SLOT: usize = EndpointSchema::SLOT_SIZE;
    const INCARNATION: u64 = 0x0123_4567_89ab_cdef;

    fn port(n: u32) -> Key {
        Key::Port { gid: [0xfe; 16], port: n }
    }

    fn endpoint(n: u32) -> Endpoint {
        Endpoint {
            gid: [n as u8; 16],
            qpn: 0x11_0000 + n,
            qkey: 0x1111_1111,
            incarnation: 0xabcd_0000_0000_0000 | u64::from(n),
            vqpn: 0x22_0000 + n,
        }
    }

    fn new_table(buf: &mut Vec<u8>, nslots: u32) -> EndpointTable<'_> {
        let mem = aligned(buf, EndpointTable::bytes_for(nslots));
        EndpointTable::init(mem, nslots, INCARNATION).unwrap()
    }

    /// `n` keys whose home slot is `home`.
    fn keys_at(remote: &RemoteEndpointTable, home: usize, n: usize) -> Vec<Key> {
        let offset = (HEADER_SIZE + home * SLOT) as u64;
        (0..).map(port).filter(|&key| remote.neighborhood(key).0 == offset).take(n).collect()
    }

    #[test]
    fn layout_constants() {
        assert_eq!(HEADER_SIZE, 64);
        assert_eq!(NEIGHBORHOOD, 8);
        assert_eq!(SLOT, 128);
        assert_eq!(EndpointTable::bytes_for(1), 64 + 8 * 128);
        assert_eq!(EndpointTable::bytes_for(100), 64 + 107 * 128);
        let mut buf = Vec::new();
        let table = new_table(&mut buf, 5);
        let remote = RemoteEndpointTable::parse(table.as_bytes()).unwrap();
        // The last home's neighborhood ends exactly at the end of the region.
        let last = keys_at(&remote, 4, 1)[0];
        assert_eq!(remote.neighborhood(last), (64 + 4 * 128, 1024));
        assert_eq!(64 + 4 * 128 + 1024, EndpointTable::bytes_for(5));
        assert_eq!(remote.neighborhood(keys_at(&remote, 0, 1)[0]), (64, 1024));
    }

    #[test]
    fn hash_is_fnv1a64_and_homes_are_pinned() {
        assert_eq!(fnv1a64(FNV_OFFSET, b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(FNV_OFFSET, b"foobar"), 0x8594_4171_f739_67e8);
        // Every process must agree on where a key lives: pin one encoding
        // and home, so that a change to either fails here.
        let key = Key::Vqpn { gid: [1; 16], vqpn: 0x12_3456 };
        let encoded = EncodedKey::new::<EndpointSchema>(&key);
        let mut expected = vec![KEY_VQPN];
        expected.extend([1; 16]);
        expected.extend([0x56, 0x34, 0x12, 0]);
        assert_eq!(encoded.bytes(), expected);
        assert_eq!(fnv1a64(FNV_OFFSET, encoded.bytes()), 0x752e_e083_3dea_aeed);
        assert_eq!(encoded.home(1000), 669);
    }

    #[test]
    fn header_round_trip() {
        let mut buf = Vec::new();
        let table = new_table(&mut buf, 37);
        let header = &table.as_bytes()[..HEADER_SIZE];
        assert_eq!(&header[..8], b"KRCEPTBL");
        assert_eq!(header[8..12], LAYOUT_VERSION.to_le_bytes());
        assert_eq!(header[12..16], 128u32.to_le_bytes());
        assert_eq!(header[16..20], 37u32.to_le_bytes());
        assert_eq!(header[20..24], 8u32.to_le_bytes());
        assert_eq!(header[24..32], INCARNATION.to_le_bytes());
        assert!(header[32..].iter().all(|&b| b == 0));
        let remote = RemoteEndpointTable::parse(header).unwrap();
        assert_eq!((remote.nslots(), remote.incarnation()), (37, INCARNATION));
    }

    #[test]
    fn header_rejections() {
        let mut buf = Vec::new();
        let table = new_table(&mut buf, 4);
        let good = table.as_bytes()[..HEADER_SIZE].to_vec();
        let parse_with = |at: usize, field: &[u8]| {
            let mut header = good.clone();
            header[at..at + field.len()].copy_from_slice(field);
            RemoteEndpointTable::parse(&header).map(|_| ())
        };
        let malformed = Err(Errno(libc::EPROTO));
        assert_eq!(parse_with(0, &good[..8]), Ok(()));
        assert_eq!(RemoteEndpointTable::parse(&good[..63]).map(|_| ()), malformed);
        assert_eq!(parse_with(0, b"KRCMRTBL"), malformed);
        assert_eq!(parse_with(0, &[0; 8]), malformed);
        let other_version = (LAYOUT_VERSION + 1).to_le_bytes();
        assert_eq!(parse_with(8, &other_version), Err(Errno(libc::EPROTONOSUPPORT)));
        assert_eq!(parse_with(12, &64u32.to_le_bytes()), malformed);
        assert_eq!(parse_with(16, &0u32.to_le_bytes()), malformed);
        assert_eq!(parse_with(20, &16u32.to_le_bytes()), malformed);
    }

    #[test]
    fn init_rejections() {
        let mut buf = Vec::new();
        let size = EndpointTable::bytes_for(4);
        let mem = aligned(&mut buf, size + 1);
        assert!(EndpointTable::init(&mut mem[1..], 4, 0).is_err_and(|e| e == Errno::EINVAL));
        assert!(EndpointTable::init(&mut mem[..size - 1], 4, 0).is_err_and(|e| e == Errno::EINVAL));
        assert!(EndpointTable::init(mem, 0, 0).is_err_and(|e| e == Errno::EINVAL));
        // A larger region is fine: the table takes its start.
        assert!(EndpointTable::init(mem, 4, 0).is_ok());
    }

    #[test]
    fn insert_get_remove() {
        let mut buf = Vec::new();
        let mut table = new_table(&mut buf, 16);
        let vqpn = Key::Vqpn { gid: [0xfe; 16], vqpn: 7 };
        assert!(table.is_empty());
        table.insert(port(7), endpoint(1)).unwrap();
        // Same GID and number, other kind of key: another entry.
        assert_eq!(table.get(vqpn), None);
        table.insert(vqpn, endpoint(2)).unwrap();
        assert_eq!(table.len(), 2);
        assert_eq!(table.get(port(7)), Some(endpoint(1)));
        assert_eq!(table.get(vqpn), Some(endpoint(2)));
        assert!(table.remove(port(7)));
        assert!(!table.remove(port(7)));
        assert_eq!(table.get(port(7)), None);
        assert_eq!(table.get(vqpn), Some(endpoint(2)));
        assert_eq!(table.len(), 1);
        table.insert(port(7), endpoint(3)).unwrap();
        assert_eq!(table.get(port(7)), Some(endpoint(3)));
    }

    #[test]
    fn reinsert_same_is_renewal_other_is_eaddrinuse() {
        let mut buf = Vec::new();
        let mut table = new_table(&mut buf, 16);
        table.insert(port(1), endpoint(1)).unwrap();
        let before = table.as_bytes().to_vec();
        table.insert(port(1), endpoint(1)).unwrap();
        // A renewal writes nothing: no READ can see it in progress.
        assert_eq!(table.as_bytes(), before);
        assert_eq!(table.insert(port(1), endpoint(2)), Err(Errno(libc::EADDRINUSE)));
        assert_eq!(table.get(port(1)), Some(endpoint(1)));
        assert_eq!(table.len(), 1);
    }

    #[test]
    fn full_neighborhood_at_the_end_of_the_table() {
        let mut buf = Vec::new();
        let mut table = new_table(&mut buf, 4);
        let remote = RemoteEndpointTable::parse(table.as_bytes()).unwrap();
        // Nine keys homed at the last home slot: eight fill it and the
        // extra slots after it, the ninth finds no room.
        let keys = keys_at(&remote, 3, NEIGHBORHOOD + 1);
        for (n, &key) in keys[..NEIGHBORHOOD].iter().enumerate() {
            table.insert(key, endpoint(n as u32)).unwrap();
        }
        let last = keys[NEIGHBORHOOD];
        assert_eq!(table.insert(last, endpoint(9)), Err(Errno(libc::ENOSPC)));
        assert_eq!(table.len(), NEIGHBORHOOD);
        assert_eq!(tail_of(&table).len(), NEIGHBORHOOD * SLOT);
        for (n, &key) in keys[..NEIGHBORHOOD].iter().enumerate() {
            let found = Lookup::Found(endpoint(n as u32));
            assert_eq!(table.get(key), Some(endpoint(n as u32)));
            assert_eq!(remote.lookup_in(tail_of(&table), key), found);
        }
        assert_eq!(remote.lookup_in(tail_of(&table), last), Lookup::Absent);
        // Removing one frees its slot for any key whose neighborhood has it.
        assert!(table.remove(keys[5]));
        table.insert(last, endpoint(9)).unwrap();
        let found = remote.lookup_in(tail_of(&table), last);
        assert_eq!(found, Lookup::Found(endpoint(9)));
        assert_eq!(remote.lookup_in(tail_of(&table), keys[5]), Lookup::Absent);
    }

    /// The neighborhood of the last home slot of a 4-slot table: the end of
    /// the region.
    fn tail_of<'t>(table: &'t EndpointTable<'_>) -> &'t [u8] {
        &table.as_bytes()[HEADER_SIZE + 3 * SLOT..]
    }

    #[test]
    fn slot_layout_is_pinned() {
        let mut buf = Vec::new();
        let mut table = new_table(&mut buf, 1);
        let key = port(0x0102_0304);
        table.insert(key, endpoint(5)).unwrap();
        let slot = &table.as_bytes()[HEADER_SIZE..][..SLOT];
        assert_eq!(slot[..8], 2u64.to_le_bytes());
        assert_eq!(slot[8], USED);
        assert_eq!(slot[9], KEY_PORT);
        assert_eq!(slot[10..26], [0xfe; 16]);
        assert_eq!(slot[26..30], 0x0102_0304u32.to_le_bytes());
        assert_eq!(slot[30..46], [5; 16]);
        assert_eq!(slot[46..50], 0x11_0005u32.to_le_bytes());
        assert_eq!(slot[50..54], 0x1111_1111u32.to_le_bytes());
        assert_eq!(slot[54..62], 0xabcd_0000_0000_0005u64.to_le_bytes());
        assert_eq!(slot[62..66], 0x22_0005u32.to_le_bytes());
        assert!(slot[66..120].iter().all(|&b| b == 0));
        assert_eq!(slot[120..], checksum(2, &slot[8..120]).to_le_bytes());
        table.remove(key);
        let slot = &table.as_bytes()[HEADER_SIZE..][..SLOT];
        assert_eq!(slot[..8], 4u64.to_le_bytes());
        assert!(slot[8..120].iter().all(|&b| b == 0));
    }

    #[test]
    fn lookup_in_agrees_with_get() {
        let mut buf = Vec::new();
        let mut table = new_table(&mut buf, 8);
        let remote = RemoteEndpointTable::parse(table.as_bytes()).unwrap();
        for n in 0..12 {
            table.insert(port(n), endpoint(n)).unwrap();
        }
        table.remove(port(3));
        for n in 0..20 {
            let expected = table.get(port(n)).map_or(Lookup::Absent, Lookup::Found);
            assert_eq!(expected == Lookup::Absent, n == 3 || n >= 12);
            let bytes = read(&table, &remote, port(n));
            assert_eq!(remote.lookup_in(bytes, port(n)), expected);
        }
    }

    #[test]
    fn torn_reads_give_old_new_or_torn() {
        let mut buf = Vec::new();
        let mut table = new_table(&mut buf, 4);
        let remote = RemoteEndpointTable::parse(table.as_bytes()).unwrap();
        let [other, key]: [Key; 2] = keys_at(&remote, 1, 2).try_into().unwrap();
        let (a, b) = (endpoint(0xa), endpoint(0xb));
        let (found, absent) = (Lookup::Found, Lookup::Absent);
        let mut check = |change: &dyn Fn(&mut EndpointTable)| check_torn_reads(&mut table, key, change);
        // Another key's slot changes while the key is absent...
        let insert_other = |t: &mut EndpointTable| t.insert(other, b).unwrap();
        assert_eq!(check(&insert_other), (absent, absent));
        assert_eq!(check(&|t| t.insert(key, a).unwrap()), (absent, found(a)));
        // ... and while it is present, in the slot before it.
        assert_eq!(check(&|t| assert!(t.remove(other))), (found(a), found(a)));
        assert_eq!(check(&insert_other), (found(a), found(a)));
        let replace = |t: &mut EndpointTable| {
            assert!(t.remove(key));
            t.insert(key, b).unwrap();
        };
        assert_eq!(check(&replace), (found(a), found(b)));
        assert_eq!(check(&|t| assert!(t.remove(key))), (found(b), absent));
    }

    #[test]
    fn a_slot_mid_write_is_torn() {
        let mut buf = Vec::new();
        let mut table = new_table(&mut buf, 4);
        let remote = RemoteEndpointTable::parse(table.as_bytes()).unwrap();
        let key = port(1);
        assert_eq!(remote.lookup_in(read(&table, &remote, key), key), Lookup::Absent);
        // Caught after the first step of a write to the key's home slot: its
        // payload and checksum are still the old, valid ones, but the seq
        // is odd, so not even the old (empty) state is believed.
        let home = EncodedKey::new::<EndpointSchema>(&key).home(4) as usize;
        let odd = table.begin_write(home);
        assert_eq!(odd, 1);
        assert_eq!(remote.lookup_in(read(&table, &remote, key), key), Lookup::Torn);
        table.end_write(home, odd, |_| {});
        assert_eq!(remote.lookup_in(read(&table, &remote, key), key), Lookup::Absent);
    }

    #[test]
    fn odd_seq_is_torn_even_with_a_matching_checksum() {
        let mut buf = Vec::new();
        let mut table = new_table(&mut buf, 4);
        let remote = RemoteEndpointTable::parse(table.as_bytes()).unwrap();
        table.insert(port(1), endpoint(1)).unwrap();
        let mut bytes = read(&table, &remote, port(1)).to_vec();
        assert_eq!(remote.lookup_in(&bytes, port(1)), Lookup::Found(endpoint(1)));
        // The key sits at its home, the first slot READ: make it look like
        // the owner's first step of a write, with a checksum that matches.
        let slot = &mut bytes[..SLOT];
        slot[..8].copy_from_slice(&3u64.to_le_bytes());
        seal(slot, 3);
        assert_eq!(remote.lookup_in(&bytes, port(1)), Lookup::Torn);
    }

    #[test]
    fn an_invalid_empty_slot_is_torn_not_absent() {
        let mut buf = Vec::new();
        let table = new_table(&mut buf, 4);
        let remote = RemoteEndpointTable::parse(table.as_bytes()).unwrap();
        let good = read(&table, &remote, port(1)).to_vec();
        assert_eq!(remote.lookup_in(&good, port(1)), Lookup::Absent);
        for at in [0, SLOT + 8, 5 * SLOT + 40, 8 * SLOT - 1] {
            let mut bytes = good.clone();
            bytes[at] ^= 0x40;
            assert_eq!(remote.lookup_in(&bytes, port(1)), Lookup::Torn, "byte {at}");
        }
        // Nor can a short READ prove absence.
        assert_eq!(remote.lookup_in(&good[..good.len() - 1], port(1)), Lookup::Torn);
    }

    #[test]
    fn short_read_still_finds_a_validated_entry() {
        let mut buf = Vec::new();
        let mut table = new_table(&mut buf, 4);
        let remote = RemoteEndpointTable::parse(table.as_bytes()).unwrap();
        table.insert(port(1), endpoint(1)).unwrap();
        let bytes = read(&table, &remote, port(1));
        assert_eq!(remote.lookup_in(&bytes[..SLOT], port(1)), Lookup::Found(endpoint(1)));
        assert_eq!(remote.lookup_in(&[], port(1)), Lookup::Torn);
    }

    #[test]
    fn random_operations_match_a_hashmap() {
        let key = |i: u64| {
            // Port and VQPN keys with the same GID and number: the tag alone
            // tells them apart.
            let (gid, n) = ([(i / 2) as u8; 16], (i / 2) as u32);
            if i % 2 == 0 {
                Key::Port { gid, port: n }
            } else {
                Key::Vqpn { gid, vqpn: n }
            }
        };
        check_against_model::<EndpointSchema>(0x5eed_1234_abcd_0001, 16, key, |v| endpoint(v as u32));
    }
}
