"""The reference backend's read-back (`NumpyBackend.materialize`) of caches before anything
was appended: the protocol's view of a target cache or a K/V slot (reference/backend.py,
`Backend.materialize`) names every K/V slot with both halves None while its buffer is
unmaterialized, with the slot's length and capacity, and every XsRolling slot with its rows'
lengths; once K/V is appended the halves are host copies the caller may keep. Expected
values come from the protocol's docstring and the slots' construction rules (a target K/V
slot starts at capacity 512, a draft KV at 16)."""

from __future__ import annotations

import pytest
import numpy as np

from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.model import ModelConfig

REF = NumpyBackend()


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_materialize_reads_unmaterialized_slots_as_none_halves():
    """A fresh target cache (ratios 4 and 0, batch 2): two K/V slots of length 0 and
    capacity 512, each `(None, None)`, and one XsRolling slot of two empty rows; a fresh
    draft KV read alone: `(None, None)` at capacity 16. After an append the halves are the
    appended K and V, copies of the slot's."""
    cfg = ModelConfig(compress_ratios=(4, 0), max_seq_len=600)
    view = REF.materialize(REF.new_target_cache(cfg, 600, 2))
    assert view["len"] == 0 and view["kv"] == [(None, None), (None, None)]
    assert view["capacity"] == [512, 512]
    [xs] = view["xs"]
    assert (xs["tokens"], xs["base"]) == ([0, 0], [0, 0])
    draft = REF.new_draft_cache(REF.build_model(ModelConfig()))
    assert REF.materialize(draft) == {"len": 0, "kv": [(None, None)], "capacity": [16],
                                      "xs": []}
    k = np.arange(6.0).reshape(1, 1, 3, 2)
    REF.kv_append(draft, k, -k)
    (kk, vv), = REF.materialize(draft)["kv"]
    assert kk.tolist() == k.tolist() and vv.tolist() == (-k).tolist()
    kk[...] = 7.0
    vv[...] = 7.0
    (again_k, again_v), = REF.materialize(draft)["kv"]
    assert again_k.tolist() == k.tolist() and again_v.tolist() == (-k).tolist()
