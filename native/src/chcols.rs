//! The analytics tables' rows as typed columns, and one block of them in ClickHouse's Native format.
//!
//! The analytics app inserts with `raw_insert(table, column_names, insert_block=bytes, fmt="Native")`
//! instead of clickhouse-connect's pure-Python encoder (`processors/analytics/tables.py` lists the
//! tables; `infra/clickhouse/migrations/` declares their columns, and `Schema` here must say the same).
//!
//! Invariants and decisions:
//! - A `TableCols` holds only complete rows between calls: a caller pushes one value into every
//!   column, then `end_row` (checked in debug builds). Pushes are a bounds check, a tag match and a
//!   `Vec::push`; the hot path (a native ingest run) pushes per event and per ended block.
//! - `LowCardinality(String)` columns keep interned ids and a dictionary for the whole batch (node ids,
//!   media and kinds repeat on nearly every row); the last id is remembered, so a run of the same
//!   value costs one string compare. `encode` writes a dictionary of its own per block, holding only
//!   the values the block's rows use, in ClickHouse's LowCardinality serialization (not as String:
//!   the engine would build the dictionary again from every row).
//! - `drop_front` keeps dictionaries (the values come back) unless they outgrow the rows left, so a
//!   batch that lives as long as the app stays bounded.
//! - The Native block is the input form of `FORMAT Native` (no BlockInfo, no per-column
//!   serialization-kind byte): varint column count, varint row count, then per column its name, its
//!   type name and, if the block has rows, its data.

mod col;

pub(crate) use col::Col;
use col::{write_bytes, write_varint};

/// A column type of the analytics tables, with the one Python/Rust value form each takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChType {
    /// `DateTime64(6, 'UTC')`: microseconds since the epoch, `i64`.
    DateTime64Micro,
    UInt8,
    UInt16,
    UInt32,
    UInt64,
    Int32,
    Float64,
    String,
    LowCardinalityString,
    ArrayUInt64,
    NullableUInt32,
    NullableFloat64,
}

impl ChType {
    /// The type exactly as the migrations declare it (and as `DESCRIBE` shows it).
    pub fn name(self) -> &'static str {
        match self {
            ChType::DateTime64Micro => "DateTime64(6, 'UTC')",
            ChType::UInt8 => "UInt8",
            ChType::UInt16 => "UInt16",
            ChType::UInt32 => "UInt32",
            ChType::UInt64 => "UInt64",
            ChType::Int32 => "Int32",
            ChType::Float64 => "Float64",
            ChType::String => "String",
            ChType::LowCardinalityString => "LowCardinality(String)",
            ChType::ArrayUInt64 => "Array(UInt64)",
            ChType::NullableUInt32 => "Nullable(UInt32)",
            ChType::NullableFloat64 => "Nullable(Float64)",
        }
    }
}

/// A table's name and its columns in insert order (`processors/analytics/rows.py`, `restores.py`).
#[derive(Debug)]
pub struct Schema {
    pub table: &'static str,
    pub columns: &'static [(&'static str, ChType)],
}

/// `columns!(module, STATIC, "table"; CONST: "column" => Type, ...)`: the schema and, in `module`, one
/// index constant per column, numbered in order, so the two cannot disagree.
macro_rules! columns {
    ($m:ident, $schema:ident, $table:literal; $($konst:ident: $name:literal => $ty:ident),+ $(,)?) => {
        #[doc = concat!("Column indexes of `", $table, "`.")]
        pub mod $m {
            columns!(@idx 0usize; $($konst)+);
            #[cfg(test)]
            pub(crate) const ALL: &[(&str, usize)] = &[$((stringify!($konst), $konst)),+];
        }
        #[doc = concat!("`", $table, "`, columns in insert order.")]
        pub static $schema: Schema = Schema { table: $table, columns: &[$(($name, ChType::$ty)),+] };
    };
    (@idx $i:expr; $k:ident $($rest:ident)*) => {
        pub const $k: usize = $i;
        columns!(@idx $i + 1; $($rest)*);
    };
    (@idx $i:expr;) => {};
}

// processors/analytics/rows.py: EVENT_COLUMNS (from_cpu_blocks: migration 006)
columns!(ev, EVENTS, "kv_events";
    TS: "ts" => DateTime64Micro, INGEST_TS: "ingest_ts" => DateTime64Micro,
    NODE_ID: "node_id" => LowCardinalityString, EPOCH: "epoch" => UInt64, SEQ: "seq" => UInt64,
    DP_RANK: "dp_rank" => Int32, GROUP_IDX: "group_idx" => Int32, MEDIUM: "medium" => LowCardinalityString,
    KIND: "kind" => LowCardinalityString, SPEC_KIND: "spec_kind" => LowCardinalityString,
    BLOCK_HASHES: "block_hashes" => ArrayUInt64, PARENT_HASH: "parent_hash" => UInt64,
    HAS_PARENT: "has_parent" => UInt8, NUM_BLOCKS: "num_blocks" => UInt32, NUM_TOKENS: "num_tokens" => UInt32,
    BLOCK_SIZE: "block_size" => UInt32, KAFKA_PARTITION: "kafka_partition" => UInt32,
    KAFKA_OFFSET: "kafka_offset" => UInt64, EVENT_IDX: "event_idx" => UInt32,
    FROM_CPU_BLOCKS: "from_cpu_blocks" => NullableUInt32,
);

// processors/analytics/rows.py: LIFETIME_COLUMNS (group_kind, end_reason: migration 004)
columns!(lt, LIFETIMES, "kv_block_lifetimes";
    NODE_ID: "node_id" => LowCardinalityString, EPOCH: "epoch" => UInt64, GROUP_IDX: "group_idx" => Int32,
    MEDIUM: "medium" => LowCardinalityString, BLOCK_HASH: "block_hash" => UInt64,
    STORED_TS: "stored_ts" => DateTime64Micro, REMOVED_TS: "removed_ts" => DateTime64Micro,
    LIFETIME_S: "lifetime_s" => Float64, REASON: "reason" => LowCardinalityString,
    KAFKA_PARTITION: "kafka_partition" => UInt32, KAFKA_OFFSET: "kafka_offset" => UInt64,
    EVENT_IDX: "event_idx" => UInt32, COPY_IDX: "copy_idx" => UInt16,
    GROUP_KIND: "group_kind" => LowCardinalityString, END_REASON: "end_reason" => LowCardinalityString,
);

// processors/analytics/restores.py: RESTORE_COLUMNS
columns!(rs, RESTORES, "kv_restores";
    NODE_ID: "node_id" => LowCardinalityString, EPOCH: "epoch" => UInt64, GROUP_IDX: "group_idx" => Int32,
    GROUP_KIND: "group_kind" => LowCardinalityString, MEDIUM: "medium" => LowCardinalityString,
    BLOCK_HASH: "block_hash" => UInt64, BLOCK_SIZE: "block_size" => UInt32,
    REMOVED_TS: "removed_ts" => DateTime64Micro, RESTORED_TS: "restored_ts" => DateTime64Micro,
    DELAY_S: "delay_s" => Float64, END_REASON: "end_reason" => LowCardinalityString,
    STACK_DISTANCE: "stack_distance" => UInt64, HELD_BLOCKS: "held_blocks" => UInt64,
    KAFKA_PARTITION: "kafka_partition" => UInt32, KAFKA_OFFSET: "kafka_offset" => UInt64,
    EVENT_IDX: "event_idx" => UInt32,
);

// processors/analytics/rows.py: LOAD_COLUMNS
columns!(ld, LOADS, "kv_node_load";
    TS: "ts" => DateTime64Micro, NODE_ID: "node_id" => LowCardinalityString, EPOCH: "epoch" => UInt64,
    SEQ: "seq" => UInt64, RUNNING: "running" => NullableUInt32, WAITING: "waiting" => NullableUInt32,
    KV_USAGE: "kv_usage" => NullableFloat64, KAFKA_PARTITION: "kafka_partition" => UInt32,
    KAFKA_OFFSET: "kafka_offset" => UInt64,
);

/// The schema of a table by its name (`processors/analytics/tables.py` names them).
pub fn schema(table: &str) -> Option<&'static Schema> {
    [&EVENTS, &LIFETIMES, &RESTORES, &LOADS]
        .into_iter()
        .find(|s| s.table == table)
}

/// One table's rows as columns (see the module's invariants).
#[derive(Clone)]
pub struct TableCols {
    schema: &'static Schema,
    pub(crate) cols: Vec<Col>,
    rows: usize,
}

#[cold]
#[inline(never)]
fn wrong_type(schema: &Schema, c: usize, pushed: &str) -> ! {
    let (name, ty) = schema.columns[c];
    panic!("{}.{name} is {}, pushed {pushed}", schema.table, ty.name())
}

/// `push_*`: one value into column `c`, which must be of the matching type.
macro_rules! push {
    ($(#[$doc:meta])* $f:ident($v:ident: $t:ty) => $p:pat => $e:expr) => {
        $(#[$doc])*
        #[inline]
        pub fn $f(&mut self, c: usize, $v: $t) {
            match &mut self.cols[c] {
                $p => $e,
                _ => wrong_type(self.schema, c, stringify!($t)),
            }
        }
    };
}

impl TableCols {
    pub fn new(schema: &'static Schema) -> Self {
        let cols = schema.columns.iter().map(|&(_, ty)| Col::new(ty)).collect();
        TableCols {
            schema,
            cols,
            rows: 0,
        }
    }

    pub fn schema(&self) -> &'static Schema {
        self.schema
    }

    /// Complete rows.
    pub fn len(&self) -> usize {
        self.rows
    }

    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    push!(/// `DateTime64Micro`: microseconds.
        push_i64(v: i64) => Col::I64(col) => col.push(v));
    push!(push_u64(v: u64) => Col::U64(col) => col.push(v));
    push!(push_u32(v: u32) => Col::U32(col) => col.push(v));
    push!(push_u16(v: u16) => Col::U16(col) => col.push(v));
    push!(push_u8(v: u8) => Col::U8(col) => col.push(v));
    push!(push_i32(v: i32) => Col::I32(col) => col.push(v));
    push!(push_f64(v: f64) => Col::F64(col) => col.push(v));
    /// `String` or `LowCardinalityString`.
    #[inline]
    pub fn push_str(&mut self, c: usize, v: &str) {
        match &mut self.cols[c] {
            Col::Lc { ids, dict } => ids.push(dict.intern(v)),
            Col::Str { bytes, offs } => {
                bytes.extend_from_slice(v.as_bytes());
                offs.push(bytes.len());
            }
            _ => wrong_type(self.schema, c, "&str"),
        }
    }
    push!(/// `ArrayUInt64`: one row's array.
    push_u64s(v: &[u64]) => Col::Arr { values, offs } => {
        values.extend_from_slice(v);
        offs.push(values.len());
    });
    push!(push_opt_u32(v: Option<u32>) => Col::OptU32 { nulls, values } => {
        nulls.push(v.is_none() as u8);
        values.push(v.unwrap_or(0));
    });
    push!(push_opt_f64(v: Option<f64>) => Col::OptF64 { nulls, values } => {
        nulls.push(v.is_none() as u8);
        values.push(v.unwrap_or(0.0));
    });

    /// Close the row every column now has a value of.
    #[inline]
    pub fn end_row(&mut self) {
        self.rows += 1;
        debug_assert!(
            self.cols.iter().all(|c| c.len() == self.rows),
            "{}: a row ended with columns of lengths {:?}",
            self.schema.table,
            self.cols.iter().map(Col::len).collect::<Vec<_>>()
        );
    }

    /// Columns filled whole (the Python face fills one column at a time): every column must hold
    /// `rows` values.
    pub(crate) fn set_rows(&mut self, rows: usize) {
        assert!(
            self.cols.iter().all(|c| c.len() == rows),
            "{}: columns of unequal length",
            self.schema.table
        );
        self.rows = rows;
    }

    /// Add `other`'s rows after ours (the same table's).
    pub fn append(&mut self, other: &TableCols) {
        assert!(
            std::ptr::eq(self.schema, other.schema),
            "append: {} rows to {}",
            other.schema.table,
            self.schema.table
        );
        if self.rows == 0 {
            self.clone_from(other);
            return;
        }
        for (a, b) in self.cols.iter_mut().zip(&other.cols) {
            a.append(b);
        }
        self.rows += other.rows;
    }

    /// Forget the first `n` rows (those inserted).
    pub fn drop_front(&mut self, n: usize) {
        assert!(
            n <= self.rows,
            "{}: drop {n} of {} rows",
            self.schema.table,
            self.rows
        );
        if n == self.rows {
            *self = TableCols::new(self.schema); // the dictionaries too: nothing refers to them
            return;
        }
        self.cols.iter_mut().for_each(|c| c.drop_front(n));
        self.rows -= n;
    }

    /// Rows `start..end` as one Native-format block, appended to `out`.
    pub fn encode(&self, start: usize, end: usize, out: &mut Vec<u8>) {
        assert!(
            start <= end && end <= self.rows,
            "{}: rows {start}..{end} of {}",
            self.schema.table,
            self.rows
        );
        write_varint(out, self.cols.len() as u64);
        write_varint(out, (end - start) as u64);
        for (col, &(name, ty)) in self.cols.iter().zip(self.schema.columns) {
            write_bytes(out, name.as_bytes());
            write_bytes(out, ty.name().as_bytes());
            if end > start {
                // ClickHouse writes no data, not even LowCardinality's prefix, for a block without rows
                col.encode(start, end, out);
            }
        }
    }
}

#[cfg(test)]
mod tests;
