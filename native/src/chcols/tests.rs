//! Unit tests of `chcols`: each type's Native bytes checked by hand on tiny columns, then whole
//! blocks, and the batch operations (append, drop_front) against a batch built from scratch.

use super::col::{write_varint, Dict};
use super::*;

fn bytes_of(col: &Col, start: usize, end: usize) -> Vec<u8> {
    let mut out = Vec::new();
    col.encode(start, end, &mut out);
    out
}

fn le64(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn lc_of(values: &[&str]) -> Col {
    let mut dict = Dict::default();
    let ids = values.iter().map(|v| dict.intern(v)).collect();
    Col::Lc { ids, dict }
}

#[test]
fn varints_are_leb128() {
    for (v, want) in [
        (0u64, vec![0u8]),
        (127, vec![0x7f]),
        (128, vec![0x80, 0x01]),
        (300, vec![0xac, 0x02]),
    ] {
        let mut out = Vec::new();
        write_varint(&mut out, v);
        assert_eq!(out, want, "{v}");
    }
    let mut out = Vec::new();
    write_varint(&mut out, u64::MAX);
    assert_eq!(out, [[0xff; 9].as_slice(), &[0x01]].concat());
}

#[test]
fn fixed_width_values_are_little_endian() {
    assert_eq!(
        bytes_of(&Col::I64(vec![1, -1]), 0, 2),
        [le64(1), vec![0xff; 8]].concat()
    );
    assert_eq!(bytes_of(&Col::U8(vec![0, 1, 255]), 1, 3), [1, 255]);
    assert_eq!(bytes_of(&Col::U16(vec![0x0102]), 0, 1), [2, 1]);
    assert_eq!(
        bytes_of(&Col::U32(vec![7, 0x0a0b0c0d]), 1, 2),
        [0x0d, 0x0c, 0x0b, 0x0a]
    );
    assert_eq!(
        bytes_of(&Col::U64(vec![u64::MAX, 2]), 0, 2),
        [vec![0xff; 8], le64(2)].concat()
    );
    assert_eq!(
        bytes_of(&Col::I32(vec![-2]), 0, 1),
        [0xfe, 0xff, 0xff, 0xff]
    );
    assert_eq!(
        bytes_of(&Col::F64(vec![1.5]), 0, 1),
        [0, 0, 0, 0, 0, 0, 0xf8, 0x3f]
    );
}

#[test]
fn strings_are_length_prefixed_utf8() {
    let mut t = TableCols::new(&EVENTS);
    let col = {
        t.cols[ev::NODE_ID] = Col::new(ChType::String);
        t.push_str(ev::NODE_ID, "");
        t.push_str(ev::NODE_ID, "é");
        t.push_str(ev::NODE_ID, "ab");
        &t.cols[ev::NODE_ID]
    };
    assert_eq!(bytes_of(col, 0, 3), [0, 2, 0xc3, 0xa9, 2, b'a', b'b']);
    assert_eq!(bytes_of(col, 1, 2), [2, 0xc3, 0xa9]);
}

#[test]
fn arrays_are_end_offsets_from_the_blocks_first_value_then_values() {
    let mut t = TableCols::new(&EVENTS);
    for row in [&[1u64, 2][..], &[], &[3], &[u64::MAX, 0]] {
        t.push_u64s(ev::BLOCK_HASHES, row);
    }
    let col = &t.cols[ev::BLOCK_HASHES];
    assert_eq!(
        bytes_of(col, 0, 2),
        [le64(2), le64(2), le64(1), le64(2)].concat()
    );
    // rows 1..4: [], [3], [MAX, 0]
    assert_eq!(
        bytes_of(col, 1, 4),
        [le64(0), le64(1), le64(3), le64(3), le64(u64::MAX), le64(0)].concat()
    );
}

#[test]
fn nullables_are_a_null_map_then_values_with_zero_for_null() {
    let mut t = TableCols::new(&LOADS);
    t.push_opt_u32(ld::RUNNING, Some(5));
    t.push_opt_u32(ld::RUNNING, None);
    t.push_opt_f64(ld::KV_USAGE, None);
    t.push_opt_f64(ld::KV_USAGE, Some(1.5));
    assert_eq!(
        bytes_of(&t.cols[ld::RUNNING], 0, 2),
        [0, 1, 5, 0, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(
        bytes_of(&t.cols[ld::KV_USAGE], 0, 2),
        [vec![1, 0], le64(0), le64(1.5f64.to_bits())].concat()
    );
}

fn lc_head(width: u64, keys: usize) -> Vec<u8> {
    [
        le64(1),
        le64((1 << 9) | (1 << 10) | width),
        le64(keys as u64),
    ]
    .concat()
}

#[test]
fn low_cardinality_is_a_block_dictionary_in_first_seen_order_and_byte_indexes() {
    let col = lc_of(&["b", "a", "b", ""]);
    let want = [
        lc_head(0, 3),
        vec![1, b'b', 1, b'a', 0],
        le64(4),
        vec![0, 1, 0, 2],
    ]
    .concat();
    assert_eq!(bytes_of(&col, 0, 4), want);
}

#[test]
fn a_low_cardinality_block_holds_only_the_values_its_rows_use() {
    let col = lc_of(&["x", "y", "z", "y"]);
    let want = [lc_head(0, 2), vec![1, b'z', 1, b'y'], le64(2), vec![0, 1]].concat();
    assert_eq!(bytes_of(&col, 2, 4), want);
}

#[test]
fn low_cardinality_indexes_take_the_smallest_width_that_fits() {
    for (distinct, width) in [(256usize, 0u64), (257, 1), (65_536, 1), (65_537, 2)] {
        let values: Vec<String> = (0..distinct).map(|i| format!("v{i}")).collect();
        let refs: Vec<&str> = values.iter().map(String::as_str).collect();
        let out = bytes_of(&lc_of(&refs), 0, distinct);
        assert_eq!(out[..24], lc_head(width, distinct)[..], "{distinct} keys");
        let index_bytes = distinct << width;
        let tail = &out[out.len() - index_bytes..];
        let last = distinct as u64 - 1;
        assert_eq!(
            tail[tail.len() - (1 << width)..],
            last.to_le_bytes()[..1 << width],
            "{distinct} keys"
        );
        assert_eq!(
            out[out.len() - index_bytes - 8..out.len() - index_bytes],
            le64(distinct as u64)
        );
    }
}

fn load_row(t: &mut TableCols, i: u64, node: &str) {
    t.push_i64(ld::TS, 1_700_000_000_000_000 + i as i64);
    t.push_str(ld::NODE_ID, node);
    t.push_u64(ld::EPOCH, 1);
    t.push_u64(ld::SEQ, i);
    t.push_opt_u32(ld::RUNNING, (i & 1 == 0).then_some(i as u32));
    t.push_opt_u32(ld::WAITING, None);
    t.push_opt_f64(ld::KV_USAGE, Some(i as f64 / 10.0));
    t.push_u32(ld::KAFKA_PARTITION, 3);
    t.push_u64(ld::KAFKA_OFFSET, 100 + i);
    t.end_row();
}

fn name_and_type(name: &str, ty: &str) -> Vec<u8> {
    [
        vec![name.len() as u8],
        name.as_bytes().to_vec(),
        vec![ty.len() as u8],
        ty.as_bytes().to_vec(),
    ]
    .concat()
}

#[test]
fn a_block_is_column_and_row_counts_then_name_type_and_data_per_column() {
    let mut t = TableCols::new(&LOADS);
    load_row(&mut t, 0, "n");
    let mut out = Vec::new();
    t.encode(0, 1, &mut out);
    let want = [
        vec![9, 1],
        name_and_type("ts", "DateTime64(6, 'UTC')"),
        le64(1_700_000_000_000_000),
        name_and_type("node_id", "LowCardinality(String)"),
        lc_head(0, 1),
        vec![1, b'n'],
        le64(1),
        vec![0],
        name_and_type("epoch", "UInt64"),
        le64(1),
        name_and_type("seq", "UInt64"),
        le64(0),
        name_and_type("running", "Nullable(UInt32)"),
        vec![0, 0, 0, 0, 0],
        name_and_type("waiting", "Nullable(UInt32)"),
        vec![1, 0, 0, 0, 0],
        name_and_type("kv_usage", "Nullable(Float64)"),
        vec![0],
        le64(0),
        name_and_type("kafka_partition", "UInt32"),
        vec![3, 0, 0, 0],
        name_and_type("kafka_offset", "UInt64"),
        le64(100),
    ]
    .concat();
    assert_eq!(out, want);
}

#[test]
fn a_block_without_rows_has_names_and_types_only() {
    let mut t = TableCols::new(&LOADS);
    load_row(&mut t, 0, "n");
    let mut out = Vec::new();
    t.encode(1, 1, &mut out);
    let mut want = vec![9, 0];
    for (name, ty) in LOADS.columns {
        want.extend(name_and_type(name, ty.name()));
    }
    assert_eq!(out, want);
}

fn encoded(t: &TableCols, start: usize, end: usize) -> Vec<u8> {
    let mut out = Vec::new();
    t.encode(start, end, &mut out);
    out
}

#[test]
fn appended_and_dropped_rows_encode_as_a_batch_built_from_those_rows() {
    let nodes = ["a", "b", "c"];
    let mut whole = TableCols::new(&LOADS);
    let mut first = TableCols::new(&LOADS);
    let mut second = TableCols::new(&LOADS);
    for i in 0..10u64 {
        // the second batch meets the nodes in another order, so its ids differ from the first's
        let node = nodes[(i as usize * 2) % 3];
        load_row(&mut whole, i, node);
        load_row(if i < 4 { &mut first } else { &mut second }, i, node);
    }
    first.append(&second);
    assert_eq!(first.len(), 10);
    assert_eq!(encoded(&first, 0, 10), encoded(&whole, 0, 10));
    assert_eq!(encoded(&first, 3, 7), encoded(&whole, 3, 7));
    first.drop_front(6);
    let mut rest = TableCols::new(&LOADS);
    for i in 6..10u64 {
        load_row(&mut rest, i, nodes[(i as usize * 2) % 3]);
    }
    assert_eq!(first.len(), 4);
    assert_eq!(encoded(&first, 0, 4), encoded(&rest, 0, 4));
    first.drop_front(4);
    assert!(first.is_empty());
    first.append(&rest);
    assert_eq!(encoded(&first, 0, 4), encoded(&rest, 0, 4));
}

#[test]
fn drop_front_shrinks_a_dictionary_that_outgrew_the_rows_left() {
    let mut t = TableCols::new(&LOADS);
    for i in 0..5000u64 {
        load_row(&mut t, i, &format!("node-{i}"));
    }
    t.drop_front(4990);
    let Col::Lc { ids, dict } = &t.cols[ld::NODE_ID] else {
        panic!("node_id is LowCardinality")
    };
    assert_eq!(dict.strs.len(), 10);
    assert_eq!(&*dict.strs[ids[9] as usize], "node-4999");
    let mut rest = TableCols::new(&LOADS);
    for i in 4990..5000u64 {
        load_row(&mut rest, i, &format!("node-{i}"));
    }
    assert_eq!(encoded(&t, 0, 10), encoded(&rest, 0, 10));
}

#[test]
fn column_constants_name_the_schemas_columns() {
    for (schema, all) in [
        (&EVENTS, ev::ALL),
        (&LIFETIMES, lt::ALL),
        (&RESTORES, rs::ALL),
        (&LOADS, ld::ALL),
    ] {
        assert_eq!(all.len(), schema.columns.len(), "{}", schema.table);
        for (i, &(konst, at)) in all.iter().enumerate() {
            assert_eq!(at, i);
            assert_eq!(
                konst.to_lowercase(),
                schema.columns[i].0,
                "{}",
                schema.table
            );
        }
    }
    assert_eq!(EVENTS.columns.len(), 20);
    assert_eq!(
        EVENTS.columns[ev::FROM_CPU_BLOCKS].1,
        ChType::NullableUInt32
    );
    assert_eq!(LIFETIMES.columns[lt::COPY_IDX].1, ChType::UInt16);
}

#[test]
fn schemas_are_found_by_table_name() {
    assert!(std::ptr::eq(schema("kv_events").unwrap(), &EVENTS));
    assert!(std::ptr::eq(
        schema("kv_block_lifetimes").unwrap(),
        &LIFETIMES
    ));
    assert!(std::ptr::eq(schema("kv_restores").unwrap(), &RESTORES));
    assert!(std::ptr::eq(schema("kv_node_load").unwrap(), &LOADS));
    assert!(schema("kv_events_final").is_none());
}

#[test]
#[should_panic(expected = "kv_node_load.epoch is UInt64, pushed u32")]
fn a_push_of_the_wrong_type_panics() {
    TableCols::new(&LOADS).push_u32(ld::EPOCH, 1);
}

#[test]
#[should_panic(expected = "append: kv_events rows to kv_node_load")]
fn appending_another_tables_rows_panics() {
    TableCols::new(&LOADS).append(&TableCols::new(&EVENTS));
}

#[test]
#[should_panic(expected = "a row ended with columns of lengths")]
#[cfg(debug_assertions)]
fn a_row_missing_a_value_fails_in_debug_builds() {
    let mut t = TableCols::new(&LOADS);
    t.push_i64(ld::TS, 0);
    t.end_row();
}
