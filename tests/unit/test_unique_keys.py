"""Unique keys: the same arguments make the same key however they are written or passed."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pgqueue import producer
from pgqueue.unique import UniqueRule, key_for

text = st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    text,
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(
    st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True), values, max_size=5
)


@given(arguments, st.randoms())
def test_the_key_of_the_same_arguments_does_not_depend_on_their_order_or_path(
    args: dict[str, Any], rnd: Any
) -> None:
    """enqueue (one job) and enqueue_many (a stored-JSON shortcut for flat sorted arguments)
    must agree, whatever order the caller wrote the arguments in."""
    rule = UniqueRule()
    shuffled = list(args.items())
    rnd.shuffle(shuffled)
    other = dict(shuffled)
    stored = producer.serialize_args(args, 10**7)
    stored_other = producer.serialize_args(other, 10**7)
    keys = {
        key_for("t", rule, args, None),
        key_for("t", rule, args, None, stored),
        key_for("t", rule, other, None),
        key_for("t", rule, other, None, stored_other),
    }
    assert len(keys) == 1


def test_different_arguments_or_tasks_make_different_keys() -> None:
    rule = UniqueRule()
    assert key_for("t", rule, {"a": 1}, None) != key_for("t", rule, {"a": 2}, None)
    assert key_for("t", rule, {"a": 1}, None) != key_for("u", rule, {"a": 1}, None)
    assert key_for("t", rule, {"a": 1}, None) != key_for("t", rule, {"a": 1.0}, None)
    named = UniqueRule(by=("a",))
    assert key_for("t", named, {"a": 1, "b": 2}, None) == key_for(
        "t", named, {"a": 1, "b": 3}, None
    )
