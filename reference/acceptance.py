"""Acceptance models and token oracles: who decides how many drafts a row accepts.

Control flow must never depend on a floating-point result (DESIGN.md), so accept counts and
token ids come from seeded **integer** oracles, never from the tiny model's logits: two
backends then take the same path and every tensor can be compared.

**Keying.** All randomness is a 64-bit splitmix hash of `(seed, seq id, absolute position)`
(plus a per-model salt), never of the row or the batch: a sequence's accepts and tokens do
not depend on its batch-mates, which is what the batched == solo tests rely on. A probability
p is an integer threshold `round(p * 2**32)`; a draft at absolute position k is "right" iff
`hash(seed, seq, k) >> 32 < threshold`. Vectorized over rows (numpy uint64).

**Acceptance models** (`AcceptanceModel.accepted(seq, pos, n, k) -> a`, arrays; `pos = L` is
the absolute position the first draft predicts, `n` drafts proposed, `k` the sequence's
count of earlier verifies that drafted, `0 <= a <= n`):
- `Geometric(p)`: every draft position is right with probability p; a = the run of right
  positions from L (so P(a >= j) = p**j).
- `Profile([p0, p1, ...])`: draft j (position L + j) is right with probability p_j (the last
  entry repeats), e.g. 0.74, 0.54, 0.41.
- `Heterogeneous(ps | p_range)`: geometric with a per-sequence probability, `ps[seq % len]`
  or drawn in `[lo, hi]` from `(seed, seq)`.
- `AllAccept` (a = n), `AllReject` (a = 0).
- `FileStream(path)`: accept counts read from a JSON file, either a list used by every
  sequence or `{"default": [...], "<seq id>": [...]}`; the sequence's k-th drafting verify
  takes entry `k mod len`, clamped to n.

**Token oracles** (`TokenOracle`, the pluggable interface): `prompt(seq, length)` -> the
prompt tokens, `target(seq, context) -> token` (what the target's greedy argmax would be
after `context`), `draft(seq, context, n) -> n tokens` (the MTP chain's proposals after
`context`). The simulator verifies `verify_proposed(draft(...), [target(ctx ++ drafts[:j])
for j])`, so the accept count is always `len(verified.accepted)`. `ModelOracle(model)` turns
any acceptance model into a token oracle: sequence s has a "true" token stream
`true(s, k) = hash(seed, s, k) % vocab`; `target` returns the true token at `len(context)`;
`draft` proposes the true tokens where the model accepts and a different token at the first
rejected position. So the committed stream is always the true stream (speculation is
lossless), and `len(verify_proposed(...).accepted)` equals the model's count.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from reference.errors import require

U64 = np.uint64
_C1, _C2, _C3 = U64(0x9E3779B97F4A7C15), U64(0xBF58476D1CE4E5B9), U64(0x94D049BB133111EB)
SALT_ACCEPT = 0xA11CE
SALT_TOKEN = 0x70CE5
SALT_WRONG = 0xB0B
SALT_RATE = 0x5EED
MAX_DRAFTS = 8


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on a uint64 array (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64) + _C1
    x = (x ^ (x >> U64(30))) * _C2
    x = (x ^ (x >> U64(27))) * _C3
    return x ^ (x >> U64(31))


def key_hash(seed: int, salt: int, seq, pos) -> np.ndarray:
    """`hash(seed, salt, seq, pos)` as uint64, broadcast over `seq` and `pos` arrays."""
    base = splitmix64(np.array([(int(seed) * 0x100000001B3 + int(salt)) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    h = splitmix64(base ^ np.asarray(seq, dtype=np.int64).astype(np.uint64))
    return splitmix64(h ^ np.asarray(pos, dtype=np.int64).astype(np.uint64))


def threshold(p: float) -> int:
    """The integer threshold of probability p: `round(p * 2**32)` (p = 1 always passes)."""
    require(0.0 <= p <= 1.0, f"probability {p} must be in [0, 1]")
    return int(round(p * (1 << 32)))


def _as_arrays(*xs):
    arrs = [np.atleast_1d(np.asarray(x, dtype=np.int64)) for x in xs]
    return np.broadcast_arrays(*arrs)


class AcceptanceModel(ABC):
    """Base class. `accepted(seq, pos, n, k)` returns int64 accept counts in `[0, n]`."""

    needs_tokens = False

    @abstractmethod
    def accepted(self, seq, pos, n, k) -> np.ndarray:
        """Accept counts for rows (seq, pos, n, k), each in [0, n]."""

    def accept_one(self, seq: int, pos: int, n: int, k: int = 0) -> int:
        return int(self.accepted([seq], [pos], [n], [k])[0])


class _Thresholds(AcceptanceModel):
    """Accept run from per-(row, draft position) thresholds `thr[R, 8]`."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)

    @abstractmethod
    def thresholds(self, seq: np.ndarray) -> np.ndarray:
        """`[R, 8]` int64 thresholds: draft j of row r is right iff its draw < thr[r, j]."""

    def accepted(self, seq, pos, n, k=0) -> np.ndarray:
        seq, pos, n, _ = _as_arrays(seq, pos, n, k)
        m = int(n.max(initial=0))
        if int(n.min(initial=0)) < 0 or m > MAX_DRAFTS:
            raise ValueError(f"drafts {n.tolist()} must be in 0..={MAX_DRAFTS}")
        if m == 0:
            return np.zeros(seq.shape, dtype=np.int64)
        j = np.arange(m, dtype=np.int64)
        draws = key_hash(self.seed, SALT_ACCEPT, seq[:, None], pos[:, None] + j[None, :]) >> U64(32)
        wrong = draws.astype(np.int64) >= self.thresholds(seq)[:, :m]
        # the run of right drafts: index of the first wrong one (m when none is wrong)
        run = np.where(wrong.any(axis=1), wrong.argmax(axis=1), m)
        return np.minimum(run, n).astype(np.int64)


class Geometric(_Thresholds):
    """Each draft position is right with probability p (module docstring)."""

    def __init__(self, p: float, seed: int) -> None:
        super().__init__(seed)
        self.t = threshold(p)

    def thresholds(self, seq: np.ndarray) -> np.ndarray:
        return np.full((seq.shape[0], MAX_DRAFTS), self.t, dtype=np.int64)


class Profile(_Thresholds):
    """Draft j is right with probability `ps[j]` (the last entry repeats)."""

    def __init__(self, ps: Sequence[float], seed: int) -> None:
        super().__init__(seed)
        require(len(ps) >= 1, "a profile needs at least one probability")
        ts = [threshold(p) for p in ps][:MAX_DRAFTS]
        self.t = np.array(ts + [ts[-1]] * (MAX_DRAFTS - len(ts)), dtype=np.int64)

    def thresholds(self, seq: np.ndarray) -> np.ndarray:
        return np.broadcast_to(self.t, (seq.shape[0], MAX_DRAFTS))


class Heterogeneous(_Thresholds):
    """Geometric with a per-sequence probability: `ps[seq % len(ps)]`, or drawn uniformly
    (integer threshold) in `p_range` from `(seed, seq)`."""

    def __init__(self, ps: Sequence[float], seed: int, p_range: tuple[float, float] | None = None) -> None:
        super().__init__(seed)
        self.ts = np.array([threshold(p) for p in ps], dtype=np.int64)
        self.range = None if p_range is None else (threshold(p_range[0]), threshold(p_range[1]))

    def per_sequence_threshold(self, seq: np.ndarray) -> np.ndarray:
        if self.range is None:
            return self.ts[seq % len(self.ts)]
        lo, hi = self.range
        h = key_hash(self.seed, SALT_RATE, seq, 0) % U64(hi - lo + 1)
        return lo + h.astype(np.int64)

    def thresholds(self, seq: np.ndarray) -> np.ndarray:
        return np.repeat(self.per_sequence_threshold(seq)[:, None], MAX_DRAFTS, axis=1)


class AllAccept(AcceptanceModel):
    """a = n."""

    def accepted(self, seq, pos, n, k=0) -> np.ndarray:
        _, _, n, _ = _as_arrays(seq, pos, n, k)
        return n.astype(np.int64).copy()


class AllReject(AcceptanceModel):
    """a = 0."""

    def accepted(self, seq, pos, n, k=0) -> np.ndarray:
        seq, _, _, _ = _as_arrays(seq, pos, n, k)
        return np.zeros(seq.shape, dtype=np.int64)


class FileStream(AcceptanceModel):
    """Accept counts from a JSON file (module docstring); entry `k mod len` of the
    sequence's list (or the default list), clamped to `[0, n]`."""

    def __init__(self, data) -> None:
        if isinstance(data, (str, Path)):
            data = json.loads(Path(data).read_text())
        if isinstance(data, list):
            data = {"default": data}
        require(isinstance(data, dict) and data, "an accept-count file holds a list or {\"default\": [...], ...}")
        self.lists: dict[str, list[int]] = {}
        for key, vals in data.items():
            require(isinstance(vals, list) and vals and all(isinstance(v, int) and v >= 0 for v in vals),
                    f"accept counts for {key!r} must be a non-empty list of integers >= 0")
            self.lists[str(key)] = vals

    def accepted(self, seq, pos, n, k=0) -> np.ndarray:
        seq, _, n, k = _as_arrays(seq, pos, n, k)
        out = np.zeros(seq.shape, dtype=np.int64)
        for i in range(seq.shape[0]):  # per row: a dict lookup per sequence, inherently
            vals = self.lists.get(str(int(seq[i])), self.lists.get("default"))
            require(vals is not None, f"no accept counts for sequence {int(seq[i])} and no default")
            out[i] = min(vals[int(k[i]) % len(vals)], int(n[i]))
        return out


# ----------------------------------------------------------------------------- token oracles


class TokenOracle(Protocol):
    """The pluggable interface: decide drafts and targets from the token context.

    `prompt(seq_id, length) -> list[int]` the prompt; `target(seq_id, context) -> int` the
    target model's token after `context`; `draft(seq_id, context, n) -> list[int]` n draft
    proposals after `context`. Tokens must be in `[0, vocab)`. Must be deterministic and must
    not depend on other sequences (the batched == solo property)."""

    def prompt(self, seq_id: int, length: int) -> list[int]: ...

    def target(self, seq_id: int, context: Sequence[int]) -> int: ...

    def draft(self, seq_id: int, context: Sequence[int], n: int) -> list[int]: ...


class ModelOracle:
    """A token oracle from an acceptance model (module docstring). Keeps, per sequence, the
    count of `draft` calls with n > 0 (the file model's k)."""

    def __init__(self, model: AcceptanceModel, seed: int, vocab: int) -> None:
        require(vocab >= 2, f"vocab {vocab} must be >= 2 for a wrong draft to exist")
        self.model, self.seed, self.vocab = model, int(seed), int(vocab)
        self.verifies: dict[int, int] = {}

    def true_tokens(self, seq_id: int, start: int, n: int) -> list[int]:
        pos = np.arange(start, start + n, dtype=np.int64)
        return [int(t) for t in key_hash(self.seed, SALT_TOKEN, seq_id, pos) % U64(self.vocab)]

    def wrong_token(self, seq_id: int, k: int) -> int:
        true = self.true_tokens(seq_id, k, 1)[0]
        shift = 1 + int(key_hash(self.seed, SALT_WRONG, seq_id, k)[0] % U64(self.vocab - 1))
        return (true + shift) % self.vocab

    def prompt(self, seq_id: int, length: int) -> list[int]:
        return self.true_tokens(seq_id, 0, length)

    def target(self, seq_id: int, context: Sequence[int]) -> int:
        return self.true_tokens(seq_id, len(context), 1)[0]

    def draft(self, seq_id: int, context: Sequence[int], n: int) -> list[int]:
        if n <= 0:
            return []
        big_l = len(context)
        k = self.verifies.get(seq_id, 0)
        self.verifies[seq_id] = k + 1
        a = self.model.accept_one(seq_id, big_l, n, k)
        toks = self.true_tokens(seq_id, big_l, n)
        if a < n:
            toks[a] = self.wrong_token(seq_id, big_l + a)
        return toks


class OracleAcceptance(AcceptanceModel):
    """Marks a custom `TokenOracle`: the simulator must track tokens and verify per row
    (`accepted` is then computed from the oracle's tokens by the simulator, not here)."""

    needs_tokens = True

    def __init__(self, oracle: TokenOracle) -> None:
        self.oracle = oracle

    def accepted(self, seq, pos, n, k=0) -> np.ndarray:
        raise TypeError("a custom token oracle has no token-free accept count; verify its tokens")


def build_model(spec, seed: int, scenario=None) -> AcceptanceModel:
    """The acceptance model of a scenario's `AcceptanceSpec`."""
    m = spec.model
    if m == "geometric":
        return Geometric(spec.p[0], seed)
    if m == "profile":
        return Profile(spec.p, seed)
    if m == "heterogeneous":
        return Heterogeneous(spec.p, seed, spec.p_range)
    if m == "all-accept":
        return AllAccept()
    if m == "all-reject":
        return AllReject()
    if m == "file":
        return FileStream(spec.path)
    if m == "oracle":
        mod, _, attr = spec.factory.partition(":")
        factory = getattr(importlib.import_module(mod), attr)
        return OracleAcceptance(factory(scenario))
    raise ValueError(f"unknown acceptance model {m!r}")


def build_oracle(model: AcceptanceModel, seed: int, vocab: int) -> TokenOracle:
    """The token oracle the simulator drives: the custom one, or `ModelOracle(model)`."""
    if isinstance(model, OracleAcceptance):
        return model.oracle
    return ModelOracle(model, seed, vocab)
