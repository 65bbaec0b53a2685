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


def attention_rules(name: str):
    """Attention of an implementation with host inputs and outputs: `attention(q, k, v, mask,
    sinks=None)`, `dsv4_attention(q, k, v, compressed_kv, attention_mask, cfg, sinks=None)`
    (`cfg` a `reference.attention.Dsv4AttentionConfig`), and `mask_stats()` / `reset_stats()`,
    the counters of the mask path `dsv4_attention` took. The port's run in float64 on its
    device and come back as float64 host arrays."""
    from types import SimpleNamespace

    if name == "reference":
        from raggedspec.reference import attention as ref

        return SimpleNamespace(attention=ref.attention, dsv4_attention=ref.dsv4_attention,
                               mask_stats=lambda: dict(ref.dsv4_mask_stats),
                               reset_stats=ref.reset_dsv4_mask_stats)
    require_port(name)
    from raggedspec.gpu import attention as port
    from raggedspec.gpu.testing import host, to_port

    def opt(a):
        return None if a is None else to_port(a)

    def attention(q, k, v, mask, sinks=None):
        return host(port.attention(to_port(q), to_port(k), to_port(v), opt(mask), opt(sinks)))

    def dsv4(q, k, v, comp, mask, cfg, sinks=None):
        cfg = port.Dsv4AttentionConfig(cfg.compress_ratio, cfg.sliding_window, cfg.raw_prefix,
                                       cfg.row_q0)
        return host(port.dsv4_attention(to_port(q), to_port(k), to_port(v), opt(comp),
                                        opt(mask), cfg, opt(sinks)))

    return SimpleNamespace(attention=attention, dsv4_attention=dsv4,
                           mask_stats=lambda: dict(port.dsv4_mask_stats),
                           reset_stats=port.reset_dsv4_mask_stats)


# Attention oracles (plain Python loops over absolute positions; they share no code with
# either implementation) and the builders of front-aligned ragged batches.


def softmax_oracle(logits: list[float], values: list, sink: float | None):
    """Plain softmax-weighted sum; the sink joins the denominator only."""
    import math

    import numpy as np

    top = max(logits + ([sink] if sink is not None else []))
    weights = [math.exp(x - top) for x in logits]
    denom = sum(weights) + (math.exp(sink - top) if sink is not None else 0.0)
    out = np.zeros_like(values[0]) if values else np.zeros(0)
    for w, v in zip(weights, values, strict=True):
        out = out + w * v
    return out / denom


def attention_oracle(q, k, v, keep, sinks):
    """Per (row, head, query) loop over kept keys; `keep[b][h][r][j]` booleans; query head h
    reads KV head `h // (H // Hk)`."""
    import math

    import numpy as np

    b_, h_, t_q, d = q.shape
    group = h_ // k.shape[1]
    out = np.zeros((b_, h_, t_q, v.shape[3]))
    for b in range(b_):
        for h in range(h_):
            for r in range(t_q):
                cols = [j for j in range(k.shape[2]) if keep[b][h][r][j]]
                logits = [float(q[b, h, r] @ k[b, h // group, j]) / math.sqrt(d) for j in cols]
                vals = [v[b, h // group, j] for j in cols]
                sink = None if sinks is None else float(sinks[h])
                out[b, h, r] = softmax_oracle(logits, vals, sink) if cols else 0.0
    return out


def union_attention_oracle(row, window: int, ratio: int, sinks):
    """`[H, t_q, D]`: each query of one sequence alone (`row`, as `make_rows` builds it) over
    its valid raw keys (`qp - window < p <= qp`) and complete compressed blocks
    (`(b + 1) * ratio <= qp + 1`)."""
    import math

    import numpy as np

    h_, t_q, d = row.q.shape
    n = row.keys.shape[0]
    out = np.zeros((h_, t_q, row.vals.shape[1]))
    for h in range(h_):
        for r in range(t_q):
            qp = n - t_q + r
            keys = [(row.keys[p], row.vals[p]) for p in range(n) if qp - window < p <= qp]
            if row.comp is not None:
                keys += [(row.comp[b], row.comp[b]) for b in range(row.comp.shape[0])
                         if (b + 1) * ratio <= qp + 1]
            logits = [float(row.q[h, r] @ key) / math.sqrt(d) for key, _ in keys]
            sink = None if sinks is None else float(sinks[h])
            out[h, r] = softmax_oracle(logits, [val for _, val in keys], sink)
    return out


def make_rows(lengths, t_q, ratio, heads, dim, rng, extra_c=0):
    """One sequence per length: `keys`, `vals [n, D]` (positions 0..n-1, this step's `t_q`
    tokens included), `comp [n // ratio + extra_c, D]` (its complete blocks, then `extra_c`
    incomplete garbage ones; None for a Standard layer) and queries `q [H, t_q, D]`."""
    from types import SimpleNamespace

    rows = []
    for n_cached in lengths:
        n = n_cached + t_q
        comp = rng.normal(size=(n // ratio + extra_c, dim)) if ratio > 1 else None
        rows.append(SimpleNamespace(keys=rng.normal(size=(n, dim)), vals=rng.normal(size=(n, dim)),
                                    comp=comp, q=rng.normal(size=(heads, t_q, dim))))
    return rows


def batch_of(rows, t_q: int, ratio: int, dead_rng=None, extra_c=0):
    """Front-align `make_rows` rows into `(q, k, v, compressed_kv)`: row i's raw run ends at
    the shared column; its dead prefix (and compressed rows past its own) are zeros, or noise
    from `dead_rng` (what a perturbation test changes)."""
    import numpy as np

    n_max = max(r.keys.shape[0] for r in rows)
    b_, dim = len(rows), rows[0].keys.shape[1]

    def dead(shape):
        return np.zeros(shape) if dead_rng is None else dead_rng.normal(size=shape) * 3.0

    k, v = dead((b_, 1, n_max, dim)), dead((b_, 1, n_max, dim))
    comp = dead((b_, 1, n_max // ratio + extra_c, dim)) if ratio > 1 else None
    for i, r in enumerate(rows):
        n = r.keys.shape[0]
        k[i, 0, n_max - n:] = r.keys
        v[i, 0, n_max - n:] = r.vals
        if comp is not None:
            own = n // ratio  # the row's complete blocks; the rest stay dead
            comp[i, 0, :own] = r.comp[:own]
    return np.stack([r.q for r in rows]), k, v, comp


def naive_attention(q, k, v, mask, sinks):
    """Plain same-dtype attention on torch tensors (the low-precision tests' yardstick):
    everything in `q.dtype`, the sink as an extra logit column dropped after the softmax, GQA
    by `repeat_interleave`."""
    import math

    import torch

    h, hk = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        logits = logits + mask.to(q.dtype)
    if sinks is not None:
        col = sinks.to(q.dtype)[None, :, None, None].expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, col], dim=-1)
    p = torch.softmax(logits, dim=-1)
    return (p[..., :-1] if sinks is not None else p) @ v


def malformed_cases(table):
    """Parametrize a test over `(case id, call, message)` rows as its `call` and `message`."""
    return pytest.mark.parametrize("call, message", [(c, m) for _, c, m in table],
                                   ids=[n for n, _, _ in table])


def assert_refused(exc: type, call, message: str) -> None:
    """`call()` raises `exc` whose message is exactly `message`."""
    with pytest.raises(exc) as info:
        call()
    assert str(info.value) == message, f"{str(info.value)!r} != {message!r}"
