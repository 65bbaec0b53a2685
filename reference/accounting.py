"""Acceptance accounting: per-step `MtpAcceptance` counters, their ratios, the periodic
acceptance log, and the `MTP[...]` marker line.

Spec: cache-and-draft.md §15 (and the §17.2 accounting tests); masks-and-scheduling.md §21.
Ratios are None on a zero denominator and print as `n/a`; ratios print with 4 decimals.
Known skew (§15, kept): `committed = 1 + a` is recorded even when the sampled token is not
committed (terminal row, or budget <= a).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from raggedspec.reference.errors import require

POSITION_CAP = 8
LOG_EVERY = 64


def _positions() -> list[int]:
    return [0] * POSITION_CAP


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _ratio(num: int, den: int) -> float | None:
    return None if den == 0 else num / den


@dataclass
class MtpAcceptance:
    """Acceptance counters of one step, one request, one batch size, or all steps.

    Invariants (for sums of well-formed steps): `sum(accepted_at) <= accepted` (equal when no
    step drafted past the cap), `reached_at[0] == drafted_steps`,
    `reached_at[j] <= accepted_at[j-1]` (position j is reached only after j-1 is accepted).
    """

    accepted: int = 0
    proposed: int = 0
    steps: int = 0
    drafted_steps: int = 0
    committed: int = 0
    batch_steps: int = 0
    pos_over_cap: int = 0
    accepted_at: list[int] = field(default_factory=_positions)
    reached_at: list[int] = field(default_factory=_positions)

    def reset(self) -> None:
        """Back to the default (all zero)."""
        self.__init__()

    def add(self, other: MtpAcceptance) -> None:
        """Field-wise sum, firing nothing."""
        self.accepted += other.accepted
        self.proposed += other.proposed
        self.steps += other.steps
        self.drafted_steps += other.drafted_steps
        self.committed += other.committed
        self.batch_steps += other.batch_steps
        self.pos_over_cap += other.pos_over_cap
        self.accepted_at = [
            x + y for x, y in zip(self.accepted_at, other.accepted_at, strict=False)
        ]
        self.reached_at = [x + y for x, y in zip(self.reached_at, other.reached_at, strict=False)]

    def accumulate(self, step: MtpAcceptance, every: int = LOG_EVERY) -> bool:
        """Add `step`; True when the proposal count crossed a multiple of `every`:
        `floor((before + p) / every) != floor(before / every)` with `before` the proposals
        before the add (a step that straddles several multiples fires once). `every == 0`
        and a step with `p == 0` never fire."""
        require(every >= 0, f"every {every} must be >= 0")
        before = self.proposed
        self.add(step)
        p = step.proposed
        return every > 0 and (before + p) // every != before // every

    # ratios
    def rate(self) -> float | None:
        return _ratio(self.accepted, self.proposed)

    def tokens_per_step(self) -> float | None:
        return _ratio(self.committed, self.steps)

    def tokens_per_batch_step(self) -> float | None:
        return _ratio(self.committed, self.batch_steps)

    def mean_batch(self) -> float | None:
        return _ratio(self.steps, self.batch_steps)

    def tracked_extent(self) -> int:
        """`1 + last j with reached_at[j] > 0`, 0 when no position was reached."""
        reached = [j for j, r in enumerate(self.reached_at) if r > 0]
        return reached[-1] + 1 if reached else 0

    def per_position_rates(self) -> list[float | None]:
        """`accepted_at[j] / reached_at[j]` for `j < tracked_extent()`."""
        return [
            _ratio(self.accepted_at[j], self.reached_at[j]) for j in range(self.tracked_extent())
        ]

    # output
    def marker(self, scope: str) -> str:
        """`MTP[{scope}] accept_rate= accepted= proposed= steps= drafted_steps= committed=
        tok_per_step= batch_steps= mean_batch= tok_per_batch_step= p_pos= accepted_pos=
        reached_pos= pos_over_cap=`. Position lists are comma-separated over the tracked
        extent; an empty extent prints `n/a` (unspecified for the count lists; chosen)."""
        ext = self.tracked_extent()

        def positions(values: Sequence) -> str:
            return ",".join(values) if ext else "n/a"

        return (
            f"MTP[{scope}] accept_rate={_fmt(self.rate())} accepted={self.accepted} "
            f"proposed={self.proposed} steps={self.steps} drafted_steps={self.drafted_steps} "
            f"committed={self.committed} tok_per_step={_fmt(self.tokens_per_step())} "
            f"batch_steps={self.batch_steps} mean_batch={_fmt(self.mean_batch())} "
            f"tok_per_batch_step={_fmt(self.tokens_per_batch_step())} "
            f"p_pos={positions([_fmt(p) for p in self.per_position_rates()])} "
            f"accepted_pos={positions([str(x) for x in self.accepted_at[:ext]])} "
            f"reached_pos={positions([str(x) for x in self.reached_at[:ext]])} "
            f"pos_over_cap={self.pos_over_cap}")

    def report_lines(self, scope: str = "agg") -> list[str]:
        """The prose rate ("MTP acceptance rate: {x:.1}% ({a}/{p} accepted)", or
        "... 0 proposals so far"), one "pos j: p=... (acc/reached)" line per tracked
        position, a WARN line when some step drafted past the cap, then the marker."""
        if self.proposed == 0:
            lines = ["MTP acceptance rate: 0 proposals so far"]
        else:
            lines = [f"MTP acceptance rate: {100.0 * self.accepted / self.proposed:.1f}% "
                     f"({self.accepted}/{self.proposed} accepted)"]
        for j, p in enumerate(self.per_position_rates()):
            lines.append(f"MTP pos {j}: p={_fmt(p)} ({self.accepted_at[j]}/{self.reached_at[j]})")
        if self.pos_over_cap:
            lines.append(
                f"MTP WARN: {self.pos_over_cap} step(s) drafted past the {POSITION_CAP}-position "
                f"tracking cap; their later positions count in accepted/proposed only")
        lines.append(self.marker(scope))
        return lines


def _one_step(d: int, a: int, reached: int, committed: int) -> MtpAcceptance:
    s = MtpAcceptance(accepted=a, proposed=d, steps=1, drafted_steps=int(d > 0),
                      committed=committed, pos_over_cap=int(d > POSITION_CAP))
    for j in range(min(reached, POSITION_CAP)):
        s.reached_at[j] = 1
    for j in range(min(a, POSITION_CAP)):
        s.accepted_at[j] = 1
    return s


def from_fused_verify(d: int, a: int) -> MtpAcceptance:
    """One fused-path step that proposed d drafts and accepted a (§15): `reached = 0` if
    d = 0 else `min(a + 1, d)`; `committed = 1 + a`; `drafted_steps = [d > 0]`;
    `pos_over_cap = [d > 8]`. `from_fused_verify(0, 0) == skipped_step()`. Malformed:
    negative counts, a > d."""
    require(0 <= a <= d, f"accepted {a} must be in [0, proposed {d}]")
    return _one_step(d, a, 0 if d == 0 else min(a + 1, d), 1 + a)


def from_verify(d: int, verified) -> MtpAcceptance:
    """The older two-forward shape (§15): `reached = len(accepted) + [rejection]`,
    `committed = 1 + commit_len`. Malformed: more accepted than proposed."""
    a = len(verified.accepted)
    require(0 <= a <= d, f"accepted {a} must be in [0, proposed {d}]")
    return _one_step(d, a, verified.commit_len, 1 + verified.commit_len)


def skipped_step() -> MtpAcceptance:
    """A step that drafted nothing: one step, one committed token."""
    return MtpAcceptance(steps=1, committed=1)


class AcceptanceTelemetry:
    """Global, per-request and per-batch-size acceptance counters (§15).

    `record_step` feeds the per-request and global counters; the global add fires the
    periodic report (every `every` proposals) into `lines` only when `logging_enabled`
    (`ARC_MTP_LOG_ACCEPTANCE`). `record_batch` feeds `by_batch[b]` (with `batch_steps` 1)
    and only the global `batch_steps`. `log()` prints regardless of the gate.
    """

    def __init__(self, logging_enabled: bool = True, every: int = LOG_EVERY) -> None:
        self.logging_enabled = logging_enabled
        self.every = every
        self.total = MtpAcceptance()
        self.by_request: dict[int, MtpAcceptance] = {}
        self.by_batch: dict[int, MtpAcceptance] = {}
        self.lines: list[str] = []

    def record_step(self, seq_id: int, stats: MtpAcceptance) -> bool:
        """Add one sequence's step; True when the global report fired."""
        self.by_request.setdefault(seq_id, MtpAcceptance()).add(stats)
        fired = self.total.accumulate(stats, self.every)
        if fired and self.logging_enabled:
            self.log()
        return fired

    def record_batch(self, b: int, per_seq: Sequence[MtpAcceptance]) -> None:
        """One batched step of b rows: `by_batch[b]` += every row's values + `batch_steps=1`;
        the global `batch_steps` += 1 (its per-sequence values come from `record_step`)."""
        require(b == len(per_seq), f"record_batch({b}) given {len(per_seq)} per-sequence stats")
        entry = self.by_batch.setdefault(b, MtpAcceptance())
        for stats in per_seq:
            entry.add(stats)
        entry.batch_steps += 1
        self.total.batch_steps += 1

    def _scoped(self, scope: str) -> MtpAcceptance:
        if scope == "agg":
            return self.total
        kind, _, key = scope.partition("=")
        require(
            kind in ("req", "b") and key.isdigit(),
            f"scope {scope!r} must be agg, req=<id> or b=<n>",
        )
        table = self.by_request if kind == "req" else self.by_batch
        require(int(key) in table, f"no acceptance counters for {scope}")
        return table[int(key)]

    def marker(self, scope: str = "agg") -> str:
        """The `MTP[scope]` line of "agg", "req=<id>" or "b=<n>"."""
        return self._scoped(scope).marker(scope)

    def report_lines(self, scope: str = "agg") -> list[str]:
        return self._scoped(scope).report_lines(scope)

    def log(self) -> list[str]:
        """Emit the aggregate report now (the manual path; not gated)."""
        lines = self.report_lines("agg")
        self.lines.extend(lines)
        return lines

    def flush_request(self, seq_id: int) -> list[str]:
        """A request finished (`drop_draft_kv`): emit its marker if logging is on, and
        forget its counters."""
        stats = self.by_request.pop(seq_id, None)
        if stats is None or not self.logging_enabled:
            return []
        line = stats.marker(f"req={seq_id}")
        self.lines.append(line)
        return [line]
