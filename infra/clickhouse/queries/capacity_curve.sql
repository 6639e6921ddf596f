-- title: Capacity curve: re-stores a bigger (or smaller) cache would have turned into hits
-- Per node, group kind and medium (GPU, and the CPU tier): for cache sizes capacity x (1 + f) over the
-- sweep f, the re-stores whose LRU stack distance is below the size (an LRU cache that large would
-- still have held the block), their fraction, and the recompute saved in tokens (hits x block size).
-- capacity = the most blocks the slot held at a re-store, plus the re-stored block (the observed pool).
-- Distances are computed by the analytics app as it consumes (processors/analytics/restores.py,
-- which states the method and what it does not model; `kvpipe plan` prints it).
-- One pass over the re-stores: each slot's distances as an array, then every cache size counted from it
-- (faster than grouping by distance first: 10 M re-stores in ~0.9 s). Memory is ~12 bytes per re-store
-- read, so past ~80 M re-stores in one call the 1 GiB analyst limit is reached: filter by node or kind.
-- param: node String =
-- param: group_kind String =
-- param: extra String = -0.5,-0.25,0,0.25,0.5,1,2,4
WITH
    slots AS (
        SELECT node_id, group_kind, medium, max(held_blocks) + 1 AS capacity, count() AS restores,
            groupArray(stack_distance) AS ds, groupArray(block_size) AS bs, min(block_size) AS bs_min,
            max(block_size) AS bs_max
        FROM kv_restores_final
        WHERE ({node:String} = '' OR node_id = {node:String})
            AND ({group_kind:String} = '' OR group_kind = {group_kind:String})
        GROUP BY node_id, group_kind, medium
    ),
    curves AS (
        SELECT node_id, group_kind, medium, capacity, restores, bs_min, bs_max,
            arrayMap(v -> toFloat64OrZero(v), splitByChar(',', {extra:String})) AS fs,
            arrayMap(f -> toInt64(round(capacity * f)), fs) AS extras,
            arrayMap(x -> greatest(toInt64(0), toInt64(capacity) + x), extras) AS sizes,
            arrayMap(c -> arrayCount(x -> x < c, ds), sizes) AS hit_counts,
            -- a group has one block size, so tokens are hits x that size; the per-block sum only when sizes
            -- differ (ClickHouse evaluates an `if` branch only for the rows that take it: ~20 % of the query at 10 M)
            if(bs_min = bs_max, arrayMap(h -> h * bs_min, hit_counts),
               arrayMap(c -> arraySum(arrayMap((x, b) -> if(x < c, b, 0), ds, bs)), sizes)) AS saved
        FROM slots
    )
SELECT node_id, group_kind, medium, capacity, restores, f AS extra_fraction, e AS extra_blocks, c AS cache_blocks,
    h AS hits, h / restores AS hit_fraction, t AS tokens_saved
FROM curves
ARRAY JOIN fs AS f, extras AS e, sizes AS c, hit_counts AS h, saved AS t
ORDER BY node_id, group_kind, medium, extra_fraction
