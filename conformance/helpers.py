"""Helpers shared by the conformance tests (one module, so no test file copies another's).

Hypothesis strategies live in `conformance/strategies.py`; the backend under test and the
comparison policy in `conformance/backends.py`; everything else two or more test files need is
here, in one section per topic.
"""

from __future__ import annotations

import pytest


# --- dispatch, step arithmetic, masks, RoPE, attention -----------------------------------------

IMPLEMENTATIONS = ("reference", "port")
"""The two implementations a topic test body runs on: `reference/` and the torch port."""

each_implementation = pytest.mark.parametrize("impl", IMPLEMENTATIONS)
"""Run a test body once per implementation, as its `impl` argument (a plain parameter, so
Hypothesis tests take it too)."""


def require_port(name: str) -> None:
    """Skip the port's run of a test where torch is not installed."""
    if name == "port":
        pytest.importorskip("torch", reason="the port needs torch: pip install 'raggedspec[torch]'")


def step_backend(name: str):
    """The backend protocol object of an implementation: `NumpyBackend` for the reference, the
    backend under test (`conformance/backends.py`, torch by default) for the port."""
    from raggedspec.conformance.backends import backend_under_test, reference_backend

    require_port(name)
    return reference_backend() if name == "reference" else backend_under_test()


# The §17.1 simulation fixture (`sim_propose_and_verify`): a deterministic target oracle whose
# next token is a function of the context's last token and length, a draft oracle that agrees
# with it at a seeded per-stream rate, a verify block whose row r has seen the window's first
# r + 1 tokens, and emission `accepted ++ [row u-1+a]`.

VOCAB = 97


def target_next(s: int, last: int, n: int) -> int:
    """The target's greedy next token after a context of length n ending in `last`."""
    return (last * 31 + n * 17 + s * 7 + 3) % VOCAB


def agrees(s: int, n: int, rate: float) -> bool:
    """Seeded per-(stream, position) draft/target agreement at `rate` (tuple-of-int hashing
    is deterministic in CPython)."""
    return (hash((s, n, 0x5EED)) % 10_000) < rate * 10_000


def draft_next(s: int, last: int, n: int, rate: float) -> int:
    t = target_next(s, last, n)
    return t if agrees(s, n, rate) else (t + 1) % VOCAB


def sim_propose_and_verify(s, toks, u, w, rate, verify_row=None):
    """One row of one verify step: `(drafted d, accepted a, emitted tokens)`; `verify_row`
    (default `reference.step.window_verify_row`) picks the verify block's row of draft slot j."""
    from raggedspec.reference.step import verify_proposed, window_verify_row

    verify_row = verify_row or window_verify_row
    n = len(toks)
    c, d = n - u, w - u
    drafts, last = [], toks[-1]
    for j in range(d):
        last = draft_next(s, last, n + j, rate)
        drafts.append(last)
    window = toks[c:] + drafts
    rows = [target_next(s, window[r], c + r + 1) for r in range(w)]
    targets = [rows[verify_row(u, j)] for j in range(d)]
    a = len(verify_proposed(drafts, targets).accepted)
    return d, a, drafts[:a] + [rows[verify_row(u, a)]]


def stream_rate(s: int) -> float:
    return 0.5 + 0.45 * ((s * 37) % 10) / 10


def run_streams(streams, w, rule, steps, plan=None):
    """Run a batch of stream ids under "cohort" (`plan`, default `plan_batch_step`) or
    "per_sequence"; returns the per-step histories of u, d, a and the emitted count, and the
    final token lists."""
    from raggedspec.reference.step import plan_batch_step, plan_per_sequence_step

    plan = plan or plan_batch_step
    toks = {s: [1 + s % 50, 11 + s % 7] for s in streams}
    u = {s: 1 for s in streams}
    hist = {"u": [], "d": [], "a": [], "emitted": 0}
    for _ in range(steps):
        us = [u[s] for s in streams]
        hist["u"].append(us)
        if min(us) < 1:
            break
        outs = [sim_propose_and_verify(s, toks[s], u[s], w, stream_rate(s)) for s in streams]
        hist["d"].append([o[0] for o in outs])
        hist["a"].append([o[1] for o in outs])
        accepted = [o[1] for o in outs]
        rule_plan = plan if rule == "cohort" else plan_per_sequence_step
        for s, o, nxt in zip(streams, outs, rule_plan(us, accepted, w).next_uncached,
                             strict=True):
            before = len(toks[s])
            toks[s].extend(o[2])
            assert len(toks[s]) == before + o[1] + 1  # grows by the emitted count
            hist["emitted"] += len(o[2])
            u[s] = nxt
    return hist, toks


def mask_rules(name: str, dtype=None):
    """The mask rules of an implementation with host (NumPy) inputs and outputs: `raw_validity`,
    `compressed_validity`, `ragged_union_mask` and `compose_caller_mask`, each called as the
    reference's function is. The port's run on its device (`gpu.testing.DEVICE`), masks in
    `dtype` (default float64), and come back as float64 / bool host arrays."""
    from types import SimpleNamespace

    if name == "reference":
        from raggedspec.reference import masks

        return SimpleNamespace(raw_validity=masks.raw_validity,
                               compressed_validity=masks.compressed_validity,
                               ragged_union_mask=masks.ragged_union_mask,
                               compose_caller_mask=masks.compose_caller_mask)
    require_port(name)
    import torch

    from raggedspec.gpu import masks
    from raggedspec.gpu.testing import DEVICE, host, to_port

    dtype = dtype or torch.float64

    def union(rows, q0, valid, raw_base, t_k, ratio, t_c):
        rows = torch.tensor([int(r) for r in rows], dtype=torch.int64, device=DEVICE)
        out = masks.ragged_union_mask(rows, q0, to_port(valid), raw_base, t_k, ratio, t_c, dtype)
        assert out.dtype == dtype
        return host(out)

    def caller(local, mask, *sizes):
        out = masks.compose_caller_mask(
            to_port(local, dtype), None if mask is None else to_port(mask, dtype), *sizes)
        assert out.dtype == dtype
        return host(out)

    return SimpleNamespace(
        raw_validity=lambda *a: host(masks.raw_validity(*a, device=DEVICE)),
        compressed_validity=lambda *a: host(masks.compressed_validity(*a, device=DEVICE)),
        ragged_union_mask=union, compose_caller_mask=caller)


def keep_bits(mask):
    """An additive mask as 1 (keep) / 0 (kill) ints, asserting it holds only 0 and -inf."""
    import numpy as np

    mask = np.asarray(mask)
    assert np.all((mask == 0.0) | (mask == -np.inf)), "an additive mask holds only 0 and -inf"
    return (mask == 0.0).astype(int)


def rope_rules(name: str):
    """RoPE of an implementation with host inputs and outputs: `apply_rope(x, offsets,
    rope_dims, theta, inverse=False)` (`x` a float64 array, `offsets` a list) and
    `rope_cos_sin(positions, rope_dims, theta)`, as the reference's functions are called. The
    port's run in float64 on its device and come back as host arrays."""
    from types import SimpleNamespace

    if name == "reference":
        from raggedspec.reference import rope

        return SimpleNamespace(apply_rope=rope.apply_rope, rope_cos_sin=rope.rope_cos_sin)
    require_port(name)
    from raggedspec.gpu import rope
    from raggedspec.gpu.testing import DEVICE, host, to_port

    def apply(x, offsets, rope_dims, theta, inverse=False):
        return host(rope.apply_rope(to_port(x), offsets, rope_dims, theta, inverse))

    def cos_sin(positions, rope_dims, theta):
        cos, sin = rope.rope_cos_sin(positions, rope_dims, theta, device=DEVICE)
        return host(cos), host(sin)

    return SimpleNamespace(apply_rope=apply, rope_cos_sin=cos_sin)
