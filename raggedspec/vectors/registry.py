"""The vector functions: what each one calls, which spec section it pins, and its cases.

A vector function (`Fn`) is one rule seen from outside: JSON inputs (plus named tensors) in,
JSON outputs (plus named tensors) out, or a raised refusal. `call(backend, inputs)` runs it
on the reference (`backend` is a `raggedspec.reference.backend.NumpyBackend`; functions of the
backend
protocol go through it, so a port's backend can run the same adapter) and returns a dict of
outputs: host ints, bools, strings, None, lists, or NumPy arrays (which become tensors).
`cases(rng, n)` lists `(case name, inputs)`: the spec's worked examples (`example-*`), its
refusals (`refusal-*`), then `n` generated cases (`gen-<shape>-<i>`) whose shapes cycle
through ragged, uniform, empty and boundary batches, drawn from `rng` only.

This module holds `Fn` and the case helpers; `length_fns` (dispatch, draft, step),
`policy_fns` (capability, scheduler) and `tensor_fns` (masks, RoPE, align, attention) hold
the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

SHAPES = ("ragged", "uniform", "empty", "boundary")
BOUNDARY_LENGTHS = (0, 1, 2, 511, 512, 513)


@dataclass(frozen=True)
class Fn:
    """One vector function: `family/name`, its spec section (`spec`, e.g. "M §3"), the
    reference function it pins (`reference`, a dotted path named in docs/rules.md), the
    adapter `call(backend, inputs) -> outputs` and the case list `cases(rng, n)`.

    The JSON shape of its cases (`schema.case_schema` writes it as schema.json): `inputs` and
    `outputs` map each JSON name to its schema (`schema.Maybe` when a case may leave it out),
    `tensor_inputs` / `tensor_outputs` each tensor name (`k.<i>` for a numbered family) to
    `schema.tensor(dtype, rank)`. `policy` names the outputs set by the source engine's
    allocation policy rather than by a rule (the 512-column capacity growth), and
    `policy_cases` the cases whose whole expectation follows from that policy; a consumer may
    skip both."""

    family: str
    name: str
    spec: str
    reference: str
    call: Callable[[object, dict], dict]
    cases: Callable[[np.random.Generator, int], list[tuple[str, dict]]]
    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    tensor_inputs: dict = field(default_factory=dict)
    tensor_outputs: dict = field(default_factory=dict)
    policy: tuple[str, ...] = ()
    policy_cases: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.family}/{self.name}"


# ------------------------------------------------------------------------------ generators


def shape_of(i: int) -> str:
    """The batch shape of generated case i: ragged, uniform, empty, boundary in turn."""
    return SHAPES[i % len(SHAPES)]


def lengths(
    rng: np.random.Generator, shape: str, lo: int = 0, hi: int = 40, max_rows: int = 5
) -> list[int]:
    """Per-row lengths in `[lo, hi]` of the given batch shape: ragged (at least two rows
    differ), uniform (one length), empty (no row) or boundary (lengths at `lo`, `hi` and the
    512-column growth steps, clipped to the range)."""
    if shape == "empty":
        return []
    n = int(rng.integers(1 if shape != "ragged" else 2, max_rows + 1))
    if shape == "uniform":
        return [int(rng.integers(lo, hi + 1))] * n
    if shape == "boundary":
        pool = sorted({min(max(b, lo), hi) for b in BOUNDARY_LENGTHS + (lo, hi)})
        return [int(rng.choice(pool)) for _ in range(n)]
    out = [int(x) for x in rng.integers(lo, hi + 1, size=n)]
    if len(set(out)) == 1:
        out[0] = lo if out[0] != lo else hi
    return out


def leads(lens: list[int]) -> list[int]:
    """Front-alignment leads `max - len_i` (empty -> empty)."""
    top = max(lens, default=0)
    return [top - n for n in lens]


def generated(n: int, make: Callable[[str, int], dict]) -> list[tuple[str, dict]]:
    """`n` generated cases `gen-<shape>-<i>` from `make(shape, i)`."""
    return [(f"gen-{shape_of(i)}-{i:03d}", make(shape_of(i), i)) for i in range(n)]


def fixed(**named: dict) -> list[tuple[str, dict]]:
    """Named fixed cases, `example_x=...` -> `example-x` (underscores become dashes)."""
    return [(k.replace("_", "-"), v) for k, v in named.items()]


def plain(fn: Callable, out: str, *args: str) -> Callable[[object, dict], dict]:
    """An adapter calling `fn(*[inputs[a] for a in args])` and naming its result `out`."""
    return lambda _b, inp: {out: fn(*[inp[a] for a in args])}
