"""The group drafting loop (cache-and-draft.md §9.3, §9.5-§9.8, §16): which rows draft together,
the uniform (batched + `set_len`) and ragged (front-aligned) group paths, the write-back with
its split and strip, and every way a group or a member is skipped, on the reference; then the
torch port's loop on rows of its pooled draft KV (`gpu.draft_loop`) against it on one body
(`draft_chain` through both backends: the drafts, the warnings, every row's state and draft KV
compared; float64, so the chains are the same greedy tokens).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given

import raggedspec.reference.draft as draft_mod
from raggedspec.conformance.helpers import StepSpy, assert_same_draft_states, draft_history, held_k
from raggedspec.conformance.helpers import built_model, primed_state, ref_draft_kv
from raggedspec.conformance.strategies import write_back_groups
from raggedspec.gpu.backend import TorchBackend
from raggedspec.reference import dispatch
from raggedspec.gpu.testing import DEVICE, assert_bit_exact, assert_same_refusal, outcome, to_port
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.cache import KvCache
from raggedspec.reference.draft import WARNINGS, DraftKv, draft_group_members, group_drafting_loop
from raggedspec.reference.draft import propose_chain
from raggedspec.reference.errors import CacheRefusal, DispatchRefusal, StepRefusal
from raggedspec.reference.model import ModelConfig, MtpBlock, TinyModel

MODEL = TinyModel()
TIER_A = TinyModel(ModelConfig(mtp="heads"))
H, V, HD = MODEL.cfg.hidden, MODEL.cfg.vocab, MODEL.cfg.head_dim
REF = NumpyBackend()
PORT = TorchBackend(str(DEVICE), "float64")


def state_with(n_held: int, filled: int, seed_pos: int | None, seed: int) -> DraftKv:
    """A reference state whose draft KV holds `n_held` slots, `filled` of them committed, seeded
    at `seed_pos` (None: no seed)."""
    st_ = DraftKv(cache=draft_history(MODEL, n_held, seed), filled=filled)
    if seed_pos is not None:
        st_.seed = (seed_pos, np.random.default_rng(1000 + seed).standard_normal(H))
    return st_


def loop(states, toks, lens, budgets, per_seq, groups, warnings=None, w=4, model=MODEL):
    return group_drafting_loop(model, groups, states, toks, lens, budgets, w, per_seq, warnings)


def two_row_group(per_seq: bool):
    """§16 PerSequence: own KV A 12, B 10, u = 1 both -> chain starts [11, 9]; draft KV
    filled [12, 10] from the previous step's extend, seeds at the chain starts."""
    a, b = state_with(12, 12, 11, 0), state_with(10, 10, 9, 1)
    rng = np.random.default_rng(5)
    toks = [rng.integers(0, V, 13).tolist(), rng.integers(0, V, 11).tolist()]
    return [a, b], toks, (1, 0) if per_seq else (1, 11)


# --- the reference loop ---------------------------------------------------------------------------


@pytest.mark.rule("group loop: group cache via resolve_draft_leads",
                  "group loop: write-back with split and strip, then record drafts")
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
    spy = StepSpy(monkeypatch, MtpBlock)
    drafts = loop(states, toks, [12, 10], [100, 100], True, {key: [0, 1]})
    assert aligned == [([11, 9], 11)]  # draft leads [0, 2], aligned width 11
    assert spy.rows == [[11, 9], [12, 10], [13, 11]] and spy.scalar == []
    assert drafts == alone
    assert [s.filled for s in states] == [12, 10]  # chain_start + 1
    assert [s.cache.current_seq_len for s in states] == [14, 12]  # start + n, prefix stripped
    assert all(s.cache.k.current_data().shape[2] == s.cache.current_seq_len for s in states)


@pytest.mark.rule("group loop: group cache via resolve_draft_leads")
def test_a_uniform_group_takes_batch_draft_caches_and_the_scalar_chain(monkeypatch):
    states = [state_with(14, 13, 11, s) for s in range(3)]  # the last chain's tail past filled
    monkeypatch.setattr(draft_mod, "front_align_draft_group",
                        lambda *a: pytest.fail("ragged path taken"))
    spy = StepSpy(monkeypatch, MtpBlock)
    drafts = loop(states, [list(range(13))] * 3, [12] * 3, [9] * 3, True, {(1, 11): [0, 1, 2]})
    assert spy.scalar == [11, 12, 13] and spy.rows == []
    assert all(len(d) == 3 for d in drafts)
    assert [s.filled for s in states] == [12] * 3
    assert [s.cache.current_seq_len for s in states] == [14] * 3


@pytest.mark.rule("group loop: group cache via resolve_draft_leads")
def test_with_the_flag_off_a_group_is_never_front_aligned(monkeypatch):
    """resolve_draft_leads is gated on per_seq_advance: even unequal starts take
    batch_draft_caches + set_len(starts[0]) (nothing would mask the padding)."""
    a, b = state_with(12, 12, 11, 0), state_with(12, 12, 9, 1)
    monkeypatch.setattr(draft_mod, "front_align_draft_group",
                        lambda *a: pytest.fail("front-aligned with the flag off"))
    batched = []
    orig = draft_mod.batch_draft_caches

    def spy_batch(caches):
        batched.append(len(caches))
        return orig(caches)

    monkeypatch.setattr(draft_mod, "batch_draft_caches", spy_batch)
    drafts = loop([a, b], [list(range(13)), list(range(11))], [12, 10], [9, 9], False,
                  {(1, 0): [0, 1]})
    assert batched == [2] and all(len(d) == 3 for d in drafts)


@pytest.mark.rule("group loop: member skips")
@pytest.mark.parametrize(
    "defect", ["budget 0", "no state", "poisoned", "no seed", "stale seed", "filled short"])
def test_a_member_that_cannot_draft_is_skipped(defect):
    good, bad = state_with(12, 12, 11, 0), state_with(12, 12, 11, 1)
    budgets = [9, 0 if defect == "budget 0" else 9]
    if defect == "poisoned":
        bad.poisoned = True
    elif defect == "no seed":
        bad.seed = None
    elif defect == "stale seed":
        bad.seed = (10, bad.seed[1])
    elif defect == "filled short":
        bad.filled = 10
    states = [good, None if defect == "no state" else bad]
    before = None if states[1] is None else (states[1].filled, states[1].cache.current_seq_len)
    drafts = loop(states, [list(range(13))] * 2, [12, 12], budgets, False, {(1, 11): [0, 1]})
    assert len(drafts[0]) == 3 and drafts[1] == []
    assert good.filled == 12 and good.cache.current_seq_len == 14
    if states[1] is not None:
        assert (states[1].filled, states[1].cache.current_seq_len) == before


@pytest.mark.rule("group loop: member skips")
def test_a_row_left_out_does_not_end_the_group():
    states = [state_with(12, 12, 11, s) for s in range(4)]
    states[1].seed = (10, states[1].seed[1])  # not at its chain start 11
    members, starts = draft_group_members([0, 1, 2, 3], states, [12] * 4, [9, 9, 0, 9], 1)
    assert (members, starts) == ([0, 3], [11, 11])  # row 2 has budget 0


@pytest.mark.rule("group loop: member skips")
def test_nothing_to_draft_warns_once_and_only_with_a_block():
    states = [state_with(12, 12, None, 0), state_with(12, 12, None, 1)]
    groups = {(1, 11): [0], (2, 12): [1]}
    warnings: list[str] = []
    drafts = loop(states, [list(range(13))] * 2, [12, 12], [9, 9], False, groups, warnings)
    assert drafts == [[], []] and len(warnings) == 1
    quiet: list[str] = []
    loop([DraftKv(None), DraftKv(None)], [list(range(13))] * 2, [12, 12], [9, 9], False, groups,
         quiet, model=TIER_A)
    assert quiet == []


@pytest.mark.rule("group loop: group cache via resolve_draft_leads")
def test_an_unbatchable_uniform_group_is_skipped_with_a_warning():
    a, b = state_with(12, 12, 11, 0), state_with(20, 12, 11, 1)  # capacity 16 vs 528
    b.cache.set_len(12)
    warnings: list[str] = []
    drafts = loop([a, b], [list(range(13))] * 2, [12, 12], [9, 9], False, {(1, 11): [0, 1]},
                  warnings)
    assert drafts == [[], []] and len(warnings) == 1 and "batched" in warnings[0]
    assert (a.filled, a.cache.current_seq_len, b.filled) == (12, 12, 12)


@pytest.mark.rule("group loop: group cache via resolve_draft_leads")
def test_a_refused_set_len_or_front_alignment_skips_the_group(monkeypatch):
    states, toks, key = two_row_group(per_seq=True)
    states[1].cache.set_len(8)  # holds 8 < chain start 9: front_align_draft_group refuses
    warnings: list[str] = []
    drafts = loop(states, toks, [12, 10], [9, 9], True, {key: [0, 1]}, warnings)
    assert drafts == [[], []] and "chain start 9" in warnings[0]
    tiny = KvCache.new_normal(4096, 4)
    monkeypatch.setattr(draft_mod, "batch_draft_caches", lambda caches: tiny)
    warnings = []
    drafts = loop([state_with(12, 12, 11, s) for s in range(2)], [list(range(13))] * 2,
                  [12, 12], [9, 9], False, {(1, 11): [0, 1]}, warnings)
    assert drafts == [[], []] and "set_len(11)" in warnings[0]


@pytest.mark.rule("group loop: chain errors propagate")
def test_a_chain_error_propagates(monkeypatch):
    def boom(*args, **kwargs):
        raise StepRefusal("chain failed")

    monkeypatch.setattr(draft_mod, "propose_chain_batched", boom)
    with pytest.raises(StepRefusal, match="chain failed"):
        loop([state_with(12, 12, 11, s) for s in range(2)], [list(range(13))] * 2, [12, 12],
             [9, 9], False, {(1, 11): [0, 1]})


@pytest.mark.rule("group loop: write-back with split and strip, then record drafts")
def test_a_split_failure_gives_the_group_no_drafts(monkeypatch):
    monkeypatch.setattr(draft_mod, "split_draft_cache", lambda batched, g: None)
    states = [state_with(12, 12, 11, s) for s in range(2)]
    warnings: list[str] = []
    drafts = loop(states, [list(range(13))] * 2, [12, 12], [9, 9], False, {(1, 11): [0, 1]},
                  warnings)
    assert drafts == [[], []] and [s.filled for s in states] == [12, 12] and len(warnings) == 1


def failing_strip(monkeypatch, seen=None):
    """`drop_dead_prefix` refusing every lead > 0 (the leads it is asked for go to `seen`)."""
    orig = draft_mod.drop_dead_prefix

    def strip(slot, lead):
        if seen is not None:
            seen.append(lead)
        if lead > 0:
            raise CacheRefusal(f"cannot drop a {lead}-column dead prefix")
        orig(slot, lead)

    monkeypatch.setattr(draft_mod, "drop_dead_prefix", strip)


@pytest.mark.rule("group loop: write-back with split and strip, then record drafts")
def test_a_failed_strip_poisons_the_row_but_still_records_its_draft(monkeypatch):
    seen: list = []
    failing_strip(monkeypatch, seen)
    states, toks, key = two_row_group(per_seq=True)
    old_cache = states[1].cache
    warnings: list[str] = []
    drafts = loop(states, toks, [12, 10], [9, 9], True, {key: [0, 1]}, warnings)
    assert seen == [0, 2]
    assert states[1].poisoned and states[1].cache is old_cache and states[1].filled == 10
    assert not states[0].poisoned and states[0].filled == 12
    assert len(drafts[0]) == 3 and len(drafts[1]) == 3  # recorded even for the failed strip
    assert len(warnings) == 1 and "row 1" in warnings[0]


@pytest.mark.rule("group loop: write-back with split and strip, then record drafts")
def test_a_failed_strip_of_one_row_leaves_the_next_row_written_back(monkeypatch):
    failing_strip(monkeypatch)
    states = [state_with(10, 10, 9, 0), state_with(12, 12, 11, 1)]  # starts [9, 11]: leads [2, 0]
    warnings: list[str] = []
    drafts = loop(states, [list(range(11)), list(range(13))], [10, 12], [9, 9], True,
                  {(1, 0): [0, 1]}, warnings)
    assert warnings == ["row 0: stripping the draft dead prefix failed (cannot drop a 2-column "
                        "dead prefix); draft KV poisoned"]
    assert states[0].poisoned and states[0].filled == 10
    assert not states[1].poisoned and states[1].filled == 12
    assert states[1].cache.current_seq_len == 14 and [len(d) for d in drafts] == [3, 3]


@pytest.mark.rule("group loop: write-back with split and strip, then record drafts")
def test_the_strip_runs_before_filled_is_committed(monkeypatch):
    """Write-back order: drop_dead_prefix(row_cache, lead), then filled = chain_start + 1."""
    order = []
    orig = draft_mod.drop_dead_prefix
    _, toks, key = two_row_group(per_seq=True)
    states = [state_with(14, 13, 11, 0), state_with(12, 11, 9, 1)]  # filled != chain_start + 1

    def strip(slot, lead):
        order.append(("strip", [s.filled for s in states]))
        orig(slot, lead)

    monkeypatch.setattr(draft_mod, "drop_dead_prefix", strip)
    loop(states, toks, [12, 10], [9, 9], True, {key: [0, 1]})
    assert order == [("strip", [13, 11]), ("strip", [12, 11])]
    assert [s.filled for s in states] == [12, 10]
    assert [s.cache.current_seq_len for s in states] == [14, 12]


BAD, GOOD = (1, 0), (1, 1)


def first_call(monkeypatch, name, replacement):
    """Replace `draft_mod.name` for its first call only."""
    orig, calls = getattr(draft_mod, name), []

    def once(*args):
        calls.append(1)
        return replacement(*args) if len(calls) == 1 else orig(*args)

    monkeypatch.setattr(draft_mod, name, once)


def bad_then_good(defect, monkeypatch):
    """Group BAD (rows 0, 1) fails by `defect`; group GOOD (rows 2, 3, uniform, chain start
    11) is drafted after it. Returns the states, the per-sequence flag and the warning."""
    states = [state_with(12, 12, 11, 0), state_with(10, 10, 9, 1),
              state_with(12, 12, 11, 2), state_with(12, 12, 11, 3)]
    per_seq = defect in ("front-align", "split")
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
        states[1].cache.set_len(8)  # holds 8 < chain start 9
        want = ("draft group (1, 0): front-alignment refused (chain start 9 is past the 8 "
                "position(s) draft row 1 holds); group skipped")
    else:  # split, after the ragged path aligned the group
        first_call(monkeypatch, "split_draft_cache", lambda batched, g: None)
        want = "draft group (1, 0): the batched draft cache did not split into 2; no drafts"
    return states, per_seq, want


@pytest.mark.rule("group loop: write-back with split and strip, then record drafts")
@pytest.mark.parametrize(
    "defect", ["no row", "no cache", "unbatchable", "set_len", "front-align", "split"])
def test_a_skipped_group_warns_with_its_key_and_the_next_group_still_drafts(defect, monkeypatch):
    states, per_seq, want = bad_then_good(defect, monkeypatch)
    toks = [list(range(13)), list(range(11)), list(range(13)), list(range(13))]
    warnings: list[str] = []
    drafts = loop(states, toks, [12, 10, 12, 12], [9] * 4, per_seq, {BAD: [0, 1], GOOD: [2, 3]},
                  warnings)
    assert warnings == [want]
    assert drafts[0] == [] and drafts[1] == [] and [len(d) for d in drafts[2:]] == [3, 3]
    assert [s.filled for s in states[2:]] == [12, 12]
    assert [s.cache.current_seq_len for s in states[2:]] == [14, 14]


@pytest.mark.rule("Tier A chain", "group loop: write-back with split and strip, then record drafts")
def test_every_tier_a_group_drafts_without_any_cache():
    """Unspecified, chosen: without a block the loop runs the heads-only chain and writes
    nothing back (Tier A never gets a seed from the capture, so only a hand-seeded state
    reaches this)."""
    s = DraftKv(cache=None, filled=11, seed=(11, np.ones(H)))
    drafts = loop([s], [list(range(13))], [12], [9], False, {(1, 11): [0]}, model=TIER_A)
    assert drafts == [propose_chain(TIER_A, np.ones(H), 12, 3, 99, 11, None)]
    assert len(drafts[0]) == 3 and s.filled == 11 and s.cache is None
    states = [DraftKv(None, 11, seed=(11, np.ones(H))), DraftKv(None, 12, seed=(12, np.ones(H)))]
    drafts = loop(states, [list(range(13)), list(range(14))], [12, 13], [9, 9], False,
                  {(1, 0): [0], (1, 1): [1]}, model=TIER_A)
    assert drafts == [propose_chain(TIER_A, np.ones(H), 12, 3, 99, 11, None),
                      propose_chain(TIER_A, np.ones(H), 13, 3, 99, 12, None)]


@pytest.mark.rule("group loop: write-back with split and strip, then record drafts",
                  "draft group loop on the pool, port")
@pytest.mark.parametrize("be", [REF, PORT], ids=["numpy", "torch"])
def test_the_loop_needs_one_entry_per_row(be):
    """Row counts that disagree are malformed, named, on both backends."""
    model = models()[be is REF]
    states = [None, None]
    for toks, lens, budgets in (([[1]], [12, 12], [9, 9]), ([[1], [1]], [12], [9, 9]),
                                ([[1], [1]], [12, 12], [9])):
        got = f"toks ({len(toks)}), cache_lens ({len(lens)}) and budgets ({len(budgets)})"
        with pytest.raises(ValueError, match=rf"^states \(2\), {re.escape(got)} must have one "
                                             r"entry per row$"):
            be.draft_chain(model, {(1, 0): [0, 1]}, states, toks, lens, budgets, 4, False)


# --- the port's loop on its pooled draft KV -------------------------------------------------------

def models(cfg: ModelConfig | None = None):
    return built_model(PORT, cfg), built_model(REF, cfg)


def states_for(be, model, plan):
    """Per row `(C, primed)`: toks of C + 1 tokens; a primed state (filled C, seed at C - 1)
    or a fresh one (no seed)."""
    toks = [[(7 * row + 3 * j + 1) % model.cfg.vocab for j in range(c + 1)]
            for row, (c, _) in enumerate(plan)]
    states = [primed_state(be, model, t) if primed else DraftKv(cache=be.new_draft_cache(model))
              for t, (_, primed) in zip(toks, plan, strict=True)]
    return states, toks


def run_both(plan, w, per_seq, cfg=None, edit=None):
    """The same batch drafted on both backends (`edit(be, states)` first): the drafts and
    warnings equal, every row's state and draft KV the reference's. Returns the reference's
    drafts, warnings, groups and states."""
    out = []
    for be, model in zip((PORT, REF), models(cfg), strict=True):
        states, toks = states_for(be, model, plan)
        if edit is not None:
            edit(be, states)
        lens = [c for c, _ in plan]
        groups = dispatch.draft_groups([1] * len(plan), lens, [True] * len(plan), w, per_seq)
        warnings: list = []
        drafts = be.draft_chain(model, groups, states, toks, lens, [9] * len(plan), w, per_seq,
                                warnings)
        out.append((drafts, warnings, states))
    (pd, pw, ps), (rd, rw, rs) = out
    assert (pd, pw) == (rd, rw)
    assert_same_draft_states(PORT, REF, ps, rs)
    return rd, rw, list(groups), rs


@pytest.mark.rule("draft group loop on the pool, port",
                  "prompt priming, the draft group loop and the MTP step, backend")
@pytest.mark.parametrize("plan, w", [([(3, True), (6, True), (4, True)], 4),
                                     ([(3, True), (5, True)], 3)])
def test_a_ragged_group_under_per_sequence_advance_drafts_every_row(plan, w):
    """C §9.5: one per-row group of rows at different C: front-aligned (the port: lengths
    only), each row drafts `w - u` tokens, no warning; `filled = chain start + 1 = C`, each
    draft KV `chain start + n` long, its capacity the batched one less its lead."""
    drafts, warnings, groups, states = run_both(plan, w, True)
    assert len(groups) == 1 and warnings == []
    assert [len(d) for d in drafts] == [w - 1] * len(plan)
    assert [s.filled for s in states] == [c for c, _ in plan]


@pytest.mark.rule("draft group loop on the pool, port",
                  "prompt priming, the draft group loop and the MTP step, backend")
@pytest.mark.parametrize("plan, lengths", [([(3, False), (5, True), (7, False)], [0, 2, 0]),
                                           ([(3, False)], [0])])
def test_groups_without_a_drafting_row_warn_once_and_later_groups_still_draft(plan, lengths):
    """Scalar keys `(u, C + u - 2)`: the unseeded rows' groups (before and after) draft
    nothing and warn "no row" once per call, into the caller's list (the key of a row at
    C = 3: (1, 2)); the seeded row's group drafts `w - u` tokens."""
    drafts, warnings, groups, _ = run_both(plan, 3, False)
    assert [len(d) for d in drafts] == lengths and groups[0] == (1, 2)
    assert warnings == [WARNINGS["no row"].format(key=(1, 2))]


@pytest.mark.rule("draft group loop on the pool, port")
def test_a_member_without_a_draft_kv_skips_its_group_with_a_warning():
    """A seeded member whose draft KV is gone: its group is skipped ("no cache"), the next
    group drafts."""
    def drop(be, states):
        states[0].cache = None

    drafts, warnings, groups, _ = run_both([(3, True), (5, True)], 3, False, edit=drop)
    assert [len(d) for d in drafts] == [0, 2]
    assert warnings == [WARNINGS["no cache"].format(key=groups[0])]


@pytest.mark.rule("draft group loop on the pool, port",
                  "prompt priming, the draft group loop and the MTP step, backend")
@pytest.mark.parametrize("plan, w, lengths", [([(3, True), (5, True)], 3, [2, 2]),
                                              ([(3, False), (4, True)], 2, [0, 1])])
def test_the_heads_only_model_drafts_without_a_draft_kv(plan, w, lengths):
    """Tier A: no block, no draft KV; each group's chain is the backend's `propose_chain` from
    the heads alone (seeds set by hand: priming stashes none without a block); a group with no
    seeded row warns nothing."""
    cfg = ModelConfig(mtp="heads")

    def seed(be, states):
        rng = np.random.default_rng(4)
        for (c, seeded), state in zip(plan, states, strict=True):
            h = rng.standard_normal(cfg.hidden)
            if seeded:
                state.filled, state.seed = c, (c - 1, to_port(h) if be is PORT else h)

    drafts, warnings, _, _ = run_both([(c, False) for c, _ in plan], w, False, cfg, seed)
    assert [len(d) for d in drafts] == lengths and warnings == []


@pytest.mark.rule("draft group loop on the pool, port")
def test_a_refused_alignment_skips_the_group_with_a_warning():
    """A member whose draft KV holds less than its chain start: the ragged alignment is
    refused (AlignRefusal), warned "front-align", the group skipped."""
    drafts, warnings, _, _ = run_both([(3, True), (6, True)], 3, True,
                                      edit=lambda be, states: be.kv_set_len(states[1].cache, 2))
    assert drafts == [[], []] and len(warnings) == 1
    assert warnings[0].startswith("draft group (1, 0): front-alignment refused (")


@pytest.mark.rule("draft group loop on the pool, port")
def test_an_unbatchable_uniform_group_is_skipped_with_a_warning_and_the_next_group_drafts():
    """Scalar keys: two rows at C = 3 whose draft KVs differ in length cannot be batched
    ("unbatchable", skipped); the row at C = 5 (a later group) still drafts."""
    drafts, warnings, groups, _ = run_both(
        [(3, True), (3, True), (5, True)], 3, False,
        edit=lambda be, states: be.kv_set_len(states[1].cache, 2))
    assert [len(d) for d in drafts] == [0, 0, 2]
    assert warnings == [WARNINGS["unbatchable"].format(key=groups[0])]


@pytest.mark.rule("draft group loop on the pool, port")
def test_a_uniform_group_whose_set_len_is_refused_is_skipped_with_a_warning():
    """Scalar keys: a row at C = 1 drafts from chain start 0; a row at C = 20 whose draft KV
    was replaced by an empty one (capacity 16) cannot be set to its start 19: "set_len"
    refused, warned, its group skipped."""
    def fresh(be, states):
        states[1].cache = be.new_draft_cache(models()[0 if be is PORT else 1])

    drafts, warnings, groups, _ = run_both([(1, True), (20, True)], 3, False, edit=fresh)
    assert [len(d) for d in drafts] == [2, 0] and len(warnings) == 1
    assert warnings[0].startswith(f"draft group {groups[1]}: set_len(19) refused (")


@pytest.mark.rule("draft group loop on the pool, port")
def test_draft_kvs_that_are_not_rows_of_one_pool_are_refused():
    pm = models()[0]
    states, toks = states_for(PORT, pm, [(3, True), (3, True)])
    states[1] = states_for(TorchBackend(dtype="float64"), pm, [(3, True)])[0][0]
    groups = dispatch.draft_groups([1, 1], [3, 3], [True, True], 3, False)
    with pytest.raises(ValueError) as info:
        PORT.draft_chain(pm, groups, states, toks, [3, 3], [9, 9], 3, False)
    assert str(info.value) == (
        "draft KV caches must be rows of one DraftStore (the backend's new_draft_cache)")


@pytest.mark.rule("draft group loop on the pool, port")
def test_a_uniform_group_with_ragged_starts_is_refused_and_its_rows_keep_their_lengths():
    """C §9.3, §10.2: a group drafted without per-sequence advance is set to its first start
    (2) as one length; a member whose start is 4 makes the chain refuse ("desync",
    DispatchRefusal) on both backends, and every member's draft KV keeps the length (3) and
    contents it had, its state untouched."""
    out = []
    for be, model in zip((PORT, REF), models(), strict=True):
        states, toks = states_for(be, model, [(3, True), (5, True)])
        be.kv_set_len(states[1].cache, 3)
        with pytest.raises(DispatchRefusal) as info:
            be.draft_chain(model, {(1, 0): [0, 1]}, states, toks, [3, 5], [9, 9], 3, False, [])
        out.append((str(info.value), states))
    (pm, ps), (rm, rs) = out
    assert pm == rm and "MTP draft KV desync" in pm
    assert [(s.filled, s.seed[0], PORT.cache_len(s.cache)) for s in ps] == [(3, 2, 3), (5, 4, 3)]
    assert_same_draft_states(PORT, REF, ps, rs)


def pool_state(k: np.ndarray, filled: int, seed) -> DraftKv:
    """A draft state whose KV is a row of the port backend's pool holding `k [n, hd]` (the
    capacity the reference's draft KV of `k` has)."""
    cache = PORT.new_draft_cache(models()[0])
    n = len(k)
    cache.store.reserve(n)
    cache.store.kv.k[cache.idx, 0, :n] = to_port(k)
    cache.store.kv.v[cache.idx, 0, :n] = to_port(k)
    cache.store.kv.set_row_len(cache.idx, n)
    cache.current, cache.materialized = n, True
    cache.capacity = ref_draft_kv(MODEL, k).k.capacity_seq_len
    return DraftKv(cache=cache, filled=filled, seed=seed)


@pytest.mark.rule("draft group loop on the pool, port")
@given(case=write_back_groups())
def test_the_backend_group_loop_on_pool_rows_is_the_reference_group_loop(case):
    """`TorchBackend.draft_chain` on rows of its pool against `group_drafting_loop` (u = 1,
    w = n + 1, seeds at the chain starts): the same drafts, warnings and refusals (a uniform
    group whose members hold different lengths is skipped by both; a start past a row's held
    entries refuses the alignment); `filled = start + 1`; each draft KV's length and capacity
    exact, its history bit-exact, its drafted entries within 1e-12."""
    starts, tails, n, per_seq, seed = case
    g = len(starts)
    rng = np.random.default_rng(seed)
    ks = [rng.standard_normal((max(s + t, 1), HD)) for s, t in zip(starts, tails, strict=True)]
    seeds, lasts = rng.standard_normal((g, H)), rng.integers(0, V, g)
    toks = [[0] * s + [int(lasts[r])] for r, s in enumerate(starts)]
    args = ({(1, 0): list(range(g))}, toks, [s + 1 for s in starts], [99] * g, n + 1, per_seq)
    r_states = [DraftKv(cache=ref_draft_kv(MODEL, k), filled=s, seed=(s, seeds[r]))
                for r, (k, s) in enumerate(zip(ks, starts, strict=True))]
    p_states = [pool_state(k, s, (s, to_port(seeds[r])))
                for r, (k, s) in enumerate(zip(ks, starts, strict=True))]
    r_warn: list[str] = []
    p_warn: list[str] = []
    r_out = outcome(REF.draft_chain, models()[1], args[0], r_states, *args[1:], r_warn)
    p_out = outcome(PORT.draft_chain, models()[0], args[0], p_states, *args[1:], p_warn)
    if assert_same_refusal(p_out, r_out, "group loop"):
        assert p_out[1] == r_out[1] and p_warn == r_warn
        assert_same_draft_states(PORT, REF, p_states, r_states)
        for r, (p_st, r_st) in enumerate(zip(p_states, r_states, strict=True)):
            held = held_k(r_st.cache, HD)[: starts[r]]
            assert_bit_exact(PORT.materialize(p_st.cache)["kv"][0][0][0, 0, : len(held)], held,
                             f"row {r}: history")
