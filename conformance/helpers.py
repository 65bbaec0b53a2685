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

