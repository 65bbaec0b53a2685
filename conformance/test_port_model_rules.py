"""Port conformance: the rules of gpu.model that need no reference run: where and in which
dtype the port model puts its weights, caches and draft caches (checked on the meta device,
where a tensor left on the CPU shows), how the RoPE tables grow, and the exact text of every
ValueError the forward, the pooled attention, the layer and the MTP block raise on malformed
input (shapes, token ranges, cache layouts, row counts). The arithmetic itself is compared
with the reference in conformance/test_port_model.py."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import raggedspec.gpu.model as port
from raggedspec.gpu.cache import RaggedKv
from raggedspec.reference.model import TinyModel

MODEL = TinyModel()  # vocab 64, hidden 32, heads 2 x 16, one KV head, ratios (0, 4)
F64 = torch.float64


def exact(msg: str) -> str:
    return f"^{re.escape(msg)}$"


def weights(pm: port.TinyModel) -> list[torch.Tensor]:
    layers = [*pm.layers, pm.mtp.layer]
    out = [pm.embed, pm.norm, pm.lm_head, pm.mtp_heads.h_proj, pm.mtp_heads.e_proj,
           pm.mtp.hnorm, pm.mtp.enorm, pm.mtp.norm_out]
    return out + [getattr(layer, name) for layer in layers for name in layer.WEIGHTS]


def ref_weights(m: TinyModel) -> list[np.ndarray]:
    layers = [*m.layers, m.mtp.layer]
    out = [m.embed, m.norm, m.lm_head, m.mtp_heads.h_proj, m.mtp_heads.e_proj, m.mtp.hnorm,
           m.mtp.enorm, m.mtp.norm_out]
    return out + [getattr(layer, name) for layer in layers for name in port.DecoderLayer.WEIGHTS]


@pytest.mark.rule("the port model's weights, devices and dtypes, port")
def test_the_port_computes_with_the_references_own_weights():
    pm = port.TinyModel(MODEL)
    for got, want in zip(weights(pm), ref_weights(MODEL), strict=True):
        assert got.dtype == F64 and torch.equal(got, torch.from_numpy(want))


@pytest.mark.rule("the port model's weights, devices and dtypes, port")
def test_every_weight_cache_and_table_is_on_the_models_device_in_its_dtype():
    pm = port.TinyModel(MODEL, torch.float16, "meta")
    assert pm.device == torch.device("meta") and pm.dtype == torch.float16
    assert all(w.device.type == "meta" and w.dtype == torch.float16 for w in weights(pm))
    for got, want in zip(weights(pm), ref_weights(MODEL), strict=True):
        assert got.shape == want.shape
    assert pm.mtp.embed is pm.embed and pm.mtp.lm_head is pm.lm_head
    caches = pm.new_cache(3)
    assert len(caches) == pm.n_layers == 2
    for kv in caches:
        assert kv.k.shape == kv.v.shape == (3, 1, 512, 16) and kv.max_seq_len == 4096
        assert kv.k.device.type == kv.v.device.type == "meta" and kv.k.dtype == torch.float16
    assert pm.new_cache(1, capacity=1024)[0].capacity == 1024
    draft = pm.mtp.new_draft_cache(2)
    assert draft.k.shape == (2, 1, 16, 16) and draft.k.device.type == "meta"
    assert draft.k.dtype == draft.v.dtype == torch.float16 and draft.max_seq_len == 4096
    assert pm.mtp.new_draft_cache(1, 32).capacity == 32
    plain = port.TinyModel(MODEL)
    assert plain.device == torch.device("cpu") and plain.embed.dtype == F64
    assert pm.layers[1].ratio == 4 and pm.layers[0].theta == MODEL.layers[0].theta


@pytest.mark.rule("the port model's weights, devices and dtypes, port")
def test_rope_tables_grow_by_doubling_and_are_kept_per_theta():
    ropes = port.RopeTables(8, F64, "cpu", n_positions=4)
    a = ropes.get(10.0, 3)
    assert a.n_positions == 4 and ropes.get(10.0, 4) is a
    b = ropes.get(10.0, 9)
    assert b.n_positions == 16 and ropes.get(10.0, 16) is b and ropes.tables[10.0] is b
    c = ropes.get(20.0, 1)
    assert c.n_positions == 4 and ropes.get(10.0, 2) is b
    assert port.RopeTables(8, F64, "cpu").get(10.0, 1025).n_positions == 2048
    assert b.cos.dtype == F64 and c.cos.device.type == "cpu"


@pytest.mark.rule("the port model's weights, devices and dtypes, port")
def test_rms_norm_and_silu_compute_in_float32_for_the_half_dtypes():
    assert port.compute_dtype(torch.bfloat16) == port.compute_dtype(torch.float16) == torch.float32
    assert port.compute_dtype(F64) == F64 and port.compute_dtype(torch.float32) == torch.float32
    x = torch.tensor([[1.0, 3.0]], dtype=F64)
    got = port.rms_norm(x, torch.tensor([2.0, 1.0], dtype=F64), 0.0)
    assert torch.allclose(got, x / np.sqrt(5.0) * torch.tensor([2.0, 1.0], dtype=F64))
    assert port.rms_norm(x.bfloat16(), torch.ones(2), 0.0).dtype == torch.bfloat16
    y = torch.tensor([0.0, 2.0], dtype=F64)
    assert torch.allclose(port.silu(y), y / (1 + torch.exp(-y)))
    assert port.silu(y.bfloat16()).dtype == torch.bfloat16


def cache_of(lens, layers=2) -> list[RaggedKv]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(layers):
        ks = [torch.from_numpy(rng.standard_normal((1, n, 16))) for n in lens]
        out.append(RaggedKv.from_rows(ks, [k.clone() for k in ks], 4096))
    return out


@pytest.mark.rule("forward layout checks and cache growth, port")
def test_forward_refuses_malformed_tokens_caches_and_offsets_with_their_messages():
    pm = port.TinyModel(MODEL)
    cache = cache_of([6, 4])
    ok = torch.tensor([[3], [4]])
    with pytest.raises(ValueError, match=exact("tokens (2,) must be [B,T], B, T >= 1")):
        pm.forward(torch.tensor([3, 4]), cache)
    with pytest.raises(ValueError, match=exact("tokens (2, 0) must be [B,T], B, T >= 1")):
        pm.forward(torch.zeros((2, 0), dtype=torch.int64), cache)
    with pytest.raises(ValueError, match=exact("tokens must be in [0, 64), got [3, 64]")):
        pm.forward(torch.tensor([[3], [64]]), cache)
    with pytest.raises(ValueError, match=exact("tokens must be in [0, 64), got [-1, 4]")):
        pm.forward(torch.tensor([[-1], [4]]), cache)
    with pytest.raises(ValueError, match=exact("cache has 1 layers for 2 layers")):
        pm.forward(ok, cache[:1])
    with pytest.raises(ValueError, match=exact(
            "layer 1's cache (3 rows, lens [6, 4, 1]) disagrees with a batch of 2 at lens "
            "[6, 4]")):
        pm.forward(ok, [cache[0], cache_of([6, 4, 1], 1)[0]])
    with pytest.raises(ValueError, match=exact(
            "layer 0's cache (2 rows, lens [6, 4]) disagrees with a batch of 1 at lens [6, 4]")):
        pm.forward(torch.tensor([[3]]), cache)
    with pytest.raises(ValueError, match=exact("3 seqlen offsets for a batch of 2")):
        pm.forward(ok, cache, seqlen_offsets=[6, 4, 4])
    with pytest.raises(ValueError, match=exact(
            "row 0: seqlen offset 5 disagrees with the layout (own length 6)")):
        pm.forward(ok, cache, seqlen_offsets=torch.tensor([5, 4]))
    with pytest.raises(ValueError, match=exact(
            "row 1: seqlen offset 6 disagrees with the layout (own length 4)")):
        pm.forward(ok, cache, seqlen_offsets=[6])
    assert [kv.host_lens().tolist() for kv in cache] == [[6, 4], [6, 4]]  # refused before
    out = pm.forward(ok, cache + cache_of([1, 1], 1), seqlen_offsets=[6, 4])  # extra: ignored
    assert out.logits.shape == (2, 1, 64) and out.hidden.shape == (2, 1, 32)
    assert [kv.host_lens().tolist() for kv in cache] == [[7, 5], [7, 5]]
    uniform = cache_of([5, 5])
    pm.forward(ok, uniform, seqlen_offsets=[5])
    assert uniform[0].host_lens().tolist() == [6, 6]


@pytest.mark.rule("dsv4 attention on a subset of a pool's rows, port")
def test_pooled_attention_refuses_shapes_that_disagree():
    kv = cache_of([5, 3, 7], 1)[0]
    rows = torch.tensor([2, 0])
    msg = ("q [{}] for rows 2 of kv [3, 1, 512, 16]: need [G,H,t_q,D], [B,Hk,cap,D] with Hk "
           "dividing H")
    for shape in ((3, 2, 1, 16), (2, 2, 1, 8), (2, 2, 16)):
        q = torch.zeros(shape, dtype=F64)
        with pytest.raises(ValueError, match=exact(msg.format(", ".join(map(str, shape))))):
            port.dsv4_attention_rows(q, kv, rows, None, 0, 4)
    q = torch.zeros((2, 2, 2, 16), dtype=F64)
    with pytest.raises(ValueError, match=exact("rows must be a 1-D vector, got shape [1, 2]")):
        port.dsv4_attention_rows(q, kv, torch.tensor([[2, 0]]), None, 0, 4)
    got = port.dsv4_attention_rows(q, kv, [2, 0], None, 0, 4)
    assert got.shape == (2, 2, 2, 16)


@pytest.mark.rule("compressed keys per row from the row's own live run, port")
def test_a_compressed_layer_refuses_a_row_subset():
    pm = port.TinyModel(MODEL)
    cache = cache_of([4, 6], 1)[0]
    x = torch.zeros((1, 1, 32), dtype=F64)
    with pytest.raises(ValueError, match=exact(
            "a compressed layer runs on every row of its cache (rows must be None)")):
        pm.layers[1].forward(x, cache, rows=torch.tensor([1]))
    assert cache.host_lens().tolist() == [4, 6]  # refused before anything was appended
    out = pm.layers[0].forward(x, cache, rows=torch.tensor([1]))
    assert out.shape == (1, 1, 32) and cache.host_lens().tolist() == [4, 7]


@pytest.mark.rule("MTP block fuse / logits / forward_tokens_rows, port")
def test_the_mtp_block_refuses_malformed_fuse_and_step_inputs():
    block = port.TinyModel(MODEL).mtp
    h = torch.zeros((3, 2, 32), dtype=F64)
    with pytest.raises(ValueError, match=exact(
            "hidden (3, 2, 32) and tokens (3, 1) disagree (hidden 32)")):
        block.fuse(h, torch.zeros((3, 1), dtype=torch.int64))
    with pytest.raises(ValueError, match=exact(
            "hidden (3, 2, 16) and tokens (3, 2) disagree (hidden 32)")):
        block.fuse(torch.zeros((3, 2, 16), dtype=F64), torch.zeros((3, 2), dtype=torch.int64))
    for bad in (64, -1):
        toks = torch.zeros((3, 2), dtype=torch.int64)
        toks[1, 1] = bad
        with pytest.raises(ValueError, match=exact("tokens must be in [0, 64)")):
            block.fuse(h, toks)
    assert block.fuse(h, [[0, 63]] * 3).shape == (3, 2, 32)
    assert block.fuse(torch.zeros((0, 32), dtype=F64), []).shape == (0, 32)
    kv = cache_of([3, 2, 5], 1)[0]
    fused = torch.zeros((2, 1, 32), dtype=F64)
    with pytest.raises(ValueError, match=exact("fused (2, 32) must be [G,T,32]")):
        block.forward_step_rows(torch.zeros((2, 32), dtype=F64), [3, 2], kv)
    with pytest.raises(ValueError, match=exact("fused (2, 1, 16) must be [G,T,32]")):
        block.forward_step_rows(torch.zeros((2, 1, 16), dtype=F64), [3, 2], kv)
    with pytest.raises(ValueError, match=exact("3 draft rows for a step of 2")):
        block.forward_step_rows(fused, [3, 2], kv)
    with pytest.raises(ValueError, match=exact("1 draft rows for a step of 2")):
        block.forward_step_rows(fused, [3, 2], kv, rows=[0])
    out = block.forward_step_rows(fused, torch.tensor([5, 3]), kv, rows=torch.tensor([2, 0]))
    assert out.shape == (2, 1, 32) and kv.host_lens().tolist() == [4, 2, 6]
    block.forward_step(fused[:1], 2, kv, rows=[1])
    assert kv.host_lens().tolist() == [4, 3, 6]
    fresh = block.new_draft_cache(2)  # the first step: rows holding nothing, at position 0
    block.forward_step(fused, 0, fresh)
    assert fresh.host_lens().tolist() == [1, 1]
