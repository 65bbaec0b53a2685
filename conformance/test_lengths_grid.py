"""The lengths-only simulator against the tensor mode on a fixed grid of small scenarios.

Each scenario of the grid is drawn once, by a seeded generator, from the space the Hypothesis
property of test_lengths.py searches (batch up to 6, prompts up to 16 tokens, every advance
rule, world, strip policy, admission, arrival, LRU size, acceptance model and capacity). The
two modes are independent implementations of the same decisions (reference/lengths.py keeps
integers only, reference/simulator.py runs the tensors), so each must give the other's trace
line for line. The grid is small enough (about three seconds) for mutmut to run it on every
mutant of either mode; a second test checks that the grid reaches the paths worth checking
(ragged steps, deferrals, mixed prompt/decode steps, refused steps, rows that stop drafting,
evictions from the draft-KV map, capacity stops), so a grid that lost its reach would fail.
"""

import json
import random

import pytest

from raggedspec.reference import lengths, simulator
from raggedspec.reference.scenario import load_scenario

SPACE = {
    "advance": ["cohort", "per-sequence"],
    "world": ["W0", "WA", "WB"],
    "strip": ["eager", "lazy", "none"],
    "admission": ["grant", "grant", "refuse"],
    "xs_per_seq": [True, True, False],
    "arrival": ["all-at-once", "staggered"],
    "max_draft_kv_seqs": [None, 2, 64],
    "acceptance": ["geometric:0.7", "profile:0.9,0.5,0.3", "all-accept", "all-reject",
                   "heterogeneous:0.1,0.95"],
    "max_seq_len": [4096, 40, 24],
    "max_seqs": [None, None, 2, 3],
    "prefill_max_seqs": [None, None, 1, 2],
}


def grid(n: int = 60, seed: int = 20261201) -> list[dict]:
    """`n` scenario dicts drawn from SPACE by `random.Random(seed)` (the same list on every
    run and machine)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = {k: rng.choice(v) for k, v in SPACE.items()}
        p, m = rng.randint(1, 10), rng.randint(1, 20)
        d.update(batch=rng.randint(1, 6), prompt_len=[p, p + rng.randint(0, 6)],
                 max_new_tokens=[m, m + rng.randint(0, 15)], steps=rng.randint(3, 16),
                 depth=rng.randint(0, 4), seed=rng.randint(0, 50))
        out.append(d)
    return out


GRID = grid()


def normalized(trace) -> list[str]:
    """The trace's lines with the header's `mode` blanked (the one field the modes differ in)."""
    out = list(trace.lines())
    head = json.loads(out[0])
    head["mode"] = "-"
    return [json.dumps(head)] + out[1:]


@pytest.mark.rule("lengths-only mode == tensor mode")
@pytest.mark.parametrize("i", range(len(GRID)))
def test_the_lengths_mode_gives_the_tensor_modes_trace_on_the_grid(i):
    sc = load_scenario(GRID[i])
    assert normalized(lengths.run(sc)) == normalized(simulator.run(sc)), GRID[i]


def paths_of(data: dict, trace) -> set[str]:
    """The paths a trace went through, named as the grid test's reach check names them."""
    seen = set()
    for s in trace.steps():
        seen.add(s["phase"])
        if s["error"]:
            seen.add("error")
        if s["phase"] != "decode":
            continue
        if s["padding_fraction"] > 0 and s["advance"] == "per-sequence":
            seen.add("ragged")
        if s["prefill"]:
            seen.add("mixed")
        if any(r["drafted"] == 0 for r in s["rows"]):
            seen.add("not drafting")
        if any(r["accepted"] > 0 for r in s["rows"]):
            seen.add("accepted")
    if data["max_draft_kv_seqs"] == 2 and data["batch"] > 2 and "decode" in seen:
        seen.add("evicting")
    return seen


@pytest.mark.rule("lengths-only mode == tensor mode")
def test_the_grid_reaches_every_path_the_equality_is_meant_to_check():
    seen: set[str] = set()
    for data in GRID:
        seen |= paths_of(data, lengths.run(load_scenario(data)))
    want = {"prompt", "decode", "defer", "ragged", "mixed", "not drafting", "accepted",
            "error", "evicting"}
    assert want <= seen, want - seen
