"""Every bad input is refused before any SQL runs (no database here: the App is never connected)."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pgqueue
from pgqueue import ConfigurationError, InvalidJobError, UnknownTaskError, producer
from pgqueue.jobs import EARLIEST_RUN_AT, LATEST_RUN_AT, MAX_DELAY_SECONDS
from pgqueue.producer import DEFAULT_MAX_PAYLOAD, serialize_args

# A DSN that is never used: every check below fails before the first connection.
NOWHERE = "postgresql://nobody@127.0.0.1:1/never"


@pytest.fixture
def app() -> pgqueue.App:
    application = pgqueue.App(NOWHERE)

    @application.task
    def send(to: str, subject: str = "") -> None: ...

    return application


class Opaque:
    pass


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({1, 2}, "set, which is not JSON-serialisable"),
        (Opaque(), "Opaque, which is not JSON-serialisable"),
        (b"bytes", "bytes, which is not JSON-serialisable"),
        ({"nested": [1, {2}]}, "set, which is not JSON-serialisable"),
        ({1: "x"}, "non-string key 1"),
        (float("nan"), "no NaN or Infinity"),
        (float("inf"), "no NaN or Infinity"),
        ([0.0, -math.inf], "no NaN or Infinity"),
        ("a\x00b", "contains NUL"),
        ({"k\x00": 1}, "key containing NUL"),
        (["ok", "no\u0000"], "contains NUL"),
        ("lone \ud800 surrogate", "lone surrogate"),
        ({"\udc00": 1}, "key that is not valid UTF-8"),
    ],
)
def test_non_json_argument_is_refused_with_its_path(
    app: pgqueue.App, value: object, message: str
) -> None:
    with pytest.raises(InvalidJobError, match=message) as info:
        app.enqueue("send", {"to": value})
    assert "to" in str(info.value)  # the message names the argument


def test_arguments_nested_too_deeply_are_refused(app: pgqueue.App) -> None:
    deep: list[object] = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(InvalidJobError, match="argument to is nested more than 100 levels deep"):
        app.enqueue("send", {"to": deep})
    ok: list[object] = []
    for _ in range(99):
        ok = [ok]
    assert list(app._row_chunks([("send", {"to": ok})], allow_unknown=False))


def test_integer_too_long_for_json_is_refused(app: pgqueue.App) -> None:
    with pytest.raises(InvalidJobError, match="not JSON-serialisable: Exceeds the limit"):
        app.enqueue("send", {"to": 10**5000})


def test_queue_name_with_a_lone_surrogate_is_refused(app: pgqueue.App) -> None:
    with pytest.raises(InvalidJobError, match="queue name contains a lone surrogate"):
        app.enqueue("send", {"to": "a"}, queue="q\ud800")


def test_argument_names_must_be_identifiers(app: pgqueue.App) -> None:
    with pytest.raises(InvalidJobError, match="not a valid Python identifier"):
        app.enqueue("send", {"not an identifier": 1})


def test_args_must_be_a_mapping(app: pgqueue.App) -> None:
    with pytest.raises(InvalidJobError, match="args must be a mapping"):
        app.enqueue("send", ["a"])  # type: ignore[arg-type]


def test_payload_over_the_default_limit_is_refused(app: pgqueue.App) -> None:
    just_fits = "x" * (DEFAULT_MAX_PAYLOAD - len('{"to":""}'))
    assert len(serialize_args({"to": just_fits}, DEFAULT_MAX_PAYLOAD)) == DEFAULT_MAX_PAYLOAD
    with pytest.raises(InvalidJobError, match=r"1,048,577 bytes as JSON; the limit is 1,048,576"):
        app.enqueue("send", {"to": just_fits + "x"})


def test_payload_limit_counts_utf8_bytes_not_characters() -> None:
    with pytest.raises(InvalidJobError, match="the limit is 20 bytes"):
        serialize_args({"a": "é" * 8}, 20)  # 8 chars, 16 bytes + 8 bytes of JSON


def test_configured_payload_limit_is_enforced() -> None:
    small = pgqueue.App(NOWHERE, max_payload_bytes=100)
    with pytest.raises(InvalidJobError, match="the limit is 100 bytes"):
        small.enqueue("t", {"blob": "x" * 100}, allow_unknown=True)
    with pytest.raises(ConfigurationError, match="max_payload_bytes must be positive"):
        pgqueue.App(NOWHERE, max_payload_bytes=0)


def test_unknown_task_is_refused_and_lists_the_known_ones(app: pgqueue.App) -> None:
    with pytest.raises(UnknownTaskError, match=r"unknown task 'nope' \(registered: send\)"):
        app.enqueue("nope", {})
    with pytest.raises(UnknownTaskError, match=r"job #1: unknown task 'nope'"):
        app.enqueue_many([("send", {"to": "a"}), ("nope", {})])


@pytest.mark.parametrize(
    ("queue", "message"),
    [
        ("", "queue name must not be empty"),
        ("   ", "queue name must not be empty"),
        ("q" * 129, "queue name is 129 characters; the limit is 128"),
        ("a\x00", "must not contain NUL"),
        (42, "queue name must be a string"),
        # `pgqueue worker --queues` splits on commas and strips spaces: never servable.
        ("a,b", "queue name 'a,b' must not contain a comma"),
        (" emails", "must not start or end with whitespace"),
        ("emails ", "must not start or end with whitespace"),
        ("emails\n", "must not start or end with whitespace"),
    ],
)
def test_bad_queue_names_are_refused(app: pgqueue.App, queue: Any, message: str) -> None:
    with pytest.raises(InvalidJobError, match=message):
        app.enqueue("send", {"to": "a"}, queue=queue)
    with pytest.raises(InvalidJobError, match=message):
        app.enqueue_many([{"task": "send", "args": {"to": "a"}, "queue": queue}])
    with pytest.raises(InvalidJobError, match=message):
        app.tasks["send"].configure(queue=queue)


def test_queue_names_with_inner_spaces_are_accepted(app: pgqueue.App) -> None:
    row = app._row(
        "send", {"to": "a"}, queue="daily reports", priority=None, max_attempts=None,
        delay=None, run_at=None, allow_unknown=False,
    )  # fmt: skip
    assert row.queue == "daily reports"


def test_queue_of_exactly_128_characters_is_accepted(app: pgqueue.App) -> None:
    row = app._row(
        "send",
        {"to": "a"},
        queue="é" * 128,
        priority=None,
        max_attempts=None,
        delay=None,
        run_at=None,
        allow_unknown=False,
    )
    assert row.queue == "é" * 128


def test_bad_queue_in_task_declaration_or_app_default_is_refused() -> None:
    app = pgqueue.App(NOWHERE)
    with pytest.raises(ConfigurationError, match="queue name is 200 characters"):
        app.task(queue="q" * 200)(lambda: None)
    with pytest.raises(ConfigurationError, match="queue name must not be empty"):
        pgqueue.App(NOWHERE, default_queue=" ")
    with pytest.raises(ConfigurationError, match="queue name must not be empty"):
        app.task(queue="")(lambda: None)
    with pytest.raises(ConfigurationError, match="must not contain a comma"):
        app.task(queue="emails,sms")(lambda: None)
    with pytest.raises(ConfigurationError, match="must not start or end with whitespace"):
        pgqueue.App(NOWHERE, default_queue="default ")
    assert not app.tasks


@pytest.mark.parametrize(
    ("delay", "message"),
    [
        (-1, "non-negative"),
        (-0.001, "non-negative"),
        (timedelta(seconds=-5), "non-negative"),
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        ("10", "delay must be seconds or a timedelta"),
        (True, "delay must be seconds or a timedelta"),
        (1e300, r"delay must be at most 3,155,760,000 seconds \(100 years\), got 1e\+300"),
        (3e11, "delay must be at most"),  # the year 11533, which readers could not read back
        (MAX_DELAY_SECONDS + 1, "delay must be at most"),
        (timedelta.max, "delay must be at most"),
        (10**400, "delay must be at most .* got more than 1e\\+308"),  # beyond float's range
        (-(10**400), "non-negative .* got less than -1e\\+308"),
    ],
)
def test_bad_delays_are_refused(app: pgqueue.App, delay: Any, message: str) -> None:
    with pytest.raises(InvalidJobError, match=message):
        app.enqueue("send", {"to": "a"}, delay=delay)
    with pytest.raises(InvalidJobError, match=f"job #0: .*{message}"):
        app.enqueue_many([{"task": "send", "args": {"to": "a"}, "delay": delay}])
    with pytest.raises(InvalidJobError, match=message):
        app.tasks["send"].configure(delay=delay)


@pytest.mark.parametrize(
    "run_at",
    [
        datetime(9999, 12, 31, 23, 59, tzinfo=UTC),
        datetime(1, 1, 1, tzinfo=UTC),
        datetime(3000, 1, 1, 0, 0, 1, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, tzinfo=UTC),
        datetime(2999, 12, 31, 20, tzinfo=timezone(timedelta(hours=-5))),  # 3000-01-01 01:00Z
    ],
)
def test_run_at_outside_the_readable_range_is_refused(app: pgqueue.App, run_at: datetime) -> None:
    message = r"run_at must be between 1970-01-01 and 3000-01-01 \(UTC\)"
    with pytest.raises(InvalidJobError, match=message):
        app.enqueue("send", {"to": "a"}, run_at=run_at)
    with pytest.raises(InvalidJobError, match=f"job #0: .*{message}"):
        app.enqueue_many([{"task": "send", "args": {"to": "a"}, "run_at": run_at}])
    with pytest.raises(InvalidJobError, match=message):
        app.tasks["send"].configure(run_at=run_at)


@pytest.mark.parametrize(
    ("delay", "run_at"),
    [(MAX_DELAY_SECONDS, None), (0, None), (None, EARLIEST_RUN_AT), (None, LATEST_RUN_AT)],
)
def test_the_bounds_themselves_are_accepted(
    app: pgqueue.App, delay: float | None, run_at: datetime | None
) -> None:
    app.tasks["send"].configure(delay=delay, run_at=run_at)
    row = app._row(
        "send", {"to": "a"}, queue=None, priority=None, max_attempts=None, delay=delay,
        run_at=run_at, allow_unknown=False,
    )  # fmt: skip
    assert (row.delay, row.run_at) == (delay or 0, run_at)


def test_configure_refuses_bad_options_where_they_are_written(app: pgqueue.App) -> None:
    send = app.tasks["send"]
    with pytest.raises(InvalidJobError, match="priority must be between"):
        send.configure(priority=2**31)
    with pytest.raises(InvalidJobError, match="max_attempts must be between 1"):
        send.configure(max_attempts=0)
    with pytest.raises(InvalidJobError, match="give delay or run_at, not both"):
        send.configure(delay=1, run_at=datetime.now(UTC))


def test_naive_run_at_is_refused(app: pgqueue.App) -> None:
    with pytest.raises(InvalidJobError, match="run_at must be timezone-aware"):
        app.enqueue("send", {"to": "a"}, run_at=datetime(2030, 1, 1))


def test_run_at_must_be_a_datetime(app: pgqueue.App) -> None:
    with pytest.raises(InvalidJobError, match="run_at must be a datetime"):
        app.enqueue("send", {"to": "a"}, run_at="2030-01-01")  # type: ignore[arg-type]


def test_delay_and_run_at_together_are_refused(app: pgqueue.App) -> None:
    with pytest.raises(InvalidJobError, match="give delay or run_at, not both"):
        app.enqueue("send", {"to": "a"}, delay=1, run_at=datetime.now(UTC))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"priority": 2**31}, "priority must be between"),
        ({"priority": -(2**31)}, "priority must be between"),
        ({"priority": 1.5}, "priority must be an integer"),
        ({"priority": True}, "priority must be an integer"),
        ({"max_attempts": 0}, "max_attempts must be between 1 and"),
        ({"max_attempts": -1}, "max_attempts must be between 1 and"),
        ({"max_attempts": 2**31}, "max_attempts must be between 1 and"),
        ({"max_attempts": "3"}, "max_attempts must be an integer"),
    ],
)
def test_priority_and_max_attempts_ranges(
    app: pgqueue.App, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidJobError, match=message):
        app.enqueue("send", {"to": "a"}, **options)


def test_priority_and_max_attempts_ranges_in_task_declaration() -> None:
    app = pgqueue.App(NOWHERE)
    with pytest.raises(ConfigurationError, match="max_attempts must be between 1"):
        app.task(max_attempts=0)(lambda: None)
    with pytest.raises(ConfigurationError, match="priority must be between"):
        app.task(priority=2**40)(lambda: None)


def test_task_enqueue_refuses_positional_arguments(app: pgqueue.App) -> None:
    send = app.tasks["send"]
    with pytest.raises(InvalidJobError, match="pass task arguments by keyword"):
        send.enqueue("a@example.com")


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"subject": "missing to"}, {"to": "a", "cc": "unexpected"}],
)
def test_arguments_not_matching_the_handler_signature_are_refused(
    app: pgqueue.App, kwargs: dict[str, Any]
) -> None:
    send = app.tasks["send"]
    with pytest.raises(InvalidJobError, match="arguments do not match task 'send'"):
        send.enqueue(**kwargs)


def test_job_context_parameter_is_not_an_argument_to_pass() -> None:
    app = pgqueue.App(NOWHERE)

    @app.task
    def handler(ctx: pgqueue.JobContext, n: int) -> None: ...

    handler.check_args({"n": 1})  # accepted without ctx
    with pytest.raises(InvalidJobError, match="arguments do not match"):
        handler.check_args({"n": 1, "ctx": None})


def test_configured_connection_of_the_wrong_kind_is_refused(app: pgqueue.App) -> None:
    send = app.tasks["send"]
    with pytest.raises(InvalidJobError, match="connection must be a psycopg Connection"):
        send.configure(connection=object()).enqueue(to="a")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "schema",
    ['x"; drop', "x;drop table y", "a.b", 'quo"te', "", "1abc", "a-b", "a b", "s" * 51],
)
def test_schema_names_that_need_quoting_are_refused(schema: str) -> None:
    with pytest.raises(ConfigurationError, match="invalid schema name"):
        pgqueue.App(NOWHERE, schema=schema)


def test_duplicate_task_name_is_refused() -> None:
    app = pgqueue.App(NOWHERE)

    @app.task(name="job")
    def first() -> None: ...

    def second() -> None: ...

    with pytest.raises(ConfigurationError, match="task name 'job' is already registered"):
        app.task(name="job")(second)
    app.task(name="job")(first.func)  # re-registering the same function is harmless


def test_enqueue_many_refuses_malformed_specs(app: pgqueue.App) -> None:
    with pytest.raises(InvalidJobError, match=r"job #0: unknown keys \['prio'\]"):
        app.enqueue_many([{"task": "send", "args": {"to": "a"}, "prio": 1}])
    with pytest.raises(InvalidJobError, match="job #0: expected a mapping with a 'task' key"):
        app.enqueue_many([{"args": {}}])
    with pytest.raises(InvalidJobError, match=r"job #2: argument to contains NUL"):
        app.enqueue_many([("send", {"to": "a"})] * 2 + [("send", {"to": "\x00"})])


def test_missing_dsn_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGQUEUE_DSN", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    with pytest.raises(ConfigurationError, match="set PGQUEUE_DSN or DATABASE_URL"):
        _ = pgqueue.App().dsn


def test_dsn_falls_back_to_pgqueue_dsn_then_database_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://db-url/x")
    monkeypatch.delenv("PGQUEUE_DSN", raising=False)
    assert pgqueue.App().dsn == "postgresql://db-url/x"
    monkeypatch.setenv("PGQUEUE_DSN", "postgresql://pgqueue-dsn/x")
    assert pgqueue.App().dsn == "postgresql://pgqueue-dsn/x"
    assert pgqueue.App("postgresql://arg/x").dsn == "postgresql://arg/x"


# --- property: any JSON-compatible dict round-trips ---------------------------------------

_text = st.text(st.characters(exclude_characters="\x00", exclude_categories=["Cs"]))
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(_text, children, max_size=5),
    max_leaves=25,
)
_identifier = st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_]{0,20}\Z")


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_identifier, _json, max_size=6))
def test_any_json_compatible_dict_round_trips(args: dict[str, Any]) -> None:
    text = serialize_args(args, DEFAULT_MAX_PAYLOAD)
    assert json.loads(text) == args


@pytest.mark.parametrize("value", [1e16, -6.554488676156261e16, 1.5e300, [2e22, {"a": 1e17}]])
def test_floats_of_1e16_and_more_are_written_with_a_decimal_point(value: object) -> None:
    # jsonb would store '1e+16' as numeric 10000000000000000 and hand back an int
    text = serialize_args({"v": value, "s": "e+ inside a string"}, DEFAULT_MAX_PAYLOAD)
    assert "e+" not in text.replace("e+ inside", "")
    assert json.loads(text) == {"v": value, "s": "e+ inside a string"}
    assert all(isinstance(x, float) for x in _floats(json.loads(text)["v"]))


def _floats(value: object) -> list[object]:
    if isinstance(value, list):
        return [f for item in value for f in _floats(item)]
    if isinstance(value, dict):
        return [f for item in value.values() for f in _floats(item)]
    return [value]


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_identifier, _json, max_size=6))
def test_exact_float_writer_matches_the_fast_encoder(args: dict[str, Any]) -> None:
    # The rare path (a float of 1e16 or more) must write everything else byte for byte alike,
    # or the same arguments would make two unique keys.
    fast = producer._ENCODER.encode(args)
    if "e+" not in fast:
        assert producer._exact_json(args) == fast
    assert json.loads(producer._exact_json(args)) == args


_any_text = st.text()  # NUL and lone surrogates included
_scalar = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**4200, max_value=10**4400)  # beyond int-to-str's digit limit
    | st.floats()  # NaN, infinities and 1e16 and more included
    | _any_text
    | st.sampled_from(["a\x00b", "\\u0000", "lone \ud800", "1e+16", "é ✓"])
)
_name = _identifier | _any_text | st.integers(max_value=3)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(_name, _scalar, max_size=5), st.sampled_from([40, DEFAULT_MAX_PAYLOAD]))
def test_flat_arguments_take_a_shortcut_to_the_same_text_or_error(
    args: dict[Any, Any], limit: int
) -> None:
    """Plain scalar arguments skip the walk (``_flat_json``): whatever they hold, the outcome is
    the walk's, the same text or the same InvalidJobError."""

    def outcome(shortcut: bool) -> str:
        original = producer._flat_json
        if not shortcut:
            producer._flat_json = lambda args, limit: None  # type: ignore[assignment]
        try:
            return serialize_args(args, limit)
        except InvalidJobError as exc:
            return f"refused: {exc}"
        finally:
            producer._flat_json = original

    assert outcome(shortcut=True) == outcome(shortcut=False)
