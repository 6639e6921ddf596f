"""What the processor integration tests share: a throw-away set of topics, and the tests' own
model of what the index must hold — written independently of processors/core/index.py, so a bug there
cannot hide in the expectation."""
from __future__ import annotations

import uuid
from collections import Counter

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from kvpipe.gpu.hit import longest_hybrid_hit_in_views
from kvpipe.gpu.specs import from_group_spec
from kvpipe.schemas.envelope import GroupSpec
from kvpipe.schemas.events import BlockStored
from tests.integration.kafka_reading import client_config


class ProcessorTopics:
    """Events (n partitions), DLQ (1) and the two apps' compacted snapshot topics, unique names."""

    def __init__(self, bootstrap: str, prefix: str, partitions: int, events_config: dict[str, str] | None = None) -> None:
        tag = uuid.uuid4().hex[:10]
        self.bootstrap, self.partitions, self.tag = bootstrap, partitions, tag
        self.events, self.dlq, self.snapshots = f"{prefix}-ev-{tag}", f"{prefix}-dlq-{tag}", f"{prefix}-snap-{tag}"
        self.analytics_snapshots = f"{prefix}-asnap-{tag}"
        self.admin = AdminClient(client_config(bootstrap))
        futures = self.admin.create_topics([
            NewTopic(self.events, partitions, 1, config={"message.timestamp.type": "LogAppendTime", **(events_config or {})}),
            NewTopic(self.dlq, 1, 1),
            NewTopic(self.snapshots, partitions, 1, config={"cleanup.policy": "compact"}),
            NewTopic(self.analytics_snapshots, partitions, 1, config={"cleanup.policy": "compact"})], operation_timeout=30)
        for f in futures.values():
            f.result(timeout=30)

    def env(self, processor_id: str, web_port: int, state_dir: str, **extra: str) -> dict[str, str]:
        """KVPIPE_* settings of a processor (or analytics app: KVPIPE_ANALYTICS_* in `extra`) on these topics."""
        return {"KVPIPE_KAFKA_BOOTSTRAP": self.bootstrap, "KVPIPE_EVENTS_TOPIC": self.events,
                "KVPIPE_DLQ_TOPIC": self.dlq, "KVPIPE_SNAPSHOT_TOPIC": self.snapshots,
                "KVPIPE_ANALYTICS_SNAPSHOT_TOPIC": self.analytics_snapshots,
                "KVPIPE_PARTITIONS": str(self.partitions), "KVPIPE_PROCESSOR_ID": processor_id,
                "KVPIPE_WEB_PORT": str(web_port), "KVPIPE_STATE_DIR": state_dir, **extra}

    def end_offsets(self) -> dict[int, int]:
        consumer = Consumer(client_config(self.bootstrap, **{"group.id": "unused"}))
        try:
            return {p: consumer.get_watermark_offsets(TopicPartition(self.events, p), timeout=10)[1]
                    for p in range(self.partitions)}
        finally:
            consumer.close()

    def delete(self) -> None:
        for f in self.admin.delete_topics([self.events, self.dlq, self.snapshots, self.analytics_snapshots],
                                           operation_timeout=30).values():
            try:
                f.result(timeout=30)
            except Exception:  # cleanup only; a leftover test topic is harmless
                pass


class HeldBlocks:
    """Reference-counted `(node, group, medium) → hash → copies`, and the route answer it implies."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, int, str], Counter] = {}

    def apply(self, node: str, events: list) -> None:
        for ev in events:
            held = self.held.setdefault((node, ev.group_idx or 0, ev.medium or "GPU"), Counter())
            for h in ev.block_hashes:
                if isinstance(ev, BlockStored):
                    held[h] += 1
                elif held[h] > 0:
                    held[h] -= 1

    def clear_node(self, node: str) -> None:
        for key in [k for k in self.held if k[0] == node]:
            del self.held[key]

    def expected_route(self, hashes: list, specs: list[GroupSpec], suspect: frozenset[str] = frozenset(),
                       node_specs: dict[str, list[GroupSpec]] | None = None,
                       loads: dict[str, tuple[int, int, float]] | None = None) -> list[tuple[str, int, int]]:
        """`(node, gpu_tokens, loadable_tokens)` of `/route` for the same hash list in every group
        and `num_tokens = len(hashes) * block_size + 1` (so the cap is the whole list): vLLM's hybrid
        hit by `kvpipe.gpu.hit` (the reference) on what each node holds, rows with a hit only, ranked by
        the default score with no load — (gpu + 0.5 · loadable) / cap — then GPU, then loadable;
        `suspect` nodes after the others. `node_specs`: nodes whose groups differ from `specs`;
        `loads`: (running, waiting, kv_usage) reported by nodes, weighed with the default knobs
        (0.02 per running, 0.05 per waiting request, 0.5 per unit of KV usage)."""
        cap = len(hashes) * specs[0].block_size
        rows = []
        for node in sorted({k[0] for k in self.held}):
            kv = [from_group_spec(gs) for gs in sorted((node_specs or {}).get(node, specs), key=lambda gs: gs.group_idx)]
            def on(medium: str, g: int) -> set[int]:
                return {h for h, n in self.held.get((node, g, medium), Counter()).items() if n > 0}
            gpu_sets = [on("GPU", g) for g in range(len(kv))]
            any_sets = [s | on("CPU", g) for g, s in enumerate(gpu_sets)]
            gpu = longest_hybrid_hit_in_views(kv, [hashes] * len(kv), gpu_sets, cap).length if cap else 0
            total = longest_hybrid_hit_in_views(kv, [hashes] * len(kv), any_sets, cap).length if cap else 0
            if total:
                running, waiting, usage = (loads or {}).get(node, (0, 0, 0.0))
                score = (gpu + 0.5 * (total - gpu)) / max(cap, 1) - 0.02 * running - 0.05 * waiting - 0.5 * usage
                rows.append(((node in suspect, -score, -gpu, -(total - gpu), node), (node, gpu, total - gpu)))
        return [row for _, row in sorted(rows)]

