"""Vector functions of the K/V slot rules: front alignment, dead-prefix strip,
concatenation, split, and the draft group's front alignment.

Every adapter builds its slots through the backend it is given (`kv_from_arrays`) and reads
them back with `materialize` (length, capacity, front-aligned K and V), so the reference and
a port run the same adapter. Slot `i` of a case is `k.<i>` / `v.<i>` `[1, HEADS, n_i, DIM]`,
drawn float64 from the case's generator.
"""

from __future__ import annotations

import numpy as np

from raggedspec.vectors.registry import Fn, fixed, generated, lengths
from raggedspec.vectors.tensor_fns import random_array
from raggedspec.reference.cache import PLAIN_CACHE_CAPACITY

HEADS, DIM = 2, 4  # K/V slot shape of the align cases: [1, HEADS, n, DIM]


# ------------------------------------------------------------------------------ align


def _rows_inputs(rng, lens: list[int], **extra) -> dict:
    inp = {"n_rows": len(lens), "max_seq_len": 4096, **extra}
    for r, n in enumerate(lens):
        inp[f"k.{r}"], inp[f"v.{r}"] = (
            random_array(rng, 1, HEADS, n, DIM),
            random_array(rng, 1, HEADS, n, DIM),
        )
    return inp


def _kvs(b, i) -> list:
    caps = i.get("capacities") or [PLAIN_CACHE_CAPACITY] * i["n_rows"]
    return [
        b.kv_from_arrays(i[f"k.{r}"], i[f"v.{r}"], i["max_seq_len"], caps[r])
        for r in range(i["n_rows"])
    ]


def _read(b, kvs: list, prefix: str = "") -> dict:
    out = {f"{prefix}lens": [], f"{prefix}capacities": []}
    for r, kv in enumerate(kvs):
        m = b.materialize(kv)
        out[f"{prefix}lens"].append(int(m["len"]))
        out[f"{prefix}capacities"].append(int(m["capacity"][0]))
        k, v = m["kv"][0]
        out[f"{prefix}k.{r}"] = None if k is None else np.asarray(k, dtype=np.float64)
        out[f"{prefix}v.{r}"] = None if v is None else np.asarray(v, dtype=np.float64)
    return out


def _align_lens(rng, shape):
    return lengths(rng, shape, 1, 20, max_rows=4) or [int(rng.integers(1, 20))]


def _front_align_cases(rng, n):
    return fixed(
        example_lives_12_and_10=_rows_inputs(rng, [12, 10]),
        example_uniform=_rows_inputs(rng, [5, 5, 5]),
        example_growth_boundary=_rows_inputs(rng, [513, 3]),
        refusal_capacity_above_max_seq_len=_rows_inputs(rng, [5, 3], max_seq_len=8),
    ) + generated(n, lambda shape, i: _rows_inputs(rng, _align_lens(rng, shape)))


def _front_align(b, i):
    kvs = _kvs(b, i)
    return {"leads": [int(x) for x in b.front_align(kvs)], **_read(b, kvs)}


def _strip_cases(rng, n):
    def make(shape, i):
        lens = _align_lens(rng, shape)
        return _rows_inputs(rng, lens[:1], lead=int(rng.integers(0, lens[0] + 2)))

    return fixed(
        example_lead_3=_rows_inputs(rng, [10], lead=3),
        example_lead_0=_rows_inputs(rng, [4], lead=0),
        refusal_lead_past_current=_rows_inputs(rng, [4], lead=5),
    ) + generated(n, make)


def _strip(b, i):
    kvs = _kvs(b, i)
    b.strip_dead_prefix(kvs[0], i["lead"])
    return _read(b, kvs)


def _concat_cases(rng, n):
    # rows of one length (concatenation follows front alignment), capacities differing
    def make(shape, i):
        lens = _align_lens(rng, shape)
        caps = [int(rng.choice([512, 1024])) for _ in lens]
        return _rows_inputs(rng, [lens[0]] * len(lens), capacities=caps)

    return fixed(
        example_three_rows=_rows_inputs(rng, [6, 6, 6]),
        example_capacity_slack=_rows_inputs(rng, [6, 6], capacities=[512, 1024]),
    ) + generated(n, make)


def _concat(b, i):
    return _read(b, [b.concat(_kvs(b, i))])


def _split_cases(rng, n):
    def make(shape, i):
        lens = _align_lens(rng, shape)
        return _rows_inputs(
            rng, [lens[0]], rows_of_batch=int(rng.integers(1, 4)), g=int(rng.integers(1, 5))
        )

    return fixed(
        example_three_pieces=_rows_inputs(rng, [7], rows_of_batch=3, g=3),
        example_piece_count_mismatch=_rows_inputs(rng, [7], rows_of_batch=2, g=3),
    ) + generated(n, make)


def _split(b, i):
    rows = (
        np.concatenate([i["k.0"]] * i["rows_of_batch"]),
        np.concatenate([i["v.0"]] * i["rows_of_batch"]),
    )
    pieces = b.split(b.kv_from_arrays(rows[0], rows[1], i["max_seq_len"]), i["g"])
    return {"pieces": None} if pieces is None else {"pieces": len(pieces), **_read(b, pieces)}


def _draft_group_cases(rng, n):
    def make(shape, i):
        lens = _align_lens(rng, shape)
        starts = [int(rng.integers(0, x + 1)) for x in lens]
        if i % 6 == 5:
            starts[0] = lens[0] + 1
        return _rows_inputs(rng, lens, starts=starts if i % 9 != 8 else starts[:-1] + [0, 0])

    return fixed(
        example_ragged_starts=_rows_inputs(rng, [12, 9, 11], starts=[10, 7, 9]),
        refusal_count_mismatch=_rows_inputs(rng, [5, 5], starts=[3]),
        refusal_start_past_held=_rows_inputs(rng, [5, 5], starts=[3, 6]),
    ) + generated(n, make)


def _draft_group(b, i):
    return _read(b, [b.front_align_draft_group(_kvs(b, i), i["starts"])])


def align_functions() -> list[Fn]:
    """The K/V slot vector functions, in manifest order."""
    return [
        Fn(
            "align",
            "front_align",
            "C §4.5",
            "reference.align.front_align_batch",
            _front_align,
            _front_align_cases,
        ),
        Fn(
            "align",
            "strip_dead_prefix",
            "C §4.4",
            "reference.align.drop_dead_prefix",
            _strip,
            _strip_cases,
        ),
        Fn("align", "concat", "C §5.2", "reference.align.concat_kv", _concat, _concat_cases),
        Fn("align", "split", "C §9.8", "reference.align.split_draft_cache", _split, _split_cases),
        Fn(
            "align",
            "front_align_draft_group",
            "C §9.7",
            "reference.align.front_align_draft_group",
            _draft_group,
            _draft_group_cases,
        ),
    ]
