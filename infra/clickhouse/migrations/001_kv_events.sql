-- One row per vLLM KV event (BlockStored / BlockRemoved / AllBlocksCleared), as the processor saw it.
--
-- Exactly once: a processor that replays after a crash inserts some rows again. The sorting key
-- ends with the Kafka coordinates (kafka_partition, kafka_offset, event_idx), which identify an
-- event; every other key column is derived from the same message, so a replayed copy has an
-- identical key and ReplacingMergeTree keeps one of them. Merges are lazy: count through
-- kv_events_final (SELECT ... FINAL), never through the raw table.
-- ts is the node's batch timestamp (deterministic on replay), so copies land in the same partition.
CREATE TABLE IF NOT EXISTS kv_events
(
    ts              DateTime64(6, 'UTC'),
    ingest_ts       DateTime64(6, 'UTC'),
    node_id         LowCardinality(String),
    epoch           UInt64,
    seq             UInt64,
    dp_rank         Int32,
    group_idx       Int32,
    medium          LowCardinality(String),
    kind            LowCardinality(String),
    spec_kind       LowCardinality(String),
    block_hashes    Array(UInt64),
    parent_hash     UInt64,
    has_parent      UInt8,
    num_blocks      UInt32,
    num_tokens      UInt32,
    block_size      UInt32,
    kafka_partition UInt32,
    kafka_offset    UInt64,
    event_idx       UInt32
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (kind, group_idx, ts, kafka_partition, kafka_offset, event_idx);

CREATE VIEW IF NOT EXISTS kv_events_final AS SELECT * FROM kv_events FINAL;
