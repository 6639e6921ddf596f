-- Node load (issue 12: per-node snapshots per minute carry load when the envelopes carry it).
--
-- One row per applied envelope that reports load (`running`, `waiting`, `kv_usage`: schemas/envelope.py),
-- heartbeats included, written by the analytics app (processors/analytics/rows.py, `load_rows`). A field the
-- envelope left out is NULL (the bridge may know only some of them), not 0: 0 running requests is a fact.
-- Per envelope rather than per minute: the app never has to decide when a minute is over, and the row is
-- keyed by Kafka coordinates like every other table, so exactly-once holds the same way; the per-minute
-- figures are views over it (below). One small row per envelope is far fewer rows than kv_events.
-- Engine: ReplacingMergeTree, the exactly-once rule of kv_events (a replay re-inserts identical rows; the
-- key ends with the message's coordinates); read kv_node_load_final. ORDER BY (node_id, ts, ...): every
-- question is "this node's load over time" or "its latest load at time T" (an ASOF join on ts per node),
-- which reads one node's range in time order. Partitioned by month like the other tables.
CREATE TABLE IF NOT EXISTS kv_node_load
(
    ts              DateTime64(6, 'UTC'),
    node_id         LowCardinality(String),
    epoch           UInt64,
    seq             UInt64,
    running         Nullable(UInt32),
    waiting         Nullable(UInt32),
    kv_usage        Nullable(Float64),
    kafka_partition UInt32,
    kafka_offset    UInt64
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (node_id, ts, kafka_partition, kafka_offset);

CREATE VIEW IF NOT EXISTS kv_node_load_final AS SELECT * FROM kv_node_load FINAL;

-- Per node and minute with reports: the minute's latest report, as a whole (`latest`; a field that report
-- left out stays NULL rather than taking an older value), when it was sent (`load_ts`) and how many came.
CREATE VIEW IF NOT EXISTS kv_node_load_minute AS
SELECT
    toStartOfMinute(l.ts) AS minute,
    l.node_id AS node_id,
    -- the latest report as a whole (a tuple is never NULL, so argMax does not skip a report's NULL fields)
    argMax((l.running, l.waiting, l.kv_usage), (l.ts, l.kafka_offset)) AS latest,
    latest.1 AS running,
    latest.2 AS waiting,
    latest.3 AS kv_usage,
    max(l.ts) AS load_ts,
    count() AS load_reports
FROM kv_node_load_final AS l
GROUP BY minute, node_id;

-- kv_node_minute (004) with the node's load beside its rates: per node, group, medium and minute, the node's
-- latest load report at or before the end of the minute (the minute itself, or the last earlier minute with
-- a report: an ASOF join on kv_node_load_minute, so ties between reports are settled there by Kafka order);
-- NULL when the node had reported none by then.
CREATE OR REPLACE VIEW kv_node_minute AS
SELECT
    m.minute AS minute,
    m.node_id AS node_id,
    m.group_idx AS group_idx,
    m.medium AS medium,
    m.stored_blocks AS stored_blocks,
    m.removed_blocks AS removed_blocks,
    m.clears AS clears,
    m.events AS events,
    l.running AS running,
    l.waiting AS waiting,
    l.kv_usage AS kv_usage,
    if(l.node_id = '', NULL, l.load_ts) AS load_ts
FROM
(
    SELECT
        toStartOfMinute(e.ts) AS minute,
        e.node_id AS node_id,
        e.group_idx AS group_idx,
        e.medium AS medium,
        sumIf(e.num_blocks, e.kind = 'stored') AS stored_blocks,
        sumIf(e.num_blocks, e.kind = 'removed') AS removed_blocks,
        countIf(e.kind = 'cleared') AS clears,
        count() AS events
    FROM kv_events_final AS e
    GROUP BY minute, node_id, group_idx, medium
) AS m
ASOF LEFT JOIN kv_node_load_minute AS l ON m.node_id = l.node_id AND m.minute >= l.minute;
