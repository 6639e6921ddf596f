"""The processing side: two Faust apps on the events topic, each its own consumer group.

Four parts, each a package (docs/architecture.md has the map):
- `core`: what both apps share, the in-memory index and everything that feeds it or keeps it:
  the index (`index`, pure, the hot path) and its block store (`slots`), per-message ingest
  (`ingest`, `ingestrun`, `outcomes`), block lifetimes (`lifetimes`), snapshots and restore
  (`snapshot`, `durability`, `rebalance`), batched and direct delivery from Faust
  (`batchdelivery`, `fastpath`), Kafka client settings (`kafkaconf`), HTTP bodies, errors and
  tokens (`httpbody`, `webauth`), and the shared CLI helpers (`appcli`, `remote`, `texttable`).
- `router`: token ids in, a chosen node out; pure logic over the core's index (`hma` feeds it
  to the hit rules, `serving` answers one worker's `/route` calls).
- `routing`: the routing app (`kvpipe processor`): app, topics, state, agents, views, metrics,
  cli, plus the `/nodes` logic (`api`), the scatter-gather across workers (`scatter`) and the
  native route server's wiring (`routeserve`).
- `analytics`: the analytics app (`kvpipe analytics`): rows in ClickHouse, analyst SQL.

Import rules (checked by the import-linter contracts in pyproject.toml): `core` imports neither
`router`, `routing` nor `analytics`; `router` imports `core` only; the routing app and the
analytics app never import each other. May import: schemas, faust (and aiokafka), prometheus_client,
clickhouse-connect (only under `analytics/`), and gpu's pure modules (`kvpipe.gpu.hit`,
`kvpipe.gpu.specs`, `kvpipe.gpu.hashing`; none imports torch). Nothing here imports producer, gpu
internals, infra or kvpipe's own modules (`kvpipe.cli`, `kvpipe.demo`, `kvpipe.bench`).
"""

if not __name__.startswith("kvpipe."):  # one module object per file (kvpipe/__init__.py)
    raise ImportError(f"import kvpipe.{__name__}, not {__name__}: the repository's top-level folders are "
                      "subpackages of kvpipe (kvpipe/__init__.py)")
