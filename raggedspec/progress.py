"""Progress of a long run on stderr, drawn by tqdm.

On a terminal the bar is redrawn in place (tqdm's own display). When stderr is not a
terminal (a log file, a CI job, a pipe) a plain line is written every few seconds instead
(`LINE_INTERVAL_S`), so a long run is never silent and the log holds no carriage returns.
`--quiet` turns both off. A run that ends before its step limit (every request finished or
failed) ends with a line saying at which step it stopped. A count without a known total (a
shrinking search) shows the count alone. Every command that can run for more than a few
seconds reports through this class (simulate and drift by step, check-kernel by case).
"""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm

LINE_INTERVAL_S = 5.0  # seconds between progress lines when stderr is not a terminal


class _Lines:
    """A stream adaptor that turns tqdm's in-place redraws into one line each."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").rstrip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


class Progress:
    """Callable `(done, total)` as the simulator's progress hook, with `close(note)`.

    `mode` is "tty" (a bar redrawn in place), "lines" (a line every `interval` seconds and
    at the end) or "off" (nothing is written). Invariant: nothing is written in "off" mode;
    in "lines" mode no carriage return reaches the stream."""

    def __init__(
        self, label: str, mode: str, stream: TextIO | None = None,
        interval: float = LINE_INTERVAL_S, unit: str = "step"
    ) -> None:
        if mode not in ("tty", "lines", "off"):
            raise ValueError(f"progress mode {mode!r} must be tty, lines or off")
        self.label, self.mode, self.interval, self.unit = label, mode, interval, unit
        self.stream = stream if stream is not None else sys.stderr
        self._bar: tqdm | None = None

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def __call__(self, done: int, total: int | None) -> None:
        """Show `done` of `total` (None: a count with no total)."""
        if self.mode == "off" or (total is not None and total <= 0):
            return
        if self._bar is None:
            tty = self.mode == "tty"
            self._bar = tqdm(
                total=total,
                desc=self.label,
                unit=self.unit,
                leave=True,
                file=self.stream if tty else _Lines(self.stream),
                mininterval=0.1 if tty else self.interval,
                ascii=not tty,
                dynamic_ncols=tty,
                ncols=None if tty else 80,
            )
        self._bar.update((done if total is None else min(done, total)) - self._bar.n)

    def close(self, note: str | None = None) -> None:
        """End the display. When the last progress was short of the total, also write one
        line: `note` (default "ended at step DONE of at most TOTAL")."""
        bar, self._bar = self._bar, None
        if bar is None:
            return
        done, total = bar.n, bar.total
        bar.close()
        if total is not None and done < total:
            note = note or f"ended at step {done} of at most {total}"
            self.stream.write(f"{self.label}: {note}\n")
            self.stream.flush()


def progress_mode(quiet: bool, stream: TextIO | None = None) -> str:
    """The progress mode: "off" with --quiet, "tty" on a terminal, "lines" otherwise."""
    stream = stream if stream is not None else sys.stderr
    if quiet:
        return "off"
    isatty = getattr(stream, "isatty", None)
    return "tty" if isatty is not None and isatty() else "lines"
