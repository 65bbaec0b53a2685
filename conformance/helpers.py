"""Helpers shared by the conformance tests (one module, so no test file copies another's).

Hypothesis strategies live in `conformance/strategies.py`; the backend under test and the
comparison policy in `conformance/backends.py`; everything else two or more test files need is
here, in one section per topic.
"""

from __future__ import annotations

import json
import re

import pytest

from raggedspec.conformance.backends import backend_under_test, reference_backend
from raggedspec.reference import simulator
from raggedspec.reference.scenario import load_scenario, model_config
from raggedspec.reference.scheduler import (
    RaggedAdmission,
    SchedulerState,
    SeqRecord,
    install_admission,
)
from raggedspec.reference.trace_reader import TraceError, read_trace_strict


# --- the step simulator: scenarios, traces, the scheduler's records, the integer hash -------

GRANTED = {"advance": "per-sequence", "xs_per_seq": True, "admission": "grant", "world": "WB"}
"""Per-sequence advance requested and granted (WB, the xs flag, ragged admission granted).
Spread it first and name a `world` after it to run the same grant in another world."""


def accept_file(tmp_path, counts) -> str:
    """An accept-count file (the `file` acceptance model) holding `counts`; its path."""
    path = tmp_path / "accepts.json"
    path.write_text(json.dumps(counts))
    return str(path)


def cohort_example(tmp_path, **extra) -> dict:
    """C §16 cohort example: two 9-token prompts; the first decode (A accepts 0, B 1) keeps
    1, so the second decode is the spec's step at C = 10 with A u = 1, B u = 2."""
    return {"requests": [{"prompt_len": 9, "max_new_tokens": 40}] * 2, "depth": 3, "steps": 4,
            "acceptance": {"model": "file",
                           "path": accept_file(tmp_path, {"0": [0, 3], "1": [1, 0]})},
            **extra}


def per_sequence_example(tmp_path, **extra) -> dict:
    """C §16 PerSequence example: A (seq 0) prefilled with 12 tokens, B (seq 1) with 10, then
    decoded together under granted per-sequence advance (WB); A accepts 2, B 0."""
    return {"requests": [{"prompt_len": 12, "max_new_tokens": 40},
                         {"prompt_len": 10, "max_new_tokens": 40}],
            "depth": 3, "steps": 4, **GRANTED,
            "acceptance": {"model": "file", "path": accept_file(tmp_path, {"0": [2], "1": [0]})},
            **extra}


def normalized_lines(trace) -> list[str]:
    """A trace's JSONL lines with the header's `mode` blanked (the one field in which the
    lengths and tensor modes differ)."""
    out = list(trace.lines())
    head = json.loads(out[0])
    head["mode"] = "-"
    return [json.dumps(head)] + out[1:]


def decode_rows(trace) -> list[tuple[dict, dict]]:
    """Every (step, row) of the decode steps, in order."""
    return [(s, r) for s in trace.steps() if s["phase"] == "decode" for r in s["rows"]]


FIXED = [
    dict(batch=5, prompt_len=[3, 9], max_new_tokens=25, steps=14, **GRANTED, strip="lazy"),
    dict(batch=4, prompt_len=[3, 9], max_new_tokens=25, steps=14, **GRANTED),
    dict(batch=3, prompt_len=[5, 9], max_new_tokens=25, steps=12, **GRANTED, strip="none"),
    dict(batch=4, prompt_len=[3, 9], max_new_tokens=25, steps=14, world="WA", xs_per_seq=True),
    dict(batch=4, prompt_len=[5, 9], max_new_tokens=25, steps=12, max_draft_kv_seqs=2,
         arrival="staggered"),
    dict(batch=3, prompt_len=6, max_new_tokens=25, steps=6, max_seq_len=40,
         acceptance="all-accept"),
    dict(batch=4, prompt_len=[3, 12], max_new_tokens=40, steps=16, **GRANTED, max_seq_len=40),
    dict(batch=3, prompt_len=6, max_new_tokens=25, steps=6, model={"mtp": "heads"}),
    dict(batch=4, prompt_len=[2, 9], max_new_tokens=20, steps=12, **GRANTED,
         model={"compress_ratios": [0, 4, 128]}),
]
"""Hand-picked scenarios through the simulator's paths: ragged per-sequence steps under each
strip policy, WA deferrals, LRU eviction, capacity refusals, Tier A, compressed layers."""


def completion(i: int, n: int, **kw) -> SeqRecord:
    """A running completion of `n` tokens (with no cache given, cache_bucket_len n - 1, like
    arc's `seq_of_len`)."""
    return SeqRecord(i, n, **kw)


def prompt(i: int, n: int, **kw) -> SeqRecord:
    """A waiting prompt of `n` tokens."""
    return SeqRecord(i, n, is_prompt=True, **kw)


GRANT = RaggedAdmission.decide(None)
REFUSE = RaggedAdmission.refused()
LENS_64_APART = [50, 114, 179, 243, 307, 371, 436, 500]
"""Eight completions' token counts about 64 apart (masks §16's shattering example)."""


def state_for(world: str, **kw) -> SchedulerState:
    """A scheduler state of `world` (keyword fields as `SchedulerState` takes them); an
    `admission` keyword is installed on both copies (`install_admission`)."""
    admission = kw.pop("admission", None)
    state = SchedulerState(world=world, **kw)
    if admission is not None:
        install_admission(state, admission)
    return state


def raises_exactly(message: str):
    """`pytest.raises(ValueError)` whose message is exactly `message`."""
    return pytest.raises(ValueError, match="^" + re.escape(message) + "$")


M64 = (1 << 64) - 1


def splitmix64_int(x: int) -> int:
    """splitmix64's output for state x in Python integers (Steele, Lea and Flood; Vigna's
    splitmix64.c): the independent oracle of the scenario generator's and the acceptance
    models' hashes."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


TRACE_STEP = {"type": "step", "step": 0, "rows": [{"seq": 0, "own_len": 5}]}
"""The smallest well-formed step line of a trace."""
TRACE_HEADER = {"type": "header", "schema": "raggedspec-trace", "version": 1}
"""A trace header with the schema and version docs/trace.md asks for."""


def write_trace_lines(tmp_path, objs, name: str = "t.jsonl"):
    """A trace file `name` in `tmp_path`: one line per object (JSON-encoded) or text."""
    path = tmp_path / name
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def problems(path) -> list[str]:
    """The problem lines the strict reader refuses `path` with."""
    with pytest.raises(TraceError) as err:
        read_trace_strict(path)
    return err.value.problems


def only_problem(path) -> str:
    """The refusal of a trace with exactly one problem: its one line is the message."""
    with pytest.raises(TraceError) as err:
        read_trace_strict(path)
    assert err.value.problems == [str(err.value)] and err.value.more == 0
    return str(err.value)



# --- end to end: one scenario on two backends ------------------------------------------------

E2E_FLAVOURS = {
    "cohort": {},
    "per-sequence granted": GRANTED,
    "per-sequence refused": {**GRANTED, "xs_per_seq": False},
    "WA ragged cohort": {"world": "WA", "xs_per_seq": True},
}
"""The advance and world settings the end-to-end scenarios run under (per-sequence refused:
requested and granted by admission, but without the xs flag the V4 cache cannot carry it)."""


def e2e_scenario(flavour, batch, plen, extra_len, new, steps, depth, strip, arrival, lru,
                 acceptance, max_seq_len, ratios, seed, mtp, heads=(2, 1)) -> dict:
    """An end-to-end scenario table: `batch` prompts of `plen..plen + extra_len` tokens, a
    model with compressed-layer `ratios`, MTP kind `mtp` and `(n_heads, n_kv_heads)` `heads`,
    under the `E2E_FLAVOURS[flavour]` settings."""
    return {"batch": batch, "prompt_len": [plen, plen + extra_len], "max_new_tokens": new,
            "steps": steps, "depth": depth, "strip": strip, "arrival": arrival,
            "max_draft_kv_seqs": lru, "acceptance": acceptance, "max_seq_len": max_seq_len,
            "seed": seed, "model": {"compress_ratios": ratios, "mtp": mtp, "n_heads": heads[0],
                                    "n_kv_heads": heads[1]},
            **E2E_FLAVOURS[flavour]}


GQA = {
    2: e2e_scenario("per-sequence granted", 3, 3, 6, 25, 9, 3, "eager", "all-at-once", None,
                    "geometric:0.7", 4096, [0, 4], 3, "block", heads=(4, 2)),
    4: e2e_scenario("WA ragged cohort", 4, 2, 6, 20, 9, 2, "eager", "staggered", 2,
                    "profile:0.9,0.5,0.3", 4096, [4, 0, 4], 5, "block", heads=(8, 2)),
    8: e2e_scenario("per-sequence granted", 3, 5, 3, 20, 9, 3, "lazy", "all-at-once", 1,
                    "heterogeneous:0.1,0.95", 4096, [0, 4], 7, "block", heads=(16, 2)),
}
"""Explicit GQA models, one per ratio of query heads to KV heads, each with two KV heads,
through ragged per-sequence steps, the MTP chain and compressed layers."""


def run_both(data: dict, port=None):
    """`data` run with `record_tensors` on the backend under test (or `port`) and on the
    reference: `(port trace, reference trace, port backend)`."""
    sc = load_scenario(data)
    port = backend_under_test() if port is None else port
    ref = simulator.run(sc, record_tensors=True, backend=reference_backend())
    out = simulator.run(sc, record_tensors=True, backend=port)
    return out, ref, port


# --- custom token oracles, named by a scenario's `acceptance = "oracle:module:factory"` --------
# (`raggedspec.conformance.helpers:make_oracle`, ...): well-behaved ones, ones that break the
# `TokenOracle` contract, and factories that fail.


class _ConstantOracle:
    """A custom token oracle for the factory test: every target is 1; drafts are all 1
    except the last, which is 2 (so n - 1 of n drafts are accepted)."""

    def prompt(self, seq_id, length):
        return [1] * length

    def target(self, seq_id, context):
        return 1

    def draft(self, seq_id, context, n):
        return [1] * (n - 1) + [2] if n else []


def make_oracle(scenario):
    return _ConstantOracle()


class _ShortDrafter(_ConstantOracle):
    """Breaks the protocol: proposes one draft fewer than asked."""

    def draft(self, seq_id, context, n):
        return [1] * (n - 1)


class _OutOfVocab(_ConstantOracle):
    """Breaks the protocol: the target after a 7-token context is token 64 = vocab."""

    def target(self, seq_id, context):
        return 64 if len(context) >= 7 else 1


def make_short_drafter(scenario):
    return _ShortDrafter()


def make_out_of_vocab(scenario):
    return _OutOfVocab()


class _LateBadPrompt(_ConstantOracle):
    """Breaks the protocol for sequence 1 only: its prompt is one token short. Both modes
    ask for a request's prompt when it arrives, so both refuse at the same call."""

    def prompt(self, seq_id, length):
        return [1] * (length - (seq_id == 1))


def make_late_bad_prompt(scenario):
    return _LateBadPrompt()


def make_not_an_oracle(scenario):
    return object()


def make_raising(scenario):
    raise RuntimeError("the oracle's weights are missing")


class _Recorder:
    """A token oracle that keeps the scenario its factory got and the arguments of its calls."""

    def __init__(self, scenario):
        self.scenario, self.calls = scenario, []

    def prompt(self, seq_id, length):
        self.calls.append(("prompt", seq_id, length))
        return [0] * length

    def target(self, seq_id, context):
        self.calls.append(("target", seq_id, list(context)))
        return 0

    def draft(self, seq_id, context, n):
        self.calls.append(("draft", seq_id, list(context), n))
        return [0] * n


def make_recorder(scenario):
    return _Recorder(scenario)


def make_nothing(scenario):
    return None


class _ContextOracle:
    """Tokens that hash every value of the context (not only its length) with the scenario's
    seed; a draft of n proposes the true tokens with one wrong at a context-chosen position
    (or none)."""

    def __init__(self, seed: int, vocab: int) -> None:
        self.seed, self.vocab = seed, vocab

    def _next(self, seq_id: int, context) -> int:
        h = self.seed * 31 + seq_id * 7 + sum((j + 1) * t for j, t in enumerate(context))
        return h % self.vocab

    def prompt(self, seq_id, length):
        return [(seq_id * 5 + 3 * j) % self.vocab for j in range(length)]

    def target(self, seq_id, context):
        return self._next(seq_id, context)

    def draft(self, seq_id, context, n):
        out = list(context)
        for _ in range(n):
            out.append(self._next(seq_id, out))
        bad = (seq_id + len(context)) % (n + 1)
        if bad < n:
            out[len(context) + bad] = (out[len(context) + bad] + 1) % self.vocab
        return out[len(context):]



def make_context_oracle(scenario):
    return _ContextOracle(scenario.seed, model_config(scenario).vocab)


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
