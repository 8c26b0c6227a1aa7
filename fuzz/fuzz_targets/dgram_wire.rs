//! The datagram tier's codec on arbitrary bytes (what the service
//! endpoint's UD QP receives, and the ACKs a CLOSE carries): decoding never
//! panics; whatever decodes is of the family (`is_dgram`) and re-encodes
//! to exactly the input; and setting or clearing a DATA's or REQUEST's
//! ACK_REQ flag in place (a retransmission) keeps it decodable with only
//! that field changed.
#![no_main]

use krcore::transport::dgram::wire::{is_dgram, set_ack_req, Data, Message, Request, MAX_MTU};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(m) = Message::decode(data) else { return };
    assert!(is_dgram(data));
    // No datagram is longer than the largest MTU (the encoder asserts
    // that), so only those re-encode.
    if data.len() <= MAX_MTU {
        assert_eq!(m.to_vec(), data, "{m:?}");
    }
    if let Message::Data(_) | Message::Request(_) = m {
        for on in [false, true] {
            let mut b = data.to_vec();
            set_ack_req(&mut b, on);
            let again = Message::decode(&b).unwrap_or_else(|e| panic!("{m:?} with ack_req {on}: {e:?}"));
            match (m, again) {
                (Message::Data(d), Message::Data(a)) => assert_eq!(a, Data { ack_req: on, ..d }),
                (Message::Request(r), Message::Request(a)) => {
                    assert_eq!(a, Request { ack_req: on, ..r })
                }
                (m, a) => panic!("{m:?} became {a:?}"),
            }
        }
    }
});
