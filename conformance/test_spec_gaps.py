"""Rules that had no function or test of their own: the verify-logits argmax,
the MTP wrapping decision, per-row prompt offsets, the synthetic-acceptance harness, the
propose/verify loop, the §22 smoke checks, and malformed-input checks of the dispatch and
mask rules (cache-and-draft.md §17.2, §19.1; masks-and-scheduling.md §1, §3, §22).

Expected values come from the spec's numbers or from brute-force oracles written here.
Tolerance for batch-vs-solo model runs: `1e-12 * max(1, max|x|)` (float64; only the
summation order differs); a batch-mate swap must be bit-identical (exactly 0.0).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.reference.accounting import MtpAcceptance, from_verify
from raggedspec.reference.align import clone_in_cache, clone_out_cache
from raggedspec.reference.dispatch import (
    CaptureOffsets,
    chain_start_of,
    draft_group_key,
    draft_groups,
    resolve_capture_offsets,
    resolve_draft_leads,
    resolve_ragged_rows,
    resolve_row_offsets,
    uniform_seqlen_offset,
)
from raggedspec.reference.draft import propose_chain
from raggedspec.reference.masks import raw_keep_span
from raggedspec.reference.model import ModelConfig, TinyModel
from raggedspec.reference.pipeline import (
    MtpSpeculativePipeline,
    SyntheticAcceptance,
    TargetPipeline,
    argmax_logits_per_row,
    try_wrap_pipeline_with_mtp,
    verify_proposed_simulated,
)
from raggedspec.reference.step import verify_proposed


def close(a, b, rel: float = 1e-12) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return bool(np.all(np.abs(a - b) <= rel * max(1.0, float(np.max(np.abs(b))))))


# --- §17.2 argmax_logits_per_row -------------------------------------------------------------


@pytest.mark.rule("argmax_logits_per_row")
def test_argmax_logits_per_row_extracts_tail_rows():
    # (5, 3): row r has its max at column r mod 3, so the last 3 rows decode as [2, 0, 1]
    logits = np.array([[1.0 if c == r % 3 else 0.0 for c in range(3)] for r in range(5)])
    assert argmax_logits_per_row(logits, 3) == [2, 0, 1]
    # negative control: the head of the block would read [0, 1, 2]
    assert [int(np.argmax(logits[r])) for r in range(3)] == [0, 1, 2]


@pytest.mark.rule("argmax_logits_per_row")
def test_argmax_logits_per_row_handles_batch_dim():
    logits = np.array([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])  # (1, 2, 3)
    assert argmax_logits_per_row(logits, 2) == [1, 2]


@pytest.mark.rule("argmax_logits_per_row")
def test_argmax_logits_per_row_takes_what_there_is_and_refuses_other_ranks():
    logits = np.array([[0.0, 3.0], [5.0, 1.0]])
    assert argmax_logits_per_row(logits, 7) == [1, 0]  # take = min(expected, rows)
    assert argmax_logits_per_row(logits, 0) == []
    for bad in (np.zeros(3), np.zeros((1, 1, 2, 3))):
        with pytest.raises(ValueError, match=f"unexpected rank {bad.ndim}"):
            argmax_logits_per_row(bad, 1)
    with pytest.raises(ValueError, match=re.escape("(2, 2, 3)")):
        argmax_logits_per_row(np.zeros((2, 2, 3)), 1)
    with pytest.raises(ValueError, match="expected_rows -1"):
        argmax_logits_per_row(logits, -1)


@pytest.mark.rule("argmax_logits_per_row")
def test_argmax_logits_per_row_refuses_a_block_with_no_vocab_column_by_shape():
    with pytest.raises(ValueError, match="^" + re.escape("verify logits (2, 0) have no vocab "
                                                         "column") + "$"):
        argmax_logits_per_row(np.zeros((2, 0)), 1)


@pytest.mark.rule("argmax_logits_per_row")
def test_argmax_logits_per_row_compares_the_logits_as_numbers():
    # logits handed over as numeric text (e.g. read back from a dump) are compared as numbers:
    # 10 > 9, though the string "9" sorts after "10"
    assert argmax_logits_per_row([["10", "9"], ["-1", "-2"]], 2) == [0, 0]


@pytest.mark.rule("argmax_logits_per_row")
@given(rows=st.integers(0, 9), vocab=st.integers(1, 6), expected=st.integers(0, 12),
       batch_dim=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_argmax_logits_per_row_matches_a_loop_oracle(rows, vocab, expected, batch_dim, seed):
    block = np.random.default_rng(seed).integers(-3, 4, (rows, vocab)).astype(float)  # ties happen
    want = []
    for r in range(max(rows - expected, 0), rows):
        best = 0
        for c in range(vocab):
            if block[r, c] > block[r, best]:
                best = c
        want.append(best)
    assert argmax_logits_per_row(block[None] if batch_dim else block, expected) == want


# --- §17.2 try_wrap_pipeline_with_mtp
# --------------------------------------------------------------


@pytest.mark.rule("try_wrap_pipeline_with_mtp")
def test_try_wrap_pipeline_with_mtp_depth_zero_is_noop():
    target = TargetPipeline("stub")
    assert try_wrap_pipeline_with_mtp(target, 0) is target
    kitted = TargetPipeline("stub", kit=TinyModel(ModelConfig(hidden=8, vocab=16)))
    assert try_wrap_pipeline_with_mtp(kitted, 0) is kitted  # depth 0 never wraps, kit or not


@pytest.mark.rule("try_wrap_pipeline_with_mtp")
def test_try_wrap_pipeline_with_mtp_no_kit_falls_back():
    target = TargetPipeline("stub")
    warnings: list[str] = []
    assert try_wrap_pipeline_with_mtp(target, 4, warnings) is target
    assert len(warnings) == 1 and "depth=4" in warnings[0] and "no MTP head" in warnings[0]


@pytest.mark.rule("try_wrap_pipeline_with_mtp")
def test_try_wrap_pipeline_with_mtp_engages_wrapper():
    target = TargetPipeline("stub", kit=TinyModel(ModelConfig(hidden=8, vocab=16)))
    warnings: list[str] = []
    wrapped = try_wrap_pipeline_with_mtp(target, 4, warnings)
    assert wrapped is not target and isinstance(wrapped, MtpSpeculativePipeline)
    assert wrapped.name().startswith("MTP-speculative(depth=4")
    assert wrapped.name() == "MTP-speculative(depth=4, target=stub)"
    assert wrapped.target is target and wrapped.kit is target.kit and warnings == []
    tier_a = TargetPipeline(
        "a", kit=TinyModel(ModelConfig(mtp="heads"))
    )  # heads only is still a kit
    assert try_wrap_pipeline_with_mtp(tier_a, 1).name().startswith("MTP-speculative(depth=1")


@pytest.mark.rule("try_wrap_pipeline_with_mtp")
def test_try_wrap_pipeline_with_mtp_refuses_a_depth_outside_the_flag_range():
    with pytest.raises(ValueError, match="--mtp-depth 9"):
        try_wrap_pipeline_with_mtp(TargetPipeline("stub"), 9)
    with pytest.raises(ValueError, match="--mtp-depth -1"):
        try_wrap_pipeline_with_mtp(TargetPipeline("stub"), -1)


# --- masks §1 / §22: resolve_row_offsets
# ------------------------------------------------------------


@pytest.mark.rule("resolve_row_offsets")
def test_a_batch_with_no_per_row_offset_takes_the_shared_path():
    assert resolve_row_offsets([None, None, None], 17) is None
    assert resolve_row_offsets([], 17) is None


@pytest.mark.rule("resolve_row_offsets")
def test_a_row_with_its_own_offset_makes_the_whole_batch_per_row():
    assert resolve_row_offsets([40, 33, 37], 17) == [40, 33, 37]
    assert resolve_row_offsets([40, None], 17) == [40, 17]  # the batch's offset, not 0
    # cache-and-draft §16 PerSequence example: set_prefill_toks_at(window, cache_lens[i]),
    # shared offset 0 -> every row's own position, which is also its row_q0
    assert resolve_row_offsets([12, 10], 0) == [12, 10]


@pytest.mark.rule("resolve_row_offsets")
def test_equal_overrides_are_not_collapsed_into_the_shared_offset():
    """The scalar path reads `shared`, not the common value: collapsing `[40, 40]` with
    shared 0 would put both rows at position 0. The RoPE dispatch collapses it downstream."""
    got = resolve_row_offsets([40, 40], 0)
    assert got == [40, 40]
    assert uniform_seqlen_offset(got) == 40


@pytest.mark.rule("resolve_row_offsets", "§22 dispatch tests: each predicate tested directly")
@given(b=st.integers(0, 12), shared=st.integers(0, 5000), data=st.data())
def test_resolve_row_offsets_dispatch_property(b, shared, data):
    # uniform (no row carries its own offset) -> the scalar form, at every width
    assert resolve_row_offsets([None] * b, shared) is None
    per_seq = data.draw(
        st.lists(st.one_of(st.none(), st.integers(0, 5000)), min_size=b, max_size=b)
    )
    got = resolve_row_offsets(per_seq, shared)
    if all(o is None for o in per_seq):
        assert got is None
    else:
        assert len(got) == b
        for i in range(b):
            assert got[i] == (shared if per_seq[i] is None else per_seq[i])


@pytest.mark.rule("resolve_row_offsets")
def test_resolve_row_offsets_refuses_negative_offsets_naming_them():
    with pytest.raises(ValueError, match="shared offset -1"):
        resolve_row_offsets([3], -1)
    with pytest.raises(ValueError, match=re.escape("[4, None, -2]")):
        resolve_row_offsets([4, None, -2], 0)


# --- §19.1 verify_proposed_simulated / SyntheticAcceptance
# ------------------------------------------


def simulated_commit_lens(acc_len: float, depth: int, steps: int) -> list[int]:
    """Every proposal mismatches the target: the real verifier commits 1 each step, so any
    longer commit can only come from the harness."""
    sim = SyntheticAcceptance(acc_len)
    proposed = [1000 + i for i in range(depth)]
    target = [2000 + i for i in range(depth)]
    return [verify_proposed_simulated(proposed, target, sim).commit_len for _ in range(steps)]


def running_mean_within_one_over_n(acc_len: float, lens: list[int]) -> bool:
    """Exact check: after every prefix of N steps, 0 <= acc_len - mean < 1/N and every value
    is one of the two integers around acc_len."""
    target = Fraction(acc_len)
    lo, hi = math.floor(acc_len), math.ceil(acc_len)
    total = 0
    for n, x in enumerate(lens, start=1):
        total += x
        gap = target - Fraction(total, n)
        if not (x in (lo, hi) and 0 <= gap < Fraction(1, n)):
            return False
    return True


@pytest.mark.rule("verify_proposed_simulated and SyntheticAcceptance")
def test_a_fractional_accept_length_is_hit_exactly_in_the_mean():
    for acc_len in (1.0, 1.5, 1.8387, 2.85, 3.0):
        lens = simulated_commit_lens(acc_len, 4, 1000)
        assert abs(sum(lens) / 1000 - acc_len) < 0.01
        assert running_mean_within_one_over_n(acc_len, lens), acc_len
    assert simulated_commit_lens(2.85, 4, 40) == simulated_commit_lens(2.85, 4, 40)  # deterministic
    lens = simulated_commit_lens(2.85, 4, 40)
    assert set(lens) == {2, 3}  # dithered between the neighbouring integers, not rounded


@pytest.mark.rule("verify_proposed_simulated and SyntheticAcceptance")
def test_a_rounding_schedule_fails_the_dithering_check():
    """Negative control for the check above: rounding 2.85 to 3 every step is not dithering."""

    class Rounding(SyntheticAcceptance):
        def next_accept_len(self) -> int:
            return round(self.acc_len - 1)

    sim = Rounding(2.85)
    lens = [
        verify_proposed_simulated([1, 2, 3, 4], [5, 6, 7, 8], sim).commit_len for _ in range(40)
    ]
    assert set(lens) == {3}
    assert not running_mean_within_one_over_n(2.85, lens)


@pytest.mark.rule("verify_proposed_simulated and SyntheticAcceptance")
@given(
    acc_len=st.floats(1.0, 9.0, allow_nan=False), steps=st.integers(1, 300), extra=st.integers(0, 3)
)
def test_the_running_mean_converges_to_acc_len_within_one_over_steps(acc_len, steps, extra):
    depth = math.ceil(acc_len - 1) + 1 + extra  # never clamped: every step has a rejection
    lens = simulated_commit_lens(acc_len, depth, steps)
    assert running_mean_within_one_over_n(acc_len, lens)
    assert abs(Fraction(sum(lens), steps) - Fraction(acc_len)) < Fraction(1, steps)


@pytest.mark.rule("verify_proposed_simulated and SyntheticAcceptance")
def test_the_harness_accepts_tokens_the_real_verifier_would_reject():
    proposed, target = [10, 20, 30], [91, 92, 93]
    real = verify_proposed(proposed, target)
    assert real.accepted == [] and real.rejection == (0, 91) and real.commit_len == 1
    forced = verify_proposed_simulated(proposed, target, SyntheticAcceptance(3.0))
    assert forced.accepted == [10, 20]  # the DRAFT's tokens
    assert forced.rejection == (2, 93)  # the TARGET's real token at the rejected slot
    assert forced.commit_len == 3


@pytest.mark.rule("verify_proposed_simulated and SyntheticAcceptance")
def test_the_schedule_is_clamped_by_the_chain_and_not_compensated():
    assert simulated_commit_lens(5.0, 2, 20) == [2] * 20  # wants 4 drafts, the chain has 2
    # n = min(len(proposed), len(target)): a longer proposal is clamped to the target's rows
    longer = verify_proposed_simulated([1, 2, 3, 4], [9, 9], SyntheticAcceptance(5.0))
    assert longer.accepted == [1, 2] and longer.rejection is None and longer.commit_len == 2
    empty = verify_proposed_simulated([], [], SyntheticAcceptance(4.0))
    assert empty.accepted == [] and empty.rejection is None and empty.commit_len == 0


@pytest.mark.rule("verify_proposed_simulated and SyntheticAcceptance")
def test_the_flag_refuses_an_impossible_accept_length():
    for bad in (0.9, 0.0, -2.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=re.escape(f"acc_len {bad!r}")):
            SyntheticAcceptance(bad)
    assert SyntheticAcceptance(1.0).acc_len == 1.0
    for value in (None, "", "  ", "yes", "0.5", "nan", "inf", "1_0"):
        assert SyntheticAcceptance.from_env_value(value) is None, value
    parsed = SyntheticAcceptance.from_env_value(" 2.85 ")
    assert parsed is not None and parsed.acc_len == 2.85
    for value, acc in (("1.0", 1.0), ("1", 1.0), ("1.5", 1.5)):  # 1.0 is the lowest accepted
        parsed = SyntheticAcceptance.from_env_value(value)
        assert parsed is not None and parsed.acc_len == acc, value


# --- §17.2 speculative_mtp_v4_propose_verify_loop_is_consistent
# --------------------------------------


@pytest.mark.rule("speculative_mtp_v4_propose_verify_loop_is_consistent")
def test_speculative_mtp_v4_propose_verify_loop_is_consistent():
    """depth 4, 8 cycles, a mock verifier agreeing on even positions only: every chain has
    `depth` tokens, nothing accepted is dropped, and the counted rate is in [0.25, 1]."""
    vocab, depth = 16, 4
    model = TinyModel(ModelConfig(hidden=4, vocab=vocab, mtp="heads"))
    prev_hidden, prev_tok = np.zeros(4), 1
    total = MtpAcceptance()
    for _cycle in range(8):
        proposed = propose_chain(model, prev_hidden, prev_tok, depth, depth, 0, None)
        assert len(proposed) == depth and all(0 <= t < vocab for t in proposed)
        target = [t if i % 2 == 0 else (t + 7) % vocab for i, t in enumerate(proposed)]
        res = verify_proposed(proposed, target)
        assert res.accepted == proposed[:len(res.accepted)]
        assert res.commit_len == len(res.accepted) + (res.rejection is not None)
        total.add(from_verify(depth, res))
        prev_tok = res.accepted[-1] if res.accepted else res.rejection[1]
        prev_hidden = model.embed[prev_tok]
    assert total.proposed == 32 and total.steps == 8
    assert 0.25 <= total.rate() <= 1.0
    assert total.accepted == 8  # the first odd slot always disagrees: one accept per cycle


# --- masks §22 smoke checks (synthetic_load_smoke.rs fixture: ratios [0,4,128], window 128)
# ----------


SMOKE = TinyModel(ModelConfig(compress_ratios=(0, 4, 128), sliding_window=128, seed=3))
PREFILL_T, DECODE_STEPS = 130, 6


def prefill(tokens: np.ndarray):
    cache = SMOKE.new_cache()
    fw = SMOKE.forward(tokens, cache, [0])
    return cache, fw


def decode(cache, first: np.ndarray, offsets: list[int], row_q0=None, lead_pad=None):
    """DECODE_STEPS greedy steps from `first [B]`; returns the per-step logits `[steps, B, V]`."""
    toks, out, offsets = first.reshape(-1, 1), [], list(offsets)
    for _ in range(DECODE_STEPS):
        fw = SMOKE.forward(toks, cache, offsets, row_q0, lead_pad)
        out.append(fw.logits[:, -1])
        toks = fw.logits[:, -1].argmax(axis=-1).reshape(-1, 1)
        offsets = [o + 1 for o in offsets]
        row_q0 = None if row_q0 is None else list(offsets)
    return np.stack(out)


@pytest.mark.rule("synthetic_load_smoke.rs: batch-mate swap and 2-chain runs equal solo runs")
def test_a_batch_mate_swap_is_bit_identical():
    rng = np.random.default_rng(5)
    a, b, c = (rng.integers(0, SMOKE.cfg.vocab, PREFILL_T) for _ in range(3))
    runs = []
    for mate in (b, c):
        cache, fw = prefill(np.stack([a, mate]))
        runs.append(decode(cache, fw.logits[:, -1].argmax(axis=-1), [PREFILL_T]))
    assert np.max(np.abs(runs[0][:, 0] - runs[1][:, 0])) == 0.0  # row A: exactly 0.0
    assert np.max(np.abs(runs[0][:, 1] - runs[1][:, 1])) > 20 * 1e-12  # teeth: the mates differ


@pytest.mark.rule("synthetic_load_smoke.rs: batch-mate swap and 2-chain runs equal solo runs")
def test_a_two_chain_batch_lockstep_and_shrink_equals_solo_runs():
    rng = np.random.default_rng(6)
    rows = rng.integers(0, SMOKE.cfg.vocab, (2, PREFILL_T))
    solo = []
    for i in range(2):
        cache, fw = prefill(rows[i:i + 1])
        solo.append(decode(cache, fw.logits[:, -1].argmax(axis=-1), [PREFILL_T])[:, 0])
    cache, fw = prefill(rows)
    lock = decode(cache, fw.logits[:, -1].argmax(axis=-1), [PREFILL_T])
    for i in range(2):
        assert close(lock[:, i], solo[i])
    # shrink: the batch splits and row 0 continues alone from its own cache
    alone = clone_out_cache(cache, 2)[0]
    nxt = int(lock[-1, 0].argmax())
    cont = decode(alone, np.array([nxt]), [PREFILL_T + DECODE_STEPS])[:, 0]
    ref_cache, fw = prefill(rows[0:1])
    full = decode(ref_cache, fw.logits[:, -1].argmax(axis=-1), [PREFILL_T])
    more = decode(ref_cache, np.array([int(full[-1, 0].argmax())]), [PREFILL_T + DECODE_STEPS])[
        :, 0
    ]
    assert close(cont, more)


@pytest.mark.rule("synthetic_load_smoke.rs: batch-mate swap and 2-chain runs equal solo runs")
def test_a_merged_ragged_batch_130_97_61_equals_solo_runs():
    """Rows prefilled alone at lens [130, 97, 61], merged by clone_in_cache (front-aligned),
    decoded together with row_q0 = their own positions: each row equals its solo run; with
    row_q0 None the rows whose dead prefix the window reaches differ (teeth > 20 x tol)."""
    lens = [130, 97, 61]
    rng = np.random.default_rng(7)
    ctx = [rng.integers(0, SMOKE.cfg.vocab, n) for n in lens]
    own, firsts = [], []
    for row in ctx:
        cache, fw = prefill(row[None])
        own.append(cache)
        firsts.append(int(fw.logits[0, -1].argmax()))
    solo = [decode(own[i].clone(), np.array([firsts[i]]), [lens[i]])[:, 0] for i in range(3)]
    controls = [c.clone() for c in own]
    merged = clone_in_cache(own, [], False)
    assert merged.lead_pad == [0, 33, 69]
    got = decode(merged.batched, np.array(firsts), lens, list(lens), merged.lead_pad)
    for i in range(3):
        assert close(got[:, i], solo[i]), f"row {i}"
    unmasked = clone_in_cache(controls, [], False)
    bad = decode(unmasked.batched, np.array(firsts), lens, None, unmasked.lead_pad)
    for i in (1, 2):
        assert np.max(np.abs(bad[0, i] - solo[i][0])) > 20 * 1e-12 * max(
            1.0, float(np.max(np.abs(solo[i][0])))
        )


# --- malformed input raises ValueError naming the value -------------------------------------


@pytest.mark.rule("resolve_draft_leads")
def test_resolve_draft_leads_refuses_a_negative_chain_start_whatever_the_flag():
    for enabled in (True, False):
        with pytest.raises(ValueError, match=re.escape("chain starts [-3, 2] must be >= 0")):
            resolve_draft_leads(enabled, [-3, 2])
    assert resolve_draft_leads(True, [0, 2]) == [2, 0]  # 0 is a position


@pytest.mark.rule("resolve_ragged_rows")
def test_resolve_ragged_rows_refuses_a_negative_row_position():
    with pytest.raises(ValueError, match=re.escape("row positions [-1, 5] must be >= 0")):
        resolve_ragged_rows([-1, 5], 5, 2)
    assert resolve_ragged_rows([0, 5], 5, 2) == [0, 5]
    assert resolve_ragged_rows(None, 5, 2) is None


@pytest.mark.rule("raw_keep_span")
def test_raw_keep_span_refuses_a_forward_with_no_query_row():
    with pytest.raises(ValueError, match="t_q 0 must be >= 1"):
        raw_keep_span(0, 4, 7)
    assert raw_keep_span(1, 4, 7) == (3, 4)  # the smallest well-formed forward: keep = window


@pytest.mark.rule("CaptureOffsets::row")
def test_capture_offsets_refuse_an_empty_vector_that_nothing_builds():
    with pytest.raises(
        ValueError, match=re.escape("capture offsets [] must hold at least one offset")
    ):
        CaptureOffsets([])
    assert resolve_capture_offsets([]).values == (0,)  # the legitimate "no offsets" path


@pytest.mark.rule("draft_group_key")
def test_draft_group_key_keeps_u_zero_well_formed():
    """Decision (see draft_group_key): u = 0 is not refused by the key. plan_step_window
    already makes such a row not-ok before any group forms; callers (draft_groups, the port
    conformance) pass u = 0 and get the spec's expression."""
    assert draft_group_key(0, 5, False) == (0, 3) == (0, chain_start_of(5, 0))
    assert draft_group_key(0, 5, True) == (0, 0)
    assert draft_groups([0, 1], [5, 5], [True, True], 3, False) == {(0, 3): [0], (1, 4): [1]}
    with pytest.raises(ValueError, match="cache_len 1 \\+ u 0 < 2"):
        draft_group_key(0, 1, False)
    with pytest.raises(ValueError, match="u -1 must be >= 0"):
        draft_group_key(-1, 5, True)
