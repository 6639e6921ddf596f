"""The one exception type of `infra`: its message is what the user needs to fix the problem."""
from __future__ import annotations


class InfraError(RuntimeError):
    """Raised for every expected failure (missing tool, port taken, broker not ready, topic
    mismatch). The CLI prints the message and exits 1 without a traceback, so messages must say
    what went wrong *and* what to do about it."""


INSTALL_HINT = "install it with: apt-get install openjdk-17-jre-headless maven"
