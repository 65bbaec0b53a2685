"""The spec's simulator test catalogue on the two advance rules (cache-and-draft.md §17.2) at
B = 128, where only the lengths mode is fast enough: per-sequence advance never lets a tail
ratchet, is token-identical to each stream run alone (against an oracle independent of the
engine, `sim_step_per_sequence` of §17.1, and in tensor mode on real token lists), is identical
to the cohort rule at batch one, and frees tok/step from the cohort bound; cohort keep is the
minimum of the per-sequence commits; the spread, the strip policies and the draft-KV map's LRU
cap at this scale.
"""

import functools

import numpy as np
import pytest

from raggedspec.conformance.helpers import GRANTED, decode_rows
from raggedspec.reference import lengths, simulator
from raggedspec.reference.acceptance import Profile
from raggedspec.reference.scenario import load_scenario


def b128(advance: str, steps: int = 200, **extra):
    data = {
        "batch": 128,
        "prompt_len": 32,
        "max_new_tokens": 4 * steps,
        "steps": steps + 1,
        "depth": 3,
        "acceptance": "profile:0.74,0.54,0.41",
        "max_draft_kv_seqs": None,
        "seed": 1,
        **extra,
    }
    if advance == "per-sequence":
        data.update(GRANTED)
    return load_scenario(data)


@functools.cache
def run_b128(advance: str):
    return lengths.run(b128(advance))


@functools.cache
def solo_runs(steps: int = 200):
    """Each of the 128 streams alone under `sim_step_per_sequence` (§17.1), an oracle
    independent of the engine: after the 32-token prompt (L = 33) every step has u = 1,
    drafts 3, accepts the acceptance model's count a and commits a + 1."""
    model = Profile([0.74, 0.54, 0.41], 1)
    out = {i: [] for i in range(128)}
    big_l = np.full(128, 33)
    for _ in range(steps):
        a = model.accepted(np.arange(128), big_l, np.full(128, 3), 0)
        for i in range(128):
            out[i].append((1, 3, int(a[i]), int(a[i]) + 1))
        big_l = big_l + a + 1
    return out


def per_stream(trace):
    out = {}
    for _, r in decode_rows(trace):
        out.setdefault(r["seq"], []).append((r["u"], r["drafted"], r["accepted"], r["committed"]))
    return out


@pytest.mark.rule("per_sequence_advance_is_token_identical_to_the_b1_reference")
def test_the_engine_alone_matches_the_solo_oracle():
    """The engine's own solo runs (the other requests never arrive, so the stream keeps
    its id) agree with `solo_runs` for a few streams: the oracle is the engine's B = 1."""
    for i in (0, 5, 127):
        reqs = [{"prompt_len": 32, "max_new_tokens": 800, "arrival": 10**9}] * i
        reqs = reqs + [{"prompt_len": 32, "max_new_tokens": 800}]
        sc = load_scenario(
            {
                "requests": reqs,
                "steps": 61,
                "depth": 3,
                "acceptance": "profile:0.74,0.54,0.41",
                "max_draft_kv_seqs": None,
                "seed": 1,
            }
        )
        rows = [
            (r["u"], r["drafted"], r["accepted"], r["committed"])
            for _, r in decode_rows(lengths.run(sc))
        ]
        assert rows == solo_runs()[i][:60]


@pytest.mark.rule("per_sequence_advance_never_lets_a_tail_ratchet_at_b128")
def test_per_sequence_advance_never_lets_a_tail_ratchet_at_b128():
    """Depth 3, 200 steps, 128 sequences starting at u = 1: under per-sequence advance every
    u is 1 and every row drafts 3; the cohort control saturates (u = w) and exactly the
    saturated rows draft nothing."""
    per = decode_rows(run_b128("per-sequence"))
    assert len(per) == 128 * 200
    assert {r["u"] for _, r in per} == {1} and min(r["drafted"] for _, r in per) == 3
    coh = decode_rows(run_b128("cohort"))
    saturated = [r for _, r in coh if r["u"] == 4]
    zero = [r for _, r in coh if r["drafted"] == 0]
    assert len(saturated) > 0 and saturated == zero


@pytest.mark.rule("the_two_advance_rules_are_identical_at_batch_one")
def test_the_two_advance_rules_are_identical_at_batch_one():
    """Depth 1..8, 40 steps, batch 1: emissions, u, drafts, accepts and lengths agree."""
    for depth in range(1, 9):
        base = {
            "batch": 1,
            "prompt_len": 9,
            "max_new_tokens": 400,
            "steps": 40,
            "depth": depth,
            "seed": depth,
            "acceptance": "geometric:0.6",
        }
        coh = lengths.run(load_scenario(base))
        per = lengths.run(load_scenario({**base, **GRANTED}))
        assert [s["advance"] for s in per.steps() if s["phase"] == "decode"] == [
            "per-sequence"
        ] * 39
        strip = lambda tr: [(r["own_len"], r["u"], r["drafted"], r["accepted"], r["committed"])  # noqa: E731
                            for _, r in decode_rows(tr)]
        assert strip(coh) == strip(per) and len(strip(coh)) == 39


@pytest.mark.rule("per_sequence_advance_is_token_identical_to_the_b1_reference")
def test_per_sequence_advance_is_token_identical_to_the_b1_reference():
    """w = 4, 60 steps: each of the 128 batched streams commits, step by step, what it
    commits alone (the oracle's tokens are the true stream, so equal emissions are equal
    tokens); the cohort control differs from its solo run."""
    solo = solo_runs()
    batched = per_stream(run_b128("per-sequence"))
    assert all(batched[i][:60] == solo[i][:60] for i in range(128))
    cohort = per_stream(run_b128("cohort"))
    assert sum(cohort[i][:60] != solo[i][:60] for i in range(128)) > 64


@pytest.mark.rule("per_sequence_advance_is_token_identical_to_the_b1_reference")
def test_per_sequence_streams_are_token_identical_to_their_solo_runs_in_tensor_mode():
    """The same in tensor mode on real token lists (4 streams, 12 steps, w = 4)."""
    reqs = [{"prompt_len": 6, "max_new_tokens": 60} for _ in range(4)]
    sc = load_scenario(
        {"requests": reqs, "steps": 14, **GRANTED, "acceptance": "profile:0.8,0.6,0.4", "seed": 2}
    )
    eng = simulator.TensorEngine(sc)
    tr = eng.run()
    assert any(s["padding_fraction"] > 0 for s in tr.steps())  # the batch really was ragged
    for i, r in enumerate(reqs):
        solo_reqs = [{"prompt_len": 1, "max_new_tokens": 1, "arrival": 10**9}] * i + [r]
        solo = simulator.TensorEngine(load_scenario({**sc.to_dict(), "requests": solo_reqs}))
        solo.run()
        n = min(len(solo.toks[i]), len(eng.toks[i]))
        assert n > r["prompt_len"] + 12 and eng.toks[i][:n] == solo.toks[i][:n]


@pytest.mark.rule("cohort keep == min per-sequence committed")
def test_cohort_keep_is_the_min_of_the_per_sequence_commits():
    """On every steady cohort step the batched cache advances by keep = min_i(u_i + a_i),
    which equals min_i(committed_i = min(u_i + a_i, w)) of the per-sequence rule."""
    tr = run_b128("cohort")
    st_ = [s for s in tr.steps() if s["phase"] == "decode"]
    checked = 0
    for s, nxt in zip(st_, st_[1:], strict=False):
        if nxt["cache_instruction"] != "Nothing":
            continue
        u = np.array([r["u"] for r in s["rows"]])
        a = np.array([r["accepted"] for r in s["rows"]])
        assert nxt["width"] - s["width"] == int(np.minimum(u + a, 4).min())
        checked += 1
    assert checked > 150


@pytest.mark.rule("tok_per_step at B = 128: bounded by the cohort rule, freed by per-sequence")
def test_tok_per_step_at_b128_is_bounded_by_the_cohort_rule_and_freed_by_the_per_sequence_rule():
    """w = 4, 200 steps, B = 128, tok/step = emitted / (steps * n): per-sequence > 1.10 x
    cohort; per-sequence equals the mean of the solo runs (|diff| < 1e-9); cohort < solo."""
    def tok_per_step(trace):
        rows = decode_rows(trace)
        return sum(r["committed"] for _, r in rows) / len(rows)
    per, coh = tok_per_step(run_b128("per-sequence")), tok_per_step(run_b128("cohort"))
    solo = solo_runs()
    solo_mean = float(np.mean([sum(x[3] for x in solo[i]) / len(solo[i]) for i in range(128)]))
    assert per > 1.10 * coh
    assert abs(per - solo_mean) < 1e-9
    assert coh < solo_mean


@pytest.mark.rule("MTP[agg] and SCHED[agg] markers")
def test_the_marker_tok_per_step_is_the_accounting_ratio():
    """The trace's tok_per_step is the MTP[agg] ratio committed/steps (with the §15 skew:
    1 + a per row-step) and the markers agree with the summary."""
    tr = run_b128("per-sequence")
    rows = decode_rows(tr)
    want = sum(1 + r["accepted"] for _, r in rows) / len(rows)
    assert tr.summary["tok_per_step"] == want
    assert f"tok_per_step={want:.4f}" in tr.markers()[0]
    assert f"steps={len(rows)} " in tr.markers()[0] and "batch_steps=200 " in tr.markers()[0]


@pytest.mark.rule("tok_per_step at B = 128: bounded by the cohort rule, freed by per-sequence")
def test_spread_grows_under_per_sequence_advance_and_stays_zero_under_cohort():
    assert run_b128("cohort").summary["max_spread"] == 0
    assert run_b128("per-sequence").summary["max_spread"] > 20
    assert run_b128("per-sequence").summary["mean_padding_fraction"] > 0


@pytest.mark.rule(
    "window check, the two guards and the deferral",
    "strip policy eager / lazy / none",
)
def test_without_the_strip_the_recorded_lengths_trip_the_left_aligned_guard():
    """strip = "none" records the padded width as the row's own length (§9.8 / masks §14,
    the compounding trap): the next ragged step's per-row lengths overrun the tokens and the
    left-aligned guard refuses it (§16 step 4) instead of decoding a wrong answer."""
    tr = lengths.run(
        load_scenario(
            {
                "batch": 6,
                "prompt_len": 16,
                "max_new_tokens": 60,
                "steps": 8,
                **GRANTED,
                "strip": "none",
            }
        )
    )
    assert "left-aligned guard" in [s["error"] for s in tr.steps()]
    ok = lengths.run(
        load_scenario({"batch": 6, "prompt_len": 16, "max_new_tokens": 60, "steps": 8, **GRANTED})
    )
    assert all(s["error"] is None for s in ok.steps())


@pytest.mark.rule("strip policy eager / lazy / none")
def test_the_lazy_and_eager_strips_take_the_same_decisions():
    """§5.5 / masks §23: eager vs lazy strip is a cost difference only."""
    base = {
        "batch": 6,
        "prompt_len": [8, 14],
        "max_new_tokens": 40,
        "steps": 30,
        **GRANTED,
        "seed": 9,
    }
    eager = lengths.run(load_scenario({**base, "strip": "eager"}))
    lazy = lengths.run(load_scenario({**base, "strip": "lazy"}))
    key = lambda tr: [(r["seq"], r["own_len"], r["u"], r["accepted"], r["committed"])  # noqa: E731
                      for _, r in decode_rows(tr)]
    assert key(eager) == key(lazy) and len(key(eager)) > 60


@pytest.mark.rule("draft-KV map LRU")
def test_the_draft_kv_lru_cap_starves_rows_beyond_64():
    """arc's MAX_DRAFT_KV_SEQS = 64 (§7.1): at B = 128 the LRU map evicts half the rows
    every step; an evicted row's fresh state fails the contiguity check and is poisoned, so
    it never drafts again. Unbounded, every row drafts."""
    capped = lengths.run(b128("per-sequence", steps=20, max_draft_kv_seqs=64))
    last = [s for s in capped.steps() if s["phase"] == "decode"][-1]
    drafting = sum(r["drafted"] > 0 for r in last["rows"])
    assert 0 < drafting <= 64
    assert all(r["drafted"] == 3 for r in [s for s in run_b128("per-sequence").steps()][-1]["rows"])
