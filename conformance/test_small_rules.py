"""Small reference rules a coverage run of the default suite found unexecuted: a K/V slot's
reset, the clone of a cache holding a slot kind the reference does not model, and the
XsRolling description a failure message prints."""

from __future__ import annotations

import pytest
import numpy as np

from raggedspec.reference.cache import KvCache, NormalCache, OtherSlot
from raggedspec.reference.xs_rolling import XsRolling


@pytest.mark.rule("KvCache / NormalCache::new_plain")
def test_a_reset_slot_is_empty_and_keeps_its_capacity():
    kv = KvCache.new_normal(4096)
    kv.append(np.ones((1, 1, 600, 2)), np.ones((1, 1, 600, 2)))
    assert kv.k.capacity_seq_len == 1024
    kv.reset()
    for half in (kv.k, kv.v):
        assert (half.current_seq_len, half.first_cached, half.data) == (0, 0, None)
        assert half.capacity_seq_len == 1024


@pytest.mark.rule("KvCache / NormalCache::new_plain")
def test_a_cache_with_an_unmodelled_slot_clones_it_independently():
    cache = NormalCache([KvCache.new_normal(64), OtherSlot("Rotating", 7)])
    copy = cache.clone()
    assert copy.slots[1] == OtherSlot("Rotating", 7) and copy.slots[1] is not cache.slots[1]
    copy.slots[1].current_seq_len = 9
    assert cache.slots[1].current_seq_len == 7
    assert not copy.slots[1].supports_per_sequence_len()


@pytest.mark.rule("XsRolling")
def test_the_xs_rolling_description_names_its_geometry():
    text = repr(XsRolling(4, max_seq_len=64, batch=2))
    assert text.startswith("XsRolling(ratio=4, span=")
    assert "tokens=[0, 0]" in text and "base=[0, 0]" in text  # one entry per row
