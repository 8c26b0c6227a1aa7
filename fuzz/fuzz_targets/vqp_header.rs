//! The header of two-sided messages on a shared link (data, WRITE_IMM,
//! CLOSE, the link's own messages: LINK_CLOSE, MR_CHECK and MR_ANSWER with
//! its answer, and the large-message control: the LARGE descriptor naming
//! the sender's staged payload and the receiver's DONE) on arbitrary
//! bytes, as a receive buffer of the links' SRQ holds them: `decode`,
//! `received` and the MR answer's decoder never panic; what decodes
//! re-encodes to the input's bytes; and `received` accepts only a header
//! whose message is exactly what arrived, a data message that fits the
//! receive buffer, a LARGE one that does not.
#![no_main]

use krcore::vqp::header::{Flags, Header, LinkOp, HEADER_LEN};
use krcore::vqp::mrcheck::{Answer, ANSWER_LEN};
use libfuzzer_sys::fuzz_target;

/// Receive-buffer payload sizes to judge against: none, small, the
/// runtime's (MAX_MSG) and beyond.
const MAX_CARRIED: [usize; 4] = [0, 64, 4096, 1 << 20];

fuzz_target!(|data: &[u8]| {
    let decoded = Header::decode(data);
    if let Ok(h) = decoded {
        let mut out = [0xee; HEADER_LEN];
        h.encode(&mut out);
        assert_eq!(out[..], data[..HEADER_LEN], "{h:?}");
        if let (Some(LinkOp::MrAnswer), Some(payload)) = (h.link_op(), data.get(HEADER_LEN..HEADER_LEN + ANSWER_LEN)) {
            if let Ok(a) = Answer::decode(payload) {
                assert_eq!(a.encode()[..], payload[..], "{a:?}");
            }
        }
    }
    // What arrived: the whole input (wc.byte_len), or a byte_len that the
    // buffer does not back.
    let byte_lens = [data.len() as u32, data.len().saturating_sub(1) as u32, data.len() as u32 + 1, u32::MAX];
    for byte_len in byte_lens {
        for max_carried in MAX_CARRIED {
            let Ok(h) = Header::received(data, byte_len, max_carried) else { continue };
            assert_eq!(decoded, Ok(h));
            let carried = h.carried_len() as usize;
            assert!(byte_len as usize == HEADER_LEN + carried && byte_len as usize <= data.len(), "{h:?} in {byte_len}");
            assert!(carried <= max_carried, "{h:?} carries more than {max_carried}");
            assert!(!h.flags.contains(Flags::LARGE) || h.len as usize > max_carried, "{h:?} LARGE at most {max_carried}");
        }
    }
});
