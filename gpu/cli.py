"""`kvpipe node` entry point (mapped in `kvpipe.cli`); the node lives in `gpu.node`."""
from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from gpu.node.cli import main as node_main

    return node_main(argv)
