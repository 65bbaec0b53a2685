"""The draft KV (cache-and-draft.md §1, §7, §17.2, §18): the per-sequence `DraftKv` state and its
LRU map, what a draft-KV slot holds, `extend_draft_cache`, `extend_draft_kv_row`'s checks 1-13
in order (the worked examples of §7.3 and §16), the batch loop `extend_draft_kvs` and
prompt-time priming, on the reference. test_draft_extension.py runs the same rule on the
torch port against it.

Expected values come from the rules' statements (`p = L - 2` seeds when `L >= 2`, writes
`[max(filled, off), min(off + T, sat(L - 1)))`, one clock tick per checkin) and from an oracle
of a slot's K written here from the MTP layer's documented steps; float64 within
`1e-12 * max(1, max|x|)` (`helpers.close`).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from raggedspec.conformance.helpers import close, draft_history, rms, rope_at
from raggedspec.reference.dispatch import CaptureOffsets, MtpHiddenCapture, resolve_capture_offsets
from raggedspec.reference.draft import MAX_DRAFT_KV_SEQS, DraftKv, DraftKvMap
from raggedspec.reference.draft import extend_draft_cache, extend_draft_kv_row, extend_draft_kvs
from raggedspec.reference.draft import extension_span, group_drafting_loop, prime_draft_kv
from raggedspec.reference.errors import CacheRefusal, Refusal, StepRefusal
from raggedspec.reference.model import ModelConfig, TinyModel

MODEL = TinyModel()
TIER_A = TinyModel(ModelConfig(mtp="heads"))
H, V = MODEL.cfg.hidden, MODEL.cfg.vocab


def oracle_slot_k(h: np.ndarray, tok: int, pos: int) -> np.ndarray:
    """Draft-KV slot `pos` holding the pair (h, tok), from the MTP layer's documented steps
    (its K is token-local, no attention): `RoPE_pos(kv_norm(attn_norm(fused) @ wkv))` with
    `fused = h_proj(hnorm(h)) + e_proj(enorm(embed(tok)))`."""
    block, layer = MODEL.mtp, MODEL.mtp.layer
    fused = (rms(h, block.hnorm) @ block.heads.h_proj
             + rms(MODEL.embed[tok], block.enorm) @ block.heads.e_proj)
    kv = rms(rms(fused, layer.attn_norm) @ layer.wkv, layer.kv_norm)
    return rope_at(kv, pos, MODEL.cfg.rope_dims, MODEL.cfg.rope_theta)


def fresh(filled=4, poisoned=False):
    return DraftKv(cache=draft_history(MODEL, filled, 3), filled=filled, poisoned=poisoned)


def cap(offsets, shape):
    return (CaptureOffsets(offsets), np.zeros(shape))


# --- §7.1 the map ------------------------------------------------------------------------------


@pytest.mark.rule("DraftKv and the map: checkout, LRU checkin, drop, clear")
def test_checkout_creates_a_fresh_state_with_an_empty_draft_cache():
    m = DraftKvMap(MODEL.mtp)
    s = m.checkout_draft_kv("a")
    assert (s.filled, s.poisoned, s.seed) == (0, False, None)
    assert s.cache.current_seq_len == 0 and s.cache.k.capacity_seq_len == 16
    assert DraftKvMap(None).checkout_draft_kv("a").cache is None  # Tier A


@pytest.mark.rule("DraftKv and the map: checkout, LRU checkin, drop, clear")
def test_checkout_removes_an_existing_entry_and_checkin_reinserts_it():
    m = DraftKvMap(MODEL.mtp)
    s = m.checkout_draft_kv("a")
    s.filled = 5
    m.checkin("a", s)
    assert len(m.entries) == 1
    again = m.checkout_draft_kv("a")
    assert again is s and again.filled == 5 and len(m.entries) == 0


@pytest.mark.rule("DraftKv and the map: checkout, LRU checkin, drop, clear")
def test_checkin_evicts_the_least_recently_used_beyond_64():
    assert MAX_DRAFT_KV_SEQS == 64
    m = DraftKvMap(MODEL.mtp)
    for i in range(64):
        m.checkin(i, DraftKv(cache=None))
    m.checkin(0, m.entries[0])  # re-stamped in place: 0 is now the most recent, 1 the oldest
    m.checkin(64, DraftKv(cache=None))
    assert len(m.entries) == 64 and 1 not in m.entries and 0 in m.entries and 64 in m.entries
    stamps = [m.entries[k].last_used for k in (2, 0, 64)]
    assert stamps == sorted(stamps)


@pytest.mark.rule("DraftKv and the map: checkout, LRU checkin, drop, clear")
def test_each_checkin_ticks_the_clock_once_from_zero():
    m = DraftKvMap(MODEL.mtp)
    a, b = DraftKv(cache=None), DraftKv(cache=None)
    m.checkin("a", a)
    m.checkin("b", b)
    assert (a.last_used, b.last_used) == (1, 2)
    assert m.drop_draft_kv("absent") is None and sorted(m.entries) == ["a", "b"]


@pytest.mark.rule("DraftKv and the map: checkout, LRU checkin, drop, clear")
def test_drop_removes_and_flushes_and_clear_empties_the_whole_map():
    m = DraftKvMap(MODEL.mtp)
    for i in range(3):
        m.checkin(i, m.checkout_draft_kv(i))
    flushed = []
    assert m.drop_draft_kv(1, flush=flushed.append) is not None
    assert flushed == [1] and sorted(m.entries) == [0, 2]
    m.clear_draft_kv()
    assert m.entries == {}


# --- §1 what a slot holds, and extend_draft_cache ---------------------------------------------


@pytest.mark.rule("draft-KV slot invariant: slot k holds (h_k, tok_{k+1}) at absolute k")
def test_draft_kv_slot_k_is_the_mtp_state_of_its_pair_at_position_k():
    """Two extensions (slots 0..3, then 4..5): every slot's K and V are the oracle's of its own
    pair at its absolute position."""
    rng = np.random.default_rng(9)
    h, nxt = rng.standard_normal((6, H)), rng.integers(0, V, 6)
    cache = MODEL.mtp.new_draft_cache()
    extend_draft_cache(MODEL.mtp, cache, h[:4], nxt[:4], 0)
    extend_draft_cache(MODEL.mtp, cache, h[4:], nxt[4:], 4)
    assert cache.current_seq_len == 6
    for k in range(6):
        want = oracle_slot_k(h[k], nxt[k], k)
        assert close(cache.k.data[0, 0, k], want) and close(cache.v.data[0, 0, k], want)


@pytest.mark.rule("extend_draft_cache")
def test_extend_draft_cache_without_a_block_tokens_or_alignment():
    """No block: the cache's length (0 without a cache); no tokens: `start`, nothing run; a
    start that is not the cache's length: "desync"."""
    cache = draft_history(MODEL, 5, 0)
    assert extend_draft_cache(None, cache, np.zeros((2, H)), [1, 2], 5) == 5
    assert extend_draft_cache(None, None, np.ones((2, H)), [1, 2], 7) == 0
    assert extend_draft_cache(MODEL.mtp, cache, np.zeros((0, H)), [], 9) == 9
    assert cache.current_seq_len == 5
    with pytest.raises(Refusal, match="desync"):
        extend_draft_cache(MODEL.mtp, cache, np.zeros((1, H)), [1], 4)


@pytest.mark.rule("extend_draft_cache")
def test_extend_draft_cache_checks_the_hidden_rows():
    cache = MODEL.mtp.new_draft_cache()
    with pytest.raises(ValueError, match=rf"^hidden \(1, 1, {H}\) must be \[1, H\] for 1 next "
                                         r"tokens$"):
        extend_draft_cache(MODEL.mtp, cache, np.ones((1, 1, H)), [1], 0)
    with pytest.raises(ValueError, match=rf"^hidden \(3, {H}\) must be \[2, H\] for 2 next "
                                         r"tokens$"):
        extend_draft_cache(MODEL.mtp, cache, np.ones((3, H)), [1, 2], 0)
    assert cache.current_seq_len == 0


@pytest.mark.rule("extend_draft_cache")
def test_next_tokens_given_as_a_row_are_read_flattened():
    rng = np.random.default_rng(6)
    h, nxt = rng.standard_normal((2, H)), [3, 4]
    flat, row = MODEL.mtp.new_draft_cache(), MODEL.mtp.new_draft_cache()
    assert extend_draft_cache(MODEL.mtp, flat, h, nxt, 0) == 2
    assert extend_draft_cache(MODEL.mtp, row, h, [nxt], 0) == 2
    assert np.array_equal(row.k.current_data(), flat.k.current_data())


# --- §7.2 extend_draft_kv_row ------------------------------------------------------------------


@pytest.mark.rule("draft-KV slot invariant: slot k holds (h_k, tok_{k+1}) at absolute k",
                  "§7.3 worked example (cohort, w=4)")
def test_the_cohort_worked_example():
    """§7.3: row 1, C=10, u=2, 2 proposed, 1 accepted, L 12 -> 14; filled = 11 -> 13,
    seed (12, h[1,2]), slots 11 and 12 written from hidden rows 1..3 with toks[12..14]."""
    rng = np.random.default_rng(73)
    state = DraftKv(cache=draft_history(MODEL, 12, 5), filled=11)  # the last chain's 10 + 2
    before = state.cache.k.current_data().copy()
    toks = rng.integers(0, V, 14).tolist()
    hidden = rng.standard_normal((2, 4, H))
    assert extend_draft_kv_row(state, (resolve_capture_offsets([10, 10]), hidden), toks, 1, 2,
                               MODEL) is True
    assert state.filled == 13 and state.cache.current_seq_len == 13
    assert state.seed[0] == 12 and np.array_equal(state.seed[1], hidden[1, 2])
    k = state.cache.k.current_data()
    assert np.array_equal(k[:, :, :11], before[:, :, :11])  # committed slots untouched
    for slot, j in ((11, 1), (12, 2)):
        assert close(k[0, 0, slot], oracle_slot_k(hidden[1, j], toks[slot + 1], slot))
    # next step (another row pinned keep = 1): C' = 11, u' = 3 -> chain start 12 = the seed
    assert state.seed[0] == 11 + 3 - 2 and state.filled >= 12


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order",
                  "extend after the verify forward; Ok(false) / Err poison")
def test_per_row_capture_offsets_extend_each_row_from_its_own_offset():
    """§16 PerSequence draft side: filled [12, 10], capture offsets [12, 10], hidden [2,4,H];
    A commits 3 (L 13 -> 16), B commits 1 (L 11 -> 12) -> filled [15, 11], seeds at 14, 10."""
    rng = np.random.default_rng(16)
    a = DraftKv(cache=draft_history(MODEL, 14, 1), filled=12)
    b = DraftKv(cache=draft_history(MODEL, 12, 2), filled=10)
    toks = [rng.integers(0, V, 16).tolist(), rng.integers(0, V, 12).tolist()]
    hidden = rng.standard_normal((2, 4, H))
    extend_draft_kvs([a, b], (resolve_capture_offsets([12, 10]), hidden), toks, 2, MODEL)
    assert (a.filled, b.filled) == (15, 11) and not a.poisoned and not b.poisoned
    assert a.seed[0] == 14 and np.array_equal(a.seed[1], hidden[0, 2])
    assert b.seed[0] == 10 and np.array_equal(b.seed[1], hidden[1, 0])
    assert close(a.cache.k.data[0, 0, 12], oracle_slot_k(hidden[0, 0], toks[0][13], 12))
    assert close(a.cache.k.data[0, 0, 14], oracle_slot_k(hidden[0, 2], toks[0][15], 14))
    assert close(b.cache.k.data[0, 0, 10], oracle_slot_k(hidden[1, 0], toks[1][11], 10))


class NoRowOffsets:
    """An offsets object that describes the batch but has no value for the row (check 7)."""

    def describes(self, b):
        return True

    def row(self, r):
        return None


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
@pytest.mark.parametrize("case, state, capture, row, batch, model, result", [
    ("1 poisoned", fresh(poisoned=True), cap([4], (1, 2, H)), 0, 1, MODEL, False),
    ("1 before 2", fresh(poisoned=True), None, 0, 1, MODEL, False),
    ("2 no capture", fresh(), None, 0, 1, MODEL, True),
    ("3 Tier A", fresh(), cap([4], (1, 2, H)), 0, 1, TIER_A, True),
    ("3 before 4", fresh(), cap([4], (1, 1, 2, H)), 0, 1, TIER_A, True),
    ("5 dim0 != batch", fresh(), cap([4], (2, 2, H)), 0, 3, MODEL, False),
    ("5 row >= batch", fresh(), cap([4], (2, 2, H)), 2, 2, MODEL, False),
    ("6 does not describe", fresh(), cap([4, 4, 4], (2, 2, H)), 0, 2, MODEL, False),
    ("7 row None", fresh(), (NoRowOffsets(), np.zeros((2, 2, H))), 0, 2, MODEL, False),
    ("8 off > filled", fresh(filled=4), cap([5], (1, 2, H)), 0, 1, MODEL, False),
])
def test_every_early_return_of_extend_draft_kv_row(case, state, capture, row, batch, model, result):
    before = (state.filled, state.seed, state.cache.current_seq_len)
    assert extend_draft_kv_row(state, capture, list(range(9)), row, batch, model) is result, case
    assert (state.filled, state.seed, state.cache.current_seq_len) == before  # nothing written


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_a_capture_of_any_other_rank_is_an_error():
    with pytest.raises(StepRefusal, match="rank 4"):
        extend_draft_kv_row(fresh(), cap([4], (1, 1, 2, H)), list(range(9)), 0, 1, MODEL)
    with pytest.raises(StepRefusal, match="rank 1"):
        extend_draft_kv_row(fresh(), cap([4], (H,)), list(range(9)), 0, 1, MODEL)


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_a_rank_2_capture_is_a_batch_of_one():
    rng = np.random.default_rng(0)
    state, hidden = fresh(filled=4), rng.standard_normal((3, H))
    toks = list(range(8))  # L = 8: writes pairs 4, 5, 6; seed at 6
    assert extend_draft_kv_row(state, (CaptureOffsets([4]), hidden), toks, 0, 1, MODEL) is True
    assert state.filled == 7 and state.seed[0] == 6 and np.array_equal(state.seed[1], hidden[2])
    assert extend_draft_kv_row(fresh(), (CaptureOffsets([4]), hidden), toks, 0, 2, MODEL) is False


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_extension_span_on_the_shortest_histories():
    # L = 2: p = 0 is the one pair (h_0, tok_1); the capture from 0 holds it
    assert extension_span(0, 0, 3, [5, 6]) == (0, 1, 0)
    # L = 1: no pair has its next token yet, no seed
    assert extension_span(0, 0, 3, [5]) == (0, 0, None)
    # L = 0: sat(L - 1) = 0
    assert extension_span(0, 0, 3, []) == (0, 0, None)


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_nothing_to_write_keeps_filled_but_may_move_the_seed():
    rng = np.random.default_rng(1)
    state, hidden = fresh(filled=6), rng.standard_normal((1, 3, H))
    # off 3, T 3: positions 3..5 all below filled 6; L = 7 -> p = 5 in [3, 6)
    assert extend_draft_kv_row(state, (CaptureOffsets([3]), hidden), list(range(7)), 0, 1,
                               MODEL) is True
    assert state.filled == 6 and state.cache.current_seq_len == 6
    assert state.seed[0] == 5 and np.array_equal(state.seed[1], hidden[0, 2])
    old = state.seed  # a seed outside the captured block keeps the old seed
    assert extend_draft_kv_row(state, (CaptureOffsets([3]), hidden), list(range(12)), 0, 1,
                               MODEL) is True
    assert state.seed is old


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_nothing_to_write_leaves_a_longer_draft_kv_untouched():
    state = DraftKv(cache=draft_history(MODEL, 14, 4), filled=12)  # a chain's tail past filled
    hidden = np.random.default_rng(3).standard_normal((1, 2, H))
    # off 10, T 2: lo = 12, hi = min(12, L - 1 = 12) = 12: nothing to write
    assert extend_draft_kv_row(state, (CaptureOffsets([10]), hidden), list(range(13)), 0, 1,
                               MODEL) is True
    assert state.filled == 12 and state.cache.current_seq_len == 14
    assert state.seed[0] == 11 and np.array_equal(state.seed[1], hidden[0, 1])


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_hi_never_exceeds_l_minus_1():
    """Only pairs (h_i, tok_{i+1}) with i <= L-2 are written: a capture reaching L never
    writes position L-1 (its next token is not committed)."""
    state, hidden = fresh(filled=4), np.random.default_rng(2).standard_normal((1, 4, H))
    assert extend_draft_kv_row(state, (CaptureOffsets([4]), hidden), list(range(8)), 0, 1,
                               MODEL) is True
    assert state.filled == 7 and state.cache.current_seq_len == 7


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_a_refused_truncate_names_the_draft_kv_and_filled():
    state = DraftKv(cache=draft_history(MODEL, 12, 0), filled=20)  # capacity 16: set_len(20)
    with pytest.raises(CacheRefusal, match=r"^MTP draft KV truncate to 20 failed: "):
        extend_draft_kv_row(state, cap([20], (1, 3, H)), list(range(25)), 0, 1, MODEL)


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_a_block_state_without_a_cache_only_advances_filled():
    """Check 11, the (unreachable in practice) cache-less branch: filled = hi, nothing run."""
    state = DraftKv(cache=None, filled=2)
    assert extend_draft_kv_row(state, (CaptureOffsets([2]), np.ones((1, 3, H))), list(range(9)),
                               0, 1, MODEL) is True
    assert state.filled == 5 and state.seed is None  # p = 7 is outside [2, 5)


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
@pytest.mark.parametrize("model, t", [(TIER_A, 5), (SimpleNamespace(), 3)],
                         ids=["tier_a", "no_mtp_attribute"])
def test_a_tier_a_row_never_gets_a_seed(model, t):
    """Check 3 before the seed stash: a heads-only model, or a model without an `mtp`
    attribute, is Tier A."""
    state = DraftKv(cache=None)
    assert extend_draft_kv_row(state, (CaptureOffsets([0]), np.ones((1, t, H))),
                               list(range(t + 1)), 0, 1, model) is True
    assert state.seed is None and state.filled == 0


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_the_seed_is_kept_as_float64():
    state = DraftKv(cache=draft_history(MODEL, 4, 2), filled=4)
    hidden = np.random.default_rng(4).standard_normal((1, 3, H)).astype(np.float32)
    assert extend_draft_kv_row(state, (CaptureOffsets([4]), hidden), list(range(8)), 0, 1,
                               MODEL) is True
    assert state.seed[0] == 6 and state.seed[1].dtype == np.float64
    assert np.array_equal(state.seed[1], hidden[0, 2].astype(np.float64))


# --- §16 step 10: the batch loop --------------------------------------------------------------


@pytest.mark.rule("extend after the verify forward; Ok(false) / Err poison")
def test_an_extension_error_poisons_only_that_row():
    good, bad = fresh(filled=4), DraftKv(cache=draft_history(MODEL, 12, 0), filled=20)
    warnings: list[str] = []
    extend_draft_kvs([good, bad], (CaptureOffsets([4, 20]), np.zeros((2, 3, H))),
                     [list(range(9)), list(range(25))], 2, MODEL, warnings)
    assert bad.poisoned and not good.poisoned and good.filled == 7
    assert len(warnings) == 1 and "row 1" in warnings[0] and "truncate to 20" in warnings[0]


@pytest.mark.rule("extend_draft_cache")
def test_rows_after_a_missing_or_failed_state_are_extended():
    hidden = np.zeros((3, 3, H))
    toks = [list(range(25)), list(range(9)), list(range(9))]
    after_none = DraftKv(cache=draft_history(MODEL, 4, 3), filled=4)
    extend_draft_kvs([None, after_none, None], (CaptureOffsets([4]), hidden), toks, 3, MODEL)
    assert after_none.filled == 7 and not after_none.poisoned
    failing = DraftKv(cache=draft_history(MODEL, 12, 0), filled=20)  # the truncate is refused
    after_fail = DraftKv(cache=draft_history(MODEL, 4, 3), filled=4)
    warnings: list[str] = []
    extend_draft_kvs([failing, after_fail, None], (CaptureOffsets([20, 4, 4]), hidden), toks, 3,
                     MODEL, warnings)
    assert failing.poisoned and after_fail.filled == 7 and not after_fail.poisoned
    assert len(warnings) == 1 and warnings[0].startswith("row 0: draft KV extension failed (")


@pytest.mark.rule("extend_draft_cache")
def test_a_misaligned_row_is_warned_by_its_index():
    ok = DraftKv(cache=draft_history(MODEL, 4, 3), filled=4)
    late = DraftKv(cache=draft_history(MODEL, 2, 3), filled=2)
    warnings: list[str] = []
    extend_draft_kvs([ok, late], (CaptureOffsets([4, 4]), np.zeros((2, 3, H))),
                     [list(range(9))] * 2, 2, MODEL, warnings)
    assert late.poisoned and not ok.poisoned
    assert warnings == ["row 1: capture misaligned with the draft KV; draft KV poisoned"]


# --- §7.4 prompt priming -----------------------------------------------------------------------


@pytest.mark.rule("prompt-time priming")
def test_prompt_priming_fills_l_minus_1_and_seeds_l_minus_2():
    rng = np.random.default_rng(74)
    prompts = rng.integers(0, V, (2, 7))
    capture = MtpHiddenCapture()
    capture.arm()
    fwd = MODEL.forward(prompts, MODEL.new_cache(), [0], capture=capture)
    sampled = [int(np.argmax(fwd.logits[i, -1])) for i in range(2)]
    toks = [prompts[i].tolist() + [sampled[i]] for i in range(2)]  # L = 8 each
    m = DraftKvMap(MODEL.mtp)
    states = [m.checkout_draft_kv(i) for i in range(2)]
    warnings: list[str] = []
    prime_draft_kv(states, capture.take(), toks, 2, MODEL, warnings)
    assert warnings == []
    for i, s in enumerate(states):
        assert s.filled == 7 and s.cache.current_seq_len == 7
        assert s.seed[0] == 6 and np.array_equal(s.seed[1], fwd.hidden[i, 6])
        assert close(s.cache.k.data[0, 0, 3], oracle_slot_k(fwd.hidden[i, 3], toks[i][4], 3))
    # the next decode step (C = 7, u = 1) can draft: its chain start is the seed
    drafts = group_drafting_loop(MODEL, {(1, 6): [0, 1]}, states, toks, [7, 7], [100, 100], 4,
                                 False)
    assert [len(d) for d in drafts] == [3, 3]
    assert [s.filled for s in states] == [7, 7]
    assert [s.cache.current_seq_len for s in states] == [9, 9]


@pytest.mark.rule("prompt-time priming")
def test_a_prefix_cache_hit_poisons_the_sequence_for_good():
    state = DraftKvMap(MODEL.mtp).checkout_draft_kv("p")
    warnings: list[str] = []
    prime_draft_kv([state], (resolve_capture_offsets([5]), np.zeros((1, 3, H))),
                   list(range(9)), 1, MODEL, warnings)
    assert state.poisoned and state.filled == 0 and state.seed is None
    assert len(warnings) == 1 and "prefix-cache hit / chunked prefill" in warnings[0]
    assert extend_draft_kv_row(state, (resolve_capture_offsets([0]), np.zeros((1, 3, H))),
                               list(range(4)), 0, 1, MODEL) is False
