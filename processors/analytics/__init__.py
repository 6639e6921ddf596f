"""The analytics app (`kvpipe analytics`): KV events and block lifetimes as rows in ClickHouse
(chDB or a server), analyst SQL. A Faust app of its own (`app` → `state` → `agents` → `views`,
`cli`), in its own consumer group, sharing no process with the routing app.

Owns: the row types and their mapping from envelopes (`rows`), the batching writer thread with
exactly-once semantics and read-only queries (`sink`), the numbered DDL migrations applied at start
(`migrations`, files in infra/clickhouse/migrations), the read-only SQL guard (`sqlguard`), the saved
capacity-planning queries (`saved`, files in infra/clickhouse/queries), re-stores and their LRU
stack distances (`restores`, `stackdist`) behind the capacity curve (`plan`), the HTML report with
matplotlib plots and a Jinja2 page (`report`, `report_page`), the Grafana dashboard generator
(`grafana`), the tables as data (`tables`), `kvpipe sql`'s output formats (`formats`), the HTTP answers as
Structs and the OpenAPI document (`answers`, `apidoc`). The demo-like workload for
tests and benchmarks is `kvpipe.bench.workload`.

May import: schemas, clickhouse-connect (chDB through its `chdb://` DSN), msgspec, jinja2, matplotlib
(`report`, lazily), the standard library. It reads infra/clickhouse's SQL files by path, never imports infra code. It builds on the
shared core (`kvpipe.processors.core`: the index, ingest, the lifetime row types); nothing else in
processors/ imports from here, and the analytics app never imports the routing app
(`kvpipe.processors.routing`).
"""
