"""The lengths-only engine against the tensor mode where the seeded grid does not go.

The grid of test_lengths_grid.py draws small scenarios: short prompts, one token oracle, no
gaps between arrivals. The cases here were chosen for the paths it misses: idle steps between
arrivals, prompts and decode steps that cross the 512-column cache block and the capacity
refusals at `max_seq_len` (exactly 1024 included), a ragged cohort step whose rejection the
compressed cache cannot roll back, the window deferral near the cap, the file model's per-row
verify count, and a custom token oracle whose tokens hash their whole context. For each case
the two modes must agree on the trace line for line, on the acceptance telemetry in total and
per batch size (`by_batch`, which no trace line carries) and on the progress callback's calls;
each case also names the path it is here for and fails if it no longer reaches it.
"""

import json

import numpy as np
import pytest

from raggedspec.reference import lengths, simulator
from raggedspec.reference.policy import ROW_DTYPE
from raggedspec.reference.scenario import load_scenario, model_config

ORACLE = "oracle:raggedspec.conformance.test_lengths_engine:make_oracle"


class _ContextOracle:
    """Tokens that hash every value of the context (not only its length) with the scenario's
    seed; a draft of n proposes the true tokens with one wrong at a context-chosen position
    (or none)."""

    def __init__(self, seed: int, vocab: int) -> None:
        self.seed, self.vocab = seed, vocab

    def _next(self, seq_id: int, context) -> int:
        h = self.seed * 31 + seq_id * 7 + sum((j + 1) * t for j, t in enumerate(context))
        return h % self.vocab

    def prompt(self, seq_id, length):
        return [(seq_id * 5 + 3 * j) % self.vocab for j in range(length)]

    def target(self, seq_id, context):
        return self._next(seq_id, context)

    def draft(self, seq_id, context, n):
        out = list(context)
        for _ in range(n):
            out.append(self._next(seq_id, out))
        bad = (seq_id + len(context)) % (n + 1)
        if bad < n:
            out[len(context) + bad] = (out[len(context) + bad] + 1) % self.vocab
        return out[len(context):]


def make_oracle(scenario):
    return _ContextOracle(scenario.seed, model_config(scenario).vocab)


def reqs(*rows) -> list[dict]:
    """Requests from `(prompt_len, max_new_tokens, arrival[, may_draft])` tuples."""
    return [{"prompt_len": r[0], "max_new_tokens": r[1], "arrival": r[2],
             "may_draft": r[3] if len(r) > 3 else True} for r in rows]


PER_SEQ = {"advance": "per-sequence"}
# name -> (scenario, the paths it must reach: phases, "error:<text>", "mixed")
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


def paths(trace) -> set[str]:
    """The phases a trace went through, its errors as `error:<text>`, `mixed` for a decode
    step that also prompted, and `defer, then decode` for a deferred row that decodes later."""
    seen, deferred = set(), set()
    for s in trace.steps():
        seen.add(s["phase"])
        ids = {r["seq"] for r in s["rows"]}
        if s["error"]:
            seen.add("error:" + s["error"])
        if s["prefill"] and s["phase"] == "decode":
            seen.add("mixed")
        if s["phase"] == "decode" and ids & deferred:
            seen.add("defer, then decode")
        if s["phase"] == "defer":
            deferred |= ids
    return seen


def normalized(trace) -> list[str]:
    out = list(trace.lines())
    head = json.loads(out[0])
    head["mode"] = "-"
    return [json.dumps(head)] + out[1:]


def both(data: dict):
    """Run `data` in both modes with a progress recorder; assert they agree on the trace (its
    lines and each step's row array, -1 for a null column, in ROW_DTYPE), the telemetry and
    the progress calls; return the lengths trace."""
    sc = load_scenario(data)
    seen_l, seen_t = [], []
    eng_l = lengths.LengthsEngine(sc, lambda *a: seen_l.append(a))
    eng_t = simulator.TensorEngine(sc, lambda *a: seen_t.append(a))
    tr_l, tr_t = eng_l.run(), eng_t.run()
    assert normalized(tr_l) == normalized(tr_t)
    for i in range(len(tr_l)):
        rows_l, rows_t = tr_l.row_array(i), tr_t.row_array(i)
        assert rows_l.dtype == rows_t.dtype == ROW_DTYPE and np.array_equal(rows_l, rows_t), i
    assert eng_l.tel.total == eng_t.tel.total
    assert eng_l.tel.by_batch == eng_t.tel.by_batch
    assert seen_l == seen_t == [(k, sc.steps) for k in range(1, len(tr_l) + 1)]
    return tr_l


@pytest.mark.rule("lengths-only mode == tensor mode")
@pytest.mark.parametrize("name", list(CASES))
def test_the_lengths_engine_agrees_with_the_tensor_mode_off_the_grid(name):
    data, want = CASES[name]
    tr = both(data)
    assert want <= paths(tr), (name, want - paths(tr))
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
