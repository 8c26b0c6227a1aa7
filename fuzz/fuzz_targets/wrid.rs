//! The physical `wr_id` codec on arbitrary 64-bit values (the first 8
//! input bytes, little-endian; a completion's `wr_id` is whatever the
//! provider hands back): decoding never panics, what decodes re-encodes to
//! the same value, and a decoded send's fields are in range.
#![no_main]

use krcore::vqp::wrid::{WrId, MAX_SLOTS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(raw) = data.first_chunk::<8>().map(|b| u64::from_le_bytes(*b)) else { return };
    let Ok(w) = WrId::decode(raw) else { return };
    assert_eq!(w.encode(), raw, "{w:?}");
    if let WrId::Send(s) = w {
        assert!(s.slot() < MAX_SLOTS && s.retired() >= 1, "{s:?}");
    }
});
