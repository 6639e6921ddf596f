-- title: Evictions per group over time
-- Blocks removed (BlockRemoved) per time bucket, KV cache group, spec kind and medium.
-- param: bucket_s UInt32 = 60
SELECT
    toDateTime64(toStartOfInterval(e.ts, toIntervalSecond({bucket_s:UInt32})), 0, 'UTC') AS bucket,
    e.group_idx AS group_idx,
    if(e.spec_kind != '', e.spec_kind, k.group_kind) AS group_kind,
    e.medium AS medium,
    sum(e.num_blocks) AS evicted_blocks
FROM kv_events_final AS e
LEFT JOIN kv_group_kinds AS k ON e.node_id = k.node_id AND e.group_idx = k.group_idx
WHERE e.kind = 'removed'
GROUP BY bucket, group_idx, group_kind, medium
ORDER BY bucket, group_idx, medium
