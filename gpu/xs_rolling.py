"""XsRolling on the port: the compressor history of one compressed layer, per-row lengths
(port of `reference.xs_rolling`; masks-and-scheduling.md §13).

The tail is a ring buffer `ring [B, W, D]` (token p at column `p mod W`: appends touch only
the new rows, rollbacks move nothing), `comp` is start-anchored as in the reference, and one
compressor call serves all rows. Refusals are the reference's, before any state changes.
Layout, plan, refusals, precision and what is not ported: docs/conformance.md, section
"gpu/xs_rolling.py".
"""

from __future__ import annotations

import numpy as np
import torch

from raggedspec.gpu._common import (
    arange_on,
    host_ints,
    to_device,
    upload_ints,
    zeros_on,
)
from raggedspec.reference.errors import CacheRefusal, Refusal, require
from raggedspec.reference.xs_rolling import (
    XS_TAIL_MARGIN_TOKENS,
    plan_xs_advance,
    rollback_refusal,
    span_groups_for,
)


def _device_and_host(value, device) -> tuple[torch.Tensor | None, np.ndarray | None]:
    """A length vector as (device tensor, host copy): the host copy None when only the device
    has it, the device tensor None when only the host has it (uploaded to `device` on the
    first read, `_on_device`)."""
    if isinstance(value, torch.Tensor):
        return value, None
    return None, np.array(value, dtype=np.int64).reshape(-1)


def _on_device(host: np.ndarray, device) -> torch.Tensor:
    """Host lengths uploaded to `device` (one transfer)."""
    return to_device(torch.from_numpy(host.copy()), device)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


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
        self._staged = None  # `stage`'s device indices for the next append

    # --- host copies of the row lengths ----------------------------------------------------
    @property
    def tokens(self) -> torch.Tensor:
        if self._tokens is None:  # set from host integers: uploaded on the first read
            self._tokens = _on_device(self._tokens_h, self.device)
        return self._tokens

    @tokens.setter
    def tokens(self, value) -> None:
        self._tokens, self._tokens_h = _device_and_host(value, self.device)

    @property
    def base(self) -> torch.Tensor:
        if self._base is None:
            self._base = _on_device(self._base_h, self.device)
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

    # --- lengths --------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.tokens.numel() if self._tokens_h is None else self._tokens_h.size

    @property
    def current_seq_len(self) -> int:
        """`max(tokens)` (0 for an empty batch)."""
        return int(self.host_tokens().max()) if self.batch else 0

    def supports_per_sequence_len(self, xs_per_seq: bool = False) -> bool:
        """The slot protocol's capability (`reference.align`, `reference.capability`): the
        rows carry their own lengths iff the xs flag is on."""
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
        tok_after, g_done_h, take_h, base_after = self._append_plan(t_new)
        idx = self._take_staged(t_new)  # before `comp` grows: the width it was staged at
        x_new = to_device(x_new, self.device)
        g_needed = int((g_done_h + take_h).max()) if b else 0
        if self.ring is None:
            self.dim = d
            self.ring = x_new.new_zeros((b, self.window, d))
            self.comp = x_new.new_zeros((b, 0, d))
        if self.comp.shape[1] < g_needed:
            self.comp = torch.nn.functional.pad(self.comp, (0, 0, 0, g_needed - self.comp.shape[1]))
        x_new = x_new.to(self.ring.dtype)
        compress = bool(b) and int(take_h.max()) > 0
        keep = min(t_new, self.window)
        # every index the append needs, computed on the host: one upload (or staged)
        if idx is None:
            idx = upload_ints(self.ring, *self._append_indices(t_new, g_done_h, take_h))
        if compress:
            self._compress_blocks(x_new, int(take_h.max()), *idx[:3])
        if keep:
            self._write_ring(x_new, keep, idx[3])
        self.tokens = tok_after
        self.base = base_after

    def append_indices(self, t_new: int) -> list | None:
        """The host index vectors the next `append_rows` of `t_new` rows needs (four int64
        arrays, None where unused), or None where that append would refuse or has no ring
        yet: a caller uploads them with its own transfer and hands the device copies to
        `stage`. Changes nothing."""
        if self.ring is None:
            return None
        try:
            _, g_done_h, take_h, _ = self._append_plan(t_new)
        except (Refusal, ValueError):
            return None  # the append itself refuses, later, in its own order
        return self._append_indices(t_new, g_done_h, take_h)

    def stage(self, t_new: int, device_indices: list) -> None:
        """Keep `append_indices(t_new)`'s device copies for the next `append_rows`, which uses
        them while the slot's lengths and widths are those they were computed from (else it
        uploads its own). Refuses nothing."""
        self._staged = (t_new, self.host_tokens().copy(), self.host_base().copy(),
                        self.comp.shape[1], list(device_indices))

    def _take_staged(self, t_new: int) -> list | None:
        """The staged device indices when they were computed for this append (dropped
        either way)."""
        staged, self._staged = getattr(self, "_staged", None), None
        if staged is None or self.ring is None:
            return None
        n, tok, base, width, dev = staged
        same = (n == t_new and width == self.comp.shape[1]
                and np.array_equal(tok, self.host_tokens())
                and np.array_equal(base, self.host_base()))
        return dev if same else None

    def _append_indices(self, t_new: int, g_done_h: np.ndarray, take_h: np.ndarray) -> list:
        """`_block_indices` (None each when no row takes a block) and `_ring_indices`."""
        g_needed = int((g_done_h + take_h).max()) if self.batch else 0
        width = max(0 if self.comp is None else self.comp.shape[1], g_needed)
        compress = bool(self.batch) and int(take_h.max()) > 0
        blocks = self._block_indices(t_new, g_done_h, take_h, width) if compress else (None,) * 3
        return [*blocks, self._ring_indices(t_new)]

    def _append_plan(self, t_new: int):
        """`(tokens_after, g_done, take, base_after)` per row, host int64 arrays, for appending
        `t_new` rows: the reference's `plan_xs_advance` on the host copies of the lengths (no
        device read; its refusals propagate). Refuses with CacheRefusal "above max_seq_len"
        naming the first row that would hold more tokens. Changes nothing."""
        b = self.batch
        rows = plan_xs_advance(
            self.host_tokens().tolist(),
            self.host_base().tolist(),
            self.window,
            t_new,
            self.ratio,
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
        return tok_after, g_done_h, take_h, base_after

    def _block_indices(self, t_new: int, g_done_h: np.ndarray, take_h: np.ndarray,
                       width: int):
        """Host indices of `_compress_blocks`: `src [B * take_max * ratio]` each block
        position's row in `cat(x_new rows, ring rows)` (position p of row i from `x_new` when
        `p >= tokens_i`, else from the ring at `p mod W`), `sel` the `(row, j)` pairs with
        `j < take_i` (flat in `[B, take_max]`) and `dst` their rows in the flattened `comp`
        (`i * width + g_done_i + j`, `width` that of `comp` at the append). No refusals."""
        b, w, r = self.batch, self.window, self.ratio
        tok, rows = self.host_tokens()[:, None], np.arange(b, dtype=np.int64)[:, None]
        j = np.arange(int(take_h.max()), dtype=np.int64)
        g = g_done_h[:, None] + j                                               # [B, take_max]
        p = (g[:, :, None] * r + np.arange(r)).reshape(b, -1)              # [B, take_max * r]
        src = np.where(p >= tok, rows * t_new + np.clip(p - tok, 0, max(t_new - 1, 0)),
                       b * t_new + rows * w + p % w)
        valid = j[None, :] < take_h[:, None]
        return src.reshape(-1), np.flatnonzero(valid), (rows * width + g)[valid]

    def _ring_indices(self, t_new: int) -> np.ndarray:
        """Host indices of `_write_ring`: row i's last `keep = min(t_new, W)` new rows land at
        `i * W + (tokens_i + t_new - keep + c) mod W` of the flattened ring. No refusals."""
        b, w = self.batch, self.window
        keep = min(t_new, w)
        cols = (self.host_tokens()[:, None] + (t_new - keep) + np.arange(keep)) % w
        return (np.arange(b, dtype=np.int64)[:, None] * w + cols).reshape(-1)

    def _compress_blocks(self, x_new: torch.Tensor, take_max: int, src: torch.Tensor,
                         sel: torch.Tensor, dst: torch.Tensor) -> None:
        """Row i's new compressed blocks `g_done_i + j`, `j < take_i`, in one gather + mean:
        block g is the mean of positions `[g * ratio, (g + 1) * ratio)`, each read from `x_new`
        when at or past the row's `tokens`, else from the ring (`src`, `sel`, `dst`: the device
        copies of `_block_indices`). Written into `comp` (its width kept); every other block
        keeps its value. No refusals."""
        b, t_new, d = x_new.shape
        source = torch.cat([x_new.reshape(b * t_new, d), self.ring.reshape(-1, d)])
        rows = source.index_select(0, src).view(b, take_max, self.ratio, d)
        blocks = rows.to(_compute_dtype(rows.dtype)).mean(dim=2).to(rows.dtype)  # [B, take_max, D]
        width = self.comp.shape[1]
        self.comp = self.comp.reshape(b * width, d).index_copy(
            0, dst, blocks.reshape(b * take_max, d).index_select(0, sel)).view(b, width, d)

    def _write_ring(self, x_new: torch.Tensor, keep: int, at: torch.Tensor) -> None:
        """The last `keep` rows of `x_new` into each row's ring at the flattened ring rows `at`
        (`_ring_indices`, on the device); `tokens` not moved. No refusals."""
        b, t_new, d = x_new.shape
        self.ring = self.ring.reshape(-1, d).index_copy(
            0, at, x_new[:, t_new - keep :].reshape(b * keep, d)).view(b, self.window, d)

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


__all__ = ["XsRolling"]
