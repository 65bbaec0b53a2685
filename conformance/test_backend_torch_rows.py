"""The torch backend's forward on a ragged batch given per-row query positions (`row_q0`) but
no dead prefix (`lead_pad = None`), against the reference backend.

That call says every row's live run starts at column 0 of the shared cache (so RoPE takes the
shared offset C) while `row_q0` still masks each row's dead prefix out of the attention. The
reference computes it as written: the raw keys' dead columns are masked, and a compressed layer
compresses each row from column 0, the zero dead columns included. The torch backend keeps a
row's dead prefix as an offset, not as stored zeros, so its compressed keys read those columns
as zeros: the same keys, hence the same hidden, logits and cache, with and without compressed
layers and at several compression ratios.
"""

import numpy as np
import pytest

from raggedspec.conformance.backends import assert_close, assert_same_cache
from raggedspec.gpu.backend import TorchBackend
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.model import ModelConfig

REF = NumpyBackend()
PORT = TorchBackend(dtype="float64")


def _prompt(be, model, cfg, n):
    """A one-row cache holding an n-token prompt run through the backend's model."""
    cache = be.new_target_cache(cfg, 4096, 1)
    fwd = be.forward(model, np.arange(n)[None] % cfg.vocab, cache, [0], None, None)
    be.xs_append(cache, fwd.hidden)
    return cache


@pytest.mark.parametrize("ratios", [(0,), (0, 4), (4,), (0, 2)])
@pytest.mark.parametrize("lens,t", [((3, 7), 1), ((9, 2, 6), 2), ((12, 4), 3)])
def test_row_positions_without_a_dead_prefix_decode_as_the_reference(ratios, lens, t):
    cfg = ModelConfig(compress_ratios=ratios)
    out = []
    for be in (PORT, REF):
        model = be.build_model(cfg)
        ci = be.clone_in([_prompt(be, model, cfg, n) for n in lens], [0] * len(lens), True, True)
        c = be.cache_len(ci.batched)
        assert any(ci.lead_pad), "the batch must be ragged"
        row_q0 = [c - lead for lead in ci.lead_pad]
        tokens = (np.arange(len(lens) * t).reshape(len(lens), t) * 5) % cfg.vocab
        fwd = be.forward(model, tokens, ci.batched, [c], row_q0, None)
        out.append((be.to_numpy(fwd.hidden), be.to_numpy(fwd.logits), be.materialize(ci.batched)))
    (ph, pl, pc), (rh, rl, rc) = out
    assert_close(ph, rh, "float64", "hidden")
    assert_close(pl, rl, "float64", "logits")
    assert_same_cache(pc, rc, "float64", "batched cache after the forward")
