"""The MTP draft chain (cache-and-draft.md §10.2, §14, §17.2, §18): `argmax_token`, the
single-sequence `propose_chain`, the batched `propose_chain_batched` on the uniform (scalar
position) and ragged (per-row positions) paths, feeding the pre-norm hidden forward, the
heads-only (Tier A) chain; then the torch port's chain on rows of its pooled draft KV
(`gpu.draft`) and the backends' `propose_chain` against the reference.

Tolerance: a row drafted inside a group gives exactly the tokens of that row drafted alone and
the same per-step hidden to `1e-12 * max(1, max|x|)` (float64; the batched softmax also sums
exactly-zero terms of the masked dead prefix); the port's draft KV history bit for bit, its new
entries within 1e-12 (`gpu.testing`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import raggedspec.gpu.draft as port
import raggedspec.gpu.model as port_model
from raggedspec.conformance.backends import assert_exact, assert_same_cache
from raggedspec.conformance.helpers import StepSpy, close, draft_history, draft_pool, held_k
from raggedspec.conformance.helpers import built_model, ref_draft_kv
from raggedspec.conformance.strategies import chain_groups
from raggedspec.gpu.backend import TorchBackend
from raggedspec.gpu.rope import reset_rope_path_stats, rope_path_stats
from raggedspec.gpu.testing import DEVICE, assert_bit_exact, assert_close64, assert_same_refusal
from raggedspec.gpu.testing import host, outcome, to_port
from raggedspec.reference import draft as ref
from raggedspec.reference.align import drop_dead_prefix, front_align_draft_group, split_draft_cache
from raggedspec.reference.attention import dsv4_mask_stats, reset_dsv4_mask_stats
from raggedspec.reference.backend import NumpyBackend
from raggedspec.reference.cache import KvCache
from raggedspec.reference.draft import DraftKv, argmax_token, propose_chain, propose_chain_batched
from raggedspec.reference.errors import DispatchRefusal, Refusal, StepRefusal
from raggedspec.reference.model import ModelConfig, MtpBlock, TinyModel

MODEL = TinyModel()
TIER_A = TinyModel(ModelConfig(mtp="heads"))
PORT = port_model.TinyModel(MODEL, torch.float64, DEVICE)
PORT_A = port_model.TinyModel(TIER_A, torch.float64, DEVICE)
REF_BE, PORT_BE = NumpyBackend(), TorchBackend(str(DEVICE), "float64")
H, V, HD = MODEL.cfg.hidden, MODEL.cfg.vocab, MODEL.cfg.head_dim


def align_rows(pool, rows, starts) -> None:
    """The group alignment the backend's loop does on the pool: the rows' lengths become their
    chain starts (host integers; the data stays put)."""
    held = pool.host_lens().copy()
    held[np.asarray(rows, dtype=np.int64)] = starts
    pool.lens = held


# --- argmax and the single-sequence chain (§17.2) ----------------------------------------------


@pytest.mark.rule("argmax_token_picks_max")
def test_argmax_token_picks_max():
    """`[0.1, 0.9, 0.2, 0.5] -> 1`; one entry -> 0; the first on a tie; an empty or 2-D row is
    malformed, with the stated message."""
    assert argmax_token(np.array([0.1, 0.9, 0.2, 0.5])) == 1
    assert argmax_token(np.array([3.0])) == 0
    assert argmax_token([0.5, 2.0, 2.0]) == 1
    with pytest.raises(ValueError, match=r"^logits shape \(0,\) must be \[V\], V >= 1$"):
        argmax_token(np.array([]))
    with pytest.raises(ValueError, match=r"^logits shape \(2, 2\) must be \[V\], V >= 1$"):
        argmax_token(np.ones((2, 2)))


@pytest.mark.rule("propose_chain single-sequence")
def test_propose_chain_returns_depth_tokens():
    small = TinyModel(ModelConfig(hidden=4, vocab=8))
    cache = small.mtp.new_draft_cache()
    chain = propose_chain(small, np.ones(4), 3, depth=3, max_tokens=16, start=0, cache=cache)
    assert len(chain) == 3 and all(0 <= t < 8 for t in chain)
    assert cache.current_seq_len == 3


@pytest.mark.rule("propose_chain single-sequence")
@pytest.mark.parametrize("depth, max_tokens, n", [(5, 2, 2), (4, 4, 4), (8, 0, 0), (0, 8, 0)])
def test_propose_chain_respects_max_tokens_cap(depth, max_tokens, n):
    cache = MODEL.mtp.new_draft_cache()
    chain = propose_chain(MODEL, np.ones(H), 1, depth, max_tokens, 0, cache)
    assert len(chain) == n and cache.current_seq_len == n


@pytest.mark.rule("propose_chain single-sequence", "synthetic_load_smoke.rs MTP checks")
def test_propose_chain_refuses_a_block_without_a_draft_kv():
    with pytest.raises(StepRefusal, match="draft KV"):
        propose_chain(MODEL, np.ones(H), 1, 3, 16, 0, None)
    with pytest.raises(StepRefusal, match="draft KV"):
        propose_chain(MODEL, np.ones(H), 1, 0, 16, 0, None)  # whatever n
    with pytest.raises(StepRefusal, match="draft KV"):
        propose_chain_batched(MODEL, np.ones((2, H)), [1, 2], 2, [0, 0], None)


@pytest.mark.rule("extend_draft_cache", "synthetic_load_smoke.rs MTP checks")
def test_smoke_a_prefill_of_five_context_positions_then_two_drafts():
    """masks §22 smoke: prefill of 5 context positions -> cache 5, two drafts -> 7."""
    rng = np.random.default_rng(4)
    cache = MODEL.mtp.new_draft_cache()
    assert ref.extend_draft_cache(MODEL.mtp, cache, rng.standard_normal((5, H)),
                                  [1, 2, 3, 4, 5], 0) == 5
    assert cache.current_seq_len == 5
    assert len(propose_chain(MODEL, rng.standard_normal(H), 5, 2, 16, 5, cache)) == 2
    assert cache.current_seq_len == 7


@pytest.mark.rule("propose_chain single-sequence", "synthetic_load_smoke.rs MTP checks")
def test_smoke_a_stale_start_on_an_empty_cache_is_a_desync():
    with pytest.raises(Refusal) as err:
        propose_chain(MODEL, np.ones(H), 1, 2, 16, 137, MODEL.mtp.new_draft_cache())
    assert "desync" in str(err.value) and "137" in str(err.value)


@pytest.mark.rule("Tier A chain")
def test_chain_inputs_are_checked_with_the_stated_messages():
    cache = MODEL.mtp.new_draft_cache()
    with pytest.raises(ValueError, match=r"^depth -1 and max_tokens 5 must be >= 0$"):
        propose_chain(MODEL, np.ones(H), 1, -1, 5, 0, cache)
    with pytest.raises(ValueError, match=r"^depth 5 and max_tokens -1 must be >= 0$"):
        propose_chain(MODEL, np.ones(H), 1, 5, -1, 0, cache)
    with pytest.raises(ValueError, match=rf"^seed_hidden \({H},\) must be \[G,H\]$"):
        propose_chain_batched(MODEL, np.ones(H), [1], 2, [0], cache)
    with pytest.raises(ValueError, match=r"^chain length -1 must be >= 0$"):
        propose_chain_batched(MODEL, np.ones((1, H)), [1], -1, [0], cache)
    with pytest.raises(ValueError, match=r"^2 last tokens for a draft group of 1$"):
        propose_chain_batched(MODEL, np.ones((1, H)), [1, 2], 2, [0], cache)


# --- the batched chain on the reference ---------------------------------------------------------


@pytest.mark.rule("propose_chain_batched: scalar vs per-row positions")
def test_propose_chain_batched_empty_cases_and_refusals():
    cache = draft_history(MODEL, 4, 0)
    assert propose_chain_batched(MODEL, np.ones((3, H)), [1, 2, 3], 0, [4] * 3, cache) == [[]] * 3
    assert propose_chain_batched(MODEL, np.ones((0, H)), [], 3, [], cache) == []
    assert cache.current_seq_len == 4  # nothing ran
    with pytest.raises(StepRefusal, match="1 chain start\\(s\\) for a draft group of 2"):
        propose_chain_batched(MODEL, np.ones((2, H)), [1, 2], 2, [4], cache)


@pytest.mark.rule("the chain feeds the pre-norm hidden forward")
def test_the_chain_feeds_the_pre_norm_hidden_and_the_drafted_token_forward():
    """Oracle loop from the block's primitives: step i runs at start + i on
    fuse(prev, tok); prev := the pre-norm hidden, tok := argmax lm_head(norm_out(hidden))."""
    block = MODEL.mtp
    rng = np.random.default_rng(8)
    seed_h, last = rng.standard_normal((2, H)), [3, 9]
    trace: list = []
    groups = [[draft_history(MODEL, 6, 1), draft_history(MODEL, 6, 2)] for _ in range(2)]
    c1, c2 = (front_align_draft_group(g, [6, 6]) for g in groups)
    chains = propose_chain_batched(MODEL, seed_h, last, 4, [6, 6], c1, trace)
    prev, toks, want, hs = seed_h, np.array(last), [[], []], []
    for i in range(4):
        hidden = block.forward_step(block.fuse(prev[:, None], toks[:, None]), 6 + i, c2)[:, 0]
        toks = np.array([int(np.argmax(r)) for r in block.logits(hidden)])
        for r in range(2):
            want[r].append(int(toks[r]))
        hs.append(hidden)
        prev = hidden
    assert chains == want
    assert all(np.array_equal(a, b) for a, b in zip(trace, hs, strict=True))
    assert c1.current_seq_len == 10 and np.array_equal(c1.k.current_data(), c2.k.current_data())


@pytest.mark.rule("Tier A chain")
def test_a_tier_a_chain_uses_no_position_and_no_cache():
    rng = np.random.default_rng(2)
    seed_h = rng.standard_normal((2, H))
    chains = propose_chain_batched(TIER_A, seed_h, [1, 2], 3, [100, 5], None)
    heads = TIER_A.mtp_heads
    prev, toks, want = seed_h, np.array([1, 2]), [[], []]
    for _ in range(3):
        fused = prev @ heads.h_proj + TIER_A.embed[toks] @ heads.e_proj
        toks = np.argmax(fused @ TIER_A.lm_head, axis=1)
        for r in range(2):
            want[r].append(int(toks[r]))
        prev = fused
    assert chains == want
    assert propose_chain(TIER_A, seed_h[0], 1, 3, 16, 999, None) == want[0]
    # last tokens as a column or as whole floats draft the same chain
    assert propose_chain_batched(TIER_A, seed_h, [[1], [2]], 3, [100, 5], None) == want
    assert propose_chain_batched(TIER_A, seed_h, np.array([1.0, 2.0]), 3, [100, 5], None) == want


@pytest.mark.rule("propose_chain_batched: scalar vs per-row positions",
                  "uniform draft group takes the scalar chain, port",
                  "forward_tokens_rows and its wrappers")
@pytest.mark.parametrize("impl", ["numpy", "torch"])
@pytest.mark.parametrize("starts, scalar, rows", [
    ([7, 7, 7], [7, 8, 9], []),
    ([7, 4, 6], [], [[7, 4, 6], [8, 5, 7], [9, 6, 8]]),
], ids=["uniform", "ragged"])
def test_a_uniform_draft_group_never_reaches_the_ragged_chain_path(impl, starts, scalar, rows,
                                                                    monkeypatch):
    """Three rows holding 9 entries draft 3 tokens from chain starts `starts`: uniform starts
    take `forward_step` at one position (never the ragged mask, never a gathered RoPE table);
    ragged ones `forward_step_rows` at every row's own position, every step. The reference
    front-aligns the group (the batched cache `max(starts) + 3` wide after it); the port
    sets its pool rows' lengths to the starts (each row `start + 3` after it)."""
    spy = StepSpy(monkeypatch, MtpBlock if impl == "numpy" else port_model.MtpBlock)
    ragged = len(set(starts)) > 1
    reset_dsv4_mask_stats()
    reset_rope_path_stats()
    before = dict(port.draft_chain_stats)
    if impl == "numpy":
        batched = front_align_draft_group([draft_history(MODEL, 9, s) for s in range(3)], starts)
        propose_chain_batched(MODEL, np.ones((3, H)), [1, 2, 3], 3, starts, batched)
        assert dsv4_mask_stats["ragged"] == (3 if ragged else 0)
        assert batched.current_seq_len == max(starts) + 3
    else:
        rng = np.random.default_rng(0)
        pool = draft_pool([rng.standard_normal((9, HD)) for _ in range(3)])
        align_rows(pool, torch.arange(3), starts)
        port.propose_chain_batched(PORT, torch.ones((3, H), dtype=torch.float64), [1, 2, 3], 3,
                                   starts, pool)
        taken = {k: port.draft_chain_stats[k] - before[k] for k in before}
        assert taken == {"scalar": 0 if ragged else 3, "per_row": 3 if ragged else 0}
        assert rope_path_stats["uniform" if ragged else "gathered"] == 0
        assert pool.lens.tolist() == [s + 3 for s in starts]
    assert (spy.scalar, spy.rows) == (scalar, rows)


@pytest.mark.rule("forward_tokens_rows and its wrappers",
                  "propose_chain_batched: scalar vs per-row positions",
                  "group loop: write-back with split and strip, then record drafts")
@given(st.data())
def test_a_ragged_draft_group_drafts_each_row_as_if_alone(data):
    g = data.draw(st.integers(1, 4), label="G")
    starts = data.draw(st.lists(st.integers(1, 14), min_size=g, max_size=g), label="starts")
    tails = data.draw(st.lists(st.integers(0, 3), min_size=g, max_size=g), label="tails")
    n = data.draw(st.integers(1, 4), label="n")
    seed = data.draw(st.integers(0, 2 ** 31), label="seed")
    rng = np.random.default_rng(seed)
    seeds, lasts = rng.standard_normal((g, H)), rng.integers(0, V, g)
    caches = [draft_history(MODEL, s + t, seed + r)
              for r, (s, t) in enumerate(zip(starts, tails, strict=True))]
    batched = front_align_draft_group(caches, starts)
    trace: list = []
    chains = propose_chain_batched(MODEL, seeds, lasts, n, starts, batched, trace)
    pieces = split_draft_cache(batched, g)
    for r in range(g):
        alone_cache = caches[r].clone()
        alone_cache.set_len(starts[r])
        alone_trace: list = []
        alone = propose_chain_batched(MODEL, seeds[r: r + 1], lasts[r: r + 1], n, [starts[r]],
                                      alone_cache, alone_trace)
        assert chains[r] == alone[0]
        for step in range(n):
            assert close(trace[step][r], alone_trace[step][0]), f"row {r} step {step}"
        drop_dead_prefix(pieces[r], max(starts) - starts[r])
        assert pieces[r].current_seq_len == starts[r] + n
        assert close(pieces[r].k.current_data(), alone_cache.k.current_data())
    # the same group through the group loop (u = 1, w = n + 1, own KV = start + 1)
    states = [DraftKv(cache=c, filled=s, seed=(s, seeds[r]))
              for r, (c, s) in enumerate(zip(caches, starts, strict=True))]
    toks = [[0] * s + [int(lasts[r])] for r, s in enumerate(starts)]
    warnings: list[str] = []
    drafts = ref.group_drafting_loop(MODEL, {(1, 0): list(range(g))}, states, toks,
                                     [s + 1 for s in starts], [99] * g, n + 1, True, warnings)
    unbatchable = g > 1 and len(set(starts)) == 1 and len(
        {(c.current_seq_len, c.k.capacity_seq_len) for c in caches}) > 1
    if unbatchable:  # a uniform group takes batch_draft_caches, which refuses unequal histories
        assert drafts == [[]] * g and len(warnings) == 1
        assert all(s_.filled == s for s_, s in zip(states, starts, strict=True))
    else:
        assert drafts == chains and warnings == []
        assert [s_.filled for s_ in states] == [s + 1 for s in starts]
        assert [s_.cache.current_seq_len for s_ in states] == [s + n for s in starts]


# --- the port's chain on pool rows -----------------------------------------------------------


@pytest.mark.rule("propose_chain_batched, port", "uniform draft group takes the scalar chain, port")
@given(case=chain_groups())
def test_the_chain_on_pool_rows_matches_the_reference_group(case):
    """Reference: `front_align_draft_group`, `propose_chain_batched`, `split_draft_cache`,
    `drop_dead_prefix`. Port: the rows' lengths set to their starts + `propose_chain_batched`
    on the pool rows. Same tokens, same hidden per step (1e-12), same draft caches (history
    bit-exact, the n new entries 1e-12, V == K), the other pool rows untouched; the scalar
    branch taken iff the starts are uniform (`draft_chain_stats`)."""
    starts, tails, others, order, n, seed = case
    g = len(starts)
    rng = np.random.default_rng(seed)
    group_k = [rng.standard_normal((s + t, HD)) for s, t in zip(starts, tails, strict=True)]
    other_k = [rng.standard_normal((m, HD)) for m in others]
    seeds, lasts = rng.standard_normal((g, H)), rng.integers(0, V, g)
    batched = front_align_draft_group([ref_draft_kv(MODEL, k) for k in group_k], starts)
    ref_trace: list = []
    chains = propose_chain_batched(MODEL, seeds, lasts, n, starts, batched, ref_trace)
    pieces = split_draft_cache(batched, g)
    for piece, s in zip(pieces, starts, strict=True):
        drop_dead_prefix(piece, max(starts) - s)
    slots = [None] * len(order)
    for j, k in enumerate(group_k + other_k):
        slots[order[j]] = k
    rows = torch.tensor(order[:g])
    pool = draft_pool(slots)
    before, taken = pool.clone(), dict(port.draft_chain_stats)
    align_rows(pool, rows, starts)
    port_trace: list = []
    got = port.propose_chain_batched(PORT, to_port(seeds), torch.from_numpy(lasts), n,
                                     torch.tensor(starts), pool, port_trace, rows)
    assert host(got).tolist() == chains
    ragged = len(set(starts)) > 1
    taken = {k: port.draft_chain_stats[k] - taken[k] for k in taken}
    assert taken == {"scalar": 0 if ragged else n, "per_row": n if ragged else 0}
    for step in range(n):
        assert_close64(port_trace[step], ref_trace[step], what=f"step {step} hidden")
    for r, (s, piece) in enumerate(zip(starts, pieces, strict=True)):
        k_row, v_row = pool.row(int(rows[r]))
        assert k_row.shape[1] == s + n == piece.current_seq_len
        assert_bit_exact(v_row, k_row, "V == K")
        assert_bit_exact(k_row[0, :s], held_k(piece, HD)[:s], f"row {r}: history")
        assert_close64(k_row[0, s:], held_k(piece, HD)[s:], what=f"row {r}: drafted entries")
    for j in range(g, len(order)):
        slot, m = order[j], others[j - g]
        assert int(pool.lens[slot]) == m
        assert_bit_exact(pool.k[slot, :, :m], before.k[slot, :, :m], "another sequence's KV")


@pytest.mark.rule("propose_chain_batched, port")
def test_chain_refusals_and_empty_cases_match_the_reference():
    rng = np.random.default_rng(1)
    ks = [rng.standard_normal((9, HD)) for _ in range(2)]
    seeds = rng.standard_normal((2, H))
    for starts, with_cache, aligned in (([7], True, False),      # a count mismatch
                                        ([7, 7], False, False),  # a block without a draft KV
                                        ([7, 7], True, False),   # held 9, max start 7: desync
                                        ([8, 5], True, True)):   # fine
        caches = [ref_draft_kv(MODEL, k) for k in ks]
        ref_cache = None
        if aligned:
            ref_cache = front_align_draft_group(caches, starts)
        elif with_cache and len(starts) == 2:
            ref_cache = KvCache.new_normal(4096, 16)
            ref_cache.append(np.stack([k[None] for k in ks]), np.stack([k[None] for k in ks]))
        elif with_cache:
            ref_cache = caches[0]
        pool = draft_pool(ks) if with_cache else None
        if aligned:
            align_rows(pool, torch.arange(2), starts)
        r = outcome(propose_chain_batched, MODEL, seeds, [1, 2], 3, starts, ref_cache)
        p = outcome(port.propose_chain_batched, PORT, to_port(seeds), [1, 2], 3, starts, pool)
        if assert_same_refusal(p, r, f"chain {starts}"):
            assert host(p[1]).tolist() == r[1]
        else:
            assert r[1] in (StepRefusal, DispatchRefusal)
    assert host(port.propose_chain_batched(PORT, to_port(seeds), [1, 2], 0, [7], None)).tolist() \
        == propose_chain_batched(MODEL, seeds, [1, 2], 0, [7], None) == [[], []]
    empty = torch.zeros((0, H), dtype=torch.float64)
    assert port.propose_chain_batched(PORT, empty, [], 3, [], None).shape[0] == 0 == \
        len(propose_chain_batched(MODEL, np.zeros((0, H)), [], 3, [], None))


@pytest.mark.rule("propose_chain_batched, port")
def test_a_tier_a_chain_matches_the_reference_without_any_cache():
    rng = np.random.default_rng(2)
    seeds, lasts = rng.standard_normal((3, H)), rng.integers(0, V, 3)
    ref_trace, port_trace = [], []
    want = propose_chain_batched(TIER_A, seeds, lasts, 4, [5, 9, 2], None, ref_trace)
    got = port.propose_chain_batched(PORT_A, to_port(seeds), torch.from_numpy(lasts), 4,
                                     [5, 9, 2], None, port_trace)
    assert host(got).tolist() == want
    for a, b in zip(port_trace, ref_trace, strict=True):
        assert_close64(a, b, what="tier A hidden")


@pytest.mark.rule("draft chain and extension refusals, port")
def test_argmax_tokens_takes_the_last_axis_and_refuses_an_empty_vocab():
    assert port.argmax_tokens(torch.tensor([1.0, 3.0, 2.0])).tolist() == 1  # 1-D: one token
    assert port.argmax_tokens(torch.zeros((2, 1))).tolist() == [0, 0]  # V == 1
    x = torch.zeros((2, 3, 4))
    x[0, 2, 1] = x[1, 0, 3] = 1.0
    assert port.argmax_tokens(x).tolist() == [[0, 0, 1], [3, 0, 0]]  # over V, not axis 1
    assert tuple(port.argmax_tokens(torch.zeros((2, 0, 3))).shape) == (2, 0)
    for shape, text in (((2, 0), "[2, 0]"), ((), "[]")):
        with pytest.raises(ValueError) as info:
            port.argmax_tokens(torch.zeros(shape))
        assert str(info.value) == f"logits shape {text} must be [..., V], V >= 1"


def small_pool(n_rows: int = 2, held: int = 2):
    rng = np.random.default_rng(7)
    return draft_pool([rng.standard_normal((held, HD)) for _ in range(n_rows)])


@pytest.mark.rule("draft chain and extension refusals, port")
def test_chain_refusals_name_the_values():
    seeds = to_port(np.zeros((2, H)))
    for args, text in (
        ((to_port(np.zeros((2, 1, H))), [1, 2], 3), f"seed_hidden (2, 1, {H}) must be [G,H]"),
        ((seeds, [1, 2], -1), "chain length -1 must be >= 0"),
        ((seeds, [1, 2, 3], 1), "3 last tokens for a draft group of 2"),
        ((seeds, [-1, 2], 1), f"tokens must be in [0, {V})"),
        ((seeds, [1, V], 1), f"tokens must be in [0, {V})"),
    ):
        with pytest.raises(ValueError) as info:
            port.propose_chain_batched(PORT, *args, [2, 2], small_pool())
        assert str(info.value) == text
    got = port.propose_chain_batched(PORT, seeds, [1, V - 1], 1, [2, 2], small_pool())
    assert (tuple(got.shape), got.dtype) == ((2, 1), torch.int64)


@pytest.mark.rule("draft chain and extension refusals, port")
@pytest.mark.parametrize("model", [PORT, PORT_A], ids=["block", "tier_a"])
def test_chain_results_are_int64_and_a_float32_seed_runs_in_the_model_dtype(model):
    seeds = np.random.default_rng(1).standard_normal((2, H))
    empty = port.propose_chain_batched(model, to_port(seeds), [1, 2], 0, [2, 2], small_pool())
    assert (tuple(empty.shape), empty.dtype) == ((2, 0), torch.int64)
    got = port.propose_chain_batched(model, to_port(seeds), [1, 2], 2, [2, 2], small_pool())
    assert got.dtype == torch.int64
    trace32: list = []
    port.propose_chain_batched(model, to_port(seeds, torch.float32), [1, 2], 2, [2, 2],
                               small_pool(), trace32)
    assert [t.dtype for t in trace32] == [torch.float64] * 2  # the seed cast to the model's


# --- the backends' propose_chain ------------------------------------------------------------------


def backend_models(cfg: ModelConfig | None = None):
    return built_model(PORT_BE, cfg), built_model(REF_BE, cfg)


def same_kv(p, r, what):
    assert_same_cache(PORT_BE.materialize(p), REF_BE.materialize(r), "float64", what)


def chain_twice(n1: int, n2: int, seed: int) -> None:
    """`propose_chain` on each backend's `new_draft_cache` (the port: a pool row), twice in a
    row (the second chain starts where the first ended): n greedy tokens, the draft KV one
    entry longer per step; the reference's is its own `propose_chain_batched`; the port's
    tokens, lengths, capacities and draft KV the reference's (1e-12); an empty group drafts
    nothing and leaves the draft KV as it was."""
    pm, rm = backend_models()
    rng = np.random.default_rng(seed)
    p_kv, r_kv = PORT_BE.new_draft_cache(pm), REF_BE.new_draft_cache(rm)
    twin = REF_BE.new_draft_cache(rm)
    start = 0
    for n in (n1, n2):
        seed_h, last = rng.standard_normal((1, H)), int(rng.integers(0, V))
        want = REF_BE.propose_chain(rm, seed_h, [last], n, [start], r_kv)
        assert want == propose_chain_batched(rm, seed_h, [last], n, [start], twin)
        assert PORT_BE.propose_chain(pm, to_port(seed_h), [last], n, [start], p_kv) == want
        start += n
        assert len(want[0]) == n and REF_BE.cache_len(r_kv) == start == PORT_BE.cache_len(p_kv)
        same_kv(p_kv, r_kv, "draft KV")
    empty = np.zeros((0, H))
    assert PORT_BE.propose_chain(pm, empty, [], 3, [], p_kv) == [] == \
        REF_BE.propose_chain(rm, empty, [], 3, [], r_kv)
    assert_exact(PORT_BE.cache_len(p_kv), REF_BE.cache_len(r_kv),
                 "draft KV length after an empty group")


@pytest.mark.rule("propose_chain on the backend's draft cache, port",
                  "prompt priming, the draft group loop and the MTP step, backend")
@pytest.mark.parametrize("n1, n2", [(0, 1), (0, 3), (0, 20), (3, 20), (2, 3)])
def test_propose_chain_on_a_draft_kv_matches_the_reference(n1, n2):
    """`chain_twice` on fixed cases: chains of 0, 1, 3 and 20 tokens (past the draft KV's 16
    columns: a 512-column block)."""
    chain_twice(n1, n2, n1 * 7 + n2)


@pytest.mark.slow
@pytest.mark.rule("propose_chain on the backend's draft cache, port")
@given(n1=st.integers(0, 3), n2=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_the_backend_propose_chain_runs_on_its_own_draft_cache(n1, n2, seed):
    """`chain_twice` on generated chain lengths and values."""
    chain_twice(n1, n2, seed)


@pytest.mark.rule("propose_chain on the backend's draft cache, port",
                  "one verify step through the target-cache rules, backend")
@pytest.mark.parametrize("n, held, capacity, max_seq_len", [
    (1, 14, 16, 4096), (2, 14, 16, 4096), (20, 14, 16, 4096), (2, 600, 512, 1030)])
def test_propose_chain_on_a_kv_slot_matches_the_reference(n, held, capacity, max_seq_len):
    """C §10.2, §3 on a plain K/V slot of two rows holding `held` entries: the chains, the
    grown capacity (a chain past 16 columns takes a 512 block; near max_seq_len the buffer
    grows by the rows' need plus the chain) and the slot, as the reference's."""
    pm, rm = backend_models()
    rng = np.random.default_rng(n + held)
    k = rng.integers(-4, 5, (2, 1, held, HD)).astype(np.float64)
    pk = PORT_BE.kv_from_arrays(k, k, max_seq_len, capacity)
    rk = REF_BE.kv_from_arrays(k, k, max_seq_len, capacity)
    seed = rng.standard_normal((2, H))
    got = PORT_BE.propose_chain(pm, seed, [3, 9], n, [held, held], pk)
    assert_exact(got, REF_BE.propose_chain(rm, seed, [3, 9], n, [held, held], rk), "chains")
    assert_exact(PORT_BE.cache_len(pk), held + n, "slot length")
    same_kv(pk, rk, "slot after the chain")


@pytest.mark.rule("propose_chain on the backend's draft cache, port")
def test_propose_chain_without_a_block_matches_the_reference():
    """Tier A (heads only, no draft KV): the chain from the heads alone."""
    pm, rm = backend_models(ModelConfig(mtp="heads"))
    seed = np.random.default_rng(5).standard_normal((2, H))
    assert_exact(PORT_BE.propose_chain(pm, seed, [1, 2], 3, [4, 6], None),
                 REF_BE.propose_chain(rm, seed, [1, 2], 3, [4, 6], None), "heads-only chains")


@pytest.mark.rule("propose_chain_batched, port")
@pytest.mark.parametrize("stale", [None, 0, 1, 2, 3])
def test_a_chain_given_staged_vectors_drafts_as_one_that_uploads_its_own(stale):
    """`staged` (the draft loop's one transfer for every group) is used only where each
    vector equals the call's own: with staged vectors equal to the call's the chain is the
    plain one; with one vector stale (last tokens, rows, ragged starts, pool lengths) the
    call uploads its own, so the chain, the pool's lengths and its K are the plain ones."""
    rng = np.random.default_rng(7)
    ks = [rng.standard_normal((m, HD)) for m in (6, 5, 7)]
    seeds, lasts, rows, starts = rng.standard_normal((2, H)), [3, 5], [2, 0], [4, 3]

    def run(staged_of):
        pool = draft_pool(ks)
        align_rows(pool, rows, starts)
        own = [np.asarray(x, dtype=np.int64) for x in (lasts, rows, starts)]
        own.append(pool.pending_upload().copy())
        staged = None if staged_of is None else staged_of(own)
        got = port.propose_chain_batched(PORT, to_port(seeds), lasts, 2, starts, pool,
                                         rows=rows, staged=staged)
        return host(got).tolist(), pool.host_lens().tolist(), host(pool.k)

    plain = run(None)

    def staged_of(own):
        hosts = [v.copy() for v in own]
        if stale is not None:
            hosts[stale][0] += 1
        # the device side: the equal host vectors' values, or a stale one's (never used)
        return hosts, [torch.as_tensor(v, device=DEVICE) for v in hosts]

    got = run(staged_of)
    assert got[0] == plain[0] and got[1] == plain[1]
    assert_bit_exact(got[2], plain[2], "pool K")
