"""The paged-KV backend (`raggedspec.gpu.paged_backend.PagedBackend`) against the reference.

Properties: a per-sequence lifecycle (build, clone-in with pending leads, append, attention,
the forward's zero baking, rollback, clone-out, commit, strip) on the paged backend, the
in-place torch backend and the NumPy reference, every row's visible cache compared after
every operation and the attention read through the block table compared with the in-place
port's; page sizes from 1 (every column its own page) to 16. A counter on the page store's
one write method shows that strips, rollbacks, commits, alignment and clone-in/out move no
K/V bytes. End to end: generated and fixed simulator scenarios with the paged backend, and
a derandomized subset of the per-method conformance run on it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raggedspec.bench.report import paged_cells
from raggedspec.conformance import test_backend as per_method
from raggedspec.conformance.backends import (
    BACKEND_ENV,
    assert_same_cache,
    compare_runs,
    reference_backend,
)
from raggedspec.conformance.test_end_to_end import FIXED, run_both, scenarios
from raggedspec.gpu.attention import dsv4_attention_in_place
from raggedspec.gpu.backend import TorchBackend
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.paged import PageStore
from raggedspec.gpu.paged_backend import PagedBackend, PagedKv
from raggedspec.paged_moves import count_paged_moves
from raggedspec.reference.cache import NormalCache

REF = reference_backend()
DENSE = TorchBackend()
PAGE_SIZES = [1, 2, 3, 4, 5, 16]


def _kv(rng: np.random.Generator, n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Small integers (exact in every dtype), never zero so a dead column shows."""
    return (rng.integers(1, 50, size=(1, 1, n, d)).astype(np.float64),
            -rng.integers(1, 50, size=(1, 1, n, d)).astype(np.float64))


VIEW = PagedBackend()


def _same(paged, ref, what: str) -> None:
    assert_same_cache(VIEW.materialize(paged), REF.materialize(ref), "float64", what)


def _attention_matches(pslot: PagedKv, dslot, rng: np.random.Generator, window: int) -> None:
    """The port's in-place attention read through the block table equals it on the in-place
    layout holding the same rows (the in-place port is itself pinned to the reference)."""
    own = pslot.kv.host_lens()
    assert np.array_equal(own, dslot.kv.host_lens()), (own, dslot.kv.host_lens())
    t_q = int(rng.integers(1, max(int(own.min()), 1) + 1))
    if own.min() < 1:
        return
    d = pslot.kv.k.shape[3]
    q = torch.from_numpy(rng.standard_normal((len(own), 2, t_q, d)))
    got = dsv4_attention_in_place(q, pslot.kv, None, 0, window)
    want = dsv4_attention_in_place(q, dslot.kv, None, 0, window)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (got - want).abs().max()


@pytest.mark.rule("paged KV: every row's view through its block table")
@settings(deadline=None)
@given(lens=st.lists(st.integers(1, 12), min_size=1, max_size=4), d=st.sampled_from([2, 3]),
       page=st.sampled_from(PAGE_SIZES), seed=st.integers(0, 10_000), data=st.data())
def test_every_operation_on_pages_leaves_the_reference_view(lens, d, page, seed, data):
    """After every operation of per-sequence steps, each row's visible cache (front-aligned
    K and V, length, capacity) on the paged backend is the reference's, bit for bit, and
    attention read through the block table is the in-place port's."""
    rng = np.random.default_rng(seed)
    be = PagedBackend(page_size=page)
    rows = [_kv(rng, n, d) for n in lens]
    port = [NormalCache([be.kv_from_arrays(k, v, 4096)]) for k, v in rows]
    dense = [NormalCache([DENSE.kv_from_arrays(k, v, 4096)]) for k, v in rows]
    ref = [NormalCache([REF.kv_from_arrays(k, v, 4096)]) for k, v in rows]
    for i, (p, r) in enumerate(zip(port, ref, strict=True)):
        _same(p, r, f"row {i} built")
    for step in range(data.draw(st.integers(1, 3), label="steps")):
        held = [c.current_seq_len for c in ref]
        pending = [data.draw(st.integers(0, min(2, h)), label="pending lead") for h in held]
        pci = be.clone_in(port, pending, False, True)
        dci = DENSE.clone_in(dense, pending, False, True)
        rci = REF.clone_in(ref, pending, False, True)
        assert pci.lead_pad == rci.lead_pad == dci.lead_pad
        pb, db, rb = pci.batched, dci.batched, rci.batched
        _same(pb, rb, f"step {step} cloned in")
        t = data.draw(st.integers(1, 4), label="append")
        k, v = _kv(rng, t * len(lens), d)
        k, v = k.reshape(len(lens), 1, t, d), v.reshape(len(lens), 1, t, d)
        for be_, c in ((be, pb), (DENSE, db), (REF, rb)):
            be_.kv_append(c.slots[0], k, v)
        _same(pb, rb, f"step {step} appended")
        if data.draw(st.booleans(), label="bake"):  # the forward's zero columns in front
            lead = pb.slots[0].lead
            dead = np.array([data.draw(st.integers(0, int(x)), label="dead") for x in lead],
                            np.int64)
            pb.slots[0].bake(dead)
            db.slots[0].bake(dead)
            _same(pb, rb, f"step {step} baked")
        _attention_matches(pb.slots[0], db.slots[0], rng, data.draw(st.sampled_from([1, 3, 128])))
        if data.draw(st.booleans(), label="cohort rollback"):
            n_drop = data.draw(st.integers(0, t), label="n_drop")
            for be_, c in ((be, pb), (DENSE, db), (REF, rb)):
                be_.truncate_by(c, n_drop)
            _same(pb, rb, f"step {step} rolled back by {n_drop}")
            _attention_matches(pb.slots[0], db.slots[0], rng, 3)
        b = len(lens)
        port, dense, ref = be.clone_out(pb, b), DENSE.clone_out(db, b), REF.clone_out(rb, b)
        for i in range(len(lens)):
            _same(port[i], ref[i], f"step {step} row {i} cloned out")
            lead, own = rci.lead_pad[i], held[i] - pending[i]
            room = max(0, ref[i].current_seq_len - lead - own)
            committed = data.draw(st.integers(0, room), label="committed")
            if data.draw(st.booleans(), label="commit"):
                for be_, c in ((be, port[i]), (DENSE, dense[i]), (REF, ref[i])):
                    be_.commit_per_sequence(c, lead, own, committed)
                _same(port[i], ref[i], f"step {step} row {i} committed {committed}")
            elif lead:
                for be_, c in ((be, port[i]), (DENSE, dense[i]), (REF, ref[i])):
                    be_.strip_dead_prefix(c.slots[0], lead)
                _same(port[i], ref[i], f"step {step} row {i} stripped {lead}")


def _counted(monkeypatch) -> dict:
    """Count every call of the page store's write method and the bytes it writes."""
    seen = {"calls": 0, "bytes": 0}
    real = PageStore.write

    def write(self, pages, offs, k, v):
        seen["calls"] += 1
        seen["bytes"] += k.to(self.dtype).nbytes + v.to(self.dtype).nbytes
        return real(self, pages, offs, k, v)

    monkeypatch.setattr(PageStore, "write", write)
    return seen


@pytest.mark.rule("paged KV: strip, rollback, commit and alignment are table updates")
def test_strips_rollbacks_commits_and_alignment_move_no_kv_bytes(monkeypatch):
    """Only appends write: clone-in with pending leads (a strip), front alignment, the
    forward's zero baking, rollback, clone-out, commit and a dead-prefix strip leave the
    write counter and the stores' contents as they were."""
    seen = _counted(monkeypatch)
    rng = np.random.default_rng(7)
    be = PagedBackend(page_size=3)
    seqs = [NormalCache([be.kv_from_arrays(*_kv(rng, n, 2), 4096)]) for n in (7, 2, 5)]
    built = dict(seen)
    assert built["bytes"] == (7 + 2 + 5) * 2 * 2 * 8  # K and V, 2 columns of float64 each
    ci = be.clone_in(seqs, [2, 0, 1], False, True)
    slot = ci.batched.slots[0]
    store = slot.kv.store
    snapshot = (store.k.clone(), store.v.clone())
    assert seen == built, "clone-in (strip of pending leads + alignment) wrote K/V"
    be.kv_append(slot, *[x.reshape(3, 1, 2, 2) for x in _kv(rng, 6, 2)])
    appended = dict(seen)
    assert appended["bytes"] >= 3 * 2 * 2 * 2 * 8, "the append's new columns were not written"
    store = slot.kv.store
    snapshot = (store.k.clone(), store.v.clone())
    grown = store.moved["grow"]
    slot.bake(np.zeros(3, dtype=np.int64))
    be.truncate_by(ci.batched, 1)
    rows = be.clone_out(ci.batched, 3)
    for i, c in enumerate(rows):
        if i:
            be.commit_per_sequence(c, ci.lead_pad[i], 3, 1)
        else:
            be.strip_dead_prefix(c.slots[0], ci.lead_pad[i])
    again = be.clone_in(rows, [0, 0, 0], False, True)
    be.kv_set_len(again.batched.slots[0], 2)
    assert seen == appended, f"a table update wrote K/V: {seen} after {appended}"
    assert store.moved["grow"] == grown
    assert torch.equal(store.k, snapshot[0]) and torch.equal(store.v, snapshot[1])


@pytest.mark.rule("paged KV: strip, rollback, commit and alignment are table updates")
def test_the_dense_layout_would_have_moved_bytes_for_the_same_strip():
    """Non-degeneracy of the counter's scenario: in the in-place layout the same strip that
    cuts into a row's own run is a gather (the paged one is a table offset)."""
    rng = np.random.default_rng(3)
    dense = DENSE.kv_from_arrays(*_kv(rng, 6, 2), 4096)
    before = dense.kv.k
    dense.drop_front(2)
    assert dense.kv.k is not before
    paged = PagedBackend(page_size=4).kv_from_arrays(*_kv(rng, 6, 2), 4096)
    pages = paged.kv.table.copy()
    paged.drop_front(2)
    assert np.array_equal(paged.kv.table, pages) and paged.kv.start.tolist() == [2]


@pytest.mark.rule("paged KV: one writer per page")
def test_a_shared_page_is_copied_before_a_write():
    """A clone shares pages; a write into a page it does not own copies the page's live
    prefix into a fresh page, so the original's columns stay as they were."""
    rng = np.random.default_rng(1)
    be = PagedBackend(page_size=4)
    k, v = _kv(rng, 5, 2)
    a = be.kv_from_arrays(k, v, 4096)
    b = a.clone()
    b.set_len(3)
    be.kv_append(b, *_kv(rng, 2, 2))
    got = be.materialize(a)["kv"][0]
    assert np.array_equal(got[0], k) and np.array_equal(got[1], v)
    assert a.kv.table[0, 0] != b.kv.table[0, 1] and b.kv.table[0, 0] != a.kv.table[0, 0]


@pytest.mark.rule("paged KV: one writer per page")
def test_a_dense_first_batch_is_adopted_into_pages():
    """The forward's empty first batch (a dense `RaggedKv`) becomes pages on assignment."""
    be = PagedBackend(page_size=2)
    slot = PagedKv(4096, be.pool)
    k = torch.arange(2 * 1 * 4 * 2, dtype=torch.float64).reshape(2, 1, 4, 2)
    slot.kv = RaggedKv(k, -k, [3, 1], 4096)
    assert slot.kv.host_lens().tolist() == [3, 1]
    assert torch.equal(slot.kv.k[0, :, :3], k[0, :, :3])
    assert torch.equal(slot.kv.v[1, :, :1], -k[1, :, :1])


@pytest.mark.rule("paged KV: every row's view through its block table")
@settings(max_examples=4, deadline=None)
@given(data=scenarios, page=st.sampled_from([1, 3, 16]))
def test_generated_scenarios_match_the_reference_on_pages(data, page):
    """The end-to-end property on the paged backend (a short derandomized subset; the full
    file runs with `RAGGEDSPEC_BACKEND=paged`)."""
    port, ref, be = run_both(data, port=PagedBackend(page_size=page))
    counts = compare_runs(port, ref, be.dtype)
    assert counts["forwards"] >= 1 or not any(s["phase"] != "idle" for s in ref.steps())


@pytest.mark.rule("paged KV: every row's view through its block table")
@pytest.mark.parametrize("case", [0, 3, 8])
def test_fixed_scenarios_match_the_reference_on_pages(case):
    port, ref, be = run_both(FIXED[case], port=PagedBackend(page_size=3))
    counts = compare_runs(port, ref, be.dtype)
    assert counts["forwards"] >= 3 and counts["tensors"] > 20


@pytest.mark.rule("paged KV: every row's view through its block table")
@pytest.mark.parametrize("name", ["test_append_growth_and_set_len_match_the_reference",
                                  "test_front_align_concat_split_and_strip_match_the_reference",
                                  "test_cohort_and_per_sequence_advance_match_the_reference",
                                  "test_a_ragged_verify_step_matches_the_reference"])
def test_per_method_conformance_on_pages(name, monkeypatch):
    """A subset of `test_backend.py` with the paged backend under test."""
    monkeypatch.setenv(BACKEND_ENV, "paged")
    assert per_method.port().name == "paged"
    getattr(per_method, name)()


@pytest.mark.rule("paged KV bytes per step, benchmark")
@pytest.mark.parametrize("lens,w", [([4096, 4090, 4033], 3), ([17, 1], 1), ([15, 16, 31, 32], 5)])
def test_the_paged_bytes_are_counted_on_the_paged_layout(lens, w):
    """The benchmark's paged counts: the step's append writes exactly its new columns' K and
    V (the batch a clone-in built owns its rows' pages: no copy), the rollback and the
    strip nothing. Expected values from the shapes, not from the counter."""
    got = count_paged_moves(lens, w, 2, 8, torch.bfloat16, "cpu", page_size=16)
    assert got["paged_append_bytes"] == 2 * len(lens) * w * 2 * 8 * 2
    assert got["paged_cow_bytes"] == 0
    assert got["paged_strip_bytes"] == 0 and got["paged_rollback_bytes"] == 0


@pytest.mark.rule("paged KV bytes per step, benchmark")
def test_the_benchmark_report_shows_the_paged_bytes():
    """The data-movement row's paged cells, and a dash for a result without them."""
    row = {"paged_append_bytes": 3072, "paged_cow_bytes": 1024, "paged_rollback_bytes": 0,
           "paged_strip_bytes": 0}
    assert paged_cells(row) == "3.0 (1.0) | 0 / 0"
    assert paged_cells({"w": 3}) == "- | -"
