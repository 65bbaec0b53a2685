"""MTP pipeline wiring and test helpers of `mtp_pipeline.rs` that the step rules do not
cover: the verify-logits argmax, the depth/kit wrapping decision, and the synthetic-acceptance
harness (cache-and-draft.md §17.2, §19.1).

Spec: `argmax_logits_per_row_extracts_tail_rows` / `_handles_batch_dim`,
`try_wrap_…_depth_zero_is_noop` / `_no_kit_falls_back` / `_engages_wrapper` (§17.2);
`verify_proposed_simulated` and `SyntheticAcceptance` (§19.1, content unspecified: the
choices are stated on each definition).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from raggedspec.reference.errors import require
from raggedspec.reference.step import Verified, mtp_window


# --- §17.2 argmax over verify logits ---------------------------------------------------------


def argmax_logits_per_row(logits: np.ndarray, expected_rows: int) -> list[int]:
    """Greedy tokens of the **last** `min(expected_rows, rows)` rows of a `[rows, vocab]`
    or `[1, rows, vocab]` verify-logits block, in row order (§17.2; arc `mtp_pipeline.rs`).

    Invariant: `len(result) == min(expected_rows, rows)`; result[i] is the argmax (first on a
    tie) of row `rows - take + i`, so a block that was not narrowed to the verify window is
    read from its tail, the "future" positions. `(5,3)` with row r's max at `r mod 3` and
    expected 3 -> `[2, 0, 1]`; `(1,2,3)` -> `[1, 2]`. Refuses nothing. ValueError: a rank
    other than 2 or 3 ("MTP verify logits had unexpected rank"), a rank-3 block whose batch
    dim is not 1, a vocab of 0, a negative `expected_rows`.
    """
    logits = np.asarray(logits, dtype=np.float64)
    require(expected_rows >= 0, f"expected_rows {expected_rows} must be >= 0")
    require(
        logits.ndim in (2, 3),
        f"MTP verify logits had unexpected rank {logits.ndim} "
        f"(shape {logits.shape}); expected [rows, vocab] or [1, rows, vocab]",
    )
    if logits.ndim == 3:
        require(logits.shape[0] == 1, f"rank-3 verify logits {logits.shape} must have batch dim 1")
        logits = logits[0]
    require(logits.shape[1] >= 1, f"verify logits {logits.shape} have no vocab column")
    rows = logits.shape[0]
    take = min(expected_rows, rows)
    start = rows - take
    return [int(np.argmax(logits[start + i])) for i in range(take)]


# --- §17.2 try_wrap_pipeline_with_mtp ----------------------------------------------------------


@dataclass(eq=False)
class TargetPipeline:
    """A loaded target pipeline, modelled minimally: its `name` and the MTP decode kit it
    advertises (`mtp_decode_kit()`; e.g. a `TinyModel`, whose MTP heads exist in both
    tiers), or None for a model with no MTP head. Identity (`is`) is the Arc identity."""

    name: str
    kit: object | None = None

    def mtp_decode_kit(self) -> object | None:
        return self.kit


class MtpSpeculativePipeline:
    """The wrapper: it owns the target and the kit and runs the MTP step (the step itself is
    `reference.simulator` / `reference.lengths`). Only the identity the wiring needs is
    modelled: `name()` is `"MTP-speculative(depth={depth}, target={target name})"`."""

    def __init__(self, target: TargetPipeline, depth: int, kit: object) -> None:
        self.target, self.depth, self.kit = target, depth, kit

    @classmethod
    def try_new(cls, target: TargetPipeline, depth: int) -> MtpSpeculativePipeline | None:
        """None when the target advertises no MTP decode kit, else the wrapper."""
        kit = target.mtp_decode_kit()
        return None if kit is None else cls(target, depth, kit)

    def name(self) -> str:
        return f"MTP-speculative(depth={self.depth}, target={self.target.name})"


def try_wrap_pipeline_with_mtp(target: TargetPipeline, mtp_depth: int,
                               warnings: list[str] | None = None):
    """The CLI-facing wrapping decision (§17.2 `try_wrap_…`).

    `mtp_depth == 0` -> the **same** target object (default off, a perfect no-op). Depth > 0
    and no kit -> a warning ("no MTP head", appended to `warnings` when given) and the same
    target object (lossless fallback to plain decode). Depth > 0 and a kit -> a new
    `MtpSpeculativePipeline` whose name starts `"MTP-speculative(depth={depth}"`.
    Refuses nothing. ValueError for a depth outside `--mtp-depth`'s 0..=8 (chosen: the
    same check as `mtp_window`; arc takes any usize here).
    """
    mtp_window(mtp_depth)
    if mtp_depth == 0:
        return target
    wrapper = MtpSpeculativePipeline.try_new(target, mtp_depth)
    if wrapper is None:
        if warnings is not None:
            warnings.append(
                f"MTP requested (depth={mtp_depth}) but the loaded model has no MTP head; "
                f"falling back to plain decode"
            )
        return target
    return wrapper


# --- §19.1 synthetic acceptance ------------------------------------------------------------------


class SyntheticAcceptance:
    """A deterministic accept-length schedule whose mean **commit length** is `acc_len`
    (§19.1; arc's `SyntheticAcceptance`, content unspecified: the dithering is chosen here).

    `next_accept_len()` returns the number of drafts to accept this step. With
    `t = acc_len - 1` (the commit is the accepted drafts plus the target's correction), step
    i (0-based) returns `floor((i+1)·t) - floor(i·t)`: first-order error diffusion computed
    in exact rational arithmetic (`Fraction(acc_len)`, the float's exact value), so every
    value is `floor(t)` or `floor(t) + 1` (the neighbouring integers; an integral t gives t
    every step) and after N steps the running sum is `floor(N·t)`, i.e.
    `0 <= t - mean < 1/N`. Same `acc_len` -> the same sequence.

    ValueError on a non-finite `acc_len` or one below 1.0 (a step always commits the
    target's own token, so < 1 describes nothing that can happen; arc's `new` returns None).
    """

    def __init__(self, acc_len: float) -> None:
        require(isinstance(acc_len, (int, float)) and math.isfinite(acc_len) and acc_len >= 1.0,
                f"acc_len {acc_len!r} must be a finite number >= 1.0")
        self.acc_len = float(acc_len)
        self._t = Fraction(self.acc_len) - 1
        self._step = 0

    @classmethod
    def from_env_value(cls, value: str | None) -> SyntheticAcceptance | None:
        """The flag's parsing (arc-engine's tests; the variable's name is unspecified here):
        None when unset, empty or blank, unparseable (e.g. "yes"; underscores are refused as
        Rust's f64 parser does), non-finite, or below 1.0; else the trimmed value."""
        if value is None or not value.strip() or "_" in value:
            return None
        try:
            acc = float(value.strip())
        except ValueError:
            return None
        return cls(acc) if math.isfinite(acc) and acc >= 1.0 else None

    def next_accept_len(self) -> int:
        """This step's accept length (see the class); advances the schedule by one."""
        i = self._step
        self._step += 1
        return math.floor((i + 1) * self._t) - math.floor(i * self._t)


def verify_proposed_simulated(proposed: Sequence[int], target: Sequence[int],
                              sim: SyntheticAcceptance) -> Verified:
    """`verify_proposed` with the accept decision forced by `sim` (§19.1; arc-engine):
    `n = min(len(proposed), len(target))`, `k = min(sim.next_accept_len(), n)`,
    `accepted = proposed[:k]` (the **draft's** tokens, whether or not they match), and
    rejection `(k, target[k])` when `k < n` (the target's real token, so lengths and the
    committed stream stay well-formed). Invariant: when the schedule is never clamped
    (`n > ceil(acc_len - 1)`, so every step has a rejection), the mean `commit_len` over N steps is
    within `1/N` of
    `acc_len`; a clamped step commits `n` and is not compensated later. Consumes one step
    of the schedule per call, even when n = 0. Refuses nothing.
    """
    n = min(len(proposed), len(target))
    k = min(sim.next_accept_len(), n)
    rejection = (k, int(target[k])) if k < n else None
    return Verified([int(p) for p in proposed[:k]], rejection)
