"""The tensor-mode simulator's sized draft-KV map and its step-failure record
(reference/simulator.py; cache-and-draft.md §7.1): `SizedDraftKvMap` keeps the MTP block of
its model (None for Tier A, or for a model with no `mtp` at all), stamps every checkin with
the next tick of its counter, evicts the least recently checked-in entries while it holds
more than the scenario's `max_draft_kv_seqs` (never with None), and gets a fresh state's
draft KV from the backend; `_StepFailed` keeps its kind and shows its detail. Unit tests on
small maps, no simulation: expected values follow from the LRU rule step by step.
"""

from __future__ import annotations

import pytest
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.draft import DraftKv
from raggedspec.reference.model import ModelConfig, TinyModel
from raggedspec.reference.simulator import SizedDraftKvMap, _StepFailed


def state() -> DraftKv:
    return DraftKv(cache=None)


@pytest.mark.rule("draft-KV map LRU")
def test_the_map_keeps_its_models_mtp_block():
    block_model = TinyModel(ModelConfig(seed=1))
    assert SizedDraftKvMap(NumpyBackend(), block_model, 4).block is block_model.mtp
    heads = TinyModel(ModelConfig(mtp="heads", seed=1))
    assert SizedDraftKvMap(NumpyBackend(), heads, 4).block is None
    assert SizedDraftKvMap(NumpyBackend(), object(), 4).block is None


@pytest.mark.rule("draft-KV map LRU")
def test_every_checkin_is_stamped_with_the_next_tick():
    m = SizedDraftKvMap(NumpyBackend(), object(), None)
    states = [state() for _ in range(3)]
    for i, st in enumerate(states):
        m.checkin(i, st)
    assert [st.last_used for st in states] == [1, 2, 3]
    m.checkin(0, m.checkout_draft_kv(0))
    assert states[0].last_used == 4


@pytest.mark.rule("draft-KV map LRU")
def test_the_least_recently_checked_in_entry_is_evicted_above_the_cap():
    """Cap 2: 1 and 2 checked in, 1 checked out and in again (now the most recent), 3
    checked in: three entries, one too many, and 2 is the least recent: {1, 3} remain."""
    m = SizedDraftKvMap(NumpyBackend(), object(), 2)
    m.checkin(1, state())
    m.checkin(2, state())
    assert set(m.entries) == {1, 2}, "at the cap nothing is evicted"
    m.checkin(1, m.checkout_draft_kv(1))
    m.checkin(3, state())
    assert set(m.entries) == {1, 3}


@pytest.mark.rule("draft-KV map LRU")
def test_an_unbounded_map_never_evicts():
    m = SizedDraftKvMap(NumpyBackend(), object(), None)
    for i in range(70):
        m.checkin(i, state())
    assert len(m.entries) == 70


@pytest.mark.rule("draft-KV map LRU")
def test_checkout_returns_the_entry_or_a_fresh_state_with_the_backends_draft_kv():
    model = TinyModel(ModelConfig(seed=1))
    m = SizedDraftKvMap(NumpyBackend(), model, 4)
    mine = state()
    m.checkin(7, mine)
    assert m.checkout_draft_kv(7) is mine and 7 not in m.entries
    fresh = m.checkout_draft_kv(8)
    assert (fresh.filled, fresh.poisoned, fresh.seed) == (0, False, None)
    assert fresh.cache.current_seq_len == 0 and fresh.cache.k.capacity_seq_len == 16


@pytest.mark.rule("one batched decode step MtpSpeculativePipeline::step, cohort example w=4 C=10")
def test_a_step_failure_keeps_its_kind_and_shows_its_detail():
    exc = _StepFailed("capacity", "cache would grow past max_seq_len")
    assert (exc.kind, exc.detail) == ("capacity", "cache would grow past max_seq_len")
    assert str(exc) == "cache would grow past max_seq_len"
