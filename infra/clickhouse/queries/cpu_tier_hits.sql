-- title: CPU-tier hit contribution: GPU stores served from the CPU tier instead of recomputed
-- vLLM reports no event for a cache hit, so this is the proxy the event stream allows: a GPU
-- BlockStored for a (node, epoch, group, hash) while the node's CPU tier still holds that hash is a
-- block the offload connector loaded back from CPU (it caches the loaded block on GPU, which emits
-- the store); a GPU store with no CPU copy was computed. Per node and group: GPU stores, those with
-- a live CPU copy, their share, and the tokens loaded instead of recomputed. A CPU-tier clear
-- (AllBlocksCleared) is not tracked per hash, so a store right after one may be over-counted.
-- How: the CPU tier's copies per (node, epoch, group, hash) are a running sum over the CPU events alone, and each
-- GPU store takes the sum of the latest CPU event before it (an ASOF join). Events are ordered as the analytics
-- app applied them: a node's events are on one Kafka partition, so by (kafka_offset, event_idx), packed in one
-- number (a message holds fewer than 2^24 events: it is at most 8 MiB). Windowing all events (GPU ones too,
-- summing only CPU ones) took ~20 s at 2.35 M events / 20 M hashes; this ~4 s (BENCHMARKS.md, analytics).
WITH
    cpu AS (
        SELECT node_id, epoch, group_idx, block_hash, kafka_offset * 16777216 + event_idx AS pos,
            sum(if(kind = 'stored', 1, -1)) OVER (
                PARTITION BY node_id, epoch, group_idx, block_hash ORDER BY pos
                ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cpu_copies
        FROM (SELECT node_id, epoch, group_idx, kind, kafka_offset, event_idx, arrayJoin(block_hashes) AS block_hash
              FROM kv_events_final
              WHERE medium = 'CPU' AND kind IN ('stored', 'removed'))
    ),
    gpu AS (
        SELECT node_id, epoch, group_idx, block_size, kafka_offset * 16777216 + event_idx AS pos,
            arrayJoin(block_hashes) AS block_hash
        FROM kv_events_final
        WHERE medium = 'GPU' AND kind = 'stored'
    )
SELECT
    g.node_id AS node_id,
    g.group_idx AS group_idx,
    count() AS gpu_stores,
    countIf(c.cpu_copies > 0) AS from_cpu,
    countIf(c.cpu_copies > 0) / count() AS cpu_share,
    sumIf(g.block_size, c.cpu_copies > 0) AS tokens_from_cpu
FROM gpu AS g
ASOF LEFT JOIN cpu AS c
    ON g.node_id = c.node_id AND g.epoch = c.epoch AND g.group_idx = c.group_idx AND g.block_hash = c.block_hash
        AND g.pos > c.pos
GROUP BY node_id, group_idx
ORDER BY node_id, group_idx
