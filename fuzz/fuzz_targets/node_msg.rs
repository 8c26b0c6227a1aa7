//! The messages between a process and its host's agent (`krcore-node`'s
//! unix socket) on arbitrary bytes: what either side reads from the other;
//! decoding never panics, and what decodes re-encodes to exactly the input
//! (the codec is strict).
#![no_main]

use krcore::node::proto::Message;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(m) = Message::decode(data) else { return };
    assert_eq!(&m.encode()[..], data, "{m:?}");
});
