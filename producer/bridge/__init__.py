"""The vLLM ZMQ bridge: forward a real vLLM node's KV events into Kafka.

vLLM publishes each scheduler step's events as one msgpack batch on a ZMQ PUB socket, numbered
from 0 per publisher process, and keeps the last `buffer_steps` batches in a ring served by a
ROUTER "replay" socket (docs/vllm-behaviour.md §2). The bridge subscribes to one such node
(one SUB per data-parallel rank; each rank is a node of its own), closes gaps from the replay
ring, reports what the ring no longer holds as `lost_batches`, turns a seq that goes backwards into
a new epoch, and hands every payload, byte-identical, to the Kafka `Publisher`.

Modules: `subscriber` (endpoints, SUB sockets, frame checks), `replay` (replay client),
`forwarder` (per-rank sequencing and forwarding, no sockets), `specs` (declared vs observed group
specs), `dlq`, `metrics`, `recording` (raw frame captures), `silence` (the no-frames warning),
`runner` (threads and lifecycle),
`cli`. The vLLM-like publisher for tests and the benchmark is `kvpipe.bench.testing_publisher`, the
benchmark `kvpipe.bench.bridge`.
"""
