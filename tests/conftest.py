"""Shared fixtures: the real Kafka broker and throwaway topics on it.

Integration tests never skip: a missing broker is a failed run with instructions, because a
skipped integration suite looks green and proves nothing.
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest
from hypothesis import settings as hypothesis_settings

from kvpipe.schemas.settings import load_settings
from tests.integration.kafka_reading import client_config

# CI (`CI=true`) runs every property test on hypothesis's fixed, per-test seed: a submission is
# judged by the same examples each time. Developers' runs keep exploring new examples (and keep
# the failures they find in the local example database).
hypothesis_settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("ci")


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """`host:port` of the broker from the settings (default: the local one on 127.0.0.1:19092)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    bootstrap = load_settings().bootstrap()
    try:
        AdminClient(client_config(bootstrap)).list_topics(timeout=10)
    except KafkaException as exc:
        pytest.fail(
            f"no Kafka broker answers at {bootstrap} ({exc}). Integration tests need the real broker: "
            "run them with `make test`, or start it with `kvpipe infra up` (or point KVPIPE_KAFKA_BOOTSTRAP at one).",
            pytrace=False,
        )
    return bootstrap


@pytest.fixture
def unique_topic(kafka_bootstrap: str) -> Iterator[Callable[..., str]]:
    """Factory: `unique_topic("what", partitions=1)` creates a fresh topic and returns its name;
    every topic it created is deleted when the test ends."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(client_config(kafka_bootstrap))
    created: list[str] = []

    def make(prefix: str = "test", partitions: int = 1, config: dict[str, str] | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        future = admin.create_topics([NewTopic(name, partitions, 1, config=config or {})], operation_timeout=30)[name]
        future.result(timeout=30)
        created.append(name)
        return name

    yield make
    if created:
        for future in admin.delete_topics(created, operation_timeout=30).values():
            try:
                future.result(timeout=30)
            except Exception:  # cleanup only; a leftover test topic is harmless
                pass
