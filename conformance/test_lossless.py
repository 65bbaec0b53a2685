"""The output is the target's own output: speculative decoding is lossless.

Whatever a step drafts, accepts or rejects, the tokens a sequence commits are the target
model's own greedy continuation of that sequence run alone. The target here is a token oracle
whose next token is a hash of the whole context (every token and its place), so a token
committed from the wrong verify slot, or any wrong token, changes the rest of the stream; its
drafts follow the target for a context-chosen number of tokens, then go wrong, so steps
accept every count from none to all and commit a bonus token after each rejection.

One body runs the step simulator's tensor mode on the NumPy reference and on the torch port,
and its lengths mode, under both advance rules, on a ragged batch of staggered arrivals.
"""

from __future__ import annotations

import pytest

from raggedspec.gpu.backend import TorchBackend
from raggedspec.gpu.testing import DEVICE
from raggedspec.reference import lengths, simulator
from raggedspec.reference.acceptance import key_hash
from raggedspec.reference.scenario import load_scenario, model_config

pytestmark = pytest.mark.rule("the committed stream is the target's own greedy output")

SALT_TARGET, SALT_PROMPT, SALT_ACCEPT = 0x7A, 0x91, 0xAC


class ContextOracle:
    """A target whose next token depends on every token of the context, not only on its
    length; drafts right for a context-chosen prefix, then one wrong token, then the target's
    continuation of that wrong context."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def _hash(self, salt: int, seq_id: int, values) -> int:
        h = salt
        for pos, tok in enumerate(values):
            h = int(key_hash(h, tok, seq_id, pos)[0] >> 8)
        return h

    def prompt(self, seq_id: int, length: int) -> list[int]:
        return [self._hash(SALT_PROMPT, seq_id, [p]) % self.vocab for p in range(length)]

    def target(self, seq_id: int, context) -> int:
        return self._hash(SALT_TARGET, seq_id, context) % self.vocab

    def draft(self, seq_id: int, context, n: int) -> list[int]:
        right = self._hash(SALT_ACCEPT, seq_id, context) % (n + 1)
        ctx, out = list(context), []
        for j in range(n):
            tok = self.target(seq_id, ctx)
            if j == right:
                tok = (tok + 1 + self._hash(SALT_ACCEPT, seq_id, ctx) % (self.vocab - 1)) % \
                    self.vocab
            out.append(tok)
            ctx.append(tok)
        return out


def make_oracle(scenario) -> ContextOracle:
    """The scenario's oracle factory (`acceptance = "oracle:...:make_oracle"`)."""
    return ContextOracle(model_config(scenario).vocab)


def alone(oracle: ContextOracle, seq_id: int, prompt_len: int, n_new: int) -> list[int]:
    """The target run alone: the prompt, then its greedy token after each context."""
    toks = oracle.prompt(seq_id, prompt_len)
    for _ in range(n_new):
        toks.append(oracle.target(seq_id, toks))
    return toks


REQUESTS = [{"prompt_len": n, "max_new_tokens": 40, "arrival": a}
            for n, a in ((5, 0), (9, 0), (3, 1), (12, 2))]
ADVANCE = {
    "cohort": {"world": "WA"},
    "per-sequence": {"advance": "per-sequence", "xs_per_seq": True, "admission": "grant",
                     "world": "WB"},
}


def run(mode: str, advance: str):
    """The scenario run by `mode` ("numpy" or "torch": tensor mode on that backend;
    "lengths": lengths mode); the engine (its committed tokens) and the trace."""
    sc = load_scenario({"requests": REQUESTS, "steps": 24, "depth": 3, "seed": 4,
                        "acceptance": "oracle:raggedspec.conformance.test_lossless:make_oracle",
                        **ADVANCE[advance]})
    if mode == "lengths":
        eng = lengths.LengthsEngine(sc)
    else:
        backend = TorchBackend(str(DEVICE), "float64") if mode == "torch" else mode
        eng = simulator.TensorEngine(sc, backend=backend)
    return eng, eng.run()


@pytest.mark.parametrize("advance", sorted(ADVANCE))
@pytest.mark.parametrize("mode", ["numpy", "torch", "lengths"])
def test_every_sequence_commits_the_targets_own_greedy_continuation(mode, advance):
    """Each sequence's committed tokens are the prefix of its solo greedy stream; every
    sequence got well past its prompt, and the run rejected drafts (committing a bonus token
    after the accepted ones) as well as accepting whole chains."""
    eng, trace = run(mode, advance)
    oracle = make_oracle(eng.sc)
    for i, req in enumerate(REQUESTS):
        got = eng.toks[i]
        assert len(got) >= req["prompt_len"] + 10, (i, len(got))
        want = alone(oracle, i, req["prompt_len"], len(got) - req["prompt_len"])
        first = next((k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        assert first is None, f"sequence {i}: token {first} is {got[first]}, not {want[first]}"
    rows = [r for s in trace.steps() if s["phase"] == "decode" for r in s["rows"]]
    rejected = [r for r in rows if r["accepted"] < r["drafted"]]
    assert rejected and all(r["committed"] == r["accepted"] + 1 for r in rejected
                            if len(eng.toks[r["seq"]]) < REQUESTS[r["seq"]]["prompt_len"] + 40)
    assert any(r["drafted"] > 0 and r["accepted"] == r["drafted"] for r in rows)
