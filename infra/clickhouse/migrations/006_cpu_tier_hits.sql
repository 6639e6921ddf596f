-- CPU-tier hits counted when the event is written (saved query cpu_tier_hits).
--
-- `from_cpu_blocks`: of a GPU BlockStored's block hashes, how many the node's CPU tier held at that moment (a
-- running count of the CPU tier's stores minus its removals per (node, epoch, group, hash), in the order the
-- analytics app applies events: processors/analytics/cputier.py). 0 on every other event. The app knows this as it
-- writes, while SQL has to rebuild it with a window over every CPU event and an ASOF join of every GPU store
-- (~4 s at 10 M lifetimes, BENCHMARKS.md, analytics); with the column the query is one GROUP BY.
-- NULL: not counted — rows written before this migration, and rows of a writer that does not track the CPU tier
-- (KVPIPE_ANALYTICS_CAPACITY=false). The query computes those the old way, so it stays right for any mix of them.
-- Exactly once: a replayed message gets the same value (the app rebuilds the counts for its restored offset from
-- the rows up to it), so the ReplacingMergeTree copies agree and whichever FINAL keeps is right.
ALTER TABLE kv_events ADD COLUMN IF NOT EXISTS from_cpu_blocks Nullable(UInt32);
-- A view's columns are fixed when it is created: re-create the FINAL view so it shows the new column.
CREATE OR REPLACE VIEW kv_events_final AS SELECT * FROM kv_events FINAL;
