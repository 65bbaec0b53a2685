"""Acceptance models and token oracles: who decides how many drafts a row accepts.

Control flow must never depend on a floating-point result (DESIGN.md), so accept counts and
token ids come from seeded **integer** oracles, never from the tiny model's logits: two
backends then take the same path and every tensor can be compared. The keying, each model, the
token-oracle protocol and how a custom oracle is loaded and checked are in docs/simulator.md
("Acceptance models", "Inside the two modes").
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from raggedspec.reference.errors import ScenarioError, require
from raggedspec.reference.plugins import (
    Plugin,
    PluginError,
    PluginSpecError,
    cwd_first,
    load_object,
)

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
    """`hash(seed, salt, seq, pos)` as uint64, broadcast over `seq` and `pos` arrays: with
    `sm` = `splitmix64` and every step mod 2**64, `sm(sm(sm(seed * 0x100000001B3 + salt) ^ seq)
    ^ pos)` (the seed and salt mixed once, then the sequence id, then the position)."""
    base = splitmix64(
        np.array([(int(seed) * 0x100000001B3 + int(salt)) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    )
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
    (integer threshold) in `p_range` from `(seed, seq)`: with `lo, hi` the range's thresholds,
    `lo + hash(seed, SALT_RATE, seq, 0) % (hi - lo + 1)`."""

    def __init__(
        self, ps: Sequence[float], seed: int, p_range: tuple[float, float] | None = None
    ) -> None:
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
        require(
            isinstance(data, dict) and data,
            'an accept-count file holds a list or {"default": [...], ...}',
        )
        self.lists: dict[str, list[int]] = {}
        for key, vals in data.items():
            require(
                isinstance(vals, list)
                and vals
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in vals),
                f"accept counts for {key!r} must be a non-empty list of integers >= 0, got "
                f"{vals!r}",
            )
            require(
                key == "default" or (isinstance(key, str) and key.isdigit()),
                f'accept-count key {key!r} must be "default" or a sequence id (a non-negative '
                'integer)',
            )
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
        """A token other than the true one at position k: the true token shifted by
        `1 + hash(seed, SALT_WRONG, seq_id, k) % (vocab - 1)` (mod vocab), so each of the
        vocab - 1 others."""
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

    def __init__(self, oracle: TokenOracle, name: str = "custom oracle") -> None:
        self.oracle, self.name = oracle, name

    def accepted(self, seq, pos, n, k=0) -> np.ndarray:
        raise TypeError("a custom token oracle has no token-free accept count; verify its tokens")


def load_accept_file(path, n_seqs: int | None = None) -> FileStream:
    """The file model's `FileStream` from `path`, checked: the file exists and holds JSON in
    the file model's form (module docstring). With `n_seqs`, a file without a "default" list
    must have a list for every sequence id `0 .. n_seqs - 1`. Raises `ScenarioError` naming
    `acceptance.path`, the file and what is wrong."""
    where = f"scenario key 'acceptance.path': accept-count file {str(path)!r}"
    p = Path(path)
    if not p.is_file():
        raise ScenarioError(f"{where} does not exist (or is not a file)")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{where} cannot be read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScenarioError(f"{where} is not valid JSON ({exc}); expected a list of accept counts "
                            "or {\"default\": [...], \"<seq id>\": [...]}") from None
    try:
        stream = FileStream(data)
    except ValueError as exc:
        raise ScenarioError(f"{where}: {exc}") from None
    if n_seqs is not None and "default" not in stream.lists:
        missing = [i for i in range(n_seqs) if str(i) not in stream.lists]
        if missing:
            raise ScenarioError(
                f'{where} has no "default" list and no list for sequence(s) '
                f"{missing[:8]}{' ...' if len(missing) > 8 else ''} (the scenario has "
                f"{n_seqs} requests)"
            )
    return stream


def resolve_factory(factory: str):
    """The callable named by `"module:callable"`, imported with the current working directory
    first on `sys.path` (`reference.plugins`). Raises `ScenarioError` naming
    `acceptance.factory` and the factory when the form is wrong, the module does not import,
    the attribute is missing or it is not callable; `PluginError` when importing it raises."""
    where = f"scenario key 'acceptance.factory': {factory!r}"
    mod, _, attr = (factory or "").partition(":")
    if not mod or not attr:
        raise ScenarioError(f"{where} must be 'module:callable', e.g. oracle:my_module:make_oracle")
    try:
        return load_object(factory, "oracle", "it must be a function or class taking the "
                                              "Scenario and returning a TokenOracle")
    except PluginSpecError as exc:
        raise ScenarioError(f"{where}: {exc}") from None


ORACLE_METHODS = ("prompt", "target", "draft")


class OracleError(ScenarioError):
    """A custom token oracle broke the `TokenOracle` contract (a bad configuration: the CLI
    exits 2). The message names `acceptance.factory`, the call and the bad value."""


def _token(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


class CheckedOracle:
    """A custom oracle with every result checked (the one shared place both simulator modes
    go through, via `build_oracle`): `prompt(seq, length)` must return exactly `length`
    tokens, `target` one token, `draft(seq, ctx, n)` exactly `n` tokens, each token an int
    in `[0, vocab)`. Results are returned as lists of Python ints; a breach raises
    `OracleError`."""

    def __init__(self, oracle, vocab: int, name: str = "custom oracle") -> None:
        self.oracle, self.vocab, self.name = oracle, int(vocab), name

    def _fail(self, call: str, got, want: str):
        shown = got if not isinstance(got, list) or len(got) <= 12 else got[:12] + ["..."]
        raise OracleError(
            f"scenario key 'acceptance.factory': the oracle from {self.name!r} broke the "
            "TokenOracle "
            f"contract: {call} returned {shown!r}; {want}, each token an int in "
            f"[0, vocab = {self.vocab})"
        )

    def _tokens(self, call: str, got, n: int) -> list[int]:
        try:
            toks = list(got)
        except TypeError:
            self._fail(call, got, f"it must return a list of exactly {n} token(s)")
        if len(toks) != n or not all(_token(t) and 0 <= int(t) < self.vocab for t in toks):
            self._fail(call, toks, f"it must return exactly {n} token(s) (got {len(toks)})")
        return [int(t) for t in toks]

    def prompt(self, seq_id: int, length: int) -> list[int]:
        got = self.oracle.prompt(seq_id, length)
        return self._tokens(f"prompt(seq_id={seq_id}, length={length})", got, length)

    def target(self, seq_id: int, context: Sequence[int]) -> int:
        got = self.oracle.target(seq_id, context)
        if not (_token(got) and 0 <= int(got) < self.vocab):
            self._fail(f"target(seq_id={seq_id}, context of {len(context)} tokens)", got,
                       "it must return one token")
        return int(got)

    def draft(self, seq_id: int, context: Sequence[int], n: int) -> list[int]:
        got = self.oracle.draft(seq_id, context, n)
        return self._tokens(
            f"draft(seq_id={seq_id}, context of {len(context)} tokens, n={n})", got, n
        )


def build_model(spec, seed: int, scenario=None) -> AcceptanceModel:
    """The acceptance model of a scenario's `AcceptanceSpec` (the file is read with
    `load_accept_file`, the factory resolved with `resolve_factory` and called with the
    scenario; its result must have callable `prompt`, `target` and `draft`, else
    `ScenarioError`)."""
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
        return load_accept_file(spec.path, None if scenario is None else scenario.batch)
    if m == "oracle":
        factory = resolve_factory(spec.factory)
        try:
            with cwd_first():
                oracle = factory(scenario)
        except ScenarioError:
            raise
        except Exception as exc:  # the user's factory raised: its failure, with its traceback
            raise PluginError(Plugin("oracle", spec.factory), " when called with the scenario") \
                from exc
        lacking = [name for name in ORACLE_METHODS if not callable(getattr(oracle, name, None))]
        if lacking:
            raise ScenarioError(
                f"scenario key 'acceptance.factory': {spec.factory!r} returned {oracle!r}, which "
                f"has no callable {', '.join(lacking)}; a TokenOracle needs prompt(seq_id, "
                "length), target(seq_id, context) and draft(seq_id, context, n)"
            )
        return OracleAcceptance(oracle, spec.factory)
    raise ValueError(f"unknown acceptance model {m!r}")


def build_oracle(model: AcceptanceModel, seed: int, vocab: int) -> TokenOracle:
    """The token oracle the simulator drives: a custom one wrapped in `CheckedOracle` (so
    both modes check it in this one place), or `ModelOracle(model)`."""
    if isinstance(model, OracleAcceptance):
        return CheckedOracle(model.oracle, vocab, model.name)
    return ModelOracle(model, seed, vocab)
