//! A remote table as a reader sees it (the meta server's endpoint table),
//! on arbitrary bytes: the header READ from the owner
//! (`RemoteTable::parse`), then a lookup (`lookup_in`) over the bytes a
//! READ of the key's neighborhood returned, which decodes a slot's value
//! (`Schema::decode_value`). Input layout: `krcore_fuzz::table_input`.
//! Nothing panics; the READ a parsed header asks for stays inside the
//! table the header describes; a short READ is never Absent; a found
//! value re-encodes to the value bytes of a slot of the READ; and
//! `decode_value` takes any bytes and re-encodes them.
#![no_main]

use krcore::meta::table::{EndpointSchema, Lookup, RemoteTable, Schema, Table, HEADER_SIZE, NEIGHBORHOOD};
use krcore_fuzz::table_input;
use libfuzzer_sys::fuzz_target;

fn check<S: Schema<Key: Copy>>(rest: &[u8], key: Option<S::Key>) {
    // `decode_value` on the value-sized tail, whatever it holds.
    if let Some(b) = rest.len().checked_sub(S::VALUE_LEN).map(|at| &rest[at..]) {
        let mut out = vec![0xee; S::VALUE_LEN];
        S::encode_value(&S::decode_value(b), &mut out);
        assert_eq!(out, b);
    }
    let Ok(table) = RemoteTable::<S>::parse(rest) else { return };
    let Some(key) = key else { return };
    let (offset, len) = table.neighborhood(key);
    let region = Table::<S>::bytes_for(table.nslots()) as u64;
    assert!(offset >= HEADER_SIZE as u64 && (offset - HEADER_SIZE as u64).is_multiple_of(S::SLOT_SIZE as u64), "{offset}");
    assert!(len == NEIGHBORHOOD * S::SLOT_SIZE && offset + len as u64 <= region, "{offset} + {len} past {region}");
    let read = &rest[HEADER_SIZE + S::KEY_LEN..];
    match table.lookup_in(read, key) {
        Lookup::Absent => assert!(read.len() >= len, "Absent from a READ of {} bytes", read.len()),
        Lookup::Found(v) => {
            let mut value = vec![0; S::VALUE_LEN];
            S::encode_value(&v, &mut value);
            // Slot: seq (8), used byte, key, value.
            let at = 8 + 1 + S::KEY_LEN;
            let mut slots = read.chunks_exact(S::SLOT_SIZE).take(NEIGHBORHOOD);
            assert!(slots.any(|s| s[at..at + S::VALUE_LEN] == value[..]), "Found a value no slot holds");
        }
        Lookup::Torn => {}
    }
}

fuzz_target!(|data: &[u8]| {
    let key = data.get(HEADER_SIZE..).unwrap_or_default();
    check::<EndpointSchema>(data, key.first_chunk().map(table_input::endpoint_key));
});
