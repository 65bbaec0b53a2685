"""Scheduler telemetry: the §21 `SCHED[...]` counters and the engine's log lines.

Spec: masks-and-scheduling.md §21. `BucketTelemetry` counts bucketing calls, shattered calls
and the sequences offered and chosen (cumulative and monotone; interval rates come from
`since`); the line helpers format and parse the interval and step-debug log lines the spec
quotes. Integer bookkeeping only; `reference.scheduler` updates the counters once per
`schedule` call.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from raggedspec.reference.errors import require

RUNNING_WAITING_RE = re.compile(r"(\d+) running, (\d+) waiting")


@dataclass
class BucketTelemetry:
    """§21 `SCHED[...]` counters: cumulative and monotone; rates come from `since`."""

    calls: int = 0
    buckets: int = 0
    offered: int = 0
    chosen: int = 0
    shattered: int = 0

    def record_bucketing(self, buckets: int, offered: int, chosen: int) -> None:
        """One bucketing decision; ignored when `offered == 0`. `shattered` counts calls
        with more than one bucket."""
        require(
            min(buckets, offered, chosen) >= 0, f"counts {buckets, offered, chosen} must be >= 0"
        )
        if offered == 0:
            return
        self.calls += 1
        self.buckets += buckets
        self.offered += offered
        self.chosen += chosen
        if buckets > 1:
            self.shattered += 1

    def since(self, earlier: BucketTelemetry) -> BucketTelemetry:
        """`self - earlier`, field by field, saturating at 0 (a reset reads as no work)."""
        e = earlier
        now = (self.calls, self.buckets, self.offered, self.chosen, self.shattered)
        before = (e.calls, e.buckets, e.offered, e.chosen, e.shattered)
        return BucketTelemetry(*(max(a - b, 0) for a, b in zip(now, before, strict=False)))

    def _per_call(self, total: int) -> float | None:
        return total / self.calls if self.calls > 0 else None

    def buckets_per_step(self) -> float | None:
        return self._per_call(self.buckets)

    def running_bucket_size(self) -> float | None:
        return self._per_call(self.chosen)

    def offered_per_step(self) -> float | None:
        return self._per_call(self.offered)

    def preempted_per_step(self) -> float | None:
        return self._per_call(max(self.offered - self.chosen, 0))

    def shattered_frac(self) -> float | None:
        return self._per_call(self.shattered)

    def marker(self, scope: str) -> str:
        """The exact `SCHED[scope] calls=... shattered_frac=...` line; ratios `{:.4f}`, or
        `n/a` when calls == 0."""
        def fmt(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.4f}"
        return (f"SCHED[{scope}] calls={self.calls} buckets={self.buckets} offered={self.offered} "
                f"chosen={self.chosen} shattered={self.shattered} "
                f"buckets_per_step={fmt(self.buckets_per_step())} "
                f"running_bucket_size={fmt(self.running_bucket_size())} "
                f"offered_per_step={fmt(self.offered_per_step())} "
                f"preempted_per_step={fmt(self.preempted_per_step())} "
                f"shattered_frac={fmt(self.shattered_frac())}")

    def sched_bucket_marker(self) -> str | None:
        """The emitted `SCHED[agg]` line, or None when nothing was ever scheduled."""
        return self.marker("agg") if self.calls > 0 else None


def interval_line(tokens: int, interval_s: float, new_seqs: int, prefix_hits: int,
                  running: int, waiting: int, encoder: tuple[int, int] | None = None,
                  sampler: str | None = None) -> str | None:
    """§21 engine interval line, or None unless the window saw new sequences and tokens:
    `Throughput (T/s) {tokens/interval:.2}, Prefix cache hitrate {100*hits/new_seqs:.2}%`
    `[, Encoder cache hitrate {100*h/(h+m):.2}%], {running} running, {waiting} waiting`
    `[, {sampler}]`. The encoder part is shown when `encoder=(hits, misses)` has h+m > 0;
    `sampler` is the SAMPLER suffix text, appended verbatim after ", "."""
    require(interval_s > 0, f"interval_s {interval_s} must be > 0")
    require(min(tokens, new_seqs, prefix_hits, running, waiting) >= 0, "counts must be >= 0")
    if new_seqs == 0 or tokens == 0:
        return None
    enc = ""
    if encoder is not None and sum(encoder) > 0:
        enc = f", Encoder cache hitrate {100.0 * encoder[0] / sum(encoder):.2f}%"
    tail = f", {sampler}" if sampler else ""
    return (
        f"Throughput (T/s) {tokens / interval_s:.2f}, Prefix cache hitrate "
        f"{100.0 * prefix_hits / new_seqs:.2f}%{enc}, {running} running, {waiting} waiting{tail}"
    )


def parse_running_waiting(line: str) -> tuple[int, int] | None:
    """The bench harness's reading of an interval line: `(\\d+) running, (\\d+) waiting`."""
    m = RUNNING_WAITING_RE.search(line)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def step_debug_line(prompt_lens: Sequence[int], completion_lens: Sequence[int], ms: float) -> str:
    """§21 per-step DEBUG line `Prompt[l, ...] Completion[l, ...] - {ms}ms`; the lengths are
    token counts (`len()`), not cache lengths. ms format unspecified: one decimal."""
    def j(xs: Sequence[int]) -> str:
        return ", ".join(str(int(x)) for x in xs)
    return f"Prompt[{j(prompt_lens)}] Completion[{j(completion_lens)}] - {ms:.1f}ms"
