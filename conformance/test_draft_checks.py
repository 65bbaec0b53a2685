"""Draft KV and the draft chain at their edges (cache-and-draft.md §7, §9.3, §10.2): the
malformed-input messages, the smallest histories the extension rule handles (L = 0, 1, 2),
the LRU clock, which rows of a draft group take part, the extension loop's later rows after a
skipped or failed one, and token and hidden inputs in other array forms.

Expected values come from the rules' statements (`p = L - 2` seeds when `L >= 2`, `hi <=
sat(L - 1)`, one clock tick per checkin); the chains compared are the reference's own chains on
the canonical inputs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from raggedspec.conformance.test_draft import MODEL, TIER_A, H, history, state_with
from raggedspec.reference.dispatch import CaptureOffsets
from raggedspec.reference.draft import (
    DraftKv,
    DraftKvMap,
    argmax_token,
    draft_group_members,
    extend_draft_cache,
    extend_draft_kv_row,
    extend_draft_kvs,
    extension_span,
    propose_chain,
    propose_chain_batched,
)
from raggedspec.reference.errors import CacheRefusal

# --- malformed input: ValueError with the stated message -----------------------------------


@pytest.mark.rule("argmax_token_picks_max")
def test_argmax_token_takes_one_non_empty_row():
    assert argmax_token(np.array([3.0])) == 0
    assert argmax_token([0.5, 2.0, 2.0]) == 1  # the first on a tie
    with pytest.raises(ValueError, match=r"^logits shape \(0,\) must be \[V\], V >= 1$"):
        argmax_token(np.array([]))
    with pytest.raises(ValueError, match=r"^logits shape \(2, 2\) must be \[V\], V >= 1$"):
        argmax_token(np.ones((2, 2)))


@pytest.mark.rule("Tier A chain")
def test_chain_inputs_are_checked_with_the_stated_messages():
    cache = MODEL.mtp.new_draft_cache()
    with pytest.raises(ValueError, match=r"^depth -1 and max_tokens 5 must be >= 0$"):
        propose_chain(MODEL, np.ones(H), 1, -1, 5, 0, cache)
    with pytest.raises(ValueError, match=r"^depth 5 and max_tokens -1 must be >= 0$"):
        propose_chain(MODEL, np.ones(H), 1, 5, -1, 0, cache)
    with pytest.raises(ValueError, match=rf"^seed_hidden \({H},\) must be \[G,H\]$"):
        propose_chain_batched(MODEL, np.ones(H), [1], 2, [0], cache)
    with pytest.raises(ValueError, match=r"^chain length -1 must be >= 0$"):
        propose_chain_batched(MODEL, np.ones((1, H)), [1], -1, [0], cache)
    with pytest.raises(ValueError, match=r"^2 last tokens for a draft group of 1$"):
        propose_chain_batched(MODEL, np.ones((1, H)), [1, 2], 2, [0], cache)


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
def test_extend_draft_cache_without_a_block_or_a_cache_reports_zero():
    assert extend_draft_cache(None, None, np.ones((2, H)), [1, 2], 7) == 0


# --- the extension rule on the shortest histories ------------------------------------------

@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_extension_span_on_the_shortest_histories():
    # L = 2: p = 0 is the one pair (h_0, tok_1); the capture from 0 holds it
    assert extension_span(0, 0, 3, [5, 6]) == (0, 1, 0)
    # L = 1: no pair has its next token yet, no seed
    assert extension_span(0, 0, 3, [5]) == (0, 0, None)
    # L = 0: sat(L - 1) = 0
    assert extension_span(0, 0, 3, []) == (0, 0, None)


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_nothing_to_write_leaves_a_longer_draft_kv_untouched():
    state = DraftKv(cache=history(14, 4), filled=12)  # a chain's speculative tail past filled
    hidden = np.random.default_rng(3).standard_normal((1, 2, H))
    # off 10, T 2: lo = 12, hi = min(12, L - 1 = 12) = 12: nothing to write
    assert extend_draft_kv_row(state, (CaptureOffsets([10]), hidden), list(range(13)), 0, 1,
                               MODEL) is True
    assert state.filled == 12 and state.cache.current_seq_len == 14
    assert state.seed[0] == 11 and np.array_equal(state.seed[1], hidden[0, 1])


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_a_model_without_an_mtp_attribute_is_tier_a():
    state = DraftKv(cache=None)
    assert extend_draft_kv_row(state, (CaptureOffsets([0]), np.ones((1, 3, H))), list(range(4)),
                               0, 1, SimpleNamespace()) is True
    assert state.seed is None and state.filled == 0


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_the_seed_is_kept_as_float64():
    state = DraftKv(cache=history(4, 2), filled=4)
    hidden = np.random.default_rng(4).standard_normal((1, 3, H)).astype(np.float32)
    assert extend_draft_kv_row(state, (CaptureOffsets([4]), hidden), list(range(8)), 0, 1,
                               MODEL) is True
    assert state.seed[0] == 6 and state.seed[1].dtype == np.float64
    assert np.array_equal(state.seed[1], hidden[0, 2].astype(np.float64))


# --- the extension loop: a skipped or failed row leaves the later rows to extend -------------

@pytest.mark.rule("extend_draft_cache")
def test_rows_after_a_missing_or_failed_state_are_extended():
    hidden = np.zeros((3, 3, H))
    toks = [list(range(25)), list(range(9)), list(range(9))]
    after_none = DraftKv(cache=history(4, 3), filled=4)
    extend_draft_kvs([None, after_none, None], (CaptureOffsets([4]), hidden), toks, 3, MODEL)
    assert after_none.filled == 7 and not after_none.poisoned
    failing = DraftKv(cache=history(12, 0), filled=20)  # capacity 16: the truncate is refused
    after_fail = DraftKv(cache=history(4, 3), filled=4)
    warnings: list[str] = []
    extend_draft_kvs([failing, after_fail, None], (CaptureOffsets([20, 4, 4]), hidden), toks, 3,
                     MODEL, warnings)
    assert failing.poisoned and after_fail.filled == 7 and not after_fail.poisoned
    assert len(warnings) == 1 and warnings[0].startswith("row 0: draft KV extension failed (")


@pytest.mark.rule("extend_draft_cache")
def test_a_misaligned_row_is_warned_by_its_index():
    ok, late = DraftKv(cache=history(4, 3), filled=4), DraftKv(cache=history(2, 3), filled=2)
    warnings: list[str] = []
    extend_draft_kvs([ok, late], (CaptureOffsets([4, 4]), np.zeros((2, 3, H))),
                     [list(range(9))] * 2, 2, MODEL, warnings)
    assert late.poisoned and not ok.poisoned
    assert warnings == ["row 1: capture misaligned with the draft KV; draft KV poisoned"]


# --- which rows of a group draft ------------------------------------------------------------

@pytest.mark.rule("group loop: member skips")
def test_a_row_left_out_does_not_end_the_group():
    states = [state_with(12, 12, 11, s) for s in range(4)]
    states[1].seed = (10, states[1].seed[1])  # not at its chain start 11
    members, starts = draft_group_members([0, 1, 2, 3], states, [12] * 4, [9, 9, 0, 9], 1)
    assert (members, starts) == ([0, 3], [11, 11])  # row 2 has budget 0


# --- the map's clock --------------------------------------------------------------------------

@pytest.mark.rule("DraftKv and the map: checkout, LRU checkin, drop, clear")
def test_each_checkin_ticks_the_clock_once_from_zero():
    m = DraftKvMap(MODEL.mtp)
    a, b = DraftKv(cache=None), DraftKv(cache=None)
    m.checkin("a", a)
    m.checkin("b", b)
    assert (a.last_used, b.last_used) == (1, 2)
    assert m.drop_draft_kv("absent") is None and sorted(m.entries) == ["a", "b"]


# --- tokens and hidden rows in other array forms -----------------------------------------

@pytest.mark.rule("extend_draft_cache")
def test_next_tokens_given_as_a_row_are_read_flattened():
    rng = np.random.default_rng(6)
    h, nxt = rng.standard_normal((2, H)), [3, 4]
    flat, row = MODEL.mtp.new_draft_cache(), MODEL.mtp.new_draft_cache()
    assert extend_draft_cache(MODEL.mtp, flat, h, nxt, 0) == 2
    assert extend_draft_cache(MODEL.mtp, row, h, [nxt], 0) == 2
    assert np.array_equal(row.k.current_data(), flat.k.current_data())


@pytest.mark.rule("Tier A chain")
def test_last_tokens_given_as_a_column_or_as_whole_floats_draft_the_same_chain():
    seed = np.random.default_rng(7).standard_normal((2, H))
    want = propose_chain_batched(TIER_A, seed, [3, 5], 3, [4, 4], None)
    assert propose_chain_batched(TIER_A, seed, [[3], [5]], 3, [4, 4], None) == want
    assert propose_chain_batched(TIER_A, seed, np.array([3.0, 5.0]), 3, [4, 4], None) == want


@pytest.mark.rule("extend_draft_kv_row checks 1-13 in order")
def test_a_refused_truncate_names_the_draft_kv():
    state = DraftKv(cache=history(12, 0), filled=20)
    with pytest.raises(CacheRefusal, match=r"^MTP draft KV truncate to 20 failed: "):
        extend_draft_kv_row(state, (CaptureOffsets([20]), np.zeros((1, 3, H))), list(range(25)),
                            0, 1, MODEL)
