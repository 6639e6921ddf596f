"""What starting either Faust app (`kvpipe processor`, `kvpipe analytics`) shares: the command's flags
become `KVPIPE_*` variables (each app reads its settings once, at import, from the environment),
the settings load, and the exposure rule (kvpipe.processors.core.webauth) and `require_native`
(kvpipe.processors.core.native) are checked before any worker starts; then the worker runs, logging in the
log format of the settings."""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from kvpipe.schemas.settings import Settings, SettingsError, load_settings


def worker_settings(prog: str, flags: Mapping[str, object], insecure: bool) -> Settings | None:
    """The app's settings, or None after printing why it must not start (the caller exits 2)."""
    os.environ.update({k: str(v) for k, v in flags.items() if v is not None})
    if insecure:  # the apps check the exposure rule again at import (webauth.install): they must see the flag
        os.environ["KVPIPE_INSECURE"] = "true"
    from kvpipe.processors.core.kafkaconf import check_properties

    try:
        settings = load_settings()
        # the Kafka pass-through properties the Faust clients cannot apply stop the app here with their names,
        # not at the app's import with a traceback
        check_properties(settings)
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


def app_logging(log_level: str) -> None:
    """Logging until the worker sets up its own (importing the app logs, e.g. which engine runs): with
    `--log-format json`, JSON lines already, on the worker's stream (stdout), so a log pipeline reads every line;
    with text, as before, Python's last-resort handler."""
    from kvpipe.schemas.cliopts import configure_logging, log_format

    if log_format() == "json":
        configure_logging(log_level, sys.stdout)


def run_worker(app: Any, log_level: str) -> None:
    """Faust's Worker for `app` until it stops. It installs SIGTERM/SIGINT handlers that stop the app cleanly
    (final snapshot included), and sets up logging at `log_level`: Faust's own text lines, or the JSON lines of
    `--log-format json` (kvpipe.schemas.logsetup.faust_logging_config)."""
    from kvpipe.schemas.cliopts import log_format
    from kvpipe.schemas.logsetup import faust_logging_config

    make_worker(app, log_level, faust_logging_config(log_level, log_format())).execute_from_commandline()


def make_worker(app: Any, log_level: str, logging_config: dict[str, Any] | None = None) -> Any:
    """Faust's Worker for `app`, without its terminal spinner. At a level of WARN and above, Faust keeps the spinner
    and, to spin it on every record, sets the root logger to DEBUG for the worker's whole life: then every
    `log.debug` of aiokafka's fetcher and connections (several per fetch) built a record nobody wrote (seen in 12 % of
    py-spy's samples of the routing app ingesting 100 k events/s; ~0.03 cores). Without it the root logger stays at `log_level`."""
    from faust.worker import Worker

    worker = Worker(app, loglevel=log_level, quiet=True, logging_config=logging_config)
    worker.spinner = None
    return worker
