"""What every clickhouse-connect client of the analytics store gets beside its DSN: the password from
`clickhouse_password_file` and the server's TLS options (`clickhouse_ca_cert`, `clickhouse_verify`).

One function for the three places that open a client (the sink's writer, its read pool, `kvpipe sql` on a
server DSN), so a server behind TLS or a password kept out of the DSN reaches all of them. The password
goes to the client only: it is read at connect time and never formatted into a message.
"""
from __future__ import annotations

from typing import Any

from kvpipe.schemas.settings import load_settings


def client_kwargs(dsn: str) -> dict[str, Any]:
    """`clickhouse_connect.get_client(dsn=dsn, **client_kwargs(dsn))`; {} for chDB (no password, no TLS),
    without loading the settings."""
    if not dsn.startswith(("http://", "https://")):
        return {}
    return load_settings().clickhouse_client_kwargs(dsn)
