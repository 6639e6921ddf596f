"""Where the load fields come from: the simulated node reports its scheduler's queues and KV usage
through the publisher's sequencer (every envelope carries the latest report)."""
from __future__ import annotations

from kvpipe.gpu.node.kv_compute import ModelShape
from kvpipe.gpu.node.node import CaptureSink, Node, NodeConfig
from kvpipe.gpu.node.workload import SyntheticConfig, SyntheticWorkload
from kvpipe.gpu.specs import FullAttention
from kvpipe.producer.sequencer import Sequencer


class LoadSink(CaptureSink):
    def __init__(self) -> None:
        super().__init__()
        self.loads: list[tuple[int, int, float]] = []

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        self.loads.append((running, waiting, kv_usage))


def test_the_simulated_node_reports_its_scheduler_queues_and_kv_usage_every_step():
    sink = LoadSink()
    workload = SyntheticWorkload(SyntheticConfig(seed=1, arrivals_per_step=3.0, system_prompt_tokens=(32, 64),
                                                 max_prompt_tokens=256))
    node = Node(NodeConfig(specs=(FullAttention(16),), gpu_blocks=64, cpu_chunks=0, max_running=2,
                           shape=ModelShape(layers_per_group=1, num_kv_heads=1, head_size=8)), workload, sink)
    for _ in range(30):
        node.step()
        running, waiting, usage = sink.loads[-1]
        assert (running, waiting) == (len(node.scheduler.running), len(node.scheduler.waiting))
        assert usage == round(node.manager.usage, 4) and 0.0 <= usage <= 1.0
    assert len(sink.loads) == 30 and max(r for r, _, _ in sink.loads) == 2  # max_running
    assert any(w > 0 for _, w, _ in sink.loads) and any(u > 0 for _, _, u in sink.loads)


def test_the_sequencer_stamps_the_latest_load_on_every_envelope_until_replaced():
    seq = Sequencer("node-a", 1)
    assert seq.heartbeat(now=1.0, mono=0.0, dropped_total=0).running is None
    seq.load = (3, 1, 0.5)
    for _ in range(2):
        env = seq.heartbeat(now=1.0, mono=0.0, dropped_total=0)
        assert (env.running, env.waiting, env.kv_usage) == (3, 1, 0.5)
    seq.load = (0, 0, 0.0)
    assert seq.heartbeat(now=1.0, mono=0.0, dropped_total=0).waiting == 0
