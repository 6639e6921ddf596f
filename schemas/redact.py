"""What of the settings never reaches output: the secret fields' values, a DSN's password, secret-looking
pass-through properties — masked as `***` by `Settings.__repr__`, `__rich_repr__` and `kvpipe config show` —
and the reading of secret files, whose errors say why (missing, permission), never what.

The `*_file` fields hold paths and are shown as they are: their content is read only where a client is
built (`read_secret`), never into output.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvpipe.schemas.configlayers import SettingsError

if TYPE_CHECKING:
    from kvpipe.schemas.settings import Settings

SECRET_FIELDS = frozenset({"api_token", "kafka_sasl_password", "kafka_ssl_key_password", "kafka_oauth_client_secret"})
# Words that make a pass-through property's value (or a DSN query parameter) a secret: sasl.jaas.config carries
# a password, ssl.keystore.password is one.
SECRET_WORDS = ("password", "secret", "jaas", "token", "credential")
MASK = "***"
# Shorter configured "secrets" are not masked in free text (`secret_values`): a 1–3 character value would turn
# every matching letter of every log line into ***, and is no secret worth the name.
MIN_MASKED_LEN = 4


def masked(name: str, value: object) -> object:
    """Setting `name`'s value as output may show it."""
    if name in SECRET_FIELDS and value:
        return MASK
    if name == "clickhouse_dsn" and isinstance(value, str):
        return masked_dsn(value)
    if name == "kafka_properties" and isinstance(value, dict):
        return masked_properties(value)
    return value


# A URL's query parameters also carry ClickHouse's and object stores' spellings (`pwd`, `access_key`, `auth…`);
# in a DSN a false positive only hides a value, so the list is wider than for settings and Kafka properties.
DSN_SECRET_WORDS = SECRET_WORDS + ("passwd", "pwd", "key", "auth")


def _secret_key(key: str, words: tuple[str, ...] = SECRET_WORDS) -> bool:
    return any(word in key.lower() for word in words)


def masked_properties(props: Mapping[str, Any]) -> dict[str, Any]:
    return {k: MASK if _secret_key(k) else v for k, v in props.items()}


def masked_dsn(dsn: str) -> str:
    """`dsn` with its password and secret-looking query parameters replaced by ***."""
    try:
        parts = urlsplit(dsn)
        password = parts.password
    except ValueError:
        return MASK
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if not password and not any(_secret_key(k, DSN_SECRET_WORDS) for k, _ in pairs):
        return dsn  # as given: urlunsplit would drop the empty netloc of chdb:///path
    netloc = parts.netloc
    if password:
        userinfo, _, host = netloc.rpartition("@")
        netloc = f"{userinfo.split(':', 1)[0]}:{MASK}@{host}"
    query = urlencode([(k, MASK if _secret_key(k, DSN_SECRET_WORDS) else v) for k, v in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def read_secret(path: str, field: str) -> str:
    """A secret file's content, a trailing newline stripped (as `echo secret > file` leaves one)."""
    try:
        return Path(path).read_text().rstrip("\r\n")
    except OSError as exc:  # the reason (missing, permission), never the content
        raise SettingsError(f"{field}: cannot read {path}: {exc.strerror}") from None


def secret_values(settings: Settings) -> tuple[str, ...]:
    """The secret values these settings hold or point at (the secret fields, the token and password files' content,
    the DSN's password, secret-looking Kafka properties), longest first, for masking free text such as log lines
    (kvpipe.schemas.logsetup). A secret file that cannot be read is skipped: whoever needs it reports why."""
    found = [str(getattr(settings, name) or "") for name in SECRET_FIELDS]
    readers = (settings.api_token_value, settings.kafka_password,
               lambda: settings.clickhouse_client_kwargs().get("password", ""),
               lambda: [str(v) for k, v in settings.kafka_client_properties().items() if _secret_key(k)])
    for read in readers:
        try:
            value = read()
        except (SettingsError, ValueError):
            continue
        found += value if isinstance(value, list) else [str(value or "")]
    try:
        dsn = urlsplit(settings.clickhouse_dsn)
        found += [dsn.password or ""] + [v for k, v in parse_qsl(dsn.query) if _secret_key(k)]
    except ValueError:
        pass
    return tuple(sorted({v for v in found if len(v) >= MIN_MASKED_LEN}, key=len, reverse=True))


def mask_secrets(text: str, secrets: tuple[str, ...]) -> str:
    """`text` with every one of `secrets` replaced by ***."""
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text
