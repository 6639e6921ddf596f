"""Topic provisioning through the Kafka admin API, idempotent.

The broker runs with auto-creation off, so every topic kvpipe uses is declared here (Faust's own
internal topics excepted: Faust creates those itself through the same admin API). Existing topics
are checked, never altered: a partition count that differs from the spec is an error, because
growing it would move keys (= nodes) to other partitions and break per-node ordering, and
shrinking is impossible. The user decides (delete the topic, or use the existing count).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from tenacity import retry_if_exception_type, stop_after_delay

from kvpipe.infra.errors import InfraError
from kvpipe.schemas import retrying

T = TypeVar("T")


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: Mapping[str, str] = field(default_factory=dict)
    replication: int = 1


def default_specs(events_topic: str, dlq_topic: str, snapshot_topic: str, partitions: int,
                  analytics_snapshot_topic: str | None = None, replication: int = 1) -> list[TopicSpec]:
    """kvpipe's topics: events (key = node_id), the DLQ, and the snapshots of each app's index (the
    routing app's, and the analytics app's, which also mark how far its rows are acknowledged).
    Snapshots are keyed by events partition and compacted (only the newest snapshot per key
    matters), with as many partitions as the events topic so snapshot partition i can follow
    events partition i. Events carry the broker's append time (LogAppendTime): the processors
    bound node timestamps by it, a clock no node can move and a replay sees unchanged
    (processors/core/ingest.py).

    `replication` > 1 (a cluster): each topic on that many nodes and `min.insync.replicas` 2, so
    an acks=all write (producer/config.py) is on two nodes before it is acknowledged and the loss
    of any one node loses nothing acknowledged."""
    isr = {"min.insync.replicas": str(min(replication, 2))} if replication > 1 else {}
    specs = [
        TopicSpec(events_topic, partitions, {"message.timestamp.type": "LogAppendTime", **isr}, replication),
        TopicSpec(dlq_topic, 1, isr, replication),
        TopicSpec(snapshot_topic, partitions, {"cleanup.policy": "compact", **isr}, replication),
    ]
    if analytics_snapshot_topic:
        specs.append(TopicSpec(analytics_snapshot_topic, partitions, {"cleanup.policy": "compact", **isr}, replication))
    return specs


def _admin(bootstrap: str):  # -> confluent_kafka.admin.AdminClient (lazy import keeps --help fast)
    from confluent_kafka.admin import AdminClient

    from kvpipe.schemas.logsetup import librdkafka_logging
    from kvpipe.schemas.settings import load_settings

    # TLS/SASL from the settings (docs/security.md), the same for every cluster this process talks to
    settings = load_settings()
    return AdminClient({**settings.kafka_confluent_security(), "bootstrap.servers": bootstrap,
                        **librdkafka_logging(settings.log_format)})


def list_topics(bootstrap: str, timeout: float = 10.0, internal: bool = False) -> dict[str, int]:
    """Topic name → partition count; internal (`__…`) topics only if asked for."""
    from confluent_kafka import KafkaException

    try:
        md = _admin(bootstrap).list_topics(timeout=timeout)
    except KafkaException as e:
        raise InfraError(f"Kafka at {bootstrap} did not answer a metadata request within {timeout:.0f} s: {e}") from e
    return {name: len(t.partitions) for name, t in sorted(md.topics.items())
            if internal or not name.startswith("__")}


def _until_settled(once: Callable[[], T], timeout: float) -> T:
    """`once()` again while it raises `_Settling` (kvpipe's retry policy, schemas/retrying.py), for at most
    `timeout` s; then its last reason as an InfraError."""
    try:
        for attempt in retrying.retrying(first_s=0.25, max_s=2.0, stop=stop_after_delay(timeout), reraise=True,
                                         retry=retry_if_exception_type(_Settling)):
            with attempt:
                return once()
    except _Settling as e:
        raise InfraError(str(e)) from e
    raise AssertionError("unreachable: tenacity either returns or raises")


def _describe_configs(admin, specs: list[TopicSpec], timeout: float) -> list[dict]:
    """Each topic's config entries. A topic just created (or created by a round whose answer was lost) may
    not be known yet to the broker that answers: `UNKNOWN_TOPIC_OR_PART` until its metadata catches up with
    the controller. That and the other answers of a settling cluster go again, within `timeout`."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import ConfigResource, ResourceType

    def once() -> list[dict]:
        futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, s.name) for s in specs])
        try:
            return [fut.result(timeout=timeout) for fut in futures.values()]
        except KafkaException as e:
            err = e.args[0]
            if err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART or _settling(err):
                raise _Settling(f"describing topic configs failed: {err.str()}") from e
            raise

    return _until_settled(once, timeout)


def _listed(admin, names: list[str], timeout: float) -> dict[str, int]:
    """Partition counts from the metadata, once it lists every topic in `names` (topics a create answered
    "already exists" for). On a cluster still settling, a create whose answer was lost reads "exists" on its
    retry before the broker answering metadata knows the topic (not listed, or listed with an error): that goes
    again within `timeout`, as creating does."""
    def once() -> dict[str, int]:
        topics = admin.list_topics(timeout=timeout).topics
        unknown = [n for n in names if n not in topics or getattr(topics[n], "error", None) is not None
                   or not topics[n].partitions]
        if unknown:
            raise _Settling(f"topics {unknown} exist (their create said so) but the metadata does not list them yet")
        return {n: len(t.partitions) for n, t in topics.items()}

    return _until_settled(once, timeout)


def _align_configs(admin, specs: list[TopicSpec], timeout: float) -> tuple[list[str], list[str]]:
    """Set the configs kvpipe needs on existing topics (every key here is one Kafka lets you change
    on a live topic). Returns `(altered topic names, problems)`: a change the cluster refuses (ACLs,
    say) is a problem that names the command to run by hand."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

    wanted = [s for s in specs if s.config]
    if not wanted:
        return [], []
    altered, problems = [], []
    for spec, entries in zip(wanted, _describe_configs(admin, wanted, timeout)):
        wrong = {k: v for k, v in spec.config.items() if (entries[k].value if k in entries else None) != v}
        if not wrong:
            continue
        change = ConfigResource(ResourceType.TOPIC, spec.name, incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in wrong.items()])
        try:
            for f in admin.incremental_alter_configs([change]).values():
                f.result(timeout=timeout)
            altered.append(spec.name)
        except KafkaException as e:
            settings = ",".join(f"{k}={v}" for k, v in wrong.items())
            problems.append(f"topic {spec.name!r} needs {settings} and the cluster refused the change "
                            f"({e.args[0].str()}); run: kafka-configs --alter --entity-type topics "
                            f"--entity-name {spec.name} --add-config {settings}")
    return altered, problems


class _Settling(Exception):
    """Some topics were refused by a cluster still coming up: worth another round."""


def _settling(err) -> bool:
    """True for the errors a cluster that is still coming up answers: worth another try."""
    from confluent_kafka import KafkaError

    return err.retriable() or err.code() in (
        KafkaError._DESTROY, KafkaError._DESTROY_BROKER, KafkaError._TRANSPORT, KafkaError._TIMED_OUT,
        KafkaError._ALL_BROKERS_DOWN, KafkaError.NOT_CONTROLLER, KafkaError.REQUEST_TIMED_OUT,
        KafkaError.INVALID_REPLICATION_FACTOR)


def ensure_topics(bootstrap: str, specs: Iterable[TopicSpec], timeout: float = 30.0) -> dict[str, str]:
    """Create missing topics; verify existing ones and set the configs kvpipe needs on them.
    Returns name → "created" | "exists" | "configured".

    Raises InfraError listing *every* problem (partition count, configs the cluster refuses to
    change) at once, so one run shows the user everything to fix.
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import NewTopic

    specs = list(specs)
    admin = _admin(bootstrap)
    try:
        existing = {n: len(t.partitions) for n, t in admin.list_topics(timeout=timeout).topics.items()}
    except KafkaException as e:
        raise InfraError(f"Kafka at {bootstrap} is not reachable: {e}") from e
    result: dict[str, str] = {}
    missing = [s for s in specs if s.name not in existing]

    def create() -> None:
        """One round over the topics still missing; those a settling cluster refused stay missing (`_Settling`)."""
        nonlocal admin, missing
        futures = admin.create_topics(
            [NewTopic(s.name, num_partitions=s.partitions, replication_factor=s.replication, config=dict(s.config))
             for s in missing], operation_timeout=timeout, request_timeout=timeout)
        by_name, again, last = {s.name: s for s in missing}, [], None
        for name, fut in futures.items():
            try:
                fut.result(timeout=timeout)
                result[name] = "created"
            except KafkaException as e:
                err = e.args[0]
                if err.code() == KafkaError.TOPIC_ALREADY_EXISTS:  # lost a race with another `up`: fine
                    result[name] = "exists"
                elif _settling(err):
                    again.append(by_name[name])
                    last = f"creating topic {name!r} on {bootstrap} failed: {err.str()}"
                else:
                    raise InfraError(f"creating topic {name!r} on {bootstrap} failed: {err.str()}") from e
        missing = again
        if again:
            # A cluster that has just come up can drop the admin's connection while its controller settles, or
            # refuse a replication factor until every node has registered: the rest go again on a fresh client
            # (creating is idempotent: a repeat reads "already exists").
            admin = _admin(bootstrap)
            raise _Settling(last)

    # kvpipe's retry policy (schemas/retrying.py): jittered, so the admins of several `up`s do not come back in step
    if missing:
        _until_settled(create, timeout)
    raced = [name for name, v in result.items() if v == "exists"]
    if raced:
        existing.update(_listed(admin, raced, timeout))
    problems = []
    for s in specs:
        if result.get(s.name) == "created":
            continue
        result[s.name] = "exists"
        if existing.get(s.name) != s.partitions:
            problems.append(f"topic {s.name!r} exists with {existing.get(s.name)} partitions, kvpipe is configured "
                            f"for {s.partitions}; either set KVPIPE_PARTITIONS={existing.get(s.name)} "
                            f"(or `kvpipe infra up --partitions {existing.get(s.name)}`), or delete the topic "
                            f"(local broker: `kvpipe infra down --purge` deletes all data)")
    altered, refused = _align_configs(admin, [s for s in specs if result[s.name] == "exists"], timeout)
    result.update({name: "configured" for name in altered})
    problems += refused
    if problems:
        raise InfraError("topic check failed:\n  " + "\n  ".join(problems))
    return result


def delete_topics(bootstrap: str, names: Iterable[str], timeout: float = 30.0) -> None:
    """For tests that create uniquely named topics and clean up after themselves."""
    admin = _admin(bootstrap)  # keep a reference: futures fail with _DESTROY once the client is collected
    for fut in admin.delete_topics(list(names), operation_timeout=timeout).values():
        fut.result(timeout=timeout)
