"""The MTP draft chain and the draft KV's tensor side on the port (port of `reference.draft`).

Every sequence's draft KV lives in ONE `gpu.cache.RaggedKv` pool; a draft group is a
row-index vector into it, so nothing is batched, aligned, split or stripped by copying.
`propose_chain_batched` runs one batched MTP step per chain step for the whole group and
`extend_draft_kv_rows` extends many rows at once. Layout, paths and host reads:
docs/conformance.md, section "gpu/draft.py".
"""

from __future__ import annotations

import numpy as np
import torch

from raggedspec.gpu._common import host_ints, on_device_of, upload_ints
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.rope import rotate
from raggedspec.reference.dispatch import resolve_ragged_chain_starts
from raggedspec.reference.errors import CacheRefusal, StepRefusal, require

draft_chain_stats = {"scalar": 0, "per_row": 0}
"""Chain steps taken by `propose_chain_batched`: "scalar" (`forward_step`, one shared
position) or "per_row" (`forward_step_rows`). A uniform group must never reach "per_row"."""


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens `[...]` of `logits [..., V]`: the first maximal index (torch.argmax's
    documented tie rule on CPU and CUDA, as `reference.draft.argmax_token`)."""
    require(
        logits.dim() >= 1 and logits.shape[-1] > 0,
        f"logits shape {list(logits.shape)} must be [..., V], V >= 1",
    )
    return logits.argmax(dim=-1)


def propose_chain_batched(
    model,
    seed_hidden: torch.Tensor,
    last_tokens,
    n: int,
    chain_starts,
    cache: RaggedKv | None,
    trace: list | None = None,
    rows=None,
    staged=None,
) -> torch.Tensor:
    """Draft `n` greedy tokens for each of G rows: one batched MTP step per chain step.

    Returns int64 `[G, n]` (row r's chain). `n == 0` or `G == 0` -> `[G, 0]`. Refuses
    (StepRefusal, the reference's messages) `len(chain_starts) != G` ("chain start(s) for a
    draft group of") and a block without a cache ("draft KV"). Group row r is `cache` row
    `rows[r]` (row r when `rows` is None). `ragged = resolve_ragged_chain_starts(starts)`;
    step i: `fused = fuse(prev, toks)`; None -> `forward_step(fused, starts[0] + i)`, else
    `forward_step_rows(fused, starts + i)`; `logits = lm_head(norm_out(hidden))`, argmax
    -> next; `toks := next`, `prev := hidden` (pre-norm). Tier A (no block):
    `hidden = h_proj(prev) + e_proj(embed(tok))`, `logits = lm_head(hidden)`, no cache.
    Invariant: on entry every group row holds its own start (else DispatchRefusal
    "desync"), after step i `start + i + 1`. `trace` receives each step's hidden `[G,H]`;
    `staged` the step's vectors uploaded earlier, used where equal (`staged_or_upload`)."""
    require(seed_hidden.dim() == 2, f"seed_hidden {tuple(seed_hidden.shape)} must be [G,H]")
    require(n >= 0, f"chain length {n} must be >= 0")
    g = seed_hidden.shape[0]
    like = model.embed  # the model's device
    if n == 0 or g == 0:
        return like.new_zeros((g, 0), dtype=torch.int64)
    starts = host_ints(chain_starts)
    if starts.size != g:
        raise StepRefusal(
            f"{starts.size} chain start(s) for a draft group of {g} row(s): {starts.tolist()}"
        )
    block = model.mtp
    if block is not None and cache is None:
        raise StepRefusal(f"the MTP block cannot draft without a draft KV cache (group of {g}, "
                          f"starts {starts.tolist()})")
    first = host_ints(last_tokens)
    require(first.size == g, f"{first.size} last tokens for a draft group of {g}")
    if first.size and (first.min() < 0 or first.max() >= model.cfg.vocab):
        raise ValueError(f"tokens must be in [0, {model.cfg.vocab})")
    rows = None if rows is None else host_ints(rows)
    ragged = resolve_ragged_chain_starts(starts.tolist())
    ragged = None if ragged is None else host_ints(ragged)
    held = None if cache is None else cache.pending_upload()
    toks, *dev, dev_held = staged_or_upload(like, [first, rows, ragged, held], staged)
    if dev_held is not None:  # the pool's lengths, in the same upload
        cache.adopt_device_lens(held, dev_held)
    out = []  # each step's tokens [G, 1]: one cat at the end
    prev, toks = on_device_of(seed_hidden, like).to(model.dtype)[:, None], toks[:, None]
    for i in range(n):
        hidden, logits = chain_step(model, prev, toks, int(starts[0]), ragged, i, cache, rows,
                                    dev)
        toks, prev = argmax_tokens(logits), hidden
        out.append(toks)
        if trace is not None:
            trace.append(hidden[:, 0].clone())
    return torch.cat(out, dim=1)


def staged_or_upload(like: torch.Tensor, host: list, staged) -> list:
    """The device copies of the host int64 vectors `host` (None entries stay None): those of
    `staged = (host vectors, device vectors)` when every vector equals its staged one, else
    one upload of `host`. Refuses nothing."""
    if staged is not None and len(staged[0]) == len(host) and all(
            (a is None and b is None) or (a is not None and b is not None
                                          and np.array_equal(a, b))
            for a, b in zip(host, staged[0], strict=True)):
        return list(staged[1])
    return upload_ints(like, *host)


def chain_step(model, prev: torch.Tensor, toks: torch.Tensor, start_pos: int,
               ragged: np.ndarray | None, i: int, cache: RaggedKv | None,
               rows, dev=(None, None)) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `i` of `propose_chain_batched`, as `reference.draft.chain_step`: `(hidden [G,1,H],
    logits [G,1,V])` from `prev [G,1,H]` and `toks [G,1]` (one token per row: the chain
    keeps that shape from step to step, no reshaping); with a block at position `start_pos + i`
    (`ragged` None, counted "scalar" in `draft_chain_stats`) or each row's `start_r + i`
    ("per_row"), group row r being `cache` row `rows[r]`; Tier A (no block) without a position
    or a cache. `dev`: `rows` and `ragged` already on the device (or None each). The block's
    refusals ("desync") propagate."""
    block = model.mtp
    if block is None:
        heads = model.mtp_heads
        hidden = prev[:, 0] @ heads.h_proj + model.embed[toks[:, 0]] @ heads.e_proj
        return hidden[:, None], (hidden @ model.lm_head)[:, None]
    fused = block.fuse(prev, toks)
    if ragged is None:
        draft_chain_stats["scalar"] += 1
        hidden = block.forward_step(fused, start_pos + i, cache, rows, dev[0])
    else:
        draft_chain_stats["per_row"] += 1
        pos = None if dev[1] is None else dev[1] + i
        hidden = block.forward_step_rows(fused, ragged + i, cache, rows, dev[0], pos)
    return hidden, block.logits(hidden)


def extend_draft_kv_rows(
    block,
    kv: RaggedKv,
    hidden: torch.Tensor,
    off,
    lo,
    hi,
    tokens: torch.Tensor,
    rows=None,
    write=None,
    hidden_rows=None,
    riders=(),
) -> list | None:
    """Write the pairs `(hidden[r, lo_r - off_r + j], tokens[r, lo_r + 1 + j])` into draft-KV
    row `rows[r]` (row r when `rows` is None) at positions `lo_r + j`, `j < hi_r - lo_r`,
    for every row at once; rows with `hi <= lo`, or outside `write` when given (a bool `[R]`,
    e.g. `plan_draft_extension(...).write`, which also excludes misaligned rows), are untouched.

    `hidden [R, T, H]` the captured pre-norm hidden of the rows (column c = position
    `off_r + c`), `tokens [R, L_max]` the rows' committed tokens (padded past each row's
    own L), `off, lo, hi [R]` as `plan_draft_extension` gives them (`lo >= off`,
    `hi <= off + T`, `hi <= L - 1`). First each writing row's length is set to `lo` (the
    reference's `set_len(filled)`, `filled == lo` for a contiguous row; CacheRefusal "MTP
    draft KV truncate to {lo} failed" past the capacity), then one fuse + key projection
    over `[R, max(hi - lo)]`, one scatter of the written pairs (only `j < hi - lo` lands;
    nothing is written past a row's `hi`; indices from the host, one upload), lengths
    `= hi`. The K is token-local, so no attention runs. `hidden_rows` (ints `[R]`): row r's
    capture is `hidden[hidden_rows[r]]` of a wider `hidden [N, T, H]` (read with the pairs,
    no copy of the rows first); a row outside `[0, N)` is refused (ValueError).
    `riders`: further host int64 vectors uploaded in the pairs' transfer; returns their
    device copies, or None when nothing is written (nothing uploaded).
    Capacity growth: by whole 512-column blocks, refused above `max_seq_len`."""
    tokens = checked_tokens(tokens, block.cfg.vocab)
    host_off, host_lo, host_hi, host_idx, host_cap = extension_rows(off, lo, hi, rows, hidden,
                                                                    tokens, hidden_rows)
    hidden = on_device_of(hidden, kv.k)
    host_n = written_counts(host_lo, host_hi, write)
    host_write = host_n > 0
    if not host_write.any():
        return None
    check_extension_spans(kv, host_off, host_lo, host_hi, host_write, hidden.shape[1],
                          tokens.shape[1])
    kv._grow_to(int(host_hi[host_write].max()))  # refused (above max_seq_len) before any change
    held = kv.host_lens().copy()
    held[host_idx[host_write]] = host_lo[host_write]
    kv.lens = held
    carried = write_draft_keys(block, kv, hidden, tokens, host_off, host_lo, host_n, host_idx,
                               host_cap, riders)
    held = held.copy()
    held[host_idx[host_write]] = host_hi[host_write]
    kv.lens = held
    return carried


def checked_tokens(tokens, vocab: int) -> torch.Tensor | np.ndarray:
    """The committed tokens `[R, L_max]`: a tensor as given, host tokens (an array or list) as
    a host int64 array; range checked where they were given (a tensor is read once). Refuses
    with ValueError a token outside `[0, vocab)`."""
    if isinstance(tokens, torch.Tensor):
        bad = tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab)
    else:
        tokens = host_ints(tokens, flat=False)
        bad = tokens.size and (tokens.min() < 0 or tokens.max() >= vocab)
    if bad:  # the committed tokens, checked on the host when given there
        raise ValueError(f"tokens must be in [0, {vocab})")
    return tokens


def extension_rows(off, lo, hi, rows, hidden: torch.Tensor, tokens, hidden_rows=None):
    """The plan `off, lo, hi`, the cache rows (`0..R-1` when `rows` is None) and the capture
    rows (`0..R-1` when `hidden_rows` is None) as host integer arrays. Refuses with
    ValueError unless they, `hidden [R,T,H]` (`[N,T,H]` holding every capture row) and
    `tokens [R,L]` all have one entry per row."""
    host_off, host_lo, host_hi = host_ints(off), host_ints(lo), host_ints(hi)
    r_n = host_lo.size
    host_idx = np.arange(r_n) if rows is None else host_ints(rows)
    host_cap = np.arange(r_n) if hidden_rows is None else host_ints(hidden_rows)
    n_cap = hidden.shape[0] if hidden.dim() == 3 else -1
    if not (
        host_off.size == r_n == host_hi.size == host_idx.size == host_cap.size
        and (n_cap == r_n if hidden_rows is None else
             not host_cap.size or (host_cap.min() >= 0 and host_cap.max() < n_cap))
        and tokens.ndim == 2
        and tokens.shape[0] == r_n
    ):
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, tokens {tuple(tokens.shape)}, off/lo/hi/rows "
            f"({host_off.size}, {r_n}, {host_hi.size}, {host_idx.size}) must all have one entry "
            "per row"
        )
    return host_off, host_lo, host_hi, host_idx, host_cap


def written_counts(host_lo: np.ndarray, host_hi: np.ndarray, write) -> np.ndarray:
    """Pairs each row writes: `max(hi - lo, 0)`, 0 outside `write` (a bool `[R]`) when given.
    Refuses (ValueError) a `write` mask without one entry per row."""
    host_n = np.maximum(host_hi - host_lo, 0)
    if write is None:
        return host_n
    host_write = host_ints(write).astype(bool)
    require(host_write.size == host_lo.size,
            f"write mask of {host_write.size} for {host_lo.size} rows")
    return np.where(host_write, host_n, 0)


def check_extension_spans(kv: RaggedKv, host_off: np.ndarray, host_lo: np.ndarray,
                          host_hi: np.ndarray, host_write: np.ndarray, t_cap: int,
                          l_max: int) -> None:
    """Every writing row's span lies inside its capture (`off <= lo`, `hi <= off + T`) and its
    tokens (`hi + 1 <= L_max`), else ValueError; its `lo` is within the pool's capacity, else
    CacheRefusal "MTP draft KV truncate to {lo} failed" (the reference's `set_len`)."""
    outside = host_write & (
        (host_lo < host_off) | (host_hi > host_off + t_cap) | (host_hi + 1 > l_max)
    )
    if outside.any():
        raise ValueError(
            f"extension spans lo {host_lo.tolist()}, hi {host_hi.tolist()} lie outside the capture "
            f"(off {host_off.tolist()}, T {t_cap}) or the tokens ({l_max})"
        )
    over = np.flatnonzero(host_write & (host_lo > kv.capacity))
    if over.size:
        bad = int(host_lo[over[0]])
        raise CacheRefusal(f"MTP draft KV truncate to {bad} failed: set_len({bad}) exceeds "
                           f"current capacity {kv.capacity} (first cached 0)")


def write_draft_keys(block, kv: RaggedKv, hidden: torch.Tensor, tokens,
                     host_off: np.ndarray, host_lo: np.ndarray, host_n: np.ndarray,
                     host_idx: np.ndarray, host_cap: np.ndarray, riders=()) -> list:
    """One fuse + key projection over `[R, max(n)]` and one scatter of the written pairs: row
    r's key for the pair `(hidden[host_cap[r], lo_r - off_r + j], tokens[r, lo_r + 1 + j])` lands at
    cache row `host_idx[r]`, column `lo_r + j`, for `j < n_r` only (K and V alike: the K is
    token-local, so no attention runs). Every index is computed on the host and uploaded in
    one transfer (host `tokens` are gathered there too); no index has a data-dependent size
    on the device. Lengths are not touched. `riders` (host int64 vectors) travel in the same
    transfer; their device copies are returned. No refusals of its own."""
    r_n, t_cap = host_lo.size, hidden.shape[1]
    width = int(host_n.max())
    j = np.arange(width, dtype=np.int64)[None, :]
    valid = j < host_n[:, None]                                                    # [R, width]
    pos = np.where(valid, host_lo[:, None] + j, 0)
    cols = np.clip(host_lo[:, None] + 1 + j, 0, tokens.shape[1] - 1)
    host_tok = not isinstance(tokens, torch.Tensor)
    flat = np.flatnonzero(valid)
    src, pos_d, flat_d, rr, cc, tok, *carried = upload_ints(kv.k, *(x.reshape(-1) for x in (
        host_cap[:, None] * t_cap + np.clip((host_lo - host_off)[:, None] + j, 0, t_cap - 1),
        pos, flat,
        np.repeat(host_idx, host_n), pos.reshape(-1)[flat],
        tokens[np.arange(r_n)[:, None], cols] if host_tok else cols)), *riders)
    h = hidden.reshape(-1, hidden.shape[2]).index_select(0, src).view(r_n, width, -1)
    tok = tok.view(r_n, width)
    nxt = tok if host_tok else on_device_of(tokens, kv.k).long().gather(1, tok)
    fused = block.fuse(h.to(block.dtype), nxt)  # the committed tokens: checked by the caller
    layer, cfg = block.layer, block.cfg
    top = int((host_lo + np.maximum(host_n - 1, 0)).max())
    cos, sin = layer.ropes.get(layer.theta, top + 1).lookup(pos_d.view(r_n, width), top)
    k = rotate(  # [R, width, Hk, hd]
        layer.key(fused).transpose(1, 2), cos[:, :, None], sin[:, :, None], cfg.rope_dims
    ).flatten(0, 1)[flat_d]
    kv.k[rr, :, cc] = k.to(kv.k.dtype)  # [V, Hk, hd] at (row, every head, column)
    kv.v[rr, :, cc] = k.to(kv.v.dtype)
    return carried


__all__ = [
    "argmax_tokens",
    "draft_chain_stats",
    "extend_draft_kv_rows",
    "propose_chain_batched",
]
