//! The datagram tier's codec on arbitrary bytes: decoding never panics,
//! and whatever decodes re-encodes to exactly the input.
#![no_main]

use krcore::transport::dgram::wire::Message;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Message::decode(data) {
        assert_eq!(m.to_vec(), data, "{m:?}");
    }
});
