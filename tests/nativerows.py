"""Random analytics columns for the `kvpipe_native.NativeRows` tests, in the forms `tables.Table.insert` produces
(int microseconds for DateTime64, bool or int for UInt8, None in Nullable columns, a list of ints per row for
Array(UInt64)), and the column names and types a Native block declares."""
from __future__ import annotations

import random
from typing import Any

U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1
# one month of microseconds from Nov 2023: every table is partitioned by month, and an insert touching more than
# 100 partitions is refused
T0 = 1_698_796_800_000_000
MONTH_US = 28 * 86_400 * 1_000_000
SPECIAL_STRINGS = ["", "GPU", "CPU", "nœud-é", "節点", "🙂 emoji", "a\x00b", "x" * 300]
FLOATS = [0.0, -1.5, 1e-300, 1e300, float("inf"), float("-inf"), 2.0**53 + 1]


def read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, at


def names_and_types(empty_block: bytes) -> list[tuple[str, str]]:
    """The (name, type) of each column of a Native block without rows (`NativeRows.encode(0, 0)`)."""
    count, at = read_varint(empty_block, 0)
    rows, at = read_varint(empty_block, at)
    assert rows == 0, "a block with rows has data between its columns' names"
    out = []
    for _ in range(count):
        pair = []
        for _ in range(2):
            n, at = read_varint(empty_block, at)
            pair.append(empty_block[at:at + n].decode())
            at += n
        out.append((pair[0], pair[1]))
    assert at == len(empty_block)
    return out


def _u(rng: random.Random, bits: int) -> int:
    top = 2**bits - 1
    return rng.choice([0, 1, top, top - 1, rng.randrange(top + 1), rng.randrange(1000)])


def _float(rng: random.Random) -> float:
    return rng.choice([*FLOATS, rng.uniform(-1e6, 1e6), rng.random()])


def _value(rng: random.Random, ch_type: str, pool: list[str]) -> Any:
    if ch_type.startswith("DateTime64"):
        return T0 + rng.randrange(MONTH_US)
    if ch_type == "UInt8":
        return rng.choice([True, False, 0, 1, 255, rng.randrange(256)])
    if ch_type.startswith("UInt"):
        return _u(rng, int(ch_type[4:]))
    if ch_type == "Int32":
        return rng.choice([-(2**31), 2**31 - 1, -1, 0, rng.randrange(-(2**31), 2**31)])
    if ch_type == "Float64":
        return _float(rng)
    if ch_type in ("String", "LowCardinality(String)"):
        return rng.choice(pool)
    if ch_type == "Array(UInt64)":
        return [_u(rng, 64) for _ in range(rng.choice([0, 0, 1, 2, 5, 33]))]
    if ch_type == "Nullable(UInt32)":
        return None if rng.random() < 0.3 else _u(rng, 32)
    if ch_type == "Nullable(Float64)":
        return None if rng.random() < 0.3 else _float(rng)
    raise AssertionError(f"no values for {ch_type}")


def random_columns(rng: random.Random, types: list[tuple[str, str]], rows: int, distinct: int = 12) -> list[list]:
    """`rows` random rows as columns; each string column draws from `distinct` values (the special ones first),
    and uses every one of them when it has at least as many rows."""
    pool = (SPECIAL_STRINGS + [f"value-{i}" for i in range(distinct)])[:distinct]
    columns = []
    for _name, ch_type in types:
        if "String" in ch_type:
            col = pool[:rows] + [rng.choice(pool) for _ in range(rows - min(rows, len(pool)))]
            rng.shuffle(col)
        else:
            col = [_value(rng, ch_type, pool) for _ in range(rows)]
        columns.append(col)
    return columns


def rows_of(columns: list[list]) -> list[tuple]:
    """Rows in a stable order (bools as the ints a store returns), for comparing as multisets."""
    return sorted((tuple(int(v) if isinstance(v, bool) else v for v in row) for row in zip(*columns)), key=repr)
