"""Draft KV and the MTP draft chain: the per-sequence `DraftKv` state and its LRU map,
`extend_draft_kv_row` / `extend_draft_cache`, prompt-time priming, the batched chain
`propose_chain_batched` (scalar and per-row positions), the single-sequence `propose_chain`,
and the group drafting loop of `step`.

Spec: cache-and-draft.md §1 (draft KV, filled, seed, poisoned, chain start), §7, §9.3,
§10.2, §16 (the PerSequence example's draft side), §17.2.

The model is duck-typed (a `reference.model.TinyModel`): `model.mtp` is the `MtpBlock` or
None (Tier A), `model.mtp_heads`, `model.embed`, `model.lm_head`. This module does not import
`reference.model` (which re-exports it).

Draft-KV invariant: slot k holds the MTP state of `(h_k, tok_{k+1})` at **absolute**
position k, and slots `0..filled` are committed (each written pair has `tok_{k+1}`
committed). A chain may start at `chain_start = L - 2` only if the seed sits there and
`filled >= chain_start`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from raggedspec.reference.align import (
    batch_draft_caches,
    drop_dead_prefix,
    front_align_draft_group,
    split_draft_cache,
)
from raggedspec.reference.cache import KvCache
from raggedspec.reference.dispatch import (
    chain_start_of,
    resolve_draft_leads,
    resolve_ragged_chain_starts,
)
from raggedspec.reference.errors import CacheRefusal, Refusal, StepRefusal, require

MAX_DRAFT_KV_SEQS = 64


EXTEND_MISALIGNED = "capture misaligned with the draft KV"
PRIME_MISALIGNED = (
    "prefix-cache hit / chunked prefill: the prompt capture does not start at the draft KV's end"
)
WARNINGS = {
    "no row": "draft group {key}: no row can draft (no seed at its chain start)",
    "no cache": "draft group {key}: a member has no draft KV cache; group skipped",
    "unbatchable": "draft group {key}: draft caches cannot be batched; group skipped",
    "set_len": "draft group {key}: set_len({start}) refused ({exc}); group skipped",
    "front-align": "draft group {key}: front-alignment refused ({exc}); group skipped",
    "split": "draft group {key}: the batched draft cache did not split into {g}; no drafts",
    "strip": "row {row}: stripping the draft dead prefix failed ({exc}); draft KV poisoned",
    "extension": "row {row}: draft KV extension failed ({exc}); draft KV poisoned",
    "misaligned": "row {row}: {why}; draft KV poisoned",
}
"""The drafting loop's warnings, one text each; the reference's loops and a port's use them."""


def warn(warnings: list[str] | None, which: str, **values) -> None:
    """Append `WARNINGS[which]` filled with `values` to `warnings` (nothing when None)."""
    if warnings is not None:
        warnings.append(WARNINGS[which].format(**values))


def argmax_token(logits: np.ndarray) -> int:
    """The greedy token of one logits row: the index of the maximum (the first on a tie).
    `[0.1, 0.9, 0.2, 0.5] -> 1`. ValueError on an empty or non-1-D row."""
    logits = np.asarray(logits)
    require(
        logits.ndim == 1 and logits.size > 0, f"logits shape {logits.shape} must be [V], V >= 1"
    )
    return int(np.argmax(logits))


# --- §7.1 DraftKv and the map ------------------------------------------------------------------


@dataclass
class DraftKv:
    """One sequence's draft state (§7.1): `cache` (None on the Tier-A heads-only path),
    `filled` (committed slots `0..filled`), `poisoned` (never drafts again: lossless,
    plain-speed decode), `seed = (p, h_p)` (the target's pre-norm hidden at `p = L - 2` from
    the last capture), `last_used` (the map's LRU stamp)."""

    cache: KvCache | None
    filled: int = 0
    poisoned: bool = False
    seed: tuple[int, np.ndarray] | None = None
    last_used: int = 0


class DraftKvMap:
    """The pipeline's map `seq id -> DraftKv` (§7.1).

    Invariant: after every `checkin` it holds at most `MAX_DRAFT_KV_SEQS = 64` entries, the
    evicted ones being the least recently checked in. The "monotonic clock" is a counter
    incremented by every checkin (chosen: deterministic, strictly increasing). Refuses
    nothing. `block` is the MTP block (None for Tier A, whose states get no cache).
    """

    def __init__(self, block=None) -> None:
        self.block = block
        self.entries: dict[object, DraftKv] = {}
        self._clock = 0

    def checkout_draft_kv(self, seq_id) -> DraftKv | None:
        """Remove and return the entry of `seq_id`, or a fresh `{new_draft_cache(), filled 0,
        poisoned false, seed None}` (cache None without a block). Never None here: the
        reference's block can always make a cache (the spec's None case is unreachable)."""
        if seq_id in self.entries:
            return self.entries.pop(seq_id)
        cache = None if self.block is None else self.block.new_draft_cache()
        return DraftKv(cache=cache)

    def checkin(self, seq_id, state: DraftKv) -> None:
        """Stamp `last_used`, reinsert, and evict LRU entries while `len > 64`."""
        self._clock += 1
        state.last_used = self._clock
        self.entries[seq_id] = state
        while len(self.entries) > MAX_DRAFT_KV_SEQS:
            oldest = min(self.entries, key=lambda k: self.entries[k].last_used)
            del self.entries[oldest]

    def drop_draft_kv(
        self, seq_id, flush: Callable[[object], None] | None = None
    ) -> DraftKv | None:
        """Remove the entry of `seq_id` (returned, None if absent) and flush that request's
        acceptance line through `flush(seq_id)` when given (the telemetry lives elsewhere)."""
        state = self.entries.pop(seq_id, None)
        if flush is not None:
            flush(seq_id)
        return state

    def clear_draft_kv(self) -> None:
        """Empty the **whole** map, not just this batch (`Reset` pre-op, window deferral)."""
        self.entries.clear()


# --- §7.2 extend_draft_kv_row, extend_draft_cache ---------------------------------------------


def extend_draft_cache(block, cache: KvCache | None, h: np.ndarray, next_tokens, start: int) -> int:
    """Write the pairs `(h[j], next[j])` into draft-KV slots `start + j` and return the new
    end `start + n` (§7.2).

    No block -> the cache's current length (0 without a cache); `n = len(next) == 0` ->
    `start`, nothing run. Else `fused = h_proj(hnorm(h)) + e_proj(enorm(embed(next)))` and
    `block.forward_tokens(fused, start, cache, next)`, which refuses ("desync") unless the
    cache holds exactly `start` entries. ValueError when `h` is not `[n, H]`.
    """
    if block is None:
        return 0 if cache is None else cache.current_seq_len
    nxt = np.asarray(next_tokens, dtype=np.int64).reshape(-1)
    n = nxt.shape[0]
    if n == 0:
        return start
    h = np.asarray(h, dtype=np.float64)
    require(
        h.ndim == 2 and h.shape[0] == n, f"hidden {h.shape} must be [{n}, H] for {n} next tokens"
    )
    fused = block.fuse(h[None], nxt[None])
    block.forward_tokens(fused, start, cache, nxt[None])
    return start + n


def extension_span(off: int | None, filled: int, t: int,
                   toks: Sequence[int]) -> tuple[int, int, int | None] | None:
    """Checks 7-10 of `extend_draft_kv_row` on host integers (§7.2), for the reference and the
    port alike: the row's capture offset `off` (None: not described), its `filled`, the
    capture width `t` and the committed tokens (only `L = len(toks)` is read, and only past
    the misalignment checks). None when the row is misaligned (no
    offset, or `off > filled`: not contiguous); else `(lo, hi, seed)` with
    `lo = max(filled, off)`, `hi = min(off + t, sat(L - 1))` (`hi <= lo`: nothing to write)
    and `seed = p = L - 2` when `L >= 2` and `off <= p < off + t`, else None (the old seed
    stays). Invariant: `hi <= L - 1`, so only pairs `(h_i, tok_{i+1})` with `i <= L - 2`
    are written. Refuses nothing."""
    if off is None or off > filled:
        return None
    big_l = len(toks)
    seed = None
    if big_l >= 2:
        p = big_l - 2
        if off <= p < off + t:
            seed = p
    lo = max(filled, off)
    hi = min(off + t, max(big_l - 1, 0))
    return lo, hi, seed


def extend_draft_kv_row(
    state: DraftKv, capture, toks: Sequence[int], row: int, batch: int, model
) -> bool:
    """Extend row `row`'s draft KV from the target's capture (§7.2). Returns True (fine, or
    nothing to do) or False (misaligned: the caller poisons); raises a `Refusal` for an
    error (the caller also poisons).

    `capture` is `(offsets, hidden)` as `MtpHiddenCapture.take()` returns it (offsets has
    `row(r)` and `describes(b)`; hidden `[B,T,H]` or `[T,H]`) or None; `toks` are the
    committed tokens **after** this step's commit, `L = len(toks)`. Checks in order:
    1 poisoned -> False; 2 no capture -> True; 3 no MTP block (Tier A) -> True, before the
    seed stash; 4 rank 2 -> `[1,T,H]`, rank 3 kept, other ranks -> StepRefusal; 5
    `dim0 != batch` or `row >= batch` -> False; 6 `!offsets.describes(batch)` -> False; 7
    `off = offsets.row(row)`, None -> False, `hidden := hidden[row]`; 8 `off > filled` ->
    False (not contiguous); 9 seed `(p, hidden[p - off])` with `p = L - 2` when `L >= 2` and
    `off <= p < off + T` (else the old seed stays); 10 `lo = max(filled, off)`,
    `hi = min(off + T, sat(L - 1))`, `hi <= lo` -> True without writing; 11 no cache (the
    unreachable Tier-A branch) -> `filled = hi`, True; 12 `set_len(filled)` (CacheRefusal
    "MTP draft KV truncate to {filled} failed"); 13 write hidden rows `[lo-off, hi-off)`
    with next tokens `toks[lo+1 .. hi+1]` at position lo, `filled = hi`, True.
    Invariant: only pairs `(h_i, tok_{i+1})` with `i <= L - 2` are written, so a rejected
    draft's hidden never reaches the draft KV.
    """
    if state.poisoned:
        return False
    if capture is None:
        return True
    block = getattr(model, "mtp", None)
    if block is None:
        return True
    offsets, hidden = capture
    hidden = captured_hidden(hidden)
    if hidden.shape[0] != batch or row >= batch:
        return False
    if not offsets.describes(batch):
        return False
    off = offsets.row(row)
    span = extension_span(off, state.filled, hidden.shape[1], toks)
    if span is None:
        return False
    lo, hi, p = span
    hidden = hidden[row]
    if p is not None:
        state.seed = (p, hidden[p - off].copy())
    if hi > lo:
        write_draft_span(state, block, hidden[lo - off: hi - off], toks, lo, hi)
    return True


def captured_hidden(hidden) -> np.ndarray:
    """The capture's hidden as float64 `[B,T,H]`: a rank-2 `[T,H]` becomes `[1,T,H]` (check 4
    of `extend_draft_kv_row`). Refuses (StepRefusal) any other rank."""
    hidden = np.asarray(hidden, dtype=np.float64)
    if hidden.ndim == 2:
        return hidden[None]
    if hidden.ndim != 3:
        raise StepRefusal(f"captured hidden has rank {hidden.ndim} (shape {list(hidden.shape)}); "
                          f"expected [B,T,H] or [T,H]")
    return hidden


def write_draft_span(state: DraftKv, block, hidden: np.ndarray, toks: Sequence[int], lo: int,
                     hi: int) -> None:
    """Checks 11-13 of `extend_draft_kv_row`: write the pairs `(hidden[j], toks[lo + 1 + j])`
    at draft-KV slots `lo..hi` and set `filled = hi`; without a cache (the unreachable Tier-A
    branch) only `filled = hi`. `hidden` holds the capture rows of slots `lo..hi`. Refuses
    (CacheRefusal "MTP draft KV truncate to {filled} failed") when the cache cannot be cut
    back to `filled`; the block's own refusals propagate."""
    if state.cache is None:
        state.filled = hi
        return
    try:
        state.cache.set_len(state.filled)
    except Refusal as exc:
        raise CacheRefusal(f"MTP draft KV truncate to {state.filled} failed: {exc}") from exc
    nxt = [int(x) for x in toks[lo + 1: hi + 1]]
    state.filled = extend_draft_cache(block, state.cache, hidden, nxt, lo)


def extend_draft_kvs(
    states: Sequence[DraftKv | None],
    capture,
    toks: Sequence[Sequence[int]],
    batch: int,
    model,
    warnings: list[str] | None = None,
    why: str = EXTEND_MISALIGNED,
) -> None:
    """`step` §16 step 10 (and the priming loop): `extend_draft_kv_row` for every row with a
    state; `False` or a `Refusal` poisons that row and appends a warning naming the row.
    Other rows are unaffected."""
    for row in range(batch):
        state = states[row]
        if state is None:
            continue
        try:
            ok = extend_draft_kv_row(state, capture, toks[row], row, batch, model)
        except Refusal as exc:
            state.poisoned = True
            warn(warnings, "extension", row=row, exc=exc)
            continue
        if not ok:
            state.poisoned = True
            warn(warnings, "misaligned", row=row, why=why)


def prime_draft_kv(
    states: Sequence[DraftKv | None],
    capture,
    toks: Sequence[Sequence[int]],
    batch: int,
    model,
    warnings: list[str] | None = None,
) -> None:
    """Prompt-time priming (§7.4): after the prompt forward, take the capture once and extend
    every row. On a fresh state with prompt offsets `[0]` (and `toks` = prompt ++ the sampled
    token, `L` tokens) this gives `filled = L - 1` and `seed = (L - 2, h_{L-2})`: the next
    decode step has `C = L - 1`, `u = 1`, so its chain start `C + u - 2 = L - 2` is the seed.
    A prefix-cache hit (`off > 0 = filled`) returns False and poisons that sequence for good,
    warning "prefix-cache hit / chunked prefill"."""
    extend_draft_kvs(
        states,
        capture,
        toks,
        batch,
        model,
        warnings,
        why=PRIME_MISALIGNED,
    )


# --- §10.2 the chain ------------------------------------------------------------------------------


def propose_chain_batched(
    model,
    seed_hidden: np.ndarray,
    last_tokens,
    n: int,
    chain_starts: Sequence[int],
    cache: KvCache | None,
    trace: list | None = None,
) -> list[list[int]]:
    """Draft `n` greedy tokens for each of G rows in one batched MTP forward per step (§10.2).

    `n == 0` or `G == 0` -> G empty chains. Refuses (StepRefusal) `len(chain_starts) != G`
    ("chain start(s) for a draft group of") and a block without a cache ("draft KV").
    `ragged = resolve_ragged_chain_starts(chain_starts)`, `start_pos = chain_starts[0]`.
    Step i: `fused = h_proj(hnorm(prev)) + e_proj(enorm(embed(toks)))`; scalar
    (`ragged` None): `forward_step(fused, start_pos + i)`; ragged:
    `forward_step_rows(fused, [start_r + i])`; `logits = lm_head(norm_out(hidden))`, row-wise
    argmax -> `next`; then `toks := next`, `prev := hidden` (the **pre-norm** output).
    Tier A (no block): `fused = h_proj(prev) + e_proj(embed(tok))`, `logits = lm_head(fused)`,
    no position, no cache; unspecified, chosen: `prev := fused`.
    Invariant: on entry the cache holds `max(chain_starts)` entries (else "desync"), after
    step i `max + i + 1`; a uniform group never takes the per-row path. `trace`, when given,
    receives each step's hidden `[G,H]` (a copy). Errors propagate.
    """
    seed_hidden = np.asarray(seed_hidden, dtype=np.float64)
    require(seed_hidden.ndim == 2, f"seed_hidden {seed_hidden.shape} must be [G,H]")
    require(n >= 0, f"chain length {n} must be >= 0")
    g = seed_hidden.shape[0]
    if n == 0 or g == 0:
        return [[] for _ in range(g)]
    starts = [int(s) for s in chain_starts]
    if len(starts) != g:
        raise StepRefusal(f"{len(starts)} chain start(s) for a draft group of {g} row(s): {starts}")
    block = model.mtp
    if block is not None and cache is None:
        raise StepRefusal(
            f"the MTP block cannot draft without a draft KV cache (group of {g}, starts {starts})"
        )
    toks = np.asarray(last_tokens, dtype=np.int64).reshape(-1)
    require(toks.shape == (g,), f"{toks.shape[0]} last tokens for a draft group of {g}")
    ragged = resolve_ragged_chain_starts(starts)
    chains: list[list[int]] = [[] for _ in range(g)]
    prev = seed_hidden
    for i in range(n):
        hidden, logits = chain_step(model, prev, toks, starts[0], ragged, i, cache)
        nxt = np.array([argmax_token(row) for row in logits], dtype=np.int64)
        for r in range(g):
            chains[r].append(int(nxt[r]))
        if trace is not None:
            trace.append(hidden.copy())
        toks, prev = nxt, hidden
    return chains


def chain_step(model, prev: np.ndarray, toks: np.ndarray, start_pos: int,
               ragged: Sequence[int] | None, i: int,
               cache: KvCache | None) -> tuple[np.ndarray, np.ndarray]:
    """Step `i` of `propose_chain_batched` (§10.2): `(hidden [G,H], logits [G,V])` from the
    previous hidden `prev [G,H]` and tokens `toks [G]`. With a block: `fused = h_proj(hnorm(prev))
    + e_proj(enorm(embed(toks)))` at position `start_pos + i` (`ragged` None) or at each row's
    `start_r + i`, `logits = lm_head(norm_out(hidden))`. Tier A (no block): `hidden = h_proj(prev)
    + e_proj(embed(toks))`, `logits = lm_head(hidden)`, no position, no cache. The block's
    refusals ("desync") propagate."""
    block = model.mtp
    if block is None:
        heads = model.mtp_heads
        hidden = prev @ heads.h_proj + model.embed[toks] @ heads.e_proj
        return hidden, hidden @ model.lm_head
    fused = block.fuse(prev[:, None, :], toks[:, None])
    if ragged is None:
        hidden = block.forward_step(fused, start_pos + i, cache)[:, 0]
    else:
        hidden = block.forward_step_rows(fused, [s + i for s in ragged], cache)[:, 0]
    return hidden, block.logits(hidden)


def propose_chain(model, h: np.ndarray, tok: int, depth: int, max_tokens: int, start: int,
                  cache: KvCache | None) -> list[int]:
    """Single-sequence chain (§10.2): `n = min(depth, max_tokens)` steps at `start + i`.
    Refused (StepRefusal, "draft KV") with a block but no cache, whatever n. Not used by the
    fused path."""
    require(
        depth >= 0 and max_tokens >= 0, f"depth {depth} and max_tokens {max_tokens} must be >= 0"
    )
    if model.mtp is not None and cache is None:
        raise StepRefusal(f"the MTP block cannot draft without a draft KV cache (start {start})")
    h = np.asarray(h, dtype=np.float64).reshape(1, -1)
    return propose_chain_batched(model, h, [tok], min(depth, max_tokens), [start], cache)[0]


# --- §9.3 the group drafting loop -----------------------------------------------------------------


def draft_group_members(rows: Sequence[int], states: Sequence, cache_lens: Sequence[int],
                        budgets: Sequence[int], u: int) -> tuple[list[int], list[int]]:
    """Which rows of a draft group `(u, _)` draft (§9.3), on host integers only: the members
    in row order and their chain starts `chain_start_of(cache_lens[i], u)`. A row is left
    out when its budget is 0, it has no state, is poisoned or has no seed, its seed is not at
    its chain start, or `filled < chain_start`. A state is anything with `poisoned`, `seed`
    (`(position, hidden)` or None) and `filled`: the reference's `DraftKv` and the port's
    draft states alike; the seed's hidden is not read. Refuses nothing."""
    members: list[int] = []
    starts: list[int] = []
    for i in rows:
        state = states[i]
        if budgets[i] == 0 or state is None or state.poisoned or state.seed is None:
            continue
        start = chain_start_of(int(cache_lens[i]), u)
        if state.seed[0] != start or state.filled < start:
            continue
        members.append(i)
        starts.append(start)
    return members, starts


def group_drafting_loop(
    model,
    groups: dict[tuple[int, int], list[int]],
    states: Sequence[DraftKv | None],
    toks: Sequence[Sequence[int]],
    cache_lens: Sequence[int],
    budgets: Sequence[int],
    w: int,
    per_seq_advance: bool,
    warnings: list[str] | None = None,
) -> list[list[int]]:
    """The drafting part of `step` (§9.3): one batched chain per draft group; returns
    `drafts[i]` for every row (empty for rows that do not draft).

    Per group `(u, _)`, `n_draft = w - u`. Members: a row is skipped when its budget is 0,
    it has no state, is poisoned or has no seed, or its seed is not at
    `chain_start_of(cache_lens[i], u)`, or `filled < chain_start`; else it contributes its
    seed, `toks[i][L-1]` and its chain start. Nothing collected -> warn (at most once per
    call, only with a block) and continue. Group cache (block present; a member without a
    cache skips the group): `resolve_draft_leads(per_seq_advance, starts)` None ->
    `batch_draft_caches` (None -> warn, skip) and `set_len(starts[0])` (a refusal -> warn,
    skip); Some(leads) -> `front_align_draft_group` (a refusal -> warn, skip). The chain
    (`propose_chain_batched`) propagates its errors. Write-back: `split_draft_cache(batched,
    G)` (None -> skip the group; its rows get no drafts); per member
    `drop_dead_prefix(row_cache, lead)` **before** `filled = chain_start + 1` (only the
    chain's first entry, real context, is committed); a strip refusal warns, poisons that
    row and skips its write-back. Every collected row records its chain, even one whose
    strip failed. Invariant: after write-back each member's cache holds exactly
    `chain_start + n_draft` entries with its live run at column 0.
    """
    b = len(states)
    require(len(toks) == b and len(cache_lens) == b and len(budgets) == b,
            f"states ({b}), toks ({len(toks)}), cache_lens ({len(cache_lens)}) and budgets "
            f"({len(budgets)}) must have one entry per row")
    drafts: list[list[int]] = [[] for _ in range(b)]
    warned_empty = False
    for (u, second), rows in groups.items():
        key = (u, second)
        members, starts = draft_group_members(rows, states, cache_lens, budgets, u)
        if not members:
            if model.mtp is not None and not warned_empty:
                warn(warnings, "no row", key=key)
                warned_empty = True
            continue
        chains = draft_group(model, key, members, starts, states, toks, w - u, per_seq_advance,
                             warnings)
        if chains is None:
            continue
        for slot, i in enumerate(members):
            drafts[i] = chains[slot]
    return drafts


def draft_group(model, key: tuple[int, int], members: Sequence[int], starts: Sequence[int],
                states: Sequence[DraftKv | None], toks: Sequence[Sequence[int]], n_draft: int,
                per_seq_advance: bool, warnings: list[str] | None) -> list[list[int]] | None:
    """One draft group of `group_drafting_loop` (§9.3): the members' chains (member order), or
    None when the group drafts nothing (a member without a cache, a group cache refused, a
    batched cache that does not split back; each warns). Tier A (no block) chains without a
    cache and writes nothing back; with a block the members' caches are written back
    (`write_back_draft_group`). The chain's errors propagate."""
    seed_hidden = np.stack([states[i].seed[1] for i in members])
    lasts = [int(toks[i][-1]) for i in members]
    if model.mtp is None:
        return propose_chain_batched(model, seed_hidden, lasts, n_draft, starts, None)
    caches = [states[i].cache for i in members]
    if any(c is None for c in caches):
        warn(warnings, "no cache", key=key)
        return None
    leads = resolve_draft_leads(per_seq_advance, starts)
    batched = group_draft_cache(caches, starts, leads, key, warnings)
    if batched is None:
        return None
    chains = propose_chain_batched(model, seed_hidden, lasts, n_draft, starts, batched)
    pieces = split_draft_cache(batched, len(members))
    if pieces is None:
        warn(warnings, "split", key=key, g=len(members))
        return None
    write_back_draft_group(states, members, starts, pieces, leads, warnings)
    return chains


def group_draft_cache(caches: Sequence[KvCache], starts: Sequence[int],
                      leads: Sequence[int] | None, key: tuple[int, int],
                      warnings: list[str] | None) -> KvCache | None:
    """The group's batched draft cache (§9.3), holding `max(starts)` entries: without `leads`
    (a uniform group) `batch_draft_caches` cut to `starts[0]`, else
    `front_align_draft_group(caches, starts)`. None, with a warning, when the caches cannot be
    batched or a `set_len` / front-alignment refusal is raised (refusals are not re-raised)."""
    if leads is not None:
        try:
            return front_align_draft_group(caches, starts)
        except Refusal as exc:
            warn(warnings, "front-align", key=key, exc=exc)
            return None
    batched = batch_draft_caches(caches)
    if batched is None:
        warn(warnings, "unbatchable", key=key)
        return None
    try:
        batched.set_len(starts[0])
    except Refusal as exc:
        warn(warnings, "set_len", key=key, start=starts[0], exc=exc)
        return None
    return batched


def write_back_draft_group(states: Sequence[DraftKv | None], members: Sequence[int],
                           starts: Sequence[int], pieces: Sequence[KvCache],
                           leads: Sequence[int] | None, warnings: list[str] | None) -> None:
    """Each member takes its piece of the split group cache (§9.3): its dead prefix (`leads[slot]`,
    0 for a uniform group) dropped **before** `filled = chain_start + 1` (only the chain's first
    entry, real context, is committed). A strip refusal warns, poisons that row and leaves its
    state as it was; other rows are unaffected."""
    for slot, i in enumerate(members):
        row_cache = pieces[slot]
        try:
            drop_dead_prefix(row_cache, 0 if leads is None else leads[slot])
        except Refusal as exc:
            warn(warnings, "strip", row=i, exc=exc)
            states[i].poisoned = True
            continue
        states[i].cache = row_cache
        states[i].filled = starts[slot] + 1
