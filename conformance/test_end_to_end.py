"""End-to-end conformance: one scenario run by the step simulator on the reference backend
(NumPy) and on the backend under test (`conformance/backends.py`: torch by default), every
step's state compared tensor for tensor and the integer trace compared line for line
(`backends.compare_runs`): target and draft caches materialized front-aligned, masks, RoPE
positions, hidden states, logits, compressor histories, lengths, capacities and every
warning. Control flow never reads a float (acceptance comes from the integer oracles), so
both runs take the same path and every record has a partner.

The default run compares the two backends on fixed scenarios (conformance/helpers.py `FIXED`:
ragged per-sequence steps under each strip policy, WA deferrals, LRU eviction, capacity
refusals, Tier A, compressed layers), on the three explicit GQA models (2 KV heads serving 2,
4 or 8 query heads each), on the spec's worked examples, and checks that the comparison can
fail (negative controls). The generated properties are slow (`-m slow`): small scenarios (B
1..4, depth 0..3, 3..9 steps; `strategies.e2e_scenarios`) that reach the same corners at
random, with one KV head and with several (GQA: `n_kv_heads` 2 or 4, 2, 4 or 8 query heads per
KV head), where a port that maps query head h to the wrong KV head (say `h % n_kv_heads` for
`h // (n_heads / n_kv_heads)`) differs at the first forward; with one KV head every mapping
agrees, so the one-KV-head runs cannot see it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from raggedspec.conformance.backends import Mismatch, compare_runs
from raggedspec.conformance.helpers import (
    FIXED,
    GQA,
    cohort_example,
    per_sequence_example,
    run_both,
)
from raggedspec.conformance.strategies import GQA_RATIOS, e2e_scenarios, kv_head_layouts
from raggedspec.reference import simulator
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.scenario import load_scenario, model_config

# The main property keeps the tiny model's one KV head (st.just draws nothing, so its examples
# are the ones it always had); GQA layouts have their own property below. `scenarios`, `FIXED`,
# `GQA` and `run_both` are also what other test files (paged, kernels) import from here.
scenarios = e2e_scenarios(st.just((2, 1)))
gqa_scenarios = e2e_scenarios(kv_head_layouts(kv_heads=(2, 4), ratios=GQA_RATIOS))


# ------------------------------------------------------------ fixed scenarios and the GQA examples


@pytest.mark.rule("end to end: the same scenario on two backends")
@pytest.mark.parametrize("case", range(len(FIXED)))
def test_fixed_scenarios_match_the_reference(case):
    """Hand-picked scenarios through the paths the property must reach; compared the same way."""
    port, ref, be = run_both(FIXED[case])
    counts = compare_runs(port, ref, be.dtype)
    assert counts["forwards"] >= 3 and counts["tensors"] > 20



@pytest.mark.rule("end to end with several KV heads")
@pytest.mark.parametrize("ratio", sorted(GQA))
def test_the_gqa_examples_match_the_reference(ratio):
    """The explicit GQA models (two KV heads, `ratio` query heads each) compared as every
    scenario is: a port that maps query head h to the wrong KV head fails at the first
    forward's hidden state."""
    cfg = model_config(load_scenario(GQA[ratio]))
    assert cfg.n_kv_heads == 2 and cfg.n_heads // cfg.n_kv_heads == ratio
    port, ref, be = run_both(GQA[ratio])
    counts = compare_runs(port, ref, be.dtype)
    assert counts["forwards"] >= 3 and counts["tensors"] > 20


@pytest.mark.rule("end to end: the same scenario on two backends")
def test_the_fixed_scenarios_reach_the_interesting_paths():
    """Non-degeneracy: across the fixed scenarios the reference runs ragged per-sequence
    steps (a lead > 0 with per-row positions), the lazy and none strip policies, deferrals
    on ragged WA batches (per-row RoPE offsets with the dead prefix attended), draft groups
    with per-row chain starts, failed steps and poisoned draft KVs, so the comparison above
    covers every kind of state."""
    seen = set()
    for data in FIXED:
        tr = simulator.run(load_scenario(data), record_tensors=True)
        seen |= paths_reached(tr)
        if (
            tr.header["scenario"]["strip"] != "eager"
            and tr.header["scenario"]["advance"] == "per-sequence"
        ):
            seen.add(f"strip {tr.header['scenario']['strip']}")
        if any(r["phase"] == "state" and any(d["seed"] is not None for d in r["drafts"].values())
               for r in tr.tensor_log):
            seen.add("draft states recorded")
    needed = {
        "phase prompt",
        "phase decode",
        "phase defer",
        "ragged per-sequence step",
        "ragged cohort batch",
        "failed step",
        "per-row chain starts in one group",
        "poisoned draft KV",
        "strip lazy",
        "strip none",
        "draft states recorded",
    }
    assert needed <= seen, f"not reached: {sorted(map(str, needed - seen))}"


@pytest.mark.rule("end to end with several KV heads")
def test_the_gqa_examples_have_several_kv_heads_and_reach_the_ragged_paths():
    """Non-degeneracy of the explicit GQA examples: ratios 2, 4 and 8, each with several KV
    heads; together they run ragged per-sequence steps, ragged cohort batches and the MTP
    chain, and every recorded K/V cache has `n_kv_heads` heads."""
    seen, ratios = set(), set()
    for data in GQA.values():
        sc = load_scenario(data)
        cfg = model_config(sc)
        assert cfg.n_kv_heads >= 2
        ratios.add(cfg.n_heads // cfg.n_kv_heads)
        tr = simulator.run(sc, record_tensors=True)
        seen |= paths_reached(tr)
        assert kv_heads_recorded(tr) == {cfg.n_kv_heads}
    assert ratios == set(GQA_RATIOS)
    needed = {"phase decode", "ragged per-sequence step", "ragged cohort batch"}
    assert needed <= seen, f"not reached: {sorted(needed - seen)}"


def kv_heads_recorded(trace) -> set[int]:
    """The head counts of every materialized K/V cache in a run's state records (the
    sequences' target caches and their draft KVs)."""
    caches = []
    for r in trace.tensor_log:
        if r["phase"] == "state":
            caches += [kv for s in r["seqs"].values() for kv in s["kv"]]
            caches += [kv for d in r["drafts"].values() if d["kv"] for kv in d["kv"]["kv"]]
    return {k.shape[1] for k, _ in (c for c in caches if c is not None) if k is not None}


def paths_reached(trace) -> set[str]:
    """What a reference run went through (Hypothesis events; the non-degeneracy test)."""
    seen = set()
    for s in trace.steps():
        seen.add(f"phase {s['phase']}")
        if (
            s["phase"] == "decode"
            and s["advance"] == "per-sequence"
            and any(r["lead"] > 0 for r in s["rows"])
        ):
            seen.add("ragged per-sequence step")
        if (
            s["phase"] in ("decode", "defer")
            and s["advance"] == "cohort"
            and any(r["lead"] > 0 for r in s["rows"])
        ):
            seen.add("ragged cohort batch")  # WA: a deferral's plain decode at per-row positions
        if s.get("error"):
            seen.add("failed step")
        starts = {
            r["chain_start"]
            for r in s["rows"]
            if r["group"] == [r["u"], 0] and r["chain_start"] is not None
        }
        if len(starts) > 1:
            seen.add("per-row chain starts in one group")
    if any("poisoned" in m for m in trace.messages):
        seen.add("poisoned draft KV")
    return seen


# ---------------------------------------------------------------------- the spec's worked examples


@pytest.mark.rule("the spec's worked examples end to end",
                  "end to end: the same scenario on two backends")
def test_the_per_sequence_example_matches_tensor_for_tensor(tmp_path):
    """C §16 PerSequence example (A own 12, B own 10 -> leads [0, 2], chain starts [11, 9],
    A accepts 2, B 0) on both backends: the ragged step's masks kill B's two dead columns,
    its positions are [12, 10] + t, and every tensor matches."""
    port, ref, be = run_both(per_sequence_example(tmp_path))
    compare_runs(port, ref, be.dtype)
    ragged = next(r for r in port.tensor_log if r["phase"] == "decode")
    assert ragged["lead"] == [0, 2] and ragged["row_q0"] == [12, 10]
    assert ragged["rope_positions"].tolist() == [[12, 13, 14, 15], [10, 11, 12, 13]]
    mask = ragged["masks"][0]  # layer 0, keys [0, 16): row 1's columns 0, 1 are its dead prefix
    assert mask.shape == (2, 1, 4, 16)
    assert np.isneginf(mask[1, 0, :, :2]).all() and not np.isneginf(mask[0, 0, 0, :2]).any()



@pytest.mark.rule("the spec's worked examples end to end")
def test_the_cohort_example_matches_tensor_for_tensor(tmp_path):
    """C §16 cohort example (C = 10, A u=1, B u=2; keep 2, n_drop 2) on both backends."""
    port, ref, be = run_both(cohort_example(tmp_path))
    counts = compare_runs(port, ref, be.dtype)
    assert counts["forwards"] == 4 and [s["width"] for s in port.steps()][2:] == [10, 12]



# ------------------------------------------------------------------------------- negative controls


class _ForgetsTheDeadPrefix(NumpyBackend):
    """The reference with one defect: the verify forward drops `row_q0`, so a ragged row's
    dead prefix is attended (a mask that forgets the dead prefix)."""

    name = "numpy-forgets-dead-prefix"

    def forward(self, model, tokens, cache, offsets, row_q0, lead_pad, capture=None, plan=None):
        return super().forward(model, tokens, cache, offsets, None, lead_pad, capture, plan)


class _RoundsHidden(NumpyBackend):
    """The reference with a float defect well inside "close": hidden states perturbed by
    1e-9 relative (a float64 port must be within 1e-12)."""

    name = "numpy-rounds-hidden"

    def forward(self, model, tokens, cache, offsets, row_q0, lead_pad, capture=None, plan=None):
        fwd = super().forward(model, tokens, cache, offsets, row_q0, lead_pad, capture, plan)
        fwd.hidden *= 1 + 1e-9
        return fwd


@pytest.mark.rule("the end-to-end comparison can fail")
def test_the_comparison_catches_a_mask_that_forgets_the_dead_prefix():
    """Negative control: the same ragged scenario on a backend whose forward forgets the dead
    prefix fails the comparison at the first ragged step's hidden state, not before."""
    with pytest.raises(Mismatch, match=r"step \d+ \(decode\) hidden"):
        compare_runs(*run_both(FIXED[1], _ForgetsTheDeadPrefix())[:2], "float64")
    with pytest.raises(Mismatch, match="hidden"):
        compare_runs(*run_both(FIXED[1], _RoundsHidden())[:2], "float64")
    good, ref, _ = run_both(FIXED[1], NumpyBackend())
    assert compare_runs(good, ref, "float64")["tensors"] > 100


@pytest.mark.rule("the end-to-end comparison can fail")
def test_the_comparison_catches_a_length_recorded_with_its_padding():
    """Negative control: a backend whose per-sequence commit keeps the padded width (the
    re-converging rows of DESIGN.md) changes the integer trace, which the comparison names."""

    class PaddedCommit(NumpyBackend):
        def commit(self, cache, strip_lead, kv_len, xs_len):
            super().commit(cache, 0, strip_lead + kv_len, strip_lead + xs_len)

    with pytest.raises(Mismatch, match="integer trace line"):
        compare_runs(*run_both(FIXED[1], PaddedCommit())[:2], "float64")


# ---------------------------------------------------------------------- generated scenarios (slow)


@pytest.mark.slow
@pytest.mark.rule("end to end: the same scenario on two backends")
@given(data=scenarios)
def test_every_step_of_a_generated_scenario_matches_the_reference(data):
    """The issue's end-to-end property: same scenario, two backends, every step's state
    compared tensor for tensor and the integer trace identical."""
    port, ref, be = run_both(data)
    for label in sorted(paths_reached(ref)):
        event(label)
    counts = compare_runs(port, ref, be.dtype)
    assert counts["forwards"] >= 1 or not any(s["phase"] != "idle" for s in ref.steps())



@pytest.mark.slow
@pytest.mark.rule("end to end with several KV heads")
@settings(max_examples=max(25, settings.default.max_examples // 4))
@example(data=GQA[2])
@example(data=GQA[4])
@example(data=GQA[8])
@given(data=gqa_scenarios)
def test_models_with_several_kv_heads_match_the_reference(data):
    """GQA end to end: models with 2 or 4 KV heads, 2, 4 or 8 query heads each (the explicit
    examples: ratios 2, 4 and 8 with two KV heads), run by both backends and compared as the
    property above compares (K/V caches `[B, n_kv_heads, T, D]`, hidden states, logits, the
    integer trace). Query head h reads KV head `h // (n_heads / n_kv_heads)` in the
    reference; a port with another mapping fails here at the first forward's hidden state."""
    cfg = model_config(load_scenario(data))
    assert cfg.n_kv_heads >= 2 and cfg.n_heads // cfg.n_kv_heads in GQA_RATIOS
    port, ref, be = run_both(data)
    counts = compare_runs(port, ref, be.dtype)
    assert counts["forwards"] >= 1 or not any(s["phase"] != "idle" for s in ref.steps())

