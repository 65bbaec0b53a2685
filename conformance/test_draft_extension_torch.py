"""The torch backend's draft-KV extension (`gpu/draft_loop.py`'s `extend_draft_kvs`, C §7.2,
§16 step 10) against the reference's `extend_draft_kvs` on small explicit batches: a capture
that fails for the whole batch (another rank: every row poisoned with the StepRefusal; a batch
or offsets that do not describe the batch: every row misaligned), no capture, a rank-2 capture,
a row without a state before the others, per-row offsets with spans of different lengths and
captures that end before the committed tokens, nothing to write, a state without a draft KV, a
truncate past the capacity (that row poisoned with the CacheRefusal, the others extended) and
an already poisoned row; and the group loop's chain refused on a uniform group with ragged
starts (the rows' lengths restored). Compared: the warnings, every row's filled, poisoned flag,
seed and draft KV (float64), and the values the rule gives, stated by hand."""

from __future__ import annotations

import numpy as np
import pytest

from raggedspec.conformance.backends import assert_close, assert_exact, assert_same_cache
from raggedspec.gpu.backend import TorchBackend
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.dispatch import MtpHiddenCapture
from raggedspec.reference.draft import EXTEND_MISALIGNED, PRIME_MISALIGNED, DraftKv
from raggedspec.reference.errors import DispatchRefusal
from raggedspec.reference.model import ModelConfig

REF = NumpyBackend()
PORT = TorchBackend(dtype="float64")
CFG = ModelConfig()
_MODELS: dict = {}


def models(cfg=CFG):
    """(port model, reference model) of `cfg`, built once."""
    if cfg not in _MODELS:
        _MODELS[cfg] = (PORT.build_model(cfg), REF.build_model(cfg))
    return _MODELS[cfg]


def toks_of(n, row=0):
    return [(5 * row + 3 * j + 1) % CFG.vocab for j in range(n)]


def primed(be, model, toks):
    """A state primed on `toks` (L tokens): the prompt forward over `toks[:-1]`, then the
    priming: filled L - 1, seed at L - 2, its draft KV L - 1 long."""
    cap = MtpHiddenCapture()
    cap.arm()
    cache = be.new_target_cache(CFG, CFG.max_seq_len, 1)
    be.forward(model, np.array([toks[:-1]]), cache, [0], None, None, cap)
    state = DraftKv(cache=be.new_draft_cache(model))
    be.prime_draft_kv([state], cap.take(), [toks], 1, model, [])
    return state


def extend_both(make, offsets, hidden, toks, batch, cfg=CFG, why=EXTEND_MISALIGNED):
    """The same extension on both backends: `make(be, model)` builds the states, the capture
    is `(offsets, hidden)` (None: no capture). Every row's state and draft KV and the warnings
    compared; returns (port states, reference states, warnings)."""
    out = []
    for be, model in zip((PORT, REF), models(cfg), strict=True):
        states = make(be, model)
        capture = None
        if offsets is not None:
            cap = MtpHiddenCapture()
            cap.arm()
            cap.store_rows(offsets, hidden)
            capture = cap.take()
        warnings: list = []
        if why == EXTEND_MISALIGNED:
            be.extend_draft_kvs(states, capture, toks, batch, model, warnings)
        else:
            be.prime_draft_kv(states, capture, toks, batch, model, warnings)
        out.append((states, warnings))
    (ps, pw), (rs, rw) = out
    assert_exact(pw, rw, "warnings")
    for i, (a, r) in enumerate(zip(ps, rs, strict=True)):
        if r is None:
            assert a is None
            continue
        assert_exact((a.filled, a.poisoned, None if a.seed is None else a.seed[0]),
                     (r.filled, r.poisoned, None if r.seed is None else r.seed[0]), f"row {i}")
        if r.seed is not None:
            assert_close(PORT.to_numpy(a.seed[1]), r.seed[1], "float64", f"row {i} seed")
        assert (a.cache is None) == (r.cache is None)
        if r.cache is not None:
            assert_same_cache(PORT.materialize(a.cache), REF.materialize(r.cache), "float64",
                              f"row {i} draft KV")
    return ps, rs, rw


def hidden_of(*shape, seed=3):
    return np.random.default_rng(seed).standard_normal(shape)


def misaligned(row, why=EXTEND_MISALIGNED):
    return f"row {row}: {why}; draft KV poisoned"


def failed(row, exc):
    return f"row {row}: draft KV extension failed ({exc}); draft KV poisoned"


def two_primed(be, model):
    return [primed(be, model, toks_of(5, 0)), primed(be, model, toks_of(5, 1))]


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_a_capture_of_another_rank_poisons_every_row_with_its_step_refusal():
    """Check 4: a capture of rank 1 or 4 is refused (StepRefusal naming the rank and the
    shape) for every row with a state; each such row is poisoned with the extension's
    warning, and an already poisoned row (check 1) is warned misaligned instead."""
    h = CFG.hidden
    for hidden, shape in ((hidden_of(1, 1, 2, h), [1, 1, 2, h]), (hidden_of(h), [h])):
        def make(be, model):
            states = two_primed(be, model) + [primed(be, model, toks_of(5, 2))]
            states[2].poisoned = True
            return states

        toks = [toks_of(7, r) for r in range(3)]
        ps, _, warnings = extend_both(make, [4], hidden, toks, 3)
        exc = (f"captured hidden has rank {len(shape)} (shape {shape}); "
               f"expected [B,T,H] or [T,H]")
        assert warnings == [failed(0, exc), failed(1, exc), misaligned(2)]
        assert [s.poisoned for s in ps] == [True, True, True]
        assert [s.filled for s in ps] == [4, 4, 4]


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_a_rank_two_capture_is_a_batch_of_one():
    """Check 4: `[T,H]` is `[1,T,H]`: a primed row (filled 4) extended by a 2-column capture
    at 4 with L = 7 writes positions 4 and 5 (filled 6) and moves the seed to 5."""
    hidden = hidden_of(2, CFG.hidden)

    def make(be, model):
        return [primed(be, model, toks_of(5))]

    ps, _, warnings = extend_both(make, [4], hidden, [toks_of(7)], 1)
    assert warnings == []
    (s,) = ps
    assert (s.filled, s.poisoned, s.seed[0], PORT.kv_len(s.cache)) == (6, False, 5, 6)
    assert_close(PORT.to_numpy(s.seed[1]), hidden[1], "float64", "seed hidden")


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_a_capture_that_does_not_describe_the_batch_poisons_every_row_as_misaligned():
    """Checks 5 and 6, each alone: a one-row capture for a batch of 2 (its one offset
    describes any batch), and a 2-row capture whose 3 offsets describe a batch of 3, not 2:
    every row returns False, poisoned with the misaligned warning (the priming's text when
    priming), nothing extended."""
    h = CFG.hidden
    for offsets, hidden, why in (([4], hidden_of(1, 2, h), EXTEND_MISALIGNED),
                                 ([4, 4, 5], hidden_of(2, 2, h), EXTEND_MISALIGNED),
                                 ([4, 4, 5], hidden_of(2, 2, h), PRIME_MISALIGNED)):
        toks = [toks_of(7, r) for r in range(2)]
        ps, _, warnings = extend_both(two_primed, offsets, hidden, toks, 2, why=why)
        assert warnings == [misaligned(0, why), misaligned(1, why)]
        assert [(s.filled, s.poisoned, s.seed[0], PORT.kv_len(s.cache)) for s in ps] == [
            (4, True, 3, 4), (4, True, 3, 4)]


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_no_capture_leaves_every_row_as_it_was_but_a_poisoned_row_is_still_warned():
    """Checks 1-2: without a capture a row is fine (True, untouched, no warning); a poisoned
    row returns False first and is warned misaligned again."""
    def make(be, model):
        states = two_primed(be, model)
        states[1].poisoned = True
        return states

    ps, _, warnings = extend_both(make, None, None, [toks_of(7, r) for r in range(2)], 2)
    assert warnings == [misaligned(1)]
    assert [(s.filled, s.poisoned, s.seed[0], PORT.kv_len(s.cache)) for s in ps] == [
        (4, False, 3, 4), (4, True, 3, 4)]


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_the_rows_after_a_row_without_a_state_are_extended():
    """A row without a state is skipped, the rows after it are still extended."""
    hidden = hidden_of(3, 2, CFG.hidden)

    def make(be, model):
        return [None] + two_primed(be, model)

    toks = [toks_of(7, r) for r in range(3)]
    ps, _, warnings = extend_both(make, [4], hidden, toks, 3)
    assert warnings == []
    assert [(s.filled, s.seed[0], PORT.kv_len(s.cache)) for s in ps[1:]] == [(6, 5, 6)] * 2
    for r in (1, 2):
        assert_close(PORT.to_numpy(ps[r].seed[1]), hidden[r, 1], "float64", f"row {r} seed")


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_per_row_offsets_spans_of_different_lengths_and_a_capture_ending_early():
    """Checks 7-13 per row from its own offset: row 0 (filled 4, off 4, T 3, L 8) writes
    `[4, 7)` and seeds at 6; row 1 (filled 6, off 6, L 11) writes `[6, 9)`, its capture
    ending before `L - 1 = 10`, so its seed (at 9, outside `[6, 9)`) stays at 5. Each row
    grows by its span only: both draft KVs keep capacity 16."""
    hidden = hidden_of(2, 3, CFG.hidden)

    def make(be, model):
        return [primed(be, model, toks_of(5, 0)), primed(be, model, toks_of(7, 1))]

    ps, _, warnings = extend_both(make, [4, 6], hidden, [toks_of(8, 0), toks_of(11, 1)], 2)
    assert warnings == []
    assert [(s.filled, s.poisoned, s.seed[0], PORT.kv_len(s.cache),
             PORT.materialize(s.cache)["capacity"]) for s in ps] == [
        (7, False, 6, 7, [16]), (9, False, 5, 9, [16])]
    assert_close(PORT.to_numpy(ps[0].seed[1]), hidden[0, 2], "float64", "row 0 seed")


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_nothing_to_write_leaves_the_row_fine_and_its_draft_kv_untouched():
    """Check 10 (`hi <= lo`): a row filled past its draft KV's capacity (20 of 16) with a
    capture at 20 and L = 21 has `lo = hi = 20`: True, no truncate (so no refusal), nothing
    written, filled kept; a primed row (filled 4) whose capture `[2, 4)` ends at its draft
    KV's end only moves its seed to 3 (`L = 5`)."""
    h = CFG.hidden

    def full(be, model):
        return [DraftKv(cache=be.new_draft_cache(model), filled=20)]

    ps, _, warnings = extend_both(full, [20], hidden_of(1, 2, h), [toks_of(21)], 1)
    assert warnings == []
    (s,) = ps
    assert (s.filled, s.poisoned, s.seed, PORT.kv_len(s.cache)) == (20, False, None, 0)
    hidden = hidden_of(1, 2, h)
    ps, _, warnings = extend_both(lambda be, m: [primed(be, m, toks_of(5))], [2], hidden,
                                  [toks_of(5)], 1)
    assert warnings == []
    (s,) = ps
    assert (s.filled, s.poisoned, s.seed[0], PORT.kv_len(s.cache)) == (4, False, 3, 4)
    assert_close(PORT.to_numpy(s.seed[1]), hidden[0, 1], "float64", "seed")


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_a_state_without_a_draft_kv_only_advances_filled():
    """Check 11: a state of the block model whose cache is None (filled 4), a capture `[4, 6)`
    and L = 7: True, filled 6, the seed moved to 5, nothing else."""
    hidden = hidden_of(1, 2, CFG.hidden)

    def make(be, model):
        return [DraftKv(cache=None, filled=4)]

    ps, _, warnings = extend_both(make, [4], hidden, [toks_of(7)], 1)
    assert warnings == []
    (s,) = ps
    assert (s.filled, s.poisoned, s.seed[0], s.cache) == (6, False, 5, None)


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_a_refused_truncate_poisons_that_row_only_and_stays_poisoned():
    """Check 12: row 0 filled 20 on a draft KV of capacity 16, with something to write
    (`[20, 22)`): `set_len(20)` is refused, the CacheRefusal "MTP draft KV truncate to 20
    failed: ..." poisons it with the extension's warning; row 1 (primed, filled 4) is
    extended. The next extension finds row 0 poisoned: misaligned, nothing written."""
    hidden = hidden_of(2, 2, CFG.hidden)
    toks = [toks_of(23, 0), toks_of(7, 1)]

    def make(be, model):
        return [DraftKv(cache=be.new_draft_cache(model), filled=20),
                primed(be, model, toks_of(5, 1))]

    ps, _, warnings = extend_both(make, [20, 4], hidden, toks, 2)
    exc = ("MTP draft KV truncate to 20 failed: set_len(20) exceeds current capacity 16 "
           "(first cached 0)")
    assert warnings == [failed(0, exc)]
    assert ps[0].poisoned is True and ps[1].poisoned is False
    assert [(s.filled, PORT.kv_len(s.cache)) for s in ps] == [(20, 0), (6, 6)]

    def twice(be, model):
        states = make(be, model)
        cap = MtpHiddenCapture()
        cap.arm()
        cap.store_rows([20, 4], hidden)
        be.extend_draft_kvs(states, cap.take(), toks, 2, model, [])
        return states

    ps, _, warnings = extend_both(twice, [20, 6], hidden, [toks_of(23, 0), toks_of(9, 1)], 2)
    assert warnings == [misaligned(0)]
    assert [(s.filled, s.poisoned) for s in ps] == [(20, True), (8, False)]


@pytest.mark.rule("draft group loop on the pool, port")
def test_a_uniform_group_with_ragged_starts_is_refused_and_its_rows_keep_their_lengths():
    """C §9.3, §10.2: a group drafted without per-sequence advance is set to its first start
    (2) as one length; a member whose start is 4 makes the chain refuse ("desync",
    DispatchRefusal) on both backends, and every member's draft KV keeps the length (3) and
    contents it had, its state untouched."""
    out = []
    for be, model in zip((PORT, REF), models(), strict=True):
        toks = [toks_of(4, 0), toks_of(6, 1)]
        states = [primed(be, model, t) for t in toks]
        be.kv_set_len(states[1].cache, 3)
        with pytest.raises(DispatchRefusal) as info:
            be.draft_chain(model, {(1, 0): [0, 1]}, states, toks, [3, 5], [9, 9], 3, False, [])
        out.append((str(info.value), states))
    (pm, ps), (rm, rs) = out
    assert pm == rm and "MTP draft KV desync" in pm
    assert [(s.filled, s.seed[0], PORT.kv_len(s.cache)) for s in ps] == [(3, 2, 3), (5, 4, 3)]
    for i, (a, r) in enumerate(zip(ps, rs, strict=True)):
        assert_same_cache(PORT.materialize(a.cache), REF.materialize(r.cache), "float64",
                          f"row {i} draft KV")
