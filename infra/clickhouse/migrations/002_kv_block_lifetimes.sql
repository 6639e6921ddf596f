-- One row per block lifetime: a (node, epoch, group, medium, block hash) stored at stored_ts and
-- removed at removed_ts, with why (evicted / cleared / node_expired).
--
-- Exactly once as for kv_events: the key ends with the coordinates of the event that ended the
-- lifetime plus the block hash (one AllBlocksCleared ends many lifetimes) and copy_idx (vLLM does
-- not de-duplicate blocks, so one clear can end two lifetimes of the same hash; copy_idx numbers
-- them). Count through kv_block_lifetimes_final.
CREATE TABLE IF NOT EXISTS kv_block_lifetimes
(
    node_id         LowCardinality(String),
    epoch           UInt64,
    group_idx       Int32,
    medium          LowCardinality(String),
    block_hash      UInt64,
    stored_ts       DateTime64(6, 'UTC'),
    removed_ts      DateTime64(6, 'UTC'),
    lifetime_s      Float64,
    reason          LowCardinality(String),
    kafka_partition UInt32,
    kafka_offset    UInt64,
    event_idx       UInt32,
    copy_idx        UInt16
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(removed_ts)
ORDER BY (group_idx, medium, removed_ts, node_id, block_hash, kafka_partition, kafka_offset, event_idx, copy_idx);

CREATE VIEW IF NOT EXISTS kv_block_lifetimes_final AS SELECT * FROM kv_block_lifetimes FINAL;
