"""Local infrastructure for kvpipe: the things a pipeline needs around it, not the pipeline.

Owns:
- a local Apache Kafka broker (`kvpipe.infra.kafka`): jars resolved by Maven from `kafka/pom.xml` into a
  user cache, KRaft combined mode (broker + controller in one JVM) on loopback, state under
  `Settings.state_dir`; started and stopped by `kvpipe infra up|down|status`;
- topic provisioning (`kvpipe.infra.topics`): the events topic (LogAppendTime), its DLQ and the two
  compacted snapshot topics (routing app, analytics app), created idempotently through the admin
  API, their configs set on existing topics (the broker runs with `auto.create.topics.enable=false`,
  so a typo in a topic name fails loudly instead of creating one); docs/operations.md §2;
- `compose.yaml` for server deployments (Kafka, ClickHouse server, the routing app, the analytics
  app; each app image installs the base distribution only, no torch);
- ClickHouse DDL migrations and saved capacity-planning queries (`infra/clickhouse/migrations`,
  `infra/clickhouse/queries`), read by path by the analytics app.

May import: `kvpipe.schemas.settings` only — nothing else of ours. gpu/, producer/ and processors/
depend on a running broker, never on this package's code, so they can point at any cluster.
"""

if not __name__.startswith("kvpipe."):  # one module object per file (kvpipe/__init__.py)
    raise ImportError(f"import kvpipe.{__name__}, not {__name__}: the repository's top-level folders are "
                      "subpackages of kvpipe (kvpipe/__init__.py)")
