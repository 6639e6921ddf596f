"""infra/compose.yaml declares the server deployment kvpipe documents.

`docker compose config` is the authoritative check (it parses, interpolates and validates the file
without talking to an engine) and runs wherever the compose plugin is installed. The structural
check below runs everywhere, so a machine without docker still catches a missing service, image or
environment key. It reads the file with a small indentation-based reader instead of a YAML library,
which the project does not depend on.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

COMPOSE = Path(__file__).resolve().parents[2] / "infra" / "compose.yaml"


def _blocks(lines: list[str], indent: int) -> dict[str, list[str]]:
    """Keys at exactly `indent` spaces → the lines nested below each of them."""
    out: dict[str, list[str]] = {}
    key = None
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        width = len(line) - len(line.lstrip())
        if width == indent and re.match(r"[A-Za-z0-9_.-]+:", line.strip()):
            key = line.strip().split(":", 1)[0]
            out[key] = []
        elif width > indent and key is not None:
            out[key].append(line)
        elif width < indent:
            key = None
    return out


def _mapping(lines: list[str]) -> dict[str, str]:
    """`KEY: value` lines one level deep (enough for environment blocks)."""
    indent = min(len(l) - len(l.lstrip()) for l in lines)
    return {k: v.strip().strip('"') for l in lines if len(l) - len(l.lstrip()) == indent and ":" in l
            for k, v in [l.strip().split(":", 1)]}


def _services() -> dict[str, dict[str, list[str]]]:
    top = _blocks(COMPOSE.read_text().splitlines(), 0)
    assert "services" in top, "compose.yaml has no top-level services"
    return {name: _blocks(body, 4) for name, body in _blocks(top["services"], 2).items()}


def test_compose_declares_kafka_clickhouse_and_the_two_apps() -> None:
    services = _services()
    assert {"kafka", "clickhouse", "processor", "analytics"} <= services.keys()
    text = COMPOSE.read_text()
    assert re.search(r"^    image: apache/kafka:3\.9\.1\b", text, re.M), "Kafka pinned to the release in pom.xml"
    assert re.search(r"^    image: clickhouse/clickhouse-server:\S+", text, re.M)
    assert re.search(r"^    image: python:3\.11", text, re.M)

    kafka = _mapping(services["kafka"]["environment"])
    assert kafka["KAFKA_PROCESS_ROLES"] == "broker,controller", "KRaft combined mode"
    assert "CLUSTER_ID" in kafka and "KAFKA_CONTROLLER_QUORUM_VOTERS" in kafka
    assert kafka["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false", "same topic policy as the local broker"

    # the routing app: Kafka only, no ClickHouse (it loads no ClickHouse code at all)
    proc = services["processor"]
    env = _mapping(proc["environment"])
    assert env["KVPIPE_KAFKA_BOOTSTRAP"] == "kafka:9092" and "KVPIPE_CLICKHOUSE_DSN" not in env
    command = "\n".join(proc["command"])
    assert "pip install" in command and "kvpipe infra up" in command and "exec kvpipe processor" in command
    depends = "\n".join(proc["depends_on"])
    assert "kafka" in depends and "clickhouse" not in depends

    # the analytics app: Kafka and the ClickHouse server, its own port
    ana = services["analytics"]
    env = _mapping(ana["environment"])
    assert env["KVPIPE_KAFKA_BOOTSTRAP"] == "kafka:9092"
    assert re.fullmatch(r"http://(\S+@)?clickhouse:8123", env["KVPIPE_CLICKHOUSE_DSN"]), env["KVPIPE_CLICKHOUSE_DSN"]
    assert env["KVPIPE_ANALYTICS_WEB_PORT"] == "6067"
    command = "\n".join(ana["command"])
    assert "pip install" in command and "kvpipe infra up" in command and "exec kvpipe analytics" in command
    depends = "\n".join(ana["depends_on"])
    assert "kafka" in depends and "clickhouse" in depends
    assert any(":6067:6067" in line for line in ana["ports"])


def test_no_port_is_published_on_all_interfaces_by_default() -> None:
    # Kafka, ClickHouse's HTTP port and the route API have no authentication here.
    for name, svc in _services().items():
        for line in svc.get("ports", []):
            assert "${" in line and "127.0.0.1" in line, f"{name} publishes {line.strip()} beyond loopback"


@pytest.mark.skipif(shutil.which("docker") is None, reason="docker CLI not installed")
def test_docker_compose_accepts_the_file() -> None:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("docker compose plugin not installed (the structural tests above still ran)")
    r = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _pip_targets(command: str) -> list[str]:
    """What each `pip install` line of a service's command installs (its last argument)."""
    return [line.split()[-1] for line in command.splitlines() if "pip install" in line]


def test_each_app_image_installs_its_role_only() -> None:
    # No `[gpu]` (torch) extra and no torch wheel index: the GPU side is `kvpipe[gpu]`, which no server
    # container runs.
    # The routing app is the base install; the analytics app adds the `analytics` extra (its store and report).
    for name, role in (("processor", "/build/src"), ("analytics", "'/build/src[analytics]'")):
        svc = _services()[name]
        command = "\n".join(svc["command"])
        targets = _pip_targets(command)
        assert targets == [role], f"{name} installs {targets}; expected its role's install of the source, {role}"
        env = _mapping(svc["environment"])
        assert not any("torch" in v for v in env.values()), f"{name} points pip at torch wheels"
        assert "torch" not in command and "requirements.lock" not in command


# --- each app's environment through the app's own start-up checks ------------------------------------

SECURE = COMPOSE.with_name("compose.secure.yaml")
_VAR = re.compile(r"\$\{(\w+)(?:(:?)([-?])([^}]*))?\}")


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable syntax: ${V}, ${V:-default}, ${V-default}, ${V:?error}, ${V?error}."""
    def one(m: re.Match) -> str:
        name, colon, op, arg = m.group(1), m.group(2), m.group(3), m.group(4)
        value = env.get(name)
        missing = value is None or (colon == ":" and value == "")
        if op == "?" and missing:
            raise ValueError(f"${{{name}}}: {arg}")
        return arg if op == "-" and missing else (value or "")
    return _VAR.sub(one, text)


def _merge(base: dict, over: dict) -> dict:
    """`docker compose -f base -f over`: mappings merge key by key, the override's scalars and lists win
    (compose appends some lists; none that these checks read)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _app_envs(files: list[Path], env: dict[str, str], secrets_dir: Path) -> dict[str, dict[str, str]]:
    """Each kvpipe app service's environment as its container sees it, secret files mapped to `secrets_dir`."""
    yaml = pytest.importorskip("yaml")  # PyYAML: the `test` extra (pyproject.toml)
    doc: dict = {}
    for f in files:
        doc = _merge(doc, yaml.safe_load(_interpolate(f.read_text(), env)))
    out = {}
    for name, svc in doc["services"].items():
        if "kvpipe processor" not in str(svc.get("command")) and "kvpipe analytics" not in str(svc.get("command")):
            continue
        environment = {k: "" if v is None else str(v) for k, v in (svc.get("environment") or {}).items()}
        for key, value in environment.items():
            if value.startswith("/run/secrets/"):
                secret = value.removeprefix("/run/secrets/")
                assert secret in (svc.get("secrets") or []), f"{name}: {key} names a secret the service does not mount"
                environment[key] = str(secrets_dir / secret)
        out[name] = environment
    return out


def _start_checks(environment: dict[str, str]):
    """What `kvpipe processor` / `kvpipe analytics` check before a worker starts (core/appcli.py)."""
    from kvpipe.processors.core.webauth import check_exposure
    from kvpipe.schemas.settings import load_settings

    settings = load_settings(env=environment)
    check_exposure(settings, insecure=False)
    return settings


def test_each_app_in_the_default_compose_passes_its_start_up_checks(tmp_path) -> None:
    envs = _app_envs([COMPOSE], {}, tmp_path)
    assert set(envs) == {"processor", "analytics"}
    for name, environment in envs.items():
        settings = _start_checks(environment)  # raises what the app would print before exiting 2
        assert settings.web_host == "0.0.0.0" and settings.insecure, name  # open only on the loopback-published port
    from kvpipe.processors.core.webauth import ExposureError

    # the check the test leans on does refuse: the same environment without the loopback waiver
    with pytest.raises(ExposureError, match="without authentication"):
        _start_checks({**envs["analytics"], "KVPIPE_INSECURE": "false"})


def test_the_secure_compose_takes_tokens_from_secret_files_and_refuses_to_run_open(tmp_path) -> None:
    with pytest.raises(ValueError, match="CLICKHOUSE_PASSWORD"):
        _app_envs([COMPOSE, SECURE], {}, tmp_path)  # no default password in the secure variant
    envs = _app_envs([COMPOSE, SECURE], {"CLICKHOUSE_PASSWORD": "s3cret"}, tmp_path)
    (tmp_path / "api_token").write_text("t0ken\n")
    for name, environment in envs.items():
        assert "t0ken" not in environment.values(), f"{name}: the token must come from the file, not the environment"
        settings = _start_checks(environment)
        assert settings.api_token_value() == "t0ken" and not settings.insecure, name
    assert "s3cret@clickhouse" in envs["analytics"]["KVPIPE_CLICKHOUSE_DSN"]
    (tmp_path / "api_token").unlink()
    from kvpipe.processors.core.webauth import ExposureError
    from kvpipe.schemas.settings import SettingsError

    with pytest.raises((SettingsError, ExposureError, OSError)):  # no secret file: the app does not start
        _start_checks(envs["processor"])
