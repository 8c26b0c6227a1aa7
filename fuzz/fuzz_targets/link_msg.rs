//! The link handshake on a service endpoint's UD QP (`LinkRequest`,
//! `LinkReply`, `LinkReady`) on arbitrary bytes: decoding never panics, and
//! what decodes re-encodes to exactly the input (the codec is strict).
#![no_main]

use krcore::meta::proto::{LinkMessage, LINK_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(m) = LinkMessage::decode(data) else { return };
    let mut out = [0xee; LINK_LEN];
    match &m {
        LinkMessage::Request(r) => r.encode(&mut out),
        LinkMessage::Reply(r) => r.encode(&mut out),
        LinkMessage::Ready(r) => r.encode(&mut out),
    }
    assert_eq!(&out[..], data, "{m:?}");
    assert_eq!(LinkMessage::decode(&out), Ok(m));
});
