-- title: Sliding-window vs full-attention evictions
-- Evicted blocks of sliding-window groups over those of full-attention groups, per medium.
-- A ratio far above the ratio of the groups' sizes means windows churn the pool.
SELECT
    e.medium AS medium,
    sumIf(e.num_blocks, k.group_kind IN ('sliding_window', 'sliding_window_mla')) AS swa_evicted,
    sumIf(e.num_blocks, k.group_kind IN ('full_attention', 'mla_attention')) AS fa_evicted,
    if(fa_evicted = 0, NULL, swa_evicted / fa_evicted) AS swa_fa_ratio
FROM kv_events_final AS e
INNER JOIN kv_group_kinds AS k ON e.node_id = k.node_id AND e.group_idx = k.group_idx
WHERE e.kind = 'removed'
GROUP BY medium
ORDER BY medium
