"""The processing side: Kafka → live per-group cache index → route API, plus analytics.

Owns: the Faust app (`app`, `topics`, `agents`, `views`), the in-memory index (`index`, pure and
the hot path), per-message ingest (`ingest`), liveness (TTL expiry in `index`, driven by a timer in
`agents`), durability (`snapshot` records and `durability`: snapshots to a compacted topic,
restore + replay on assignment), the HTTP API's logic (`api`), the `kvpipe processor|route|sql`
commands (`cli`), the ingest benchmark (`bench`), and the ClickHouse analytics sink (`analytics`).
May import: schemas, faust (and aiokafka, which it runs on), clickhouse-connect, and gpu's pure hit
module once it exists. Nothing here imports producer, gpu internals, infra or kvpipe.
"""
