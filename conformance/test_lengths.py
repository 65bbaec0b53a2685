"""The lengths-only simulator (reference/lengths.py): equal, integer for integer, to the
tensor mode on generated scenarios; and the spec's simulator test catalogue
(cache-and-draft.md §17.2) at B = 128, where only the lengths mode is fast enough."""

import functools
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.reference import lengths, lengths_scheduler, simulator
from raggedspec.reference.acceptance import OracleError, Profile
from raggedspec.reference.scenario import load_scenario

GRANTED = {"advance": "per-sequence", "xs_per_seq": True, "admission": "grant", "world": "WB"}


def normalized_lines(trace):
    out = list(trace.lines())
    head = json.loads(out[0])
    head["mode"] = "-"
    return [json.dumps(head)] + out[1:]


def decode_rows(trace):
    return [(s, r) for s in trace.steps() if s["phase"] == "decode" for r in s["rows"]]


# ----------------------------------------------------------------------------- lengths == tensor


scenarios = st.fixed_dictionaries(
    {
        "batch": st.integers(1, 6),
        "prompt_len": st.tuples(st.integers(1, 10), st.integers(0, 6)).map(
            lambda t: [t[0], t[0] + t[1]]
        ),
        "max_new_tokens": st.tuples(st.integers(1, 20), st.integers(0, 15)).map(
            lambda t: [t[0], t[0] + t[1]]
        ),
        "steps": st.integers(3, 16),
        "depth": st.integers(0, 4),
        "advance": st.sampled_from(["cohort", "per-sequence"]),
        "world": st.sampled_from(["W0", "WA", "WB"]),
        "strip": st.sampled_from(["eager", "lazy", "none"]),
        "admission": st.sampled_from(["grant", "grant", "refuse"]),
        "xs_per_seq": st.sampled_from([True, True, False]),
        "arrival": st.sampled_from(["all-at-once", "staggered"]),
        "max_draft_kv_seqs": st.sampled_from([None, 2, 64]),
        "acceptance": st.sampled_from(
            [
                "geometric:0.7",
                "profile:0.9,0.5,0.3",
                "all-accept",
                "all-reject",
                "heterogeneous:0.1,0.95",
            ]
        ),
        "max_seq_len": st.sampled_from([4096, 40]),
        "max_seqs": st.sampled_from([None, None, 2, 3]),
        "prefill_max_seqs": st.sampled_from([None, None, 1, 2]),
        "seed": st.integers(0, 50),
    }
)


@pytest.mark.rule(
    "scheduler worlds, bucket selection, engine cache instruction",
    "lengths-only mode == tensor mode",
)
@given(data=scenarios)
def test_lengths_mode_gives_the_tensor_modes_integer_trace(data):
    """The issue's property: the same decisions with no tensors give the identical trace
    (every integer, every float, the markers), across advance rules, worlds, strip
    policies, arrivals, LRU sizes, acceptance models and capacity refusals."""
    sc = load_scenario(data)
    assert normalized_lines(lengths.run(sc)) == normalized_lines(simulator.run(sc))


@pytest.mark.rule(
    "window check, the two guards and the deferral",
    "lengths-only mode == tensor mode",
)
def test_the_equality_covers_the_interesting_paths():
    """Non-degeneracy of the property above: across a fixed set of scenarios drawn from
    the same space, both modes agree and the runs include ragged per-sequence steps,
    deferrals, mixed prompt/decode steps, LRU eviction and refused steps."""
    seen = set()
    cases = [
        dict(batch=5, prompt_len=[3, 9], max_new_tokens=25, steps=16, **GRANTED, strip="lazy"),
        dict(batch=4, prompt_len=[3, 9], max_new_tokens=25, steps=16, world="WA", xs_per_seq=True),
        dict(
            batch=4,
            prompt_len=[5, 9],
            max_new_tokens=25,
            steps=12,
            max_draft_kv_seqs=2,
            arrival="staggered",
        ),
        dict(batch=3, prompt_len=[5, 9], max_new_tokens=25, steps=12, **GRANTED, strip="none"),
        dict(
            batch=3,
            prompt_len=6,
            max_new_tokens=25,
            steps=6,
            max_seq_len=40,
            acceptance="all-accept",
        ),
        dict(batch=3, prompt_len=6, max_new_tokens=25, steps=6, model={"mtp": "heads"}),
    ]
    for data in cases:
        sc = load_scenario(data)
        tr = lengths.run(sc)
        assert normalized_lines(tr) == normalized_lines(simulator.run(sc))
        for s in tr.steps():
            seen.add(s["phase"])
            if s["padding_fraction"] > 0 and s["advance"] == "per-sequence":
                seen.add("ragged")
            if s["prefill"] and s["phase"] != "prompt":
                seen.add("mixed")
            if s["error"]:
                seen.add("error:" + s["error"])
            if (
                any(r["drafted"] == 0 and r["u"] < sc.w for r in s["rows"])
                and s["phase"] == "decode"
            ):
                seen.add("not drafting")
    assert {"prompt", "decode", "defer", "ragged", "mixed", "not drafting"} <= seen, seen
    assert any(x.startswith("error:") for x in seen), seen


@pytest.mark.rule("Tier A never drafts in the fused path")
def test_tier_a_never_drafts_in_the_fused_path():
    """§19.6 / §7.2 step 3: without an MTP block no seed is stashed, so no row drafts."""
    sc = load_scenario(
        {"batch": 3, "prompt_len": 6, "max_new_tokens": 25, "steps": 8, "model": {"mtp": "heads"}}
    )
    tr = lengths.run(sc)
    assert all(r["drafted"] == 0 for s in tr.steps() for r in s["rows"])
    assert normalized_lines(tr) == normalized_lines(simulator.run(sc))


# ----------------------------------------------------------------------------- §17.2 catalogue


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


def per_stream(trace):
    out = {}
    for _, r in decode_rows(trace):
        out.setdefault(r["seq"], []).append((r["u"], r["drafted"], r["accepted"], r["committed"]))
    return out


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


@pytest.mark.rule("pluggable token oracle")
def test_a_custom_token_oracle_drives_both_modes_alike():
    """A user's TokenOracle (raggedspec.conformance.test_scenario._ConstantOracle: of n drafts the
    first n - 1 agree) decides accepts through verify_proposed in both modes."""
    for extra in ({}, GRANTED):
        sc = load_scenario(
            {
                "batch": 3,
                "prompt_len": [4, 7],
                "max_new_tokens": 30,
                "steps": 12,
                "acceptance": "oracle:raggedspec.conformance.test_scenario:make_oracle",
                **extra,
            }
        )
        tr = lengths.run(sc)
        assert normalized_lines(tr) == normalized_lines(simulator.run(sc))
        assert all(r["accepted"] == r["drafted"] - 1 for _, r in decode_rows(tr) if r["drafted"])
        assert any(r["drafted"] for _, r in decode_rows(tr))


# ----------------------------------------------------------------------------- review fixes


@pytest.mark.rule(
    "window check, the two guards and the deferral",
    "MTP[agg] and SCHED[agg] markers",
)
def test_deferred_steps_count_in_the_summarys_spread_and_padding():
    """A `defer` step runs the plain decode on the batched cache, leads included, so the
    summary's max_spread and mean_padding_fraction count it (brute force over the trace's
    decode and defer steps). Non-degenerate: in this WA cohort run every decode step has
    spread 0 and only the deferred steps carry the leads."""
    sc = load_scenario(
        dict(batch=4, prompt_len=[3, 9], max_new_tokens=25, steps=16, world="WA", xs_per_seq=True)
    )
    for tr in (lengths.run(sc), simulator.run(sc)):
        steps = list(tr.steps())
        measured = [s for s in steps if s["phase"] in ("decode", "defer")]

        def spread(s):
            return max(r["own_len"] for r in s["rows"]) - min(r["own_len"] for r in s["rows"])

        assert any(s["phase"] == "defer" and s["padding_fraction"] > 0 for s in measured)
        assert max(spread(s) for s in steps if s["phase"] == "decode") == 0
        assert tr.summary["max_spread"] == max(spread(s) for s in measured) > 0
        assert tr.summary["mean_padding_fraction"] == pytest.approx(
            sum(s["padding_fraction"] for s in measured) / len(measured), abs=1e-15)
        assert tr.summary["shattered_steps"] == sum(s["buckets"] > 1 for s in measured)


def sequential_admission(new, room, cap):
    """The loop `scheduler.schedule` runs over the sorted waiting queue (the oracle)."""
    taken, n_new, n_run = [], 0, 0
    for is_new in new:
        capped = is_new and cap is not None and n_new >= cap
        if n_run + 1 <= room and not capped:
            taken.append(True)
            n_run += 1
            n_new += is_new
        else:
            taken.append(False)
    return taken


@pytest.mark.rule("lengths mode, scheduler half")
@given(
    new=st.lists(st.booleans(), max_size=40),
    room=st.integers(-3, 45),
    cap=st.none() | st.integers(1, 10),
)
def test_the_vectorized_admission_equals_the_sequential_rule(new, room, cap):
    got = lengths_scheduler.admit_waiting(np.array(new, dtype=bool), room, cap)
    assert got.tolist() == sequential_admission(new, room, cap)


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
            "acceptance": f"oracle:raggedspec.conformance.test_scenario:{factory}",
        }
    )
    messages = []
    for mode in (lengths, simulator):
        with pytest.raises(OracleError) as err:
            mode.run(sc)
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert (
        f"raggedspec.conformance.test_scenario:{factory}" in messages[0]
        and "'acceptance.factory'" in messages[0]
    )
    for w in words:
        assert w in messages[0], f"{w!r} not in {messages[0]!r}"


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
