"""The value checks of a scenario, shared by `reference.scenario` and its acceptance and
request parsers (`reference.scenario_acceptance`, `reference.scenario_requests`).

Each check returns the value, converted where it says so, or raises `ScenarioError`
(`reference.errors`) in one wording: `scenario key 'KEY': WHAT IS ALLOWED, got VALUE`.
"""

from __future__ import annotations

from typing import Any

from raggedspec.reference.errors import ScenarioError


def fail(key: str, allowed: str, got: Any) -> None:
    """Refuse `got` for `key`: ScenarioError "scenario key 'KEY': ALLOWED, got GOT"."""
    raise ScenarioError(f"scenario key '{key}': {allowed}, got {got!r}")


def range_text(lo: int, hi: int | None) -> str:
    """The words for `lo..=hi`: " >= lo" without an upper bound, else " in lo..=hi"."""
    return f" >= {lo}" if hi is None else f" in {lo}..={hi}"


def integer(key: str, value: Any, lo: int, hi: int | None = None) -> int:
    """`value` as an int in `lo..=hi` (no upper bound when `hi` is None). Refuses a bool, a
    non-integer and a value out of range."""
    if isinstance(value, bool) or not isinstance(value, int):
        fail(key, f"must be an integer{range_text(lo, hi)}", value)
    if value < lo or (hi is not None and value > hi):
        fail(key, f"must be an integer{range_text(lo, hi)}", value)
    return int(value)


def optional_int(key: str, value: Any, lo: int) -> int | None:
    """None for None, else `integer(key, value, lo)`."""
    return None if value is None else integer(key, value, lo)


def choice(key: str, value: Any, allowed: tuple[str, ...]) -> str:
    """`value` when it is one of `allowed`; refuses anything else, listing them."""
    if value not in allowed:
        fail(key, f"must be one of {', '.join(allowed)}", value)
    return value


def boolean(key: str, value: Any) -> bool:
    """`value` when it is a bool (true or false); refuses anything else, 0 and 1 included."""
    if not isinstance(value, bool):
        fail(key, "must be true or false", value)
    return value


def int_range(key: str, value: Any, lo: int) -> tuple[int, int]:
    """An int or an inclusive [low, high] pair, each >= lo, as `(low, high)` (`(v, v)` for an
    int). Refuses a list that is not a pair and a pair with low > high."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            fail(key, f"must be an integer >= {lo} or an inclusive [low, high] pair", value)
        a, b = integer(key, value[0], lo), integer(key, value[1], lo)
        if a > b:
            fail(key, "range [low, high] must have low <= high", value)
        return a, b
    v = integer(key, value, lo)
    return v, v


def probability(key: str, value: Any) -> float:
    """`value` as a float in [0, 1]; refuses a bool, a non-number and a value outside."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0.0 <= float(value) <= 1.0
    ):
        fail(key, "must be a probability in [0, 1]", value)
    return float(value)
