"""The kernel layouts (gpu/layouts.py): each converter round-trips the front-aligned verify
batch, the worked example of docs/kernels.md holds array for array, and malformed layout
arrays are refused with a message naming the field."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raggedspec.gpu import layouts as L
from raggedspec.kernel_cases import build_batch, cases

LAYOUT_CASES = st.sampled_from(["varlen", "kvcache", "paged", "padded"]).flatmap(
    lambda layout: st.tuples(st.just(layout), cases(layout))
)


def _same(a: L.VerifyBatch, b: L.VerifyBatch) -> None:
    assert (a.q_lens, a.kv_lens, a.window) == (b.q_lens, b.kv_lens, b.window)
    for name in ("q", "k", "v"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert torch.equal(x, y), name


def _expected(batch: L.VerifyBatch, x) -> L.VerifyBatch:
    """What reading the layout back gives: dead cells the layout does not carry are zero
    (padded carries all; kvcache carries the query padding, and dense its dead columns)."""
    if isinstance(x, L.Padded):
        return batch
    zeroed = L.zero_dead(batch)
    if isinstance(x, L.KvCache):
        k, v = (batch.k, batch.v) if x.block_table is None else (zeroed.k, zeroed.v)
        return L.VerifyBatch(batch.q, k, v, batch.q_lens, batch.kv_lens, batch.window)
    return zeroed


@pytest.mark.rule("kernel batch layouts varlen / kvcache / paged / padded")
@settings(max_examples=60)
@given(drawn=LAYOUT_CASES, dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_round_trip(drawn, dtype):
    """from(to(b)) is b (dead cells included where the layout carries them, zeroed where it
    does not), and to(from(to(b))) rebuilds the same layout arrays."""
    layout, case = drawn
    batch = build_batch(case, dtype, "cpu")
    arrays = L.to_layout(batch, layout, case.page_size, seed=case.seed)
    back = L.from_layout(arrays)
    _same(back, _expected(batch, arrays))
    again = L.to_layout(back, layout, case.page_size, seed=case.seed)
    for f in arrays.__dataclass_fields__:
        x, y = getattr(arrays, f), getattr(again, f)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f
        else:
            assert x == y, f


@pytest.mark.rule("kernel batch layouts varlen / kvcache / paged / padded")
@settings(max_examples=40)
@given(drawn=LAYOUT_CASES)
def test_output_round_trip(drawn):
    """A kernel output in the layout's shape maps back to the canonical output on the live
    query slots, zero on the dead ones."""
    layout, case = drawn
    batch = build_batch(case, torch.float32, "cpu")
    arrays = L.to_layout(batch, layout, case.page_size, seed=case.seed)
    canonical = L.zero_dead(batch).q  # stands for an output [B, Hq, t_q, D]
    if isinstance(arrays, L.Varlen | L.Paged):
        out = arrays.q  # packed live queries, in the layout's own order
    elif isinstance(arrays, L.KvCache):
        out = batch.q.transpose(1, 2)
    else:
        out = batch.q
    assert torch.equal(arrays.output_to_batch(out), canonical)


def _example() -> L.VerifyBatch:
    """docs/kernels.md's worked example: rows with 2, 0 and 1 queries over 5, 3 and 1 keys,
    window 3, Hq 2, Hk 1, D 1; key value = 10 * row + position, dead cells -1."""
    kv_lens, q_lens = [5, 3, 1], [2, 0, 1]
    k = torch.full((3, 1, 5, 1), -1.0)
    for i, n in enumerate(kv_lens):
        k[i, 0, 5 - n :, 0] = torch.arange(n) + 10.0 * i
    q = torch.zeros((3, 2, 2, 1))
    q[0, :, :, 0] = torch.tensor([3.0, 4.0])
    q[2, :, 1, 0] = 20.0
    return L.VerifyBatch(q, k, k.clone(), q_lens, kv_lens, window=3)


@pytest.mark.rule("kernel batch layouts varlen / kvcache / paged / padded")
def test_worked_example_varlen():
    x = L.to_varlen(_example())
    assert x.cu_seqlens_q.tolist() == [0, 2, 2, 3] and x.cu_seqlens_k.tolist() == [0, 5, 8, 9]
    assert (x.max_seqlen_q, x.max_seqlen_k, x.window_size) == (2, 5, (2, 0))
    assert x.k[:, 0, 0].tolist() == [0, 1, 2, 3, 4, 10, 11, 12, 20]
    assert x.q[:, 0, 0].tolist() == [3, 4, 20]


@pytest.mark.rule("kernel batch layouts varlen / kvcache / paged / padded")
def test_worked_example_kvcache():
    dense = L.to_kvcache(_example())
    assert dense.cache_leftpad.tolist() == [0, 2, 4] and dense.cache_seqlens.tolist() == [5, 5, 5]
    assert dense.k_cache[1, :, 0, 0].tolist() == [-1, -1, 10, 11, 12]
    assert dense.q.shape == (3, 2, 2, 1) and dense.q[2, :, 0, 0].tolist() == [0, 20]
    paged = L.to_kvcache(_example(), page_size=2, seed=0)
    assert paged.cache_seqlens.tolist() == [5, 3, 1] and paged.cache_leftpad is None
    table = paged.block_table.tolist()
    for i, keys in enumerate([[0, 1, 2, 3, 4], [10, 11, 12], [20]]):
        read = [paged.k_cache[table[i][p // 2], p % 2, 0, 0].item() for p in range(len(keys))]
        assert read == keys


@pytest.mark.rule("kernel batch layouts varlen / kvcache / paged / padded")
def test_worked_example_paged():
    x = L.to_paged(_example(), page_size=2, seed=0)
    assert x.qo_indptr.tolist() == [0, 2, 2, 3] and x.kv_indptr.tolist() == [0, 3, 5, 6]
    assert x.kv_last_page_len.tolist() == [1, 1, 1] and x.window_left == 2
    assert x.k_pages.shape == (7, 2, 1, 1)  # 6 pages in use and one spare
    pages = x.kv_indices.tolist()
    assert len(set(pages)) == 6 and all(0 <= p < 7 for p in pages)  # six distinct pages
    row0 = x.kv_indices[0:3].tolist()
    assert x.k_pages[row0].flatten()[:5].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.rule("kernel batch layouts varlen / kvcache / paged / padded")
def test_worked_example_padded():
    x = L.to_padded(_example())
    assert x.attention_mask.int().tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1]]
    assert x.position_ids.tolist() == [[3, 4], [-1, -1], [-1, 0]]
    assert x.sliding_window == 3


@pytest.mark.rule("kernel batch layouts varlen / kvcache / paged / padded")
def test_sinks_travel_in_the_padded_layout_only():
    batch = _example()
    sinks = torch.tensor([0.5, -1.0])
    with_sinks = L.VerifyBatch(batch.q, batch.k, batch.v, batch.q_lens, batch.kv_lens, 3, sinks)
    padded = L.to_padded(with_sinks)
    assert padded.call()[1]["sinks"] is sinks
    assert torch.equal(L.from_padded(padded).sinks, sinks)
    assert "sinks" not in L.to_padded(batch).call()[1]
    for layout in ("varlen", "kvcache", "paged"):
        with pytest.raises(ValueError, match=f"the {layout} layout has no argument for"):
            L.to_layout(with_sinks, layout, page_size=2)


@pytest.mark.rule("kernel batch layouts varlen / kvcache / paged / padded")
@pytest.mark.parametrize(
    "mutate, field",
    [
        (
            lambda x: setattr(x, "cu_seqlens_q", torch.tensor([1, 2, 2, 3], dtype=torch.int32)),
            "cu_seqlens_q",
        ),
        (
            lambda x: setattr(x, "cu_seqlens_k", torch.tensor([0, 5, 4, 9], dtype=torch.int32)),
            "cu_seqlens_k",
        ),
        (lambda x: setattr(x, "window_size", (2, 1)), "window_size"),
    ],
)
def test_varlen_refusals(mutate, field):
    x = L.to_varlen(_example())
    mutate(x)
    with pytest.raises(ValueError, match=field):
        L.from_varlen(x)


@pytest.mark.rule("kernel batch layouts varlen / kvcache / paged / padded")
def test_paged_refusals():
    x = L.to_paged(_example(), page_size=2)
    x.kv_last_page_len = torch.tensor([0, 1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_last_page_len 0 with 3 pages"):
        L.from_paged(x)
    x = L.to_paged(_example(), page_size=2)
    x.kv_indices = x.kv_indices + 7
    with pytest.raises(ValueError, match="kv_indices"):
        L.from_paged(x)


@pytest.mark.rule("kernel batch layouts varlen / kvcache / paged / padded")
def test_padded_and_kvcache_refusals():
    x = L.to_padded(_example())
    x.attention_mask = torch.tensor(
        [[1, 1, 1, 1, 1], [1, 0, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool
    )
    with pytest.raises(ValueError, match="attention_mask row 1 is not left-padded"):
        L.from_padded(x)
    x = L.to_padded(_example())
    x.position_ids = torch.tensor([[2, 3], [-1, -1], [-1, 0]])
    with pytest.raises(ValueError, match="position_ids row 0"):
        L.from_padded(x)
    y = L.to_kvcache(_example())
    y.cache_leftpad = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="row 2: cache_leftpad 6"):
        L.from_kvcache(y)
    with pytest.raises(ValueError, match="row 0: q_len 3 must lie in"):
        L.VerifyBatch(
            torch.zeros(1, 1, 3, 1), torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1), [3], [2]
        )


@pytest.mark.rule("kernel batch layouts varlen / kvcache / paged / padded")
def test_each_call_passes_the_kernels_own_argument_names():
    """`call()` gives the positional arguments and keywords of each kernel's signature (the
    module docstring's `*.call()`), `causal=True` for every causal verify."""
    batch = _example()
    scale = 1.0  # D = 1
    x = L.to_varlen(batch)
    args, kw = x.call()
    assert args == (x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, 2, 5)
    assert kw == {"softmax_scale": scale, "causal": True, "window_size": (2, 0)}
    y = L.to_kvcache(batch, page_size=2)
    args, kw = y.call()
    assert args == (y.q, y.k_cache, y.v_cache)
    assert kw == {"cache_seqlens": y.cache_seqlens, "cache_leftpad": None,
                  "block_table": y.block_table, "softmax_scale": scale, "causal": True,
                  "window_size": (2, 0)}
    p = L.to_paged(batch, page_size=2)
    args, kw = p.call()
    assert args == (p.q, p.k_pages, p.v_pages, p.qo_indptr, p.kv_indptr, p.kv_indices,
                    p.kv_last_page_len)
    assert kw == {"page_size": 2, "causal": True, "window_left": 2, "sm_scale": scale}
    d = L.to_padded(batch)
    args, kw = d.call()
    assert args == (d.q, d.k, d.v, d.attention_mask, d.position_ids)
    assert kw == {"sliding_window": 3, "softmax_scale": scale}
