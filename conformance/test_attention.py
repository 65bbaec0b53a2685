"""Attention (masks-and-scheduling.md §4, §5 fixture, §12).

Oracle: `union_attention_oracle` below recomputes each row *alone*, query by query, from
absolute positions (raw keys `p` with `qp - window < p <= qp`, compressed blocks
`b < floor((qp + 1) / ratio)`), softmax with a denominator-only sink, in plain Python
loops. It shares no code with `reference.attention`.

Tolerances (float64 throughout):
- reference vs oracle, and ragged batch vs the row alone: rtol = atol = 1e-12. The same
  valid (logit, value) pairs enter the same softmax; only the float64 summation order
  differs (BLAS blocking over a different number of masked columns), which moves results
  by a few ulp. The spec's 1.5e-3 is a candle F16 artefact and does not apply here.
- dead-prefix perturbation, uniform `row_q0` vs None, `raw_prefix` accounting, Standard
  layer vs no compressed keys: bit-exact (masked columns contribute exp(-inf) = 0 exactly;
  the other two are the same computation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.strategies import leads_of, ragged_lengths, uniform_lengths
from raggedspec.reference.errors import DispatchRefusal, MaskRefusal
from raggedspec.reference.attention import (
    Dsv4AttentionConfig,
    absorbed_decode_eligible,
    attention,
    dsv4_attention,
    dsv4_mask_stats,
    reset_dsv4_mask_stats,
    v4_paged_dispatch_precheck,
    xs_history_should_reset,
)
from raggedspec.reference.masks import compressed_validity, raw_keep_span

TOL = 1e-12


# ----------------------------------------------------------------------------- oracles


def softmax_oracle(logits: list[float], values: list[np.ndarray], sink: float | None) -> np.ndarray:
    """Plain softmax-weighted sum; the sink joins the denominator only."""
    top = max(logits + ([sink] if sink is not None else []))
    weights = [math.exp(x - top) for x in logits]
    denom = sum(weights) + (math.exp(sink - top) if sink is not None else 0.0)
    out = np.zeros_like(values[0]) if values else np.zeros(0)
    for w, v in zip(weights, values, strict=False):
        out = out + w * v
    return out / denom


def attention_oracle(q, k, v, keep, sinks):
    """Per (row, head, query) loop over kept keys; `keep[b][h][r][j]` booleans."""
    b_, h_, t_q, d = q.shape
    group = h_ // k.shape[1]
    out = np.zeros((b_, h_, t_q, v.shape[3]))
    for b in range(b_):
        for h in range(h_):
            for r in range(t_q):
                cols = [j for j in range(k.shape[2]) if keep[b][h][r][j]]
                logits = [float(q[b, h, r] @ k[b, h // group, j]) / math.sqrt(d) for j in cols]
                vals = [v[b, h // group, j] for j in cols]
                sink = None if sinks is None else float(sinks[h])
                out[b, h, r] = softmax_oracle(logits, vals, sink) if cols else 0.0
    return out


@dataclass
class Row:
    """One sequence alone: `keys [n, D]` (its raw K = V, positions 0..n-1), `comp [n_c, D]`
    (its compressed rows, block b at row b, possibly with trailing incomplete rows), and the
    queries `q [H, t_q, D]` at positions `n - t_q ..`."""

    keys: np.ndarray
    vals: np.ndarray
    comp: np.ndarray | None
    q: np.ndarray


def union_attention_oracle(row: Row, window: int, ratio: int, sinks) -> np.ndarray:
    """`[H, t_q, D]`: each query of the row alone over its valid raw and compressed keys."""
    h_, t_q, d = row.q.shape
    n = row.keys.shape[0]
    out = np.zeros((h_, t_q, row.vals.shape[1]))
    for h in range(h_):
        for r in range(t_q):
            qp = n - t_q + r
            keys = [(row.keys[p], row.vals[p]) for p in range(n) if qp - window < p <= qp]
            if row.comp is not None:
                keys += [(row.comp[b], row.comp[b]) for b in range(row.comp.shape[0])
                         if (b + 1) * ratio <= qp + 1]
            logits = [float(row.q[h, r] @ key) / math.sqrt(d) for key, _ in keys]
            sink = None if sinks is None else float(sinks[h])
            out[h, r] = softmax_oracle(logits, [val for _, val in keys], sink)
    return out


# ----------------------------------------------------------------------------- builders


def make_rows(lengths, t_q, ratio, heads, dim, rng, extra_c=0) -> list[Row]:
    """Row i has `lengths[i]` cached tokens plus this step's `t_q`; its compressed rows are
    its complete blocks plus `extra_c` incomplete (garbage) ones."""
    rows = []
    for n_cached in lengths:
        n = n_cached + t_q
        comp = None
        if ratio > 1:
            comp = rng.normal(size=(n // ratio + extra_c, dim))
        rows.append(Row(rng.normal(size=(n, dim)), rng.normal(size=(n, dim)), comp,
                        rng.normal(size=(heads, t_q, dim))))
    return rows


def batch_of(rows: list[Row], t_q: int, ratio: int, dead_rng=None, extra_c=0):
    """Front-align the rows into `(q, k, v, compressed_kv)`: row i's raw run ends at the
    shared column; its dead prefix (and compressed rows past its own) are zeros, or noise
    from `dead_rng` (what a perturbation test changes)."""
    n_max = max(r.keys.shape[0] for r in rows)
    b_, dim = len(rows), rows[0].keys.shape[1]

    def dead(shape):
        return np.zeros(shape) if dead_rng is None else dead_rng.normal(size=shape) * 3.0

    k = dead((b_, 1, n_max, dim))
    v = dead((b_, 1, n_max, dim))
    comp = None
    if ratio > 1:
        comp = dead((b_, 1, n_max // ratio + extra_c, dim))
    for i, r in enumerate(rows):
        n = r.keys.shape[0]
        k[i, 0, n_max - n:] = r.keys
        v[i, 0, n_max - n:] = r.vals
        if comp is not None:
            own = n // ratio  # the row's complete blocks; the rest stay dead
            comp[i, 0, :own] = r.comp[:own]
    q = np.stack([r.q for r in rows])
    return q, k, v, comp


def alone(row: Row, cfg_ratio: int, window: int, sinks):
    cfg = Dsv4AttentionConfig(cfg_ratio, window)
    comp = None if row.comp is None else row.comp[None, None]
    return dsv4_attention(row.q[None], row.keys[None, None], row.vals[None, None], comp, None,
                          cfg, sinks)[0]


# ----------------------------------------------------------------------------- attention()


@pytest.mark.rule("attention with sinks")
@given(b=st.integers(1, 3), hk=st.integers(1, 2), group=st.integers(1, 2),
       t_q=st.integers(1, 5), t_k=st.integers(1, 12), with_sinks=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_attention_equals_the_loop_oracle(b, hk, group, t_q, t_k, with_sinks, seed):
    rng = np.random.default_rng(seed)
    h = hk * group
    q = rng.normal(size=(b, h, t_q, 4))
    k = rng.normal(size=(b, hk, t_k, 4))
    v = rng.normal(size=(b, hk, t_k, 3))
    keep = rng.random((b, h, t_q, t_k)) < 0.7
    keep[..., 0] = True  # at least one kept key per query
    sinks = rng.normal(size=h) if with_sinks else None
    mask = np.where(keep, 0.0, -np.inf)
    got = attention(q, k, v, mask, sinks)
    np.testing.assert_allclose(got, attention_oracle(q, k, v, keep, sinks), rtol=TOL, atol=TOL)


@pytest.mark.rule("attention with sinks")
def test_the_sink_is_a_denominator_only_column():
    rng = np.random.default_rng(7)
    q, k, v = (
        rng.normal(size=(1, 2, 3, 4)),
        rng.normal(size=(1, 1, 5, 4)),
        rng.normal(size=(1, 1, 5, 4)),
    )
    plain = attention(q, k, v, None, None)
    # a -inf sink is no sink at all, bit for bit
    assert np.array_equal(attention(q, k, v, None, np.full(2, -np.inf)), plain)
    # a finite sink only rescales: out = plain * Z / (Z + e^sink)
    sinks = np.array([0.5, -1.0])
    logits = (q @ np.swapaxes(k, -1, -2)) / 2.0
    z = np.exp(logits).sum(-1, keepdims=True)
    want = plain * z / (z + np.exp(sinks)[None, :, None, None])
    np.testing.assert_allclose(attention(q, k, v, None, sinks), want, rtol=TOL, atol=TOL)
    # a dominant sink takes (almost) all the weight, and adds no value row
    assert np.abs(attention(q, k, v, None, np.full(2, 60.0))).max() < 1e-20


@pytest.mark.rule("attention with sinks")
def test_masked_keys_never_reach_the_output_and_never_make_nan():
    rng = np.random.default_rng(8)
    q, k, v = (
        rng.normal(size=(2, 2, 3, 4)),
        rng.normal(size=(2, 1, 6, 4)),
        rng.normal(size=(2, 1, 6, 4)),
    )
    mask = np.zeros((2, 1, 3, 6))
    mask[..., :2] = -np.inf
    base = attention(q, k, v, mask)
    k2, v2 = k.copy(), v.copy()
    k2[:, :, :2] = rng.normal(size=(2, 1, 2, 4)) * 50
    v2[:, :, :2] = rng.normal(size=(2, 1, 2, 4)) * 50
    assert np.array_equal(attention(q, k2, v2, mask), base)
    # unspecified, chosen: a query with every key masked and no sink returns 0, not NaN
    dead = np.full((1, 1, 3, 6), -np.inf)
    assert np.array_equal(attention(q, k, v, dead), np.zeros((2, 2, 3, 4)))
    assert np.array_equal(attention(q, k, v, dead, np.zeros(2)), np.zeros((2, 2, 3, 4)))


# ----------------------------------------------------------------------------- dsv4 refusals


def _plain(b=1, t_q=1, t_k=4, d=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(b, 2, t_q, d)), rng.normal(size=(b, 1, t_k, d))


@pytest.mark.rule("dsv4_attention refusals")
def test_dsv4_refuses_more_queries_than_keys():
    q, k = _plain(t_q=5, t_k=4)
    with pytest.raises(MaskRefusal, match="5 query rows against only 4 keys"):
        dsv4_attention(q, k, k, None, None, Dsv4AttentionConfig(0, 8))
    # raw_prefix counts toward t_k_full: 5 queries against 1 + 4 keys pass this check (and
    # then meet the raw_prefix refusal, since the window reaches column 0)
    with pytest.raises(MaskRefusal, match="are NOT held"):
        dsv4_attention(q, k, k, None, None, Dsv4AttentionConfig(0, 128, raw_prefix=1))
    q4, _ = _plain(t_q=4, t_k=4)
    assert dsv4_attention(q4, k, k, None, None, Dsv4AttentionConfig(0, 8)).shape == (1, 2, 4, 4)


@pytest.mark.rule("dsv4_attention refusals")
def test_dsv4_refuses_a_raw_prefix_past_the_window_base():
    q, k = _plain(t_q=1, t_k=6)
    # t_k_full = 4 + 6 = 10, window 8 -> raw_base 2 < raw_prefix 4
    with pytest.raises(MaskRefusal, match="are NOT held.*raw_prefix 4 > raw_base 2"):
        dsv4_attention(q, k, k, None, None, Dsv4AttentionConfig(0, 8, raw_prefix=4))


@pytest.mark.rule("dsv4_attention refusals")
def test_dsv4_passes_on_the_ragged_row_refusals():
    q, k = _plain(b=3, t_q=1, t_k=7)
    for rows, words in (([7, 4, 2], "AHEAD of the batch"), ([6, 4], "for a batch of"),
                        ([5, 4, 2], "no row sits at the batch's shared end column")):
        with pytest.raises(DispatchRefusal, match=words):
            dsv4_attention(q, k, k, None, None, Dsv4AttentionConfig(4, 4, row_q0=rows))


# ----------------------------------------------------------------------------- dsv4 rules


@pytest.mark.rule("dsv4_attention")
def test_raw_prefix_is_pure_accounting():
    rng = np.random.default_rng(11)
    rows = make_rows([20, 13, 17], 3, 4, 2, 8, rng, extra_c=1)
    q, k, v, comp = batch_of(rows, 3, 4, extra_c=1)
    t_k_full = k.shape[2]
    base, _ = raw_keep_span(3, 6, t_k_full)
    assert base > 2  # non-degeneracy: there is a prefix to drop
    row_q0 = [20, 13, 17]
    full = dsv4_attention(q, k, v, comp, None, Dsv4AttentionConfig(4, 6, 0, row_q0))
    for prefix in range(1, base + 1):
        cut = dsv4_attention(q, k[:, :, prefix:], v[:, :, prefix:], comp, None,
                             Dsv4AttentionConfig(4, 6, prefix, row_q0))
        assert np.array_equal(cut, full)


@pytest.mark.rule("dsv4_attention Standard layer forces compressed_kv None")
def test_a_standard_layer_never_reads_compressed_keys():
    rng = np.random.default_rng(12)
    q, k = _plain(b=2, t_q=3, t_k=9, seed=3)
    comp = rng.normal(size=(2, 1, 2, 4))
    cfg0 = Dsv4AttentionConfig(0, 5)
    assert np.array_equal(dsv4_attention(q, k, k, comp, None, cfg0),
                          dsv4_attention(q, k, k, None, None, cfg0))
    # negative control: a CSA layer does read them
    cfg4 = Dsv4AttentionConfig(4, 5)
    assert np.abs(dsv4_attention(q, k, k, comp, None, cfg4)
                  - dsv4_attention(q, k, k, None, None, cfg4)).max() > 1e-2


@pytest.mark.rule("dsv4_attention")
def test_the_caller_mask_is_folded_in():
    rng = np.random.default_rng(13)
    row = make_rows([9], 2, 4, 2, 4, rng)[0]
    q, k, v, comp = batch_of([row], 2, 4)
    cfg = Dsv4AttentionConfig(4, 4)
    t_k_full, t_c = k.shape[2], comp.shape[2]
    caller = np.zeros((2, t_k_full + t_c))
    caller[:, t_k_full - 2] = -np.inf  # kill raw position 9 for both queries
    caller[1, t_k_full] = -np.inf  # kill compressed block 0 for query 1
    got = dsv4_attention(q, k, v, comp, caller, cfg)
    # oracle: the same row with the killed keys removed from its valid sets
    want = np.zeros_like(got[0])
    for h in range(2):
        for r in range(2):
            qp = 9 + r
            keys = [(row.keys[p], row.vals[p]) for p in range(11) if qp - 4 < p <= qp and p != 9]
            keys += [(row.comp[b], row.comp[b]) for b in range(t_c)
                     if (b + 1) * 4 <= qp + 1 and not (r == 1 and b == 0)]
            logits = [float(row.q[h, r] @ kk) / 2.0 for kk, _ in keys]
            want[h, r] = softmax_oracle(logits, [vv for _, vv in keys], None)
    np.testing.assert_allclose(got[0], want, rtol=TOL, atol=TOL)
    assert np.abs(got - dsv4_attention(q, k, v, comp, None, cfg)).max() > 1e-2


@pytest.mark.rule("dsv4_attention absorbed-decode gate")
def test_the_absorbed_decode_gate():
    assert absorbed_decode_eligible(1, 1, True) is True
    assert absorbed_decode_eligible(1, 1, False) is False  # sinks are required
    assert absorbed_decode_eligible(2, 1, True) is False
    assert absorbed_decode_eligible(1, 2, True) is False
    assert absorbed_decode_eligible(1, 1, True, no_absorbed_decode=True) is False


@pytest.mark.rule("dsv4_attention uniform row_q0")
def test_a_uniform_row_q0_is_bit_identical_to_none_over_54_configs():
    configs = 0
    for b in (1, 3):
        for t_q in (1, 2, 5):
            for window in (1, 4, 128):
                for ratio in (0, 4, 8):
                    rng = np.random.default_rng(configs)
                    rows = make_rows([13] * b, t_q, ratio, 2, 4, rng, extra_c=1)
                    q, k, v, comp = batch_of(rows, t_q, ratio, extra_c=1)
                    sinks = rng.normal(size=2)
                    reset_dsv4_mask_stats()
                    none = dsv4_attention(q, k, v, comp, None,
                                          Dsv4AttentionConfig(ratio, window), sinks)
                    uni = dsv4_attention(q, k, v, comp, None,
                                         Dsv4AttentionConfig(ratio, window, 0, [13] * b), sinks)
                    assert np.array_equal(none, uni)
                    assert dsv4_mask_stats == {"uniform": 2, "ragged": 0}
                    configs += 1
    assert configs >= 54


# ----------------------------------------------------------------------------- §5 fixture


@pytest.mark.rule("dsv4_attention")
def test_repository_ragged_fixture_lens_10_8_5():
    lens, t_q, window, ratio = [10, 8, 5], 2, 10, 4
    rng = np.random.default_rng(2024)
    rows = make_rows(lens, t_q, ratio, 2, 8, rng, extra_c=1)
    q, k, v, comp = batch_of(rows, t_q, ratio, extra_c=1)
    t_k_full, t_c = k.shape[2], comp.shape[2]
    assert (t_k_full, t_c, leads_of(lens)) == (12, 4, [0, 2, 5])
    sinks = rng.normal(size=2)
    ragged_cfg = Dsv4AttentionConfig(ratio, window, 0, lens)
    got = dsv4_attention(q, k, v, comp, None, ragged_cfg, sinks)

    # (a) the ragged batch equals each row run alone (and the position oracle)
    for i, row in enumerate(rows):
        np.testing.assert_allclose(got[i], alone(row, ratio, window, sinks), rtol=TOL, atol=TOL)
        np.testing.assert_allclose(got[i], union_attention_oracle(row, window, ratio, sinks),
                                   rtol=TOL, atol=TOL)

    # (b) negative control: with row_q0 = None the shorter rows differ (> 1e-2)
    blind = dsv4_attention(q, k, v, comp, None, Dsv4AttentionConfig(ratio, window), sinks)
    assert np.array_equal(blind[0], got[0])  # row 0 has no lead
    for i in (1, 2):
        assert np.abs(blind[i] - got[i]).max() > 1e-2

    # (c) perturbing the dead prefix (and the rows' incomplete compressed blocks) changes
    #     nothing, exactly
    q2, k2, v2, comp2 = batch_of(rows, t_q, ratio, dead_rng=np.random.default_rng(1),
                                 extra_c=1)
    assert not np.array_equal(k2, k) and not np.array_equal(comp2, comp)
    assert np.abs(dsv4_attention(q2, k2, v2, comp2, None, ragged_cfg, sinks) - got).max() == 0.0

    # (d) non-degeneracy: the per-row compressed thresholds differ from the batch's, some
    #     lead reaches into the kept raw span, and the span was narrowed
    raw_base, _ = raw_keep_span(t_q, window, t_k_full)
    assert raw_base == 1 and max(leads_of(lens)) > raw_base
    q0 = t_k_full - t_q
    batch_thr = compressed_validity(t_q, q0, t_c, ratio).sum(axis=1).tolist()
    row_thr = [compressed_validity(t_q, r, t_c, ratio).sum(axis=1).tolist() for r in lens]
    assert batch_thr == [2, 3] and row_thr == [[2, 3], [2, 2], [1, 1]]


# ----------------------------------------------------------------------------- properties


ratios = st.sampled_from([0, 4, 8, 16, 128])
case = dict(t_q=st.integers(1, 9), window=st.integers(1, 128), ratio=ratios,
            heads=st.integers(1, 3), with_sinks=st.booleans(), extra_c=st.integers(0, 2),
            seed=st.integers(0, 2**32 - 1))


@pytest.mark.rule("dsv4_attention")
@given(lengths=ragged_lengths(1, 6, 1, 80), **case)
def test_a_ragged_batch_gives_each_row_its_solo_attention(lengths, t_q, window, ratio, heads,
                                                          with_sinks, extra_c, seed):
    rng = np.random.default_rng(seed)
    rows = make_rows(lengths, t_q, ratio, heads, 4, rng, extra_c)
    sinks = rng.normal(size=heads) if with_sinks else None
    q, k, v, comp = batch_of(rows, t_q, ratio, extra_c=extra_c)
    got = dsv4_attention(q, k, v, comp, None, Dsv4AttentionConfig(ratio, window, 0, lengths), sinks)
    for i, row in enumerate(rows):
        np.testing.assert_allclose(got[i], alone(row, ratio, window, sinks), rtol=TOL, atol=TOL)
        np.testing.assert_allclose(got[i], union_attention_oracle(row, window, ratio, sinks),
                                   rtol=TOL, atol=TOL)


@pytest.mark.rule("dsv4_attention with several KV heads")
@given(lengths=ragged_lengths(1, 4, 1, 40), t_q=st.integers(1, 5), window=st.integers(1, 32),
       ratio=ratios, hk=st.sampled_from([2, 4]), group=st.sampled_from([1, 2, 4, 8]),
       seed=st.integers(0, 2**32 - 1))
def test_with_several_kv_heads_query_head_h_reads_kv_head_h_div_group(lengths, t_q, window,
                                                                       ratio, hk, group, seed):
    """GQA: `k, v [B,Hk,t_k,D]`, `compressed_kv [B,Hk,t_c,D]`, `H = Hk * group`. Query heads
    `[j * group, (j + 1) * group)` read KV head j only (`h // group`): the batched result on
    those heads equals, within 1e-12, the one-KV-head call on KV head j alone and the loop
    oracle of each row alone over KV head j. Any other mapping moves a head's output."""
    rng = np.random.default_rng(seed)
    per_kv = [make_rows(lengths, t_q, ratio, group, 4, rng) for _ in range(hk)]
    parts = [batch_of(rows, t_q, ratio) for rows in per_kv]
    q, k, v = (np.concatenate([p[n] for p in parts], axis=1) for n in range(3))
    comp = None if ratio <= 1 else np.concatenate([p[3] for p in parts], axis=1)
    sinks = rng.normal(size=hk * group)
    cfg = Dsv4AttentionConfig(ratio, window, 0, lengths)
    got = dsv4_attention(q, k, v, comp, None, cfg, sinks)
    assert got.shape == (len(lengths), hk * group, t_q, 4)
    for j, (qj, kj, vj, cj) in enumerate(parts):
        heads = slice(j * group, (j + 1) * group)
        one = dsv4_attention(qj, kj, vj, cj, None, cfg, sinks[heads])
        np.testing.assert_allclose(got[:, heads], one, rtol=TOL, atol=TOL)
        for i, row in enumerate(per_kv[j]):
            np.testing.assert_allclose(got[i, heads],
                                       union_attention_oracle(row, window, ratio, sinks[heads]),
                                       rtol=TOL, atol=TOL)


@pytest.mark.rule("dsv4_attention with several KV heads")
def test_dsv4_refuses_kv_heads_that_do_not_divide_the_query_heads():
    q, k = _plain()
    k2 = np.repeat(k, 2, axis=1)
    with pytest.raises(ValueError, match="KV heads 2 must divide query heads 3"):
        dsv4_attention(np.repeat(q[:, :1], 3, axis=1), k2, k2, None, None,
                       Dsv4AttentionConfig(0, 4))
    comp = np.zeros((1, 1, 1, q.shape[3]))
    with pytest.raises(ValueError, match=r"compressed_kv .* must be \[B=1,2,t_c"):
        dsv4_attention(q, k2, k2, comp, None, Dsv4AttentionConfig(4, 4))


@pytest.mark.rule("dsv4_attention")
@given(lengths=ragged_lengths(1, 6, 1, 80), **case)
def test_the_dead_prefix_never_reaches_any_output(lengths, t_q, window, ratio, heads,
                                                  with_sinks, extra_c, seed):
    rng = np.random.default_rng(seed)
    rows = make_rows(lengths, t_q, ratio, heads, 4, rng, extra_c)
    sinks = rng.normal(size=heads) if with_sinks else None
    cfg = Dsv4AttentionConfig(ratio, window, 0, lengths)
    zero = dsv4_attention(*batch_of(rows, t_q, ratio, extra_c=extra_c), None, cfg, sinks)
    noise = batch_of(rows, t_q, ratio, dead_rng=np.random.default_rng(seed + 1), extra_c=extra_c)
    assert np.array_equal(dsv4_attention(*noise, None, cfg, sinks), zero)


@pytest.mark.rule("dsv4_attention uniform row_q0")
@given(lengths=uniform_lengths(1, 6, 1, 80), **case)
def test_a_uniform_batch_never_reaches_the_ragged_path(lengths, t_q, window, ratio, heads,
                                                       with_sinks, extra_c, seed):
    rng = np.random.default_rng(seed)
    rows = make_rows(lengths, t_q, ratio, heads, 4, rng, extra_c)
    sinks = rng.normal(size=heads) if with_sinks else None
    batch = batch_of(rows, t_q, ratio, extra_c=extra_c)
    reset_dsv4_mask_stats()
    none = dsv4_attention(*batch, None, Dsv4AttentionConfig(ratio, window), sinks)
    uni = dsv4_attention(*batch, None, Dsv4AttentionConfig(ratio, window, 0, lengths), sinks)
    assert np.array_equal(none, uni)
    assert dsv4_mask_stats == {"uniform": 2, "ragged": 0}


@pytest.mark.rule("dsv4_attention uniform row_q0")
@given(lengths=ragged_lengths(2, 6, 1, 80, force_ragged=True), t_q=st.integers(1, 9))
def test_a_ragged_row_q0_takes_the_ragged_path(lengths, t_q):
    rows = make_rows(lengths, t_q, 4, 1, 4, np.random.default_rng(0))
    reset_dsv4_mask_stats()
    dsv4_attention(*batch_of(rows, t_q, 4), None, Dsv4AttentionConfig(4, 16, 0, lengths))
    assert dsv4_mask_stats == {"uniform": 0, "ragged": 1}


# ----------------------------------------------------------------------------- §12


@pytest.mark.rule("xs-history reset")
def test_the_xs_history_resets_only_when_every_offset_is_zero():
    assert xs_history_should_reset([0, 0, 0]) is True
    assert xs_history_should_reset([0]) is True
    assert xs_history_should_reset([0, 3, 0]) is False
    assert xs_history_should_reset([5]) is False
    assert xs_history_should_reset([]) is True  # chosen: vacuous truth


@pytest.mark.rule("v4_paged_dispatch_precheck")
def test_the_paged_arm_refuses_a_batch():
    assert v4_paged_dispatch_precheck(1) is None
    with pytest.raises(DispatchRefusal, match="bs=2 > 1 on the paged arm"):
        v4_paged_dispatch_precheck(2)
