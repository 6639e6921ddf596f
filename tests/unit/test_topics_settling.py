"""`kvpipe.infra.topics.ensure_topics` on a cluster still coming up: the topics it refuses with a settling error go again,
on a fresh admin client, after the retry policy's jittered waits (schemas/retrying.py), until created or the
timeout; any other error ends it at once. A fake admin stands in for the cluster's answers (the real cluster's
settling is exercised by tests/fault's 3-node test)."""
from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException

from kvpipe.infra import topics
from kvpipe.infra.errors import InfraError


class _Admin:
    def __init__(self, script: list[dict[str, int | None]], created: list[list[str]]) -> None:
        self.script, self.created = script, created

    existing: dict = {}

    def list_topics(self, timeout: float) -> SimpleNamespace:
        return SimpleNamespace(topics=self.existing)

    def create_topics(self, new, operation_timeout: float, request_timeout: float) -> dict[str, Future]:
        answers = self.script.pop(0)
        self.created.append([t.topic for t in new])
        out = {}
        for t in new:
            f: Future = Future()
            code = answers.get(t.topic)
            if code is None:
                f.set_result(None)
            else:
                f.set_exception(KafkaException(KafkaError(code)))
            out[t.topic] = f
        return out


def _run(monkeypatch, script, timeout=5.0):
    created: list[list[str]] = []
    admins: list[_Admin] = []

    def admin(_bootstrap):
        a = _Admin(script, created)
        admins.append(a)
        return a

    monkeypatch.setattr(topics, "_admin", admin)
    monkeypatch.setattr(topics, "_align_configs", lambda *a, **k: ([], []), raising=False)
    specs = [topics.TopicSpec("a", 1), topics.TopicSpec("b", 1)]
    return topics.ensure_topics("x:1", specs, timeout=timeout), created, admins


def test_refused_topics_go_again_on_a_fresh_client_until_created(monkeypatch):
    settle = KafkaError.INVALID_REPLICATION_FACTOR
    result, created, admins = _run(monkeypatch, [{"b": settle}, {"b": settle}, {}])
    assert result == {"a": "created", "b": "created"}
    assert created == [["a", "b"], ["b"], ["b"]] and len(admins) == 3  # one fresh client per round


def test_other_errors_end_it_at_once_and_settling_ends_at_the_timeout(monkeypatch):
    with pytest.raises(InfraError, match="'b'"):
        _run(monkeypatch, [{"b": KafkaError.POLICY_VIOLATION}])
    never = [{"b": KafkaError.NOT_CONTROLLER}] * 100
    with pytest.raises(InfraError, match="creating topic 'b'"):
        _run(monkeypatch, never, timeout=0.6)


def test_nothing_missing_creates_nothing(monkeypatch):
    monkeypatch.setattr(_Admin, "existing", {"a": SimpleNamespace(partitions=[0]), "b": SimpleNamespace(partitions=[0])})
    result, created, _ = _run(monkeypatch, [])
    assert result == {"a": "exists", "b": "exists"} and created == []


class _DescribeAdmin:
    """Answers `describe_configs` from a script: one dict per round, topic → error code (None: its entries)."""

    def __init__(self, script: list[dict[str, int | None]]) -> None:
        self.script, self.rounds = script, 0

    def describe_configs(self, resources) -> dict[str, Future]:
        answers, self.rounds = self.script.pop(0), self.rounds + 1
        out = {}
        for r in resources:
            f: Future = Future()
            code = answers.get(r.name)
            if code is None:
                f.set_result({"cleanup.policy": SimpleNamespace(value="compact")})
            else:
                f.set_exception(KafkaException(KafkaError(code)))
            out[r.name] = f
        return out


def test_describe_goes_again_while_a_broker_does_not_know_a_new_topic():
    # Found in a 3-node fault run: a topic whose create answer was lost reads "exists", and the broker asked
    # for its configs had not caught up with the controller yet.
    unknown = KafkaError.UNKNOWN_TOPIC_OR_PART
    admin = _DescribeAdmin([{"b": unknown}, {"b": unknown}, {}])
    specs = [topics.TopicSpec("a", 1, {"cleanup.policy": "compact"}), topics.TopicSpec("b", 1, {"cleanup.policy": "compact"})]
    assert topics._align_configs(admin, specs, timeout=5.0) == ([], [])
    assert admin.rounds == 3


def test_describe_ends_at_the_timeout_or_at_once_on_other_errors():
    specs = [topics.TopicSpec("b", 1, {"cleanup.policy": "compact"})]
    with pytest.raises(InfraError, match="describing topic configs"):
        topics._align_configs(_DescribeAdmin([{"b": KafkaError.UNKNOWN_TOPIC_OR_PART}] * 100), specs, timeout=0.6)
    admin = _DescribeAdmin([{"b": KafkaError.TOPIC_AUTHORIZATION_FAILED}] * 100)
    with pytest.raises(KafkaException):
        topics._align_configs(admin, specs, timeout=5.0)
    assert admin.rounds == 1


class _LateMetadataAdmin(_Admin):
    """Create answers "already exists" (the round whose answer was lost made the topics), and the metadata lists
    them only from the `known_from`-th `list_topics` call on (the broker asked has not caught up yet)."""

    def __init__(self, script, created, known_from: int) -> None:
        super().__init__(script, created)
        self.lists, self.known_from = 0, known_from

    def list_topics(self, timeout: float) -> SimpleNamespace:
        self.lists += 1
        known = self.lists >= self.known_from
        return SimpleNamespace(topics={n: SimpleNamespace(partitions=[0], error=None) for n in ("a", "b")} if known
                               else {})


def _run_late(monkeypatch, known_from: int, timeout: float):
    exists = KafkaError.TOPIC_ALREADY_EXISTS
    admins: list[_LateMetadataAdmin] = []

    def admin(_bootstrap):
        a = _LateMetadataAdmin([{"a": exists, "b": exists}], [], known_from)
        admins.append(a)
        return a

    monkeypatch.setattr(topics, "_admin", admin)
    monkeypatch.setattr(topics, "_align_configs", lambda *a, **k: ([], []), raising=False)
    specs = [topics.TopicSpec("a", 1), topics.TopicSpec("b", 1)]
    return topics.ensure_topics("x:1", specs, timeout=timeout), admins


def test_topics_a_create_says_exist_are_read_again_until_the_metadata_lists_them(monkeypatch):
    # Found in a 3-node fault run: every create answered "already exists" and the metadata read right after
    # listed none of them, which was reported as "exists with None partitions".
    result, admins = _run_late(monkeypatch, known_from=4, timeout=5.0)
    assert result == {"a": "exists", "b": "exists"}
    assert admins[0].lists == 4  # the first read (before creating), two while settling, then listed


def test_topics_the_metadata_never_lists_end_at_the_timeout_with_a_clear_error(monkeypatch):
    with pytest.raises(InfraError, match="metadata does not list them yet"):
        _run_late(monkeypatch, known_from=10_000, timeout=0.6)
