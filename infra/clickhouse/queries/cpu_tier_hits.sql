-- title: CPU-tier hit contribution: GPU stores served from the CPU tier instead of recomputed
-- vLLM reports no event for a cache hit, so this is the proxy the event stream allows: a GPU
-- BlockStored for a (node, epoch, group, hash) while the node's CPU tier still holds that hash is a
-- block the offload connector loaded back from CPU (it caches the loaded block on GPU, which emits
-- the store); a GPU store with no CPU copy was computed. Per node and group: GPU stores, those with
-- a live CPU copy, their share, and the tokens loaded instead of recomputed. A CPU-tier clear
-- (AllBlocksCleared) is not tracked per hash, so a store right after one may be over-counted.
-- How: the analytics app counts, as it writes each GPU store, its hashes with a live CPU copy (`from_cpu_blocks`,
-- migration 006; processors/analytics/cputier.py), so the answer is a sum over the GPU stores. Rows without that
-- count (written before migration 006, or with KVPIPE_ANALYTICS_CAPACITY=false) are counted here the old way, for
-- their (node, epoch) only: the CPU tier's copies per (node, epoch, group, hash) as a running sum over its
-- events, and each GPU store's hash the sum of the latest CPU event before it (an ASOF join), in the order the app
-- applied them: a node's events are on one Kafka partition, so by (kafka_offset, event_idx), packed in one number
-- (a message holds fewer than 2^24 events: it is at most 8 MiB). `uncounted` says whether any such row exists, from
-- the raw table (a few ms): when none does, the old way reads nothing. At 10 M lifetimes ~0.2 s instead of ~4 s
-- (BENCHMARKS.md, analytics).
WITH
    (SELECT count() > 0 FROM (SELECT 1 FROM kv_events
                              WHERE kind = 'stored' AND medium = 'GPU' AND from_cpu_blocks IS NULL LIMIT 1)) AS uncounted,
    old_gpu AS (
        SELECT node_id, epoch, group_idx, block_size, kafka_offset * 16777216 + event_idx AS pos, block_hashes
        FROM kv_events_final
        WHERE uncounted AND medium = 'GPU' AND kind = 'stored' AND from_cpu_blocks IS NULL
    ),
    old_cpu AS (
        SELECT node_id, epoch, group_idx, block_hash, kafka_offset * 16777216 + event_idx AS pos,
            sum(if(kind = 'stored', 1, -1)) OVER (
                PARTITION BY node_id, epoch, group_idx, block_hash ORDER BY pos
                ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cpu_copies
        FROM (SELECT node_id, epoch, group_idx, kind, kafka_offset, event_idx, arrayJoin(block_hashes) AS block_hash
              FROM kv_events_final
              WHERE uncounted AND medium = 'CPU' AND kind IN ('stored', 'removed')
                  AND (node_id, epoch) IN (SELECT node_id, epoch FROM old_gpu))
    ),
    old_hashes AS (
        SELECT node_id, epoch, group_idx, block_size, pos, arrayJoin(block_hashes) AS block_hash FROM old_gpu
    )
SELECT
    node_id,
    group_idx,
    sum(stores) AS gpu_stores,
    sum(loaded) AS from_cpu,
    from_cpu / gpu_stores AS cpu_share,
    sum(tokens) AS tokens_from_cpu
FROM
(
    SELECT node_id, group_idx, toUInt64(num_blocks) AS stores, toUInt64(assumeNotNull(from_cpu_blocks)) AS loaded,
        loaded * block_size AS tokens
    FROM kv_events_final
    WHERE medium = 'GPU' AND kind = 'stored' AND from_cpu_blocks IS NOT NULL
    UNION ALL
    SELECT g.node_id AS node_id, g.group_idx AS group_idx, toUInt64(1) AS stores, toUInt64(c.cpu_copies > 0) AS loaded,
        if(c.cpu_copies > 0, toUInt64(g.block_size), 0) AS tokens
    FROM old_hashes AS g
    ASOF LEFT JOIN old_cpu AS c
        ON g.node_id = c.node_id AND g.epoch = c.epoch AND g.group_idx = c.group_idx AND g.block_hash = c.block_hash
            AND g.pos > c.pos
)
GROUP BY node_id, group_idx
ORDER BY node_id, group_idx
