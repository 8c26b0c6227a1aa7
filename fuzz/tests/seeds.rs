//! The committed seed corpus (`corpus/<target>/`) is exactly what
//! `krcore_fuzz::seeds` makes with the library's encoders today, and every
//! seed is a message its target's decoder accepts: after a change to a wire
//! format (a version bump, say) this fails instead of the fuzzer starting
//! from seeds that no longer decode.
//!
//! `KRCORE_FUZZ_WRITE_SEEDS=1 cargo test --manifest-path fuzz/Cargo.toml
//! --test seeds` rewrites the corpus (then commit it).

use krcore::meta::proto::{BootMessage, LinkMessage, Request, Response, Welcome};
use krcore::meta::table::{EndpointSchema, Lookup, RemoteTable, Schema, HEADER_SIZE};
use krcore::transport::dgram::wire::Message;
use krcore::vqp::header::Header;
use krcore::vqp::wrid::WrId;
use krcore_fuzz::{seeds, table_input, TARGETS};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn corpus(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus").join(target)
}

/// Whether `seed` is a valid input of `target` (the lookups of
/// `meta_table` as the seed's name says).
fn decodes(target: &str, name: &str, seed: &[u8]) -> bool {
    match target {
        "dgram_wire" => Message::decode(seed).is_ok(),
        "link_msg" => LinkMessage::decode(seed).is_ok(),
        "meta_proto" => {
            BootMessage::decode(seed).is_ok()
                || Welcome::decode(seed).is_ok()
                || krcore::meta::proto::Answer::decode(seed).is_ok()
                || Request::decode(seed).is_ok()
                || Response::decode(seed).is_ok()
                || krcore::meta::proto::Proof::decode(seed).is_ok()
                || krcore::meta::proto::PresenceAnswer::decode(seed).is_ok()
        }
        "meta_table" => {
            let key = table_input::endpoint_key(seed[HEADER_SIZE..].first_chunk().unwrap());
            match lookup::<EndpointSchema>(seed, key, EndpointSchema::KEY_LEN) {
                Some(Lookup::Found(())) => name.contains("found"),
                Some(Lookup::Absent) => name.contains("absent"),
                Some(Lookup::Torn) => name.contains("short"),
                None => false,
            }
        }
        "node_msg" => krcore::node::proto::Message::decode(seed).is_ok(),
        "vqp_header" => Header::decode(seed).is_ok_and(|h| {
            let payload = &seed[krcore::vqp::header::HEADER_LEN..];
            payload.len() == h.carried_len() as usize
                && (h.link_op() != Some(krcore::vqp::header::LinkOp::MrAnswer) || krcore::vqp::mrcheck::Answer::decode(payload).is_ok())
        }),
        "wrid" => seed.first_chunk().is_some_and(|b| WrId::decode(u64::from_le_bytes(*b)).is_ok()),
        _ => unreachable!(),
    }
}

/// The lookup a `meta_table` seed describes, values forgotten.
fn lookup<S: Schema>(rest: &[u8], key: S::Key, key_len: usize) -> Option<Lookup<()>> {
    let table = RemoteTable::<S>::parse(rest).ok()?;
    Some(match table.lookup_in(&rest[HEADER_SIZE + key_len..], key) {
        Lookup::Found(_) => Lookup::Found(()),
        Lookup::Absent => Lookup::Absent,
        Lookup::Torn => Lookup::Torn,
    })
}

#[test]
fn committed_corpus_is_the_generated_one() {
    let write = std::env::var_os("KRCORE_FUZZ_WRITE_SEEDS").is_some_and(|v| v == "1");
    let mut stale = Vec::new();
    for target in TARGETS {
        let dir = corpus(target);
        let want: BTreeMap<String, Vec<u8>> = seeds(target).into_iter().map(|(n, b)| (n.to_string(), b)).collect();
        for (name, seed) in &want {
            assert!(decodes(target, name, seed), "seed {target}/{name} is not a valid input: {seed:02x?}");
        }
        if write {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            for (name, seed) in &want {
                std::fs::write(dir.join(name), seed).unwrap();
            }
            continue;
        }
        let have: BTreeMap<String, Vec<u8>> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| {
                let e = e.unwrap();
                (e.file_name().into_string().unwrap(), std::fs::read(e.path()).unwrap())
            })
            .collect();
        if have != want {
            stale.push(target);
        }
    }
    assert!(
        stale.is_empty(),
        "the seed corpus of {stale:?} differs from what the encoders make now: \
         KRCORE_FUZZ_WRITE_SEEDS=1 cargo test --manifest-path fuzz/Cargo.toml --test seeds, then commit fuzz/corpus"
    );
}
