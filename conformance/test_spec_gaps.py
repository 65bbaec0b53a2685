"""Rules that had no function or test of their own: the verify-logits argmax,
the MTP wrapping decision, per-row prompt offsets, the synthetic-acceptance harness, the
propose/verify loop, the §22 smoke checks, and malformed-input checks of the dispatch and
mask rules (cache-and-draft.md §17.2, §19.1; masks-and-scheduling.md §1, §3, §22).

Expected values come from the spec's numbers or from brute-force oracles written here.
Tolerance for batch-vs-solo model runs: `1e-12 * max(1, max|x|)` (float64; only the
summation order differs); a batch-mate swap must be bit-identical (exactly 0.0).
"""

from __future__ import annotations


import numpy as np
import pytest

from raggedspec.reference.accounting import MtpAcceptance, from_verify
from raggedspec.reference.align import clone_in_cache, clone_out_cache
from raggedspec.reference.draft import propose_chain
from raggedspec.reference.masks import raw_keep_span
from raggedspec.reference.model import ModelConfig, TinyModel
from raggedspec.reference.step import verify_proposed


def close(a, b, rel: float = 1e-12) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return bool(np.all(np.abs(a - b) <= rel * max(1.0, float(np.max(np.abs(b))))))


# --- §17.2 argmax_logits_per_row -------------------------------------------------------------



# --- §17.2 try_wrap_pipeline_with_mtp
# --------------------------------------------------------------



# --- masks §1 / §22: resolve_row_offsets
# ------------------------------------------------------------



# --- §19.1 verify_proposed_simulated / SyntheticAcceptance
# ------------------------------------------



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



@pytest.mark.rule("raw_keep_span")
def test_raw_keep_span_refuses_a_forward_with_no_query_row():
    with pytest.raises(ValueError, match="t_q 0 must be >= 1"):
        raw_keep_span(0, 4, 7)
    assert raw_keep_span(1, 4, 7) == (3, 4)  # the smallest well-formed forward: keep = window



