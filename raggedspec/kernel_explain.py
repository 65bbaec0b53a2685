"""Why a kernel's output differs from the reference: the reference key sets, the same
attention under single changed rules, and the words for the first query where one shows.

`attention_under(batch, validity, modulo_heads)` is `reference.attention.attention` per row
with the additive mask of a key-set rule; with the defaults (`reference_validity`, the
reference's `raw_validity`, and the reference's GQA head `h // (Hq // Hk)`) it is the
reference output. `VARIANTS` are the single rules a kernel gets wrong in practice;
`explain` names the first whose output the kernel's matches (and any other that matches
equally on the shrunk case), else a page-table misread (for
the paged layouts, the output with each row's page list shifted), else the one key whose
addition to or removal from the reference key set reproduces the first wrong query.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

import numpy as np
import torch

from raggedspec.gpu.layouts import KvCache, Paged, VerifyBatch, from_layout
from raggedspec.reference.attention import attention
from raggedspec.reference.masks import raw_validity

# ----------------------------------------------------------------------------- reference


def _positions(batch: VerifyBatch, i: int) -> tuple[np.ndarray, np.ndarray]:
    """`(qp [q_len, 1], kp [1, T])`: query positions and key positions of row i's columns
    (negative on the dead prefix)."""
    qp = batch.q_starts[i] + np.arange(batch.q_lens[i])[:, None]
    kp = np.arange(batch.k.shape[2])[None, :] - batch.leads[i]
    return qp, kp


def reference_validity(batch: VerifyBatch, i: int) -> np.ndarray:
    """Row i's key set `bool [q_len, T]` over the front-aligned columns, by the reference's
    `raw_validity` on its live keys (an unbounded window is the row's whole length)."""
    ql, kl, lead = batch.q_lens[i], batch.kv_lens[i], batch.leads[i]
    window = batch.window if batch.window is not None else max(kl, 1)
    out = np.zeros((ql, batch.k.shape[2]), dtype=bool)
    if ql:
        out[:, lead:] = raw_validity(ql, kl - ql, 0, kl, window)
    return out


def _window_keep(kp, qp, w, shift: int = 0):
    return (
        np.ones(np.broadcast_shapes(kp.shape, qp.shape), dtype=bool)
        if w is None
        else kp > qp - w + shift
    )


def _top_left(b, i):
    _qp, kp = _positions(b, i)
    j = np.arange(b.q_lens[i])[:, None]
    return (kp >= 0) & (kp <= j) & _window_keep(kp, j, b.window)


def _window_from(b: VerifyBatch, i: int, which: int) -> np.ndarray:
    """Row i's key set with every query's window started from the row's query `which` (0:
    the first, -1: the last) in place of its own."""
    qp, kp = _positions(b, i)
    return (kp >= 0) & (kp <= qp) & _window_keep(kp, qp[which], b.window)


def _window_shift(b: VerifyBatch, i: int, shift: int) -> np.ndarray:
    """Row i's key set with the window's first key moved by `shift` (-1: one key more)."""
    qp, kp = _positions(b, i)
    return (kp >= 0) & (kp <= qp) & _window_keep(kp, qp, b.window, shift)


def _no_window(b, i):
    qp, kp = _positions(b, i)
    return (kp >= 0) & (kp <= qp)


def _dead_visible(b, i):
    qp, kp = _positions(b, i)
    return (kp <= qp) & _window_keep(kp, qp, b.window)


def _not_causal(b, i):
    qp, kp = _positions(b, i)
    return (kp >= 0) & _window_keep(kp, qp, b.window)


def _diagonal(offsets: Callable[[VerifyBatch], list[int]]) -> Callable:
    """The key set with row i's query j placed at position `offsets(b)[i] + j` (the window
    moving with it), in place of the reference's `kv_len - q_len + j`."""
    def valid(b, i):
        _qp, kp = _positions(b, i)
        qp = offsets(b)[i] + np.arange(b.q_lens[i])[:, None]
        return (kp >= 0) & (kp <= qp) & _window_keep(kp, qp, b.window)

    valid.offsets = offsets
    return valid


def _own_offsets(b: VerifyBatch) -> list[int]:
    return [int(k) for k in np.subtract(b.kv_lens, b.q_lens)]


def diagonal_rules(b: VerifyBatch) -> list[tuple[str, Callable]]:
    """`(where the kernel takes a row's causal offset from, key set)` for the offsets a
    kernel mistakes for the row's own `kv_len - q_len`: another row's, the batch's widest
    row's (`max kv_len` with the row's own or the longest query count), or the row's own
    keys with the longest query count."""
    max_k, max_q, n = max(b.kv_lens), max(b.q_lens), len(b.q_lens)
    rules = [
        ("the batch's widest row: max kv_len - the row's own q_len",
         _diagonal(lambda _b: [max_k - q for q in _b.q_lens])),
        ("the batch's widest row: max kv_len - max q_len",
         _diagonal(lambda _b: [max_k - max_q] * n)),
        ("the row's kv_len - the batch's max q_len",
         _diagonal(lambda _b: [k - max_q for k in _b.kv_lens])),
    ]
    return rules + [
        (f"row {r}'s offset kv_len - q_len = {b.kv_lens[r] - b.q_lens[r]} for every row",
         _diagonal(lambda _b, r=r: [_b.kv_lens[r] - _b.q_lens[r]] * n))
        for r in range(n) if b.q_lens[r]]


CAUSAL_RULE = ("causal alignment is bottom-right per row: query j of a row with q_len queries "
               "over kv_len keys sits at position kv_len - q_len + j, from the row's own lengths")


VARIANTS: list[tuple[str, Callable, bool]] = [
    (
        "causal aligned top-left (query j of a row sees its first j + 1 keys), not bottom-right",
        _top_left,
        False,
    ),
    ("the window starts from the row's last query for every query",
     partial(_window_from, which=-1), False),
    ("the window starts from the row's first query for every query",
     partial(_window_from, which=0), False),
    ("no sliding window", _no_window, False),
    ("the window keeps one key too many", partial(_window_shift, shift=-1), False),
    ("the window keeps one key too few", partial(_window_shift, shift=1), False),
    ("the dead prefix is attended (cache_leftpad / the key mask ignored)", _dead_visible, False),
    ("not causal (keys after the query are attended)", _not_causal, False),
    ("query head h reads KV head h % Hk, not h // (Hq / Hk)", reference_validity, True),
]
"""(rule as the kernel seems to apply it, row key set `(batch, i) -> bool [q_len, T]`, GQA
head `h % Hk`)."""


def as_float64(x: torch.Tensor) -> np.ndarray:
    return x.detach().to("cpu", torch.float64).numpy()


def attention_under(
    batch: VerifyBatch, validity: Callable = reference_validity, modulo_heads: bool = False,
    use_sinks: bool = True,
) -> np.ndarray:
    """`float64 [B, Hq, t_q, D]` per row by `reference.attention.attention` with the additive
    mask of `validity` and the batch's sinks (unless `use_sinks` is False); dead query slots
    0. With the defaults this is the reference output (GQA by the reference's own
    `h // (Hq // Hk)`)."""
    q, k, v = as_float64(batch.q), as_float64(batch.k), as_float64(batch.v)
    sinks = None if batch.sinks is None or not use_sinks else as_float64(batch.sinks)
    b, hq, t_q, _d = q.shape
    out = np.zeros((b, hq, t_q, v.shape[3]))
    for i, ql in enumerate(batch.q_lens):
        if not ql:
            continue
        mask = np.where(validity(batch, i), 0.0, -np.inf)[None, None]
        ki, vi = k[i : i + 1], v[i : i + 1]
        if modulo_heads:
            heads = np.arange(hq) % k.shape[1]  # the misread GQA head h % Hk
            ki, vi = ki[:, heads], vi[:, heads]
        out[i, :, t_q - ql :] = attention(q[i : i + 1, :, t_q - ql :], ki, vi, mask, sinks)[0]
    return out


def short_floats(x: torch.Tensor, limit: int = 8) -> str:
    """A float tensor's first values, rounded, for a report."""
    vals = [round(float(v), 3) for v in x.flatten()[:limit]]
    return str(vals)[:-1] + (", ...]" if x.numel() > limit else "]")


def live_slots(batch: VerifyBatch) -> np.ndarray:
    """`bool [B, 1, t_q, 1]`: the slots holding a row's query."""
    t_q = batch.q.shape[2]
    return (np.arange(t_q)[None, :] >= t_q - np.asarray(batch.q_lens)[:, None])[:, None, :, None]


# ----------------------------------------------------------------------------- explanation


def _key_list(ps: list[int]) -> str:
    shown = ", ".join(str(p) for p in ps[:6]) + (", ..." if len(ps) > 6 else "")
    return f"key {shown}" if len(ps) == 1 else f"keys {shown} ({len(ps)} keys)"


def describe_keys(batch: VerifyBatch, i: int, j: int, extra: list[int], missing: list[int]) -> str:
    """Words for row i's query j attending the columns `extra` and not `missing`: each
    extra key with the rule that excludes it (dead prefix, causality, window)."""
    lead, qp, w = batch.leads[i], batch.q_starts[i] + j, batch.window
    keep = "every key up to the query" if w is None else f"keys {max(0, qp - w + 1)}..{qp}"
    parts = []
    dead = [c for c in extra if c < lead]
    after = [c - lead for c in extra if c >= lead and c - lead > qp]
    outside = [c - lead for c in extra if c >= lead and c - lead <= qp]
    if dead:
        parts.append(
            f"attends dead column{'s' if len(dead) > 1 else ''} "
            f"{', '.join(map(str, dead[:6]))} (the row's lead is {lead}: padding, no key of it)"
        )
    if after:
        parts.append(f"attends {_key_list(after)}, which causality excludes (the query is at {qp})")
    if outside:
        parts.append(f"attends {_key_list(outside)}, which its window of {w} excludes ({keep})")
    if missing:
        parts.append(
            f"does not attend {_key_list([c - lead for c in missing])}, which it should ({keep})"
        )
    return f"row {i}, query {j} (position {qp}): " + "; ".join(parts)


def _first_bad(err: np.ndarray, bound: float) -> tuple[int, int, int] | None:
    """First `(row, head, slot)` whose worst error over D exceeds `bound`."""
    bad = np.argwhere(err.max(axis=-1) > bound)
    return None if not len(bad) else tuple(int(x) for x in bad[0])


def _probe_one_key(
    batch: VerifyBatch, got: np.ndarray, i: int, h: int, s: int, bound: float
) -> str | None:
    """The one key added to or removed from the reference key set of row i, head h, slot s
    that reproduces the kernel's output there, in words; None if none does."""
    t_q = batch.q.shape[2]
    j = s - (t_q - batch.q_lens[i])
    base = reference_validity(batch, i)[j]
    kvh = h // (batch.q.shape[1] // batch.k.shape[1])  # the reference's GQA head
    q, k, v = as_float64(batch.q)[i, h, s], as_float64(batch.k)[i, kvh], as_float64(batch.v)[i, kvh]
    logits = k @ q / np.sqrt(q.shape[0])
    for c in range(len(base)):
        keys = base.copy()
        keys[c] = not keys[c]
        if not keys.any():
            continue
        e = np.exp(logits - logits[keys].max())  # pragma: no mutate (shift: keeps exp finite)
        p = np.where(keys, e, 0.0)
        if np.abs(p @ v / p.sum() - got[i, h, s]).max() <= bound:
            return describe_keys(batch, i, j, [c] if keys[c] else [], [] if keys[c] else [c])
    return None


def page_misreads(arrays) -> list[tuple[str, object]]:
    """`(rule, arrays with that misread)` for a paged layout: each row's page list read one
    entry late or early, or each page id one page off; empty for the other layouts."""
    if isinstance(arrays, Paged):
        idx, n = arrays.kv_indices, arrays.k_pages.shape[0]
        return [("each kv_indices entry is read one entry late",
                 replace(arrays, kv_indices=torch.roll(idx, -1))),
                ("each kv_indices entry is read one entry early",
                 replace(arrays, kv_indices=torch.roll(idx, 1))),
                ("each page id is read one too high", replace(arrays, kv_indices=(idx + 1) % n)),
                ("each page id is read one too low", replace(arrays, kv_indices=(idx - 1) % n))]
    if isinstance(arrays, KvCache) and arrays.block_table is not None:
        bt, n = arrays.block_table, arrays.k_cache.shape[0]
        return [("each block_table entry is read one column late",
                 replace(arrays, block_table=torch.roll(bt, -1, dims=1))),
                ("each block_table entry is read one column early",
                 replace(arrays, block_table=torch.roll(bt, 1, dims=1))),
                ("each page id is read one too high", replace(arrays, block_table=(bt + 1) % n)),
                ("each page id is read one too low", replace(arrays, block_table=(bt - 1) % n))]
    return []


def _row_pages(arrays, i: int, n: int) -> list[int]:
    """Row i's page ids in order, as the layout's table gives them."""
    if isinstance(arrays, Paged):
        ptr = arrays.kv_indptr.tolist()
        return arrays.kv_indices[ptr[i]: ptr[i + 1]].tolist()
    return arrays.block_table[i, : -(-n // arrays.k_cache.shape[1])].tolist()


def _explain_pages(arrays, batch: VerifyBatch, got: np.ndarray, bound: float) -> str | None:
    """The page-table misread whose output the kernel's matches, with the first row it
    changes; None if none does."""
    live = live_slots(batch)
    for rule, alt in page_misreads(arrays):
        misread = from_layout(alt)
        if np.where(live, np.abs(got - attention_under(misread)), 0.0).max() > bound:
            continue
        for i, n in enumerate(batch.kv_lens):
            own, read = _row_pages(arrays, i, n), _row_pages(alt, i, n)
            if batch.q_lens[i] and own != read:
                k = next(p for p in range(len(own)) if own[p] != read[p])  # same length
                return (f"rule that differs: page table: {rule}\n  row {i} ({n} keys): its "
                        f"page {k} is page id {own[k]}, the output is that of reading {read[k]} "
                        f"(its pages {own[:8]}{' ...' if len(own) > 8 else ''})")
        return f"rule that differs: page table: {rule}"
    return None


def _row_output(batch: VerifyBatch, i: int, validity: Callable) -> np.ndarray:
    """Row i's output `[Hq, q_len, D]` under the key set `validity` (reference GQA, sinks)."""
    q, k, v = (as_float64(x)[i][np.newaxis] for x in (batch.q, batch.k, batch.v))
    ql, t_q = batch.q_lens[i], batch.q.shape[2]
    sinks = None if batch.sinks is None else as_float64(batch.sinks)
    mask = np.where(validity(batch, i), 0.0, -np.inf)[None, None]
    return attention(q[:, :, t_q - ql :], k, v, mask, sinks)[0]


def _offset_source(batch: VerifyBatch, i: int, d: int) -> str:
    """Where a row-i causal offset `d` comes from, in words (the first that equals it)."""
    max_k, max_q = max(batch.kv_lens), max(batch.q_lens)
    others = [r for r, o in enumerate(_own_offsets(batch)) if r != i and batch.q_lens[r] and o == d]
    if others:
        return f"row {others[0]}'s (its kv_len - q_len)"
    named = [(0, "0: top-left"),
             (max_k - batch.q_lens[i], "the batch's widest row's: max kv_len - q_len"),
             (max_k - max_q, "the batch's widest row's: max kv_len - max q_len"),
             (batch.kv_lens[i] - max_q, "kv_len - the batch's max q_len")]
    return next((words for value, words in named if value == d), "no other length of the batch")


def _diagonal_words(batch: VerifyBatch, i: int, validity: Callable, d: int) -> str:
    """Row i under a diagonal at offset `d`: where its queries sit and, for its query 0, the
    keys it wrongly attends or misses (or that it attends none). Query 0 is where the row
    first changes: its key set at `d` differs from the one at the row's own offset whenever
    any query's does (the two end at different keys, or the row has that one query)."""
    own = batch.kv_lens[i] - batch.q_lens[i]
    want, have = reference_validity(batch, i), validity(batch, i)
    j = 0
    head = (f"row {i} ({batch.kv_lens[i]} keys, {batch.q_lens[i]} queries): its queries sit at "
            f"positions from {d} on, where its own lengths put them from {own} on")
    if not have[j].any():
        return (f"{head}; query {j} then attends no key, so its output is 0 "
                "(as if the query attended no key)")
    extra = [int(c) for c in np.flatnonzero(have[j] & ~want[j])]
    missing = [int(c) for c in np.flatnonzero(want[j] & ~have[j])]
    return f"{head}; {describe_keys(batch, i, j, extra, missing)}"


def _diagonal_matches(batch: VerifyBatch, got: np.ndarray,
                      bound: float) -> list[tuple[str, Callable]]:
    """The causal offset sources (`diagonal_rules`) whose output the kernel's matches."""
    live = live_slots(batch)
    return [(source, validity) for source, validity in diagonal_rules(batch)
            if np.where(live, np.abs(got - attention_under(batch, validity)), 0.0).max() <= bound]


def _explain_diagonal(batch: VerifyBatch, ref: np.ndarray, bound: float,
                      matches: list[tuple[str, Callable]]) -> str:
    """The first matching causal offset source, with the first row it moves, and the others
    that match this case equally."""
    source, validity = matches[0]
    alt = attention_under(batch, validity)
    where = _first_bad(np.where(live_slots(batch), np.abs(alt - ref), 0.0), bound)
    i = where[0] if where else 0
    words = _diagonal_words(batch, i, validity, int(validity.offsets(batch)[i]))
    also = "".join(f"\n  (on this case the output equally follows: the offset taken from {s})"
                   for s, _ in matches[1:])
    return (f"rule that differs: the causal diagonal: each row's offset is taken from "
            f"{source}, not from the row's own lengths\n  {words}\n  the rule: {CAUSAL_RULE}"
            + also)


def _fit_diagonal(batch: VerifyBatch, got: np.ndarray, i: int, bound: float) -> str | None:
    """The causal offset of row i alone that reproduces the kernel's output there (every
    offset from -t_q to T tried), in words with where it comes from; None if none does."""
    ql, t_q, big = batch.q_lens[i], batch.q.shape[2], batch.k.shape[2]
    own = batch.kv_lens[i] - ql
    mine = got[i, :, t_q - ql :]
    for d in range(-t_q, big + 1):
        if d == own:
            continue
        offsets = _own_offsets(batch)
        offsets[i] = d
        validity = _diagonal(lambda _b, o=offsets: o)
        if np.abs(mine - _row_output(batch, i, validity)).max() <= bound:
            return (f"rule that differs: the causal diagonal of row {i} is at offset {d}, which "
                    f"is {_offset_source(batch, i, d)}, not its own kv_len - q_len = {own}\n  "
                    f"{_diagonal_words(batch, i, validity, d)}\n  the rule: {CAUSAL_RULE}")
    return None


def explain(batch: VerifyBatch, got: np.ndarray, ref: np.ndarray, bound: float,
            arrays=None) -> str:
    """The rule the kernel's output follows instead of the reference's, with the first
    (row, query) where it shows; else (paged layouts, given `arrays`) a page-table misread;
    else a one-key probe; else the plain difference."""
    live = live_slots(batch)
    where = _first_bad(np.nan_to_num(np.where(live, np.abs(got - ref), 0.0), nan=np.inf), bound)
    if where is None:
        return "no live query differs"
    i, h, s = where
    j = s - (batch.q.shape[2] - batch.q_lens[i])
    if not np.isfinite(got[i, h, s]).all():
        return f"row {i}, query {j}, head {h}: the output is not finite ({got[i, h, s][:3]} ...)"
    if batch.sinks is not None:
        alt = attention_under(batch, use_sinks=False)
        if np.where(live, np.abs(got - alt), 0.0).max() <= bound:
            return (f"rule that differs: the attention sinks are dropped from the softmax "
                    f"denominator\n  sinks {short_floats(batch.sinks)}: row {i}, query {j}, "
                    f"head {h} is the softmax over its keys alone")
    matching = [(rule, validity, modulo) for rule, validity, modulo in VARIANTS
                if np.where(live, np.abs(got - attention_under(batch, validity, modulo)), 0.0).max()
                <= bound]
    diagonals = _diagonal_matches(batch, got, bound)
    if matching:
        rule, validity, modulo = matching[0]
        also = "".join(f"\n  (on this case the output equally follows: {r})"
                       for r, _, _ in matching[1:])
        also += "".join(f"\n  (on this case the output equally follows: the causal offset taken "
                        f"from {src})" for src, _ in diagonals)
        alt = attention_under(batch, validity, modulo)
        i, h, s = _first_bad(np.where(live, np.abs(alt - ref), 0.0), bound) or where
        j = s - (batch.q.shape[2] - batch.q_lens[i])
        if modulo:
            hq, hk = batch.q.shape[1], batch.k.shape[1]
            return (
                f"rule that differs: {rule}\n  row {i}, query {j}: query head {h} reads KV head "
                f"{h % hk}; with {hq} query heads over {hk} KV heads it reads {h // (hq // hk)}"
                + also
            )
        want, have = reference_validity(batch, i)[j], validity(batch, i)[j]
        extra = [int(c) for c in np.flatnonzero(have & ~want)]
        missing = [int(c) for c in np.flatnonzero(want & ~have)]
        return f"rule that differs: {rule}\n  {describe_keys(batch, i, j, extra, missing)}{also}"
    if diagonals:
        return _explain_diagonal(batch, ref, bound, diagonals)
    pages = None if arrays is None else _explain_pages(arrays, batch, got, bound)
    if pages is not None:
        return pages
    fitted = _fit_diagonal(batch, got, i, bound)
    if fitted is not None:
        return fitted
    probe = _probe_one_key(batch, got, i, h, s, bound)
    if probe is not None:
        return f"rule that differs: one key of the set\n  {probe}"
    if not np.any(got[i, h, s]):
        return (f"row {i}, query {j}, head {h}: the output is 0, as if the query attended no key "
                f"(the row holds {batch.kv_lens[i]} keys)")
    err = float(np.abs(got[i, h, s] - ref[i, h, s]).max())
    return (
        f"row {i}, query {j}, head {h}: output differs from the reference by {err:.3g} "
        f"(bound {bound:.3g}); no single changed rule or one-key change explains it"
    )
