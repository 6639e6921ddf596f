"""kvpipe's entry points: the CLI dispatcher, the end-to-end demo and the benchmark runner.

This package sits above the others (it may import schemas, gpu, producer, processors, infra);
none of them imports it.
"""
