-- title: Per-node occupancy over time
-- Cached blocks per node, epoch, group and medium at the end of each time bucket: blocks stored
-- minus blocks removed, cumulative in (seq, event) order. AllBlocksCleared carries no medium; vLLM
-- emits it from the GPU pool's reset (the offloading connector's reset emits nothing for CPU), so it
-- resets GPU occupancy only. A bucket without events for a series has no row (the value holds).
-- param: bucket_s UInt32 = 60
WITH
    numbered AS (
        SELECT node_id, epoch, seq, event_idx, ts, group_idx, medium, kind, num_blocks,
            -- resets seen so far on this node: the GPU series restarts from 0 after each
            sum(kind = 'cleared') OVER (PARTITION BY node_id, epoch ORDER BY seq, event_idx
                                        ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS resets
        FROM kv_events_final
    ),
    running AS (
        SELECT node_id, epoch, group_idx, medium, ts, seq, event_idx,
            sum(if(kind = 'stored', toInt64(num_blocks), -toInt64(num_blocks)))
                OVER (PARTITION BY node_id, epoch, group_idx, medium, if(medium = 'GPU', resets, 0)
                      ORDER BY seq, event_idx ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS blocks
        FROM numbered
        WHERE kind != 'cleared'
    ),
    -- a reset is a point at 0 for every GPU series the node had, so the drop shows in its bucket
    clears AS (
        SELECT c.node_id AS node_id, c.epoch AS epoch, g.group_idx AS group_idx, g.medium AS medium,
            c.ts AS ts, c.seq AS seq, c.event_idx AS event_idx, toInt64(0) AS blocks
        FROM (SELECT node_id, epoch, ts, seq, event_idx FROM kv_events_final WHERE kind = 'cleared') AS c
        INNER JOIN (SELECT DISTINCT node_id, epoch, group_idx, medium FROM kv_events_final
                    WHERE kind = 'stored' AND medium = 'GPU') AS g
            ON c.node_id = g.node_id AND c.epoch = g.epoch
    )
SELECT
    toDateTime64(toStartOfInterval(ts, toIntervalSecond({bucket_s:UInt32})), 0, 'UTC') AS bucket,
    node_id, epoch, group_idx, medium,
    argMax(blocks, (seq, event_idx)) AS cached_blocks
FROM (SELECT * FROM running UNION ALL SELECT * FROM clears)
GROUP BY bucket, node_id, epoch, group_idx, medium
ORDER BY node_id, epoch, group_idx, medium, bucket
