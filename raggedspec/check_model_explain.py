"""Why a model's ragged batch differs from its rows run alone: the rule it applies instead of
the reference's, in words, at the first row and query where it shows.

Positions (masks-and-scheduling §11: row i's query t sits at `row_q0[i] + t`, its own
length): the positions the rotary embedding received against the reference's, named when
they are the query's cache column (counted from the padded start), the batch's shared q0,
or a constant shift. Masks (§5, §9.2, §4 step 5): the mask an attention layer received
against the reference key set, named by the first of `MASK_VARIANTS` it equals (the
attention mask's zeros ignored, the window counted in cache columns, no window, a window
one key off, not causal), else key by key. Finiteness: where the first non-finite logit
is and whether the cache holds non-finite values in a dead or padding column (a padding
query that attends no key gives NaN, and NaN times a zero weight is still NaN). The cache
after a rollback (cache-and-draft §12): the layer, row, column and the position whose key
it holds instead, and whether the cache equals one rolled back batch-wide.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from raggedspec.check_model_cases import Step, expected_keep, leads, realign


def show_layout(step: Step, limit: int = 40) -> str:
    """Each row's cache columns during the step (`.` a column with no key of the row, else
    the position it holds) and the positions its query slots feed."""
    lines = []
    for i, (cols, slots) in enumerate(zip(step.cols, step.slot_pos, strict=True)):
        shown = " ".join("." if p is None else str(p) for p in cols[-limit:])
        more = f"({len(cols) - limit} more) " if len(cols) > limit else ""
        fed = [p for p in slots if p is not None]
        lines.append(f"  row {i}: columns {more}{shown} | feeds positions {fed}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- positions


def explain_positions(step: Step, got: np.ndarray) -> str:
    """The rule the received positions follow, with the first row where they differ."""
    want = step.slot_pos
    width, t = len(step.cols[0]), step.width
    live = [(i, j) for i, row in enumerate(want) for j, p in enumerate(row) if p is not None]
    column = all(int(got[i, j]) == width - t + j for i, j in live)
    first = next((i, j) for i, j in live if int(got[i, j]) != want[i][j])
    i = first[0]
    row_got = [int(got[i, j]) for j, p in enumerate(want[i]) if p is not None]
    row_want = [p for p in want[i] if p is not None]
    where = (f"  row {i} (lead {leads(step.cols)[i]}): positions {row_got}, the reference's "
             f"{row_want} (row_q0 {row_want[0]})")
    if column:
        return ("rule that differs: positions counted from the padded start (each query gets "
                "its cache column, dead and masked columns counted), not the row's own "
                f"length (masks §11: row i, query t at row_q0[i] + t)\n{where}")
    shift = {int(got[i, j]) - want[i][j] for j in range(t) if want[i][j] is not None}
    if len(shift) == 1:
        return (f"rule that differs: row {i}'s positions are shifted by {shift.pop():+d} "
                f"(masks §11: row i, query t at row_q0[i] + t)\n{where}")
    return f"rule that differs: positions (masks §11: row i, query t at row_q0[i] + t)\n{where}"


# ----------------------------------------------------------------------------- masks


def _grid(step: Step, i: int):
    """`(kp, qp, live, qcol, kcol)` of row i: key positions per column (-1 where none),
    query positions per slot, column liveness, query and key column indices."""
    cols = step.cols[i]
    kp = np.array([-1 if p is None else p for p in cols])[None, :]
    qp = np.array([-1 if p is None else p for p in step.slot_pos[i]])[:, None]
    width, t = len(cols), step.width
    qcol = (width - t + np.arange(t))[:, None]
    return kp, qp, kp >= 0, qcol, np.arange(width)[None, :]


def _in(w: int | None, a, b) -> np.ndarray:
    return np.ones(np.broadcast_shapes(a.shape, b.shape), bool) if w is None else a > b - w


def _mask_ignored(step, i, w):
    _kp, _qp, _live, qcol, kcol = _grid(step, i)
    return (kcol <= qcol) & _in(w, kcol, qcol)


def _window_in_columns(step, i, w):
    _kp, _qp, live, qcol, kcol = _grid(step, i)
    return live & (kcol <= qcol) & _in(w, kcol, qcol)


def _no_window(step, i, w):
    return expected_keep(step.cols[i], step.slot_pos[i], None)


def _window_plus(k: int):
    def keep(step, i, w):
        return expected_keep(step.cols[i], step.slot_pos[i], None if w is None else max(1, w + k))
    return keep


def _not_causal(step, i, w):
    kp, qp, live, _qcol, _kcol = _grid(step, i)
    return live & _in(w, kp, qp)


MASK_VARIANTS: list[tuple[str, Callable]] = [
    ("the dead prefix and padding are attended (the attention mask's zeros are ignored; "
     "masks §5: the dead prefix must be killed)", _mask_ignored),
    ("the sliding window is counted in cache columns, not positions (dead, padding and "
     "masked columns count toward it; masks §4 step 5: kp > qp - window)", _window_in_columns),
    ("no sliding window", _no_window),
    ("the window keeps one key too many", _window_plus(1)),
    ("the window keeps one key too few", _window_plus(-1)),
    ("not causal (keys after the query are attended)", _not_causal),
]
"""(rule as the model applies it, row key set `(step, row, window) -> bool [t, columns]`)."""


def _equals(keep: np.ndarray, step: Step, fn: Callable, window) -> bool:
    width = len(step.cols[0])
    m = keep.shape[2]
    for i in range(len(step.cols)):
        alt = fn(step, i, window)
        for j, p in enumerate(step.slot_pos[i]):
            if p is not None and (alt[j, : width - m].any() or (keep[i, j] != alt[j, width - m:])
                                  .any()):
                return False
    return True


def _first_diff(keep: np.ndarray, step: Step, window):
    width = len(step.cols[0])
    m = keep.shape[2]
    for i in range(len(step.cols)):
        want = expected_keep(step.cols[i], step.slot_pos[i], window)
        for j, p in enumerate(step.slot_pos[i]):
            if p is None:
                continue
            have = np.concatenate([np.zeros(width - m, bool), keep[i, j]]) if m <= width \
                else keep[i, j, m - width:]
            if (have != want[j]).any():
                return i, j, have, want[j]
    return None


def describe_keys(step: Step, i: int, j: int, have, want, window) -> str:
    """Words for row i's query slot j attending `have` instead of `want` (column masks)."""
    cols, qp = step.cols[i], step.slot_pos[i][j]
    lead = leads(step.cols)[i]
    keep = "every key up to the query" if window is None else \
        f"positions {max(0, qp - window + 1)}..{qp}"
    parts = []
    extra = [c for c in np.flatnonzero(have & ~want)]
    dead = [int(c) for c in extra if cols[c] is None and c < lead]
    holes = [int(c) for c in extra if cols[c] is None and c >= lead]
    later = [cols[c] for c in extra if cols[c] is not None and cols[c] > qp]
    outside = [cols[c] for c in extra if cols[c] is not None and cols[c] <= qp]
    missing = [cols[c] for c in np.flatnonzero(want & ~have)]
    if dead:
        parts.append(f"attends dead column(s) {dead[:6]} (the row's lead is {lead})")
    if holes:
        parts.append(f"attends column(s) {holes[:6]} inside the row that hold no key of it "
                     f"(padding or a masked rejected draft)")
    if later:
        parts.append(f"attends position(s) {later[:6]}, after the query")
    if outside:
        parts.append(f"attends position(s) {outside[:6]}, which its window of {window} "
                     f"excludes ({keep})")
    if missing:
        parts.append(f"does not attend position(s) {missing[:6]}, which it should ({keep})")
    return f"row {i}, query slot {j} (position {qp}): " + "; ".join(parts)


def explain_mask(step: Step, layer: int, window, keep: np.ndarray, none: bool) -> str:
    """The rule attention layer `layer`'s mask follows instead of the reference key set."""
    what = "no mask (sdpa's is_causal)" if none else f"a mask of {keep.shape[2]} columns"
    head = f"attention layer {layer} (window {window}) received {what}"
    matching = [rule for rule, fn in MASK_VARIANTS if _equals(keep, step, fn, window)]
    first = _first_diff(keep, step, window)
    where = "" if first is None else "\n  " + describe_keys(step, *first, window)
    if matching:
        also = "".join(f"\n  (on this case the mask equally follows: {r})" for r in matching[1:])
        return f"rule that differs: {matching[0]}\n  {head}{where}{also}"
    return f"rule that differs: the attention mask (masks §5, §9.2)\n  {head}{where}"


# ----------------------------------------------------------------------------- finiteness


def explain_nonfinite(step: Step, logits: np.ndarray, cache_layers: list) -> str:
    """Where the first non-finite logit is, and any non-finite key or value the cache holds
    in a column that is no key of its row."""
    i, j = (int(x) for x in np.argwhere(~np.isfinite(logits).all(axis=-1))[0])
    p = step.slot_pos[i][j]
    what = "a padding slot" if p is None else f"position {p}"
    lines = [f"rule that differs: finite outputs (no NaN or inf anywhere)\n  row {i}, query "
             f"slot {j} ({what}): the logits are not finite"]
    for n, (k, v) in enumerate(cache_layers):
        bad = ~(torch.isfinite(k).all(dim=(1, 3)) & torch.isfinite(v).all(dim=(1, 3)))
        for r, c in bad.nonzero().tolist():
            base = len(step.cols[r]) - k.shape[2]
            held = step.cols[r][base + c] if base + c >= 0 else None
            if held is None:
                lines.append(f"  the cache holds non-finite keys or values at layer {n}, row "
                             f"{r}, column {base + c}, a column with no key of the row: a "
                             f"padding query that attends no key gives NaN, and NaN times its "
                             f"zero weight poisons every later query of the row")
                return "\n".join(lines)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the cache


def _which(key: torch.Tensor, solo_keys: torch.Tensor, first: int, tol: float) -> int | None:
    err = (solo_keys - key[:, None]).abs().amax(dim=(0, 2))
    k = int(err.argmin())
    return first + k if float(err[k]) <= tol else None


def _relaid_equal(layers, before, step: Step, drop: list[int], tol: float,
                  relaid: Callable) -> bool:
    new = realign(step.cols, drop)
    for layer, (k, _v) in zip(layers, before, strict=True):
        if layer.keys.shape != _shape(k, new) or \
                (layer.keys - relaid(k, step.cols, new)).abs().max() > tol:
            return False
    return True


def _shape(k: torch.Tensor, new) -> torch.Size:
    return torch.Size((k.shape[0], k.shape[1], len(new[0]), k.shape[3]))


def explain_cache(step: Step, family: str, n: int, i: int, bad, layers, before, solo,
                  rtol: float, relaid: Callable) -> str:
    """The cache column that holds the wrong key, whose key it holds, and whether the whole
    cache equals a batch-wide rollback (`relaid(tensor, old, new)` re-lays a layer tensor
    from the snapshot `before`)."""
    col, p = bad
    rule = "cache-and-draft §12.2: each row drops its own w - committed"
    if p is None:
        return (f"rule that differs: the rollback ({rule})\n  after the step's rollback layer {n}"
                f" holds more columns than the {col} of the layout")
    layer = layers[n]
    sk = solo.kv[n][0]
    first = solo.logits.shape[0] - sk.shape[1]
    base = len(step.cols_after[i]) - layer.keys.shape[2]
    tol = rtol * max(1.0, float(sk.abs().max()))
    held = _which(layer.keys[i][:, col - base], sk, first, tol)
    holds = "a key no position of the row run alone has" if held is None else \
        f"the key of position {held}"
    where = (f"  layer {n}, row {i}, column {col}: should hold the key of position {p}, holds "
             f"{holds}")
    if step.drop is not None and before:
        for k in sorted(set(step.drop) | {max(step.drop), min(step.drop)}):
            uniform = [k] * len(step.drop)
            if len(set(step.drop)) > 1 and _relaid_equal(layers, before, step, uniform, tol,
                                                         relaid):
                return (f"rule that differs: a batch-wide rollback where a row-wise one is needed "
                        f"({rule})\n  every row dropped {k} column(s); the rows needed "
                        f"{list(step.drop)}\n{where}")
    return f"rule that differs: the cache after the {family} rollback ({rule})\n{where}"
