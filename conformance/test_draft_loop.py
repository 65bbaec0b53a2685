"""The group drafting loop (cache-and-draft.md §9.3, §16): which rows draft together, the
uniform and the ragged group paths, and every way a group or a member is skipped.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import raggedspec.reference.draft as draft_mod
from raggedspec.conformance.test_draft import MODEL, TIER_A, H, StepSpy, V, state_with
from raggedspec.reference.cache import KvCache
from raggedspec.reference.draft import (
    DraftKv,
    group_drafting_loop,
    propose_chain,
)
from raggedspec.reference.errors import CacheRefusal, StepRefusal

# --- §9.3 the group drafting loop
# -------------------------------------------------------------------


def two_row_group(per_seq: bool):
    """§16 PerSequence: own KV A 12, B 10, u = 1 both -> chain starts [11, 9]; draft KV
    filled [12, 10] from the previous step's extend, seeds at the chain starts."""
    a, b = state_with(12, 12, 11, 0), state_with(10, 10, 9, 1)
    rng = np.random.default_rng(5)
    toks = [rng.integers(0, V, 13).tolist(), rng.integers(0, V, 11).tolist()]
    key = (1, 0) if per_seq else (1, 11)
    return [a, b], toks, key


@pytest.mark.rule(
    "group loop: group cache via resolve_draft_leads",
    "group loop: write-back with split and strip, then record drafts",
)
def test_the_per_sequence_example_drafts_a_ragged_group_in_one_forward(monkeypatch):
    states, toks, key = two_row_group(per_seq=True)
    alone = []
    for i, s in enumerate(states):  # each row drafted alone, for comparison
        c = s.cache.clone()
        c.set_len(s.seed[0])
        alone.append(propose_chain(MODEL, s.seed[1], toks[i][-1], 3, 100, s.seed[0], c))
    aligned = []
    orig_align = draft_mod.front_align_draft_group

    def spy_align(caches, starts):
        out = orig_align(caches, starts)
        aligned.append((list(starts), out.current_seq_len))
        return out

    monkeypatch.setattr(draft_mod, "front_align_draft_group", spy_align)
    spy = StepSpy(monkeypatch)
    drafts = group_drafting_loop(MODEL, {key: [0, 1]}, states, toks, [12, 10], [100, 100], 4, True)
    assert aligned == [([11, 9], 11)]  # draft leads [0, 2], aligned width 11
    assert spy.rows == [[11, 9], [12, 10], [13, 11]] and spy.scalar == []
    assert drafts == alone
    assert [s.filled for s in states] == [12, 10]  # chain_start + 1
    assert [s.cache.current_seq_len for s in states] == [14, 12]  # start + n_draft, prefix stripped
    assert all(s.cache.k.current_data().shape[2] == s.cache.current_seq_len for s in states)


@pytest.mark.rule("group loop: group cache via resolve_draft_leads")
def test_a_uniform_group_takes_batch_draft_caches_and_the_scalar_chain(monkeypatch):
    states = [
        state_with(14, 13, 11, s) for s in range(3)
    ]  # last chain's speculative tail beyond filled
    toks = [list(range(13))] * 3
    monkeypatch.setattr(
        draft_mod, "front_align_draft_group", lambda *a: pytest.fail("ragged path taken")
    )
    spy = StepSpy(monkeypatch)
    drafts = group_drafting_loop(
        MODEL, {(1, 11): [0, 1, 2]}, states, toks, [12] * 3, [9] * 3, 4, True
    )
    assert spy.scalar == [11, 12, 13] and spy.rows == []
    assert all(len(d) == 3 for d in drafts)
    assert [s.filled for s in states] == [12] * 3 and [s.cache.current_seq_len for s in states] == [
        14
    ] * 3


@pytest.mark.rule("group loop: group cache via resolve_draft_leads")
def test_with_the_flag_off_a_group_is_never_front_aligned(monkeypatch):
    """resolve_draft_leads is gated on per_seq_advance: even unequal starts take
    batch_draft_caches + set_len(starts[0]) (nothing would mask the padding)."""
    a, b = state_with(12, 12, 11, 0), state_with(12, 12, 9, 1)
    monkeypatch.setattr(
        draft_mod,
        "front_align_draft_group",
        lambda *a: pytest.fail("front-aligned with the flag off"),
    )
    batched = []
    orig = draft_mod.batch_draft_caches

    def spy_batch(caches):
        batched.append(len(caches))
        return orig(caches)

    monkeypatch.setattr(draft_mod, "batch_draft_caches", spy_batch)
    drafts = group_drafting_loop(
        MODEL,
        {(1, 0): [0, 1]},
        [a, b],
        [list(range(13)), list(range(11))],
        [12, 10],
        [9, 9],
        4,
        False,
    )
    assert batched == [2] and all(len(d) == 3 for d in drafts)


@pytest.mark.rule("group loop: member skips")
@pytest.mark.parametrize(
    "defect", ["budget 0", "no state", "poisoned", "no seed", "stale seed", "filled short"]
)
def test_a_member_that_cannot_draft_is_skipped(defect):
    good, bad = state_with(12, 12, 11, 0), state_with(12, 12, 11, 1)
    budgets = [9, 9]
    if defect == "budget 0":
        budgets[1] = 0
    elif defect == "poisoned":
        bad.poisoned = True
    elif defect == "no seed":
        bad.seed = None
    elif defect == "stale seed":
        bad.seed = (10, bad.seed[1])
    elif defect == "filled short":
        bad.filled = 10
    states = [good, None if defect == "no state" else bad]
    before = None if states[1] is None else (states[1].filled, states[1].cache.current_seq_len)
    drafts = group_drafting_loop(
        MODEL, {(1, 11): [0, 1]}, states, [list(range(13))] * 2, [12, 12], budgets, 4, False
    )
    assert len(drafts[0]) == 3 and drafts[1] == []
    assert good.filled == 12 and good.cache.current_seq_len == 14
    if states[1] is not None:
        assert (states[1].filled, states[1].cache.current_seq_len) == before


@pytest.mark.rule("group loop: member skips")
def test_nothing_to_draft_warns_once_and_only_with_a_block():
    states = [state_with(12, 12, None, 0), state_with(12, 12, None, 1)]
    groups = {(1, 11): [0], (2, 12): [1]}
    warnings: list[str] = []
    drafts = group_drafting_loop(
        MODEL, groups, states, [list(range(13))] * 2, [12, 12], [9, 9], 4, False, warnings
    )
    assert drafts == [[], []] and len(warnings) == 1
    quiet: list[str] = []
    group_drafting_loop(
        TIER_A,
        groups,
        [DraftKv(None), DraftKv(None)],
        [list(range(13))] * 2,
        [12, 12],
        [9, 9],
        4,
        False,
        quiet,
    )
    assert quiet == []


@pytest.mark.rule("group loop: group cache via resolve_draft_leads")
def test_an_unbatchable_uniform_group_is_skipped_with_a_warning():
    a, b = state_with(12, 12, 11, 0), state_with(20, 12, 11, 1)  # capacity 16 vs 528
    b.cache.set_len(12)
    warnings: list[str] = []
    drafts = group_drafting_loop(
        MODEL,
        {(1, 11): [0, 1]},
        [a, b],
        [list(range(13))] * 2,
        [12, 12],
        [9, 9],
        4,
        False,
        warnings,
    )
    assert drafts == [[], []] and len(warnings) == 1 and "batched" in warnings[0]
    assert (a.filled, a.cache.current_seq_len, b.filled) == (12, 12, 12)


@pytest.mark.rule("group loop: group cache via resolve_draft_leads")
def test_a_refused_set_len_or_front_alignment_skips_the_group(monkeypatch):
    states, toks, key = two_row_group(per_seq=True)
    states[1].cache.set_len(8)  # holds 8 < chain start 9: front_align_draft_group refuses
    warnings: list[str] = []
    drafts = group_drafting_loop(
        MODEL, {key: [0, 1]}, states, toks, [12, 10], [9, 9], 4, True, warnings
    )
    assert drafts == [[], []] and "chain start 9" in warnings[0]
    tiny = KvCache.new_normal(4096, 4)
    monkeypatch.setattr(draft_mod, "batch_draft_caches", lambda caches: tiny)
    states = [state_with(12, 12, 11, s) for s in range(2)]
    warnings = []
    drafts = group_drafting_loop(
        MODEL,
        {(1, 11): [0, 1]},
        states,
        [list(range(13))] * 2,
        [12, 12],
        [9, 9],
        4,
        False,
        warnings,
    )
    assert drafts == [[], []] and "set_len(11)" in warnings[0]


@pytest.mark.rule("group loop: chain errors propagate")
def test_a_chain_error_propagates(monkeypatch):
    def boom(*args, **kwargs):
        raise StepRefusal("chain failed")

    monkeypatch.setattr(draft_mod, "propose_chain_batched", boom)
    states = [state_with(12, 12, 11, s) for s in range(2)]
    with pytest.raises(StepRefusal, match="chain failed"):
        group_drafting_loop(
            MODEL, {(1, 11): [0, 1]}, states, [list(range(13))] * 2, [12, 12], [9, 9], 4, False
        )


@pytest.mark.rule("group loop: write-back with split and strip, then record drafts")
def test_a_split_failure_gives_the_group_no_drafts(monkeypatch):
    monkeypatch.setattr(draft_mod, "split_draft_cache", lambda batched, g: None)
    states = [state_with(12, 12, 11, s) for s in range(2)]
    warnings: list[str] = []
    drafts = group_drafting_loop(
        MODEL,
        {(1, 11): [0, 1]},
        states,
        [list(range(13))] * 2,
        [12, 12],
        [9, 9],
        4,
        False,
        warnings,
    )
    assert drafts == [[], []] and [s.filled for s in states] == [12, 12] and len(warnings) == 1


@pytest.mark.rule("group loop: write-back with split and strip, then record drafts")
def test_a_failed_strip_poisons_the_row_but_still_records_its_draft(monkeypatch):
    orig = draft_mod.drop_dead_prefix
    seen = []

    def strip(slot, lead):
        seen.append(lead)
        if lead > 0:
            raise CacheRefusal(f"cannot drop a {lead}-column dead prefix")
        orig(slot, lead)

    monkeypatch.setattr(draft_mod, "drop_dead_prefix", strip)
    states, toks, key = two_row_group(per_seq=True)
    old_cache = states[1].cache
    warnings: list[str] = []
    drafts = group_drafting_loop(
        MODEL, {key: [0, 1]}, states, toks, [12, 10], [9, 9], 4, True, warnings
    )
    assert seen == [0, 2]
    assert states[1].poisoned and states[1].cache is old_cache and states[1].filled == 10
    assert not states[0].poisoned and states[0].filled == 12
    assert len(drafts[0]) == 3 and len(drafts[1]) == 3  # recorded even for the failed strip
    assert len(warnings) == 1 and "row 1" in warnings[0]


@pytest.mark.rule("group loop: write-back with split and strip, then record drafts")
def test_the_strip_runs_before_filled_is_committed(monkeypatch):
    """Write-back order: drop_dead_prefix(row_cache, lead), then filled = chain_start + 1."""
    order = []
    orig = draft_mod.drop_dead_prefix
    states, toks, key = two_row_group(per_seq=True)
    states = [state_with(14, 13, 11, 0), state_with(12, 11, 9, 1)]  # filled != chain_start + 1

    def strip(slot, lead):
        order.append(("strip", [s.filled for s in states]))
        orig(slot, lead)

    monkeypatch.setattr(draft_mod, "drop_dead_prefix", strip)
    group_drafting_loop(MODEL, {key: [0, 1]}, states, toks, [12, 10], [9, 9], 4, True)
    assert order == [("strip", [13, 11]), ("strip", [12, 11])]
    assert [s.filled for s in states] == [12, 10]
    assert [s.cache.current_seq_len for s in states] == [14, 12]


# --- a skipped group or row leaves every later one to draft ---------------------------------

BAD, GOOD = (1, 0), (1, 1)


def bad_then_good(defect, monkeypatch):
    """Group BAD (rows 0, 1) fails by `defect`; group GOOD (rows 2, 3, uniform, chain start
    11) is drafted after it. Returns the loop's arguments and the expected warning."""
    states = [state_with(12, 12, 11, 0), state_with(10, 10, 9, 1),
              state_with(12, 12, 11, 2), state_with(12, 12, 11, 3)]
    lens, per_seq = [12, 10, 12, 12], False
    if defect == "no row":
        states[0].seed = states[1].seed = None
        want = "draft group (1, 0): no row can draft (no seed at its chain start)"
    elif defect == "no cache":
        states[1].cache = None
        want = "draft group (1, 0): a member has no draft KV cache; group skipped"
    elif defect == "unbatchable":
        states[1] = state_with(20, 10, 9, 1)  # capacity 528 against 16
        states[1].cache.set_len(10)
        want = "draft group (1, 0): draft caches cannot be batched; group skipped"
    elif defect == "set_len":
        states[1] = state_with(12, 12, 9, 1)  # same shape as row 0: batchable, starts [11, 9]
        tiny = KvCache.new_normal(4096, 4)
        with pytest.raises(CacheRefusal) as refused:
            tiny.clone().set_len(11)
        first_call(monkeypatch, "batch_draft_caches", lambda caches: tiny)
        want = f"draft group (1, 0): set_len(11) refused ({refused.value}); group skipped"
    elif defect == "front-align":
        per_seq = True
        states[1].cache.set_len(8)  # holds 8 < chain start 9
        want = ("draft group (1, 0): front-alignment refused (chain start 9 is past the 8 "
                "position(s) draft row 1 holds); group skipped")
    else:  # split, after the ragged path aligned the group
        per_seq = True
        first_call(monkeypatch, "split_draft_cache", lambda batched, g: None)
        want = "draft group (1, 0): the batched draft cache did not split into 2; no drafts"
    toks = [list(range(13)), list(range(11)), list(range(13)), list(range(13))]
    return (states, toks, lens, per_seq), want


def first_call(monkeypatch, name, replacement):
    """Replace `draft_mod.name` for its first call only."""
    orig, calls = getattr(draft_mod, name), []

    def once(*args):
        calls.append(1)
        return replacement(*args) if len(calls) == 1 else orig(*args)

    monkeypatch.setattr(draft_mod, name, once)


@pytest.mark.rule("group loop: write-back with split and strip, then record drafts")
@pytest.mark.parametrize(
    "defect", ["no row", "no cache", "unbatchable", "set_len", "front-align", "split"]
)
def test_a_skipped_group_warns_with_its_key_and_the_next_group_still_drafts(defect, monkeypatch):
    (states, toks, lens, per_seq), want = bad_then_good(defect, monkeypatch)
    warnings: list[str] = []
    drafts = group_drafting_loop(MODEL, {BAD: [0, 1], GOOD: [2, 3]}, states, toks, lens,
                                 [9] * 4, 4, per_seq, warnings)
    assert warnings == [want]
    assert drafts[0] == [] and drafts[1] == []
    assert [len(d) for d in drafts[2:]] == [3, 3]
    assert [s.filled for s in states[2:]] == [12, 12]
    assert [s.cache.current_seq_len for s in states[2:]] == [14, 14]


@pytest.mark.rule("group loop: write-back with split and strip, then record drafts")
def test_every_tier_a_group_drafts():
    states = [DraftKv(None, 11, seed=(11, np.ones(H))), DraftKv(None, 12, seed=(12, np.ones(H)))]
    drafts = group_drafting_loop(TIER_A, {(1, 0): [0], (1, 1): [1]}, states,
                                 [list(range(13)), list(range(14))], [12, 13], [9, 9], 4, False)
    assert drafts == [propose_chain(TIER_A, np.ones(H), 12, 3, 99, 11, None),
                      propose_chain(TIER_A, np.ones(H), 13, 3, 99, 12, None)]


@pytest.mark.rule("group loop: write-back with split and strip, then record drafts")
def test_a_failed_strip_of_one_row_leaves_the_next_row_written_back(monkeypatch):
    orig = draft_mod.drop_dead_prefix

    def strip(slot, lead):
        if lead > 0:
            raise CacheRefusal(f"cannot drop a {lead}-column dead prefix")
        orig(slot, lead)

    monkeypatch.setattr(draft_mod, "drop_dead_prefix", strip)
    states = [state_with(10, 10, 9, 0), state_with(12, 12, 11, 1)]  # starts [9, 11]: leads [2, 0]
    warnings: list[str] = []
    drafts = group_drafting_loop(MODEL, {(1, 0): [0, 1]}, states,
                                 [list(range(11)), list(range(13))], [10, 12], [9, 9], 4, True,
                                 warnings)
    assert warnings == ["row 0: stripping the draft dead prefix failed (cannot drop a 2-column "
                        "dead prefix); draft KV poisoned"]
    assert states[0].poisoned and states[0].filled == 10
    assert not states[1].poisoned and states[1].filled == 12
    assert states[1].cache.current_seq_len == 14 and [len(d) for d in drafts] == [3, 3]


@pytest.mark.rule("group loop: write-back with split and strip, then record drafts")
def test_the_loop_needs_one_entry_per_row():
    states = [state_with(12, 12, 11, 0), state_with(12, 12, 11, 1)]
    for toks, lens, budgets, got in (([[1]], [12, 12], [9, 9], "toks (1), cache_lens (2) and "
                                      "budgets (2)"),
                                     ([[1], [1]], [12], [9, 9], "toks (2), cache_lens (1) and "
                                      "budgets (2)"),
                                     ([[1], [1]], [12, 12], [9], "toks (2), cache_lens (2) and "
                                      "budgets (1)")):
        with pytest.raises(ValueError, match=rf"^states \(2\), {re.escape(got)} must have one "
                                             r"entry per row$"):
            group_drafting_loop(MODEL, {(1, 0): [0, 1]}, states, toks, lens, budgets, 4, False)
