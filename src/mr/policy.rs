//! Eviction policies of the memory-registration cache: MRE (size and
//! recency, batched) and a plain LRU pin-down cache for comparison.
//!
//! Pure bookkeeping over opaque entry ids: no FFI, no `unsafe`, no I/O. The
//! cache owns the registrations; a policy only says which idle ones to drop.
//! The interpretation of MRE and the simulation that compares the two
//! policies are in docs/mr-eviction.md.
//!
//! MRE in one paragraph: entries live in an LRU stack. Its top part, the
//! *frequent section* (`frequent_fraction` of the entries), is pure LRU: an
//! insert or a hit puts the entry on top, and the entry that falls off the
//! bottom of the section moves to the *resorting section* below it. That
//! section is ordered by the eviction factor `H = r + 1/s` (s = size in
//! pages, r the global recency value at the entry's last insert or hit),
//! lowest at the bottom. An eviction takes the *eviction segment*: the
//! shortest run of evictable entries from the bottom (ascending H) that frees
//! what was asked (optionally padded to `batch_min` entries), deregistered as one
//! batch; r then rises to the largest H evicted.
//!
//! Complexity: insert, touch and remove are O(log n); evict is O(k log n)
//! for k victims plus the non-evictable entries it has to step over.

use rustc_hash::FxHashMap;
use std::collections::BTreeMap;

/// Opaque handle of a cached registration, chosen by the cache.
pub type EntryId = u64;

/// An eviction factor in unsigned fixed point with [`FACTOR_FRAC_BITS`]
/// fractional bits: exact, totally ordered and deterministic (no floats).
pub type Factor = u128;

/// Fractional bits of a [`Factor`].
pub const FACTOR_FRAC_BITS: u32 = 64;

/// The factor 1.0.
pub const FACTOR_ONE: Factor = 1 << FACTOR_FRAC_BITS;

/// `1/s` as a [`Factor`], rounded down; an empty entry counts as one page.
pub fn inverse_size(pages: u64) -> Factor {
    FACTOR_ONE / Factor::from(pages.max(1))
}

/// A factor as a float, for display only.
pub fn factor_to_f64(h: Factor) -> f64 {
    h as f64 / FACTOR_ONE as f64
}

/// What the cache asks of an eviction policy.
pub trait Policy {
    /// A new entry of `pages` pages, most recently used. Inserting an id that
    /// is already present replaces it.
    fn insert(&mut self, id: EntryId, pages: u64);
    /// A hit on `id`. Unknown ids are ignored.
    fn touch(&mut self, id: EntryId);
    /// `id` is dropped for another reason (invalidated, released uncached);
    /// this is not an eviction and ages nothing. Unknown ids are ignored.
    fn remove(&mut self, id: EntryId);
    /// Choose the eviction segment: entries for which `evictable(id)` is true
    /// (entries the application still holds are not), enough to free at
    /// least `pages` pages and `entries` entries if possible, else every
    /// evictable entry. Returns them in eviction order (the caller
    /// deregisters them as one batch) and forgets them. Asking for nothing
    /// (`pages == 0 && entries == 0`) evicts nothing.
    fn evict(&mut self, pages: u64, entries: usize, evictable: &mut dyn FnMut(EntryId) -> bool) -> Vec<EntryId>;
    /// Number of entries.
    fn len(&self) -> usize;
    /// No entries.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

const NIL: usize = usize::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Section {
    /// Linked into the LRU list.
    Frequent,
    /// Keyed by `(h, seq)` in the resorting map.
    Resorting,
}

#[derive(Clone, Debug)]
struct Node {
    id: EntryId,
    pages: u64,
    /// Eviction factor (MRE only).
    h: Factor,
    /// Stamp of the last insert or hit: breaks ties between equal factors
    /// (least recently used first).
    seq: u64,
    prev: usize,
    next: usize,
    section: Section,
}

/// Nodes by slot, with a free list and the id -> slot index.
#[derive(Default)]
struct Slab {
    nodes: Vec<Node>,
    free: Vec<usize>,
    index: FxHashMap<EntryId, usize>,
}

impl Slab {
    fn alloc(&mut self, node: Node) -> usize {
        let id = node.id;
        let slot = match self.free.pop() {
            Some(slot) => {
                self.nodes[slot] = node;
                slot
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        };
        self.index.insert(id, slot);
        slot
    }

    fn release(&mut self, slot: usize) {
        self.index.remove(&self.nodes[slot].id);
        self.free.push(slot);
    }

    fn slot(&self, id: EntryId) -> Option<usize> {
        self.index.get(&id).copied()
    }

    fn len(&self) -> usize {
        self.index.len()
    }
}

/// An intrusive doubly linked LRU list over slab slots: `top` is the most
/// recently used entry, `bottom` the least.
struct List {
    top: usize,
    bottom: usize,
    len: usize,
}

impl List {
    const fn new() -> Self {
        List { top: NIL, bottom: NIL, len: 0 }
    }

    fn push_top(&mut self, nodes: &mut [Node], slot: usize) {
        nodes[slot].prev = NIL;
        nodes[slot].next = self.top;
        if self.top != NIL {
            nodes[self.top].prev = slot;
        } else {
            self.bottom = slot;
        }
        self.top = slot;
        self.len += 1;
    }

    fn unlink(&mut self, nodes: &mut [Node], slot: usize) {
        let (prev, next) = (nodes[slot].prev, nodes[slot].next);
        if prev != NIL {
            nodes[prev].next = next;
        } else {
            self.top = next;
        }
        if next != NIL {
            nodes[next].prev = prev;
        } else {
            self.bottom = prev;
        }
        nodes[slot].prev = NIL;
        nodes[slot].next = NIL;
        self.len -= 1;
    }

    /// Slots from the bottom (least recent) upwards.
    fn iter_up<'a>(&self, nodes: &'a [Node]) -> impl Iterator<Item = usize> + 'a {
        let mut cur = self.bottom;
        std::iter::from_fn(move || {
            (cur != NIL).then(|| {
                let slot = cur;
                cur = nodes[slot].prev;
                slot
            })
        })
    }
}

/// Takes evictable entries from `candidates` until `pages` pages and
/// `entries` entries are freed; returns (pages, entries) freed so far.
fn take(
    nodes: &[Node],
    candidates: impl Iterator<Item = usize>,
    mut freed: (u64, usize),
    want: (u64, usize),
    evictable: &mut dyn FnMut(EntryId) -> bool,
    out: &mut Vec<usize>,
) -> (u64, usize) {
    for slot in candidates {
        if freed.0 >= want.0 && freed.1 >= want.1 {
            break;
        }
        let node = &nodes[slot];
        if evictable(node.id) {
            out.push(slot);
            freed = (freed.0.saturating_add(node.pages), freed.1 + 1);
        }
    }
    freed
}

/// Configuration of [`Mre`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MreConfig {
    /// Share of the entries, from the top of the LRU stack, that form the
    /// frequent section (pure LRU, never resorted, evicted from only when the
    /// resorting section has no evictable entry left). Clamped to [0, 1]:
    /// 0 is size-and-recency alone (GreedyDual-Size), 1 is plain LRU.
    pub frequent_fraction: f64,
    /// Padding of the eviction segment: an eviction takes at least
    /// `min(batch_min, max(1, len / 16))` entries (when the resorting section
    /// has them), so that deregistration happens in larger batches at the
    /// price of a cache left a few entries short of full. 0 or 1 (the
    /// default) disables padding: the segment is exactly the evictable
    /// entries the request needs.
    pub batch_min: usize,
}

impl Default for MreConfig {
    /// Half the stack is the frequent section; no batch padding
    /// (`batch_min` 1): the eviction segment is exactly the evictable entries
    /// the limits require (many after a burst or a large registration),
    /// taken from the bottom of the resorting section and deregistered as one
    /// batch. See docs/mr-eviction.md for the reasons, the sensitivity runs
    /// and the padded (`batch_min` 8) ablation.
    fn default() -> Self {
        MreConfig { frequent_fraction: 0.5, batch_min: 1 }
    }
}

/// MRE: an LRU stack whose upper (frequent) section is LRU and whose lower
/// (resorting) section is ordered by the eviction factor `H = r + 1/s`.
pub struct Mre {
    frequent_fraction: f64,
    batch_min: usize,
    slab: Slab,
    /// The frequent section, top = most recent.
    frequent: List,
    /// The resorting section, ascending `(H, seq)`: the first entries are the
    /// bottom of the stack, where the eviction segment is taken.
    resorting: BTreeMap<(Factor, u64), usize>,
    /// The global recency value r.
    r: Factor,
    seq: u64,
    /// Slots chosen by `evict`, kept to avoid an allocation per eviction.
    chosen: Vec<usize>,
}

impl Mre {
    pub fn new(config: MreConfig) -> Self {
        let f = config.frequent_fraction;
        Mre {
            frequent_fraction: if f.is_nan() { 0.0 } else { f.clamp(0.0, 1.0) },
            batch_min: config.batch_min,
            slab: Slab::default(),
            frequent: List::new(),
            resorting: BTreeMap::new(),
            r: 0,
            seq: 0,
            chosen: Vec::new(),
        }
    }

    /// The global recency value r.
    pub fn recency(&self) -> Factor {
        self.r
    }

    /// The eviction factor of `id`.
    pub fn factor(&self, id: EntryId) -> Option<Factor> {
        self.slab.slot(id).map(|s| self.slab.nodes[s].h)
    }

    /// Whether `id` is in the frequent section (`None`: unknown id).
    pub fn in_frequent_section(&self, id: EntryId) -> Option<bool> {
        self.slab.slot(id).map(|s| self.slab.nodes[s].section == Section::Frequent)
    }

    /// Entries in the frequent section.
    pub fn frequent_len(&self) -> usize {
        self.frequent.len
    }

    /// The minimum size of an eviction batch at the current length.
    pub fn batch(&self) -> usize {
        self.batch_min.min((self.len() / 16).max(1))
    }

    fn frequent_target(&self) -> usize {
        // Deterministic: an exact product of an integer and a double, floored.
        ((self.len() as f64) * self.frequent_fraction) as usize
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// Moves entries from the bottom of the frequent section into the
    /// resorting section until the frequent section is within its share.
    /// The frequent section is refilled only by inserts and hits: entries in
    /// the resorting section have lost their LRU position, so none is
    /// promoted back when the frequent section is under its share.
    fn rebalance(&mut self) {
        let target = self.frequent_target();
        while self.frequent.len > target {
            let slot = self.frequent.bottom;
            self.frequent.unlink(&mut self.slab.nodes, slot);
            let node = &mut self.slab.nodes[slot];
            node.section = Section::Resorting;
            self.resorting.insert((node.h, node.seq), slot);
        }
    }

    /// Takes `slot` out of whichever section holds it.
    fn detach(&mut self, slot: usize) {
        let node = &self.slab.nodes[slot];
        match node.section {
            Section::Frequent => self.frequent.unlink(&mut self.slab.nodes, slot),
            Section::Resorting => {
                self.resorting.remove(&(node.h, node.seq));
            }
        }
    }

    #[cfg(test)]
    fn check_invariants(&self) {
        assert_eq!(self.slab.len(), self.frequent.len + self.resorting.len());
        assert!(self.frequent.len <= self.frequent_target());
        let listed: Vec<usize> = self.frequent.iter_up(&self.slab.nodes).collect();
        assert_eq!(listed.len(), self.frequent.len);
        for &slot in &listed {
            let n = &self.slab.nodes[slot];
            assert_eq!(n.section, Section::Frequent);
            assert_eq!(self.slab.slot(n.id), Some(slot));
        }
        // Seq grows towards the top of the LRU list.
        assert!(listed.windows(2).all(|w| self.slab.nodes[w[0]].seq < self.slab.nodes[w[1]].seq));
        for (&(h, seq), &slot) in &self.resorting {
            let n = &self.slab.nodes[slot];
            assert_eq!((n.section, n.h, n.seq), (Section::Resorting, h, seq));
            assert_eq!(self.slab.slot(n.id), Some(slot));
        }
    }
}

impl Default for Mre {
    fn default() -> Self {
        Mre::new(MreConfig::default())
    }
}

impl Policy for Mre {
    fn insert(&mut self, id: EntryId, pages: u64) {
        self.remove(id);
        let seq = self.next_seq();
        let h = self.r + inverse_size(pages);
        let node = Node { id, pages, h, seq, prev: NIL, next: NIL, section: Section::Frequent };
        let slot = self.slab.alloc(node);
        self.frequent.push_top(&mut self.slab.nodes, slot);
        self.rebalance();
    }

    fn touch(&mut self, id: EntryId) {
        let Some(slot) = self.slab.slot(id) else { return };
        self.detach(slot);
        let seq = self.next_seq();
        let node = &mut self.slab.nodes[slot];
        node.h = self.r + inverse_size(node.pages);
        node.seq = seq;
        node.section = Section::Frequent;
        self.frequent.push_top(&mut self.slab.nodes, slot);
        self.rebalance();
    }

    fn remove(&mut self, id: EntryId) {
        let Some(slot) = self.slab.slot(id) else { return };
        self.detach(slot);
        self.slab.release(slot);
        self.rebalance();
    }

    fn evict(&mut self, pages: u64, entries: usize, evictable: &mut dyn FnMut(EntryId) -> bool) -> Vec<EntryId> {
        if pages == 0 && entries == 0 {
            return Vec::new();
        }
        let mut chosen = std::mem::take(&mut self.chosen);
        chosen.clear();
        let nodes = &self.slab.nodes;
        // The eviction segment: the bottom of the resorting section, padded
        // to a batch.
        let want = (pages, entries.max(self.batch()));
        let freed = take(nodes, self.resorting.values().copied(), (0, 0), want, evictable, &mut chosen);
        // Not enough there: the frequent section from its LRU end, for what
        // was asked only (no padding).
        if freed.0 < pages || freed.1 < entries {
            let from_frequent = self.frequent.iter_up(nodes);
            take(nodes, from_frequent, freed, (pages, entries), evictable, &mut chosen);
        }
        let mut victims = Vec::with_capacity(chosen.len());
        let mut highest = None;
        for &slot in &chosen {
            self.detach(slot);
            let node = &self.slab.nodes[slot];
            highest = highest.max(Some(node.h));
            victims.push(node.id);
            self.slab.release(slot);
        }
        self.chosen = chosen;
        if let Some(h) = highest {
            self.r = self.r.max(h);
        }
        self.rebalance();
        victims
    }

    fn len(&self) -> usize {
        self.slab.len()
    }
}

/// A plain LRU pin-down cache: evicts the least recently used evictable
/// entries, just enough for the request, no batching.
pub struct Lru {
    slab: Slab,
    list: List,
}

impl Lru {
    pub fn new() -> Self {
        Lru { slab: Slab::default(), list: List::new() }
    }
}

impl Default for Lru {
    fn default() -> Self {
        Lru::new()
    }
}

impl Policy for Lru {
    fn insert(&mut self, id: EntryId, pages: u64) {
        self.remove(id);
        let node = Node { id, pages, h: 0, seq: 0, prev: NIL, next: NIL, section: Section::Frequent };
        let slot = self.slab.alloc(node);
        self.list.push_top(&mut self.slab.nodes, slot);
    }

    fn touch(&mut self, id: EntryId) {
        let Some(slot) = self.slab.slot(id) else { return };
        self.list.unlink(&mut self.slab.nodes, slot);
        self.list.push_top(&mut self.slab.nodes, slot);
    }

    fn remove(&mut self, id: EntryId) {
        let Some(slot) = self.slab.slot(id) else { return };
        self.list.unlink(&mut self.slab.nodes, slot);
        self.slab.release(slot);
    }

    fn evict(&mut self, pages: u64, entries: usize, evictable: &mut dyn FnMut(EntryId) -> bool) -> Vec<EntryId> {
        if pages == 0 && entries == 0 {
            return Vec::new();
        }
        let mut chosen = Vec::new();
        let nodes = &self.slab.nodes;
        take(nodes, self.list.iter_up(nodes), (0, 0), (pages, entries), evictable, &mut chosen);
        chosen
            .into_iter()
            .map(|slot| {
                let id = self.slab.nodes[slot].id;
                self.list.unlink(&mut self.slab.nodes, slot);
                self.slab.release(slot);
                id
            })
            .collect()
    }

    fn len(&self) -> usize {
        self.slab.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    const ONE: Factor = FACTOR_ONE;

    fn all(_: EntryId) -> bool {
        true
    }

    fn mre(frequent_fraction: f64, batch_min: usize) -> Mre {
        Mre::new(MreConfig { frequent_fraction, batch_min })
    }

    #[test]
    fn inverse_size_is_exact_fixed_point() {
        assert_eq!(inverse_size(1), ONE);
        assert_eq!(inverse_size(0), ONE);
        assert_eq!(inverse_size(4), ONE / 4);
        assert_eq!(inverse_size(3), 6_148_914_691_236_517_205); // floor(2^64 / 3)
        assert_eq!(factor_to_f64(ONE + ONE / 2), 1.5);
    }

    #[test]
    fn mre_sections_follow_the_fraction() {
        let mut p = mre(0.5, 1);
        for id in 1..=8 {
            p.insert(id, 1);
        }
        p.check_invariants();
        assert_eq!(p.frequent_len(), 4);
        for id in 1..=4 {
            assert_eq!(p.in_frequent_section(id), Some(false), "{id}");
        }
        for id in 5..=8 {
            assert_eq!(p.in_frequent_section(id), Some(true), "{id}");
        }
        // A hit in the resorting section goes to the top; the bottom of the
        // frequent section (5) moves down.
        p.touch(2);
        p.check_invariants();
        assert_eq!(p.in_frequent_section(2), Some(true));
        assert_eq!(p.in_frequent_section(5), Some(false));
        assert_eq!(p.in_frequent_section(99), None);
    }

    #[test]
    fn mre_evicts_from_the_resorting_section_first() {
        let mut p = mre(0.5, 1);
        // Large entries first (they become the resorting section), then small
        // ones: the resorting section is evicted before any frequent entry,
        // even though its entries are larger than needed.
        for id in 1..=4 {
            p.insert(id, 16);
        }
        for id in 5..=8 {
            p.insert(id, 1);
        }
        assert_eq!(p.evict(1, 0, &mut all), vec![1]);
        assert_eq!(p.evict(20, 0, &mut all), vec![2, 3]);
        p.check_invariants();
        for id in 5..=8 {
            assert!(p.factor(id).is_some());
        }
        // Within the resorting section the order is by H, not recency: a
        // large recent entry goes before a small old one.
        let mut p = mre(0.0, 1);
        p.insert(1, 1);
        p.insert(2, 8);
        p.insert(3, 2);
        assert_eq!(p.evict(1, 0, &mut all), vec![2]);
        assert_eq!(p.evict(1, 0, &mut all), vec![3]);
        assert_eq!(p.evict(1, 0, &mut all), vec![1]);
        assert!(p.is_empty());
    }

    #[test]
    fn frequent_section_protects_a_new_large_entry() {
        // Small entries first, then a large one just registered. Pure
        // size-and-recency (fraction 0) makes it the next victim; with a
        // frequent section it survives and the oldest small entry goes.
        for (fraction, victim) in [(0.0, 100), (0.5, 0)] {
            let mut p = mre(fraction, 1);
            for id in 0..8 {
                p.insert(id, 1);
            }
            p.insert(100, 32);
            assert_eq!(p.evict(1, 0, &mut all), vec![victim], "fraction {fraction}");
        }
    }

    #[test]
    fn mre_falls_back_to_the_frequent_section_in_lru_order() {
        let mut p = mre(0.5, 8);
        for id in 1..=8 {
            p.insert(id, 1);
        }
        // Resorting section: 1..=4, none evictable; frequent 5..=8, LRU first.
        let mut pinned = |id: EntryId| id > 4;
        assert_eq!(p.evict(2, 0, &mut pinned), vec![5, 6]);
        p.check_invariants();
        assert_eq!(p.len(), 6);
    }

    #[test]
    fn mre_factor_arithmetic_by_hand() {
        // frequent_fraction 0: everything is resorted (pure H order); no batching.
        let mut p = mre(0.0, 1);
        p.insert(b'A' as u64, 1); // H = 0 + 1
        p.insert(b'B' as u64, 2); // H = 0 + 1/2
        p.insert(b'C' as u64, 4); // H = 0 + 1/4
        assert_eq!(p.factor(b'A' as u64), Some(ONE));
        assert_eq!(p.factor(b'B' as u64), Some(ONE / 2));
        assert_eq!(p.factor(b'C' as u64), Some(ONE / 4));
        assert_eq!(p.recency(), 0);

        // Lowest H goes: C (1/4); r rises to 1/4.
        assert_eq!(p.evict(1, 0, &mut all), vec![b'C' as u64]);
        assert_eq!(p.recency(), ONE / 4);

        p.insert(b'D' as u64, 1); // H = 1/4 + 1 = 5/4
        assert_eq!(p.factor(b'D' as u64), Some(ONE + ONE / 4));
        p.touch(b'B' as u64); // H = 1/4 + 1/2 = 3/4
        assert_eq!(p.factor(b'B' as u64), Some(3 * ONE / 4));

        // B (3/4) < A (1) < D (5/4).
        assert_eq!(p.evict(1, 0, &mut all), vec![b'B' as u64]);
        assert_eq!(p.recency(), 3 * ONE / 4);

        p.insert(b'E' as u64, 4); // H = 3/4 + 1/4 = 1, ties with A
        assert_eq!(p.factor(b'E' as u64), Some(ONE));
        // The tie goes to the least recently used: A.
        assert_eq!(p.evict(1, 0, &mut all), vec![b'A' as u64]);
        assert_eq!(p.recency(), ONE);

        // 5 pages: E (H 1, 4 pages) then D (H 5/4, 1 page); r = 5/4.
        assert_eq!(p.evict(5, 0, &mut all), vec![b'E' as u64, b'D' as u64]);
        assert_eq!(p.recency(), ONE + ONE / 4);
        assert!(p.is_empty());

        // A size of 3 pages adds floor(2^64/3) to r.
        p.insert(7, 3);
        assert_eq!(p.factor(7), Some(ONE + ONE / 4 + inverse_size(3)));
    }

    #[test]
    fn mre_recency_never_decreases() {
        // A frequent-section entry evicted with an H below r leaves r alone.
        let mut p = mre(1.0, 1);
        p.insert(1, 1); // H = 1
        p.insert(2, 4); // H = 1/4
        assert_eq!(p.evict(1, 0, &mut all), vec![1]);
        assert_eq!(p.recency(), ONE);
        assert_eq!(p.evict(1, 0, &mut all), vec![2]);
        assert_eq!(p.recency(), ONE);
    }

    #[test]
    fn mre_remove_does_not_age() {
        let mut p = mre(0.0, 1);
        p.insert(1, 4);
        p.insert(2, 1);
        p.remove(1);
        p.remove(42); // unknown: ignored
        assert_eq!(p.recency(), 0);
        p.insert(3, 2);
        assert_eq!(p.factor(3), Some(ONE / 2));
        assert_eq!(p.len(), 2);
        p.check_invariants();
        // Forgotten ids (evicted, then removed by the cache) are no-ops too.
        let gone = p.evict(1, 0, &mut all);
        assert_eq!(gone, vec![3]);
        p.remove(3);
        p.touch(3);
        assert_eq!(p.len(), 1);
        p.check_invariants();
    }

    #[test]
    fn mre_batches() {
        // 256 entries: batch = min(8, 256/16) = 8.
        let mut p = mre(0.5, 8);
        for id in 0..256 {
            p.insert(id, 1);
        }
        assert_eq!(p.batch(), 8);
        let v = p.evict(1, 0, &mut all);
        assert_eq!(v, (0..8).collect::<Vec<_>>());
        // A request larger than the batch is not padded further.
        assert_eq!(p.evict(20, 0, &mut all).len(), 20);
        assert_eq!(p.evict(0, 11, &mut all).len(), 11);
        p.check_invariants();

        // 64 entries: min(8, 64/16) = 4; 10 entries: 1.
        let mut p = mre(0.5, 8);
        for id in 0..64 {
            p.insert(id, 1);
        }
        assert_eq!(p.evict(1, 0, &mut all).len(), 4);
        let mut p = mre(0.5, 8);
        for id in 0..10 {
            p.insert(id, 1);
        }
        assert_eq!(p.evict(1, 0, &mut all).len(), 1);

        // Padding never reaches into the frequent section: only one resorting
        // entry is evictable, the request needs one, so one goes.
        let mut p = mre(0.5, 8);
        for id in 0..256 {
            p.insert(id, 1);
        }
        let mut only_zero = |id: EntryId| id == 0 || id >= 128;
        assert_eq!(p.evict(1, 0, &mut only_zero), vec![0]);
        // Asking for nothing evicts nothing.
        assert!(p.evict(0, 0, &mut all).is_empty());
        // Huge requests (the cache's "everything idle") take all.
        let n = p.len();
        assert_eq!(p.evict(u64::MAX, usize::MAX, &mut all).len(), n);
        assert!(p.is_empty());
        p.check_invariants();
    }

    #[test]
    fn mre_default_does_not_pad() {
        assert_eq!(MreConfig::default(), MreConfig { frequent_fraction: 0.5, batch_min: 1 });
        let mut p = Mre::default();
        for id in 0..256 {
            p.insert(id, 1);
        }
        assert_eq!(p.batch(), 1);
        // Exactly what was asked, from the bottom of the resorting section,
        // as one segment.
        assert_eq!(p.evict(1, 0, &mut all), vec![0]);
        assert_eq!(p.evict(5, 0, &mut all), (1..6).collect::<Vec<_>>());
        assert_eq!(p.evict(0, 3, &mut all), (6..9).collect::<Vec<_>>());
        p.check_invariants();
    }

    #[test]
    fn evictable_predicate_is_respected() {
        let mut m = mre(0.5, 8);
        let mut l = Lru::new();
        for id in 0..100 {
            m.insert(id, 1 + id % 5);
            l.insert(id, 1 + id % 5);
        }
        let mut odd = |id: EntryId| id % 2 == 1;
        for p in [&mut m as &mut dyn Policy, &mut l] {
            let v = p.evict(30, 3, &mut odd);
            assert!(!v.is_empty());
            assert!(v.iter().all(|id| id % 2 == 1));
        }
        // Nothing evictable: nothing evicted, nothing aged.
        let r = m.recency();
        let mut none = |_: EntryId| false;
        assert!(m.evict(10, 1, &mut none).is_empty());
        assert!(l.evict(10, 1, &mut none).is_empty());
        assert_eq!(m.recency(), r);
        // Everything evictable is taken when the request cannot be met.
        let before = m.len();
        let odd_left = (0..100).filter(|id| id % 2 == 1 && m.factor(*id).is_some()).count();
        assert_eq!(m.evict(u64::MAX, 0, &mut odd).len(), odd_left);
        assert_eq!(m.len(), before - odd_left);
        m.check_invariants();
    }

    #[test]
    fn lru_order() {
        let mut p = Lru::new();
        for id in 1..=5 {
            p.insert(id, 2);
        }
        p.touch(2);
        p.touch(1);
        // Stack bottom-up: 3 4 5 2 1.
        assert_eq!(p.evict(1, 0, &mut all), vec![3]);
        let mut not4 = |id: EntryId| id != 4;
        assert_eq!(p.evict(3, 0, &mut not4), vec![5, 2]);
        assert_eq!(p.evict(0, 1, &mut all), vec![4]);
        p.insert(1, 7); // replaces 1, now on top with 7 pages
        assert_eq!(p.len(), 1);
        assert!(p.evict(0, 0, &mut all).is_empty());
        assert_eq!(p.evict(7, 0, &mut all), vec![1]);
        assert!(p.is_empty());
    }

    /// The LRU reference: a Vec from least to most recently used.
    #[derive(Default)]
    struct VecLru(Vec<(EntryId, u64)>);
    impl VecLru {
        fn insert(&mut self, id: EntryId, pages: u64) {
            self.remove(id);
            self.0.push((id, pages));
        }
        fn touch(&mut self, id: EntryId) {
            if let Some(i) = self.0.iter().position(|e| e.0 == id) {
                let e = self.0.remove(i);
                self.0.push(e);
            }
        }
        fn remove(&mut self, id: EntryId) {
            self.0.retain(|e| e.0 != id);
        }
        fn evict(&mut self, pages: u64, entries: usize, ok: &dyn Fn(EntryId) -> bool) -> Vec<EntryId> {
            if pages == 0 && entries == 0 {
                return Vec::new();
            }
            let (mut fp, mut fe, mut out) = (0u64, 0usize, Vec::new());
            for &(id, p) in &self.0 {
                if fp >= pages && fe >= entries {
                    break;
                }
                if ok(id) {
                    out.push(id);
                    fp += p;
                    fe += 1;
                }
            }
            self.0.retain(|e| !out.contains(&e.0));
            out
        }
    }

    #[test]
    fn randomized_against_reference() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let mut lru = Lru::new();
        let mut reference = VecLru::default();
        let mut m = mre(0.5, 8);
        // Model of the MRE's contents: id -> pages.
        let mut present: std::collections::HashMap<EntryId, u64> = Default::default();
        let mut next_id = 0u64;
        let mut last_r = 0;
        for step in 0..20_000u64 {
            // Which ids are held by the application changes over time.
            let salt = step / 500;
            let ok = move |id: EntryId| (id.wrapping_mul(0x9E37_79B9) ^ salt) % 5 != 0;
            let op = rng.below(100);
            let known = rng.below(next_id.max(1) + 3); // sometimes unknown ids
            match op {
                0..=39 => {
                    let pages = 1 + rng.below(32);
                    let id = if rng.below(10) == 0 { known } else { next_id };
                    next_id += 1;
                    lru.insert(id, pages);
                    reference.insert(id, pages);
                    m.insert(id, pages);
                    present.insert(id, pages);
                }
                40..=74 => {
                    lru.touch(known);
                    reference.touch(known);
                    m.touch(known);
                }
                75..=84 => {
                    lru.remove(known);
                    reference.remove(known);
                    let r = m.recency();
                    m.remove(known);
                    assert_eq!(m.recency(), r, "remove must not age");
                    present.remove(&known);
                }
                _ => {
                    let pages = rng.below(64);
                    let entries = rng.below(4) as usize;
                    let got = lru.evict(pages, entries, &mut |id| ok(id));
                    assert_eq!(got, reference.evict(pages, entries, &ok), "step {step}");

                    let evictable: Vec<(EntryId, u64)> = present.iter().filter(|(id, _)| ok(**id)).map(|(&id, &p)| (id, p)).collect();
                    let (avail_p, avail_e) = (evictable.iter().map(|e| e.1).sum::<u64>(), evictable.len());
                    let batch = m.batch();
                    let v = m.evict(pages, entries, &mut |id| ok(id));
                    let mut seen = std::collections::HashSet::new();
                    let mut freed = 0;
                    for id in &v {
                        assert!(seen.insert(*id), "duplicate victim {id}");
                        assert!(ok(*id), "victim {id} was not evictable");
                        freed += present.remove(id).expect("victim was present");
                    }
                    if pages == 0 && entries == 0 {
                        assert!(v.is_empty());
                    } else if avail_p >= pages && avail_e >= entries {
                        assert!(freed >= pages && v.len() >= entries, "step {step}: request not met");
                        assert!(v.len() <= entries.max(batch) + pages as usize, "step {step}: too many victims");
                    } else {
                        assert_eq!(v.len(), avail_e, "step {step}: should take every evictable entry");
                    }
                    assert!(m.recency() >= last_r);
                    last_r = m.recency();
                }
            }
            assert_eq!(lru.len(), reference.0.len());
            assert_eq!(m.len(), present.len());
            if step % 97 == 0 {
                m.check_invariants();
            }
        }
        m.check_invariants();
        assert!(last_r > 0);
    }
}
