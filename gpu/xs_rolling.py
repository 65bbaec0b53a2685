"""XsRolling on the port: the compressor history of one compressed layer, per-row lengths
(port of `reference.xs_rolling`; masks-and-scheduling.md §13).

The tail is a ring buffer `ring [B, W, D]` (token p at column `p mod W`: appends touch only
the new rows, rollbacks move nothing), `comp` is start-anchored as in the reference, and one
compressor call serves all rows. Refusals are the reference's, before any state changes.
Layout, plan, refusals, precision and what is not ported: docs/conformance.md, section
"gpu/xs_rolling.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raggedspec.gpu._common import (
    arange_like,
    arange_on,
    as_list,
    host_ints,
    ints_on,
    lengths,
    lengths_like,
    on_device_of,
    to_device,
    zeros_on,
)
from raggedspec.reference.errors import CacheRefusal, require
from raggedspec.reference.xs_rolling import MTP_DEPTH_CAP, XS_TAIL_MARGIN_TOKENS, span_groups_for  # noqa: F401
from raggedspec.reference.xs_rolling import XsRolling as RefXsRolling
from raggedspec.reference.xs_rolling import XsRowPlan, rollback_refusal
from raggedspec.reference.xs_rolling import plan_xs_advance as ref_plan_xs_advance


def _device_and_host(value, device) -> tuple[torch.Tensor, np.ndarray | None]:
    """A length vector as (device tensor, host copy or None when only the device has it)."""
    if isinstance(value, torch.Tensor):
        return value, None
    host = np.array(value, dtype=np.int64).reshape(-1)
    return to_device(torch.from_numpy(host.copy()), device), host


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def compress_blocks(x: torch.Tensor, ratio: int) -> torch.Tensor:
    """Mean over each complete `ratio` block along axis -2 (`[..., T, D] -> [..., T//ratio, D]`),
    the incomplete trailing block dropped: one reshape-mean."""
    require(
        isinstance(x, torch.Tensor) and x.dim() >= 2,
        f"compress_blocks needs [..., T, D], got {getattr(x, 'shape', None)}",
    )
    require(ratio >= 1, f"compress ratio {ratio} must be >= 1")
    g = x.shape[-2] // ratio
    blocks = x[..., : g * ratio, :].unflatten(-2, (g, ratio))
    return blocks.to(_compute_dtype(x.dtype)).mean(dim=-2).to(x.dtype)


def resumable_from(length, ratio: int, span: int) -> torch.Tensor:
    """`max(0, length // ratio + 1 - span) * ratio` elementwise (int64)."""
    length = torch.as_tensor(length, dtype=torch.int64)
    require(not bool((length < 0).any()), f"length {as_list(length.reshape(-1))} must be >= 0")
    return (torch.div(length, ratio, rounding_mode="floor") + 1 - span).clamp(min=0) * ratio


@dataclass(frozen=True)
class XsAdvancePlan:
    """The reference's `XsRowPlan` fields as int64 `[B]` vectors (`need_start`, `off`,
    `length` are -1 where `take == 0`, the reference's None); `dest = g_done`."""

    tokens_after: torch.Tensor
    g_done: torch.Tensor
    g_target: torch.Tensor
    need_start: torch.Tensor
    off: torch.Tensor
    length: torch.Tensor
    take: torch.Tensor
    base_after: torch.Tensor

    @property
    def dest(self) -> torch.Tensor:
        return self.g_done

    def reference_rows(self) -> list[XsRowPlan]:
        """The plan as the reference's row objects (host lists; for conformance)."""
        cols = [
            as_list(t)
            for t in (
                self.tokens_after,
                self.g_done,
                self.g_target,
                self.need_start,
                self.off,
                self.length,
                self.take,
                self.base_after,
            )
        ]
        out = []
        for tok2, gd, gt, ns, off, ln, take, b2 in zip(*cols, strict=False):
            none = take == 0
            out.append(
                XsRowPlan(
                    tok2,
                    gd,
                    gt,
                    None if none else ns,
                    None if none else off,
                    None if none else ln,
                    take,
                    b2,
                )
            )
        return out


def plan_xs_advance(tokens, base, window: int, t_new: int, ratio: int, span: int,
                    margin: int = XS_TAIL_MARGIN_TOKENS) -> XsAdvancePlan:
    """Plan appending `t_new` rows to every row, all rows at once (the reference's formulas):
    `tok' = tok + t_new`, `g_done = tok // ratio`, `g_target = tok' // ratio`,
    `take = g_target - g_done`; with new blocks `need_start = max(0, g_done + 1 - span) *
    ratio` (CacheRefusal "compressor history gap" below `base`), `off = need_start + W - tok`,
    `length = g_target * ratio - need_start`; `keep_from = max(base, (max(tok' - margin, 0)
    // ratio + 1 - span) * ratio)`, `base' = min(keep_from, tok')`, CacheRefusal "does not fit
    the window" when `tok' - base' > W`. The first offending row is refused (a gap before a
    window misfit within a row), with the reference's message; a base outside `[0, tokens]`
    is malformed (ValueError) when its row is the first offending one, as the reference's
    row loop finds it."""
    tokens = lengths(tokens, name="tokens")
    base = lengths_like(base, tokens, name="base")
    require(
        tokens.numel() == base.numel(), f"{tokens.numel()} token counts but {base.numel()} bases"
    )
    require(
        window >= 0 and t_new >= 0 and ratio >= 1 and span >= 1 and margin >= 0,
        f"window {window}, t_new {t_new}, ratio {ratio}, span {span}, margin {margin} out of range",
    )
    bad_base = (base < 0) | (base > tokens)
    tok2 = tokens + t_new
    g_done = torch.div(tokens, ratio, rounding_mode="floor")
    g_target = torch.div(tok2, ratio, rounding_mode="floor")
    take = g_target - g_done
    new = take > 0
    need_start = (g_done + 1 - span).clamp(min=0) * ratio
    gap = new & (need_start < base)
    keep_from = torch.maximum(
        base,
        (torch.div((tok2 - margin).clamp(min=0), ratio, rounding_mode="floor") + 1 - span) * ratio,
    )
    base2 = torch.minimum(keep_from, tok2)
    misfit = tok2 - base2 > window
    bad = bad_base | gap | misfit
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        require(
            not bool(bad_base[i]),
            f"row {i}: base {int(base[i])} must be in [0, tokens {int(tokens[i])}]",
        )
        if bool(gap[i]):
            raise CacheRefusal(
                f"compressor history gap: row {i} needs token {int(need_start[i])} to complete "
                "block "
                f"{int(g_done[i])} but its history starts at base {int(base[i])} (tokens "
                f"{int(tokens[i])})"
            )
        raise CacheRefusal(
            f"row {i}'s run of {int(tok2[i] - base2[i])} tokens (base {int(base2[i])} .. "
            f"{int(tok2[i])}) does not "
            f"fit the window of {window}"
        )
    none = torch.full_like(tokens, -1)
    return XsAdvancePlan(tok2, g_done, g_target, torch.where(new, need_start, none),
                         torch.where(new, need_start + window - tokens, none),
                         torch.where(new, g_target * ratio - need_start, none), take, base2)


class XsRolling:
    """The port's XsRolling slot (ring-buffer history, see the module docstring).
    `XsRolling(ratio, span_groups=None, window=None, max_seq_len=4096, batch=1, dim=None,
    margin=16, device=None)`: the reference's defaults (`span_groups_for(ratio)`,
    `W = span * ratio + margin`). Buffers are allocated on the first append (dtype and D
    from it). Invariant: `0 <= base <= tokens <= base + W` per row; the ring holds token p of
    row i at `p mod W` for every `p` in `[base_i, tokens_i)`."""

    kind = "XsRolling"

    def __init__(self, ratio: int, span_groups: int | None = None, window: int | None = None,
                 max_seq_len: int = 4096, batch: int = 1, dim: int | None = None,
                 margin: int = XS_TAIL_MARGIN_TOKENS, device=None) -> None:
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
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dim = dim
        self.tokens = np.zeros(batch, dtype=np.int64)
        self.base = np.zeros(batch, dtype=np.int64)
        self.ring: torch.Tensor | None = None
        self.comp: torch.Tensor | None = None

    # --- host copies of the row lengths ----------------------------------------------------
    @property
    def tokens(self) -> torch.Tensor:
        return self._tokens

    @tokens.setter
    def tokens(self, value) -> None:
        self._tokens, self._tokens_h = _device_and_host(value, self.device)

    @property
    def base(self) -> torch.Tensor:
        return self._base

    @base.setter
    def base(self, value) -> None:
        self._base, self._base_h = _device_and_host(value, self.device)

    def host_tokens(self) -> np.ndarray:
        """`tokens` as host integers (read from the device once if computed there)."""
        if self._tokens_h is None:
            self._tokens_h = np.asarray(self._tokens.tolist(), dtype=np.int64).reshape(-1)
        return self._tokens_h

    def host_base(self) -> np.ndarray:
        """`base` as host integers (read from the device once if computed there)."""
        if self._base_h is None:
            self._base_h = np.asarray(self._base.tolist(), dtype=np.int64).reshape(-1)
        return self._base_h

    # --- conversion (conformance) -------------------------------------------------------
    @staticmethod
    def from_reference(
        ref: RefXsRolling, dtype: torch.dtype = torch.float64, device=None
    ) -> XsRolling:
        """The port slot holding the reference slot's state: its end-anchored tail scattered
        into the ring (column c -> `(tokens - W + c) mod W`, one scatter), comp copied."""
        out = XsRolling(
            ref.ratio, ref.span, ref.window, ref.max_seq_len, ref.batch, ref.dim, ref.margin, device
        )
        out.tokens = ints_on(ref.tokens, out.device).reshape(-1)
        out.base = ints_on(ref.base, out.device).reshape(-1)
        if ref.tail is not None:
            tail = to_device(torch.from_numpy(np.ascontiguousarray(ref.tail)), out.device).to(dtype)
            b, w, d = tail.shape
            cols = torch.remainder(out.tokens[:, None] - w + arange_like(w, out.tokens), w)
            out.ring = torch.zeros_like(tail).scatter(1, cols[:, :, None].expand(b, w, d), tail)
            out.comp = to_device(torch.from_numpy(np.ascontiguousarray(ref.comp)), out.device).to(
                dtype
            )
        return out

    def materialize_tail(self) -> torch.Tensor | None:
        """The reference's end-anchored tail `[B, W, D]`: column c of row i holds token
        `p = tokens_i - W + c` when `p >= base_i`, else 0. One gather + one where."""
        if self.ring is None:
            return None
        b, w, d = self.ring.shape
        p = self.tokens[:, None] - w + arange_like(w, self.ring)
        out = self.ring.gather(1, torch.remainder(p, w)[:, :, None].expand(b, w, d))
        live = (p >= self.base[:, None])[:, :, None]
        return torch.where(live, out, out.new_zeros(()))

    def to_reference(self) -> RefXsRolling:
        """A reference slot with this state (tail materialized, comp copied; host arrays)."""
        ref = RefXsRolling(
            self.ratio, self.span, self.window, self.max_seq_len, self.batch, self.dim, self.margin
        )
        ref.tokens, ref.base = as_list(self.tokens), as_list(self.base)
        if self.ring is not None:
            ref.tail = self.materialize_tail().cpu().to(torch.float64).numpy()
            ref.comp = self.comp.cpu().to(torch.float64).numpy()
        return ref

    # --- lengths --------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.tokens.numel()

    @property
    def current_seq_len(self) -> int:
        """`max(tokens)` (0 for an empty batch)."""
        return int(self.host_tokens().max()) if self.batch else 0

    @property
    def comp_seq_len(self) -> int:
        """`max(tokens) // ratio`."""
        return self.current_seq_len // self.ratio

    def supports_per_sequence_len(self, xs_per_seq: bool = False) -> bool:
        return bool(xs_per_seq)

    def row_comp(self, i: int) -> torch.Tensor:
        """Row i's valid compressed rows `[tokens_i // ratio, D]`."""
        g = int(self.tokens[i]) // self.ratio
        if self.comp is None:
            return zeros_on((g, self.dim or 0), torch.float64, self.device)
        return self.comp[i, :g]

    def row_history(self, i: int) -> torch.Tensor:
        """Row i's retained rows, tokens `[base_i, tokens_i)` (gathered from the ring)."""
        n = int(self.tokens[i] - self.base[i])
        if self.ring is None:
            return zeros_on((n, self.dim or 0), torch.float64, self.device)
        p = arange_on(n, self.device) + int(self.base[i])
        return self.ring[i, torch.remainder(p, self.window)]

    # --- append -----------------------------------------------------------------------------
    def append_rows(self, x_new: torch.Tensor) -> None:
        """Append `x_new [B, t_new, D]` to every row: `plan_xs_advance` (its refusals), the
        "above max_seq_len" refusal (first row over), then one gather + mean for every row's
        new blocks (scattered at `g_done + j`, `j < take_i`), one scatter of the last
        `min(t_new, W)` rows into the ring, and `tokens`/`base` moved on. Nothing changes on
        a refusal."""
        require(
            isinstance(x_new, torch.Tensor) and x_new.dim() == 3 and x_new.shape[0] == self.batch,
            f"append_rows needs [B={self.batch}, t_new, D], got "
            f"{tuple(getattr(x_new, 'shape', ()))}",
        )
        require(
            self.ring is None or x_new.shape[2] == self.ring.shape[2],
            f"hidden width {x_new.shape[2]} differs from the slot's "
            f"{None if self.ring is None else self.ring.shape[2]}",
        )
        b, t_new, d = x_new.shape
        w, r = self.window, self.ratio
        # the plan is the reference's, on the host copies of the lengths (no device read)
        rows = ref_plan_xs_advance(
            self.host_tokens().tolist(),
            self.host_base().tolist(),
            w,
            t_new,
            r,
            self.span,
            self.margin,
        ).rows
        tok_after = np.fromiter((p.tokens_after for p in rows), np.int64, b)
        over = np.flatnonzero(tok_after > self.max_seq_len)
        if over.size:
            i = int(over[0])
            raise CacheRefusal(
                f"xs row {i} would hold {int(tok_after[i])} tokens, above max_seq_len "
                f"{self.max_seq_len}"
            )
        g_done_h = np.fromiter((p.g_done for p in rows), np.int64, b)
        take_h = np.fromiter((p.take for p in rows), np.int64, b)
        base_after = np.fromiter((p.base_after for p in rows), np.int64, b)
        x_new = to_device(x_new, self.device)
        g_needed = int((g_done_h + take_h).max()) if b else 0
        if self.ring is None:
            self.dim = d
            self.ring = x_new.new_zeros((b, w, d))
            self.comp = x_new.new_zeros((b, 0, d))
        if self.comp.shape[1] < g_needed:
            self.comp = torch.nn.functional.pad(self.comp, (0, 0, 0, g_needed - self.comp.shape[1]))
        x_new = x_new.to(self.ring.dtype)
        take_max = int(take_h.max()) if b else 0
        if take_max > 0:
            g_done = on_device_of(torch.from_numpy(g_done_h), self.ring)
            j = arange_like(take_max, self.ring)
            g = g_done[:, None] + j  # [B, take_max]
            p = (g[:, :, None] * r + arange_like(r, self.ring)).reshape(
                b, -1
            )  # [B, take_max * r]
            fresh = p >= self.tokens[:, None]
            from_new = x_new.gather(
                1,
                (p - self.tokens[:, None])
                .clamp(0, max(t_new - 1, 0))[:, :, None]
                .expand(-1, -1, d),
            )
            from_ring = self.ring.gather(1, torch.remainder(p, w)[:, :, None].expand(-1, -1, d))
            rows = torch.where(fresh[:, :, None], from_new, from_ring).reshape(b, take_max, r, d)
            blocks = (
                rows.to(_compute_dtype(rows.dtype)).mean(dim=2).to(rows.dtype)
            )  # [B, take_max, D]
            valid = (j[None, :] < on_device_of(torch.from_numpy(take_h), j)[:, None])[:, :, None]
            # every (row, g) pair is distinct: write all of them into a buffer wide enough,
            # the pairs past a row's take with the values they had (no mask-sized index)
            width = self.comp.shape[1]
            room = int(g_done_h.max()) + take_max
            comp = (
                self.comp
                if room <= width
                else torch.nn.functional.pad(self.comp, (0, 0, 0, room - width))
            )
            at = g[:, :, None].expand(-1, -1, d)
            comp = comp.scatter(1, at, torch.where(valid, blocks, comp.gather(1, at)))
            self.comp = comp[:, :width]
        keep = min(t_new, w)
        if keep:
            cols = torch.remainder(
                self.tokens[:, None] + (t_new - keep) + arange_like(keep, self.ring), w
            )
            self.ring = self.ring.scatter(
                1, cols[:, :, None].expand(-1, -1, d), x_new[:, t_new - keep :]
            )
        self.tokens = tok_after
        self.base = base_after

    # --- length setters -----------------------------------------------------------------------
    def _rollback_refusal(self, lens: np.ndarray) -> CacheRefusal | None:
        """The reference's per-row checks (`reference.xs_rolling.rollback_refusal`) on the
        host lengths; the first offending row's first failing check."""
        tok, base = self.host_tokens(), self.host_base()
        for i, n in enumerate(lens.tolist()):
            refusal = rollback_refusal(
                i, n, int(tok[i]), int(base[i]), self.ratio, self.span, self.window
            )
            if refusal is not None:
                return refusal
        return None

    def set_row_lens(self, lens) -> None:
        """Per-row rollback to `lens[i]` (the per-sequence commit): the reference's refusals,
        before any change; then `tokens = lens`. No data moves (the ring keeps every token
        in `[base, lens)` where it is); `base` and `comp` are kept."""
        lens = host_ints(lens)
        require(lens.size == self.batch, f"{lens.size} row lengths for a batch of {self.batch}")
        if (lens < 0).any():
            raise ValueError(f"row lengths {lens.tolist()} must be >= 0")
        refusal = self._rollback_refusal(lens)
        if refusal is not None:
            raise refusal
        self.tokens = lens.copy()

    def try_set_len(self, length: int) -> None:
        """Check a uniform `set_len(length)`: "non-uniform" rows refused first, then the
        per-row checks of `set_row_lens`."""
        require(length >= 0, f"set_len length {length} must be >= 0")
        tok = self.host_tokens()
        if self.batch and (tok != tok[0]).any():
            raise CacheRefusal(
                f"xs set_len({length}) refused: non-uniform rows with tokens {tok.tolist()}"
            )
        refusal = self._rollback_refusal(np.full(self.batch, int(length), dtype=np.int64))
        if refusal is not None:
            raise refusal

    def set_len(self, length: int) -> None:
        """Uniform rollback: `try_set_len`, then `set_row_lens([length] * B)`."""
        self.try_set_len(length)
        self.set_row_lens(np.full(self.batch, int(length), dtype=np.int64))

    def reset(self) -> None:
        """tokens = base = 0; buffers dropped."""
        self.tokens = np.zeros(self.batch, dtype=np.int64)
        self.base = np.zeros(self.batch, dtype=np.int64)
        self.ring = None
        self.comp = None

    def clone(self) -> XsRolling:
        out = XsRolling(
            self.ratio,
            self.span,
            self.window,
            self.max_seq_len,
            self.batch,
            self.dim,
            self.margin,
            self.device,
        )
        out.tokens = (
            self.host_tokens().copy() if self._tokens_h is not None else self.tokens.clone()
        )
        out.base = self.host_base().copy() if self._base_h is not None else self.base.clone()
        out.ring = None if self.ring is None else self.ring.clone()
        out.comp = None if self.comp is None else self.comp.clone()
        return out

    def __repr__(self) -> str:
        return (f"XsRolling(ratio={self.ratio}, span={self.span}, window={self.window}, "
                f"tokens={as_list(self.tokens)}, base={as_list(self.base)})")


__all__ = ["XsRolling", "XsAdvancePlan", "plan_xs_advance", "compress_blocks", "resumable_from"]
