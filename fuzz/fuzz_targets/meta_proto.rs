//! The boot (TCP), meta (RC SEND) and proof (UD) protocols with `krcore-meta` on
//! arbitrary bytes: no decoder panics; what one decodes re-encodes to
//! exactly the input; kinds are unique across families, so at most one
//! message type accepts a buffer (the link family included); and the
//! server's first-message dispatch (`BootMessage`) agrees with the
//! decoders of the three messages it accepts.
#![no_main]

use krcore::meta::proto::{
    Answer, BootMessage, Hello, LinkMessage, PresenceAnswer, PresenceQuery, Proof, Query, Request, Response, Welcome, BOOT_LEN, META_LEN,
    PROOF_LEN,
};
use libfuzzer_sys::fuzz_target;

/// Re-encodes a decoded message into a buffer pre-filled with garbage (the
/// encoder must write every byte) and checks it is the input.
fn recode<M: std::fmt::Debug, const N: usize>(data: &[u8], m: &M, encode: impl Fn(&M, &mut [u8; N])) {
    let mut out = [0xee; N];
    encode(m, &mut out);
    assert_eq!(&out[..], data, "{m:?}");
}

fuzz_target!(|data: &[u8]| {
    let hello = Hello::decode(data);
    let welcome = Welcome::decode(data);
    let query = Query::decode(data);
    let answer = Answer::decode(data);
    let request = Request::decode(data);
    let response = Response::decode(data);
    let link = LinkMessage::decode(data);
    let proof = Proof::decode(data);
    let presence_query = PresenceQuery::decode(data);
    let presence_answer = PresenceAnswer::decode(data);
    let boot = BootMessage::decode(data);

    if let Ok(m) = &hello {
        recode::<_, BOOT_LEN>(data, m, Hello::encode);
    }
    if let Ok(m) = &welcome {
        recode::<_, BOOT_LEN>(data, m, Welcome::encode);
    }
    if let Ok(m) = &query {
        recode::<_, BOOT_LEN>(data, m, Query::encode);
    }
    if let Ok(m) = &answer {
        recode::<_, BOOT_LEN>(data, m, Answer::encode);
    }
    if let Ok(m) = &request {
        recode::<_, META_LEN>(data, m, Request::encode);
    }
    if let Ok(m) = &response {
        recode::<_, META_LEN>(data, m, Response::encode);
    }
    if let Ok(m) = &proof {
        recode::<_, PROOF_LEN>(data, m, Proof::encode);
    }
    if let Ok(m) = &presence_query {
        recode::<_, BOOT_LEN>(data, m, PresenceQuery::encode);
    }
    if let Ok(m) = &presence_answer {
        recode::<_, BOOT_LEN>(data, m, PresenceAnswer::encode);
    }

    let accepted = [
        hello.is_ok(),
        welcome.is_ok(),
        query.is_ok(),
        answer.is_ok(),
        request.is_ok(),
        response.is_ok(),
        link.is_ok(),
        proof.is_ok(),
        presence_query.is_ok(),
        presence_answer.is_ok(),
    ];
    assert!(accepted.iter().filter(|&&ok| ok).count() <= 1, "{accepted:?}");
    match boot {
        Ok(BootMessage::Hello(m)) => assert_eq!(hello, Ok(m)),
        Ok(BootMessage::Query(m)) => assert_eq!(query, Ok(m)),
        Ok(BootMessage::Presence(m)) => assert_eq!(presence_query, Ok(m)),
        Err(_) => assert!(hello.is_err() && query.is_err() && presence_query.is_err()),
    }
});
