"""The torch backend's draft-group loop (`gpu/draft_loop.py`) against the reference's
`group_drafting_loop` (C §9.3) on small explicit batches the Hypothesis property of
test_backend.py rarely builds: groups with no drafting row (warned once per call, later
groups still drafting), a member without a draft KV, the heads-only model, a ragged group
under per-sequence advance (front-aligned as lengths, each row's capacity less its lead), a
group whose alignment is refused (warned, skipped), and the malformed inputs (row counts, draft
KVs that are not rows of one pool). Compared: the drafts, the warnings, every row's state and
draft KV (float64: the chains are the same greedy tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from raggedspec.conformance.backends import assert_close, assert_exact, assert_same_cache
from raggedspec.gpu.backend import TorchBackend
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.dispatch import MtpHiddenCapture
from raggedspec.reference.draft import WARNINGS, DraftKv
from raggedspec.reference.model import ModelConfig

REF = NumpyBackend()
PORT = TorchBackend(dtype="float64")
_MODELS: dict = {}


def models(cfg):
    if cfg not in _MODELS:
        _MODELS[cfg] = (PORT.build_model(cfg), REF.build_model(cfg))
    return _MODELS[cfg]


def states_for(be, model, cfg, plan):
    """Per row `(C, primed)`: toks of C + 1 tokens; a primed state (prompt forward + priming:
    filled C, seed at C - 1) or a fresh one (no seed)."""
    states, toks = [], []
    for row, (c, primed) in enumerate(plan):
        t = [(7 * row + 3 * j + 1) % cfg.vocab for j in range(c + 1)]
        state = DraftKv(cache=be.new_draft_cache(model))
        if primed:
            cap = MtpHiddenCapture()
            cap.arm()
            cache = be.new_target_cache(cfg, cfg.max_seq_len, 1)
            be.forward(model, np.array([t[:-1]]), cache, [0], None, None, cap)
            be.prime_draft_kv([state], cap.take(), [t], 1, model, [])
        states.append(state)
        toks.append(t)
    return states, toks


def run_both(plan, w, per_seq, cfg=None, edit=None):
    """The same batch drafted on both backends: (drafts, warnings, states) per backend."""
    cfg = cfg or ModelConfig()
    out = []
    for be, model in zip((PORT, REF), models(cfg), strict=True):
        states, toks = states_for(be, model, cfg, plan)
        if edit is not None:
            edit(be, states)
        cache_lens = [c for c, _ in plan]
        groups = REF.draft_groups([1] * len(plan), cache_lens, [True] * len(plan), w, per_seq)
        warnings: list = []
        drafts = be.draft_chain(model, groups, states, toks, cache_lens, [9] * len(plan), w,
                                per_seq, warnings)
        out.append((drafts, warnings, states, groups))
    (pd, pw, ps, _), (rd, rw, rs, groups) = out
    assert_exact(pw, rw, "warnings")
    assert_exact(pd, rd, "drafts")
    for i, (a, r) in enumerate(zip(ps, rs, strict=True)):
        assert_exact((a.filled, a.poisoned, None if a.seed is None else a.seed[0]),
                     (r.filled, r.poisoned, None if r.seed is None else r.seed[0]), f"row {i}")
        if r.seed is not None:
            assert_close(PORT.to_numpy(a.seed[1]), r.seed[1], "float64", f"row {i} seed")
        assert (a.cache is None) == (r.cache is None)
        if r.cache is not None:
            assert_same_cache(PORT.materialize(a.cache), REF.materialize(r.cache), "float64",
                              f"row {i} draft KV")
    return rd, rw, groups


@pytest.mark.rule("draft group loop on the pool, port")
def test_groups_without_a_drafting_row_warn_once_and_later_groups_still_draft():
    """Scalar keys `(u, C + u - 2)`: the unseeded rows' groups (before and after) draft
    nothing and warn "no row" once per call; the seeded row's group drafts `w - u` tokens."""
    drafts, warnings, groups = run_both([(3, False), (5, True), (7, False)], 3, False)
    assert [len(d) for d in drafts] == [0, 2, 0]
    assert warnings == [WARNINGS["no row"].format(key=next(iter(groups)))]


@pytest.mark.rule("draft group loop on the pool, port")
def test_a_member_without_a_draft_kv_skips_its_group_with_a_warning():
    """A seeded member whose draft KV is gone: its group is skipped ("no cache"), the next
    group drafts."""
    def drop(be, states):
        states[0].cache = None

    drafts, warnings, groups = run_both([(3, True), (5, True)], 3, False, edit=drop)
    assert [len(d) for d in drafts] == [0, 2]
    assert warnings == [WARNINGS["no cache"].format(key=next(iter(groups)))]


@pytest.mark.rule("draft group loop on the pool, port")
def test_the_heads_only_model_drafts_without_a_draft_kv():
    """Tier A: no block, no draft KV; each group's chain from the heads alone (seeds set by
    hand: priming stashes none without a block); a group with no seeded row warns nothing."""
    cfg = ModelConfig(mtp="heads")

    def seed(plan):
        def edit(be, states):
            rng = np.random.default_rng(4)
            for (c, seeded), state in zip(plan, states, strict=True):
                h = rng.standard_normal(cfg.hidden)
                if seeded:
                    state.filled, state.seed = c, (c - 1, PORT._t(h) if be is PORT else h)
        return edit

    plan = [(3, True), (5, True)]
    drafts, warnings, _ = run_both([(c, False) for c, _ in plan], 3, False, cfg, seed(plan))
    assert [len(d) for d in drafts] == [2, 2] and warnings == []
    plan = [(3, False), (4, True)]
    drafts, warnings, _ = run_both([(c, False) for c, _ in plan], 2, False, cfg, seed(plan))
    assert [len(d) for d in drafts] == [0, 1] and warnings == []


@pytest.mark.rule("draft group loop on the pool, port")
def test_a_ragged_group_under_per_sequence_advance_drafts_every_row():
    """One per-row group of rows at C = 3, 6, 4: front-aligned (lengths only), each row
    `chain_start + n` long afterwards, its capacity the batched one less its lead."""
    drafts, warnings, _ = run_both([(3, True), (6, True), (4, True)], 4, True)
    assert [len(d) for d in drafts] == [3, 3, 3] and warnings == []


@pytest.mark.rule("draft group loop on the pool, port")
def test_a_refused_alignment_skips_the_group_with_a_warning():
    """A member whose draft KV holds less than its chain start: the ragged alignment is
    refused (AlignRefusal), warned "front-align", the group skipped."""
    def cut(be, states):
        be.kv_set_len(states[1].cache, 2)

    drafts, warnings, _ = run_both([(3, True), (6, True)], 3, True, edit=cut)
    assert drafts == [[], []] and len(warnings) == 1
    assert warnings[0].startswith("draft group (1, 0): front-alignment refused (")


@pytest.mark.rule("draft group loop on the pool, port")
def test_malformed_batches_are_refused_alike():
    """Row counts that disagree, and (the port) draft KVs that are not rows of one pool."""
    cfg = ModelConfig()
    pm, rm = models(cfg)
    for toks, lens, budgets in (([], [1], [1]), ([[1]], [], [1]), ([[1]], [1], [])):
        msgs = []
        for be, model in ((PORT, pm), (REF, rm)):
            with pytest.raises(ValueError) as info:
                be.draft_chain(model, {}, [None], toks, lens, budgets, 2, False)
            msgs.append(str(info.value))
        assert msgs[0] == msgs[1] == (f"states (1), toks ({len(toks)}), cache_lens ({len(lens)}) "
                                      f"and budgets ({len(budgets)}) must have one entry per row")
    other = TorchBackend(dtype="float64")
    states, toks = states_for(PORT, pm, cfg, [(3, True), (3, True)])
    stray, _ = states_for(other, pm, cfg, [(3, True)])
    states[1] = stray[0]
    groups = REF.draft_groups([1, 1], [3, 3], [True, True], 3, False)
    with pytest.raises(ValueError) as info:
        PORT.draft_chain(pm, groups, states, toks, [3, 3], [9, 9], 3, False)
    assert str(info.value) == (
        "draft KV caches must be rows of one DraftStore (the backend's new_draft_cache)")


@pytest.mark.rule("draft group loop on the pool, port")
def test_an_unbatchable_uniform_group_is_skipped_with_a_warning_and_the_next_group_drafts():
    """Scalar keys: two rows at C = 3 whose draft KVs differ in length cannot be batched
    ("unbatchable", skipped); the row at C = 5 (a later group) still drafts."""
    def cut(be, states):
        be.kv_set_len(states[1].cache, 2)

    drafts, warnings, groups = run_both([(3, True), (3, True), (5, True)], 3, False, edit=cut)
    assert [len(d) for d in drafts] == [0, 0, 2]
    assert warnings == [WARNINGS["unbatchable"].format(key=next(iter(groups)))]


@pytest.mark.rule("draft group loop on the pool, port")
def test_a_uniform_group_whose_set_len_is_refused_is_skipped_with_a_warning():
    """Scalar keys: a row at C = 1 drafts from chain start 0; a row at C = 20 whose draft KV
    was replaced by an empty one (capacity 16) cannot be set to its start 19: "set_len"
    refused, warned, its group skipped."""
    def fresh(be, states):
        states[1].cache = be.new_draft_cache(models(ModelConfig())[0 if be is PORT else 1])

    drafts, warnings, groups = run_both([(1, True), (20, True)], 3, False, edit=fresh)
    assert [len(d) for d in drafts] == [2, 0] and len(warnings) == 1
    key = list(groups)[1]
    assert warnings[0].startswith(f"draft group {key}: set_len(19) refused (")
