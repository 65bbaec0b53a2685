"""Boundary conformance: the cases random draws rarely reach, reached on purpose.

- the allocation arithmetic at every integer boundary, at it, one below and one above: the
  capacity a K/V append needs against `max_seq_len`, the draft cache's first 16 columns, each
  512-column block, the 64-entry draft map (`strategies.allocation_lengths`, `around`);
- float32 and bfloat16 at lengths into the thousands and positions bfloat16 cannot hold
  exactly (odd and above 256): RoPE and the port's in-place attention per op, and short end-to-end
  runs with long prompts;
- a small `max_seq_len` where the token budget clamp binds (`hypothesis.target` pushes the
  draws there). Under per-sequence advance a batch of several ragged rows is refused at front
  alignment below `max_seq_len` 512 (a new slot's capacity is 512), so there the clamp binds
  on rows decoding alone, and every row has `u = 1`; under the cohort rule the rows of one
  step carry different `u` (so different draft counts and budgets), and the clamp cuts such
  rows at `max_seq_len` 8-15.

The backend under test is the one `conformance/backends.py` selects; the low-precision cases
load the same backend at float32 and bfloat16 (the NumPy reference is float64 only, so with
`RAGGEDSPEC_BACKEND=numpy` they do not apply). Comparison policy as in `backends.py`.

The tiny model has one KV head by default (K == V, V4's MQA); the long-prompt runs include a
model with two KV heads of four query heads each (GQA), so the head mapping meets long
positions in low precision too (`test_end_to_end.py` runs GQA ratios 2, 4 and 8 in float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import event, example, given, settings, target
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

import raggedspec.gpu.attention as port_attention
import raggedspec.reference.attention as ref_attention
from raggedspec.conformance.backends import (
    EPS,
    assert_close,
    assert_exact,
    backend_under_test,
    compare_runs,
    reference_backend,
    selection,
)
from raggedspec.conformance.helpers import GRANTED
from raggedspec.conformance.strategies import (
    allocation_lengths,
    around,
    bf16_inexact_positions,
)
from raggedspec.gpu import kernel_emulator
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.testing import representable, to_port
from raggedspec.reference import simulator
from raggedspec.reference.backend import NumpyBackend, load_backend
from raggedspec.reference.cache import CACHE_GROW_SIZE, DRAFT_CACHE_CAPACITY
from raggedspec.reference.draft import MAX_DRAFT_KV_SEQS, DraftKv, DraftKvMap
from raggedspec.reference.errors import Refusal
from raggedspec.reference.model import ModelConfig
from raggedspec.reference.plan import plan_commit
from raggedspec.reference.scenario import load_scenario

REF = reference_backend()
# The end-to-end properties run 25 examples unless the profile asks for more (`thorough`).
FEW = settings(max_examples=max(25, settings.default.max_examples // 10))
LOW = ("float32", "bfloat16")
TORCH_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_low: dict[str, object] = {}


def low_precision_backend(dtype: str):
    """The selected backend loaded at `dtype` (one instance per dtype)."""
    spec, device, _ = selection()
    if spec == "numpy":
        pytest.skip("the NumPy reference is float64 only: no low-precision backend to test")
    if dtype not in _low:
        _low[dtype] = load_backend(spec, device, dtype)
    return _low[dtype]


def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except Refusal as exc:
        return ("refused", type(exc).__name__, str(exc))


def needed_capacity(capacity: int, n: int) -> int:
    """The spec's capacity for `n` columns starting from `capacity` (C §3: whole 512 blocks)."""
    if n <= capacity:
        return capacity
    return capacity + -(-(n - capacity) // CACHE_GROW_SIZE) * CACHE_GROW_SIZE


def rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`[1,1,n,2]` K and V of small integers (exact in every dtype)."""
    rng = np.random.default_rng(seed)
    return rng.integers(-8, 8, size=(1, 1, n, 2)).astype(np.float64), rng.integers(
        -8, 8, size=(1, 1, n, 2)).astype(np.float64)


# ----------------------------------------------------------------------------- allocation


@pytest.mark.rule("allocation boundaries: capacity, draft start, 512-column blocks, draft map")
@given(n=allocation_lengths(1, 1600), t=st.one_of(around([1, 16, 512], 1), st.integers(1, 600)),
       capacity=st.sampled_from([16, 512]), slack=st.one_of(around([0]), st.integers(-600, 600)),
       seed=st.integers(0, 9))
@example(n=511, t=1, capacity=512, slack=0, seed=0)    # exactly one block, max_seq_len == capacity
@example(n=512, t=1, capacity=512, slack=-1, seed=0)   # one past the block, max_seq_len one short
@example(n=512, t=1, capacity=512, slack=0, seed=0)
@example(n=1024, t=1, capacity=512, slack=1, seed=0)
@example(n=512, t=512, capacity=512, slack=0, seed=0)   # a shortfall of exactly one block
@example(n=15, t=1, capacity=16, slack=0, seed=0)      # the draft cache's first 16 columns
@example(n=15, t=1, capacity=16, slack=-1, seed=0)     # an exact fill under a smaller max_seq_len
@example(n=511, t=1, capacity=512, slack=-1, seed=0)
@example(n=16, t=1, capacity=16, slack=0, seed=0)
@example(n=16, t=1, capacity=16, slack=-1, seed=0)
@example(n=10, t=6, capacity=16, slack=-1, seed=0)
def test_append_at_every_allocation_boundary_matches_the_reference(n, t, capacity, slack, seed):
    """A slot of `n` columns (capacity 16 or 512) appended `t` more, under a `max_seq_len`
    placed at the capacity the append needs plus `slack` (0: exactly at it; -1: one short).
    The reference follows the spec (refused iff the append must grow the slot and the grown
    capacity is above max_seq_len; an exact fill never grows), and the port agrees: same
    refusal message, same length and capacity."""
    need_first = needed_capacity(capacity, n)
    need = needed_capacity(need_first, n + t)
    # the slot itself must be buildable (the append is the case); without growth any
    # max_seq_len >= 1 is (even one below the capacity: an exact fill needs no growth)
    max_seq_len = max(need + slack, need_first if n > capacity else 1)
    target(-float(abs(max_seq_len - need)), label="max_seq_len - needed capacity")
    k, v = rows(n, seed)
    k2, v2 = rows(t, seed + 1)
    be = backend_under_test()
    r_kv = REF.kv_from_arrays(k, v, max_seq_len, capacity)
    p_kv = be.kv_from_arrays(k, v, max_seq_len, capacity)
    assert_exact(be.materialize(p_kv)["capacity"], [need_first], "capacity after building")
    r, p = outcome(REF.kv_append, r_kv, k2, v2), outcome(be.kv_append, p_kv, k2, v2)
    fits = need == need_first or need <= max_seq_len
    assert r[0] == ("ok" if fits else "refused"), f"reference: {r}"
    assert p[:3] == r[:3], f"port {p[:3]} but reference {r[:3]}"
    want = need if r[0] == "ok" else need_first
    pm, rm = be.materialize(p_kv), REF.materialize(r_kv)
    assert_exact(rm["capacity"], [want], "reference capacity")
    assert_exact(pm["capacity"], rm["capacity"], "capacity")
    assert_exact(pm["len"], rm["len"], "length")
    assert_exact(be.cache_len(p_kv), n + t if r[0] == "ok" else n, "length after the append")
    assert_exact(np.asarray(pm["kv"][0][0]), rm["kv"][0][0], "K")


@pytest.mark.rule("allocation boundaries: capacity, draft start, 512-column blocks, draft map")
@given(n=around([MAX_DRAFT_KV_SEQS], 1), touch=st.integers(0, 80))
@example(n=MAX_DRAFT_KV_SEQS + 1, touch=0)
@example(n=MAX_DRAFT_KV_SEQS, touch=MAX_DRAFT_KV_SEQS - 1)
def test_the_draft_map_holds_64_and_evicts_the_least_recently_checked_in(n, touch):
    """`n` sequences checked in (one of them checked in again last): the map holds
    `min(n, 64)` entries and the evicted ones are the earliest checked in."""
    m = DraftKvMap()
    for s in range(n):
        m.checkin(s, DraftKv(cache=None))
    again = touch % n
    m.checkin(again, m.checkout_draft_kv(again))
    order = [s for s in range(n) if s != again] + [again]
    assert len(m.entries) == min(n, MAX_DRAFT_KV_SEQS)
    assert sorted(m.entries) == sorted(order[-MAX_DRAFT_KV_SEQS:])


@pytest.mark.rule("allocation boundaries: capacity, draft start, 512-column blocks, draft map")
@FEW
@given(start=around([DRAFT_CACHE_CAPACITY]), n=st.integers(1, 3), seed=st.integers(0, 99))
@example(start=15, n=2, seed=0)   # the chain crosses the draft cache's first 16 columns
def test_propose_chain_across_the_draft_caches_first_16_columns(start, n, seed):
    """The protocol's `propose_chain` on each backend's own draft cache: a chain of `start`
    tokens, then one of `n` from there (so the draft cache grows past its first 16 columns
    when `start + n > 16`): the same tokens, lengths and capacities as the reference, the draft
    K within the policy."""
    cfg = ModelConfig()
    be = backend_under_test()
    p_model, r_model = be.build_model(cfg), REF.build_model(cfg)
    p_kv, r_kv = be.new_draft_cache(p_model), REF.new_draft_cache(r_model)
    rng = np.random.default_rng(seed)
    for at, m in ((0, start), (start, n)):
        seed_h, last = rng.standard_normal((1, cfg.hidden)), int(rng.integers(0, cfg.vocab))
        p = be.propose_chain(p_model, seed_h, [last], m, [at], p_kv)
        r = REF.propose_chain(r_model, seed_h, [last], m, [at], r_kv)
        assert_exact([[int(x) for x in c] for c in p], [[int(x) for x in c] for c in r], "chain")
    pm, rm = be.materialize(p_kv), REF.materialize(r_kv)
    assert_exact(pm["len"], rm["len"], "draft length")
    assert_exact(pm["capacity"], rm["capacity"], "draft capacity")
    assert_close(pm["kv"][0][0], rm["kv"][0][0], be.dtype, "draft K")


# ----------------------------------------------------------------------------- low precision


@pytest.mark.rule("positions low precision cannot hold")
@pytest.mark.parametrize("dtype", LOW)
@given(offsets=st.lists(bf16_inexact_positions(257, 4000), min_size=1, max_size=3),
       t=st.integers(1, 3), inverse=st.booleans(), seed=st.integers(0, 99))
@example(offsets=[257], t=1, inverse=False, seed=0)
@example(offsets=[3999, 301], t=2, inverse=True, seed=1)
def test_rope_at_positions_the_dtype_cannot_hold(dtype, offsets, t, inverse, seed):
    """RoPE at positions above 256 (odd: not a bfloat16 value) in float32 and bfloat16:
    positions stay integers, so the rotation is within the dtype's policy of the float64
    reference (a port that rounds a position to its dtype rotates by the wrong angle)."""
    be = low_precision_backend(dtype)
    b = len(offsets)
    x = representable(np.random.default_rng(seed).normal(size=(b, 2, t, 8)), TORCH_DTYPE[dtype])
    got = be.to_numpy(be.apply_rope(x, offsets, 8, 10000.0, inverse))
    want = REF.apply_rope(x, offsets, 8, 10000.0, inverse)
    assert_close(got, want, dtype, "apply_rope")
    assert_exact(be.rope_positions(offsets, b, t), REF.rope_positions(offsets, b, t), "positions")


@pytest.mark.rule("positions low precision cannot hold")
@pytest.mark.parametrize("dtype", LOW)
@given(own=st.lists(st.one_of(allocation_lengths(1, 3000), bf16_inexact_positions(257, 3000)),
                    min_size=1, max_size=3),
       t_q=st.integers(1, 3), ratio=st.sampled_from([0, 4, 128]), window=st.sampled_from([4, 128]),
       seed=st.integers(0, 99))
@example(own=[3000, 513], t_q=3, ratio=4, window=128, seed=0)
@example(own=[511, 2049, 1], t_q=1, ratio=128, window=4, seed=1)
def test_in_place_attention_at_long_lengths_in_low_precision(dtype, own, t_q, ratio, window, seed):
    """The port's in-place attention over rows of own lengths into the thousands (block
    boundaries and bf16-inexact lengths included) in float32 / bfloat16 equals the float64
    reference's `dsv4_attention` of the front-aligned batch (same dtype-rounded inputs)
    within 16 eps of the output's scale."""
    td = TORCH_DTYPE[dtype]
    rng = np.random.default_rng(seed)
    own = [n + t_q for n in own]
    b, n_max = len(own), max(own)
    k_place = representable(rng.normal(size=(b, 1, n_max + 3, 8)), td)
    v_place = representable(rng.normal(size=(b, 1, n_max + 3, 8)), td)
    k_front, v_front = np.zeros((b, 1, n_max, 8)), np.zeros((b, 1, n_max, 8))
    for i, n in enumerate(own):
        k_front[i, 0, n_max - n:] = k_place[i, 0, :n]
        v_front[i, 0, n_max - n:] = v_place[i, 0, :n]
    t_c = n_max // ratio if ratio else 0
    comp = representable(rng.normal(size=(b, 1, t_c, 8)), td) if t_c else None
    q = representable(rng.normal(size=(b, 2, t_q, 8)), td)
    sinks = representable(rng.normal(size=2), td)
    kv = RaggedKv(to_port(k_place, td), to_port(v_place, td), torch.tensor(own),
                  max_seq_len=1 << 20)
    comp_t = None if comp is None else to_port(comp, td)
    got = port_attention.dsv4_attention_in_place(to_port(q, td), kv, comp_t, ratio, window,
                                                 to_port(sinks, td))
    assert got.dtype == td
    cfg = ref_attention.Dsv4AttentionConfig(ratio, window, 0, [n - t_q for n in own])
    want = ref_attention.dsv4_attention(q, k_front, v_front, comp, None, cfg, sinks)
    err = float(np.abs(got.to(torch.float64).numpy() - want).max())
    assert err <= 16 * EPS[dtype] * float(np.abs(v_place).max()), f"{dtype}: max error {err:.3e}"


LONG = [  # (scenario, a length some row passes)
    (dict(batch=2, prompt_len=[300, 530], max_new_tokens=6, steps=4, depth=2,
          advance="per-sequence", xs_per_seq=True, admission="grant", world="WB",
          acceptance="all-accept"), 256),
    (dict(batch=2, prompt_len=[509, 512], max_new_tokens=8, steps=4, depth=3,
          acceptance="all-accept"), 512),
    (dict(batch=2, prompt_len=[1021, 2047], max_new_tokens=6, steps=3, depth=2,
          advance="per-sequence", xs_per_seq=True, admission="grant", world="WB",
          acceptance="all-accept", max_seq_len=4096), 1536),  # lengths into the thousands
    (dict(batch=2, prompt_len=[300, 530], max_new_tokens=6, steps=4, depth=2,
          advance="per-sequence", xs_per_seq=True, admission="grant", world="WB",
          acceptance="all-accept", model={"n_heads": 8, "n_kv_heads": 2}), 256),
]


@pytest.mark.rule("positions low precision cannot hold")
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("case", [0, 1] + [pytest.param(c, marks=pytest.mark.slow)
                                          for c in range(2, len(LONG))])
def test_long_prompts_end_to_end_in_low_precision(dtype, case):
    """Short runs with prompts of 300-2047 tokens: positions bfloat16 cannot hold, the first
    512-column block crossed while decoding, rows more than 1536 long, and one run with two KV
    heads (GQA ratio 4): every step's state within the policy of the float64 reference and
    the integer trace identical."""
    data, past = LONG[case]
    sc = load_scenario(data)
    ref = simulator.run(sc, record_tensors=True, backend=REF)
    out = simulator.run(sc, record_tensors=True, backend=low_precision_backend(dtype))
    counts = compare_runs(out, ref, dtype)
    assert counts["forwards"] >= 3
    assert max(r["own_len"] + r["committed"] for s in ref.steps() for r in s["rows"]) > past


# ----------------------------------------------------------------------------- budget clamp


class ClampProbe(NumpyBackend):
    """The reference, counting the rows the budget clamp cut (`bound`) and, of those, the rows
    cut on a step whose rows have different `u` and draft different numbers of tokens
    (`bound_ragged_u`; the step's `u` from its plan, its drafts from `draft_chain`).
    `run(sc)` runs the tensor mode on it, watching the step plan's commit."""

    def __init__(self) -> None:
        super().__init__()
        self.bound = 0
        self.bound_ragged_u = 0
        self.u: list[int] = []
        self.drafted: list[int] = []

    def upload_plan(self, plan):
        self.u, self.drafted = plan.u.tolist(), [0] * plan.batch
        return super().upload_plan(plan)

    def draft_chain(self, model, groups, states, toks, cache_lens, budgets, w, psa,
                    warnings=None):
        chains = super().draft_chain(model, groups, states, toks, cache_lens, budgets, w, psa,
                                     warnings)
        self.drafted = [w - u if c else 0 for u, c in zip(self.u, chains, strict=True)]
        return chains

    def _commit_plan(self, plan, verified, remaining, w, strip):
        out = plan_commit(plan, verified, remaining, w, strip)
        cut = sum(a != o for a, o in zip(verified, out.accepted.tolist(), strict=True))
        self.bound += cut
        if len(set(self.u)) > 1 and len(set(self.drafted)) > 1:
            self.bound_ragged_u += cut
        return out

    def run(self, sc, **kw):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(simulator, "plan_commit", self._commit_plan)
            return simulator.run(sc, backend=self, **kw)


def port_matches_the_clamped_reference(sc, count: str, label: str, seen: str) -> ClampProbe:
    """Run `sc` on the reference through a `ClampProbe`, steer Hypothesis toward more of the
    probe's `count` cuts (`target`, `event` when any, inside a Hypothesis example), compare
    the port's run with it, and return the probe."""
    probe = ClampProbe()
    ref = probe.run(sc, record_tensors=True)
    if currently_in_test_context():  # a Hypothesis example (the fixed examples run alone too)
        target(float(getattr(probe, count)), label=label)
        if getattr(probe, count):
            event(seen)
    out = simulator.run(sc, record_tensors=True, backend=backend_under_test())
    compare_runs(out, ref, backend_under_test().dtype)
    return probe


def per_sequence_clamp_scenario(max_seq_len, plens, depth, acceptance, seed):
    """Three rows (prompts in `plens`) under granted per-sequence advance, a small
    `max_seq_len`."""
    return load_scenario(dict(GRANTED, batch=3, prompt_len=list(plens), max_new_tokens=30,
                              steps=10, depth=depth, max_seq_len=max_seq_len,
                              acceptance=acceptance, seed=seed))


PER_SEQUENCE_CLAMP = dict(max_seq_len=12, plens=(2, 6), depth=3, acceptance="all-accept", seed=0)
# the per-sequence scenarios the two properties below draw (ragged prompts, max_seq_len 12-20)
PER_SEQUENCE_DRAWS = dict(
    max_seq_len=st.integers(12, 20), plens=st.tuples(st.integers(2, 6), st.integers(6, 11)),
    depth=st.integers(2, 3), acceptance=st.sampled_from(["all-accept", "geometric:0.8"]),
    seed=st.integers(0, 9))


@pytest.mark.slow
@pytest.mark.rule("budget clamp binding on ragged rows")
@FEW
@given(**PER_SEQUENCE_DRAWS)
@example(**PER_SEQUENCE_CLAMP)
def test_the_budget_clamp_binding_on_ragged_rows_matches_the_reference(max_seq_len, plens, depth,
                                                                       acceptance, seed):
    """Per-sequence advance with ragged prompts and a `max_seq_len` of 12-20, where the token
    budget clamps the accepted counts (`target` pushes toward more clamped rows); the port's
    run equals the reference's step for step."""
    sc = per_sequence_clamp_scenario(max_seq_len, plens, depth, acceptance, seed)
    port_matches_the_clamped_reference(sc, "bound", "rows the budget clamp cut",
                                       "budget clamp bound")


@pytest.mark.rule("budget clamp binding on ragged rows")
def test_the_budget_clamp_example_binds():
    """The explicit example above does reach the case (the clamp cuts a row's accepted count),
    and there the port's run equals the reference's step for step."""
    probe = port_matches_the_clamped_reference(per_sequence_clamp_scenario(**PER_SEQUENCE_CLAMP),
                                               "bound", "rows the budget clamp cut",
                                               "budget clamp bound")
    assert probe.bound >= 1


@pytest.mark.rule("one uncached token per row under per-sequence advance")
@FEW
@given(**PER_SEQUENCE_DRAWS)
@example(**PER_SEQUENCE_CLAMP)
def test_under_per_sequence_advance_every_decode_row_has_one_uncached_token(max_seq_len, plens,
                                                                           depth, acceptance,
                                                                           seed):
    """Reference only, over the scenarios of the per-sequence clamp test above: every decode
    step that runs has `u = 1` on every row (the commit leaves the cache at `L - 1`: the row
    keeps its `u + a` window tokens and the one sampled token is uncached; C §12.2), so no
    clamp there cuts a row on a step whose rows have different `u`. That case is reached under
    the cohort rule (below)."""
    sc = per_sequence_clamp_scenario(max_seq_len, plens, depth, acceptance, seed)
    probe = ClampProbe()
    trace = probe.run(sc)
    ran = [s for s in trace.steps() if s["phase"] == "decode" and not s["error"]]
    event(f"decode steps that ran: {min(len(ran), 3)}{'+' if len(ran) >= 3 else ''}")
    assert {r["u"] for s in ran for r in s["rows"]} <= {1}
    assert probe.bound_ragged_u == 0


# Cohort advance at max_seq_len 8-15: the rows of one batch share the cache length C, and the
# cohort rule leaves `u_i + a_i + 1 - keep` tokens of row i uncached, so the rows of a step
# carry different u, draft `w - u_i` tokens each and have different budgets
# `max_seq_len - C - u_i`. Each entry is a run whose clamp cuts such a row.
RAGGED_U = [
    dict(max_seq_len=8, plens=(2, 3), depth=3, acceptance="geometric:0.5", seed=1),  # u 1, 2, 3
    dict(max_seq_len=10, plens=(3, 5), depth=3, acceptance="geometric:0.5", seed=1),
    dict(max_seq_len=12, plens=(3, 5), depth=3, acceptance="geometric:0.5", seed=0),
]


def ragged_u_scenario(max_seq_len, plens, depth, acceptance, seed):
    """Three rows (prompts in `plens`), cohort advance, a small `max_seq_len`."""
    return load_scenario(dict(batch=3, prompt_len=list(plens), max_new_tokens=30, steps=14,
                              depth=depth, advance="cohort", max_seq_len=max_seq_len,
                              acceptance=acceptance, seed=seed))


@pytest.mark.slow
@pytest.mark.rule("budget clamp binding on rows of different u")
@FEW
@given(max_seq_len=st.integers(8, 15), plens=st.tuples(st.integers(2, 3), st.integers(3, 6)),
       depth=st.integers(2, 3), acceptance=st.sampled_from(["geometric:0.5", "geometric:0.8"]),
       seed=st.integers(0, 9))
@example(**RAGGED_U[0])
@example(**RAGGED_U[1])
@example(**RAGGED_U[2])
def test_the_budget_clamp_binding_on_rows_of_different_u_matches_the_reference(max_seq_len, plens,
                                                                               depth, acceptance,
                                                                               seed):
    """Cohort advance with a `max_seq_len` of 8-15, where the token budget clamp cuts rows on
    steps whose rows have different `u` (so different draft counts and budgets; `target`
    pushes toward more such cuts): the port's run equals the reference's step for step."""
    sc = ragged_u_scenario(max_seq_len, plens, depth, acceptance, seed)
    port_matches_the_clamped_reference(sc, "bound_ragged_u",
                                       "rows the clamp cut on a step of different u",
                                       "budget clamp bound on rows of different u")


@pytest.mark.rule("budget clamp binding on rows of different u")
@pytest.mark.parametrize("case", range(len(RAGGED_U)))
def test_the_budget_clamp_examples_bind_on_rows_of_different_u(case):
    """Each explicit example above does reach the case (the clamp cuts a row's accepted count
    on a step whose rows have different `u` and draft different numbers of tokens), and there
    the port's run equals the reference's step for step."""
    probe = port_matches_the_clamped_reference(ragged_u_scenario(**RAGGED_U[case]),
                                               "bound_ragged_u",
                                               "rows the clamp cut on a step of different u",
                                               "budget clamp bound on rows of different u")
    assert probe.bound_ragged_u >= 1


@pytest.mark.rule("positions low precision cannot hold")
@pytest.mark.skipif(kernel_emulator.compilers()["g++"] is None,
                    reason="the kernel emulator needs g++")
@settings(max_examples=10)
@given(offsets=st.lists(bf16_inexact_positions(257, 4000), min_size=1, max_size=3),
       inverse=st.booleans(), seed=st.integers(0, 99))
def test_the_kernel_backend_rope_at_long_positions(offsets, inverse, seed):
    """The kernel backend's own RoPE (`rs_rope`, run by the g++ emulator on the CPU) at
    positions into the thousands equals the float64 reference."""
    be = _kernel_backend()
    x = np.random.default_rng(seed).normal(size=(len(offsets), 2, 2, 8))
    got = be.to_numpy(be.apply_rope(x, offsets, 8, 10000.0, inverse))
    want = REF.apply_rope(x, offsets, 8, 10000.0, inverse)
    assert_close(got, want, "float64", "kernel apply_rope")


def _kernel_backend():
    if "kernel" not in _low:
        from raggedspec.gpu.cupy_backend import emulated

        _low["kernel"] = emulated()
    return _low["kernel"]
