-- The spec kind (full_attention, sliding_window, mamba, ...) of each node's KV cache group.
-- BlockStored events carry it (kv_cache_spec_kind) but BlockRemoved events do not, so queries that
-- split evictions by kind join this view on (node_id, group_idx). The latest non-empty kind wins.
CREATE VIEW IF NOT EXISTS kv_group_kinds AS
SELECT e.node_id AS node_id, e.group_idx AS group_idx, argMax(e.spec_kind, e.ts) AS group_kind
FROM kv_events_final AS e
WHERE e.spec_kind != '' AND e.group_idx >= 0
GROUP BY e.node_id, e.group_idx;
