"""The torch backend's draft-group loop and draft-KV extension on the pooled draft KV.

`draft_group_loop` is `reference.draft.group_drafting_loop` on rows of one
`gpu.draft_store.DraftStore`: membership is the reference's `draft_group_members` and the
ragged alignment's refusals its `reference.align.draft_group_target` (both integer-only, the
same functions the reference's loop calls); the reference's batch / set_len / split / strip
become host metadata (decided before any tensor changes) plus the rows' lengths set to their
chain starts; the chain is one `gpu.draft.propose_chain_batched` per group on the pool
rows, every group's chain vectors go up in one transfer before the first chain
(`_stage_chains`), and every group's tokens come back in one read. `extend_draft_kvs` is
`extend_draft_kv_row` for a whole batch: the checks and metadata per row on host integers
(the span is the reference's `extension_span`), then one `gpu.draft.extend_draft_kv_rows`
whose transfer carries the new seeds' indices, and one gather of the seeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from raggedspec.gpu._common import upload_ints
from raggedspec.gpu.draft import extend_draft_kv_rows, propose_chain_batched
from raggedspec.gpu.draft_store import PoolKv
from raggedspec.reference import dispatch
from raggedspec.reference.align import NORMAL, draft_caches_batchable, draft_group_target
from raggedspec.reference.cache import chain_capacity, set_len_refusal
from raggedspec.reference.draft import (
    EXTEND_MISALIGNED,
    draft_group_members,
    extension_span,
    warn,
)
from raggedspec.reference.errors import AlignRefusal, CacheRefusal, Refusal, StepRefusal, require


def draft_group_loop(
    be,
    model,
    groups: dict,
    states: list,
    toks: list,
    cache_lens: list[int],
    budgets: list[int],
    w: int,
    per_seq_advance: bool,
    warnings: list | None = None,
) -> list[list[int]]:
    """`group_drafting_loop` (same membership, warnings, refusals and order) on the pooled
    draft KV: a group is the row-index vector of its members' `PoolKv` rows. The
    reference's batch / front-align / set_len / split / strip become host metadata
    (the same capacity arithmetic and refusals, decided before any tensor changes) plus
    one `index_copy` of the rows' lengths to their chain starts; the chain is one
    `propose_chain_batched` on the pool rows (one batched MTP step per chain step)."""
    b = len(states)
    require(
        len(toks) == b and len(cache_lens) == b and len(budgets) == b,
        f"states ({b}), toks ({len(toks)}), cache_lens ({len(cache_lens)}) and budgets "
        f"({len(budgets)}) must have one entry per row",
    )
    drafts: list[list[int]] = [[] for _ in range(b)]
    warned_empty = False
    pending = []  # (members, chain tokens on the device) per drafted group
    staged = _stage_chains(model, groups, states, toks, cache_lens, budgets, w,
                           per_seq_advance)
    for key, rows in groups.items():  # groups: at most w of them (one per uncached count)
        members, starts = draft_group_members(rows, states, cache_lens, budgets, key[0])
        if not members:
            if model.mtp is not None and not warned_empty:
                warn(warnings, "no row", key=key)
                warned_empty = True
            continue
        group = _Group(key, w - key[0], members, starts, staged.get(key))
        chains = _draft_one_group(be, model, group, states, toks, per_seq_advance, warnings)
        if chains is None:
            continue
        if model.mtp is None:  # the heads' chain: host tokens already
            for slot, i in enumerate(members):
                drafts[i] = chains[slot]
            continue
        pending.append((members, chains))
    _read_chains(pending, drafts)
    return drafts


@dataclass
class _Group:
    """One draft group: its key, chain length, members (row indices) and chain starts."""

    key: tuple
    n_draft: int
    members: list
    starts: list
    staged: tuple | None = None


def _stage_chains(model, groups, states, toks, cache_lens, budgets, w, per_seq_advance):
    """Every group's chain vectors (`propose_chain_batched`'s last tokens, pool rows, ragged
    starts and the pool's lengths on entry) predicted on the host before the first chain,
    as if each group drafts, and uploaded in one transfer: `{key: (host, device)}`. A chain
    uses its group's only where they equal its own (a skipped group changes the lengths
    the next one sees). Empty with fewer than two such groups or without host lengths."""
    try:
        host = _predict_chains(model, groups, states, toks, cache_lens, budgets, w,
                               per_seq_advance)
    except (ValueError, IndexError):  # the chain itself refuses it, in its own order
        return {}
    if len(host) < 2:
        return {}
    dev = iter(upload_ints(model.embed, *(v for vs in host.values() for v in vs)))
    return {key: (vs, [next(dev) for _ in vs]) for key, vs in host.items()}


def _predict_chains(model, groups, states, toks, cache_lens, budgets, w, per_seq_advance):
    """`_stage_chains`'s host vectors per group key (empty where a group's pool differs
    or the pool's lengths are not on the host); the rules' ValueErrors propagate."""
    lens, store, host = None, None, {}
    for key, rows in groups.items() if model.mtp is not None else ():
        members, starts = draft_group_members(rows, states, cache_lens, budgets, key[0])
        caches = [states[i].cache for i in members]
        n = w - key[0]
        if not members or n <= 0 or not all(isinstance(c, PoolKv) for c in caches):
            continue
        store = caches[0].store if store is None else store
        lens = store.kv.known_host_lens() if lens is None else lens
        if lens is None or any(c.store is not store for c in caches):
            return {}
        idx = np.fromiter((c.idx for c in caches), np.int64, len(caches))
        aligned = dispatch.resolve_draft_leads(per_seq_advance, starts) is not None
        lens = lens.copy()
        lens[idx] = starts if aligned else starts[0]
        ragged = dispatch.resolve_ragged_chain_starts(starts)
        host[key] = [np.fromiter((int(toks[i][-1]) for i in members), np.int64, len(members)),
                     idx, None if ragged is None else np.asarray(ragged, np.int64), lens]
        lens = lens.copy()
        lens[idx] += n
    return host


def _read_chains(pending: list, drafts: list) -> None:
    """Every drafted group's chain tokens in one device read, into `drafts` by row."""
    if not pending:
        return
    flat = torch.cat([c.reshape(-1) for _, c in pending]).tolist()
    at = 0
    for members, c in pending:
        n = c.shape[1]
        for i in members:
            drafts[i] = flat[at : at + n]
            at += n


def _draft_one_group(be, model, group: _Group, states, toks, per_seq_advance, warnings):
    """One group's chain: the heads' host chains (no MTP block), None when the group is
    skipped (warned), else its chain tokens on the device with the rows' draft-KV metadata
    written back (host integers, no tensor)."""
    members, starts, n_draft, key = group.members, group.starts, group.n_draft, group.key
    seed_hidden = torch.stack([states[i].seed[1] for i in members])  # per-sequence records
    lasts = [int(toks[i][-1]) for i in members]
    g = len(members)
    if model.mtp is None:
        return be.propose_chain(model, seed_hidden, lasts, n_draft, starts, None)
    caches = [states[i].cache for i in members]
    if any(c is None for c in caches):
        warn(warnings, "no cache", key=key)
        return None
    require(
        all(isinstance(c, PoolKv) and c.store is caches[0].store for c in caches),
        "draft KV caches must be rows of one DraftStore (the backend's new_draft_cache)",
    )
    leads = dispatch.resolve_draft_leads(per_seq_advance, starts)
    aligned = leads is not None
    leads = leads if aligned else [0] * g
    plan = _draft_group_plan(caches, starts, aligned, n_draft, key, warnings)
    if plan is None:
        return None
    entry, cap = plan
    chains = _run_chain(model, caches, seed_hidden, lasts, n_draft, starts, aligned, entry,
                        group.staged)
    for slot, i in enumerate(members):  # host write-back: per-state metadata, no tensor
        c = caches[slot]
        c.materialized = True
        c.capacity = cap - leads[slot]  # split (batched metadata) + strip of the row's lead
        c.current = starts[slot] + n_draft  # == store.kv.lens[c.idx]
        states[i].filled = starts[slot] + 1
    return chains


def _run_chain(model, caches, seed_hidden, lasts, n_draft, starts, aligned, entry,
               staged=None):
    """The chain on the pool rows: their lengths set to the chain starts (each row its own
    start when aligned, else the batched `set_len(starts[0])`; ragged starts there refuse
    "desync" in the chain), then `propose_chain_batched`; a refusal leaves the rows as they
    were (the reference refused on a batched copy). `staged`: `_stage_chains`'s vectors."""
    store = caches[0].store
    idx = np.fromiter((c.idx for c in caches), np.int64, len(caches))
    store.reserve(max(max(starts), entry) + n_draft)
    before = store.kv.host_lens()
    aligned_lens = before.copy()
    aligned_lens[idx] = starts if aligned else entry
    store.kv.lens = aligned_lens
    try:
        return propose_chain_batched(model, seed_hidden, lasts, n_draft, starts, store.kv,
                                     rows=idx, staged=staged)
    except Refusal:
        store.kv.lens = before
        raise


def _draft_group_plan(caches, starts, aligned, n, key, warnings):
    """The reference's group alignment on host metadata: the batched slot's length on
    entry to the chain and its capacity after it, or None (warned) when the reference
    skips the group. Uniform (no leads): `draft_caches_batchable` then `set_len(starts[0])`'s
    `set_len_refusal`. Ragged: `draft_group_target`'s AlignRefusals, length and capacity
    `T = max(starts)`. Then the chain's n one-column appends (`chain_capacity`, CacheRefusal
    propagates, as the reference's `propose_chain`)."""
    g = len(caches)
    if not aligned:
        first = caches[0]
        if not draft_caches_batchable([NORMAL] * g, [c.materialized for c in caches],
                                      [(c.current, c.capacity) for c in caches]):
            warn(warnings, "unbatchable", key=key)
            return None
        refusal = set_len_refusal(starts[0], 0, first.capacity)
        if refusal is not None:
            warn(warnings, "set_len", key=key, start=starts[0], exc=refusal)
            return None
        entry, cap = starts[0], first.capacity
    else:
        try:  # pool rows are Normal slots
            entry = cap = draft_group_target([NORMAL] * g, [c.materialized for c in caches],
                                             [c.current for c in caches], starts)
        except AlignRefusal as exc:
            warn(warnings, "front-align", key=key, exc=exc)
            return None
    return entry, chain_capacity(cap, entry, n, caches[0].max_seq_len)


def extend_draft_kvs(
    be,
    states,
    capture,
    toks,
    batch,
    model,
    warnings=None,
    why=EXTEND_MISALIGNED,
):
    """`extend_draft_kv_row` for every row: checks 1-13 and the metadata (capacity,
    refusals, filled, poisoning, warnings in row order) on host integers, then the
    tensor side for the whole batch at once: one gather of the new seeds, one
    `index_copy` of the truncated lengths, and one `gpu.draft.extend_draft_kv_rows`
    (one fuse + key projection, one masked scatter into the pool rows; the MTP layer's
    K is token-local, so the reference's discarded attention output is not computed)."""
    block = None if capture is None else model.mtp
    offsets, hidden, batch_fail = _capture_of(be, capture, block, batch)
    q = _Queued()
    for row in range(batch):  # host: per-state integer checks and metadata, no tensor touched
        state = states[row]
        if state is None:
            continue
        ok, err = _extend_row(state, block, batch_fail, offsets, toks[row], row, hidden, q)
        if err is not None:
            state.poisoned = True
            warn(warnings, "extension", row=row, exc=err)
        elif not ok:
            state.poisoned = True
            warn(warnings, "misaligned", row=row, why=why)
    _extend_tensors(be, block, hidden, toks, q)


def _capture_of(be, capture, block, batch):
    """The capture's (offsets, hidden `[B,T,H]`, capture-wide outcome): None, an exception
    (every row poisoned with it) or False (every row misaligned)."""
    if block is None:
        return None, None, None
    offsets, hidden = capture
    hidden = be._t(hidden)
    if hidden.dim() == 2:
        hidden = hidden[None]
    if hidden.dim() != 3:
        return offsets, hidden, StepRefusal(
            f"captured hidden has rank {hidden.dim()} (shape {list(hidden.shape)}); "
            f"expected [B,T,H] or [T,H]"
        )
    if hidden.shape[0] != batch or not offsets.describes(batch):
        return offsets, hidden, False
    return offsets, hidden, None


def _extend_row(state, block, batch_fail, offsets, toks, row, hidden, q):
    """One row's checks on host integers: (ok, refusal or None); its work queued on `q`."""
    if state.poisoned:
        return False, None
    if block is None:
        return True, None
    if isinstance(batch_fail, Exception):
        return True, batch_fail
    if batch_fail is False:
        return False, None
    try:
        ok = _extend_plan(state, offsets, toks, row, hidden.shape[1], q)
    except Refusal as exc:
        return True, exc
    finally:
        if isinstance(state.cache, PoolKv):
            q.store = state.cache.store
    return ok, None


def _extend_tensors(be, block, hidden, toks, q) -> None:
    """The queued tensor work: the truncated lengths, one `extend_draft_kv_rows` (reading the
    written rows of the capture itself) whose transfer carries the new seeds' indices, then
    one gather of the new seeds (one view per row by one `unbind`). The seeds are set even
    when the extension refuses (their indices then uploaded on their own), as before it."""
    seeds = None
    if q.seed_rows:
        seeds = [np.asarray(x, dtype=np.int64) for x in (q.seed_rows, q.seed_cols)]
    carried = None
    try:
        carried = _extend_writes(block, hidden, toks, q, seeds or ())
    finally:
        if seeds is not None:
            seed_rows, seed_cols = carried or upload_ints(hidden, *seeds)
            got = hidden[seed_rows, seed_cols].unbind(0)  # one view op
            for (state, p), seed in zip(q.seed_states, got, strict=True):  # host records
                state.seed = (p, seed)


def _extend_writes(block, hidden, toks, q, riders):
    """The truncated lengths and the pairs' write; the `riders`' device copies (None when
    nothing was written)."""
    store = q.store
    if q.trunc_idx:  # the reference's set_len(filled): lengths only
        held = store.kv.host_lens().copy()
        held[np.asarray(q.trunc_idx, dtype=np.int64)] = q.trunc_len
        store.kv.lens = held
    if not q.w_rows:
        return None
    store.reserve(max(q.w_hi))
    tok = np.zeros((len(q.w_rows), max(q.w_hi) + 1), dtype=np.int64)
    for r, (row, lo, hi) in enumerate(zip(q.w_rows, q.w_lo, q.w_hi, strict=True)):
        tok[r, lo + 1 : hi + 1] = toks[row][lo + 1 : hi + 1]  # host packing of the tokens
    return extend_draft_kv_rows(block, store.kv, hidden, q.w_off, q.w_lo, q.w_hi, tok,
                                rows=q.w_idx, hidden_rows=q.w_rows, riders=riders)


@dataclass
class _Queued:
    """The batch's tensor work, queued per row on the host: the new seeds (capture row,
    column, the state and its position), the truncated pool rows and their lengths, and the
    rows to write (capture row, pool row, capture offset, span `(lo, hi]`)."""

    seed_rows: list = field(default_factory=list)
    seed_cols: list = field(default_factory=list)
    seed_states: list = field(default_factory=list)
    trunc_idx: list = field(default_factory=list)
    trunc_len: list = field(default_factory=list)
    w_rows: list = field(default_factory=list)
    w_idx: list = field(default_factory=list)
    w_off: list = field(default_factory=list)
    w_lo: list = field(default_factory=list)
    w_hi: list = field(default_factory=list)
    store: object = None


def _extend_plan(state, offsets, toks, row: int, t: int, q: _Queued) -> bool:
    """`extend_draft_kv_row`'s checks 7-13 for one row on host integers (7-10 are the
    reference's `extension_span`): False where the reference returns False; a CacheRefusal
    as the reference's; otherwise the row's metadata updated and its tensor work queued
    (seed, truncation, write)."""
    off = offsets.row(row)
    span = extension_span(off, state.filled, t, toks)
    if span is None:
        return False
    lo, hi, p = span
    if p is not None:
        q.seed_rows.append(row)
        q.seed_cols.append(p - off)
        q.seed_states.append((state, p))
    if hi <= lo:
        return True
    cache = state.cache
    if cache is None:
        state.filled = hi
        return True
    try:
        cache.try_set_len(state.filled)
    except Refusal as exc:
        raise CacheRefusal(f"MTP draft KV truncate to {state.filled} failed: {exc}") from exc
    cache.current = state.filled  # lo == filled == current: forward_tokens' desync check holds
    if cache.materialized:
        q.trunc_idx.append(cache.idx)
        q.trunc_len.append(state.filled)
    cache.grow_meta(hi - lo)  # refuses (CacheRefusal) before it changes anything
    cache.materialized = True
    cache.current = hi
    state.filled = hi
    q.w_rows.append(row)
    q.w_idx.append(cache.idx)
    q.w_off.append(off)
    q.w_lo.append(lo)
    q.w_hi.append(hi)
    return True
