//! The wr_id codec: what the library posts as `wr_id` on a shared physical
//! QP or SRQ, so that a completion can be dispatched without a lookup table.
//!
//! Many VQPs share one physical QP. The application's `wr_id` stays in the
//! VQP's software send queue; the physical `wr_id` names the VQP (table slot
//! and that slot's generation, so a late completion of a destroyed VQP is
//! recognised and dropped), the WR's position in the VQP's send sequence
//! (FIFO check), and the overflow accounting of the physical send queue
//! (how many WQEs the completion retires, and whether the library signaled
//! it on its own).
//!
//! Layout (bit 63 on the left):
//!
//! ```text
//!         63..62  61      60      59..40  39..32  31..16  15..0
//! Send    kind=1  0       forced  slot    gen     seq     retired
//! Recv    kind=2  0 (bits 61..32)                 buffer index
//! Control kind=3  0 (bits 61..32)                 tag
//! ```
//!
//! Kind 0 is the invalid one, so a zero `wr_id` (zeroed memory, a WR that
//! was never ours) never decodes. Reserved bits must be zero and `retired`
//! is at least 1 (a completion always retires its own WQE): decoding is
//! strict, and every `u64` that decodes re-encodes to itself. A `wr_id` that
//! does not decode can only come from a WR the library did not post; the
//! error is EINVAL.

use crate::error::{Errno, Result};

/// VQP table slots addressable by a send `wr_id`.
pub const MAX_SLOTS: u32 = 1 << SLOT_BITS;

/// Most physical WQEs one completion can retire (itself included).
pub const MAX_RETIRED: u16 = u16::MAX;

const KIND_SHIFT: u32 = 62;
const KIND_SEND: u64 = 1;
const KIND_RECV: u64 = 2;
const KIND_CONTROL: u64 = 3;

const FORCED_SHIFT: u32 = 60;
const SLOT_SHIFT: u32 = 40;
const SLOT_BITS: u32 = 20;
const GEN_SHIFT: u32 = 32;
const SEQ_SHIFT: u32 = 16;

/// Bits that must be zero in a send `wr_id` (bit 61).
const SEND_RESERVED: u64 = 1 << 61;
/// Bits that must be zero in a receive or control `wr_id` (61..32).
const VALUE_RESERVED: u64 = ((1 << KIND_SHIFT) - 1) & !(u32::MAX as u64);

/// A decoded physical `wr_id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrId {
    /// A VQP's send WR.
    Send(SendId),
    /// A receive buffer the library posted on its shared SRQ. The index is
    /// enough: an SRQ's WQEs cannot be withdrawn, so a buffer is never
    /// reused while it is posted.
    Recv { buf: u32 },
    /// Library control traffic (link handshake, large-message DONE, fences).
    Control { tag: u32 },
}

/// The send half of a physical `wr_id`; fields are range-checked by
/// [`SendId::new`], so encoding cannot fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendId {
    slot: u32,
    generation: u8,
    seq: u16,
    retired: u16,
    forced: bool,
}

impl SendId {
    /// `slot` below [`MAX_SLOTS`], `retired` at least 1; EINVAL otherwise.
    pub fn new(slot: u32, generation: u8, seq: u16, retired: u16, forced: bool) -> Result<SendId> {
        if slot >= MAX_SLOTS || retired == 0 {
            return Err(Errno::EINVAL);
        }
        Ok(SendId { slot, generation, seq, retired, forced })
    }

    /// Index of the VQP in the process's VQP table.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The slot's generation when the WR was posted.
    pub fn generation(&self) -> u8 {
        self.generation
    }

    /// The VQP's send sequence number of this WR, mod 2^16.
    pub fn seq(&self) -> u16 {
        self.seq
    }

    /// Physical WQEs this completion retires, itself included.
    pub fn retired(&self) -> u16 {
        self.retired
    }

    /// Signaled by the library, not the application: no application
    /// completion unless it failed.
    pub fn forced(&self) -> bool {
        self.forced
    }
}

impl WrId {
    pub fn encode(&self) -> u64 {
        match *self {
            WrId::Send(s) => {
                KIND_SEND << KIND_SHIFT
                    | u64::from(s.forced) << FORCED_SHIFT
                    | u64::from(s.slot) << SLOT_SHIFT
                    | u64::from(s.generation) << GEN_SHIFT
                    | u64::from(s.seq) << SEQ_SHIFT
                    | u64::from(s.retired)
            }
            WrId::Recv { buf } => KIND_RECV << KIND_SHIFT | u64::from(buf),
            WrId::Control { tag } => KIND_CONTROL << KIND_SHIFT | u64::from(tag),
        }
    }

    /// EINVAL for kind 0, a reserved bit set, or a send with `retired == 0`.
    pub fn decode(raw: u64) -> Result<WrId> {
        // Truncating casts below extract fields already shifted into place.
        let value = raw as u32;
        match raw >> KIND_SHIFT {
            KIND_SEND if raw & SEND_RESERVED == 0 => SendId::new(
                (raw >> SLOT_SHIFT) as u32 & (MAX_SLOTS - 1),
                (raw >> GEN_SHIFT) as u8,
                (raw >> SEQ_SHIFT) as u16,
                raw as u16,
                raw >> FORCED_SHIFT & 1 != 0,
            )
            .map(WrId::Send),
            KIND_RECV if raw & VALUE_RESERVED == 0 => Ok(WrId::Recv { buf: value }),
            KIND_CONTROL if raw & VALUE_RESERVED == 0 => Ok(WrId::Control { tag: value }),
            _ => Err(Errno::EINVAL),
        }
    }
}

/// How far `to` is ahead of `from` in mod-2^16 sequence space.
pub fn seq_distance(from: u16, to: u16) -> u16 {
    to.wrapping_sub(from)
}

/// Whether `seq` is one of the `len` sequence numbers starting at `oldest`
/// (the outstanding sends of a VQP, which therefore keeps fewer than 2^16
/// of them).
pub fn seq_in_window(oldest: u16, seq: u16, len: u16) -> bool {
    seq_distance(oldest, seq) < len
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    fn send(slot: u32, generation: u8, seq: u16, retired: u16, forced: bool) -> WrId {
        WrId::Send(SendId::new(slot, generation, seq, retired, forced).unwrap())
    }

    #[test]
    fn send_layout_is_exact() {
        assert_eq!(send(0, 0, 0, 1, false).encode(), 0x4000_0000_0000_0001);
        assert_eq!(send(0, 0, 0, 1, true).encode(), 0x5000_0000_0000_0001);
        assert_eq!(send(1, 0, 0, 1, false).encode(), 0x4000_0100_0000_0001);
        assert_eq!(send(MAX_SLOTS - 1, 0, 0, 1, false).encode(), 0x4fff_ff00_0000_0001);
        assert_eq!(send(0, 0xab, 0, 1, false).encode(), 0x4000_00ab_0000_0001);
        assert_eq!(send(0, 0, 0xcdef, 1, false).encode(), 0x4000_0000_cdef_0001);
        assert_eq!(send(0, 0, 0, MAX_RETIRED, false).encode(), 0x4000_0000_0000_ffff);
        assert_eq!(send(MAX_SLOTS - 1, u8::MAX, u16::MAX, MAX_RETIRED, true).encode(), 0x5fff_ffff_ffff_ffff);
    }

    #[test]
    fn recv_and_control_layout_is_exact() {
        assert_eq!(WrId::Recv { buf: 0 }.encode(), 0x8000_0000_0000_0000);
        assert_eq!(WrId::Recv { buf: u32::MAX }.encode(), 0x8000_0000_ffff_ffff);
        assert_eq!(WrId::Control { tag: 0 }.encode(), 0xc000_0000_0000_0000);
        assert_eq!(WrId::Control { tag: 0x1234_5678 }.encode(), 0xc000_0000_1234_5678);
    }

    #[test]
    fn accessors_return_constructor_fields() {
        let s = SendId::new(MAX_SLOTS - 1, 7, 65_000, 3, true).unwrap();
        assert_eq!((s.slot(), s.generation(), s.seq(), s.retired(), s.forced()), (MAX_SLOTS - 1, 7, 65_000, 3, true));
    }

    #[test]
    fn constructor_rejects_out_of_range() {
        assert_eq!(SendId::new(MAX_SLOTS, 0, 0, 1, false), Err(Errno::EINVAL));
        assert_eq!(SendId::new(u32::MAX, 0, 0, 1, false), Err(Errno::EINVAL));
        assert_eq!(SendId::new(0, 0, 0, 0, false), Err(Errno::EINVAL));
    }

    #[test]
    fn round_trip_at_field_boundaries() {
        let slots = [0, 1, MAX_SLOTS / 2, MAX_SLOTS - 2, MAX_SLOTS - 1];
        let gens = [0, 1, 0x7f, 0x80, u8::MAX];
        let seqs = [0, 1, 0x7fff, 0x8000, u16::MAX];
        let retired = [1, 2, 0x7fff, 0x8000, MAX_RETIRED];
        let mut n = 0;
        for &slot in &slots {
            for &g in &gens {
                for &seq in &seqs {
                    for &r in &retired {
                        for forced in [false, true] {
                            let w = send(slot, g, seq, r, forced);
                            assert_eq!(WrId::decode(w.encode()), Ok(w));
                            n += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(n, 5 * 5 * 5 * 5 * 2);
        for v in [0, 1, 0x7fff_ffff, 0x8000_0000, u32::MAX] {
            for w in [WrId::Recv { buf: v }, WrId::Control { tag: v }] {
                assert_eq!(WrId::decode(w.encode()), Ok(w));
            }
        }
    }

    #[test]
    fn decode_rejects_every_invalid_pattern() {
        // Kind 0, whatever the other bits.
        for raw in [0, 1, u64::MAX >> 2, 0x1000_0000_0000_0001] {
            assert_eq!(WrId::decode(raw), Err(Errno::EINVAL), "{raw:#x}");
        }
        // Send: reserved bit 61, or nothing retired.
        assert_eq!(WrId::decode(0x6000_0000_0000_0001), Err(Errno::EINVAL));
        assert_eq!(WrId::decode(0x4000_0000_0000_0000), Err(Errno::EINVAL));
        assert_eq!(WrId::decode(0x5fff_ffff_ffff_0000), Err(Errno::EINVAL));
        // Recv and control: each reserved bit alone.
        for bit in 32..62 {
            for kind in [KIND_RECV, KIND_CONTROL] {
                let raw = kind << KIND_SHIFT | 1 << bit;
                assert_eq!(WrId::decode(raw), Err(Errno::EINVAL), "{raw:#x}");
            }
        }
    }

    #[test]
    fn random_round_trip_and_canonical_decode() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut decoded = 0;
        for _ in 0..100_000 {
            let r = rng.next();
            let w = match r % 3 {
                0 => send((r >> 8) as u32 % MAX_SLOTS, (r >> 28) as u8, (r >> 36) as u16, ((r >> 52) as u16).max(1), r & 4 != 0),
                1 => WrId::Recv { buf: (r >> 16) as u32 },
                _ => WrId::Control { tag: (r >> 16) as u32 },
            };
            assert_eq!(WrId::decode(w.encode()), Ok(w));
            // Any u64 that decodes is the one encoding of its value.
            let raw = rng.next();
            if let Ok(w) = WrId::decode(raw) {
                assert_eq!(w.encode(), raw);
                decoded += 1;
            }
        }
        // About 1/8 of random words are sends (kind 1, bit 61 clear, retired
        // non-zero); receives and controls need 30 zero bits.
        assert!((11_000..14_000).contains(&decoded), "{decoded}");
    }

    #[test]
    fn seq_arithmetic_wraps() {
        assert_eq!(seq_distance(0, 0), 0);
        assert_eq!(seq_distance(10, 15), 5);
        assert_eq!(seq_distance(u16::MAX, 0), 1);
        assert_eq!(seq_distance(0xfff0, 0x0010), 0x20);
        assert_eq!(seq_distance(1, 0), u16::MAX);

        assert!(!seq_in_window(5, 5, 0));
        assert!(seq_in_window(5, 5, 1));
        assert!(!seq_in_window(5, 6, 1));
        // The widest window holds every number but the one before `oldest`.
        assert!(seq_in_window(5, 3, u16::MAX));
        assert!(!seq_in_window(5, 3, u16::MAX - 1));
        assert!(!seq_in_window(5, 4, u16::MAX));
        // Window across the wrap: 0xfffe, 0xffff, 0, 1.
        for seq in [0xfffe, 0xffff, 0, 1] {
            assert!(seq_in_window(0xfffe, seq, 4), "{seq:#x}");
        }
        for seq in [0xfffd, 2, 0x8000] {
            assert!(!seq_in_window(0xfffe, seq, 4), "{seq:#x}");
        }
    }
}
