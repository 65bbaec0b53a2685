"""Helpers shared by the conformance tests (one module, so no test file copies another's).

Hypothesis strategies live in `conformance/strategies.py`; the backend under test and the
comparison policy in `conformance/backends.py`; everything else two or more test files need is
here, in one section per topic.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

import pytest

import raggedspec

from raggedspec import cli
from raggedspec.conformance.backends import backend_under_test, reference_backend
from raggedspec.gpu.slots import stack_xs, xs_rows
from raggedspec.gpu.testing import assert_bit_exact, assert_close64, host, to_port
from raggedspec.gpu.xs_rolling import XsRolling as PortXs
from raggedspec.reference.xs_rolling import XsRolling as RefXs
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


# --- draft KV, draft chain, tiny model and backends ----------------------------------------


def close(a, b, rel: float = 1e-12) -> bool:
    """`|a - b| <= rel * max(1, max|b|)` elementwise: float64 results that sum the same terms
    in another order (or add exactly-zero masked terms) agree to ~1e-16."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return bool(np.all(np.abs(a - b) <= rel * max(1.0, float(np.max(np.abs(b), initial=0.0)))))


def rms(x, gain, eps: float = 1e-6):
    """RMSNorm over the last axis, written here: `x / sqrt(mean(x^2) + eps) * gain`."""
    return x / np.sqrt((x ** 2).mean(axis=-1, keepdims=True) + eps) * gain


def rope(x, positions, rope_dims: int, theta: float, inverse: bool = False):
    """Rotate the last `rope_dims` dims of `x [..., T, D]` as interleaved pairs, token t at
    `positions[t]` (the conjugate rotation when `inverse`); one loop per pair, written here."""
    x = np.asarray(x, dtype=np.float64)
    out = x.copy()
    d0 = x.shape[-1] - rope_dims
    sign = -1.0 if inverse else 1.0
    for t, pos in enumerate(positions):
        for k in range(rope_dims // 2):
            ang = pos * theta ** (-(2.0 * k) / rope_dims)
            c, s = np.cos(ang), sign * np.sin(ang)
            a, b = x[..., t, d0 + 2 * k], x[..., t, d0 + 2 * k + 1]
            out[..., t, d0 + 2 * k] = a * c - b * s
            out[..., t, d0 + 2 * k + 1] = a * s + b * c
    return out


def rope_at(vec, pos: int, rope_dims: int, theta: float):
    """`rope` of one vector `[D]` at one position."""
    return rope(np.asarray(vec)[None], [pos], rope_dims, theta)[0]


def draft_history(model, n: int, seed: int):
    """A reference draft KV holding `n` slots written from random `(h, tok)` pairs."""
    from raggedspec.reference.draft import extend_draft_cache

    rng = np.random.default_rng(seed)
    cache = model.mtp.new_draft_cache()
    extend_draft_cache(model.mtp, cache, rng.standard_normal((n, model.cfg.hidden)),
                       rng.integers(0, model.cfg.vocab, n), 0)
    return cache


def prompt_cache(be, model, toks, capture=None, own: bool = True):
    """A one-row target cache after a prompt forward of `toks` on backend `be` (compressor
    history fed): the row's own cache (`clone_out`) when `own`, else the batched cache."""
    cfg = model.cfg
    cache = be.new_target_cache(cfg, cfg.max_seq_len, 1)
    fwd = be.forward(model, np.array([list(toks)]), cache, [0], None, None, capture)
    be.xs_append(cache, fwd.hidden)
    return be.clone_out(cache, 1)[0] if own else cache


def primed_state(be, model, toks):
    """A draft state primed on `toks` (L tokens, C §7.4): the prompt forward over `toks[:-1]`
    captured, then `prime_draft_kv`: filled L - 1, seed at L - 2 (no seed without a block)."""
    from raggedspec.reference.dispatch import MtpHiddenCapture
    from raggedspec.reference.draft import DraftKv

    cap = MtpHiddenCapture()
    cap.arm()
    prompt_cache(be, model, toks[:-1], cap)
    state = DraftKv(cache=be.new_draft_cache(model))
    be.prime_draft_kv([state], cap.take(), [list(toks)], 1, model, [])
    return state


def assert_same_draft_states(port_be, ref_be, ps, rs, dtype: str = "float64",
                             committed_only: bool = False, what: str = "") -> None:
    """Two backends' draft states row by row: filled, poisoned and seed position exact; seed
    hidden and draft KV within the comparison policy (`committed_only`: the draft KV's
    columns `[0, filled)` only: past them a chain's entries follow a float argmax)."""
    from raggedspec.conformance.backends import assert_close, assert_exact, assert_same_cache

    assert_exact(len(ps), len(rs), f"{what} row count")
    for i, (a, r) in enumerate(zip(ps, rs, strict=True)):
        if r is None:
            assert a is None, f"{what} row {i}: a state in the port only"
            continue
        assert_exact((a.filled, a.poisoned, None if a.seed is None else a.seed[0]),
                     (r.filled, r.poisoned, None if r.seed is None else r.seed[0]),
                     f"{what} row {i} state")
        if r.seed is not None:
            assert_close(port_be.to_numpy(a.seed[1]), r.seed[1], dtype, f"{what} row {i} seed")
        assert (a.cache is None) == (r.cache is None), f"{what} row {i}: draft KV in one only"
        if r.cache is not None:
            assert_same_cache(port_be.materialize(a.cache), ref_be.materialize(r.cache), dtype,
                              f"{what} row {i} draft KV", r.filled if committed_only else None)


def ref_draft_kv(model, k: np.ndarray):
    """A reference draft KV (capacity 16, growing by 512) holding `k [n, head_dim]` as K and V."""
    cache = model.mtp.new_draft_cache()
    if len(k):
        cache.append(k[None, None], k[None, None].copy())
    return cache


def draft_pool(ks: list[np.ndarray]):
    """The port's pooled draft KV (`gpu.cache.RaggedKv`): row s holds `ks[s] [n_s, head_dim]`
    at columns `[0, n_s)`, capacity the reference's (16, grown by whole 512 blocks)."""
    from raggedspec.gpu.cache import RaggedKv
    from raggedspec.gpu.testing import to_port

    top = max(len(k) for k in ks)
    capacity = 16 if top <= 16 else 16 + 512 * (-(-(top - 16) // 512))
    return RaggedKv.from_rows([to_port(k[None]) for k in ks], [to_port(k[None]) for k in ks],
                              4096, capacity)


def held_k(cache, head_dim: int) -> np.ndarray:
    """A reference draft KV's held K `[n, head_dim]` (none while unmaterialized)."""
    data = cache.k.current_data()
    return np.zeros((0, head_dim)) if data is None else data[0, 0]


class StepSpy:
    """The positions every chain step of a block class is called at: `scalar` (one shared
    position, `forward_step`) or `rows` (per-row positions, `forward_step_rows`)."""

    def __init__(self, monkeypatch, cls):
        self.scalar: list[int] = []
        self.rows: list[list[int]] = []
        orig_step, orig_rows = cls.forward_step, cls.forward_step_rows

        def forward_step(block, fused, pos, cache, *rows):
            self.scalar.append(int(pos))
            return orig_step(block, fused, pos, cache, *rows)

        def forward_step_rows(block, fused, positions, cache, *rows):
            self.rows.append(np.asarray(positions.cpu() if hasattr(positions, "cpu") else positions)
                             .tolist())
            return orig_rows(block, fused, positions, cache, *rows)

        monkeypatch.setattr(cls, "forward_step", forward_step)
        monkeypatch.setattr(cls, "forward_step_rows", forward_step_rows)


def kv_history(model, lens: list[int], rng, dtype=None) -> list[list[np.ndarray]]:
    """`hist[layer][i]`: row i's cached K (== V) of every target layer, `[lens[i], head_dim]`
    (`[n_kv_heads, lens[i], head_dim]` with several KV heads), rounded to the torch `dtype`
    when given (so both sides hold it exactly)."""
    from raggedspec.gpu.testing import representable

    d, hk = model.cfg.head_dim, model.cfg.n_kv_heads
    out = []
    for _ in model.layers:
        rows = [rng.standard_normal((n, d) if hk == 1 else (hk, n, d)) for n in lens]
        out.append([r if dtype is None else representable(r, dtype) for r in rows])
    return out


def front_aligned_batch(model, hist):
    """The reference's front-aligned batch of `kv_history` rows: row i's run ends at column
    C = max(lens), zeros in front (its lead), capacity 512 (the plain cache's); and the
    leads."""
    from raggedspec.reference.cache import KvCache, NormalCache, SingleCache

    lens = [h.shape[-2] for h in hist[0]]
    c = max(lens)
    if c == 0:
        return model.new_cache(), [0] * len(lens)
    slots = []
    for rows in hist:
        data = np.zeros((len(lens), model.cfg.n_kv_heads, 512, model.cfg.head_dim))
        for i, h in enumerate(rows):
            data[i, :, c - h.shape[-2]: c] = h
        slots.append(KvCache(SingleCache(model.cfg.max_seq_len, 512, c, 0, None, data.copy()),
                             SingleCache(model.cfg.max_seq_len, 512, c, 0, None, data.copy())))
    return NormalCache(slots), [c - n for n in lens]


def in_place_cache(model, hist, dtype=None):
    """The port's in-place rows of `kv_history` (one `RaggedKv` per layer): row i's K at
    columns `[0, lens[i])`, in the torch `dtype` (default float64)."""
    from raggedspec.gpu.cache import RaggedKv
    from raggedspec.gpu.testing import to_port

    out = []
    for rows in hist:
        ks = [to_port(h if h.ndim == 3 else h[None], dtype) for h in rows]
        out.append(RaggedKv.from_rows(ks, [k.clone() for k in ks], model.cfg.max_seq_len))
    return out


_BUILT: dict = {}


def built_model(be, cfg=None):
    """`be.build_model(cfg)` (the default config when None), built once per backend object
    and config."""
    from raggedspec.reference.model import ModelConfig

    cfg = cfg or ModelConfig()
    key = (id(be), cfg)
    if key not in _BUILT:
        _BUILT[key] = (be, be.build_model(cfg))  # the backend kept: its id stays its own
    return _BUILT[key][1]


# --- KV cache, alignment and batch assembly, XsRolling, paged KV, kernels ----------------------




def xs_state(slot) -> tuple[list[int], list[int], list[np.ndarray], list[np.ndarray]]:
    """`(tokens, base, history, comp)` of a reference or port XsRolling slot, read through
    the rows it reports (`row_history`, `row_comp`) as float64 host arrays."""
    tokens, base = host(slot.tokens).tolist(), host(slot.base).tolist()
    rows = range(len(tokens))
    return (tokens, base, [host(slot.row_history(i)) for i in rows],
            [host(slot.row_comp(i)) for i in rows])


def assert_same_xs(port, ref, what: str = "") -> None:
    """A port XsRolling slot holds the reference's state: tokens, base and width equal, each
    row's retained history bit for bit, its compressed rows within 1e-12 (float64 means)."""
    p, r = xs_state(port), xs_state(ref)
    assert p[:2] == r[:2], f"{what}: tokens, base {p[:2]} != {r[:2]}"
    assert port.dim == ref.dim, f"{what}: width {port.dim} != {ref.dim}"
    for i, (ph, rh, pc, rc) in enumerate(zip(p[2], r[2], p[3], r[3], strict=True)):
        assert_bit_exact(ph, rh, f"{what}: row {i} history")
        assert_close64(pc, rc, what=f"{what}: row {i} comp")


def scratch_blocks(h: np.ndarray, ratio: int) -> np.ndarray:
    """From-scratch compression of hidden rows `h [T, D]`: block g = the mean of rows
    `[g*ratio, (g+1)*ratio)`, by loop (an oracle independent of any reshape)."""
    out = [sum(h[g * ratio + j] for j in range(ratio)) / ratio for g in range(len(h) // ratio)]
    return np.array(out).reshape(len(out), h.shape[1]) if out else np.zeros((0, h.shape[1]))


def xs_filled(impl, ratio, n, **kw):
    """A one-row XsRolling slot of `impl` fed `n` distinct hidden rows of width 3 (token t
    holds `3t, 3t + 1, 3t + 2`)."""
    xs = impl.new(ratio, **kw)
    xs.append_rows(impl.x(np.arange(n * 3, dtype=np.float64).reshape(1, n, 3)))
    return xs


def xs_fed(impl, n, ratio=4, **kw):
    """A one-row XsRolling slot of `impl` fed tokens 1..n of width 3 (token t holds
    `t + 0.25 * feature`)."""
    xs = impl.new(ratio, **kw)
    if n:
        xs.append_rows(impl.x((np.arange(1, n + 1)[:, None] + 0.25 * np.arange(3))[None]))
    return xs


class XsImpl:
    """One implementation of the XsRolling slot, so one test body runs over both: `new` builds
    a slot (the classes share their constructor), `x` turns a float64 host array into what its
    `append_rows` takes, `stack` and `split` are its batch assembly (the reference's
    `XsRolling.stack` / `split_rows`; the port's `gpu.slots.stack_xs` / `xs_rows`), `kv` a K/V
    slot of the same implementation for rollbacks that move every slot together."""

    def __init__(self, name: str, cls, x, stack, split, kv) -> None:
        self.name, self.new, self.x = name, cls, x
        self.stack, self.split, self.kv = stack, split, kv

    def __repr__(self) -> str:
        return self.name


def _ref_kv(max_seq_len: int):
    from raggedspec.reference.cache import KvCache

    slot = KvCache.new_normal(max_seq_len)
    return slot, lambda block: slot.append(block, block)


def _port_kv(max_seq_len: int):
    from raggedspec.gpu.slots import TorchKv

    slot = TorchKv(max_seq_len)
    return slot, lambda block: slot.append(to_port(block), to_port(block))


XS_IMPLS = (
    XsImpl("reference", RefXs, np.asarray, RefXs.stack, lambda s: s.split_rows(), _ref_kv),
    XsImpl("port", PortXs, to_port, stack_xs, lambda s: [stack_xs([h]) for h in xs_rows(s)],
           _port_kv),
)
over_xs = pytest.mark.parametrize("impl", XS_IMPLS, ids=repr)
"""Run a test body once per XsRolling implementation (its argument `impl`)."""


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16/int16, how the kernels take and give bfloat16) as float32."""
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`x` rounded to bfloat16: `(bits for a kernel, the same values in float64)`."""
    from raggedspec.gpu.cupy_kernels import bf16_bits

    bits = bf16_bits(x)
    return bits, bf16_values(bits).astype(np.float64)



def _ref_kv_slot(length: int, mark: float, extra: int, max_seq_len: int, h: int, d: int):
    from raggedspec.reference.cache import KvCache

    slot = KvCache.new_normal(max_seq_len)
    slot.append(*_marked(length + extra, mark, h, d))
    slot.set_len(length)
    return slot


def _port_kv_slot(length: int, mark: float, extra: int, max_seq_len: int, h: int, d: int):
    from raggedspec.gpu.slots import TorchKv

    slot = TorchKv(max_seq_len)
    slot.append(*(to_port(x) for x in _marked(length + extra, mark, h, d)))
    slot.set_len(length)
    return slot


def _marked(n: int, mark: float, h: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """K `[1, h, n, d]` whose column j holds `mark + j`, and V holding `mark + 0.5 + j`."""
    k = np.broadcast_to(np.arange(n, dtype=np.float64)[None, None, :, None] + mark, (1, h, n, d))
    return k.copy(), k + 0.5


def _xs_slot(cls, x):
    def make(tokens: int):
        xs = cls(4, window=32)
        if tokens:
            xs.append_rows(x(np.arange(tokens, dtype=np.float64).reshape(1, tokens, 1)))
        return xs
    return make


class KvImpl:
    """One implementation of the K/V slot under the alignment rules (`reference.align` runs on
    both), so one test body runs over both: `slot(length, mark, extra=0, max_seq_len=4096,
    h=1, d=1)` appends `length + extra` columns (column j holds `mark + j` in K, `mark + 0.5 +
    j` in V) and sets the length back to `length` (stale columns beyond); `xs(tokens)` an
    XsRolling slot (ratio 4, window 32) fed `tokens` rows; `k` / `v` a slot's front-aligned
    K / V `[B, H, current, D]` on the host; `held` what the slot holds (equal when nothing
    moved); `stack_layer` its clone-in assembly (None: the reference's own); `empty(max_seq_len,
    capacity)` an empty slot and `put(slot, k, v)` an append of host arrays."""

    def __init__(self, name: str, slot, xs, k, v, held, stack_layer, empty, put) -> None:
        self.name, self.make, self.xs, self.k, self.v = name, slot, xs, k, v
        self.held, self.stack_layer, self.empty, self.put = held, stack_layer, empty, put

    def slot(self, length: int, mark: float, extra: int = 0, max_seq_len: int = 4096,
             h: int = 1, d: int = 1):
        return self.make(length, mark, extra, max_seq_len, h, d)

    def __repr__(self) -> str:
        return self.name


def _ref_empty(max_seq_len: int, capacity: int):
    from raggedspec.reference.cache import KvCache

    return KvCache.new_normal(max_seq_len, capacity)


def _port_empty(max_seq_len: int, capacity: int):
    from raggedspec.gpu.slots import TorchKv

    return TorchKv(max_seq_len, capacity)


def _port_front(i: int):
    return lambda slot: host(slot.front_aligned()[i])


def _port_stack_layer(slots, layer, xs_per_seq):
    from raggedspec.gpu.slots import stack_layer

    return stack_layer(slots, layer, xs_per_seq)


KV_IMPLS = (
    KvImpl("reference", _ref_kv_slot, _xs_slot(RefXs, np.asarray),
           lambda s: s.k.current_data(), lambda s: s.v.current_data(),
           lambda s: (s.k.data, s.v.data, s.current_seq_len, s.k.capacity_seq_len), None,
           lambda m, c: _ref_empty(m, c), lambda s, k, v: s.append(k, v)),
    KvImpl("port", _port_kv_slot, _xs_slot(PortXs, to_port), _port_front(0), _port_front(1),
           lambda s: (s.kv, None if s.lead is None else s.lead.tolist(), s.current, s.capacity),
           _port_stack_layer, lambda m, c: _port_empty(m, c),
           lambda s, k, v: s.append(to_port(k), to_port(v))),
)
over_kv = pytest.mark.parametrize("impl", KV_IMPLS, ids=repr)
"""Run a test body once per K/V slot implementation (its argument `impl`)."""

REF_KV = KV_IMPLS[0]


def seq(lengths, mark: float = 0, impl: KvImpl = REF_KV, **kw):
    """A NormalCache of one K/V slot per entry of `lengths` (`impl.slot`, marked
    `mark + 10_000 * layer`)."""
    from raggedspec.reference.cache import NormalCache

    return NormalCache([impl.slot(n, mark + 10_000 * layer, **kw)
                        for layer, n in enumerate(lengths)])


def k_row(slot, n: int | None = None) -> list[float]:
    """A reference K/V slot's K buffer, row 0, head 0, feature 0: the first `n` (default
    current) columns."""
    n = slot.current_seq_len if n is None else n
    return list(slot.k.data[0, 0, :n, 0])


def draft_slot(live: int, cap: int, mark: float):
    """§17.1: a reference Normal slot, K `[1,1,cap,1]` holding `mark + i`, V `mark + 1000 +
    i`, `live` positions, max_seq_len 4096."""
    from raggedspec.reference.cache import KvCache, SingleCache

    k = np.arange(cap, dtype=np.float64).reshape(1, 1, cap, 1) + mark
    return KvCache(SingleCache(4096, cap, live, 0, None, k.copy()),
                   SingleCache(4096, cap, live, 0, None, k + 1000))


def _kernel_modes() -> list:
    from raggedspec.gpu import kernel_emulator
    from raggedspec.gpu.cupy_kernels import cupy_unavailable

    why = cupy_unavailable()
    return [
        pytest.param("emulate", marks=pytest.mark.skipif(
            kernel_emulator.compilers()["g++"] is None,
            reason="the kernel emulator needs g++ on the PATH")),
        pytest.param("cupy", marks=pytest.mark.skipif(
            why is not None, reason=f"CuPy needs a CUDA GPU: {why}")),
    ]


KERNEL_MODES = _kernel_modes()
"""The kernels' two runners: `emulate` (g++, every machine with it) and `cupy` (a CUDA GPU);
each skipped, with the reason, where it cannot run."""
_RUNNERS: dict = {}


def kernels(mode: str):
    """One `gpu.cupy_kernels.Kernels(mode)` per session (its builds are cached with it)."""
    from raggedspec.gpu.cupy_kernels import Kernels

    if mode not in _RUNNERS:
        _RUNNERS[mode] = Kernels(mode)
    return _RUNNERS[mode]


def to_kern(kern, a):
    """A host array as the runner's array (a CuPy array, or NumPy under the emulator)."""
    return kern.xp.asarray(np.ascontiguousarray(a))


def from_kern(kern, a) -> np.ndarray:
    return a.get() if kern.mode == "cupy" else np.asarray(a)


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


# --- the command line: in this process, as a child, through the console script ----------------

PACKAGE = Path(raggedspec.__file__).parent
"""The package folder (its reference/, gpu/, conformance/, docs/, examples/ beside each other),
as imported: the checkout's raggedspec/ (through its links), an installed package, or mutmut's
copy under mutants/."""
ROOT = PACKAGE.parent
"""The folder the package is imported from: a child process started there imports the same
package (the commands' tests start `python -m raggedspec` there)."""
CHECKOUT = ROOT if (ROOT / "pyproject.toml").is_file() else None
"""The checkout (pyproject.toml, README.md, scripts/ beside the package), or None for an
installed package."""
TRACEBACK = "Traceback (most recent call last)"


class Tty(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def run_cli(*argv) -> tuple[int, str, str]:
    """`raggedspec ARGV` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def one_error_line(err: str) -> str:
    """The one `... error: ...` line of stderr (asserted to be exactly one)."""
    lines = [ln for ln in err.splitlines() if ": error: " in ln]
    assert len(lines) == 1, err
    return lines[0]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this checkout first on PYTHONPATH, no backend
    or profile chosen by the caller's environment."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAGGEDSPEC_") and k != "HYPOTHESIS_PROFILE"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env | extra


def run_module(*args, cwd: Path | None = None, timeout: int = 300,
               **env: str) -> subprocess.CompletedProcess:
    """`python -m raggedspec ARGS` in a child process (stderr a pipe, not a terminal)."""
    return subprocess.run([sys.executable, "-m", "raggedspec", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd or ROOT,
                          env=child_env(**env), timeout=timeout)


def console_script(tmp_path: Path):
    """A launcher exactly like the one pip writes for the `raggedspec` console script (its
    own folder, not the current one, first on sys.path); returns `run(*args, cwd=)`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    launcher = bin_dir / "raggedspec"
    launcher.write_text("import sys\nfrom raggedspec.cli import main\nsys.exit(main())\n")

    def run(*args, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(launcher), *map(str, args)],
                              capture_output=True, text=True, cwd=cwd,
                              env=child_env(), timeout=timeout)

    return run


def write(path: Path, text: str) -> Path:
    """Write `text` to `path` and return the path."""
    path.write_text(text)
    return path
