"""Front padding / stripping, batch assembly, and draft-group alignment.

Spec: cache-and-draft.md §4, §5, §9.6-§9.8; masks-and-scheduling.md §14. Rows of different
lengths share a batched cache only front-aligned (a dead prefix of zeros), and the strip
(`drop_dead_prefix`) gives each row back its OWN length. Slot kinds and the windowed-slot
refusal: docs/simulator.md, section "reference/align.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raggedspec.reference.cache import SEQ_DIM, KvCache, NormalCache, OtherSlot, SingleCache
from raggedspec.reference.errors import AlignRefusal, CacheRefusal, require
from raggedspec.reference.xs_rolling import XsRolling

NORMAL = "Normal"
XS = "XsRolling"


# --- §4.1 / §4.3: one SingleCache -------------------------------------------------------

def front_pad_refusal(live: int, target: int, materialized: bool, first_cached: int,
                      capacity: int, max_seq_len: int) -> CacheRefusal | None:
    """The refusal front-padding a slot of `live` positions to `target` raises, or None, on
    integers only (the reference's caches and the port's slots both call it): shorter than
    the live run; an unmaterialized buffer; a windowed slot (`first_cached > 0`); a capacity
    `max(capacity, target)` above `max_seq_len`. `target == live` is never refused."""
    if target < live:
        return CacheRefusal(f"front_pad to {target} is shorter than the {live} live positions")
    if target == live:
        return None
    if not materialized:
        return CacheRefusal(
            f"front_pad to {target}: the slot's buffer is unmaterialized ({live} live positions)"
        )
    if first_cached > 0:
        return CacheRefusal(
            f"front_pad to {target}: a windowed slot (first cached {first_cached}) cannot be "
            "front-padded"
        )
    cap = max(capacity, target)
    if cap > max_seq_len:
        return CacheRefusal(f"front_pad to {target}: capacity {cap} would be above max_seq_len "
                            f"{max_seq_len}")
    return None


def _front_pad_refusal(sc: SingleCache, target: int) -> CacheRefusal | None:
    """The refusal `front_pad_single(sc, target)` would raise, or None (no change made)."""
    return front_pad_refusal(sc.current_seq_len, target, sc.data is not None, sc.first_cached,
                             sc.capacity_seq_len, sc.max_seq_len)


def front_pad_single(sc: SingleCache, target: int) -> int:
    """Move the live run `[0, live)` to `[lead, target)` with zeros in front; return
    `lead = target - live`. Lead 0: `current = target`, buffer and capacity untouched (no
    reallocation). Else a new zero buffer of width `max(capacity, target)`.

    Refused (CacheRefusal): `target < live` ("front_pad to {T} is shorter than the {live}
    live positions"); an unmaterialized buffer; a windowed slot with `first_cached > 0`;
    a capacity above `max_seq_len`."""
    require(target >= 0, f"front_pad target {target} must be >= 0")
    refusal = _front_pad_refusal(sc, target)
    if refusal is not None:
        raise refusal
    live = sc.current_seq_len
    lead = target - live
    if lead == 0:
        sc.current_seq_len = target
        return 0
    cap = max(sc.capacity_seq_len, target)
    b, h, _, d = sc.data.shape
    fresh = np.zeros((b, h, cap, d), dtype=sc.data.dtype)
    fresh[:, :, lead:target, :] = sc.data[:, :, :live, :]
    sc.data = fresh
    sc.capacity_seq_len = cap
    sc.current_seq_len = target
    return lead


def drop_front_refusal(lead: int, held: int, materialized: bool, width: int,
                       first_cached: int) -> CacheRefusal | None:
    """The refusal stripping a `lead`-column dead prefix from a slot holding `held` positions
    in a buffer `width` columns wide raises, or None, on integers only: lead 0 never refuses;
    a lead past `held`; an unmaterialized buffer; a buffer narrower than `held`; a windowed
    slot (`first_cached > 0`). The reference's caches and the port's slots both call it."""
    if lead == 0:
        return None
    if lead > held:
        return CacheRefusal(f"cannot drop a {lead}-column dead prefix from a slot that holds only "
                            f"{held}")
    if not materialized:
        return CacheRefusal(
            f"cannot drop a {lead}-column dead prefix from an unmaterialized slot ({held} "
            "positions)"
        )
    if width < held:
        return CacheRefusal(
            f"cannot drop a {lead}-column dead prefix: buffer width {width} < current {held}"
        )
    if first_cached > 0:
        return CacheRefusal(
            f"cannot drop a {lead}-column dead prefix from a windowed slot (first cached "
            f"{first_cached})"
        )
    return None


def _drop_front_refusal(sc: SingleCache, lead: int) -> CacheRefusal | None:
    """The refusal `drop_front_single(sc, lead)` would raise, or None."""
    width = 0 if sc.data is None else sc.data.shape[SEQ_DIM]
    return drop_front_refusal(lead, sc.current_seq_len, sc.data is not None, width,
                              sc.first_cached)


def drop_front_single(sc: SingleCache, lead: int) -> None:
    """Strip a `lead`-column dead prefix: `kept = width - lead`, buffer = columns
    `[lead, width)`, `capacity = kept`, `current -= lead`. Lead 0 is a no-op (no tensor touched).

    Refused (CacheRefusal): `lead > current` ("cannot drop a {lead}-column dead prefix from a
    slot that holds only {n}"); an unmaterialized buffer; buffer width < current; a windowed
    slot with `first_cached > 0`."""
    require(lead >= 0, f"dead-prefix lead {lead} must be >= 0")
    refusal = _drop_front_refusal(sc, lead)
    if refusal is not None:
        raise refusal
    if lead == 0:
        return
    width = sc.data.shape[SEQ_DIM]
    kept = width - lead
    sc.data = sc.data[:, :, lead:width, :].copy()
    sc.capacity_seq_len = kept
    sc.current_seq_len -= lead


# --- §4.2 / §4.4: one slot of any kind --------------------------------------------------

def _slot_pad_refusal(slot, target: int, xs_per_seq: bool) -> CacheRefusal | None:
    if slot.kind == XS:
        if not xs_per_seq:
            return CacheRefusal(
                f"front_pad to {target}: an XsRolling slot cannot be front-padded while "
                f"ARC_V4_XS_PER_SEQ is off (xs_per_seq={xs_per_seq})"
            )
        return None
    if slot.kind != NORMAL:
        return CacheRefusal(f"front_pad to {target}: a {slot.kind} slot cannot be front-padded")
    if not isinstance(slot, KvCache):  # a port's K/V slot: its own layout, the same refusals
        return slot.pad_refusal(target)
    require(slot.k.current_seq_len == slot.v.current_seq_len,
            f"K length {slot.k.current_seq_len} and V length {slot.v.current_seq_len} disagree")
    return _front_pad_refusal(slot.k, target) or _front_pad_refusal(slot.v, target)


def front_pad_kv_cache(slot, target: int, xs_per_seq: bool) -> int:
    """Front-pad one slot to `target` and return its lead. Normal: both halves (equal leads,
    checked before either moves). XsRolling: refused if the xs flag is off, else 0 with no
    change (its rows carry their own lengths). Any other kind: refused (CacheRefusal)."""
    require(target >= 0, f"front_pad target {target} must be >= 0")
    refusal = _slot_pad_refusal(slot, target, xs_per_seq)
    if refusal is not None:
        raise refusal
    if slot.kind == XS:
        return 0
    if not isinstance(slot, KvCache):
        return slot.front_pad(target)
    lead = front_pad_single(slot.k, target)
    front_pad_single(slot.v, target)  # the same length (checked above): the same lead
    return lead


def _dead_prefix_refusal(slot, lead: int) -> CacheRefusal | None:
    """The refusal `drop_dead_prefix(slot, lead)` would raise, or None."""
    if slot.kind == XS or lead == 0:
        return None
    if slot.kind != NORMAL:
        return CacheRefusal(f"cannot drop a {lead}-column dead prefix from a {slot.kind} slot")
    if not isinstance(slot, KvCache):
        return slot.drop_refusal(lead)
    return _drop_front_refusal(slot.k, lead) or _drop_front_refusal(slot.v, lead)


def drop_dead_prefix(slot, lead: int) -> None:
    """Strip a `lead`-column dead prefix from one slot, in place. XsRolling or lead 0: a no-op
    touching no tensor (B=1 and uniform groups stay structurally untouched). Normal: both
    halves (both checked before either changes). Any other kind: refused (CacheRefusal)."""
    require(lead >= 0, f"dead-prefix lead {lead} must be >= 0")
    refusal = _dead_prefix_refusal(slot, lead)
    if refusal is not None:
        raise refusal
    if slot.kind == XS or lead == 0:
        return
    if not isinstance(slot, KvCache):
        slot.drop_front(lead)
        return
    drop_front_single(slot.k, lead)
    drop_front_single(slot.v, lead)


# --- §4.5: front_align_batch ------------------------------------------------------------

def _batch_target(caches: list[NormalCache]) -> int:
    """`T`: the maximum `current_seq_len` over every slot of every sequence, XsRolling included."""
    return max((slot.current_seq_len for c in caches for slot in c.slots), default=0)


def _front_align_refusal(caches: list[NormalCache], xs_per_seq: bool) -> CacheRefusal | None:
    target = _batch_target(caches)
    for i, c in enumerate(caches):
        for layer, slot in enumerate(c.slots):
            refusal = _slot_pad_refusal(slot, target, xs_per_seq)
            if refusal is not None:
                return CacheRefusal(f"sequence {i} slot {layer}: {refusal}")
    return None


def front_align_would_succeed(caches: list[NormalCache], xs_per_seq: bool) -> bool:
    """Non-mutating pre-check: True iff `front_align_batch(caches, xs_per_seq)` would pad every
    slot of every sequence to `T` without a refusal."""
    return _front_align_refusal(caches, xs_per_seq) is None


def front_align_batch(caches: list[NormalCache], xs_per_seq: bool) -> list[int]:
    """Left-align a batch in place: `T = max` over all slots of all sequences (XsRolling
    included); pad every slot to `T`; `lead_i` is the lead of sequence i's LAST NON-XsRolling
    slot (XsRolling slots come last on V4 and return 0; a sequence with no K/V slot has lead
    0). A uniform batch gets all-zero leads and no buffer changes. Refused (CacheRefusal, the
    first failing slot named) before any slot changes, so a refusal leaves the batch untouched.
    (`modify_draft_cache` is never passed true upstream and is not modelled.)"""
    refusal = _front_align_refusal(caches, xs_per_seq)
    if refusal is not None:
        raise refusal
    target = _batch_target(caches)
    leads = []
    for c in caches:
        lead = 0
        for slot in c.slots:
            slot_lead = front_pad_kv_cache(slot, target, xs_per_seq)
            if slot.kind != XS:
                lead = slot_lead
        leads.append(lead)
    return leads


# --- §5.1 / §14: uniformity checks and capability ---------------------------------------

def first_mismatched_cache_len(
    caches: list[NormalCache], xs_per_seq: bool
) -> tuple[int, int, int, int] | None:
    """The first `(layer, expected, got, i)` where sequence i's slot `layer` has a
    `current_seq_len` different from `seqs[0]`'s same slot, scanning sequences in order and
    layers within each (order unspecified upstream; this one is stated). XsRolling slots are
    skipped when the xs flag is on. None when uniform (or fewer than two sequences)."""
    if not caches:
        return None
    ref = caches[0].slots
    for i, c in enumerate(caches[1:], start=1):
        require(
            len(c.slots) == len(ref),
            f"sequence {i} has {len(c.slots)} slots, sequence 0 has {len(ref)}",
        )
        for layer, slot in enumerate(c.slots):
            if xs_per_seq and (slot.kind == XS or ref[layer].kind == XS):
                continue
            expected, got = ref[layer].current_seq_len, slot.current_seq_len
            if expected != got:
                return (layer, expected, got, i)
    return None


def ensure_uniform_batch_cache_lens(caches: list[NormalCache], xs_per_seq: bool) -> None:
    """Release-mode postcondition of assembly: refused (AlignRefusal, "sequences in one batch
    must share current_seq_len", naming layer, expected, got and sequence) on any mismatch."""
    mismatch = first_mismatched_cache_len(caches, xs_per_seq)
    if mismatch is not None:
        layer, expected, got, i = mismatch
        raise AlignRefusal(
            f"sequences in one batch must share current_seq_len: layer {layer} expected {expected} "
            f"(sequence 0) but sequence {i} has {got}")


def batch_can_be_ragged(caches: list[NormalCache], xs_per_seq: bool) -> bool:
    """True iff every slot of every sequence `supports_per_sequence_len(xs_per_seq)`: Normal
    always, XsRolling iff the xs flag, Rotating/TurboQuant never. (Paging is not consulted
    here; the capability checks refuse it.)"""
    return all(slot.supports_per_sequence_len(xs_per_seq) for c in caches for slot in c.slots)


# --- concatenation / chunking helpers (one place for clone_in, clone_out and the draft group) ---

def _concat_single(parts: list[SingleCache]) -> SingleCache:
    """Concatenate on dim 0, zero-padding capacity (the slack) to the widest; metadata
    (current, first_cached, max_seq_len, retain) from the first. ValueError if the buffers
    cannot be concatenated (mixed materialization, H/D/dtype mismatch)."""
    first = parts[0]
    cap = max(p.capacity_seq_len for p in parts)
    materialized = [p.data is not None for p in parts]
    require(
        all(materialized) or not any(materialized),
        "cannot concatenate materialized and unmaterialized slots",
    )
    data = None
    if all(materialized):
        shapes = {(p.data.shape[1], p.data.shape[3], p.data.dtype) for p in parts}
        require(
            len(shapes) == 1,
            f"cannot concatenate buffers of [H, D, dtype] {sorted(map(str, shapes))}",
        )
        padded = []
        for p in parts:
            b, h, w, d = p.data.shape
            if w == cap:
                padded.append(p.data)
            else:
                z = np.zeros((b, h, cap, d), dtype=p.data.dtype)
                z[:, :, :w, :] = p.data
                padded.append(z)
        data = np.concatenate(padded, axis=0)
    return SingleCache(first.max_seq_len, cap, first.current_seq_len, first.first_cached,
                       first.retain_window, data)


def concat_kv(caches: list[KvCache]) -> KvCache:
    """K and V of Normal slots concatenated on dim 0; capacity zero-padded to the batch max;
    every other field (current_seq_len included) from the first slot. ValueError when the
    buffers cannot be concatenated. Used by `clone_in_cache`, `batch_draft_caches` and
    `front_align_draft_group`."""
    require(len(caches) > 0, "concat_kv needs at least one slot")
    return KvCache(_concat_single([c.k for c in caches]), _concat_single([c.v for c in caches]))


def _chunk_sizes(n: int, g: int) -> list[int]:
    """Candle's `Tensor::chunk` sizes: `min(g, n)` pieces, the first `n % g` one longer."""
    if n < g:
        return [1] * n
    size, extra = divmod(n, g)
    return [size + 1 if i < extra else size for i in range(g)]


def _chunk_single(sc: SingleCache, g: int) -> list[SingleCache] | None:
    """Chunk one SingleCache on dim 0 into g pieces, each with a copy of its metadata; None
    when the piece count is not g (unmaterialized buffers give g metadata-only copies)."""
    if sc.data is None:
        return [
            SingleCache(
                sc.max_seq_len,
                sc.capacity_seq_len,
                sc.current_seq_len,
                sc.first_cached,
                sc.retain_window,
                None,
            )
            for _ in range(g)
        ]
    sizes = _chunk_sizes(sc.data.shape[0], g)
    if len(sizes) != g:
        return None
    out, start = [], 0
    for s in sizes:
        out.append(
            SingleCache(
                sc.max_seq_len,
                sc.capacity_seq_len,
                sc.current_seq_len,
                sc.first_cached,
                sc.retain_window,
                sc.data[start : start + s].copy(),
            )
        )
        start += s
    return out


# --- §5.2-§5.5: clone_in / clone_out ----------------------------------------------------

@dataclass
class CloneIn:
    """What `clone_in_cache` publishes: the stacked cache, `RAGGED_LEAD_PAD` (None unless this
    call front-aligned a ragged batch) and `ragged_decode_supported` (= batch_can_be_ragged)."""

    batched: NormalCache
    lead_pad: list[int] | None
    ragged_decode_supported: bool


def _strip_pending(caches: list[NormalCache], pending_leads: list[int]) -> None:
    require(len(pending_leads) in (0, len(caches)),
            f"{len(pending_leads)} pending leads for {len(caches)} sequences")
    for i, (c, lead) in enumerate(zip(caches, pending_leads, strict=False)):
        require(lead >= 0, f"pending lead {lead} must be >= 0")
        for layer, slot in enumerate(c.slots):
            refusal = _dead_prefix_refusal(slot, lead)
            if refusal is not None:
                raise CacheRefusal(f"sequence {i} slot {layer}: {refusal}")
    for c, lead in zip(caches, pending_leads, strict=False):
        for slot in c.slots:
            drop_dead_prefix(slot, lead)


def _stack_layer(slots: list, layer: int, xs_per_seq: bool):
    kinds = {s.kind for s in slots}
    require(len(kinds) == 1, f"layer {layer} mixes slot kinds {sorted(kinds)}")
    kind = kinds.pop()
    if kind == NORMAL:
        return concat_kv(slots)
    if kind == XS:
        return XsRolling.stack(slots, reconcile_bases=not xs_per_seq)
    return OtherSlot(kind, slots[0].current_seq_len)


def clone_in_cache(caches: list[NormalCache], pending_leads: list[int], xs_per_seq: bool,
                   stack_layer=None) -> CloneIn:
    """Assemble per-sequence caches into one batched cache (the lazy-strip policy, §5.2).

    In order: (1) strip each sequence's pending lead (`drop_dead_prefix` on every slot;
    `pending_leads` may be empty = none pending); (2) `can = batch_can_be_ragged`; (3) if
    lengths mismatch and `can` and `front_align_would_succeed`: `lead_pad = front_align_batch`,
    else None; (4) `ensure_uniform_batch_cache_lens` (AlignRefusal "sequences in one batch must
    share current_seq_len ..."); (5) per layer, Normal slots via `concat_kv` (capacity
    zero-padded to the batch max), XsRolling via `XsRolling.stack` (bases reconciled only with
    the flag off), other kinds as a length record. The batched current is `seqs[0]`'s.
    Mutates the per-sequence caches (strip, alignment) as the engine does; a pending strip
    that some slot refuses is refused (CacheRefusal naming sequence and slot) before any
    slot is stripped. `stack_layer(slots, layer, xs_per_seq)` builds step (5)'s batched slot
    (default the reference's; a port passes its own layout's, every check above is shared)."""
    require(len(caches) > 0, "clone_in_cache needs at least one sequence")
    _strip_pending(caches, pending_leads)
    can = batch_can_be_ragged(caches, xs_per_seq)
    lead_pad = None
    if (first_mismatched_cache_len(caches, xs_per_seq) is not None and can
            and front_align_would_succeed(caches, xs_per_seq)):
        lead_pad = front_align_batch(caches, xs_per_seq)
    ensure_uniform_batch_cache_lens(caches, xs_per_seq)
    n_layers = len(caches[0].slots)
    stack = _stack_layer if stack_layer is None else stack_layer
    batched = NormalCache([stack([c.slots[layer] for c in caches], layer, xs_per_seq)
                           for layer in range(n_layers)], caches[0].paged)
    return CloneIn(batched, lead_pad, can)


def clone_in_cache_reporting_lead(
    caches: list[NormalCache],
    pending_leads: list[int],
    xs_per_seq: bool,
    per_sequence: bool,
    stack_layer=None,
) -> CloneIn:
    """The MTP pipeline's `In` (eager policy, §5.4): strip pending leads; under PerSequence run
    `front_align_batch` BEFORE `clone_in_cache` (its refusal propagates) and report those
    leads (all 0 for a uniform batch); otherwise report all-0 leads. Internals unspecified
    upstream; choices here: if the inner lazy `clone_in_cache` itself aligned a ragged batch
    (never the case in the cohort world, whose rows are uniform) its real leads are reported
    rather than zeros, since a zero lead on a padded row would be an unmasked dead prefix."""
    _strip_pending(caches, pending_leads)
    leads = front_align_batch(caches, xs_per_seq) if per_sequence else None
    inner = clone_in_cache(caches, [], xs_per_seq, stack_layer)
    if leads is None:
        leads = inner.lead_pad if inner.lead_pad is not None else [0] * len(caches)
    return CloneIn(inner.batched, leads, inner.ragged_decode_supported)


def clone_out_cache(batched: NormalCache, b: int) -> list[NormalCache]:
    """Split a batched cache back into `b` per-sequence caches (§5.3): Normal slots chunked on
    dim 0, every row getting the batched current and capacity (dead prefix included: the
    caller records `PENDING_LEAD_PAD[i] = lead_pad[i]`; nothing is stripped here); XsRolling
    slots by `split_rows` (own tokens and base); other kinds copied. ValueError unless every
    materialized Normal slot has exactly `b` rows."""
    require(b >= 1, f"clone_out_cache needs b >= 1, got {b}")
    rows = [[] for _ in range(b)]
    for layer, slot in enumerate(batched.slots):
        if slot.kind == NORMAL:
            for half in (slot.k, slot.v):
                require(
                    half.data is None or half.data.shape[0] == b,
                    f"layer {layer} holds {None if half.data is None else half.data.shape[0]} "
                    f"rows, not {b}",
                )
            ks, vs = _chunk_single(slot.k, b), _chunk_single(slot.v, b)
            pieces = [KvCache(k, v) for k, v in zip(ks, vs, strict=False)]
        elif slot.kind == XS:
            require(slot.batch == b, f"xs layer {layer} holds {slot.batch} rows, not {b}")
            pieces = slot.split_rows()
        else:
            pieces = [slot.clone() for _ in range(b)]
        for i in range(b):
            rows[i].append(pieces[i])
    return [NormalCache(r, batched.paged) for r in rows]


# --- §9.6-§9.8: draft groups ------------------------------------------------------------

def draft_caches_batchable(kinds: list[str], materialized: list[bool],
                           shapes: list[tuple[int, int]]) -> bool:
    """The host half of `batch_draft_caches` (§9.6), on integers only: a UNIFORM draft group
    of more than one member batches iff every member is Normal, materialized, and has the
    first member's `(current_seq_len, capacity_seq_len)`. One member always batches (a
    plain clone); no members never do. The reference's caches and the port's slots both
    call it before any tensor work."""
    if not kinds:
        return False
    if len(kinds) == 1:
        return True
    return all(
        kind == NORMAL and mat and shape == shapes[0]
        for kind, mat, shape in zip(kinds, materialized, shapes, strict=True)
    )


def batch_draft_caches(caches: list[KvCache]) -> KvCache | None:
    """Batch a UNIFORM draft group (§9.6). None if: `draft_caches_batchable` says no (empty;
    a member not Normal, unmaterialized, or with another `(current, capacity)` than the
    first's, the sequence dim being 2 for every slot here); the concatenation fails
    (H/D/dtype). One member: a plain clone, unchecked. Else K and V concatenated on dim 0
    with the first member's metadata."""
    normal = [c.kind == NORMAL for c in caches]
    if not draft_caches_batchable(
        [c.kind for c in caches],
        [n and c.k.data is not None and c.v.data is not None for n, c in zip(normal, caches,
                                                                             strict=True)],
        [(c.k.current_seq_len, c.k.capacity_seq_len) if n else (0, 0)
         for n, c in zip(normal, caches, strict=True)],
    ):
        return None
    if len(caches) == 1:
        return caches[0].clone()
    try:
        return concat_kv(caches)
    except ValueError:
        return None


def draft_group_target(kinds: list[str], materialized: list[bool], held: list[int],
                       starts: list[int]) -> int:
    """The host half of `front_align_draft_group` (§9.7), on integers only: the group's
    aligned width `T = max(starts)`, or its refusal. Every row's kind, whether its buffer is
    materialized and the positions it holds are given, one entry per row. Checks, in order:
    chain starts >= 0 (ValueError); AlignRefusal "{n} cache(s) for {m} chain start(s)"; no
    rows; per row in order, a non-Normal slot, an unmaterialized buffer, then a chain start
    past the positions held (set_len alone would grow into spare capacity). The reference's
    NumPy caches and the port's slots both call it before any tensor work."""
    require(all(int(s) >= 0 for s in starts), f"chain starts {list(starts)} must be >= 0")
    if len(kinds) != len(starts):
        raise AlignRefusal(f"{len(kinds)} cache(s) for {len(starts)} chain start(s)")
    if not kinds:
        raise AlignRefusal("front_align_draft_group was given no rows (0 caches, 0 chain starts)")
    for r, (kind, mat, h, s) in enumerate(zip(kinds, materialized, held, starts, strict=True)):
        if kind != NORMAL:
            raise AlignRefusal(f"draft row {r} is a {kind} slot, not Normal")
        if not mat:
            raise AlignRefusal(f"draft row {r}'s buffer is unmaterialized")
        if s > h:
            raise AlignRefusal(f"chain start {s} is past the {h} position(s) draft row {r} holds")
    return max(int(s) for s in starts)


def front_align_draft_group(caches: list[KvCache], starts: list[int]) -> KvCache:
    """Batch a RAGGED draft group (§9.7). Per row: clone, `set_len(start)` (drops the
    speculative tail), `front_pad_kv_cache(target = max(starts))`, narrow K and V to exactly
    `target` columns. Result: concatenated on dim 0, `capacity = current = target`, other
    metadata from the first row. The inputs are never mutated.

    Refused (AlignRefusal) before any work: "{n} cache(s) for {m} chain start(s)"; no rows;
    "chain start {s} is past the {held} position(s)" (set_len alone would grow into spare
    capacity); a non-Normal slot; an unmaterialized buffer. A pad refusal (max_seq_len)
    propagates as CacheRefusal."""
    target = draft_group_target(  # the buffers of a non-Normal row are never read
        [c.kind for c in caches],
        [c.kind != NORMAL or (c.k.data is not None and c.v.data is not None) for c in caches],
        [c.current_seq_len for c in caches], starts)
    rows = []
    for c, s in zip(caches, starts, strict=False):
        row = c.clone()
        row.set_len(s)
        front_pad_kv_cache(row, target, xs_per_seq=False)
        for half in (row.k, row.v):
            half.data = half.data[:, :, :target, :].copy()
            half.capacity_seq_len = target
        rows.append(row)
    return concat_kv(rows)


def split_draft_cache(batched: KvCache, g: int) -> list[KvCache] | None:
    """Split a batched draft cache into g row caches (§9.8): g == 1 -> a clone; else K and V
    chunked on dim 0 (candle `chunk` sizes), each piece copying the batched metadata (every
    row's current = the batched length, dead prefix included). None when the piece count is
    not g (e.g. fewer rows than g). The caller then strips each row's lead with
    `drop_dead_prefix`, giving row i the length `start_i + n_draft`."""
    require(g >= 1, f"split_draft_cache needs g >= 1, got {g}")
    if g == 1:
        return [batched.clone()]
    ks, vs = _chunk_single(batched.k, g), _chunk_single(batched.v, g)
    if ks is None or vs is None:
        return None
    return [KvCache(k, v) for k, v in zip(ks, vs, strict=False)]
