"""Local infrastructure for kvpipe: the things a pipeline needs around it, not the pipeline.

Owns:
- a local Apache Kafka broker (`infra.kafka`): jars resolved by Maven from `kafka/pom.xml` into a
  user cache, KRaft combined mode (broker + controller in one JVM) on loopback, state under
  `Settings.state_dir`; started and stopped by `kvpipe infra up|down|status`;
- topic provisioning (`infra.topics`): the events topic, its DLQ and the compacted index-snapshot
  topic, created idempotently through the admin API (the broker runs with
  `auto.create.topics.enable=false`, so a typo in a topic name fails loudly instead of creating one);
- `compose.yaml` for server deployments (Kafka, ClickHouse server, the processor);
- ClickHouse DDL migrations and saved queries (when they land under `infra/clickhouse/`).

May import: `schemas.settings` only — nothing else of ours. gpu/, producer/ and processors/
depend on a running broker, never on this package's code, so they can point at any cluster.
"""
