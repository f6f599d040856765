"""Unique jobs: the rule a task or a call gives, checked where it is written, and the key it
makes for a job.

The key is ``task:key``, where ``key`` is the caller's string, a callable's result, or a hash of
the arguments (all of them, or the named ones), so keys never collide across tasks and a key
of any length fits the unique index. PostgreSQL enforces it (``insert_unique_job``).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Literal

from .errors import InvalidJobError
from .jobs import MAX_DELAY_SECONDS

#: While a key holds: a rule's name, or the job states it names (a collection of state names:
#: queued and retrying for "waiting", those and running for "active").
UniqueWhile = Literal["waiting", "active"] | Collection[str]
OnConflict = Literal["keep", "replace", "debounce"]
#: How a task makes its key: True (every argument), the names of the arguments that matter, or
#: a function of the arguments returning a string.
UniqueBy = bool | Sequence[str] | Callable[[dict[str, Any]], str]

UNIQUE_WHILE: tuple[str, ...] = ("waiting", "active")
ON_CONFLICT: tuple[str, ...] = ("keep", "replace", "debounce")
#: Longest stored key in UTF-8 bytes (btree entries have a size limit near 2.7 KB).
MAX_KEY_BYTES = 1000


@dataclass(frozen=True, slots=True)
class UniqueRule:
    by: UniqueBy = True
    #: "waiting": a second job is refused while the first is queued or retrying; "active":
    #: also while it runs.
    while_: str = "active"
    #: Seconds after the first job's success during which a second is still refused.
    for_: float | None = None
    on_conflict: str = "keep"


def check_by(by: object) -> UniqueBy:
    if by is True or callable(by):
        return by
    if isinstance(by, str) or not isinstance(by, Sequence) or not by:
        raise InvalidJobError(
            "unique must be True, a list of argument names, or a function of the arguments "
            f"returning the key, got {by!r}"
        )
    for name in by:
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidJobError(f"unique: {name!r} is not an argument name")
    return tuple(by)


#: The job states each rule refuses a second job in, for a ``unique_while`` given as states.
_WHILE_STATES = {
    frozenset({"queued", "retrying"}): "waiting",
    frozenset({"queued", "retrying", "running"}): "active",
}


def check_while(value: object) -> str:
    if isinstance(value, str):
        if value in UNIQUE_WHILE:
            return value
    elif isinstance(value, Collection) and all(isinstance(v, str) for v in value):
        rule = _WHILE_STATES.get(frozenset(value))
        if rule is not None:
            return rule
        if "succeeded" in value:
            raise InvalidJobError(
                "unique_while: a key is kept after success with unique_for=SECONDS (beside "
                f"unique_while='active' or 'waiting'), not with a state; got {value!r}"
            )
    raise InvalidJobError(
        "unique_while must be 'waiting' (queued or retrying) or 'active' (also while "
        "running), or those states as a list (['queued', 'retrying'] or ['queued', "
        f"'retrying', 'running']), got {value!r}"
    )


def check_for(value: object) -> float | None:
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not 0 < seconds <= MAX_DELAY_SECONDS
        or (isinstance(seconds, float) and not math.isfinite(seconds))
    ):
        raise InvalidJobError(
            "unique_for must be a positive number of seconds (at most 100 years) or a "
            f"timedelta, got {value!r}"
        )
    return float(seconds)


def check_on_conflict(value: object) -> str:
    if value not in ON_CONFLICT:
        raise InvalidJobError(f"on_conflict must be 'keep', 'replace' or 'debounce', got {value!r}")
    return str(value)


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise InvalidJobError(f"a unique key must be a non-empty string, got {key!r}")
    if "\x00" in key:
        raise InvalidJobError("a unique key must not contain NUL (\\u0000)")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidJobError("a unique key contains a lone surrogate (not valid UTF-8)") from None
    if size > MAX_KEY_BYTES:
        raise InvalidJobError(
            f"a unique key is {size:,} bytes; the limit is {MAX_KEY_BYTES:,} (pass a shorter "
            "key, or unique=True to key on a hash of the arguments)"
        )
    return key


def combine(
    base: UniqueRule | None,
    *,
    unique: object = None,
    unique_while: object = None,
    unique_for: object = None,
    on_conflict: object = None,
    unique_key: object = None,
) -> tuple[UniqueRule | None, str | None]:
    """The rule for one call: the task's, changed by the call's options (None: unchanged;
    ``unique=False`` turns it off). Returns (rule, the caller's explicit key)."""
    rule = base
    if unique is False:
        if unique_key is not None:
            raise InvalidJobError("unique=False and unique_key contradict each other")
        rule = None
    elif unique is not None:
        rule = replace(base or UniqueRule(), by=check_by(unique))
    key = check_key(unique_key) if unique_key is not None else None
    if key is not None and rule is None:
        rule = UniqueRule()
    changes: dict[str, Any] = {}
    if unique_while is not None:
        changes["while_"] = check_while(unique_while)
    if unique_for is not None:
        changes["for_"] = check_for(unique_for)
    if on_conflict is not None:
        changes["on_conflict"] = check_on_conflict(on_conflict)
    if changes:
        if rule is None:
            raise InvalidJobError(
                f"{', '.join(sorted(k.rstrip('_') for k in changes))} given for a job that is "
                "not unique: pass unique=True (or a key) too"
            )
        rule = replace(rule, **changes)
    return rule, key


# Keys sorted at every level, so the same arguments in any order make the same key.
def plain_mapping(value: object) -> object:
    """For the JSON encoders (here and in the producer): a mapping other than a dict
    (``MappingProxyType``, a read-only view), which the argument checks accept and json cannot
    encode, as a dict."""
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_CANONICAL = json.JSONEncoder(
    sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=plain_mapping
)


def _digest(value: Any) -> str:
    return hashlib.sha256(_CANONICAL.encode(value).encode("utf-8")).hexdigest()[:32]


_SCALARS = (str, int, float, bool, type(None))


_sha256 = hashlib.sha256


def _canonical_already(args: Mapping[str, Any], args_json: str) -> bool:
    """True when ``args_json`` (the stored JSON) is exactly what _CANONICAL would write: scalar
    values only, names in sorted order, and no float the producer writes its own way (1e16 and
    up, as ``10000000000000000.0``). The common case, and it saves encoding the arguments again."""
    previous = ""
    for name, value in args.items():
        if name < previous:
            return False
        kind = type(value)
        if kind is float:
            if "e+" in float.__repr__(value):
                return False
        elif kind not in _SCALARS:
            return False
        previous = name
    return True


def key_for(
    task: str,
    rule: UniqueRule,
    args: Mapping[str, Any],
    explicit: str | None,
    args_json: str | None = None,
) -> str:
    """The stored key of one job (its arguments were checked already; ``args_json``, if given,
    is their stored JSON)."""
    if explicit is not None:
        return f"{task}:{explicit}"
    by = rule.by
    if by is True:
        if args_json is not None and _canonical_already(args, args_json):
            return task + ":" + _sha256(args_json.encode()).hexdigest()[:32]
        return f"{task}:{_digest(args)}"
    if callable(by):
        try:
            made = by(dict(args))
        except Exception as exc:
            raise InvalidJobError(
                f"the unique key function of task {task!r} failed: {type(exc).__name__}: {exc}"
            ) from None
        return f"{task}:{check_key(made)}"
    assert not isinstance(by, bool)
    return f"{task}:{_digest({name: args[name] for name in by if name in args})}"
