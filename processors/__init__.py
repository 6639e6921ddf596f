"""The processing side: two Faust apps on the events topic, each its own consumer group.

The routing app (`kvpipe processor`): Kafka → live per-group cache index → route API. It loads no
ClickHouse code. The analytics app (`kvpipe analytics`, in `analytics/`): the same pure index code →
rows in ClickHouse, analyst SQL.

Owns: the routing app (`app`, `topics`, `agents`, `views`), the in-memory index (`index`, pure and
the hot path), per-message ingest (`ingest`), liveness (TTL expiry in `index`, driven by a timer in
`agents`), durability (`snapshot` records and `durability`: snapshots to a compacted topic,
restore + replay on assignment), the HTTP API's logic (`api`, `routeapi`; `route_hma` feeds the index to the hit rules), the
scatter-gather across workers (`scatter`), Prometheus metrics (`metrics`), the token-id router
logic (`router`), the `kvpipe processor|route` commands (`cli`), and the analytics app (`analytics`). How they fit: docs/architecture.md.
May import: schemas, faust (and aiokafka, which it runs on), prometheus_client, clickhouse-connect
(only under `analytics/`, never from the routing app's modules), and gpu's pure modules (`kvpipe.gpu.hit`,
`kvpipe.gpu.specs`, `kvpipe.gpu.hashing`; none imports torch). Nothing here imports producer, gpu internals,
infra or kvpipe's own modules (`kvpipe.cli`, `kvpipe.demo`, `kvpipe.bench`).
"""

if not __name__.startswith("kvpipe."):  # one module object per file (kvpipe/__init__.py)
    raise ImportError(f"import kvpipe.{__name__}, not {__name__}: the repository's top-level folders are "
                      "subpackages of kvpipe (kvpipe/__init__.py)")
