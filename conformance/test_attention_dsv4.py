"""DeepSeek V4's union attention (masks-and-scheduling.md §4, §5 fixture, §12), on the reference
and the port (`gpu.attention.dsv4_attention`) through one test body (`impl`): the refusals, the
rules (raw_prefix accounting, the Standard layer, the caller mask, the mask-path counters), the
§5 fixture, and the properties that a ragged row equals the row alone, with one KV head or
several, whatever its dead prefix holds. Then each side's own input contract, the port against
the reference on random batches, and the §4 / §12 predicates only the reference states.

Oracle: `union_attention_oracle` (`conformance/helpers.py`) recomputes each row *alone*, query by
query, from absolute positions (raw keys `p` with `qp - window < p <= qp`, compressed blocks
`b < floor((qp + 1) / ratio)`), softmax with a denominator-only sink, in plain Python loops.

Tolerances (float64): against the oracle, and a ragged batch against the row alone: 1e-12,
relative and absolute (the same valid (logit, value) pairs in another summation order; the
spec's 1.5e-3 is a candle F16 artefact). Dead-prefix perturbation, uniform `row_q0` vs None,
`raw_prefix` accounting, a Standard layer vs no compressed keys: bit-exact (masked columns
contribute exp(-inf) = 0 exactly; the others are the same computation). The port against the
reference: within 1e-12 relative to the output's magnitude; float32 / bfloat16 within twice a
plain same-dtype implementation's error plus 4 eps(dtype) at the values' scale.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raggedspec.conformance.helpers import (
    assert_refused,
    attention_rules,
    batch_of,
    each_implementation,
    make_rows,
    naive_attention,
    softmax_oracle,
    union_attention_oracle,
)
from raggedspec.conformance.strategies import (
    compress_ratios,
    corner_lengths,
    leads_of,
    ragged_lengths,
    uniform_lengths,
)
from raggedspec.reference import attention as ref
from raggedspec.reference.attention import Dsv4AttentionConfig as Cfg
from raggedspec.reference.errors import DispatchRefusal, MaskRefusal
from raggedspec.reference.masks import compressed_validity, raw_keep_span

TOL = 1e-12
ratios = st.sampled_from([0, 4, 8, 16, 128])
case = dict(t_q=st.integers(1, 9), window=st.integers(1, 128), ratio=ratios,
            heads=st.integers(1, 3), with_sinks=st.booleans(), extra_c=st.integers(0, 2),
            seed=st.integers(0, 2**32 - 1))


def _plain(b=1, t_q=1, t_k=4, d=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(b, 2, t_q, d)), rng.normal(size=(b, 1, t_k, d))


def alone(dsv4, row, ratio: int, window: int, sinks):
    """One sequence run by itself through the implementation's `dsv4_attention`."""
    comp = None if row.comp is None else row.comp[None, None]
    return dsv4(row.q[None], row.keys[None, None], row.vals[None, None], comp, None,
                Cfg(ratio, window), sinks)[0]


# ----------------------------------------------------------------------------- refusals


@each_implementation
@pytest.mark.rule("dsv4_attention refusals", "dsv4_attention, port")
def test_dsv4_refuses_more_queries_than_keys_and_a_raw_prefix_past_the_window_base(impl):
    dsv4 = attention_rules(impl).dsv4_attention
    q, k = _plain(t_q=5, t_k=4)
    with pytest.raises(MaskRefusal, match="^5 query rows against only 4 keys$"):
        dsv4(q, k, k, None, None, Cfg(0, 8))
    # raw_prefix counts toward t_k_full: 5 queries against 1 + 4 keys pass this check (and
    # then meet the raw_prefix refusal, since the window reaches column 0)
    with pytest.raises(MaskRefusal, match="are NOT held"):
        dsv4(q, k, k, None, None, Cfg(0, 128, raw_prefix=1))
    q4, _ = _plain(t_q=4, t_k=4)
    assert dsv4(q4, k, k, None, None, Cfg(0, 8)).shape == (1, 2, 4, 4)
    q, k = _plain(t_q=1, t_k=6)  # t_k_full = 4 + 6 = 10, window 8 -> raw_base 2 < raw_prefix 4
    with pytest.raises(MaskRefusal) as e:
        dsv4(q, k, k, None, None, Cfg(0, 8, raw_prefix=4))
    assert str(e.value) == ("raw keys [2, 4) reachable by the window are NOT held: "
                            "raw_prefix 4 > raw_base 2")


@each_implementation
@pytest.mark.rule("dsv4_attention refusals", "dsv4_attention, port")
def test_dsv4_passes_on_the_ragged_row_refusals(impl):
    dsv4 = attention_rules(impl).dsv4_attention
    q, k = _plain(b=3, t_q=1, t_k=7)
    for rows, words in (([7, 4, 2], "AHEAD of the batch"), ([6, 4], "for a batch of"),
                        ([5, 4, 2], "no row sits at the batch's shared end column")):
        with pytest.raises(DispatchRefusal, match=words):
            dsv4(q, k, k, None, None, Cfg(4, 4, row_q0=rows))


@each_implementation
@pytest.mark.rule("dsv4_attention with several KV heads", "dsv4_attention, port")
def test_dsv4_refuses_kv_heads_that_do_not_divide_the_query_heads(impl):
    dsv4 = attention_rules(impl).dsv4_attention
    q, k = _plain()
    k2 = np.repeat(k, 2, axis=1)
    with pytest.raises(ValueError, match="^KV heads 2 must divide query heads 3$"):
        dsv4(np.repeat(q[:, :1], 3, axis=1), k2, k2, None, None, Cfg(0, 4))
    # the head check comes before the key-count refusal: 3 queries against 2 keys
    with pytest.raises(ValueError, match="^KV heads 2 must divide query heads 3$"):
        dsv4(np.zeros((1, 3, 3, 1)), np.zeros((1, 2, 2, 1)), np.zeros((1, 2, 2, 1)), None, None,
             Cfg(0, 4))
    with pytest.raises(ValueError, match=r"compressed_kv .* must be \[B=1,2,t_c"):
        dsv4(q, k2, k2, np.zeros((1, 1, 1, q.shape[3])), None, Cfg(4, 4))


# ----------------------------------------------------------------------------- rules


@each_implementation
@pytest.mark.rule("dsv4_attention", "dsv4_attention, port")
def test_raw_prefix_is_pure_accounting(impl):
    dsv4 = attention_rules(impl).dsv4_attention
    rows = make_rows([20, 13, 17], 3, 4, 2, 8, np.random.default_rng(11), extra_c=1)
    q, k, v, comp = batch_of(rows, 3, 4, extra_c=1)
    base, _ = raw_keep_span(3, 6, k.shape[2])
    assert base > 2  # non-degeneracy: there is a prefix to drop
    full = dsv4(q, k, v, comp, None, Cfg(4, 6, 0, [20, 13, 17]))
    for prefix in range(1, base + 1):
        cut = dsv4(q, k[:, :, prefix:], v[:, :, prefix:], comp, None,
                   Cfg(4, 6, prefix, [20, 13, 17]))
        assert np.array_equal(cut, full)


@each_implementation
@pytest.mark.rule("dsv4_attention Standard layer forces compressed_kv None", "dsv4_attention, port")
def test_a_standard_layer_never_reads_compressed_keys(impl):
    dsv4 = attention_rules(impl).dsv4_attention
    q, k = _plain(b=2, t_q=3, t_k=9, seed=3)
    comp = np.random.default_rng(12).normal(size=(2, 1, 2, 4))
    for ratio in (0, 1):  # config ratio 0 and internal ratio 1 are Standard
        plain = dsv4(q, k, k, None, None, Cfg(ratio, 5))
        assert np.array_equal(dsv4(q, k, k, comp, None, Cfg(ratio, 5)), plain)
    # ... even compressed keys of a shape no layer could read
    assert np.array_equal(dsv4(q, k, k, np.zeros(3), None, Cfg(1, 5)), plain)
    # negative controls: a CSA layer reads them, and a ratio-2 layer checks them
    assert np.abs(dsv4(q, k, k, comp, None, Cfg(4, 5))
                  - dsv4(q, k, k, None, None, Cfg(4, 5))).max() > 1e-2
    with pytest.raises(ValueError):
        dsv4(q, k, k, np.zeros(3), None, Cfg(2, 5))


@each_implementation
@pytest.mark.rule("dsv4_attention", "dsv4_attention, port")
def test_the_caller_mask_is_folded_in(impl):
    dsv4 = attention_rules(impl).dsv4_attention
    row = make_rows([9], 2, 4, 2, 4, np.random.default_rng(13))[0]
    q, k, v, comp = batch_of([row], 2, 4)
    cfg = Cfg(4, 4)
    t_k_full, t_c = k.shape[2], comp.shape[2]
    caller = np.zeros((2, t_k_full + t_c))
    caller[:, t_k_full - 2] = -np.inf  # kill raw position 9 for both queries
    caller[1, t_k_full] = -np.inf  # kill compressed block 0 for query 1
    got = dsv4(q, k, v, comp, caller, cfg)
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
    assert np.abs(got - dsv4(q, k, v, comp, None, cfg)).max() > 1e-2


@each_implementation
@pytest.mark.rule("dsv4_attention uniform row_q0", "dsv4 uniform path never ragged, port")
def test_a_uniform_row_q0_is_bit_identical_to_none_over_54_configs(impl):
    rules = attention_rules(impl)
    configs = 0
    for b in (1, 3):
        for t_q in (1, 2, 5):
            for window in (1, 4, 128):
                for ratio in (0, 4, 8):
                    rng = np.random.default_rng(configs)
                    rows = make_rows([13] * b, t_q, ratio, 2, 4, rng, extra_c=1)
                    batch = batch_of(rows, t_q, ratio, extra_c=1)
                    sinks = rng.normal(size=2)
                    rules.reset_stats()
                    none = rules.dsv4_attention(*batch, None, Cfg(ratio, window), sinks)
                    uni = rules.dsv4_attention(*batch, None, Cfg(ratio, window, 0, [13] * b),
                                               sinks)
                    assert np.array_equal(none, uni)
                    assert rules.mask_stats() == {"uniform": 2, "ragged": 0}
                    configs += 1
    assert configs >= 54


@each_implementation
@pytest.mark.rule("dsv4_attention uniform row_q0", "dsv4 uniform path never ragged, port")
def test_the_ragged_path_counts_every_call(impl):
    rules = attention_rules(impl)
    q, k = np.zeros((3, 1, 1, 1)), np.ones((3, 1, 7, 1))
    cfg = Cfg(4, 4, row_q0=[6, 4, 2])  # q0 = 7 - 1 = 6: row 0 at the end
    rules.reset_stats()
    for _ in range(2):
        rules.dsv4_attention(q, k, k, None, None, cfg)
        rules.dsv4_attention(q, k, k, None, None, Cfg(4, 4))
    assert rules.mask_stats() == {"uniform": 2, "ragged": 2}


# ----------------------------------------------------------------------------- §5 fixture


@each_implementation
@pytest.mark.rule("dsv4_attention", "dsv4_attention, port")
def test_repository_ragged_fixture_lens_10_8_5(impl):
    dsv4 = attention_rules(impl).dsv4_attention
    lens, t_q, window, ratio = [10, 8, 5], 2, 10, 4
    rng = np.random.default_rng(2024)
    rows = make_rows(lens, t_q, ratio, 2, 8, rng, extra_c=1)
    q, k, v, comp = batch_of(rows, t_q, ratio, extra_c=1)
    t_k_full, t_c = k.shape[2], comp.shape[2]
    assert (t_k_full, t_c, leads_of(lens)) == (12, 4, [0, 2, 5])
    sinks = rng.normal(size=2)
    ragged_cfg = Cfg(ratio, window, 0, lens)
    got = dsv4(q, k, v, comp, None, ragged_cfg, sinks)
    # (a) the ragged batch equals each row run alone (and the position oracle)
    for i, row in enumerate(rows):
        np.testing.assert_allclose(got[i], alone(dsv4, row, ratio, window, sinks), rtol=TOL,
                                   atol=TOL)
        np.testing.assert_allclose(got[i], union_attention_oracle(row, window, ratio, sinks),
                                   rtol=TOL, atol=TOL)
    # (b) negative control: with row_q0 = None the shorter rows differ (> 1e-2)
    blind = dsv4(q, k, v, comp, None, Cfg(ratio, window), sinks)
    assert np.array_equal(blind[0], got[0])  # row 0 has no lead
    for i in (1, 2):
        assert np.abs(blind[i] - got[i]).max() > 1e-2
    # (c) perturbing the dead prefix (and the rows' incomplete compressed blocks) changes
    #     nothing, exactly
    q2, k2, v2, comp2 = batch_of(rows, t_q, ratio, dead_rng=np.random.default_rng(1), extra_c=1)
    assert not np.array_equal(k2, k) and not np.array_equal(comp2, comp)
    assert np.abs(dsv4(q2, k2, v2, comp2, None, ragged_cfg, sinks) - got).max() == 0.0
    # (d) non-degeneracy: the per-row compressed thresholds differ from the batch's, some
    #     lead reaches into the kept raw span, and the span was narrowed
    raw_base, _ = raw_keep_span(t_q, window, t_k_full)
    assert raw_base == 1 and max(leads_of(lens)) > raw_base
    q0 = t_k_full - t_q
    assert compressed_validity(t_q, q0, t_c, ratio).sum(axis=1).tolist() == [2, 3]
    assert [compressed_validity(t_q, r, t_c, ratio).sum(axis=1).tolist() for r in lens] == [
        [2, 3], [2, 2], [1, 1]]


# ----------------------------------------------------------------------------- properties


@pytest.mark.parametrize("impl", ["reference", pytest.param("port", marks=pytest.mark.slow)])
@pytest.mark.rule("dsv4_attention", "dsv4_attention, port")
@given(lengths=ragged_lengths(1, 6, 1, 80), **case)
def test_a_ragged_batch_gives_each_row_its_solo_attention(impl, lengths, t_q, window, ratio,
                                                          heads, with_sinks, extra_c, seed):
    """(The port's run is slow: seven dsv4 calls an example; its default-run guarantee is the
    comparison with the reference on random ragged batches below.)"""
    dsv4 = attention_rules(impl).dsv4_attention
    rng = np.random.default_rng(seed)
    rows = make_rows(lengths, t_q, ratio, heads, 4, rng, extra_c)
    sinks = rng.normal(size=heads) if with_sinks else None
    q, k, v, comp = batch_of(rows, t_q, ratio, extra_c=extra_c)
    got = dsv4(q, k, v, comp, None, Cfg(ratio, window, 0, lengths), sinks)
    for i, row in enumerate(rows):
        np.testing.assert_allclose(got[i], alone(dsv4, row, ratio, window, sinks), rtol=TOL,
                                   atol=TOL)
        np.testing.assert_allclose(got[i], union_attention_oracle(row, window, ratio, sinks),
                                   rtol=TOL, atol=TOL)


@pytest.mark.parametrize("impl", ["reference", pytest.param("port", marks=pytest.mark.slow)])
@pytest.mark.rule("dsv4_attention with several KV heads", "dsv4_attention, port")
@given(lengths=ragged_lengths(1, 4, 1, 40), t_q=st.integers(1, 5), window=st.integers(1, 32),
       ratio=ratios, hk=st.sampled_from([2, 4]), group=st.sampled_from([1, 2, 4, 8]),
       seed=st.integers(0, 2**32 - 1))
def test_with_several_kv_heads_query_head_h_reads_kv_head_h_div_group(impl, lengths, t_q, window,
                                                                       ratio, hk, group, seed):
    """GQA: `k, v [B,Hk,t_k,D]`, `compressed_kv [B,Hk,t_c,D]`, `H = Hk * group`. Query heads
    `[j * group, (j + 1) * group)` read KV head j only (`h // group`): the batched result on
    those heads equals, within 1e-12, the one-KV-head call on KV head j alone and the loop
    oracle of each row alone over KV head j. Any other mapping moves a head's output. (The
    port's run is slow; in the default run its GQA mapping is checked over the in-place
    layout, test_attention_in_place.py.)"""
    dsv4 = attention_rules(impl).dsv4_attention
    rng = np.random.default_rng(seed)
    per_kv = [make_rows(lengths, t_q, ratio, group, 4, rng) for _ in range(hk)]
    parts = [batch_of(rows, t_q, ratio) for rows in per_kv]
    q, k, v = (np.concatenate([p[n] for p in parts], axis=1) for n in range(3))
    comp = None if ratio <= 1 else np.concatenate([p[3] for p in parts], axis=1)
    sinks = rng.normal(size=hk * group)
    cfg = Cfg(ratio, window, 0, lengths)
    got = dsv4(q, k, v, comp, None, cfg, sinks)
    assert got.shape == (len(lengths), hk * group, t_q, 4)
    for j, (qj, kj, vj, cj) in enumerate(parts):
        heads = slice(j * group, (j + 1) * group)
        np.testing.assert_allclose(got[:, heads], dsv4(qj, kj, vj, cj, None, cfg, sinks[heads]),
                                   rtol=TOL, atol=TOL)
        for i, row in enumerate(per_kv[j]):
            np.testing.assert_allclose(got[i, heads],
                                       union_attention_oracle(row, window, ratio, sinks[heads]),
                                       rtol=TOL, atol=TOL)


@each_implementation
@pytest.mark.rule("dsv4_attention", "dsv4_attention, port")
@given(lengths=ragged_lengths(1, 6, 1, 80), **case)
def test_the_dead_prefix_never_reaches_any_output(impl, lengths, t_q, window, ratio, heads,
                                                  with_sinks, extra_c, seed):
    dsv4 = attention_rules(impl).dsv4_attention
    rng = np.random.default_rng(seed)
    rows = make_rows(lengths, t_q, ratio, heads, 4, rng, extra_c)
    sinks = rng.normal(size=heads) if with_sinks else None
    cfg = Cfg(ratio, window, 0, lengths)
    zero = dsv4(*batch_of(rows, t_q, ratio, extra_c=extra_c), None, cfg, sinks)
    noise = batch_of(rows, t_q, ratio, dead_rng=np.random.default_rng(seed + 1), extra_c=extra_c)
    assert np.array_equal(dsv4(*noise, None, cfg, sinks), zero)


@each_implementation
@pytest.mark.rule("dsv4_attention uniform row_q0", "dsv4 uniform path never ragged, port")
@given(lengths=st.one_of(uniform_lengths(1, 6, 1, 80),
                         ragged_lengths(2, 6, 1, 80, force_ragged=True)), **case)
def test_the_mask_path_is_ragged_exactly_when_the_rows_are(impl, lengths, t_q, window, ratio,
                                                          heads, with_sinks, extra_c, seed):
    """A uniform `row_q0` is bit-identical to None and never reaches the ragged path; a
    ragged one always does (counted)."""
    rules = attention_rules(impl)
    rng = np.random.default_rng(seed)
    rows = make_rows(lengths, t_q, ratio, heads, 4, rng, extra_c)
    sinks = rng.normal(size=heads) if with_sinks else None
    batch = batch_of(rows, t_q, ratio, extra_c=extra_c)
    rules.reset_stats()
    got = rules.dsv4_attention(*batch, None, Cfg(ratio, window, 0, lengths), sinks)
    if len(set(lengths)) == 1:
        none = rules.dsv4_attention(*batch, None, Cfg(ratio, window), sinks)
        assert np.array_equal(none, got)
        assert rules.mask_stats() == {"uniform": 2, "ragged": 0}
    else:
        assert rules.mask_stats() == {"uniform": 0, "ragged": 1}


# ----------------------------------------------------------------------------- input contracts


def refused(call, message):
    assert_refused(ValueError, call, message)


@pytest.mark.rule("dsv4_attention refusals")
def test_the_reference_refuses_each_malformed_input_with_its_own_message():
    cfg, z = Cfg(0, 4), np.zeros
    q, kv = z((1, 1, 1, 1)), z((1, 1, 2, 1))
    f = ref.dsv4_attention
    refused(lambda: f(z((1, 1, 1)), kv, kv, None, None, cfg),
            "q (1, 1, 1), k (1, 1, 2, 1), v (1, 1, 2, 1) must all be rank 4")
    refused(lambda: f(q, z((1, 1, 2)), kv, None, None, cfg),
            "q (1, 1, 1, 1), k (1, 1, 2), v (1, 1, 2, 1) must all be rank 4")
    refused(lambda: f(q, kv, z((1, 1, 2)), None, None, cfg),
            "q (1, 1, 1, 1), k (1, 1, 2, 1), v (1, 1, 2) must all be rank 4")
    # only k and v differ; only the batch; only the head dim
    refused(lambda: f(q, z((1, 1, 3, 1)), kv, None, None, cfg),
            "k (1, 1, 3, 1) and v (1, 1, 2, 1) must both be [B=1,Hk,t_k,D=1]")
    refused(lambda: f(z((2, 1, 1, 1)), kv, kv, None, None, cfg),
            "k (1, 1, 2, 1) and v (1, 1, 2, 1) must both be [B=2,Hk,t_k,D=1]")
    refused(lambda: f(z((1, 1, 1, 2)), z((1, 1, 2, 3)), z((1, 1, 2, 3)), None, None, cfg),
            "k (1, 1, 2, 3) and v (1, 1, 2, 3) must both be [B=1,Hk,t_k,D=2]")
    refused(lambda: f(q, kv, kv, None, None, Cfg(0, 4, raw_prefix=-1)),
            "raw_prefix -1 and compress_ratio 0 must be >= 0")
    refused(lambda: f(q, kv, kv, None, None, Cfg(-4, 4)),
            "raw_prefix 0 and compress_ratio -4 must be >= 0")


@pytest.mark.rule("dsv4_attention, port")
def test_the_port_refuses_each_malformed_input_with_its_own_message():
    torch = pytest.importorskip("torch")
    from raggedspec.gpu.attention import Dsv4AttentionConfig, dsv4_attention

    z = torch.zeros
    q, k = z((2, 4, 3, 8)), z((2, 2, 5, 8))
    cfg = Dsv4AttentionConfig(compress_ratio=4, sliding_window=3)
    for args, shapes in (((q[0], k, k), "q [4, 3, 8], k [2, 2, 5, 8], v [2, 2, 5, 8]"),
                         ((q, k[0], k), "q [2, 4, 3, 8], k [2, 5, 8], v [2, 2, 5, 8]"),
                         ((q, k, k[0]), "q [2, 4, 3, 8], k [2, 2, 5, 8], v [2, 5, 8]")):
        refused(lambda a=args: dsv4_attention(*a, None, None, cfg), f"{shapes} must all be rank 4")
    msg = "k {} and v {} must both be [B=2,Hk,t_k,D=8]"
    for kk, vv in ((k, k[:, :, :4]), (k[:1], k[:1]), (k[..., :4], k[..., :4])):
        refused(lambda kk=kk, vv=vv: dsv4_attention(q, kk, vv, None, None, cfg),
                msg.format(list(kk.shape), list(vv.shape)))
    for heads in (3, 0):
        refused(lambda h=heads: dsv4_attention(q, z((2, h, 5, 8)), z((2, h, 5, 8)), None, None,
                                               cfg), f"KV heads {heads} must divide query heads 4")
    for prefix, ratio in ((-1, 4), (0, -1)):
        refused(lambda p=prefix, r=ratio: dsv4_attention(q, k, k, None, None,
                                                         Dsv4AttentionConfig(r, 3, p)),
                f"raw_prefix {prefix} and compress_ratio {ratio} must be >= 0")
    for comp in (z((2, 2, 3)), z((1, 2, 3, 8)), z((2, 1, 3, 8)), z((2, 2, 3, 4))):
        refused(lambda c=comp: dsv4_attention(q, k, k, c, None, cfg),
                f"compressed_kv {list(comp.shape)} must be [B=2,2,t_c,D=8]")


# ----------------------------------------------------------------------------- §4 step 9, §12


@pytest.mark.rule("dsv4_attention absorbed-decode gate")
def test_the_absorbed_decode_gate():
    assert ref.absorbed_decode_eligible(1, 1, True) is True
    assert ref.absorbed_decode_eligible(1, 1, False) is False  # sinks are required
    assert ref.absorbed_decode_eligible(2, 1, True) is False
    assert ref.absorbed_decode_eligible(1, 2, True) is False
    assert ref.absorbed_decode_eligible(1, 1, True, no_absorbed_decode=True) is False


@pytest.mark.rule("dsv4_attention Standard layer forces compressed_kv None", "dsv4_attention, port")
def test_a_standard_layer_is_config_ratio_0_or_internal_ratio_1_only():
    assert [ref.is_standard_layer(r) for r in (0, 1, 2, 4, 128)] == [True, True, False, False,
                                                                     False]
    torch = pytest.importorskip("torch")  # noqa: F841 (the port needs it)
    from raggedspec.gpu.attention import is_standard_layer

    assert [is_standard_layer(r) for r in (0, 1, 2, 4, 128)] == [True, True, False, False, False]


@pytest.mark.rule("xs-history reset")
def test_the_xs_history_resets_only_when_every_offset_is_zero():
    assert ref.xs_history_should_reset([0, 0, 0]) is True
    assert ref.xs_history_should_reset([0]) is True
    assert ref.xs_history_should_reset([0, 3, 0]) is False
    assert ref.xs_history_should_reset([5]) is False
    assert ref.xs_history_should_reset([]) is True  # chosen: vacuous truth


@pytest.mark.rule("v4_paged_dispatch_precheck")
def test_the_paged_arm_refuses_a_batch_takes_an_empty_one_and_no_negative_one():
    assert ref.v4_paged_dispatch_precheck(1) is None
    assert ref.v4_paged_dispatch_precheck(0) is None
    with pytest.raises(DispatchRefusal, match="bs=2 > 1 on the paged arm"):
        ref.v4_paged_dispatch_precheck(2)
    refused(lambda: ref.v4_paged_dispatch_precheck(-1), "batch size -1 must be >= 0")


# ----------------------------------------------------------------------------- the port


@st.composite
def dsv4_case(draw):
    """A front-aligned dsv4 batch built here (independently of the port's layout code):
    rows of own length `n_i` (this step's `t_q` tokens included) ending at the shared column
    `N = max n_i`, zero dead prefix, start-anchored compressed keys per row (blocks past a
    row's own count are noise: the mask must kill them). Plus a config, a caller mask, sinks,
    and variants reaching each refusal."""
    ratio = draw(compress_ratios())
    t_q = draw(st.integers(1, 4))
    max_len = 300 if ratio == 128 else 60
    own = [n + t_q for n in draw(corner_lengths(1, 4, max_len, boundaries=False))]
    b, n_max = len(own), max(own)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    k, v = np.zeros((b, 1, n_max, 8)), np.zeros((b, 1, n_max, 8))
    for i, n in enumerate(own):
        k[i, 0, n_max - n:] = rng.normal(size=(n, 8))
        v[i, 0, n_max - n:] = rng.normal(size=(n, 8))
    comp = None
    if ratio > 1 and n_max // ratio > 0:
        comp = rng.normal(size=(b, 1, n_max // ratio + draw(st.integers(0, 1)), 8)) * 3
    h = draw(st.sampled_from([1, 2, 4]))
    q = rng.normal(size=(b, h, t_q, 8))
    window = draw(st.sampled_from([0, 1, 3, 8, 128]))
    rows = {"own": [n - t_q for n in own], "none": None, "uniform": [n_max - t_q] * b,
            "bad": [n - t_q + 1 for n in own]}[draw(st.sampled_from(
                ["own", "own", "none", "uniform", "bad"]))]
    raw_prefix = draw(st.sampled_from([0, 0, 0, 1, 5]))
    if raw_prefix:  # the first raw_prefix columns are "already dropped"
        k, v = k[:, :, raw_prefix:], v[:, :, raw_prefix:]
    if draw(st.sampled_from([False, False, False, True])):  # more queries than keys: refused
        q = rng.normal(size=(b, h, n_max + 1, 8))
    caller = None
    if draw(st.booleans()):
        t_c = 0 if comp is None or ratio <= 1 else comp.shape[2]
        width = draw(st.sampled_from([n_max, n_max + t_c, n_max + 2]))
        caller = np.where(rng.random((q.shape[2], width)) < 0.9, 0.0, -np.inf)
    sinks = rng.normal(size=h) if draw(st.booleans()) else None
    return q, k, v, comp, caller, Cfg(ratio, window, raw_prefix, rows), sinks


@pytest.mark.rule("dsv4_attention, port")
@given(case=dsv4_case())
def test_the_ports_float64_dsv4_attention_matches_the_reference_including_refusals(case):
    from raggedspec.gpu.testing import assert_close64, assert_same_refusal, outcome

    p = outcome(attention_rules("port").dsv4_attention, *case)
    r = outcome(ref.dsv4_attention, *case)
    if assert_same_refusal(p, r, "dsv4_attention"):
        assert_close64(p[1], r[1], what="dsv4_attention")


def naive_dsv4(q, k, v, comp, cfg, sinks):
    """Same-dtype dsv4 on torch tensors: the reference's (exact) masks and narrowing, then the
    plain same-dtype attention."""
    import torch

    from raggedspec.reference import masks

    t_q = q.shape[2]
    t_k_full = cfg.raw_prefix + k.shape[2]
    window, q0 = max(cfg.sliding_window, 1), t_k_full - t_q
    base, keep = raw_keep_span(t_q, window, t_k_full)
    t_c = 0 if comp is None or cfg.compress_ratio <= 1 else comp.shape[2]
    valid = np.concatenate([masks.raw_validity(t_q, q0, base, keep, window),
                            masks.compressed_validity(t_q, q0, t_c, cfg.compress_ratio)], axis=1)
    rows = ref.resolve_ragged_rows(cfg.row_q0, q0, q.shape[0])
    mask = (np.where(valid, 0.0, -np.inf)[None, None] if rows is None else
            masks.ragged_union_mask(rows, q0, valid, base, keep, cfg.compress_ratio, t_c))
    rel = base - cfg.raw_prefix
    kk, vv = k[:, :, rel: rel + keep], v[:, :, rel: rel + keep]
    if t_c:
        kk, vv = torch.cat([kk, comp], 2), torch.cat([vv, comp], 2)
    return naive_attention(q, kk, vv, torch.from_numpy(mask).to(q.device), sinks)


@pytest.mark.rule("dsv4_attention, port")
@given(case=dsv4_case(), low=st.sampled_from(["float32", "bfloat16"]))
def test_the_ports_low_precision_dsv4_attention_is_within_twice_the_naive_error(case, low):
    torch = pytest.importorskip("torch")
    from raggedspec.gpu import attention as port
    from raggedspec.gpu.testing import (
        assert_dtype_bound,
        assert_same_refusal,
        outcome,
        representable,
        to_port,
    )

    dtype = getattr(torch, low)
    q, k, v, comp, _caller, cfg, sinks = (
        x if x is None or isinstance(x, Cfg) else representable(x, dtype) for x in case)
    r = outcome(ref.dsv4_attention, q, k, v, comp, None, cfg, sinks)
    args = [None if a is None else to_port(a, dtype) for a in (q, k, v, comp, sinks)]
    pcfg = port.Dsv4AttentionConfig(cfg.compress_ratio, cfg.sliding_window, cfg.raw_prefix,
                                    cfg.row_q0)
    p = outcome(port.dsv4_attention, *args[:4], None, pcfg, args[4])
    if assert_same_refusal(p, r, "dsv4_attention"):
        scale = max(float(np.abs(v).max()), 0.0 if comp is None else float(np.abs(comp).max()),
                    1e-30)
        assert_dtype_bound(p[1], naive_dsv4(*args[:4], cfg, args[4]), r[1], dtype, scale,
                           "dsv4_attention")


@pytest.mark.rule("dsv4_attention, port")
def test_the_ports_float64_caller_mask_keeps_its_values_on_both_mask_paths():
    """Zero queries make the logits the caller mask itself: one query over two keys with
    biases (-0.3, 0.1) weighs v0 = 1 and v1 = -1 by e^-0.3 and e^0.1. Row 1 of the ragged
    batch starts one column later (row_q0 0 of q0 1), so it reads key 1 alone: -1."""
    import math

    e0, e1 = math.exp(-0.3), math.exp(0.1)
    mixed = (e0 - e1) / (e0 + e1)
    z, k = np.zeros((2, 1, 1, 1)), np.zeros((2, 1, 2, 1))
    v = np.tile(np.array([1.0, -1.0]).reshape(1, 1, 2, 1), (2, 1, 1, 1))
    caller = np.array([[-0.3, 0.1]])
    for rows, want in ((None, [mixed, mixed]), ([1, 0], [mixed, -1.0])):
        got = attention_rules("port").dsv4_attention(z, k, v, None, caller, Cfg(0, 8, 0, rows))
        assert got.reshape(-1).tolist() == pytest.approx(want, rel=1e-15, abs=1e-15), rows


@pytest.mark.slow
@pytest.mark.rule("dsv4_attention, port")
def test_the_ports_dsv4_attention_builds_its_masks_on_the_queries_device():
    """torch's meta device runs on any machine. Slow only because the first meta-device
    comparison of a process loads torch's meta kernels (about 2 s)."""
    torch = pytest.importorskip("torch")
    from raggedspec.gpu.attention import Dsv4AttentionConfig, dsv4_attention

    q, k = torch.zeros((1, 2, 3, 4), device="meta"), torch.zeros((1, 1, 5, 4), device="meta")
    cfg = Dsv4AttentionConfig(compress_ratio=4, sliding_window=3)
    for comp in (torch.zeros((1, 1, 2, 4), device="meta"), None):
        out = dsv4_attention(q, k, k.clone(), comp, None, cfg)
        assert (out.device.type, tuple(out.shape)) == ("meta", (1, 2, 3, 4))
