"""The tensor-mode step logic of reference/simulator.py read off its outputs and the backend
calls it makes: the per-sequence commit under each strip policy (cache-and-draft.md §5.5,
§12.2), the step failures with their trace error and message text (§13, §16 step 4), the two
guards, the deferral's plain decode at each row's own position, and the cohort verify at the
shared offset. A `NumpyBackend` subclass observes the calls and, where a test asks, refuses one
of them, so each refusal path runs on demand.
"""

import pytest

from raggedspec.conformance.helpers import GRANTED
from raggedspec.reference import dispatch, policy, simulator, step
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.errors import (
    AlignRefusal,
    CacheRefusal,
    DispatchRefusal,
    StepRefusal,
)
from raggedspec.reference.scenario import load_scenario
from raggedspec.reference.xs_rolling import XsRolling


class SpyBackend(NumpyBackend):
    """The NumPy reference, recording the arguments of the calls the engine's control flow
    hands over, refusing `fail[name]` (an exception) when set, and adding `warn[name]` to the
    warnings list the draft calls are given."""

    def __init__(self, fail=None, warn=None):
        super().__init__()
        self.fail, self.warn, self.calls = fail or {}, warn or {}, []

    def _hook(self, name, *args, warnings=None):
        self.calls.append((name, args))
        if name in self.warn:
            warnings.append(self.warn[name])
        if name in self.fail:
            raise self.fail[name]

    def clone_in(self, caches, pending_leads, xs_per_seq, per_sequence):
        self._hook("clone_in", list(pending_leads), xs_per_seq, per_sequence)
        ci = super().clone_in(caches, pending_leads, xs_per_seq, per_sequence)
        self.calls.append(("clone_in ->", (ci.ragged_decode_supported,)))
        return ci

    def draft_chain(self, model, groups, states, toks, cache_lens, budgets, w, psa, warnings=None):
        self._hook("draft_chain", warnings=warnings)
        return super().draft_chain(model, groups, states, toks, cache_lens, budgets, w, psa,
                                   warnings)

    def extend_draft_kvs(self, states, capture, toks, batch, model, warnings=None):
        self._hook("extend_draft_kvs", warnings=warnings)
        super().extend_draft_kvs(states, capture, toks, batch, model, warnings)

    def prime_draft_kv(self, states, capture, toks, batch, model, warnings=None):
        self._hook("prime_draft_kv", warnings=warnings)
        super().prime_draft_kv(states, capture, toks, batch, model, warnings)

    def truncate_by(self, cache, n_drop):
        self._hook("truncate_by", n_drop)
        super().truncate_by(cache, n_drop)

    def commit(self, cache, strip_lead, kv_len, xs_len):
        self._hook("commit", strip_lead, kv_len, xs_len)
        super().commit(cache, strip_lead, kv_len, xs_len)

    def forward(self, model, tokens, cache, offsets, row_q0, lead_pad, capture=None, plan=None):
        self._hook("forward", tokens.shape)
        return super().forward(model, tokens, cache, offsets, row_q0, lead_pad, capture, plan)

    def args(self, name):
        return [a for n, a in self.calls if n == name]


def scenario(**kw):
    base = {"batch": 2, "prompt_len": 6, "max_new_tokens": 30, "steps": 3, "depth": 3}
    return load_scenario({**base, **kw})


def per_seq_pair(**kw):
    """Granted per-sequence advance (WB), prompts 12 (seq 0) and 10 (seq 1) in steps 1 and 0,
    one decode of both in step 2, all drafts accepted."""
    return load_scenario({"requests": [{"prompt_len": 12, "max_new_tokens": 40},
                                       {"prompt_len": 10, "max_new_tokens": 40}],
                          "depth": 3, "steps": 3, "acceptance": "all-accept", **GRANTED, **kw})


def engine(sc, **kw):
    eng = simulator.TensorEngine(sc, **kw)
    return eng, eng.run()


def steps_of(trace):
    return list(trace.steps())


# ------------------------------------------------------- per-sequence steps and the strip policies


@pytest.mark.rule("per-step tensor hook")
def test_a_per_sequence_step_logs_its_ragged_forward():
    """Lead [0, 2] at width 12: padding 2 / (2 * 12); the verify forward runs at the rows' own
    offsets [12, 10], row_q0 = those offsets (per_seq_kv on), leads [0, 2]."""
    spy = SpyBackend()
    eng, tr = engine(per_seq_pair(), record_tensors=True, backend=spy)
    dec = next(s for s in tr.steps() if s["phase"] == "decode")
    assert dec["padding_fraction"] == 2 / 24 and dec["advance"] == "per-sequence"
    (rec,) = tr.tensors
    assert (rec["step"], rec["phase"], rec["ids"]) == (dec["step"], "decode", [0, 1])
    assert rec["positions"] == [12, 10] and rec["row_q0"] == [12, 10] and rec["lead"] == [0, 2]
    assert rec["tokens"].shape == (2, 4)
    prompts = [r for r in tr.tensor_log if r["phase"] == "prompt"]
    assert [(r["step"], r["ids"]) for r in prompts] == [
        (s["step"], s["prefill"]) for s in tr.steps() if s["prefill"]]
    states = [r for r in tr.tensor_log if r["phase"] == "state"]
    assert [r["step"] for r in states] == [s["step"] for s in tr.steps()]
    (ci,) = spy.args("clone_in")
    assert ci[1] is True and ci[2] is True  # xs_per_seq, per-sequence advance
    (ok,) = spy.args("clone_in ->")
    assert eng.state.ragged_decode_supported is ok[0]


@pytest.mark.rule("one batched decode step MtpSpeculativePipeline::step, cohort example w=4 C=10")
def test_a_cohort_step_hands_clone_in_a_false_per_sequence_flag():
    spy = SpyBackend()
    engine(scenario(steps=2), backend=spy)
    (ci,) = spy.args("clone_in")
    assert ci == ([0, 0], False, False)


def xs_lens(cache):
    return [s.current_seq_len for s in cache.slots if isinstance(s, XsRolling)]


def kv_lens(cache):
    return [s.current_seq_len for s in cache.slots if not isinstance(s, XsRolling)]


@pytest.mark.rule("strip policy eager / lazy / none")
@pytest.mark.parametrize("strip, kv, pending", [
    ("eager", [16, 14], [0, 0]),  # drop the lead, set_len(own + committed)
    ("lazy", [16, 16], [0, 2]),  # K/V set_len(lead + own + committed), the lead stays pending
    ("none", [16, 16], [0, 0]),  # K/V set_len(C + committed): the padded length, nothing pending
])
def test_the_per_sequence_commit_under_each_strip_policy(strip, kv, pending):
    """Own lengths [12, 10], leads [0, 2], C = 12, all 3 drafts + the bonus committed: the
    XsRolling slots always hold own + committed = [16, 14] (§5.5, §12.2)."""
    spy = SpyBackend()
    eng, tr = engine(per_seq_pair(strip=strip), backend=spy)
    assert [r["committed"] for r in tr.rows(2)] == [4, 4]
    for i in (0, 1):
        assert set(kv_lens(eng.caches[i])) == {kv[i]}
        assert set(xs_lens(eng.caches[i])) == {[16, 14][i]}
    assert [eng.pending[i] for i in (0, 1)] == pending
    if strip != "eager":
        assert {a for a in spy.args("commit")} == {(0, kv[0], 16), (0, kv[1], 14)}


@pytest.mark.rule("strip policy eager / lazy / none")
def test_the_lazy_strip_hands_the_pending_lead_to_the_next_clone_in():
    spy = SpyBackend()
    engine(per_seq_pair(strip="lazy", steps=4), backend=spy)
    assert [a[0] for a in spy.args("clone_in")] == [[0, 0], [0, 2]]


# ----------------------------------------------------------------------------------- step failures


def failed_decode(tr):
    return next(s for s in tr.steps() if s["phase"] == "decode" and s["error"])


def assert_failed_rows(tr, step):
    """A failed step's rows: nothing drafted, accepted, committed or filled, and -1 (null)
    for group and chain start."""
    for r in step["rows"]:
        assert (r["drafted"], r["accepted"], r["committed"], r["filled"]) == (0, 0, 0, 0)
    assert (tr.row_array(step["step"])[:, policy.NULL_COLS] == -1).all()


@pytest.mark.rule("one batched decode step MtpSpeculativePipeline::step, cohort example w=4 C=10")
@pytest.mark.parametrize("sc, exc, kind", [
    (scenario(steps=3), CacheRefusal("no room"), "clone_in refused"),
    (per_seq_pair(steps=4), CacheRefusal("no room"), "capacity refused"),
    (per_seq_pair(steps=4), AlignRefusal("no room"), "clone_in refused"),
])
def test_a_refused_clone_in_fails_the_step_before_anything_is_measured(sc, exc, kind):
    """§13: under PerSequence a CacheRefusal out of clone_in is the capacity refusal; any other
    refusal (or any under the cohort rule) is clone_in's. The step keeps its defaults (cohort,
    width 0, no padding, no groups), its rows carry nothing, and its sequences end."""
    eng, tr = engine(sc, backend=SpyBackend(fail={"clone_in": exc}))
    st = failed_decode(tr)
    assert (st["advance"], st["cache_instruction"], st["width"], st["padding_fraction"],
            st["groups"], st["committed"], st["error"]) == ("cohort", "In", 0, 0.0, 0, 0, kind)
    assert_failed_rows(tr, st)
    assert tr.messages == [f"{kind}: no room"]
    assert tr.summary["errors"] == 1 and len(tr) == st["step"] + 1  # nothing left to run


@pytest.mark.rule("window check, the two guards and the deferral")
def test_a_refused_row_length_resolution_is_the_left_aligned_guard(monkeypatch):
    """The step plan's row lengths (`resolve_row_cache_lens`) refused: the step fails before
    its window is measured."""
    def refuse(*_args):
        raise DispatchRefusal("rows disagree")

    monkeypatch.setattr(dispatch, "resolve_row_cache_lens", refuse)
    eng, tr = engine(per_seq_pair(), backend=SpyBackend())
    st = failed_decode(tr)
    assert (st["advance"], st["width"], st["padding_fraction"], st["error"]) == (
        "per-sequence", 12, 2 / 24, "left-aligned guard")
    assert_failed_rows(tr, st)
    assert tr.messages == ["left-aligned guard: rows disagree"]


@pytest.mark.rule("one batched decode step MtpSpeculativePipeline::step, cohort example w=4 C=10")
def test_a_refused_draft_chain_fails_the_step_after_grouping():
    """The refusal lands after the groups were counted (one group, key (1, 0)) and after
    clone_in consumed the pending leads (the logged state shows pending 0)."""
    eng, tr = engine(per_seq_pair(strip="lazy", steps=4), record_tensors=True,
                     backend=SpyBackend(fail={"draft_chain": StepRefusal("chain broke")}))
    st = failed_decode(tr)
    assert (st["step"], st["groups"], st["error"]) == (2, 1, "draft chain refused")
    assert_failed_rows(tr, st)
    assert tr.messages == ["draft chain refused: chain broke"]
    state = [r for r in tr.tensor_log if r["phase"] == "state"][-1]
    assert state["step"] == 2 and [state["seqs"][i]["pending"] for i in (0, 1)] == [0, 0]


@pytest.mark.rule("one batched decode step MtpSpeculativePipeline::step, cohort example w=4 C=10")
def test_a_refused_rollback_is_the_xs_rollback_refusal():
    """Cohort, all drafts rejected: keep = 1 of w = 4, so the batch truncates by 3 (§16)."""
    spy = SpyBackend(fail={"truncate_by": StepRefusal("xs would go negative")})
    eng, tr = engine(scenario(acceptance="all-reject"), backend=spy)
    st = failed_decode(tr)
    assert st["error"] == "xs rollback refused" and spy.args("truncate_by") == [(3,)]
    assert_failed_rows(tr, st)
    assert tr.messages == ["xs rollback refused: xs would go negative"]


@pytest.mark.rule("one batched decode step MtpSpeculativePipeline::step, cohort example w=4 C=10")
def test_a_cohort_step_that_drops_one_column_truncates_by_one():
    """w = 2, every draft rejected: keep = u + a = 1, n_drop = 1 each step, so C advances by
    exactly one column a step (§16 cohort rollback)."""
    spy = SpyBackend()
    eng, tr = engine(scenario(depth=1, steps=4, acceptance="all-reject"), backend=spy)
    assert [s["width"] for s in steps_of(tr)[1:]] == [6, 7, 8]
    assert spy.args("truncate_by") == [(1,)] * 3


@pytest.mark.rule("one batched decode step MtpSpeculativePipeline::step, cohort example w=4 C=10")
def test_a_cohort_step_that_keeps_every_column_truncates_nothing():
    spy = SpyBackend()
    engine(scenario(acceptance="all-accept"), backend=spy)
    assert spy.args("truncate_by") == []


@pytest.mark.rule("strip policy eager / lazy / none")
@pytest.mark.parametrize("strip", ["lazy", "none"])
def test_a_refused_set_len_is_the_per_sequence_commit_refusal(strip):
    spy = SpyBackend(fail={"commit": CacheRefusal("past the capacity")})
    eng, tr = engine(per_seq_pair(strip=strip), backend=spy)
    st = failed_decode(tr)
    assert st["error"] == "per-sequence commit refused"
    assert_failed_rows(tr, st)
    assert tr.messages == ["per-sequence commit refused: past the capacity"]


@pytest.mark.rule("one batched decode step MtpSpeculativePipeline::step, cohort example w=4 C=10")
def test_a_refused_prompt_forward_fails_the_prompt_step():
    """The prompt's forward refused (a capacity refusal): the prompt step records the error,
    commits nothing, and its sequences end; the run has nothing left to do."""
    spy = SpyBackend(fail={"forward": CacheRefusal("too long")})
    tr = simulator.run(scenario(batch=2, steps=4), backend=spy)
    st = steps_of(tr)
    assert len(st) == 1 and st[0]["phase"] == "prompt" and st[0]["error"] == "capacity refused"
    assert [r["committed"] for r in st[0]["rows"]] == [0, 0] and st[0]["committed"] == 0
    assert tr.messages == ["capacity refused: too long"] and tr.summary["errors"] == 1


@pytest.mark.rule("one batched decode step MtpSpeculativePipeline::step, cohort example w=4 C=10")
def test_the_draft_calls_write_their_warnings_into_the_trace_messages():
    spy = SpyBackend(warn={"prime_draft_kv": "primed", "draft_chain": "drafted",
                           "extend_draft_kvs": "extended"})
    tr = simulator.run(scenario(batch=1, steps=2), backend=spy)
    assert tr.messages == ["primed", "drafted", "extended"]


# ------------------------------------------------------------------------------------ window guard


@pytest.mark.rule("window check, the two guards and the deferral")
def test_a_step_that_did_not_assemble_a_per_sequence_batch_trips_the_follows_guard(tmp_path):
    """WA, granted: step 1 assembles A and B (C = 16) and commits A 4, B 1; step 2 issues
    Nothing on the resident cache, C + w = 20 wide: cache_lens [20, 20] against token
    lengths [21, 18] leave B's tail 0 (§16 step 4)."""
    path = tmp_path / "accepts.json"
    path.write_text('{"0": [3], "1": [0]}')
    sc = load_scenario({"batch": 2, "prompt_len": 16, "max_new_tokens": 40, "steps": 4,
                        "depth": 3, "world": "WA", "advance": "per-sequence",
                        "xs_per_seq": True, "admission": "grant",
                        "acceptance": {"model": "file", "path": str(path)}})
    tr = simulator.run(sc)
    st = failed_decode(tr)
    assert (st["step"], st["cache_instruction"], st["error"]) == (2, "Nothing", "follows guard")
    assert tr.messages == [
        "follows guard: MTP step refused by the follows guard: kv_advance is PerSequence but "
        "this step did not assemble the batch (cache_lens [20, 20], token lengths [21, 18], "
        "w 4); the resident batched cache is C + w wide"]


@pytest.mark.rule("window check, the two guards and the deferral")
def test_a_per_row_step_whose_window_is_not_ok_trips_the_left_aligned_guard(monkeypatch):
    """The step plan's window check says not ok on a step carrying per-row lengths."""
    window = step.plan_step_window
    monkeypatch.setattr(step, "plan_step_window",
                        lambda *a: step.StepWindow(window(*a).uncached, False))
    tr = simulator.run(per_seq_pair(), backend=SpyBackend())
    st = failed_decode(tr)
    assert st["error"] == "left-aligned guard"
    assert tr.messages == [
        "left-aligned guard: MTP step refused by the left-aligned guard: per-row cache_lens "
        "[12, 10] and token lengths [13, 11] leave a tail outside [1, 4]"]


# ------------------------------------------------------------------------------------------- defer


def deferring(**kw):
    """WA cohort (per-sequence requested and refused, so per_seq_kv stays on): seq 2 (3
    tokens) runs ahead; seqs 0 and 3 (4 tokens) join it 3 columns behind, so every window
    check fails and the step defers (§16 step 4)."""
    reqs = [{"prompt_len": p, "max_new_tokens": 25} for p in (4, 9, 3, 4)]
    for i, m in kw.pop("max_new", {}).items():
        reqs[i]["max_new_tokens"] = m
    return load_scenario({"requests": reqs, "steps": 8, "world": "WA",
                          "advance": "per-sequence", "xs_per_seq": True, **kw})


@pytest.mark.rule("window check, the two guards and the deferral")
def test_a_deferred_step_is_one_plain_decode_at_each_rows_own_position():
    """Each deferral clears the draft map, feeds every row its last token at its own
    position (C - lead, = row_q0 with per_seq_kv), commits exactly one token per row and
    leaves nothing filled."""
    spy = SpyBackend()
    eng, tr = engine(deferring(), record_tensors=True, backend=spy)
    assert tr.summary["refusal"] is not None
    st = steps_of(tr)
    defers = [s for s in st if s["phase"] == "defer"]
    recs = [r for r in tr.tensor_log if r["phase"] == "defer"]
    assert len(defers) == len(recs) >= 4
    assert all(r["phase"] == "decode" for r in tr.tensors)  # `tensors`: the verify forwards
    assert [r["step"] for r in recs] == [s["step"] for s in defers]
    for s, rec in zip(defers, recs, strict=True):
        rows = s["rows"]
        own = [r["own_len"] for r in rows]
        assert rec["ids"] == [r["seq"] for r in rows]
        assert rec["positions"] == own == [s["width"] - r["lead"] for r in rows]
        assert rec["row_q0"] == own and rec["lead"] == [r["lead"] for r in rows]
        assert any(r["lead"] for r in rows)
        # the token at index own_len: the last one before the step (own_len cached + 1)
        assert rec["tokens"].tolist() == [[eng.toks[r["seq"]][r["own_len"]]] for r in rows]
        assert [r["committed"] for r in rows] == [1] * len(rows) and s["committed"] == len(rows)
        assert [r["filled"] for r in rows] == [0] * len(rows)
    assert st[-1]["phase"] == "defer" and eng.dmap.entries == {}


@pytest.mark.rule("window check, the two guards and the deferral")
def test_a_sequence_that_finishes_on_a_deferred_step_leaves_the_batch():
    """Seq 3 gets one token from its prompt and one per deferral: with max_new_tokens 3 it
    ends on its second deferral and is in no later step."""
    tr = simulator.run(deferring(max_new={3: 3}))
    st = steps_of(tr)
    prompted = [s["step"] for s in st if 3 in s["prefill"]]
    seen = [(s["step"], s["phase"]) for s in st for r in s["rows"] if r["seq"] == 3]
    assert prompted == [1] and seen == [(2, "defer"), (3, "defer")]
    assert len(st) == 8 and all(s["phase"] == "defer" for s in st[4:5])


@pytest.mark.rule("one batched decode step MtpSpeculativePipeline::step, cohort example w=4 C=10")
def test_a_cohort_verify_runs_at_the_shared_offset_even_on_a_ragged_batch(tmp_path):
    """§16 step 7, the non-per-row route: one shared offset C and no per-row leads. WA: A and
    B decode, B ends; D (7 tokens) is prompted; A (5 cached, 3 uncached) and D are then
    assembled 7 wide with A 2 columns behind, and both tails pass the window check (u = 1),
    so the step verifies (no deferral) at offset 7 for both rows."""
    path = tmp_path / "accepts.json"
    path.write_text('{"0": [2, 3, 0, 2], "1": [0, 0, 3, 2], "2": [3, 1, 1, 0]}')
    sc = load_scenario({"requests": [{"prompt_len": 4, "max_new_tokens": 30},
                                     {"prompt_len": 4, "max_new_tokens": 2},
                                     {"prompt_len": 7, "max_new_tokens": 30, "arrival": 1}],
                        "steps": 4, "depth": 3, "world": "WA", "prefill_floor": 1,
                        "xs_per_seq": True, "acceptance": {"model": "file", "path": str(path)}})
    tr = simulator.TensorEngine(sc, record_tensors=True).run()
    st = steps_of(tr)[3]
    assert (st["phase"], st["advance"], st["cache_instruction"], st["width"]) == (
        "decode", "cohort", "In", 7)
    assert [(r["seq"], r["lead"], r["u"]) for r in st["rows"]] == [(2, 0, 1), (0, 2, 1)]
    rec = tr.tensors[-1]
    assert (rec["step"], rec["ids"]) == (3, [2, 0])
    assert rec["positions"] == [7] and rec["lead"] == [0, 0] and rec["row_q0"] is None
