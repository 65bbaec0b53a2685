"""The draft KV on the torch port: its pooled storage (`gpu.draft_store`: every sequence's draft
KV a row of one buffer, C §7.1, §9.3) and its extension (C §7.2, §7.4, §16 step 10) against the
reference: `extend_draft_kvs` and `prime_draft_kv` through both backends on one body (every
row's filled, poisoned flag, seed and draft KV and the warnings compared, and the values the
rule gives stated by hand), and the port's batched tensor side `gpu.draft.extend_draft_kv_rows`
(many rows with different spans in one masked scatter) against `extend_draft_kv_row` row by row,
with its own refusals and boundaries.

Policy (float64): positions, lengths, flags and warnings exact; seeds and written pairs within
1e-12; the history a write leaves alone bit for bit (`gpu.testing`, `conformance/backends.py`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given

import gc

import raggedspec.gpu.draft as port
import raggedspec.gpu.draft_store as draft_store
from raggedspec.conformance.backends import assert_close
from raggedspec.conformance.helpers import assert_same_draft_states, draft_pool, held_k
from raggedspec.conformance.helpers import built_model, primed_state, ref_draft_kv
from raggedspec.conformance.strategies import extension_batches
from raggedspec.gpu.backend import TorchBackend
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.draft_store import DraftStore, PoolKv
from raggedspec.gpu.model import TinyModel as PortModel
from raggedspec.gpu.testing import DEVICE, assert_bit_exact, assert_close64, to_port
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.dispatch import CaptureOffsets, MtpHiddenCapture
from raggedspec.reference.draft import EXTEND_MISALIGNED, PRIME_MISALIGNED, DraftKv
from raggedspec.reference.cache import DRAFT_CACHE_CAPACITY
from raggedspec.reference.draft import extend_draft_kv_row
from raggedspec.reference.errors import CacheRefusal
from raggedspec.reference.model import ModelConfig

REF = NumpyBackend()
PORT = TorchBackend(str(DEVICE), "float64")
CFG = ModelConfig()
H, V, HD = CFG.hidden, CFG.vocab, CFG.head_dim
def models(cfg=CFG):
    return built_model(PORT, cfg), built_model(REF, cfg)


def toks_of(n, row=0):
    return [(5 * row + 3 * j + 1) % V for j in range(n)]


def hidden_of(*shape, seed=3):
    return np.random.default_rng(seed).standard_normal(shape)


def misaligned(row, why=EXTEND_MISALIGNED):
    return f"row {row}: {why}; draft KV poisoned"


def failed(row, exc):
    return f"row {row}: draft KV extension failed ({exc}); draft KV poisoned"


def two_primed(be, model):
    return [primed_state(be, model, toks_of(5, 0)), primed_state(be, model, toks_of(5, 1))]


def extend_both(make, offsets, hidden, toks, batch, why=EXTEND_MISALIGNED):
    """The same extension (priming when `why` is the priming's text) on both backends:
    `make(be, model)` builds the states, the capture is `(offsets, hidden)` (None: no
    capture). The warnings and every row's state and draft KV compared; returns (port states,
    warnings)."""
    out = []
    for be, model in zip((PORT, REF), models(), strict=True):
        states = make(be, model)
        capture = None
        if offsets is not None:
            cap = MtpHiddenCapture()
            cap.arm()
            cap.store_rows(offsets, hidden)
            capture = cap.take()
        warnings: list = []
        run = be.extend_draft_kvs if why == EXTEND_MISALIGNED else be.prime_draft_kv
        run(states, capture, toks, batch, model, warnings)
        out.append((states, warnings))
    (ps, pw), (rs, rw) = out
    assert pw == rw, (pw, rw)
    assert_same_draft_states(PORT, REF, ps, rs)
    return ps, rw


def summary(states):
    return [(s.filled, s.poisoned, None if s.seed is None else s.seed[0],
             None if s.cache is None else PORT.cache_len(s.cache)) for s in states]


# --- extend_draft_kvs and prime_draft_kv on both backends ---------------------------------------


@pytest.mark.rule("extend after the verify forward; Ok(false) / Err poison",
                  "prompt priming, the draft group loop and the MTP step, backend")
def test_an_extension_after_priming_writes_the_committed_pairs():
    """C §7.2: a state primed on 5 tokens (filled 4), then a decode step of 2 tokens at offset
    `filled` committing both (L = 7): the draft KV holds `L - 1 = 6` entries, filled 6, the
    seed at `L - 2 = 5`, no warning."""
    hidden = hidden_of(1, 2, H, seed=7)
    ps, warnings = extend_both(lambda be, m: [primed_state(be, m, [5, 1, 8, 3, 2])], [4],
                               hidden, [[5, 1, 8, 3, 2, 6, 4]], 1)
    assert warnings == [] and summary(ps) == [(6, False, 5, 6)]
    assert_close(PORT.to_numpy(ps[0].seed[1]), hidden[0, 1], "float64", "seed hidden")


@pytest.mark.rule("prompt-time priming", "extend_draft_kv_row tensor side, port",
                  "prompt priming, the draft group loop and the MTP step, backend")
@pytest.mark.parametrize("why", [PRIME_MISALIGNED, EXTEND_MISALIGNED], ids=["prime", "extend"])
@pytest.mark.parametrize("off", [2, 3])
def test_a_capture_past_a_fresh_draft_kv_poisons_it_with_its_own_text(why, off):
    """C §7.2, §7.4: a capture that does not start at a fresh draft KV's end (offset 2 or 3
    against filled 0) poisons the row and warns into the caller's list, priming with the
    prefix-cache text, the step's extension with its own; nothing is written."""
    ps, warnings = extend_both(lambda be, m: [DraftKv(cache=be.new_draft_cache(m))], [off],
                               hidden_of(1, 2, H, seed=2), [[1, 2, 3, 4]], 1, why)
    assert warnings == [misaligned(0, why)] and summary(ps) == [(0, True, None, 0)]


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_a_capture_of_another_rank_poisons_every_row_with_its_step_refusal():
    """Check 4: a capture of rank 1 or 4 is refused (StepRefusal naming the rank and the
    shape) for every row with a state; each such row is poisoned with the extension's
    warning, and an already poisoned row (check 1) is warned misaligned instead."""
    for hidden, shape in ((hidden_of(1, 1, 2, H), [1, 1, 2, H]), (hidden_of(H), [H])):
        def make(be, model):
            states = two_primed(be, model) + [primed_state(be, model, toks_of(5, 2))]
            states[2].poisoned = True
            return states

        ps, warnings = extend_both(make, [4], hidden, [toks_of(7, r) for r in range(3)], 3)
        exc = f"captured hidden has rank {len(shape)} (shape {shape}); expected [B,T,H] or [T,H]"
        assert warnings == [failed(0, exc), failed(1, exc), misaligned(2)]
        assert [(s.filled, s.poisoned) for s in ps] == [(4, True)] * 3


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_a_rank_two_capture_is_a_batch_of_one():
    """Check 4: `[T,H]` is `[1,T,H]`: a primed row (filled 4) extended by a 2-column capture
    at 4 with L = 7 writes positions 4 and 5 (filled 6) and moves the seed to 5."""
    hidden = hidden_of(2, H)
    ps, warnings = extend_both(lambda be, m: [primed_state(be, m, toks_of(5))], [4], hidden,
                               [toks_of(7)], 1)
    assert warnings == [] and summary(ps) == [(6, False, 5, 6)]
    assert_close(PORT.to_numpy(ps[0].seed[1]), hidden[1], "float64", "seed hidden")


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_a_capture_that_does_not_describe_the_batch_poisons_every_row_as_misaligned():
    """Checks 5 and 6, each alone: a one-row capture for a batch of 2 (its one offset
    describes any batch), and a 2-row capture whose 3 offsets describe a batch of 3, not 2:
    every row returns False, poisoned with the misaligned warning (the priming's text when
    priming), nothing extended."""
    for offsets, hidden, why in (([4], hidden_of(1, 2, H), EXTEND_MISALIGNED),
                                 ([4, 4, 5], hidden_of(2, 2, H), EXTEND_MISALIGNED),
                                 ([4, 4, 5], hidden_of(2, 2, H), PRIME_MISALIGNED)):
        toks = [toks_of(7, r) for r in range(2)]
        ps, warnings = extend_both(two_primed, offsets, hidden, toks, 2, why)
        assert warnings == [misaligned(0, why), misaligned(1, why)]
        assert summary(ps) == [(4, True, 3, 4)] * 2


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_no_capture_leaves_every_row_as_it_was_but_a_poisoned_row_is_still_warned():
    """Checks 1-2: without a capture a row is fine (True, untouched, no warning); a poisoned
    row returns False first and is warned misaligned again."""
    def make(be, model):
        states = two_primed(be, model)
        states[1].poisoned = True
        return states

    ps, warnings = extend_both(make, None, None, [toks_of(7, r) for r in range(2)], 2)
    assert warnings == [misaligned(1)]
    assert summary(ps) == [(4, False, 3, 4), (4, True, 3, 4)]


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_the_rows_after_a_row_without_a_state_are_extended():
    hidden = hidden_of(3, 2, H)
    ps, warnings = extend_both(lambda be, m: [None] + two_primed(be, m), [4], hidden,
                               [toks_of(7, r) for r in range(3)], 3)
    assert warnings == [] and [(s.filled, s.seed[0], PORT.cache_len(s.cache)) for s in ps[1:]] == \
        [(6, 5, 6)] * 2
    for r in (1, 2):
        assert_close(PORT.to_numpy(ps[r].seed[1]), hidden[r, 1], "float64", f"row {r} seed")


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_per_row_offsets_spans_of_different_lengths_and_a_capture_ending_early():
    """Checks 7-13 per row from its own offset: row 0 (filled 4, off 4, T 3, L 8) writes
    `[4, 7)` and seeds at 6; row 1 (filled 6, off 6, L 11) writes `[6, 9)`, its capture
    ending before `L - 1 = 10`, so its seed (at 9, outside `[6, 9)`) stays at 5. Each row
    grows by its span only: both draft KVs keep capacity 16."""
    hidden = hidden_of(2, 3, H)
    ps, warnings = extend_both(
        lambda be, m: [primed_state(be, m, toks_of(5, 0)), primed_state(be, m, toks_of(7, 1))],
        [4, 6], hidden, [toks_of(8, 0), toks_of(11, 1)], 2)
    assert warnings == [] and summary(ps) == [(7, False, 6, 7), (9, False, 5, 9)]
    assert [PORT.materialize(s.cache)["capacity"] for s in ps] == [[16], [16]]
    assert_close(PORT.to_numpy(ps[0].seed[1]), hidden[0, 2], "float64", "row 0 seed")


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_nothing_to_write_leaves_the_row_fine_and_its_draft_kv_untouched():
    """Check 10 (`hi <= lo`): a row filled past its draft KV's capacity (20 of 16) with a
    capture at 20 and L = 21 has `lo = hi = 20`: True, no truncate (so no refusal), nothing
    written, filled kept; a primed row (filled 4) whose capture `[2, 4)` ends at its draft
    KV's end only moves its seed to 3 (`L = 5`)."""
    ps, warnings = extend_both(lambda be, m: [DraftKv(cache=be.new_draft_cache(m), filled=20)],
                               [20], hidden_of(1, 2, H), [toks_of(21)], 1)
    assert warnings == [] and summary(ps) == [(20, False, None, 0)]
    hidden = hidden_of(1, 2, H)
    ps, warnings = extend_both(lambda be, m: [primed_state(be, m, toks_of(5))], [2], hidden,
                               [toks_of(5)], 1)
    assert warnings == [] and summary(ps) == [(4, False, 3, 4)]
    assert_close(PORT.to_numpy(ps[0].seed[1]), hidden[0, 1], "float64", "seed")


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_a_state_without_a_draft_kv_only_advances_filled():
    """Check 11: a state of the block model whose cache is None (filled 4), a capture `[4, 6)`
    and L = 7: True, filled 6, the seed moved to 5, nothing else."""
    ps, warnings = extend_both(lambda be, m: [DraftKv(cache=None, filled=4)], [4],
                               hidden_of(1, 2, H), [toks_of(7)], 1)
    assert warnings == [] and summary(ps) == [(6, False, 5, None)]


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_a_refused_truncate_poisons_that_row_only_and_stays_poisoned():
    """Check 12: row 0 filled 20 on a draft KV of capacity 16, with something to write
    (`[20, 22)`): `set_len(20)` is refused, the CacheRefusal "MTP draft KV truncate to 20
    failed: ..." poisons it with the extension's warning; row 1 (primed, filled 4) is
    extended. The next extension finds row 0 poisoned: misaligned, nothing written."""
    hidden = hidden_of(2, 2, H)
    toks = [toks_of(23, 0), toks_of(7, 1)]

    def make(be, model):
        return [DraftKv(cache=be.new_draft_cache(model), filled=20),
                primed_state(be, model, toks_of(5, 1))]

    ps, warnings = extend_both(make, [20, 4], hidden, toks, 2)
    assert warnings == [failed(0, "MTP draft KV truncate to 20 failed: set_len(20) exceeds "
                                  "current capacity 16 (first cached 0)")]
    assert [(s.filled, s.poisoned, PORT.cache_len(s.cache)) for s in ps] == [(20, True, 0),
                                                                          (6, False, 6)]

    def twice(be, model):
        states = make(be, model)
        cap = MtpHiddenCapture()
        cap.arm()
        cap.store_rows([20, 4], hidden)
        be.extend_draft_kvs(states, cap.take(), toks, 2, model, [])
        return states

    ps, warnings = extend_both(twice, [20, 6], hidden, [toks_of(23, 0), toks_of(9, 1)], 2)
    assert warnings == [misaligned(0)]
    assert [(s.filled, s.poisoned) for s in ps] == [(20, True), (8, False)]


# --- the port's batched tensor side: extend_draft_kv_rows ---------------------------------------


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
@given(case=extension_batches())
def test_extend_draft_kv_rows_is_extend_draft_kv_row_for_every_row_at_once(case):
    """Reference: `extend_draft_kv_row` row by row. Port: one `extend_draft_kv_rows` call for
    all rows (their (lo, hi) differ: masked scatter) at shuffled pool rows, the reference's
    misaligned rows left out. Same filled and held lengths; draft KV history bit-exact,
    written pairs 1e-12; V == K; the extra pool row untouched."""
    t, spec, order, seed = case
    model = models()[1]
    r_n = len(spec)
    rng = np.random.default_rng(seed)
    ks = [rng.standard_normal((f + tail, HD)) for f, tail, _, _ in spec]
    hidden = rng.standard_normal((r_n, t, H))
    toks = [rng.integers(0, V, big_l).tolist() for *_, big_l in spec]
    offs = [off for _, _, off, _ in spec]
    capture = (CaptureOffsets(offs), hidden)
    states = [DraftKv(cache=ref_draft_kv(model, k), filled=f)
              for k, (f, *_rest) in zip(ks, spec, strict=True)]
    verdicts = [extend_draft_kv_row(s, capture, toks[i], i, r_n, model)
                for i, s in enumerate(states)]
    # the backend's plan per row: write [lo, hi) where the reference found the capture contiguous
    lo = [max(f, off) for (f, *_), off in zip(spec, offs, strict=True)]
    hi = [min(off + t, max(len(x) - 1, 0)) for off, x in zip(offs, toks, strict=True)]
    write = [bool(v) and h > lo_ for v, lo_, h in zip(verdicts, lo, hi, strict=True)]
    slots = [None] * (r_n + 1)
    for j, k in enumerate(ks + [rng.standard_normal((5, HD))]):
        slots[order[j]] = k
    pool = draft_pool(slots)
    before = pool.clone()
    rows = torch.tensor(order[:r_n])
    tokens = np.zeros((r_n, max(1, max(len(x) for x in toks))), dtype=np.int64)
    for i, x in enumerate(toks):
        tokens[i, : len(x)] = x
    port.extend_draft_kv_rows(models()[0].mtp, pool, to_port(hidden), offs, lo, hi, tokens, rows,
                              write)
    for i, s in enumerate(states):
        if write[i]:
            assert hi[i] == s.filled
        k_row, v_row = pool.row(int(rows[i]))
        assert k_row.shape[1] == s.cache.current_seq_len
        assert_bit_exact(v_row, k_row, "V == K")
        lo_i = lo[i] if write[i] else k_row.shape[1]
        assert_bit_exact(k_row[0, :lo_i], held_k(s.cache, HD)[:lo_i], f"row {i}: history")
        assert_close64(k_row[0, lo_i:], held_k(s.cache, HD)[lo_i:], what=f"row {i}: written")
    extra = order[r_n]
    assert int(pool.lens[extra]) == 5 and torch.equal(pool.k[extra, :, :5], before.k[extra, :, :5])


def pool(n_rows: int, held: int = 2) -> RaggedKv:
    rng = np.random.default_rng(7)
    return draft_pool([rng.standard_normal((held, HD)) for _ in range(n_rows)])


def extend(kv, off, lo, hi, tokens, hidden=None, rows=None, write=None, block=None,
           hidden_rows=None):
    if hidden is None:
        hidden = to_port(np.random.default_rng(2).standard_normal((len(lo), 6, H)))
    port.extend_draft_kv_rows(block or models()[0].mtp, kv, hidden, off, lo, hi, tokens, rows,
                              write, hidden_rows)


def toks(r_n: int, width: int = 8) -> torch.Tensor:
    return torch.arange(r_n * width).reshape(r_n, width) % V


def refuses(exc, text, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert str(info.value) == text


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_extend_draft_kv_rows_reads_the_capture_rows_it_is_given():
    """`hidden_rows` picks each row's capture from a wider hidden: the same keys and lengths
    as the rows copied out first; a capture row outside the hidden is refused before any
    change."""
    rng = np.random.default_rng(5)
    wide = to_port(rng.standard_normal((4, 6, H)))
    spans = (torch.tensor([4, 2]), torch.tensor([4, 2]), torch.tensor([6, 5]))
    picked, copied = pool(2, held=4), pool(2, held=4)
    extend(picked, *spans, toks(2), wide, hidden_rows=[3, 1])
    extend(copied, *spans, toks(2), wide[[3, 1]])
    assert picked.lens.tolist() == copied.lens.tolist() == [6, 5]
    assert_bit_exact(picked.k, copied.k, "K")
    assert_bit_exact(picked.v, copied.v, "V")
    before = picked.clone()
    refuses(ValueError, f"hidden (4, 6, {H}), tokens (2, 8), off/lo/hi/rows (2, 2, 2, 2) must "
            "all have one entry per row", extend, picked, *spans, toks(2), wide,
            hidden_rows=[4, 1])
    assert picked.lens.tolist() == [6, 5] and torch.equal(picked.k, before.k)


@pytest.mark.rule("extend_draft_kv_row tensor side, port")
def test_extend_draft_kv_rows_writes_nothing_past_hi_and_refuses_a_truncate_past_capacity():
    """Row 0 writes 1 pair at 4, row 1 writes 4 pairs at 2, in one call (a masked scatter):
    nothing past either row's `hi` changes; a truncate past the capacity is refused before
    any length changes."""
    rng = np.random.default_rng(3)
    kv = draft_pool([rng.standard_normal((4, HD)), rng.standard_normal((2, HD))])
    before = kv.clone()
    hidden = to_port(rng.standard_normal((2, 6, H)))
    extend(kv, torch.tensor([4, 2]), torch.tensor([4, 2]), torch.tensor([5, 6]), toks(2),
           hidden)
    assert kv.lens.tolist() == [5, 6]
    assert torch.equal(kv.k[0, :, 5:], before.k[0, :, 5:])
    assert torch.equal(kv.k[1, :, 6:], before.k[1, :, 6:])
    with pytest.raises(CacheRefusal, match="MTP draft KV truncate to 17 failed"):
        extend(kv, torch.tensor([17, 0]), torch.tensor([17, 0]), torch.tensor([18, 0]),
               torch.zeros((2, 20), dtype=torch.int64), hidden)
    assert kv.lens.tolist() == [5, 6]


@pytest.mark.rule("draft chain and extension refusals, port")
def test_extension_token_refusals_on_the_host_and_on_the_device():
    for bad in ([[0, -1]], [[0, V]]):
        for given_as in (np.asarray(bad), torch.tensor(bad)):
            refuses(ValueError, f"tokens must be in [0, {V})", extend, pool(1), [0], [2], [3],
                    given_as)
    kv = pool(1)
    extend(kv, [0], [2], [3], np.array([[0, 1, 2, V - 1]]))  # V - 1 is a token
    assert kv.host_lens().tolist() == [3]
    kv = pool(1)
    extend(kv, [0], [2], [3], torch.tensor([[0, 1, 2, V - 1]], dtype=torch.int32))
    assert kv.host_lens().tolist() == [3]


@pytest.mark.rule("draft chain and extension refusals, port")
def test_extension_shape_refusals_break_one_condition_each():
    hid = to_port(np.zeros((2, 6, H)))
    msg = "hidden {}, tokens {}, off/lo/hi/rows ({}, 2, {}, {}) must all have one entry per row"
    t2 = toks(2)
    cases = [  # (hidden, tokens, off, hi, rows) -> message values
        ((hid, t2, [0], [3, 3], None), ((2, 6, H), (2, 8), 1, 2, 2)),
        ((hid, t2, [0, 0], [3], None), ((2, 6, H), (2, 8), 2, 1, 2)),
        ((hid, t2, [0, 0], [3, 3], [0]), ((2, 6, H), (2, 8), 2, 2, 1)),
        ((hid[0], t2, [0, 0], [3, 3], None), ((6, H), (2, 8), 2, 2, 2)),
        ((hid[:1], t2, [0, 0], [3, 3], None), ((1, 6, H), (2, 8), 2, 2, 2)),
        ((hid, t2[0], [0, 0], [3, 3], None), ((2, 6, H), (8,), 2, 2, 2)),
        ((hid, t2[:1], [0, 0], [3, 3], None), ((2, 6, H), (1, 8), 2, 2, 2)),
    ]
    for (hidden, tokens, off, hi, rows), vals in cases:
        refuses(ValueError, msg.format(*vals), extend, pool(2), off, [2, 2], hi, tokens, hidden,
                rows)
    refuses(ValueError, "write mask of 1 for 2 rows",
            extend, pool(2), [0, 0], [2, 2], [3, 3], t2, write=[True])


@pytest.mark.rule("draft chain and extension refusals, port")
def test_extension_span_refusals_and_boundaries():
    msg = "extension spans lo {}, hi {} lie outside the capture (off {}, T 6) or the tokens ({})"
    for off, lo, hi, width in (([3], [2], [4], 8), ([0], [2], [7], 8), ([0], [2], [5], 5)):
        refuses(ValueError, msg.format(lo, hi, off, width), extend, pool(1), off, lo, hi,
                toks(1, width))
    kv = pool(1)
    extend(kv, [0], [2], [6], toks(1, 7))  # hi == off + T and hi + 1 == L: both in
    assert kv.host_lens().tolist() == [6]
    kv = pool(2)  # a row with hi < lo (and lo < off) writes nothing, beside one that writes
    before = kv.clone()
    extend(kv, [3, 0], [2, 2], [1, 4], toks(2))
    assert kv.host_lens().tolist() == [2, 4]
    assert torch.equal(kv.k[0], before.k[0])
    kv = pool(2)  # a row that writes nothing is not read, whatever its lo and hi
    extend(kv, [0, 0], [2, -3], [4, -5], toks(2))
    assert kv.host_lens().tolist() == [4, 2]
    assert torch.equal(kv.k[1], before.k[1])
    kv = pool(1)
    extend(kv, [0], [3], [2], toks(1))  # nothing to write: the row is untouched
    assert kv.host_lens().tolist() == [2]


@pytest.mark.rule("draft chain and extension refusals, port")
def test_extension_at_the_capacity_grows_the_row():
    kv = pool(1, held=16)  # capacity 16, full
    extend(kv, [16], [16], [17], toks(1, 20))
    assert (kv.host_lens().tolist(), kv.capacity > 16) == ([17], True)
    refuses(CacheRefusal, "MTP draft KV truncate to 17 failed: set_len(17) exceeds current "
            "capacity 16 (first cached 0)", extend, pool(1, held=16), [17], [17], [18],
            toks(1, 20))


@pytest.mark.rule("draft chain and extension refusals, port")
def test_extension_into_a_float32_pool_from_a_float32_capture():
    """The pool keeps its dtype (the K is cast to it) and a float32 capture is fused in the
    block's dtype: the written K equals the float64 path's, rounded once to float32."""
    hidden = np.random.default_rng(5).standard_normal((1, 6, H))
    k64 = pool(1)
    extend(k64, [0], [2], [5], toks(1), to_port(hidden))
    base = pool(1)
    k32 = RaggedKv.from_rows([base.k[0, :, :2].float()], [base.v[0, :, :2].float()], 4096, 16)
    extend(k32, [0], [2], [5], toks(1), to_port(hidden, torch.float32))
    assert k32.k.dtype == torch.float32
    want, got = k64.k[0, :, 2:5].float(), k32.k[0, :, 2:5]
    assert torch.equal(got, want) or float((got - want).abs().max()) <= 1e-6 * float(
        want.abs().max())


@pytest.mark.rule("draft chain and extension refusals, port")
def test_extension_past_the_rope_table_grows_the_table():
    """A fresh model's RoPE table holds 1024 positions; writing positions 1023 and 1024 needs
    1025. The K equals the one computed with the table grown beforehand."""
    rng = np.random.default_rng(9)
    held = to_port(rng.standard_normal((1, 1023, HD)))
    hidden = to_port(rng.standard_normal((1, 6, H)))
    tokens = torch.arange(1026).reshape(1, 1026) % V
    out = []
    for pregrow in (False, True):
        model = PortModel(models()[1], torch.float64, DEVICE)
        if pregrow:
            model.mtp.layer.ropes.get(model.mtp.layer.theta, 4096)
        kv = RaggedKv.from_rows([held], [held.clone()], 4096)
        extend(kv, [1023], [1023], [1025], tokens, hidden, block=model.mtp)
        assert kv.host_lens().tolist() == [1025]
        out.append(kv.k[0, :, 1023:1025])
    assert torch.equal(out[0], out[1])


# --- the pooled draft KV: rows and handles ------------------------------------------------------
# Each test builds its own store: the backend under test keeps its stores for the process, so a
# store's construction, first growth and row recycling would happen once per run otherwise.


@pytest.mark.rule("the pooled draft KV: rows and handles, port")
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_a_fresh_store_holds_no_rows_in_the_given_dtype_and_head_width(dtype):
    store = DraftStore(3, dtype, "cpu")
    for buf in (store.kv.k, store.kv.v):
        assert list(buf.shape) == [0, 1, DRAFT_CACHE_CAPACITY, 3] and buf.dtype == dtype
    assert store.kv.lens.tolist() == [] and store.free == []


@pytest.mark.rule("the pooled draft KV: rows and handles, port")
def test_the_store_allocates_on_the_device_it_is_given(monkeypatch):
    """A CPU run has one device, so the device a store's buffers are created on is read from
    the allocation itself."""
    seen = []

    class Spy(RaggedKv):
        @staticmethod
        def empty(*args, **kwargs):
            seen.append(args[6] if len(args) > 6 else kwargs.get("device"))
            return RaggedKv.empty(*args, **kwargs)

    monkeypatch.setattr(draft_store, "RaggedKv", Spy)
    dev = torch.device("cpu")
    DraftStore(3, torch.float64, dev)
    assert seen == [dev]


@pytest.mark.rule("the pooled draft KV: rows and handles, port")
def test_rows_are_handed_out_lowest_first_and_the_row_count_doubles_from_8():
    store = DraftStore(2, torch.float64, "cpu")
    assert [store.alloc() for _ in range(8)] == list(range(8))
    assert store.kv.batch == 8 and store.free == []
    assert store.alloc() == 8 and store.kv.batch == 16
    assert [store.alloc() for _ in range(7)] == list(range(9, 16)) and store.kv.batch == 16
    assert store.alloc() == 16 and store.kv.batch == 32
    for buf in (store.kv.k, store.kv.v):
        assert list(buf.shape) == [32, 1, DRAFT_CACHE_CAPACITY, 2]
    assert store.kv.host_lens().tolist() == [0] * 32


@pytest.mark.rule("the pooled draft KV: rows and handles, port")
def test_a_recycled_row_is_zeroed_with_length_0_and_the_other_rows_keep_theirs():
    store = DraftStore(2, torch.float64, "cpu")
    a, b = store.alloc(), store.alloc()
    store.kv.k[a].fill_(7.0)
    store.kv.v[a].fill_(8.0)
    store.kv.k[b].fill_(9.0)
    store.kv.set_row_len(a, 3)
    store.kv.set_row_len(b, 5)
    store.release(a)
    assert store.alloc() == a  # the last row released is the next handed out
    assert bool((store.kv.k[a] == 0).all()) and bool((store.kv.v[a] == 0).all())
    assert store.kv.host_lens()[[a, b]].tolist() == [0, 5]
    assert bool((store.kv.k[b] == 9.0).all())


@pytest.mark.rule("the pooled draft KV: rows and handles, port")
def test_a_store_row_grows_past_any_sequence_length_without_refusal():
    """The store's own width is never refused (refusals are the handles' metadata): a row
    appended far past the draft capacity grows by whole 512-column blocks."""
    store = DraftStore(2, torch.float64, "cpu")
    r = store.alloc()
    store.kv.append(torch.ones(1, 1, 5000, 2, dtype=torch.float64),
                    torch.ones(1, 1, 5000, 2, dtype=torch.float64), rows=[r])
    assert int(store.kv.lens[r]) == 5000 and store.kv.capacity == DRAFT_CACHE_CAPACITY + 10 * 512
    store.reserve(6000)
    assert store.kv.capacity == DRAFT_CACHE_CAPACITY + 12 * 512


@pytest.mark.rule("the pooled draft KV: rows and handles, port")
def test_a_handle_starts_empty_and_unmaterialized_and_returns_its_row_when_it_dies():
    store = DraftStore(2, torch.float64, "cpu")
    h = PoolKv(store, 4096)
    assert (h.current, h.current_seq_len, h.capacity_seq_len, h.max_seq_len) == (
        0, 0, DRAFT_CACHE_CAPACITY, 4096)
    assert h.materialized is False and h.front_aligned() is None
    idx = h.idx
    assert idx not in store.free
    del h
    gc.collect()
    assert idx in store.free


@pytest.mark.rule("the pooled draft KV: rows and handles, port")
def test_set_len_of_a_materialized_handle_sets_only_its_own_row():
    store = DraftStore(2, torch.float64, "cpu")
    h, other = PoolKv(store, 4096), PoolKv(store, 4096)
    store.kv.set_row_len(other.idx, 2)
    h.set_len(5)  # unmaterialized: the metadata only
    assert h.current == 5 and int(store.kv.lens[h.idx]) == 0
    h.materialized = True
    h.set_len(9)
    assert h.current == 9
    assert store.kv.host_lens()[[h.idx, other.idx]].tolist() == [9, 2]
    k, v = h.front_aligned()
    assert list(k.shape) == [1, 1, 9, 2] == list(v.shape)
    with pytest.raises(CacheRefusal):
        h.set_len(DRAFT_CACHE_CAPACITY + 1)
