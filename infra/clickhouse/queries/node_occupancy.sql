-- title: Per-node occupancy and load over time
-- Cached blocks per node, epoch, group and medium at the end of each time bucket, with the node's load beside
-- them: `running`, `waiting` (requests) and `kv_usage` (the fraction of KV blocks in use, as the node reports
-- it) from its latest load report at or before the end of the bucket (kv_node_load; a report is whole: a field
-- it left out is NULL); NULL when the node had reported no load by then. Blocks: stored
-- minus blocks removed, cumulative in (seq, event) order. AllBlocksCleared carries no medium; vLLM
-- emits it from the GPU pool's reset (the offloading connector's reset emits nothing for CPU), so it
-- resets GPU occupancy only. A bucket without events for a series has no row (the value holds).
-- Computed per bucket, not per event: each series' blocks change is summed per bucket and reset segment,
-- then accumulated over buckets, so only one small window runs (the events are read once, in key order).
-- The segment of an event is the number of resets before it (an ASOF join on the node's few clears).
-- This equals a per-event running sum in (seq, event) order as long as a node's batch timestamps do not go
-- backwards within an epoch.
-- param: bucket_s UInt32 = 60
WITH
    clears AS (
        SELECT node_id, epoch, ts, seq, event_idx, seq * 1048576 + event_idx AS pos,
            row_number() OVER (PARTITION BY node_id, epoch ORDER BY seq, event_idx) AS resets
        FROM kv_events_final
        WHERE kind = 'cleared'
    ),
    deltas AS (
        SELECT e.node_id AS node_id, e.epoch AS epoch, e.group_idx AS group_idx, e.medium AS medium,
            if(e.medium = 'GPU', c.resets, 0) AS segment,
            toStartOfInterval(e.ts, toIntervalSecond({bucket_s:UInt32})) AS bucket,
            sum(if(e.kind = 'stored', toInt64(e.num_blocks), -toInt64(e.num_blocks))) AS delta,
            max((e.seq, e.event_idx)) AS last
        FROM kv_events_final AS e
        ASOF LEFT JOIN clears AS c
            ON e.node_id = c.node_id AND e.epoch = c.epoch AND e.seq * 1048576 + e.event_idx > c.pos
        WHERE e.kind != 'cleared'
        GROUP BY node_id, epoch, group_idx, medium, segment, bucket
    ),
    running AS (
        SELECT node_id, epoch, group_idx, medium, bucket, last,
            sum(delta) OVER (PARTITION BY node_id, epoch, group_idx, medium, segment ORDER BY bucket
                             ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS blocks
        FROM deltas
    ),
    resets AS (
        SELECT c.node_id AS node_id, c.epoch AS epoch, g.group_idx AS group_idx, g.medium AS medium,
            toStartOfInterval(c.ts, toIntervalSecond({bucket_s:UInt32})) AS bucket,
            (c.seq, c.event_idx) AS last, toInt64(0) AS blocks
        FROM clears AS c
        INNER JOIN (SELECT DISTINCT node_id, epoch, group_idx, medium FROM kv_events_final
                    WHERE kind = 'stored' AND medium = 'GPU') AS g
            ON c.node_id = g.node_id AND c.epoch = g.epoch
    ),
    occupancy AS (
        SELECT bucket, node_id, epoch, group_idx, medium, argMax(blocks, last) AS cached_blocks
        FROM (SELECT * FROM running UNION ALL SELECT * FROM resets)
        GROUP BY bucket, node_id, epoch, group_idx, medium
    ),
    -- per node and bucket, its latest report (ties in time settled by Kafka order), then carried forward
    -- to later buckets by the ASOF join below
    loads AS (
        SELECT node_id, toStartOfInterval(ts, toIntervalSecond({bucket_s:UInt32})) AS bucket,
            argMax((running, waiting, kv_usage), (ts, kafka_offset)) AS latest
        FROM kv_node_load_final
        GROUP BY node_id, bucket
    )
SELECT
    toDateTime64(o.bucket, 0, 'UTC') AS bucket,
    o.node_id AS node_id, o.epoch AS epoch, o.group_idx AS group_idx, o.medium AS medium,
    o.cached_blocks AS cached_blocks,
    if(l.node_id = '', NULL, tupleElement(l.latest, 1)) AS running,
    if(l.node_id = '', NULL, tupleElement(l.latest, 2)) AS waiting,
    if(l.node_id = '', NULL, tupleElement(l.latest, 3)) AS kv_usage
FROM occupancy AS o
ASOF LEFT JOIN loads AS l ON o.node_id = l.node_id AND o.bucket >= l.bucket
ORDER BY node_id, epoch, group_idx, medium, bucket
