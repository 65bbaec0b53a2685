"""A scenario's `acceptance` key: which acceptance model decides the accept counts
(`reference.acceptance`), parsed from a string shorthand or a table into an `AcceptanceSpec`,
written back as a table, and checked where only the outside world can tell (the file model's
file, the oracle's factory).

Every refusal is a `ScenarioError` naming the key (`acceptance`, `acceptance.p`, ...), what is
allowed and the value given (`reference.scenario_values`). `reference.scenario` re-exports
the public names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raggedspec.reference.acceptance import load_accept_file, resolve_factory
from raggedspec.reference.scenario_values import choice, fail, probability

ACCEPTANCE_MODELS = (
    "geometric",
    "profile",
    "heterogeneous",
    "all-accept",
    "all-reject",
    "file",
    "oracle",
)
PROB_MODELS = ("geometric", "profile", "heterogeneous")
EXAMPLES = {"geometric": "geometric:0.7", "profile": "profile:0.74,0.54,0.41",
            "heterogeneous": "heterogeneous:0.2,0.9"}
TABLE_KEYS = ("model", "p", "p_range", "path", "factory")


@dataclass(frozen=True)
class AcceptanceSpec:
    """Which acceptance model decides the accept counts (reference/acceptance.py).
    `p`: geometric -> one probability; profile -> per draft position; heterogeneous -> per
    sequence (cycled by id); `p_range`: heterogeneous alternative (per-sequence probability
    drawn in [lo, hi]); `path`: the file model's JSON; `factory`: "module:callable" returning a
    `TokenOracle` (the oracle model)."""

    model: str = "geometric"
    p: tuple[float, ...] = (0.7,)
    p_range: tuple[float, float] | None = None
    path: str | None = None
    factory: str | None = None


def parse_acceptance(value: Any) -> AcceptanceSpec:
    """A string shorthand (`geometric:0.7`, `profile:0.74,0.54,0.41`, `heterogeneous:0.2,0.9`,
    `all-accept`, `all-reject`, `file:PATH`, `oracle:module:callable`) or a table.

    Probabilities are never made up: `profile` needs 1..=8 of them, `heterogeneous` at least
    two (one per class of sequences, cycled by id; for one probability use `geometric`) or a
    `p_range` (not both); `geometric` takes exactly one, and a bare `geometric` (no colon, no
    `p`) is the documented default 0.7. An empty list after the colon (`profile:`) and an
    argument to a model that takes none (`all-accept:0.5`) are refused. This only parses:
    `load_scenario` then checks the file and the factory (`check_acceptance`)."""
    if isinstance(value, AcceptanceSpec):
        return value
    if isinstance(value, str):
        value = shorthand_table(value)
    if not isinstance(value, dict):
        fail("acceptance", "must be a string like geometric:0.7 or a table {model, p, ...}",
             value)
    unknown = set(value) - set(TABLE_KEYS)
    if unknown:
        fail(f"acceptance.{sorted(unknown)[0]}",
             "unknown key; allowed: model, p, p_range, path, factory", value[sorted(unknown)[0]])
    model = choice("acceptance.model", value.get("model", "geometric"), ACCEPTANCE_MODELS)
    p = value.get("p")
    if p is not None and not isinstance(p, (list, tuple)):
        p = [p]
    p = list(p) if p else []
    p_range = value.get("p_range")
    probs = model_probabilities(model, p, p_range)
    p_range = checked_p_range(model, p_range)
    path = value.get("path")
    if model == "file" and not (isinstance(path, str) and path):
        fail("acceptance.path", "the file model needs a JSON path", path)
    factory = value.get("factory")
    if model == "oracle" and not (isinstance(factory, str) and ":" in factory):
        fail("acceptance.factory", "the oracle model needs 'module:callable'", factory)
    return AcceptanceSpec(model, probs, p_range, path if model == "file" else None,
                          factory if model == "oracle" else None)


def shorthand_table(text: str) -> dict[str, Any]:
    """The table of a string shorthand `model[:argument]`: probabilities (comma-separated) for
    geometric, profile and heterogeneous, the path for `file:`, the factory for `oracle:`.
    Refuses (naming `acceptance` and the whole string) an empty argument after a probability
    model's colon, probabilities that are not numbers, and an argument to a model that takes
    none. An unknown model name passes through (the table check names it)."""
    name, colon, arg = text.partition(":")
    table: dict[str, Any] = {"model": name}
    if name in PROB_MODELS:
        if colon and not arg.strip():
            fail("acceptance", f"'{name}:' needs its probabilities after the colon, e.g. "
                 f"{EXAMPLES[name]}", text)
        if arg:
            try:
                table["p"] = [float(x) for x in arg.split(",")]
            except ValueError:
                fail("acceptance",
                     f"probabilities must be comma-separated numbers, e.g. {EXAMPLES[name]}",
                     text)
    elif name == "file":
        table["path"] = arg
    elif name == "oracle":
        table["factory"] = arg
    elif colon and name in ACCEPTANCE_MODELS:
        fail("acceptance", f"'{name}' takes no argument", text)
    return table


def model_probabilities(model: str, p: list, p_range: Any) -> tuple[float, ...]:
    """The probabilities `model` keeps from the list `p`: geometric exactly one (none given:
    the default 0.7), profile 1..=8, heterogeneous at least two unless a `p_range` is given
    (then none); each in [0, 1]. Any other model keeps none: its `p` is ignored, not refused
    (headers written before this rule carried the default p = [0.7] for every model)."""
    if model not in PROB_MODELS:
        return ()
    if model == "geometric":
        probs = tuple(probability("acceptance.p", x) for x in (p or [0.7]))
        if len(probs) != 1:
            fail("acceptance.p", "geometric takes exactly one probability, e.g. geometric:0.7", p)
        return probs
    probs = tuple(probability("acceptance.p", x) for x in p)
    if model == "profile" and not 1 <= len(probs) <= 8:
        fail("acceptance.p", "profile needs 1..=8 per-position probabilities (one per draft "
             "position, the last repeats), e.g. profile:0.74,0.54,0.41", p)
    if model == "heterogeneous" and p_range is None and len(probs) < 2:
        fail("acceptance.p", "heterogeneous needs at least two probabilities (sequence i gets "
             "p[i mod n]; for one probability for every sequence use geometric:p), e.g. "
             "heterogeneous:0.2,0.9, or a p_range = [low, high]", p)
    if model == "heterogeneous" and p_range is not None and probs:
        fail("acceptance.p", "heterogeneous takes either p (a list) or p_range, not both", p)
    return probs


def checked_p_range(model: str, p_range: Any) -> tuple[float, float] | None:
    """`p_range` as `(low, high)` probabilities with low <= high, or None when not given.
    Refuses it on a model other than heterogeneous and anything but a pair."""
    if p_range is None:
        return None
    if model != "heterogeneous" or not isinstance(p_range, (list, tuple)) or len(p_range) != 2:
        fail("acceptance.p_range", "only for heterogeneous: a [low, high] pair of probabilities",
             p_range)
    p_range = (probability("acceptance.p_range", p_range[0]),
               probability("acceptance.p_range", p_range[1]))
    if p_range[0] > p_range[1]:
        fail("acceptance.p_range", "must have low <= high", list(p_range))
    return p_range


def acceptance_table(spec: AcceptanceSpec) -> dict:
    """The table form of an AcceptanceSpec (only the keys its model uses; lists, not
    tuples): `parse_acceptance(acceptance_table(spec)) == spec`."""
    out: dict[str, Any] = {"model": spec.model}
    if spec.p:
        out["p"] = list(spec.p)
    if spec.p_range is not None:
        out["p_range"] = list(spec.p_range)
    if spec.path is not None:
        out["path"] = spec.path
    if spec.factory is not None:
        out["factory"] = spec.factory
    return out


def check_acceptance(spec: AcceptanceSpec, n_seqs: int) -> None:
    """What can only be checked outside the parser: the file model's file exists and holds
    valid accept counts (covering every one of the `n_seqs` sequences when it has no
    default), and the oracle's factory imports and is callable. Raises ScenarioError naming
    `acceptance.path` / `acceptance.factory` and the bad value (reference.acceptance)."""
    if spec.model == "file":
        load_accept_file(spec.path, n_seqs)
    elif spec.model == "oracle":
        resolve_factory(spec.factory)
