"""Port conformance: the draft chain's and the draft-KV extension's malformed-input refusals
(exact texts, stated from the inputs), their boundaries, and the result dtypes of
`gpu.draft` (the sibling of test_port_draft.py, which compares the port with the reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import raggedspec.gpu.draft as port
import raggedspec.gpu.model as port_model_mod
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.testing import DEVICE, to_port
from raggedspec.reference.errors import CacheRefusal
from raggedspec.reference.model import ModelConfig, TinyModel

MODEL = TinyModel()
PORT = port_model_mod.TinyModel(MODEL, torch.float64, DEVICE)
PORT_A = port_model_mod.TinyModel(TinyModel(ModelConfig(mtp="heads")), torch.float64, DEVICE)
H, V, HD = MODEL.cfg.hidden, MODEL.cfg.vocab, MODEL.cfg.head_dim


def refuses(exc, text, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert str(info.value) == text


@pytest.mark.rule("draft chain and extension refusals, port")
def test_argmax_tokens_takes_the_last_axis_and_refuses_an_empty_vocab():
    assert port.argmax_tokens(torch.tensor([1.0, 3.0, 2.0])).tolist() == 1  # 1-D: one token
    assert port.argmax_tokens(torch.zeros((2, 1))).tolist() == [0, 0]  # V == 1
    x = torch.zeros((2, 3, 4))
    x[0, 2, 1] = x[1, 0, 3] = 1.0
    assert port.argmax_tokens(x).tolist() == [[0, 0, 1], [3, 0, 0]]  # over V, not axis 1
    assert tuple(port.argmax_tokens(torch.zeros((2, 0, 3))).shape) == (2, 0)
    refuses(ValueError, "logits shape [2, 0] must be [..., V], V >= 1",
            port.argmax_tokens, torch.zeros((2, 0)))
    refuses(ValueError, "logits shape [] must be [..., V], V >= 1",
            port.argmax_tokens, torch.tensor(1.0))


def pool(n_rows: int, held: int = 2) -> RaggedKv:
    rng = np.random.default_rng(7)
    rows = [to_port(rng.standard_normal((1, held, HD))) for _ in range(n_rows)]
    return RaggedKv.from_rows(rows, [r.clone() for r in rows], 4096, 16)


@pytest.mark.rule("draft chain and extension refusals, port")
def test_chain_refusals_name_the_values():
    seeds = to_port(np.zeros((2, H)))
    refuses(ValueError, f"seed_hidden (2, 1, {H}) must be [G,H]",
            port.propose_chain_batched, PORT, to_port(np.zeros((2, 1, H))), [1, 2], 3, [2, 2],
            pool(2))
    refuses(ValueError, "chain length -1 must be >= 0",
            port.propose_chain_batched, PORT, seeds, [1, 2], -1, [2, 2], pool(2))
    refuses(ValueError, "3 last tokens for a draft group of 2",
            port.propose_chain_batched, PORT, seeds, [1, 2, 3], 1, [2, 2], pool(2))
    for toks in ([-1, 2], [1, V]):
        refuses(ValueError, f"tokens must be in [0, {V})",
                port.propose_chain_batched, PORT, seeds, toks, 1, [2, 2], pool(2))
    got = port.propose_chain_batched(PORT, seeds, [1, V - 1], 1, [2, 2], pool(2))
    assert (tuple(got.shape), got.dtype) == ((2, 1), torch.int64)


@pytest.mark.rule("draft chain and extension refusals, port")
@pytest.mark.parametrize("model", [PORT, PORT_A], ids=["block", "tier_a"])
def test_chain_results_are_int64_and_a_float32_seed_runs_in_the_model_dtype(model):
    seeds = np.random.default_rng(1).standard_normal((2, H))
    empty = port.propose_chain_batched(model, to_port(seeds), [1, 2], 0, [2, 2], pool(2))
    assert (tuple(empty.shape), empty.dtype) == ((2, 0), torch.int64)
    trace64, trace32 = [], []
    got = port.propose_chain_batched(model, to_port(seeds), [1, 2], 2, [2, 2], pool(2), trace64)
    assert got.dtype == torch.int64
    port.propose_chain_batched(model, to_port(seeds, torch.float32), [1, 2], 2, [2, 2], pool(2),
                               trace32)
    assert [t.dtype for t in trace32] == [torch.float64] * 2  # the seed is cast to the model's


def extend(kv, off, lo, hi, tokens, hidden=None, rows=None, write=None, block=None):
    r_n = len(lo)
    if hidden is None:
        hidden = to_port(np.random.default_rng(2).standard_normal((r_n, 6, H)))
    port.extend_draft_kv_rows(block or PORT.mtp, kv, hidden, off, lo, hi, tokens, rows, write)


def toks(r_n: int, width: int = 8) -> torch.Tensor:
    return torch.arange(r_n * width).reshape(r_n, width) % V


@pytest.mark.rule("draft chain and extension refusals, port")
def test_extension_token_refusals_on_the_host_and_on_the_device():
    for bad in ([[0, -1]], [[0, V]]):
        for given in (np.asarray(bad), torch.tensor(bad)):
            refuses(ValueError, f"tokens must be in [0, {V})",
                    extend, pool(1), [0], [2], [3], given)
    kv = pool(1)
    extend(kv, [0], [2], [3], np.array([[0, 1, 2, V - 1]]))  # V - 1 is a token
    assert kv.host_lens().tolist() == [3]
    kv = pool(1)
    extend(kv, [0], [2], [3], torch.tensor([[0, 1, 2, V - 1]], dtype=torch.int32))
    assert kv.host_lens().tolist() == [3]


@pytest.mark.rule("draft chain and extension refusals, port")
def test_extension_shape_refusals_break_one_condition_each():
    hid = to_port(np.zeros((2, 6, H)))
    msg = ("hidden {}, tokens {}, off/lo/hi/rows ({}, 2, {}, {}) must all have one entry "
           "per row")
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
    msg = ("extension spans lo {}, hi {} lie outside the capture (off {}, T 6) or the tokens "
           "({})")
    for off, lo, hi, width in (([3], [2], [4], 8), ([0], [2], [7], 8), ([0], [2], [5], 5)):
        refuses(ValueError, msg.format(lo, hi, off, width), extend, pool(1), off, lo, hi,
                toks(1, width))
    kv = pool(1)
    extend(kv, [0], [2], [6], toks(1, 7))  # hi == off + T and hi + 1 == L: both in
    assert kv.host_lens().tolist() == [6]
    # a row with hi < lo (and lo < off) writes nothing, beside one that writes
    kv = pool(2)
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
    rng = np.random.default_rng(5)
    hidden = rng.standard_normal((1, 6, H))
    k64 = pool(1)
    extend(k64, [0], [2], [5], toks(1), to_port(hidden))
    base = pool(1)
    k32 = RaggedKv.from_rows([base.k[0, :, :2].float()], [base.v[0, :, :2].float()], 4096, 16)
    extend(k32, [0], [2], [5], toks(1), to_port(hidden, torch.float32))
    assert k32.k.dtype == torch.float32
    want = k64.k[0, :, 2:5].float()
    got = k32.k[0, :, 2:5]
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
        model = port_model_mod.TinyModel(MODEL, torch.float64, DEVICE)
        if pregrow:
            model.mtp.layer.ropes.get(model.mtp.layer.theta, 4096)
        kv = RaggedKv.from_rows([held], [held.clone()], 4096)
        extend(kv, [1023], [1023], [1025], tokens, hidden, block=model.mtp)
        assert kv.host_lens().tolist() == [1025]
        out.append(kv.k[0, :, 1023:1025])
    assert torch.equal(out[0], out[1])
