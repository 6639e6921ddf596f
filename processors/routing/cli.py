"""`kvpipe processor` (the routing index app) and `kvpipe route`. `kvpipe sql` and `kvpipe analytics`
live in `kvpipe.processors.analytics.cli`."""
from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from kvpipe.processors.core.appcli import app_logging, run_worker, worker_settings
from kvpipe.schemas.cliopts import (Command, apply_bootstrap, bootstrap_server_option, configure_logging,
                                    datadir_option, log_level_option, output_option, web_bind_option)
from kvpipe.schemas.settings import SettingsError, load_settings



@click.command("processor", cls=Command, help=(
    "Run the routing index app (Faust): consume KV events, keep the per-group cache index, serve "
    "/route /nodes /stats /metrics /health. It writes no analytics and loads no ClickHouse code: "
    "`kvpipe analytics` is a second app in its own consumer group on the same topic.\n\n"
    "Scaling: one consumer group (--processor-id); run more workers with the same id, up to one "
    "per events partition; /route gathers the answer across them. Every setting is also a "
    "KVPIPE_* environment variable; these flags override them."))
@click.option("--web-port", type=int, help="HTTP port of this app, the route API (KVPIPE_WEB_PORT; the analytics "
              "app's is KVPIPE_ANALYTICS_WEB_PORT)")
@web_bind_option()
@click.option("--insecure", is_flag=True,
              help="allow a non-loopback --web-bind without KVPIPE_API_TOKEN (an open endpoint)")
@datadir_option("processor")
@click.option("--topic", help="events topic to consume (KVPIPE_EVENTS_TOPIC)")
@click.option("--processor-id", help="Faust app id = consumer group (KVPIPE_PROCESSOR_ID)")
@click.option("--route-port", type=int, help="port of the native route server: POST /route on native threads "
              "beside ingest, every other request passed to --web-port (KVPIPE_ROUTE_PORT; 0 = off)")
@click.option("--route-threads", type=int, help="threads of the native route server (KVPIPE_ROUTE_THREADS; "
              "0 = one per core)")
@bootstrap_server_option()
@log_level_option()
def processor(web_port: int | None, web_host: str | None, insecure: bool, state_dir: str | None, topic: str | None,
              processor_id: str | None, route_port: int | None, route_threads: int | None,
              bootstrap_server: str | None, log_level: str) -> int:
    apply_bootstrap(bootstrap_server)
    # log_level is resolved (flag, KVPIPE_LOG_LEVEL, default): Faust's Worker configures logging at it (run_worker)
    flags = {"KVPIPE_WEB_PORT": web_port, "KVPIPE_WEB_HOST": web_host, "KVPIPE_STATE_DIR": state_dir,
             "KVPIPE_EVENTS_TOPIC": topic, "KVPIPE_PROCESSOR_ID": processor_id, "KVPIPE_ROUTE_PORT": route_port,
             "KVPIPE_ROUTE_THREADS": route_threads}
    settings = worker_settings("kvpipe processor", flags, insecure)
    if settings is None:
        return 2
    bad = [f"{name}={getattr(settings, name)}" for name in ("route_inflight_ttl_s", "route_inflight_max_requests",
                                                           "route_inflight_max_entries", "route_stale_after_s")
           if not getattr(settings, name) > 0]
    if bad:
        print(f"kvpipe processor: {', '.join(bad)}: the router's in-flight TTL, caps and staleness bound must be > 0",
              file=sys.stderr)
        return 2
    app_logging(log_level)
    from kvpipe.processors.routing import agents, routeserve, views  # noqa: F401  (registers the agent, timers and pages)
    from kvpipe.processors.routing.app import app

    os.makedirs(settings.state_path("processor"), exist_ok=True)
    run_worker(app, log_level)
    return 0


def _base_url(url: str | None) -> str:
    if url:
        return url.rstrip("/")
    s = load_settings()
    return f"http://{s.web_host}:{s.web_port}"


def read_tokens(text: str) -> list[int]:
    """Token ids from a file's text: a JSON list (`[1, 2, 3]`) or whitespace/comma-separated ints."""
    text = text.strip()
    if text.startswith("["):
        values = json.loads(text)
        if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError("expected a JSON list of integer token ids")
        return values
    return [int(t) for t in text.replace(",", " ").split()]


def _hash_arg(text: str) -> int | str:
    text = text.strip()
    return text if text.lower().startswith("0x") else int(text)


def _print_answer(answer: Any) -> None:
    """A short human-readable answer: the choice, a table of the nodes, the no-signal reasons."""
    from kvpipe.processors.core.texttable import render

    print(f"chosen: {answer.chosen or '(none eligible)'}   semantics: {answer.semantics}   "
          f"num_tokens: {answer.num_tokens}   hashing: {answer.hashing_s * 1e3:.2f} ms   "
          f"search: {answer.search_s * 1e3:.2f} ms" + ("   PARTIAL: missing partitions "
                                                      f"{answer.missing_partitions}" if answer.partial else ""))
    rows = []
    for r in answer.nodes:
        load = r.load
        notes = (["speculative"] if r.speculative else []) + ([] if r.exact else [f"not exact: {r.reason or ''}"])
        rows.append([r.node_id, r.state, r.gpu_tokens, r.loadable_tokens, f"{r.score:.4f}",
                     load.running if load else 0, load.waiting if load else 0,
                     f"{load.kv_usage if load else 0.0:.2f}", "; ".join(notes)])
    if rows:
        print(render(["node", "state", "gpu_tok", "cpu_tok", "score", "run", "wait", "kv", "note"], rows,
                     right=range(2, 8)))
    for n in answer.no_signal:
        print(f"no signal: {n.node_id} ({n.cause}): {n.reason}")


@click.command("route", cls=Command, help=(
    "Ask a running processor where to send a prompt: vLLM's hybrid cache hit per node (tokens on GPU, "
    "tokens loadable from CPU), a score against each node's load, and the chosen node. Give exactly one "
    "of --tokens, --hashes, --file."))
@click.option("--tokens", metavar="FILE", help="the prompt's token ids: a JSON list or whitespace-separated "
                                               "ints, from FILE or - (stdin); the router hashes them per node")
@click.option("--hashes", help="comma-separated block hashes of one group (ints, or 0x... hex for bytes "
                               "hashes), at that group's block size; see --group")
@click.option("--file", "body_file", metavar="FILE", help='JSON request body, e.g. {"token_ids": [...]} or '
              '{"block_hashes": {"<group>": [...]}, "num_tokens": N} (see GET /openapi.json)')
@click.option("--group", type=int, default=0, help="group index of --hashes (default 0; groups at the same "
                                                   "block size share the list)")
@click.option("--num-tokens", type=int, help="with --hashes: the prompt's token count (the hit is capped "
                                             "at N-1 as vLLM does; without it the answer is not exact)")
@click.option("--semantics", type=click.Choice(("hma", "prefix-per-group")),
              help="hma (default): vLLM's hybrid hit; prefix-per-group: the same ranking plus each "
                   "group's longest cached prefix, as an explanation")
@click.option("--model", help="only nodes serving this model")
@click.option("--top-k", type=int, help="at most K nodes (the chosen one always among them)")
@click.option("--include-zero", is_flag=True, help="also list eligible nodes without a hit")
@click.option("--request-id", help="record the request as sent to the chosen node (in-flight accounting)")
@output_option(help="the answer as a table (the choice, the nodes, the no-signal reasons) or whole as JSON")
@click.option("--url", help="processor base URL (default: http://<web_host>:<web_port> from the settings)")
@log_level_option()
def route(tokens: str | None, hashes: str | None, body_file: str | None, group: int, num_tokens: int | None,
          semantics: str | None, model: str | None, top_k: int | None, include_zero: bool, request_id: str | None,
          output: str, url: str | None, log_level: str) -> int:
    configure_logging(log_level)
    given = [flag for flag, value in (("--tokens", tokens), ("--hashes", hashes), ("--file", body_file))
             if value is not None]
    if len(given) != 1:
        raise click.UsageError("give exactly one of --tokens, --hashes, --file"
                               + (f" (got {' and '.join(given)})" if given else ""))
    import msgspec

    from kvpipe.processors.router.client import RouterClient
    from kvpipe.processors.router.model import RouteError, RouteRequest, decode_request

    try:
        if tokens is not None:
            text = sys.stdin.read() if tokens == "-" else open(tokens).read()
            req = RouteRequest(token_ids=read_tokens(text))
        elif body_file is not None:
            with open(body_file, "rb") as f:
                req = decode_request(f.read())
        else:
            assert hashes is not None  # the one flag given (checked above)
            req = RouteRequest(block_hashes={group: [_hash_arg(h) for h in hashes.split(",") if h.strip()]})
    except (OSError, ValueError) as exc:  # RouteError is a ValueError: a bad --file body
        raise click.UsageError(str(exc)) from None
    flags = {"num_tokens": num_tokens, "semantics": semantics, "model": model, "top_k": top_k,
             "request_id": request_id, "include_zero": include_zero or None}
    req = msgspec.structs.replace(req, **{k: v for k, v in flags.items() if v is not None})  # flags win
    try:
        base, token = _base_url(url), load_settings().api_token_value() or None
    except SettingsError as exc:
        print(f"kvpipe route: {exc}", file=sys.stderr)
        return 2
    try:
        with RouterClient(base, token=token, timeout_s=30.0) as client:
            answer = client.route(req)
    except RouteError as exc:
        print(f"kvpipe route: {exc.error}: {exc.detail}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"kvpipe route: no processor answers at {base} ({exc}); start one with `kvpipe processor`",
              file=sys.stderr)
        return 1
    if output == "json":
        print(msgspec.json.format(msgspec.json.encode(answer), indent=2).decode())
    else:
        _print_answer(answer)
    return 0
