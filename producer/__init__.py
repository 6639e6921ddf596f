"""Getting KV events off a serving node and into Kafka.

Owns: the Kafka publisher (`publisher.Publisher`, confluent-kafka), envelope sequencing
(`sequencer.Sequencer`: epoch, contiguous seq, drop accounting, when group specs travel), the
`kvpipe inspect` decoder (`inspect`, with `frame_capture` for raw ZMQ frame captures), and the vLLM
ZMQ bridge (subpackage `bridge`). The producer benchmark is `kvpipe.bench.producer`.
May import: schemas, confluent-kafka, pyzmq (and the standard library).
"""

if not __name__.startswith("kvpipe."):  # one module object per file (kvpipe/__init__.py)
    raise ImportError(f"import kvpipe.{__name__}, not {__name__}: the repository's top-level folders are "
                      "subpackages of kvpipe (kvpipe/__init__.py)")
