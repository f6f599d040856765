"""The completer's ack arrays, packed in PostgreSQL's binary array format by ``struct``.

psycopg's list dumper is pure Python and costs ~0.5 us per element: ~3.3 us per acked job for
the ack's seven arrays, a tenth of what a no-op job costs the worker in all. Here each element is
packed by one C call, and the result travels as a ``Packed`` object whose dumper hands the bytes
over unchanged (``register`` teaches a connection that type: the completer registers it on the
pool connection it writes with; a handler's own connection never learns it). Texts are packed
only when they are all NULL (errors and results of a batch of plain successes) or are our own
ASCII statuses: any other text goes through psycopg, which encodes it in the connection's
client encoding, except the limited claim's group names and keys (``utf8_texts``), read from
the database a moment before, packed when the connection speaks UTF-8 (psycopg's text dump
looks at every element with a regular expression, for quoting).
"""

from __future__ import annotations

import struct
from itertools import repeat
from typing import Any

import psycopg
from psycopg import adapt, postgres
from psycopg.pq import Format

from ..jobs import Status

_HEADER = struct.Struct("!iiiii").pack  # dimensions, has NULLs, element type, length, lower bound
_EMPTY = struct.Struct("!iii").pack  # no dimensions, no NULLs, element type
_INT8 = struct.Struct("!iq").pack  # each element: its length, then its value
_FLOAT8 = struct.Struct("!id").pack
_UUID_LENGTH = struct.pack("!i", 16)
_NULL = struct.pack("!i", -1)
_LENGTH = struct.Struct("!i").pack
_STATUS = {s: struct.pack("!i", len(s.value)) + s.value.encode("ascii") for s in Status}

_TYPES = {name: postgres.types[name] for name in ("int8", "float8", "uuid", "text")}


class Packed:
    """A one-dimensional array already in binary wire format."""

    __slots__ = ("data", "oid")

    def __init__(self, data: bytes, oid: int) -> None:
        self.data = data
        self.oid = oid


class PackedDumper(adapt.Dumper):
    format = Format.BINARY

    def dump(self, obj: Any) -> bytes:
        data: bytes = obj.data
        return data

    def get_key(self, obj: Any, format: adapt.PyFormat) -> Any:
        return (Packed, obj.oid)

    def upgrade(self, obj: Any, format: adapt.PyFormat) -> adapt.Dumper:
        dumper = PackedDumper(Packed)
        dumper.oid = obj.oid
        return dumper


def register(conn: psycopg.AsyncConnection[Any]) -> None:
    """Let this connection send ``Packed`` parameters (the completer and the limited claim
    call it before each use: connections come from a pool that others may have set up)."""
    conn.adapters.register_dumper(Packed, PackedDumper)


def _array(name: str, count: int, elements: bytes, has_null: int = 0) -> Packed:
    info = _TYPES[name]
    if not count:
        return Packed(_EMPTY(0, 0, info.oid), info.array_oid)
    return Packed(_HEADER(1, has_null, info.oid, count, 1) + elements, info.array_oid)


def int8_array(values: list[int]) -> Packed:
    return _array("int8", len(values), b"".join(map(_INT8, repeat(8), values)))


def float8_array(values: list[float]) -> Packed:
    return _array("float8", len(values), b"".join(map(_FLOAT8, repeat(8), values)))


def uuid_array(values: list[Any]) -> Packed:
    return _array("uuid", len(values), b"".join([_UUID_LENGTH + v.bytes for v in values]))


def status_array(values: list[Status]) -> Packed:
    return _array("text", len(values), b"".join(map(_STATUS.__getitem__, values)))


def texts(values: list[str | None]) -> Packed | list[str | None]:
    """All NULL (the usual case): packed. Otherwise the list, for psycopg to encode."""
    if any(v is not None for v in values):
        return values
    return _array("text", len(values), _NULL * len(values), has_null=1)


def utf8_texts(conn: psycopg.AsyncConnection[Any], values: list[str]) -> Packed | list[str]:
    """Texts without NUL (names read from the database): packed when ``conn`` (registered)
    speaks UTF-8, else the list, for psycopg to encode."""
    if conn.pgconn.parameter_status(b"client_encoding") != b"UTF8":
        return values
    encoded = [v.encode() for v in values]
    return _array("text", len(values), b"".join([_LENGTH(len(e)) + e for e in encoded]))
