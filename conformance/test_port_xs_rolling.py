"""Port conformance: XsRolling, the compressor history with per-row lengths (gpu.xs_rolling
vs reference.xs_rolling; masks-and-scheduling.md §13, cache-and-draft.md §12.3, §17.2
`mtp_verify_rollback_restores_the_compressor_rows_exactly`).

The port keeps each row's history in a ring buffer (token p at column `p mod W`) where the
reference keeps an end-anchored tail it shifts; `materialize_tail` gives the reference's
tensor. What is compared after every operation:

- integers (`tokens`, `base`, `current_seq_len`, `comp_seq_len`, every field of the plan):
  equal;
- the tail (data movement: each token's row, zeros behind `base`): bit-exact, in float64,
  float32 and bfloat16 (the data are drawn representable);
- the compressed rows (a mean of `ratio` rows): float64 `assert_close64` (1e-12 relative to
  the largest compressed value; observed ~1e-16: the same sums in another order); in
  float32/bfloat16 the FlashAttention bound against a naive same-dtype mean (a sequential
  sum over the block, then a division, written here);
- refusals: raised by both or neither, same class (CacheRefusal) and message, and a refused
  call changes nothing; malformed input (ValueError) on both sides.
The from-scratch oracle `scratch_blocks` (a per-block loop) pins the numbers independently.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import raggedspec.gpu.xs_rolling as port
from raggedspec.gpu.testing import (
    DEVICE,
    assert_bit_exact,
    assert_close64,
    assert_dtype_bound,
    assert_same_refusal,
    host,
    outcome,
    representable,
    to_port,
)
from raggedspec.reference import xs_rolling as ref
from raggedspec.reference.errors import CacheRefusal

D = 3
RATIOS = [2, 3, 4, 8, 128]


def scratch_blocks(h: np.ndarray, ratio: int) -> np.ndarray:
    """From-scratch compression: block g = mean of rows [g*ratio, (g+1)*ratio), by loop."""
    out = [sum(h[g * ratio + j] for j in range(ratio)) / ratio for g in range(len(h) // ratio)]
    return np.array(out).reshape(len(out), h.shape[1]) if out else np.zeros((0, h.shape[1]))


def assert_same_state(p: port.XsRolling, r: ref.XsRolling, what: str = "") -> None:
    """Port state == reference state: integers equal, tail bit-exact, comp within 1e-12."""
    q = p.to_reference()
    assert (q.tokens, q.base) == (r.tokens, r.base), (
        f"{what}: tokens/base {q.tokens, q.base} != {r.tokens, r.base}"
    )
    assert (p.current_seq_len, p.comp_seq_len) == (r.current_seq_len, r.comp_seq_len)
    assert (q.tail is None) == (r.tail is None)
    if r.tail is not None:
        assert_bit_exact(q.tail, r.tail, f"{what}: tail")
        assert_close64(q.comp, r.comp, what=f"{what}: comp")
        for i in range(r.batch):
            assert_bit_exact(p.row_history(i), r.row_history(i), f"{what}: row {i} history")
            assert_close64(p.row_comp(i), r.row_comp(i), what=f"{what}: row {i} comp")


def both(p: port.XsRolling, r: ref.XsRolling, op: str, *args):
    """Run `op` on both slots (port args converted); assert the same outcome and, when
    refused, that neither changed. Returns True when neither refused."""
    before = r.clone()
    p_args = [to_port(a, device=DEVICE) if isinstance(a, np.ndarray) else a for a in args]
    ro = outcome(getattr(r, op), *args)
    po = outcome(getattr(p, op), *p_args)
    ok = assert_same_refusal(po, ro, op)
    if not ok:
        assert_same_state(p, before, f"{op} refused: unchanged")
    assert_same_state(p, r, op)
    return ok


# --- plan_xs_advance ------------------------------------------------------------------------------


@st.composite
def plan_case(draw):
    """Rows of tokens 0..400 with a base anywhere in [0, tokens] (so both refusals are
    reached), a window from tight to roomy, t_new 0..40, ratio 2..128, span 1..2."""
    ratio = draw(st.sampled_from(RATIOS))
    span = draw(st.sampled_from([1, 2, ref.span_groups_for(ratio)]))
    margin = draw(st.sampled_from([0, 4, 16]))
    window = draw(
        st.sampled_from([span * ratio + margin, span * ratio + margin + 7, max(1, ratio - 1), 8])
    )
    b = draw(st.integers(1, 6))
    tokens = draw(st.lists(st.integers(0, 400), min_size=b, max_size=b))
    base = [draw(st.one_of(st.integers(max(0, t - window), t), st.integers(0, t))) for t in tokens]
    if draw(st.integers(0, 9)) == 0:  # malformed: a base past its tokens
        i = draw(st.integers(0, b - 1))
        base[i] = tokens[i] + 1
    return tokens, base, window, draw(st.integers(0, 40)), ratio, span, margin


@pytest.mark.rule("plan_xs_advance, port")
@given(case=plan_case())
def test_plan_xs_advance_matches_the_reference_including_refusals(case):
    tokens, base, window, t_new, ratio, span, margin = case
    try:
        want = outcome(ref.plan_xs_advance, tokens, base, window, t_new, ratio, span, margin)
    except ValueError:
        with pytest.raises(ValueError, match="base .* must be in"):
            port.plan_xs_advance(
                torch.tensor(tokens), torch.tensor(base), window, t_new, ratio, span, margin
            )
        return
    got = outcome(
        port.plan_xs_advance,
        torch.tensor(tokens),
        torch.tensor(base),
        window,
        t_new,
        ratio,
        span,
        margin,
    )
    if assert_same_refusal(got, want, "plan_xs_advance"):
        assert got[1].reference_rows() == want[1].rows
        assert host(got[1].dest).tolist() == [r.dest for r in want[1].rows]


@pytest.mark.rule("plan_xs_advance, port")
def test_plan_xs_advance_worked_rows_on_the_port():
    """The reference test's hand-worked rows (§13 formulas): ratio 4 tok 13 + 5 and
    61 (base 40) + 9; ratio 128 tok 250 (base 128) + 9; and the two refusals."""
    rows = port.plan_xs_advance([13, 61, 13], [0, 40, 0], 24, 5, 4, 2, 16).reference_rows()
    p = rows[0]
    assert (
        p.tokens_after,
        p.g_done,
        p.g_target,
        p.need_start,
        p.off,
        p.length,
        p.take,
        p.dest,
        p.base_after,
    ) == (18, 3, 4, 8, 19, 8, 1, 3, 0)
    p = port.plan_xs_advance([61], [40], 24, 9, 4, 2, 16).reference_rows()[0]
    assert (p.need_start, p.off, p.length, p.take, p.dest, p.base_after) == (56, 19, 12, 2, 15, 48)
    p = port.plan_xs_advance([13], [0], 24, 2, 4, 2, 16).reference_rows()[0]
    assert (p.take, p.need_start, p.off, p.length, p.tokens_after) == (0, None, None, None, 15)
    p = port.plan_xs_advance([250], [128], 144, 9, 128, 1, 16).reference_rows()[0]
    assert (p.need_start, p.off, p.length, p.take, p.dest, p.base_after) == (
        128,
        22,
        128,
        1,
        1,
        128,
    )
    with pytest.raises(
        CacheRefusal, match="compressor history gap: row 1 needs token 56 .* base 60"
    ):
        port.plan_xs_advance([13, 61], [0, 60], 24, 3, 4, 2, 16)
    with pytest.raises(CacheRefusal, match="run of 20 tokens .* does not fit the window of 8"):
        port.plan_xs_advance([0], [0], 8, 40, 4, 2, 16)


# --- §17.2 mtp_verify_rollback_restores_the_compressor_rows_exactly
# --------------------------------

SHAPES = [
    (1, 1),
    (2, 1),
    (2, 2),
    (3, 2),
    (4, 1),
    (5, 5),
    (6, 3),
    (8, 2),
    (9, 9),
]  # (w = depth+1, commit)
SPEC_PREFILLS = [(4, [13, 15, 16, 20, 61]), (128, [130, 250, 255, 256, 383])]


@pytest.mark.rule("mtp_verify_rollback_restores_the_compressor_rows_exactly, port")
@pytest.mark.parametrize("ratio,prefills", SPEC_PREFILLS)
def test_mtp_verify_rollback_restores_the_compressor_rows_exactly_on_the_port(ratio, prefills):
    """The spec's numbers: prefill committed - 1, then 1, then a verify window of w (commit
    of them true, the rest junk), `set_len` back by `w - commit` (truncate_cache_by), then
    onward decode. After every feed and the rollback the port equals the reference; after
    the rollback and onward its compressed rows equal the from-scratch compression of the
    committed rows; some speculative block was compressed and rewritten."""
    rng = np.random.default_rng(ratio)
    crossed = 0
    for committed in prefills:
        for w, commit in SHAPES:
            truth = rng.standard_normal((committed + commit + 9, D))
            r, p = ref.XsRolling(ratio), port.XsRolling(ratio, device=DEVICE)
            for rows in (truth[: committed - 1], truth[committed - 1: committed],
                         np.concatenate([truth[committed: committed + commit],
                                         rng.standard_normal((w - commit, D)) + 50])):
                assert both(p, r, "append_rows", rows[None])
            crossed += p.comp_seq_len > (committed + commit) // ratio
            assert both(p, r, "set_len", p.current_seq_len - (w - commit))
            assert p.current_seq_len == committed + commit
            assert_close64(
                p.row_comp(0),
                scratch_blocks(truth[: committed + commit], ratio),
                what="rolled back",
            )
            assert both(p, r, "append_rows", truth[None, committed + commit:])
            assert_close64(p.row_comp(0), scratch_blocks(truth, ratio), what="onward")
            assert_bit_exact(p.row_history(0), truth[int(p.base[0]):], "history")
    assert crossed > 0


@pytest.mark.rule("mtp_verify_rollback_restores_the_compressor_rows_exactly, port")
@pytest.mark.parametrize("ratio,prefills", SPEC_PREFILLS)
def test_a_ragged_batch_rolls_each_row_back_to_its_own_commit_on_the_port(ratio, prefills):
    """The five prefills as one ragged batch (the reference's stack, converted): a verify
    window of w for every row, a per-row commit (`set_row_lens`), onward decode; the port
    equals the reference after every step and each row equals its from-scratch compression."""
    rng = np.random.default_rng(7 + ratio)
    for w, _ in SHAPES:
        truths = [rng.standard_normal((n + 2 * w, D)) for n in prefills]
        solos = []
        for n, h in zip(prefills, truths, strict=False):
            solo = ref.XsRolling(ratio)
            solo.append_rows(h[None, :n])
            solos.append(solo)
        r = ref.XsRolling.stack(solos)
        p = port.XsRolling.from_reference(r, device=DEVICE)
        assert_same_state(p, r, "from_reference")
        commits = [1 + (i * 3 + w) % w for i in range(len(prefills))]
        block = np.stack([np.concatenate([h[n: n + c], rng.standard_normal((w - c, D)) - 40])
                          for n, h, c in zip(prefills, truths, commits, strict=False)])
        assert both(p, r, "append_rows", block)
        assert both(p, r, "set_row_lens", [n + c for n, c in zip(prefills, commits, strict=False)])
        assert both(
            p,
            r,
            "append_rows",
            np.stack(
                [h[n + c : n + c + w] for n, c, h in zip(prefills, commits, truths, strict=False)]
            ),
        )
        for i, (n, c, h) in enumerate(zip(prefills, commits, truths, strict=False)):
            assert_close64(p.row_comp(i), scratch_blocks(h[: n + c + w], ratio), what=f"row {i}")


# --- random ragged feeds, rollbacks and refusals
# ------------------------------------------------------


@pytest.mark.rule(
    "XsRolling append and compressor, port",
    "XsRolling length setters, port",
    "XsRolling rollback refusal, one rule for both layouts",
)
@given(data=st.data())
def test_random_ragged_feeds_rollbacks_and_refusals_match_the_reference(data):
    """Ragged batches of 1..4 rows (prefills 0..300 in two parts), then 1..6 rounds of an
    append of 0..12 rows and a per-row rollback, sometimes past what the history allows
    (refused by both: past the tokens seen, behind base, resume point behind base), plus
    uniform `set_len` attempts on ragged rows ("non-uniform")."""
    ratio = data.draw(st.sampled_from(RATIOS))
    b = data.draw(st.integers(1, 4))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    solos = []
    for n in data.draw(st.lists(st.integers(0, 300), min_size=b, max_size=b)):
        solo = ref.XsRolling(ratio)
        h = rng.standard_normal((n, 2))
        cut = data.draw(st.integers(0, n))
        for part in (h[:cut], h[cut:]):
            solo.append_rows(part[None])
        solos.append(solo)
    r = ref.XsRolling.stack(solos)
    p = port.XsRolling.from_reference(r, device=DEVICE)
    for _ in range(data.draw(st.integers(1, 6))):
        both(p, r, "append_rows", rng.standard_normal((b, data.draw(st.integers(0, 12)), 2)))
        lens = [
            max(0, t - data.draw(st.integers(0, ref.XS_TAIL_MARGIN_TOKENS + 2 * ratio)))
            for t in r.tokens
        ]
        if data.draw(st.integers(0, 5)) == 0:
            i = data.draw(st.integers(0, b - 1))
            lens[i] = r.tokens[i] + 1
        both(p, r, "set_row_lens", lens)
        if data.draw(st.booleans()):
            both(p, r, "set_len", max(0, r.current_seq_len - data.draw(st.integers(0, 20))))


@pytest.mark.rule(
    "XsRolling length setters, port",
    "XsRolling rollback refusal, one rule for both layouts",
)
def test_length_setter_and_append_refusals_match_the_reference_messages():
    """The reference test's refusal numbers (tokens 61, base 40; ratio 4): past the tokens,
    behind base, resume point 36 behind base 40, non-uniform; above max_seq_len; a history
    gap on append. Same class and message on both, nothing changed."""
    h = np.arange(61 * D, dtype=np.float64).reshape(1, 61, D)
    r = ref.XsRolling(4)
    r.append_rows(h)
    p = port.XsRolling.from_reference(r)
    assert p.base.tolist() == [40]
    for length, pattern in (
        (62, "past the 61 tokens"),
        (39, "behind base 40"),
        (43, "resume point 36, behind base 40"),
    ):
        assert not both(p, r, "set_len", length)
        with pytest.raises(CacheRefusal, match=pattern):
            p.try_set_len(length)
    assert both(p, r, "set_len", 44)
    ragged = ref.XsRolling.stack([ref.XsRolling(4), ref.XsRolling(4)])
    ragged.append_rows(np.ones((2, 13, D)))
    ragged.set_row_lens([13, 12])
    pr = port.XsRolling.from_reference(ragged)
    with pytest.raises(CacheRefusal, match=r"non-uniform rows with tokens \[13, 12\]"):
        pr.try_set_len(12)
    assert not both(pr, ragged, "set_len", 12)
    small_r = ref.XsRolling(4, max_seq_len=16)
    small_r.append_rows(np.ones((1, 12, D)))
    small_p = port.XsRolling.from_reference(small_r)
    assert not both(small_p, small_r, "append_rows", np.ones((1, 5, D)))
    gap_r = ref.XsRolling(4)
    gap_r.append_rows(h)
    gap_r.base = [60]            # a base past the history block 15 needs (token 56)
    gap_r._zero_behind_base()    # the reference's own representation of "not kept"
    assert not both(port.XsRolling.from_reference(gap_r), gap_r, "append_rows", np.ones((1, 3, D)))
    with pytest.raises(ValueError):
        p.set_row_lens([61, 3])
    # hand-set states, unreachable by appends (bases are multiples of the ratio; tokens <=
    # base + W), to pin the two last checks: a resume point one token behind base 37, and
    # a length past base 30 + W 24
    for hand_base, length, pattern in (
        (37, 43, "resume point 36, behind base 37"),
        (30, 55, "base 30 [+] window 24 < length 55"),
    ):
        odd = ref.XsRolling(4)
        odd.append_rows(h)
        odd.base = [hand_base]
        odd._zero_behind_base()
        po = port.XsRolling.from_reference(odd)
        with pytest.raises(CacheRefusal, match=pattern):
            po.set_row_lens([length])
        assert not assert_same_refusal(
            outcome(po.set_row_lens, [length]), outcome(odd.set_row_lens, [length])
        )
        assert po.tokens.tolist() == odd.tokens == [61]


# --- dtypes
# -------------------------------------------------------------------------------------------


@pytest.mark.rule("XsRolling append and compressor, port")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@given(ratio=st.sampled_from(RATIOS), sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
       seed=st.integers(0, 2**32 - 1))
def test_low_precision_tail_is_bit_exact_and_comp_within_the_naive_bound(dtype, ratio, sizes, seed):
    """Feeds of dtype-representable rows: the tail (moved) equals the float64 reference bit
    for bit in dtype; each compressed row is within 2x the naive same-dtype mean's error
    (sequential sum over the block in dtype, then / ratio) + 4 eps * max|x|."""
    rng = np.random.default_rng(seed)
    r, p = ref.XsRolling(ratio), port.XsRolling(ratio, device=DEVICE)
    fed = np.zeros((0, D))
    for n in sizes:
        x = representable(rng.standard_normal((1, n, D)), dtype)
        r.append_rows(x)
        p.append_rows(to_port(x, dtype))
        fed = np.concatenate([fed, x[0]])
    assert p.ring.dtype == dtype and p.tokens.tolist() == r.tokens
    assert_bit_exact(p.materialize_tail(), r.tail, "tail")
    g = r.tokens[0] // ratio
    naive = torch.zeros((g, D), dtype=dtype)
    rows = to_port(fed, dtype).cpu()
    for j in range(g):
        acc = rows[j * ratio]
        for k in range(1, ratio):
            acc = acc + rows[j * ratio + k]
        naive[j] = acc / ratio
    assert_dtype_bound(
        p.row_comp(0),
        naive,
        r.row_comp(0),
        dtype,
        float(np.abs(fed).max()) if fed.size else 1.0,
        "comp",
    )


@pytest.mark.rule("XsRolling append and compressor, port")
def test_compress_blocks_matches_the_reference():
    x = np.random.default_rng(0).standard_normal((2, 3, 19, 4))
    for ratio in (1, 4, 128):
        assert_close64(
            port.compress_blocks(to_port(x), ratio),
            ref.compress_blocks(x, ratio),
            what="compress_blocks",
        )
    assert port.compress_blocks(to_port(np.arange(10.0).reshape(1, 10, 1)), 4).tolist() == [
        [[1.5], [5.5]]
    ]
