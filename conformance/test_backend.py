"""Per-method conformance of the backend under test (`conformance/backends.py`; torch by
default, any `package.module:factory` port) against the NumPy reference backend, one
protocol method (or one short chain of them) per property, on Hypothesis inputs.

Policy (`conformance/backends.py`, docs/conformance.md): integers, lengths, capacities,
leads, positions, masks and data movement bit-exact (data movement on values every dtype
holds exactly: small integers); float64 arithmetic within 1e-12 of the reference;
float32 / bfloat16 within 16 eps at the output's scale; refusals raised by both or neither,
same class and same message."""

from __future__ import annotations

import pytest
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from raggedspec.conformance.backends import assert_close, assert_exact, assert_same_cache
from raggedspec.conformance.backends import backend_under_test, reference_backend
from raggedspec.conformance.helpers import assert_same_draft_states, built_model, primed_state
from raggedspec.conformance.helpers import prompt_cache
from raggedspec.conformance.strategies import corner_lengths, lead_pads
from raggedspec.reference import dispatch, step
from raggedspec.reference.attention import Dsv4AttentionConfig
from raggedspec.reference.backend import PROTOCOL_METHODS, missing_methods
from raggedspec.reference.errors import Refusal
from raggedspec.reference.model import ModelConfig


def port():
    return backend_under_test()


REF = reference_backend()


def outcome(fn, *args, **kwargs):
    """`("ok", value)`, `("refused", class name, message)` or `("malformed", "ValueError")`."""
    try:
        return ("ok", fn(*args, **kwargs))
    except Refusal as exc:
        return ("refused", type(exc).__name__, str(exc))
    except ValueError:
        return ("malformed", "ValueError")


def same_outcome(p, r, what: str) -> bool:
    """Both refused alike, both malformed, or both ok (True: compare the values next)."""
    assert p[0] == r[0], f"{what}: port {p[:3]} but reference {r[:3]}"
    if p[0] == "refused":
        assert p[1:] == r[1:], f"{what}: port refused {p[1:]} but reference {r[1:]}"
    return p[0] == "ok"


def both(method: str, *args, **kwargs):
    """Call `method` on both backends with the same (host) arguments; the outcomes."""
    return outcome(getattr(port(), method), *args, **kwargs), outcome(
        getattr(REF, method), *args, **kwargs
    )


@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_the_backend_under_test_implements_every_protocol_method():
    """A port must override every method of `raggedspec.reference.backend.Backend` (none left to the
    abstract base, whose methods raise NotImplementedError naming themselves). The protocol
    is tensor-side only: at most 30 methods, none of them a length-vector rule (those are the
    step plan's, `reference.plan`)."""
    assert missing_methods(port()) == []
    assert missing_methods(REF) == []
    assert 20 <= len(PROTOCOL_METHODS) <= 30
    assert not {"plan_step_window", "budget_clamp", "draft_groups"} & set(PROTOCOL_METHODS)


# ----------------------------------------------------------------------------- one K/V slot


def _rows(lens, seed, d=4):
    """Per-row K and V `[1, 1, n, d]` of small integers (exact in every dtype)."""
    rng = np.random.default_rng(seed)
    return [
        (
            rng.integers(-8, 9, (1, 1, n, d)).astype(np.float64),
            rng.integers(-8, 9, (1, 1, n, d)).astype(np.float64),
        )
        for n in lens
    ]


def _slots(be, rows, max_seq_len, capacity):
    return [outcome(be.kv_from_arrays, k, v, max_seq_len, capacity) for k, v in rows]


def same_slot(p_kv, r_kv, what: str) -> None:
    """Materialized slots equal bit for bit (lengths, capacities, front-aligned K and V)."""
    p, r = port().materialize(p_kv), REF.materialize(r_kv)
    assert_exact(p["len"], r["len"], f"{what} length")
    assert_exact(p["capacity"], r["capacity"], f"{what} capacity")
    for (pk, pv), (rk, rv) in zip(p["kv"], r["kv"], strict=False):
        assert (pk is None) == (rk is None), f"{what}: materialized in one backend only"
        if rk is not None:
            assert_exact(pk, rk, f"{what} K")
            assert_exact(pv, rv, f"{what} V")


@pytest.mark.rule("K/V append, growth and set_len, backend")
@given(
    lens=corner_lengths(max_rows=5, max_len=40),
    seed=st.integers(0, 99),
    capacity=st.sampled_from([16, 512]),
    max_seq_len=st.sampled_from([4096, 1100, 600]),
    more=st.integers(0, 40),
)
def test_append_growth_and_set_len_match_the_reference(lens, seed, capacity, max_seq_len, more):
    """C §3: appending at the shared length grows the capacity by whole 512 blocks and is
    refused above max_seq_len (lengths at the 512 growth boundaries included); set_len is
    refused past the capacity; data movement bit-exact."""
    rows = _rows(lens[:1], seed)
    p, r = (
        _slots(port(), rows, max_seq_len, capacity)[0],
        _slots(REF, rows, max_seq_len, capacity)[0],
    )
    if not same_outcome(p, r, "kv_from_arrays"):
        return
    pk, rk = p[1], r[1]
    same_slot(pk, rk, "built")
    extra = _rows([more], seed + 1)[0]
    if same_outcome(
        outcome(port().kv_append, pk, *extra), outcome(REF.kv_append, rk, *extra), "kv_append"
    ):
        same_slot(pk, rk, "appended")
    target = max(0, REF.cache_len(rk) - more // 2) if seed % 2 else REF.cache_len(rk) + more * 20
    if same_outcome(
        outcome(port().kv_set_len, pk, target), outcome(REF.kv_set_len, rk, target), "kv_set_len"
    ):
        assert_exact(port().cache_len(pk), REF.cache_len(rk), "length after set_len")
        if target <= len(extra[0][0, 0]) + lens[0]:
            same_slot(pk, rk, "after set_len")


@pytest.mark.rule("front alignment, concatenation, split and dead-prefix strip, backend")
@given(
    lens=corner_lengths(max_rows=5, max_len=40),
    seed=st.integers(0, 99),
    max_seq_len=st.sampled_from([4096, 600]),
    g=st.integers(1, 6),
)
def test_front_align_concat_split_and_strip_match_the_reference(lens, seed, max_seq_len, g):
    """C §4.5, §5.2, §9.8, §4.4 through the protocol: front alignment gives the same leads
    (the port may keep them as offsets) and, materialized, the same front-aligned rows (a
    refused alignment is refused alike); concatenation, the split into g pieces (None when
    not g) and the dead-prefix strip of each piece give the same rows, bit for bit."""
    rows = _rows(lens, seed)
    ps, rs = _slots(port(), rows, max_seq_len, 512), _slots(REF, rows, max_seq_len, 512)
    for p, r in zip(ps, rs, strict=False):
        if not same_outcome(p, r, "kv_from_arrays"):
            return
    pk, rk = [p[1] for p in ps], [r[1] for r in rs]
    p, r = outcome(port().front_align, pk), outcome(REF.front_align, rk)
    if not same_outcome(p, r, "front_align"):
        return
    assert_exact(p[1], r[1], "leads")
    for i, (a, b) in enumerate(zip(pk, rk, strict=False)):
        same_slot(a, b, f"row {i} aligned")
    pb, rb = port().concat(pk), REF.concat(rk)
    same_slot(pb, rb, "concatenated")
    pp, rp = port().split(pb, g), REF.split(rb, g)
    assert (pp is None) == (rp is None), (
        f"split into {g}: port {pp is not None}, reference {rp is not None}"
    )
    if rp is None:
        return
    assert len(pp) == len(rp) == g
    leads = r[1]
    for i, (a, b) in enumerate(zip(pp, rp, strict=False)):
        same_slot(a, b, f"piece {i}")
        if g == len(lens):
            lead = leads[i] + (seed % 3 == 0)  # sometimes one column too many: refused alike?
            if same_outcome(
                outcome(port().strip_dead_prefix, a, lead),
                outcome(REF.strip_dead_prefix, b, lead),
                f"strip piece {i}",
            ):
                same_slot(a, b, f"piece {i} stripped")


@pytest.mark.rule("front_align_draft_group, backend")
@given(
    lens=corner_lengths(max_rows=5, max_len=30, boundaries=False),
    seed=st.integers(0, 99),
    data=st.data(),
)
def test_front_align_draft_group_matches_the_reference(lens, seed, data):
    """C §9.7: every row cut to its chain start, padded to `max(starts)`, capacity narrowed;
    the AlignRefusals (a start past the held length, a count mismatch) alike."""
    rows = _rows(lens, seed)
    ps, rs = _slots(port(), rows, 4096, 16), _slots(REF, rows, 4096, 16)
    pk, rk = [p[1] for p in ps], [r[1] for r in rs]
    starts = [data.draw(st.integers(0, n + (seed % 5 == 0))) for n in lens]
    if seed % 7 == 0:
        starts = starts[:-1]
    p, r = (
        outcome(port().front_align_draft_group, pk, starts),
        outcome(REF.front_align_draft_group, rk, starts),
    )
    if same_outcome(p, r, "front_align_draft_group"):
        same_slot(p[1], r[1], "draft group")


# ----------------------------------------------------------------------------- masks, positions,
# attention


@pytest.mark.rule("dead-prefix union mask, backend")
@given(
    data=st.data(),
    t_q=st.integers(1, 5),
    window=st.integers(1, 12),
    ratio=st.sampled_from([0, 4, 128]),
    kind=st.sampled_from(["none", "uniform", "ragged", "ahead", "short"]),
)
def test_union_mask_matches_the_reference_bit_for_bit(data, t_q, window, ratio, kind):
    """M §4 steps 5-7 and §5: the additive union mask a dsv4 step builds (uniform path, or
    per-row with the dead prefix killed and compressed validity per row), in the backend's
    dtype, equal bit for bit; `resolve_ragged_rows`' DispatchRefusals alike."""
    q0 = data.draw(st.integers(0, 40))
    t_k_full = q0 + t_q
    t_c = 0 if ratio == 0 else data.draw(st.integers(0, t_k_full // ratio + 1))
    b = data.draw(st.integers(1, 5))
    row_q0 = {"none": None, "uniform": [q0] * b,
              "ragged": [q0 - x for x in data.draw(lead_pads(b, b, max_lead=q0))],
              "ahead": [q0 + 1] + [q0] * (b - 1), "short": [max(q0 - 1, 0)] * b}[kind]
    p, r = both("union_mask", t_q, t_k_full, row_q0, window, ratio, t_c)
    if same_outcome(p, r, "union_mask"):
        assert_exact(port().to_numpy(p[1]), r[1], "union mask")


@pytest.mark.rule("RoPE positions and rotation, backend")
@given(
    offsets=st.lists(st.integers(0, 300), min_size=1, max_size=5),
    b=st.integers(1, 5),
    t=st.integers(1, 6),
    theta=st.sampled_from([10000.0, 160000.0]),
    inverse=st.booleans(),
    seed=st.integers(0, 99),
)
def test_rope_positions_and_rotation_match_the_reference(offsets, b, t, theta, inverse, seed):
    """M §11: row i, token t at `offsets[i] + t` (exact); the rotation within the policy."""
    if len(offsets) != 1:
        offsets = (offsets * b)[:b]
    p, r = both("rope_positions", offsets, b, t)
    assert same_outcome(p, r, "rope_positions")
    assert_exact(np.asarray(p[1]), np.asarray(r[1]), "positions")
    x = np.random.default_rng(seed).standard_normal((b, 2, t, 8))
    be = port()
    got = be.apply_rope(x, offsets, 4, theta, inverse)
    assert_close(be.to_numpy(got), REF.apply_rope(x, offsets, 4, theta, inverse), be.dtype, "rope")


@pytest.mark.rule("dsv4_attention, backend")
@given(
    data=st.data(),
    t_q=st.integers(1, 4),
    window=st.integers(1, 10),
    ratio=st.sampled_from([0, 4]),
    kind=st.sampled_from(["none", "ragged", "uniform"]),
    seed=st.integers(0, 999),
)
def test_dsv4_attention_matches_the_reference(data, t_q, window, ratio, kind, seed):
    """M §4: union attention with sinks over raw window keys and compressed keys, per-row
    dead prefixes on the ragged path; within the policy; refusals alike."""
    b = data.draw(st.integers(1, 4))
    t_k = data.draw(st.integers(max(t_q - 1, 1), 14))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, 2, t_q, 8)) * 0.5
    k = rng.standard_normal((b, 1, t_k, 8)) * 0.5
    t_c = 0 if ratio == 0 else t_k // ratio
    comp = rng.standard_normal((b, 1, t_c, 8)) * 0.5 if t_c else None
    q0 = t_k - t_q
    row_q0 = None
    if kind == "ragged" and q0 >= 0:
        row_q0 = [q0 - x for x in data.draw(lead_pads(b, b, max_lead=q0))]
    elif kind == "uniform":
        row_q0 = [max(q0, 0)] * b
    cfg = Dsv4AttentionConfig(ratio, window, 0, row_q0)
    sinks = rng.standard_normal(2)
    be = port()
    p = outcome(be.dsv4_attention, q, k, k, comp, cfg, sinks)
    r = outcome(REF.dsv4_attention, q, k, k, comp, cfg, sinks)
    if same_outcome(p, r, "dsv4_attention"):
        assert_close(be.to_numpy(p[1]), r[1], be.dtype, "attention output")


# ----------------------------------------------------------------------------- model, draft, target
# cache


def quarter_of_the_profile() -> int:
    """Model-level properties run a whole prompt + step per example (~30 ms on the CPU):
    a quarter of the profile's examples (50 at ci, 500 at thorough)."""
    return max(10, settings().max_examples // 4)


def _cfg(ratios, mtp="block", max_seq_len=4096):
    return ModelConfig(compress_ratios=tuple(ratios), mtp=mtp, max_seq_len=max_seq_len)


def models(cfg):
    """(the backend under test's model, the reference's) of `cfg`, built once per backend."""
    return built_model(port(), cfg), built_model(REF, cfg)


def same_cache(p, r, what: str) -> None:
    assert_same_cache(port().materialize(p), REF.materialize(r), port().dtype, what)


@pytest.mark.rule("one verify step through the target-cache rules, backend")
@settings(max_examples=quarter_of_the_profile())
@given(
    plens=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    w=st.integers(1, 4),
    ratios=st.sampled_from([(0, 4), (4,), (0, 128)]),
    seed=st.integers(0, 50),
    per_seq=st.booleans(),
    accept=st.lists(st.integers(0, 3), min_size=4, max_size=4),
)
def test_a_ragged_verify_step_matches_the_reference(plens, w, ratios, seed, per_seq, accept):
    """C §5.2-§5.4, §12; M §4, §11 through the protocol: per-sequence caches from prompt
    forwards, `clone_in` (front alignment under PerSequence: the same leads; a refusal
    alike), the verify forward at per-row positions with per-row masks (`row_q0`) and the
    dead prefix (`lead_pad`), the XsRolling feed, `clone_out`, then the per-sequence commit
    (`commit`) or the cohort rollback (`truncate_by`): hidden, logits and every
    cache within the policy, lengths and capacities exact."""
    cfg = _cfg(ratios)
    pm, rm = models(cfg)
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(0, cfg.vocab, n)) for n in plens]
    pc = [prompt_cache(port(), pm, t) for t in prompts]
    rc = [prompt_cache(REF, rm, t) for t in prompts]
    p = outcome(port().clone_in, pc, [0] * len(pc), True, per_seq)
    r = outcome(REF.clone_in, rc, [0] * len(rc), True, per_seq)
    if not same_outcome(p, r, "clone_in"):
        return
    pi, ri = p[1], r[1]
    assert_exact(pi.lead_pad, ri.lead_pad, "leads")
    assert_exact(pi.ragged_decode_supported, ri.ragged_decode_supported, "ragged_decode_supported")
    c = REF.cache_len(ri.batched)
    assert_exact(port().cache_len(pi.batched), c, "batched length")
    b = len(plens)
    leads = ri.lead_pad
    ragged = per_seq and any(leads)
    offsets = [c - x for x in leads] if ragged else [c]
    row_q0 = offsets if ragged else None
    tokens = rng.integers(0, cfg.vocab, (b, w))
    pf = outcome(port().forward, pm, tokens, pi.batched, offsets, row_q0, leads if ragged else None)
    rf = outcome(REF.forward, rm, tokens, ri.batched, offsets, row_q0, leads if ragged else None)
    if not same_outcome(pf, rf, "forward"):
        return
    be = port()
    assert_close(be.to_numpy(pf[1].hidden), rf[1].hidden, be.dtype, "hidden")
    assert_close(be.to_numpy(pf[1].logits), rf[1].logits, be.dtype, "logits")
    if not same_outcome(
        outcome(be.xs_append, pi.batched, pf[1].hidden),
        outcome(REF.xs_append, ri.batched, rf[1].hidden),
        "xs_append",
    ):
        return
    same_cache(pi.batched, ri.batched, "batched cache after the forward")
    acc = [min(a, w - 1) for a in accept[:b]]
    if ragged:
        committed = step.plan_per_sequence_step([1] * b, acc, w).committed
        pp, rp = be.clone_out(pi.batched, b), REF.clone_out(ri.batched, b)
        for i in range(b):
            own = c - leads[i] + committed[i]
            p = outcome(be.commit, pp[i], leads[i], own, own)
            r = outcome(REF.commit, rp[i], leads[i], own, own)
            if same_outcome(p, r, "commit"):
                same_cache(pp[i], rp[i], f"row {i} after its own commit")
    else:
        n_drop = step.plan_batch_step([1] * b, acc, w).n_drop
        if same_outcome(
            outcome(be.truncate_by, pi.batched, n_drop),
            outcome(REF.truncate_by, ri.batched, n_drop),
            "truncate_by",
        ):
            same_cache(pi.batched, ri.batched, "batched cache after the rollback")
        kv_len, xs_len = c + w - n_drop, c + w - n_drop - (seed % 2)
        if same_outcome(
            outcome(be.commit, pi.batched, 0, kv_len, xs_len),
            outcome(REF.commit, ri.batched, 0, kv_len, xs_len),
            "commit",
        ):
            same_cache(pi.batched, ri.batched, "batched cache after a lazy commit")


@pytest.mark.rule("prompt priming, the draft group loop and the MTP step, backend")
@settings(max_examples=quarter_of_the_profile())
@given(
    plens=st.lists(st.integers(1, 10), min_size=1, max_size=4),
    n=st.integers(0, 4),
    seed=st.integers(0, 50),
    per_seq=st.booleans(),
    uniform=st.booleans(),
    mtp=st.sampled_from(["block", "block", "heads"]),
)
def test_priming_and_the_draft_chain_match_the_reference(plens, n, seed, per_seq, uniform, mtp):
    """C §7.4, §9.3-§9.8, §10: prompt priming (`prime_draft_kv`: filled, seed position and
    hidden, the draft KV), then one group's chain through `draft_chain` (uniform: batched +
    set_len; ragged under per-sequence advance: front-aligned with per-row positions),
    written back and stripped: the warnings, each row's state and draft KV, and in float64
    the chains themselves (the same greedy tokens). Then `mtp_step`'s refusal of a
    desynchronised step, alike."""
    cfg = _cfg((0, 4), mtp)
    pm, rm = models(cfg)
    if uniform:
        plens = [plens[0]] * len(plens)
    rng = np.random.default_rng(seed)
    b = len(plens)
    toks = [
        [int(x) for x in rng.integers(0, cfg.vocab, m + 1)] for m in plens
    ]  # prompt + sampled token
    be = port()
    exact = be.dtype == "float64"

    ps = [primed_state(be, pm, t) for t in toks]
    rs = [primed_state(REF, rm, t) for t in toks]

    def same_states(when: str) -> None:
        assert_same_draft_states(be, REF, ps, rs, be.dtype, not exact, when)

    same_states("after priming")
    cache_lens = [len(t) - 1 for t in toks]
    w = n + 1
    groups = dispatch.draft_groups([1] * b, cache_lens, [True] * b, w, per_seq)
    pw, rw = [], []
    pd = be.draft_chain(pm, groups, ps, toks, cache_lens, [100] * b, w, per_seq, pw)
    rd = REF.draft_chain(rm, groups, rs, toks, cache_lens, [100] * b, w, per_seq, rw)
    assert_exact(pw, rw, "group-loop warnings")
    assert_exact([len(x) for x in pd], [len(x) for x in rd], "chain lengths")
    if exact:
        assert_exact(pd, rd, "chains")
    same_states("after the chain")
    if rm.mtp is not None and rs[0].cache is not None and not rs[0].poisoned:
        held = rs[0].filled  # cut the speculative tail (its entries follow a float argmax)
        be.kv_set_len(ps[0].cache, held)
        REF.kv_set_len(rs[0].cache, held)
        fused = np.random.default_rng(seed).standard_normal((1, 1, cfg.hidden))
        p = outcome(be.mtp_step, pm, fused, [held + 1], ps[0].cache)
        r = outcome(REF.mtp_step, rm, fused, [held + 1], rs[0].cache)
        assert r[0] == "refused" and not same_outcome(p, r, "mtp_step desync")
        p = outcome(be.mtp_step, pm, fused, [held], ps[0].cache)
        r = outcome(REF.mtp_step, rm, fused, [held], rs[0].cache)
        if same_outcome(p, r, "mtp_step"):
            assert_close(be.to_numpy(p[1]), r[1], be.dtype, "mtp step hidden")
            same_states("after one more MTP step")
