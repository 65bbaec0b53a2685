"""XsRolling: the compressor history of one compressed attention layer, with per-row lengths.

Spec: masks-and-scheduling.md §13 (and §14, cache-and-draft.md §4.2/§4.4, §12.3).
Invariant: `0 <= base[i] <= tokens[i] <= base[i] + W` for every row. The slot's fields
(`tokens`, `base`, the end-anchored `tail`, the start-anchored `comp`) and the compressor:
docs/simulator.md, section "reference/xs_rolling.py".
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from raggedspec.reference.errors import CacheRefusal, require

XS_TAIL_MARGIN_TOKENS = 16
"""Rollback margin kept behind the newest token; >= the MTP depth cap (8)."""

MTP_DEPTH_CAP = 8


def span_groups_for(ratio: int) -> int:
    """`span_groups`: 2 for ratio 4 (the CSA blocks overlap), otherwise 1."""
    require(ratio >= 1, f"compress ratio {ratio} must be >= 1")
    return 2 if ratio == 4 else 1


def compress_blocks(x: np.ndarray, ratio: int) -> np.ndarray:
    """Mean over each complete `ratio`-sized block along axis -2: `[..., T, D] -> [..., T//ratio,
    D]`.

    An incomplete trailing block is dropped (it has no compressed key yet)."""
    require(
        isinstance(x, np.ndarray) and x.ndim >= 2,
        f"compress_blocks needs [..., T, D], got {getattr(x, 'shape', None)}",
    )
    require(ratio >= 1, f"compress ratio {ratio} must be >= 1")
    t = x.shape[-2]
    g = t // ratio
    blocks = x[..., : g * ratio, :].reshape(*x.shape[:-2], g, ratio, x.shape[-1])
    return blocks.mean(axis=-2)


def resumable_from(length: int, ratio: int, span: int) -> int:
    """The first token a row of `length` tokens needs to complete its next block:
    `max(0, length // ratio + 1 - span) * ratio` (always <= length). A row may be rolled
    back to `length` only if this is >= its `base`."""
    require(length >= 0, f"length {length} must be >= 0")
    return max(0, length // ratio + 1 - span) * ratio


def rollback_refusal(i: int, length: int, tokens: int, base: int, ratio: int, span: int,
                     window: int) -> CacheRefusal | None:
    """Why row `i` (holding `tokens`, history from `base`) cannot be set to `length`, or None:
    past the tokens seen, behind base, a resume point (`resumable_from`) behind base, or
    `base + window < length`, checked in that order. Host integers only; the one rule every
    XsRolling layout (the reference's tail, a port's ring) refuses by."""
    if length > tokens:
        return CacheRefusal(f"xs row {i}: set length {length} is past the {tokens} tokens seen")
    if length < base:
        return CacheRefusal(
            f"xs row {i}: set length {length} is behind base {base} (history starts at {base})"
        )
    resume = resumable_from(length, ratio, span)
    if resume < base:
        return CacheRefusal(
            f"xs row {i}: set length {length} needs resume point {resume}, behind base {base} "
            f"(compressor history gap)")
    if base + window < length:
        return CacheRefusal(f"xs row {i}: base {base} + window {window} < length {length}")
    return None


@dataclass(frozen=True)
class XsRowPlan:
    """One row's advance. `take` new compressed rows are written at `dest = g_done`, taken
    as the last `take` blocks of `compress_blocks(ext[off : off + length])`, where
    `ext = tail ++ x_new` (column c of ext holds token `tokens - W + c`). With no new block,
    `take == 0` and `need_start`, `off`, `length` are None."""

    tokens_after: int
    g_done: int
    g_target: int
    need_start: int | None
    off: int | None
    length: int | None
    take: int
    base_after: int

    @property
    def dest(self) -> int:
        return self.g_done


@dataclass(frozen=True)
class XsAdvancePlan:
    """Per-row plans plus the compressor calls: rows with equal `(off, length, take)`
    share one call (keys in first-seen order, rows ascending)."""

    rows: list[XsRowPlan]
    calls: dict[tuple[int, int, int], list[int]] = field(default_factory=dict)


def plan_xs_advance(tokens: list[int], base: list[int], window: int, t_new: int, ratio: int,
                    span: int, margin: int = XS_TAIL_MARGIN_TOKENS) -> XsAdvancePlan:
    """Plan appending `t_new` hidden rows to every row (§13), without touching any state.

    Per row: `tok' = tok + t_new`; blocks `g_done = tok // ratio` .. `g_target = tok' // ratio`
    complete. With new blocks: `need_start = max(0, g_done + 1 - span) * ratio`, refused
    below `base` ("compressor history gap"); slice `off = need_start + W - tok`,
    `length = g_target * ratio - need_start`; `take = g_target - g_done` at `g_done`.
    Retention: `keep_from = max(base, (max(tok' - margin, 0) // ratio + 1 - span) * ratio)`,
    `base' = min(keep_from, tok')`; a row with `tok' - base' > W` does not fit the window and
    is refused ("does not fit the window"). Refusals are CacheRefusal naming row and values.
    """
    require(len(tokens) == len(base), f"{len(tokens)} token counts but {len(base)} bases")
    require(
        window >= 0 and t_new >= 0 and ratio >= 1 and span >= 1 and margin >= 0,
        f"window {window}, t_new {t_new}, ratio {ratio}, span {span}, margin {margin} out of range",
    )
    rows: list[XsRowPlan] = []
    calls: dict[tuple[int, int, int], list[int]] = {}
    for i, (tok, b) in enumerate(zip(tokens, base, strict=False)):
        require(0 <= b <= tok, f"row {i}: base {b} must be in [0, tokens {tok}]")
        tok2 = tok + t_new
        g_done, g_target = tok // ratio, tok2 // ratio
        need_start = off = length = None
        take = g_target - g_done
        if take > 0:
            need_start = max(0, g_done + 1 - span) * ratio
            if need_start < b:
                raise CacheRefusal(
                    f"compressor history gap: row {i} needs token {need_start} to complete block "
                    f"{g_done} but its history starts at base {b} (tokens {tok})")
            off = need_start + window - tok
            length = g_target * ratio - need_start
            calls.setdefault((off, length, take), []).append(i)
        keep_from = max(b, (max(tok2 - margin, 0) // ratio + 1 - span) * ratio)
        base2 = min(keep_from, tok2)
        if tok2 - base2 > window:
            raise CacheRefusal(
                f"row {i}'s run of {tok2 - base2} tokens (base {base2} .. {tok2}) does not fit the "
                f"window of {window}")
        rows.append(XsRowPlan(tok2, g_done, g_target, need_start, off, length, take, base2))
    return XsAdvancePlan(rows, calls)


class XsRolling:
    """The XsRolling slot (kind "XsRolling"); see the module docstring for state and invariant.

    `XsRolling(ratio, span_groups=None, window=None, max_seq_len=4096, batch=1, dim=None,
    margin=16)`: `span_groups` defaults to `span_groups_for(ratio)`; `window` (W) defaults
    to `span * ratio + margin`, the smallest round size that always fits the retained run
    (`tok' - base' <= margin - 1 + span * ratio`). Buffers are allocated on the first append
    (`dim` from it). Refusals: appends past `max_seq_len`, a history gap, a run that does not
    fit the window, and the length setters' refusals (see `set_row_lens`, `try_set_len`).
    """

    kind = "XsRolling"

    def __init__(self, ratio: int, span_groups: int | None = None, window: int | None = None,
                 max_seq_len: int = 4096, batch: int = 1, dim: int | None = None,
                 margin: int = XS_TAIL_MARGIN_TOKENS) -> None:
        self.ratio = int(ratio)
        self.span = span_groups_for(self.ratio) if span_groups is None else int(span_groups)
        self.window = self.span * self.ratio + margin if window is None else int(window)
        self.max_seq_len = int(max_seq_len)
        self.margin = int(margin)
        require(
            self.span >= 1 and self.window >= 1 and self.max_seq_len >= 0 and batch >= 0,
            f"span {self.span}, window {self.window}, max_seq_len {self.max_seq_len}, batch "
            f"{batch} out of range",
        )
        self.dim = dim
        self.tokens = [0] * batch
        self.base = [0] * batch
        self.tail: np.ndarray | None = None
        self.comp: np.ndarray | None = None

    # --- lengths -------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return len(self.tokens)

    @property
    def current_seq_len(self) -> int:
        """The maximum of `tokens` (0 for an empty batch)."""
        return max(self.tokens, default=0)

    @property
    def comp_seq_len(self) -> int:
        """Batched compressed width: `max(tokens) // ratio`."""
        return self.current_seq_len // self.ratio

    def supports_per_sequence_len(self, xs_per_seq: bool = False) -> bool:
        """XsRolling rows may carry their own length iff the `ARC_V4_XS_PER_SEQ` flag is on."""
        return bool(xs_per_seq)

    def row_comp(self, i: int) -> np.ndarray:
        """Row i's valid compressed rows `[tokens[i] // ratio, D]` (a copy)."""
        g = self.tokens[i] // self.ratio
        if self.comp is None:
            return np.zeros((g, self.dim or 0))
        return self.comp[i, :g].copy()

    def row_history(self, i: int) -> np.ndarray:
        """Row i's retained hidden rows, tokens `[base[i], tokens[i])` (a copy)."""
        n = self.tokens[i] - self.base[i]
        if self.tail is None:
            return np.zeros((n, self.dim or 0))
        return self.tail[i, self.window - n:].copy()

    # --- append --------------------------------------------------------------------------
    def _ensure_buffers(self, d: int, dtype, g_needed: int) -> None:
        if self.tail is None:
            self.dim = d
            self.tail = np.zeros((self.batch, self.window, d), dtype=dtype)
            self.comp = np.zeros((self.batch, 0, d), dtype=dtype)
        if self.comp.shape[1] < g_needed:
            grown = np.zeros((self.batch, g_needed, self.comp.shape[2]), dtype=self.comp.dtype)
            grown[:, : self.comp.shape[1]] = self.comp
            self.comp = grown

    def _zero_behind_base(self) -> None:
        for i in range(self.batch):
            first_col = self.base[i] - (
                self.tokens[i] - self.window
            )  # tail column of token base[i]
            if first_col > 0:
                self.tail[i, :first_col] = 0

    def append_rows(self, x_new: np.ndarray) -> None:
        """Append `x_new [B, t_new, D]` (t_new hidden rows to every row): plan with
        `plan_xs_advance`, run one `compress_blocks` call per shared `(off, length, take)`,
        write the new compressed rows at each row's `g_done`, keep the last W rows of
        `tail ++ x_new`, and move `tokens`/`base` on. Refused (before any change): a row
        past `max_seq_len` ("above max_seq_len"), a history gap, a run that does not fit."""
        require(
            isinstance(x_new, np.ndarray) and x_new.ndim == 3 and x_new.shape[0] == self.batch,
            f"append_rows needs [B={self.batch}, t_new, D], got {getattr(x_new, 'shape', None)}",
        )
        require(
            self.tail is None or x_new.shape[2] == self.tail.shape[2],
            f"hidden width {x_new.shape[2]} differs from the slot's "
            f"{None if self.tail is None else self.tail.shape[2]}",
        )
        t_new = x_new.shape[1]
        plan = plan_xs_advance(
            self.tokens, self.base, self.window, t_new, self.ratio, self.span, self.margin
        )
        over = [
            (i, p.tokens_after)
            for i, p in enumerate(plan.rows)
            if p.tokens_after > self.max_seq_len
        ]
        if over:
            raise CacheRefusal(
                f"xs row {over[0][0]} would hold {over[0][1]} tokens, above max_seq_len "
                f"{self.max_seq_len}"
            )
        g_needed = max((p.g_target for p in plan.rows), default=0)
        self._ensure_buffers(x_new.shape[2], x_new.dtype, g_needed)
        ext = np.concatenate([self.tail, x_new], axis=1)
        for (off, length, take), rows in plan.calls.items():
            blocks = compress_blocks(ext[rows, off : off + length], self.ratio)[:, -take:]
            for j, i in enumerate(rows):
                dest = plan.rows[i].dest
                self.comp[i, dest : dest + take] = blocks[j]
        self.tail = ext[:, ext.shape[1] - self.window:].copy()
        self.tokens = [p.tokens_after for p in plan.rows]
        self.base = [p.base_after for p in plan.rows]
        self._zero_behind_base()

    # --- length setters ------------------------------------------------------------------
    def _rollback_refusal(self, i: int, length: int) -> CacheRefusal | None:
        return rollback_refusal(
            i, length, self.tokens[i], self.base[i], self.ratio, self.span, self.window
        )

    def set_row_lens(self, lens: list[int]) -> None:
        """Per-row rollback to `lens[i]` tokens (the per-sequence commit). Refused, before
        any change: a length past the row's tokens (the history was never seen), a length
        behind `base` (`base > len`), a resume point (`resumable_from`) behind `base`, and
        `base + W < len`. The tail shifts right by the rolled-back count (zeros in front);
        `base` and `comp` are kept (stale compressed rows are overwritten by the next append)."""
        require(len(lens) == self.batch, f"{len(lens)} row lengths for a batch of {self.batch}")
        require(all(int(n) >= 0 for n in lens), f"row lengths {list(lens)} must be >= 0")
        for i, n in enumerate(lens):
            refusal = self._rollback_refusal(i, int(n))
            if refusal is not None:
                raise refusal
        for i, n in enumerate(lens):
            shift = self.tokens[i] - int(n)
            if shift > 0 and self.tail is not None:
                row = self.tail[i].copy()
                self.tail[i] = 0
                if shift < self.window:
                    self.tail[i, shift:] = row[: self.window - shift]
            self.tokens[i] = int(n)

    def try_set_len(self, length: int) -> None:
        """Check a uniform `set_len(length)`: refused for non-uniform rows ("non-uniform"),
        and per row as `set_row_lens` refuses (past tokens, behind base, resume point behind
        base)."""
        require(length >= 0, f"set_len length {length} must be >= 0")
        if len(set(self.tokens)) > 1:
            raise CacheRefusal(
                f"xs set_len({length}) refused: non-uniform rows with tokens {self.tokens}"
            )
        for i in range(self.batch):
            refusal = self._rollback_refusal(i, length)
            if refusal is not None:
                raise refusal

    def set_len(self, length: int) -> None:
        """Uniform rollback: `try_set_len`, then `set_row_lens([length] * B)`."""
        self.try_set_len(length)
        self.set_row_lens([length] * self.batch)

    def reset(self) -> None:
        """tokens = base = 0 on every row; buffers dropped."""
        self.tokens = [0] * self.batch
        self.base = [0] * self.batch
        self.tail = None
        self.comp = None

    # --- batch assembly ------------------------------------------------------------------
    def clone(self) -> XsRolling:
        """A deep copy."""
        return copy.deepcopy(self)

    def _empty_like(self, batch: int) -> XsRolling:
        return XsRolling(
            self.ratio, self.span, self.window, self.max_seq_len, batch, self.dim, self.margin
        )

    def split_rows(self) -> list[XsRolling]:
        """`split_row` for every row: B one-row slots, each with its own `(tokens, base)`, tail
        (zeros behind base) and compressed rows."""
        out = []
        for i in range(self.batch):
            row = self._empty_like(1)
            row.tokens, row.base = [self.tokens[i]], [self.base[i]]
            if self.tail is not None:
                row.tail = self.tail[i : i + 1].copy()
                row.comp = self.comp[i : i + 1].copy()
            out.append(row)
        return out

    @staticmethod
    def stack(rows: list[XsRolling], reconcile_bases: bool = False) -> XsRolling:
        """Stack slots along dim 0 with per-row `(tokens, base)`; comp padded with zeros at the
        end to the widest. `reconcile_bases` (the flag-off `reconcile_xs_bases`, unspecified
        upstream) gives every row the batch's largest base, which needs uniform tokens."""
        require(len(rows) > 0, "stack needs at least one xs slot")
        first = rows[0]
        for r in rows:
            require(
                (r.ratio, r.span, r.window, r.margin)
                == (first.ratio, first.span, first.window, first.margin),
                "xs slots in one layer must share ratio, span, window and margin",
            )
        out = first._empty_like(0)
        out.tokens = [t for r in rows for t in r.tokens]
        out.base = [b for r in rows for b in r.base]
        dims = {r.tail.shape[2] for r in rows if r.tail is not None}
        require(len(dims) <= 1, f"xs slots with hidden widths {sorted(dims)} cannot be stacked")
        if dims:
            d = dims.pop()
            dtype = next(r.tail.dtype for r in rows if r.tail is not None)
            g = max(r.comp.shape[1] for r in rows if r.comp is not None)
            tails, comps = [], []
            for r in rows:
                tail = (
                    r.tail if r.tail is not None else np.zeros((r.batch, r.window, d), dtype=dtype)
                )
                comp = np.zeros((r.batch, g, d), dtype=dtype)
                if r.comp is not None:
                    comp[:, : r.comp.shape[1]] = r.comp
                tails.append(tail)
                comps.append(comp)
            out.dim = d
            out.tail = np.concatenate(tails, axis=0)
            out.comp = np.concatenate(comps, axis=0)
        if reconcile_bases and out.batch:
            require(
                len(set(out.tokens)) == 1,
                f"reconciling xs bases needs uniform tokens, got {out.tokens}",
            )
            out.base = [max(out.base)] * out.batch
            if out.tail is not None:
                out._zero_behind_base()
        return out

    def __repr__(self) -> str:
        return (f"XsRolling(ratio={self.ratio}, span={self.span}, window={self.window}, "
                f"tokens={self.tokens}, base={self.base})")
