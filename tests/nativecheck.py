"""The guard of the tests that hold the native core equal to the Python reference: they need the native engine
(`kvpipe.processors.core.native`), and a checkout without it fails them with the reason, unless the native core
was left out on purpose (KVPIPE_NATIVE=0, which infra/scripts/native.sh honours too)."""
from __future__ import annotations

import os

import pytest

from kvpipe.processors.core import native


def require_native_core() -> None:
    """Call at module level, before the tests of a native part."""
    if native.engine() == "native":
        return
    if os.environ.get("KVPIPE_NATIVE") == "0":
        pytest.skip(f"KVPIPE_NATIVE=0: {native.reason()}", allow_module_level=True)
    raise ImportError(f"these tests compare the native core with the Python reference: {native.reason()}")
