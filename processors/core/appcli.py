"""What starting either Faust app (`kvpipe processor`, `kvpipe analytics`) shares: the command's flags
become `KVPIPE_*` variables (each app reads its settings once, at import, from the environment),
the settings load, and the exposure rule (kvpipe.processors.core.webauth) and `require_native`
(kvpipe.processors.core.native) are checked before any worker starts."""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from kvpipe.schemas.settings import Settings, SettingsError, load_settings


def worker_settings(prog: str, flags: Mapping[str, object], insecure: bool) -> Settings | None:
    """The app's settings, or None after printing why it must not start (the caller exits 2)."""
    os.environ.update({k: str(v) for k, v in flags.items() if v is not None})
    if insecure:  # the apps check the exposure rule again at import (webauth.install): they must see the flag
        os.environ["KVPIPE_INSECURE"] = "true"
    try:
        settings = load_settings()
    except SettingsError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    from kvpipe.processors.core.webauth import ExposureError, check_exposure

    try:
        check_exposure(settings, insecure)
    except ExposureError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    from kvpipe.processors.core import native

    try:  # refused here, before any worker starts; the app logs its engine line itself (its `state`)
        native.check_start(prog, settings.require_native)
    except native.NativeUnavailable as exc:
        print(exc, file=sys.stderr)
        return None
    return settings
