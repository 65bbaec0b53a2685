"""Tests of other rule families, waiting to be sorted into their topic files.

They came from files that existed to close gaps (the §22 smoke checks of
`synthetic_load_smoke.rs`: masks-and-scheduling.md §22) and pin the target model's forward
(`reference.model.TinyModel.forward`) and batch assembly (`reference.align.clone_in_cache`,
`clone_out_cache`): a batched row equals its solo run. The model family's topic file is their
home.

Tolerance for batch-vs-solo model runs: `1e-12 * max(1, max|x|)` (float64; only the summation
order differs); a batch-mate swap must be bit-identical (exactly 0.0).
"""

from __future__ import annotations

import numpy as np
import pytest

from raggedspec.reference.align import clone_in_cache, clone_out_cache
from raggedspec.reference.model import ModelConfig, TinyModel


def close(a, b, rel: float = 1e-12) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return bool(np.all(np.abs(a - b) <= rel * max(1.0, float(np.max(np.abs(b))))))


# --- masks §22 smoke checks (synthetic_load_smoke.rs fixture: ratios [0,4,128], window 128) ----


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
