"""The lengths-only engine (reference/lengths.py) against the tensor mode
(reference/simulator.py): the two are independent implementations of the same decisions (the
lengths mode keeps integers only, the tensor mode runs the tensors), so the same scenario must
give the same trace line for line, the same row arrays, the same acceptance telemetry in total
and per batch size (`by_batch`, which no trace line carries) and the same progress calls.

Checked on generated scenarios (a Hypothesis property, slow), on a seeded grid drawn once from
the same space (about 60 small scenarios, fast enough for every run), on the fixed scenarios of
conformance/helpers.py, and on cases chosen for the paths the grid misses: idle steps between
arrivals, prompts and decode steps that cross the 512-column cache block and the capacity
refusals at `max_seq_len` (exactly 1024 included), a ragged cohort step whose rejection the
compressed cache cannot roll back, the window deferral near the cap, the file model's per-row
verify count, and custom token oracles, well-behaved or broken. Each set of cases also names
the paths it is there for and fails if it no longer reaches them. The lengths engine's two
halves rule by rule are in test_lengths_halves.py; the §17.2 comparisons of the advance rules
at B = 128 in test_lengths_advance.py.
"""

import json
import random

import numpy as np
import pytest
from hypothesis import given

from raggedspec.conformance.helpers import FIXED, GRANTED, decode_rows, normalized_lines
from raggedspec.conformance.strategies import ACCEPTANCES, simulator_scenarios
from raggedspec.reference import lengths, simulator
from raggedspec.reference.acceptance import OracleError
from raggedspec.reference.policy import ROW_DTYPE
from raggedspec.reference.scenario import load_scenario

ORACLES = "raggedspec.conformance.helpers"  # the module holding the custom token oracles
ORACLE = f"oracle:{ORACLES}:make_context_oracle"


def both(data: dict):
    """Run `data` in both modes with a progress recorder; assert they agree on the trace (its
    lines and each step's row array, -1 for a null column, in ROW_DTYPE), the telemetry and
    the progress calls; return the lengths trace."""
    sc = load_scenario(data)
    seen_l, seen_t = [], []
    eng_l = lengths.LengthsEngine(sc, lambda *a: seen_l.append(a))
    eng_t = simulator.TensorEngine(sc, lambda *a: seen_t.append(a))
    tr_l, tr_t = eng_l.run(), eng_t.run()
    assert normalized_lines(tr_l) == normalized_lines(tr_t)
    for i in range(len(tr_l)):
        rows_l, rows_t = tr_l.row_array(i), tr_t.row_array(i)
        assert rows_l.dtype == rows_t.dtype == ROW_DTYPE and np.array_equal(rows_l, rows_t), i
    assert eng_l.tel.total == eng_t.tel.total
    assert eng_l.tel.by_batch == eng_t.tel.by_batch
    assert seen_l == seen_t == [(k, sc.steps) for k in range(1, len(tr_l) + 1)]
    return tr_l


def paths_of(data: dict, trace) -> set[str]:
    """The paths a run went through: its phases; `error` and `error:<text>` for its refused
    steps; on decode steps `ragged` (per-sequence, a lead), `mixed` (a prompt ran beside it),
    `not drafting` (a row that could draft, u < w, did not), `accepted` (a row accepted a
    draft) and `defer, then decode` (a row deferred earlier); `evicting` for a run with more
    rows than a draft-KV map of 2 holds."""
    seen, deferred = set(), set()
    w = data.get("depth", 3) + 1
    for s in trace.steps():
        seen.add(s["phase"])
        ids = {r["seq"] for r in s["rows"]}
        if s["error"]:
            seen |= {"error", "error:" + s["error"]}
        if s["phase"] == "defer":
            deferred |= ids
        if s["phase"] != "decode":
            continue
        if s["padding_fraction"] > 0 and s["advance"] == "per-sequence":
            seen.add("ragged")
        if s["prefill"]:
            seen.add("mixed")
        if any(r["drafted"] == 0 and r["u"] < w for r in s["rows"]):
            seen.add("not drafting")
        if any(r["accepted"] > 0 for r in s["rows"]):
            seen.add("accepted")
        if ids & deferred:
            seen.add("defer, then decode")
    if data.get("max_draft_kv_seqs") == 2 and data.get("batch", 0) > 2 and "decode" in seen:
        seen.add("evicting")
    return seen


# ----------------------------------------- generated scenarios, the fixed ones and the seeded grid


@pytest.mark.rule(
    "scheduler worlds, bucket selection, engine cache instruction",
    "lengths-only mode == tensor mode",
)
@pytest.mark.slow
@given(data=simulator_scenarios())
def test_lengths_mode_gives_the_tensor_modes_integer_trace(data):
    """The issue's property: the same decisions with no tensors give the identical trace
    (every integer, every float, the markers), across advance rules, worlds, strip
    policies, arrivals, LRU sizes, acceptance models and capacity refusals."""
    both(data)



@pytest.mark.rule(
    "window check, the two guards and the deferral",
    "lengths-only mode == tensor mode",
)
def test_the_equality_covers_the_interesting_paths():
    """Non-degeneracy of the property above: on the fixed scenarios both modes agree and the
    runs include ragged per-sequence steps, deferrals, mixed prompt/decode steps, rows that
    could draft and did not, and refused steps."""
    seen: set[str] = set()
    for data in FIXED:
        seen |= paths_of(data, both(data))
    assert {"prompt", "decode", "defer", "ragged", "mixed", "not drafting", "error"} <= seen, seen


SPACE = {
    "advance": ["cohort", "per-sequence"],
    "world": ["W0", "WA", "WB"],
    "strip": ["eager", "lazy", "none"],
    "admission": ["grant", "grant", "refuse"],
    "xs_per_seq": [True, True, False],
    "arrival": ["all-at-once", "staggered"],
    "max_draft_kv_seqs": [None, 2, 64],
    "acceptance": list(ACCEPTANCES),
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


@pytest.mark.rule("lengths-only mode == tensor mode")
@pytest.mark.parametrize("i", range(len(GRID)))
def test_the_lengths_mode_gives_the_tensor_modes_trace_on_the_grid(i):
    both(GRID[i])



@pytest.mark.rule("lengths-only mode == tensor mode")
def test_the_grid_reaches_every_path_the_equality_is_meant_to_check():
    seen: set[str] = set()
    for data in GRID:
        seen |= paths_of(data, lengths.run(load_scenario(data)))
    want = {"prompt", "decode", "defer", "ragged", "mixed", "not drafting", "accepted",
            "error", "evicting"}
    assert want <= seen, want - seen



# ------------------------------------------------------------------------------------ off the grid


def reqs(*rows) -> list[dict]:
    """Requests from `(prompt_len, max_new_tokens, arrival[, may_draft])` tuples."""
    return [{"prompt_len": r[0], "max_new_tokens": r[1], "arrival": r[2],
             "may_draft": r[3] if len(r) > 3 else True} for r in rows]


PER_SEQ = {"advance": "per-sequence"}


CASES = {
    "idle steps between arrivals, the draft-KV map at 2": (dict(
        PER_SEQ, world="WA", max_draft_kv_seqs=2, acceptance="all-accept", prefill_max_seqs=2,
        max_seq_len=24, requests=reqs((11, 17, 0), (13, 7, 1), (14, 4, 3), (11, 8, 9)),
        steps=14, depth=5, seed=43, model={"compress_ratios": [0, 1]}), {"idle", "mixed"}),
    "one running row at a time, wide prompts, no MTP block": (dict(
        PER_SEQ, world="WB", strip="lazy", xs_per_seq=True, max_draft_kv_seqs=2, max_seqs=1,
        prefill_max_seqs=2, max_seq_len=1100, requests=reqs(
            (505, 20, 6), (504, 7, 6, False), (509, 9, 0, False), (509, 1, 0, False),
            (507, 6, 1)), steps=9, depth=5, seed=16, model={"mtp": "heads"}), {"decode"}),
    "prompts past the block under a 530 cap": (dict(
        PER_SEQ, strip="lazy", admission="grant", max_draft_kv_seqs=1, acceptance="all-accept",
        max_seqs=1, max_seq_len=530, requests=reqs(
            (515, 15, 9), (518, 4, 0), (516, 14, 0), (515, 17, 0, False), (517, 1, 0),
            (513, 2, 9, False)), steps=17, depth=5, seed=32, model={"mtp": "heads"}),
        {"idle", "error:capacity refused"}),
    "a prompt and a decode step refused together": (dict(
        PER_SEQ, world="WA", strip="lazy", admission="grant", max_draft_kv_seqs=2,
        acceptance="all-reject", prefill_floor=1, max_seq_len=530, batch=5,
        prompt_len=[511, 513], max_new_tokens=[10, 13], steps=8, depth=4, seed=44),
        {"mixed", "error:capacity refused; capacity refused"}),
    "plain decode past the block under a 600 cap": (dict(
        PER_SEQ, world="WA", admission="grant", xs_per_seq=True, max_draft_kv_seqs=2,
        acceptance="all-accept", prefill_max_seqs=2, prefill_floor=1, max_seq_len=600,
        requests=reqs((513, 17, 0), (505, 13, 1), (508, 4, 6), (511, 19, 1), (507, 3, 1),
                      (509, 19, 0)), steps=16, depth=0, seed=9,
        model={"compress_ratios": [0]}), {"error:capacity refused"}),
    "a cohort deferral refused at the cap": (dict(
        world="WA", strip="lazy", admission="grant", xs_per_seq=True, acceptance="all-accept",
        max_seqs=3, prefill_max_seqs=2, max_seq_len=540, requests=reqs((507, 20, 0), (502, 19, 0)),
        steps=15, depth=5, seed=12), {"defer", "error:capacity refused"}),
    "the context oracle at a 14 cap": (dict(
        PER_SEQ, strip="none", xs_per_seq=True, acceptance=ORACLE, max_seqs=2,
        prefill_max_seqs=2, max_seq_len=14, batch=2, prompt_len=3, max_new_tokens=[18, 27],
        arrival="staggered", steps=11, depth=5, seed=32, model={"compress_ratios": [0]}),
        {"decode"}),
    "the context oracle deferring wide rows": (dict(
        PER_SEQ, world="WA", strip="none", xs_per_seq=True, max_draft_kv_seqs=1,
        acceptance=ORACLE, prefill_max_seqs=1, max_seq_len=530, batch=5, prompt_len=[501, 503],
        max_new_tokens=[13, 17], arrival="staggered", stagger=5, steps=17, depth=0, seed=1,
        model={"compress_ratios": [0, 1]}), {"defer", "error:capacity refused"}),
    "one row refused at a 14 cap": (dict(
        PER_SEQ, world="WB", admission="grant", max_draft_kv_seqs=None, acceptance="all-reject",
        prefill_max_seqs=2, prefill_floor=1, max_seq_len=14, batch=1, prompt_len=[8, 9],
        max_new_tokens=[16, 20], arrival="staggered", steps=8, depth=4, seed=16,
        model={"compress_ratios": [0, 1]}),
        {"error:capacity refused"}),
    "staggered rows, the map at 2, a 24 cap": (dict(
        PER_SEQ, world="WA", strip="none", admission="grant", xs_per_seq=True,
        max_draft_kv_seqs=2, max_seqs=2, max_seq_len=24, batch=4, prompt_len=7,
        max_new_tokens=[16, 25], arrival="staggered", steps=8, depth=4, seed=14),
        {"error:follows guard"}),
    "the context oracle, six rows two at a time": (dict(
        PER_SEQ, strip="none", xs_per_seq=True, acceptance=ORACLE, max_seqs=2,
        prefill_max_seqs=1, prefill_floor=0, max_seq_len=12, batch=6, prompt_len=[3, 4],
        max_new_tokens=[17, 25], steps=5, depth=1, seed=49, model={"compress_ratios": [0, 2, 4]}),
        {"decode"}),
    "a draft chain refused at a 24 cap": (dict(
        PER_SEQ, world="WA", admission="grant", acceptance="profile:0.9,0.5,0.3", max_seqs=3,
        prefill_max_seqs=1, max_seq_len=24, requests=reqs((14, 10, 0), (11, 7, 0), (6, 12, 6),
                                                          (8, 19, 3)),
        steps=10, depth=4, seed=3, model={"compress_ratios": [0, 1]}),
        {"error:draft chain refused"}),
    "granted WB rows growing past the block": (dict(
        PER_SEQ, world="WB", admission="grant", xs_per_seq=True, max_draft_kv_seqs=None,
        prefill_floor=0, max_seq_len=540, requests=reqs(
            (505, 2, 0, False), (507, 6, 1, False), (501, 19, 0), (505, 5, 9), (508, 2, 3)),
        steps=8, depth=3, seed=16, model={"mtp": "heads"}), {"error:capacity refused"}),
    "a cohort that never accepts, under an 1100 cap": (dict(
        world="WA", strip="none", admission="grant", xs_per_seq=True, acceptance="all-reject",
        prefill_floor=0, max_seq_len=1100, batch=2, prompt_len=[501, 504],
        max_new_tokens=[18, 25], arrival="staggered", steps=18, depth=1, seed=35,
        model={"compress_ratios": [0, 2, 4]}), {"defer"}),
    "a deferred cohort member decodes on with the context oracle": (dict(
        world="WA", strip="none", admission="grant", xs_per_seq=True, acceptance=ORACLE,
        prefill_floor=0, max_seq_len=1100, batch=2, prompt_len=[501, 504],
        max_new_tokens=[5, 6], arrival="staggered", steps=24, depth=1, seed=35,
        model={"compress_ratios": [0, 2, 4]}), {"defer, then decode"}),
    "a prompt refused at a 540 cap": (dict(
        PER_SEQ, world="WA", xs_per_seq=True, max_draft_kv_seqs=1, max_seqs=3, max_seq_len=540,
        requests=reqs(
            (516, 9, 6), (510, 13, 9), (513, 3, 9, False), (513, 18, 6, False), (516, 19, 0)),
        steps=17, depth=5, seed=8), {"error:capacity refused"}),
    "a W0 cohort refused at the cap": (dict(
        strip="lazy", admission="grant", xs_per_seq=True, max_draft_kv_seqs=1,
        acceptance="profile:0.9,0.5,0.3", max_seqs=3, prefill_max_seqs=2, max_seq_len=530,
        batch=2, prompt_len=[500, 506], max_new_tokens=[4, 16], arrival="staggered", stagger=3,
        steps=18, depth=2, seed=6), {"error:capacity refused"}),
    "a cohort with a non-drafting row under a 540 cap": (dict(
        world="WA", strip="none", admission="grant", xs_per_seq=True, prefill_floor=0,
        max_seq_len=540, requests=reqs((507, 16, 6), (501, 5, 3), (507, 17, 0), (509, 17, 1),
                                       (501, 14, 0, False)),
        steps=14, depth=1, seed=5, model={"compress_ratios": [0, 1]}), {"defer"}),
    "WB rows at exactly a 1024 cap": (dict(
        PER_SEQ, world="WB", xs_per_seq=True, max_draft_kv_seqs=None,
        acceptance="heterogeneous:0.1,0.95",
        max_seqs=2, prefill_floor=0, max_seq_len=1024, requests=reqs(
            (508, 16, 9, False), (506, 16, 9), (503, 6, 3)), steps=20, depth=6, seed=44,
        model={"mtp": "heads"}), {"idle", "mixed"}),
    "rows padded past a 512 cap": (dict(
        PER_SEQ, world="WA", strip="none", admission="grant", xs_per_seq=True,
        max_draft_kv_seqs=None, acceptance="profile:0.9,0.5,0.3", max_seqs=2, max_seq_len=512,
        requests=reqs((506, 6, 9, False), (505, 3, 6), (506, 20, 0), (501, 20, 0), (504, 16, 0)),
        steps=4, depth=0, seed=21, model={"compress_ratios": [0, 1]}), {"defer"}),
    "a cohort refused at clone-in under a 511 cap": (dict(
        world="WA", admission="grant", max_draft_kv_seqs=2, acceptance="all-accept",
        prefill_floor=1, max_seq_len=511, batch=6, prompt_len=[499, 502],
        max_new_tokens=[14, 18], steps=21, depth=7, seed=48, model={"compress_ratios": [0]}),
        {"mixed", "error:clone_in refused"}),
    "granted WB rows under a 512 cap": (dict(
        PER_SEQ, world="WB", strip="none", admission="grant", xs_per_seq=True,
        max_draft_kv_seqs=None, acceptance="profile:0.9,0.5,0.3", max_seq_len=512,
        requests=reqs((503, 5, 0, False), (500, 4, 3, False), (501, 19, 1)), steps=23, depth=5,
        seed=11, model={"compress_ratios": [0, 1]}), {"error:follows guard"}),
    "prompts just under a 1024 cap": (dict(
        PER_SEQ, world="WA", strip="none", admission="grant", xs_per_seq=True,
        acceptance="profile:0.9,0.5,0.3", max_seqs=2, prefill_max_seqs=2, max_seq_len=1024,
        batch=5, prompt_len=[1010, 1020], max_new_tokens=[12, 26], arrival="staggered",
        stagger=3, steps=21, depth=8, seed=46, model={"compress_ratios": [0, 1]}),
        {"error:capacity refused"}),
    "a cohort deferring under a 1024 cap": (dict(
        world="WA", xs_per_seq=True, max_draft_kv_seqs=None, batch=6, prompt_len=[505, 506],
        max_new_tokens=[4, 18], max_seq_len=1024, steps=10, depth=1, seed=16,
        model={"compress_ratios": [0, 1]}), {"defer"}),
    "two staggered rows deferring under a 513 cap": (dict(
        PER_SEQ, world="WA", xs_per_seq=True, acceptance="all-accept", max_seqs=2,
        prefill_floor=1, max_seq_len=513, batch=2, prompt_len=[490, 499],
        max_new_tokens=[17, 23], arrival="staggered", stagger=3, steps=20, depth=3, seed=17,
        model={"mtp": "heads"}), {"defer"}),
}


# the cases over about 3 s on two busy cores (their prompts of 1000 tokens run every forward)
SLOW_CASES = {"prompts just under a 1024 cap", "a cohort deferring under a 1024 cap"}


@pytest.mark.rule("lengths-only mode == tensor mode")
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES
                                  else n for n in CASES])
def test_the_lengths_engine_agrees_with_the_tensor_mode_off_the_grid(name):
    data, want = CASES[name]
    tr = both(data)
    assert want <= paths_of(data, tr), (name, want - paths_of(data, tr))
    assert json.loads(next(iter(tr.lines())))["mode"] == "lengths"



ROLLBACK = {  # name -> (accepts file, D's prompt, a late request?, the refused step)
    "A accepts 1 of 3: refused": ('{"0": [2, 1], "1": [0], "2": [3, 1]}', 7, False, 3),
    "A accepts 2 of 3, one column to drop: refused": ('{"0": [2, 2], "1": [0], "2": [3, 3]}', 7,
                                                      False, 3),
    "A one column behind: refused": ('{"0": [2, 1], "1": [0], "2": [3, 1]}', 6, False, 3),
    "both accept all 3: nothing to drop, the next step refused": (
        '{"0": [2, 3, 0], "1": [0], "2": [3, 3, 0]}', 7, False, 4),
    "a request arriving after the refusal still runs": (
        '{"0": [2, 1], "1": [0], "2": [3, 1], "3": [1, 1]}', 7, True, 3),
}


@pytest.mark.rule("lengths-only mode == tensor mode")
@pytest.mark.parametrize("name", list(ROLLBACK))
def test_a_ragged_cohort_step_the_compressed_cache_cannot_roll_back_is_refused_alike(tmp_path,
                                                                                     name):
    """WA: A and B decode, B ends, D is prompted; A (behind D) and D are assembled into one
    cohort step on the compressed cache. A step that keeps fewer columns than it wrote must
    drop columns the ragged compressed rows cannot give back: both modes refuse it, and only
    it (the rows it did not hold run on)."""
    accepts, d_prompt, late, step = ROLLBACK[name]
    path = tmp_path / "accepts.json"
    path.write_text(accepts)
    rows = [(4, 30, 0), (4, 2, 0), (d_prompt, 30, 1)] + ([(3, 5, 5)] if late else [])
    tr = both({"requests": reqs(*rows), "steps": 8, "depth": 3, "world": "WA",
               "prefill_floor": 1, "xs_per_seq": True,
               "acceptance": {"model": "file", "path": str(path)}})
    refused = [s["step"] for s in tr.steps() if s["error"] == "xs rollback refused"]
    assert refused == [step], refused
    if late:
        assert any(s["phase"] == "decode" and [r["seq"] for r in s["rows"]] == [3]
                   for s in tr.steps())


@pytest.mark.rule("lengths-only mode == tensor mode")
def test_the_file_models_verify_count_moves_only_for_rows_that_drafted(tmp_path):
    """The file model reads a row's k-th entry on its k-th drafted verify: with the draft-KV
    map at 2 for 4 rows, rows skip drafting on some steps, and both modes must read the same
    entries (a count that also moved on a skipped step would shift every later accept)."""
    path = tmp_path / "accepts.json"
    path.write_text(json.dumps({
        "0": [0, 2, 2, 3, 4, 2, 1, 3, 2, 3, 1, 3], "1": [4, 0, 2, 4, 0, 4, 3, 0, 2, 0, 3, 0],
        "2": [1, 4, 1, 0, 3, 2, 4, 2, 1, 4, 1, 1], "3": [2, 2, 0, 0, 4, 2, 3, 4, 4, 0, 1, 2]}))
    tr = both(dict(PER_SEQ, world="WB", admission="grant", xs_per_seq=True, batch=4,
                   prompt_len=[3, 8], max_new_tokens=30, steps=14, depth=4, max_draft_kv_seqs=2,
                   seed=13, acceptance={"model": "file", "path": str(path)}))
    drafted: dict[int, list[int]] = {}
    for s in tr.steps():
        if s["phase"] == "decode":
            for r in s["rows"]:
                drafted.setdefault(r["seq"], []).append(r["drafted"])
    assert any(0 in d[:-1] and max(d[d.index(0):]) > 0 for d in drafted.values()), drafted


@pytest.mark.rule("lengths-only mode == tensor mode")
def test_run_takes_a_scenario_a_table_or_a_path_and_reports_progress(tmp_path):
    """`lengths.run` loads a dict or a path as `load_scenario` does, takes a `Scenario` as it
    is, calls `progress(step + 1, steps)` once per step and writes a trace of mode
    `lengths`."""
    data = {"batch": 2, "prompt_len": [3, 6], "max_new_tokens": 6, "steps": 9, "depth": 2}
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(data))
    calls = []
    tr = lengths.run(data, progress=lambda *a: calls.append(a))
    got = list(tr.lines())
    assert got == list(lengths.run(str(path)).lines()) == list(
        lengths.run(load_scenario(data)).lines())
    assert json.loads(got[0])["mode"] == "lengths"
    assert calls == [(k, 9) for k in range(1, len(tr) + 1)] and len(tr) > 1



@pytest.mark.rule("Tier A never drafts in the fused path")
def test_tier_a_never_drafts_in_the_fused_path():
    """§19.6 / §7.2 step 3: without an MTP block no seed is stashed, so no row drafts."""
    sc = load_scenario(
        {"batch": 3, "prompt_len": 6, "max_new_tokens": 25, "steps": 8, "model": {"mtp": "heads"}}
    )
    tr = lengths.run(sc)
    assert all(r["drafted"] == 0 for s in tr.steps() for r in s["rows"])
    assert normalized_lines(tr) == normalized_lines(simulator.run(sc))


@pytest.mark.rule("lengths-only mode == tensor mode", "lengths mode, scheduler half")
def test_the_admission_caps_are_exercised_and_both_modes_agree():
    """max_seqs and the WA prefill cap hold sequences back (waiting > 0 with room to run
    them later); lengths and tensor mode agree step for step."""
    for data in (
        dict(
            batch=6, prompt_len=[3, 8], max_new_tokens=12, steps=30, max_seqs=2, arrival="staggered"
        ),
        dict(
            batch=6,
            prompt_len=[3, 8],
            max_new_tokens=12,
            steps=30,
            world="WA",
            prefill_max_seqs=1,
            xs_per_seq=True,
            arrival="staggered",
        ),
    ):
        sc = load_scenario(data)
        tr = lengths.run(sc)
        assert normalized_lines(tr) == normalized_lines(simulator.run(sc))
        assert max(s["running"] for s in tr.steps()) <= (data.get("max_seqs") or 6)
        assert any(s["waiting"] > 0 and s["running"] > 0 for s in tr.steps())


# ---------------------------------------------------------------------------- custom token oracles


@pytest.mark.rule("pluggable token oracle")
def test_a_custom_token_oracle_drives_both_modes_alike():
    """A user's TokenOracle (conformance/helpers.py `make_oracle`: of n drafts the first n - 1
    agree) decides accepts through verify_proposed in both modes."""
    for extra in ({}, GRANTED):
        sc = load_scenario(
            {
                "batch": 3,
                "prompt_len": [4, 7],
                "max_new_tokens": 30,
                "steps": 12,
                "acceptance": f"oracle:{ORACLES}:make_oracle",
                **extra,
            }
        )
        tr = lengths.run(sc)
        assert normalized_lines(tr) == normalized_lines(simulator.run(sc))
        assert all(r["accepted"] == r["drafted"] - 1 for _, r in decode_rows(tr) if r["drafted"])
        assert any(r["drafted"] for _, r in decode_rows(tr))



@pytest.mark.rule("pluggable token oracle")
@pytest.mark.parametrize("factory, words", [
    ("make_short_drafter", ["draft(seq_id=", "n=3)", "exactly 3 token(s) (got 2)"]),
    ("make_out_of_vocab", ["context of 7 tokens)", "returned 64", "[0, vocab = 64)"]),
    ("make_late_bad_prompt", ["prompt(seq_id=1, length=6)", "exactly 6 token(s) (got 5)"]),
])
def test_a_broken_custom_oracle_is_refused_identically_in_both_modes(factory, words):
    """An oracle that proposes the wrong number of drafts or a token outside the vocab is
    refused by the one shared check (`acceptance.CheckedOracle`, via `build_oracle`) with the
    same OracleError in lengths and tensor mode, instead of the two modes diverging (the
    lengths mode never looks at a token's value; the tensor mode feeds it to the model)."""
    sc = load_scenario(
        {
            "batch": 2,
            "prompt_len": 6,
            "max_new_tokens": 20,
            "steps": 8,
            "arrival": "staggered",
            "stagger": 1,
            "acceptance": f"oracle:{ORACLES}:{factory}",
        }
    )
    messages = []
    for mode in (lengths, simulator):
        with pytest.raises(OracleError) as err:
            mode.run(sc)
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert (
        f"{ORACLES}:{factory}" in messages[0]
        and "'acceptance.factory'" in messages[0]
    )
    for w in words:
        assert w in messages[0], f"{w!r} not in {messages[0]!r}"



# ------------------------------------------------------------------------------------ draft stalls


@pytest.mark.rule("lengths mode, draft half")
def test_the_lengths_engine_says_why_rows_stop_drafting():
    """`Trace.draft_stalls` (lengths mode): at B = 2 with per-sequence advance the two rows'
    draft caches get different capacities on a ragged step, then meet at equal lengths; the
    uniform group is refused by batch_draft_caches (§9.6: equal length, different capacity)
    on every later step, so they never draft again."""
    data = {
        "batch": 2,
        "prompt_len": 64,
        "max_new_tokens": [300, 600],
        "depth": 3,
        "acceptance": "geometric:0.7",
        "max_draft_kv_seqs": None,
        "steps": 60,
        **GRANTED,
    }
    tr = lengths.run(load_scenario(data))
    decode = [s for s in tr.steps() if s["phase"] == "decode"]
    last_draft = max(i for i, s in enumerate(decode) if any(r["drafted"] for r in s["rows"]))
    stalled = decode[last_draft + 1:]
    assert len(stalled) > 50
    assert all(
        len({r["own_len"] for r in s["rows"]}) == 1 and all(r["u"] == 1 for r in s["rows"])
        for s in stalled
    )
    assert tr.draft_stalls == {lengths.STALL_UNIFORM: 2 * len(stalled), lengths.STALL_RAGGED: 0,
                               lengths.STALL_INELIGIBLE: 0}
