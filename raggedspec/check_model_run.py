"""One case of `raggedspec check-model` through a model: the engine side (inputs, cache,
rollback), what the model used (hooks), the row run alone, and the comparisons.

`run_case(subject, case)` plans the case (`check_model_cases.plan_steps`), then for each
forward: feeds the left-padded ids with the attention mask of the live columns and the
reference's positions; records the `position_ids` every rotary embedding received and the
`attention_mask` every attention module received (`Watch`); runs each row alone, unpadded,
on the same weights; and compares in this order: positions, masks (per layer, with that
layer's window), finiteness of every logit, each live query's logits, then after the step's
rollback the keys and values each row's cache holds against those of the row run alone. The
first difference is explained by `check_model_explain` and returned as the report.

Rollback (the engine's part): crop and refeed call the cache's `crop(-n)` (as transformers'
own assisted decoding does, past recording on); shift re-lays each layer's keys and values
row by row (`relayout`), unless the model defines `rollback_rows(cache, dropped)`; mask
leaves the cache as it is. A model's `rollback_rows(cache, dropped, attention_mask)` gets
each row's dropped count and the step's `[B, columns]` mask of live columns, and must leave
row i's kept keys front-aligned (they end at one column, zeros in front).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from raggedspec.check_model_cases import Case, Plan, Step, expected_keep, plan_steps
from raggedspec.check_model_explain import (
    explain_cache,
    explain_mask,
    explain_nonfinite,
    explain_positions,
    show_layout,
)
from raggedspec.check_model_models import Subject, attention_modules, layer_window
from raggedspec.reference.plugins import PluginError

RTOL = {"float64": 1e-9, "float32": 1e-4}
"""Tolerance on logits, keys and values, relative to the largest magnitude of the row run
alone (at least 1): float64 agrees to about 1e-15 where the model is right, an error in a
rule gives a difference of order 1e-2 to 1."""
RECORDING = ("crop", "refeed", "shift")
"""Families whose rollback needs the whole history of a sliding-window layer."""
MISSING = object()


@dataclass
class Outcome:
    """A case's result: `report` None when everything agreed; `max_diff` the largest logit
    difference seen (absolute)."""

    report: str | None
    max_diff: float


class ModelRaised(Exception):
    """The model (or transformers) raised during a forward or a rollback."""


# ----------------------------------------------------------------------------- hooks


class Watch:
    """Forward pre-hooks recording the `position_ids` of every rotary embedding call and the
    `attention_mask` (with the module's `sliding_window`) of every attention module call."""

    def __init__(self, model) -> None:
        self.positions: list[np.ndarray] = []
        self.masks: list[tuple[int, int | None, object]] = []
        self.handles = []
        rotary = [m for m in model.modules() if "Rotary" in type(m).__name__]
        for m in rotary:
            self.handles.append(m.register_forward_pre_hook(self._rope, with_kwargs=True))
        self.attention = attention_modules(model)
        config = getattr(model, "config", None)
        for i, m in enumerate(self.attention):
            hook = partial(self._mask, i, layer_window(m, config))
            self.handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
        self.sees_positions = bool(rotary)

    def _rope(self, module, args, kwargs) -> None:
        pos = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if isinstance(pos, torch.Tensor):
            self.positions.append(pos.detach().cpu().numpy())

    def _mask(self, index: int, window, module, args, kwargs) -> None:
        mask = kwargs.get("attention_mask", MISSING)
        if mask is MISSING:
            try:
                bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
                mask = bound.arguments.get("attention_mask", MISSING)
            except TypeError:
                mask = MISSING
        if mask is not MISSING:
            self.masks.append((index, window, mask))

    def clear(self) -> None:
        self.positions, self.masks = [], []

    def pause(self) -> None:
        """Stop recording (the rows run alone reuse the model) until `clear`."""
        self.positions, self.masks = _Sink(), _Sink()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class _Sink(list):
    """A list that drops what is appended to it."""

    def append(self, _item) -> None:
        return None


def keep_of(mask, b: int, t: int, width: int) -> np.ndarray:
    """A captured attention mask as `bool [B, t, m]` (head 0): a bool mask as is, an
    additive one kept where above half the dtype's lowest value, a flex BlockMask
    materialized; None (no mask: sdpa's `is_causal`) as causal over the last t columns of
    `width`."""
    if mask is None:
        cols = np.arange(width)[None, :]
        return np.broadcast_to(cols <= width - t + np.arange(t)[:, None], (b, t, width))
    if type(mask).__name__ == "BlockMask":
        from torch.nn.attention.flex_attention import create_mask

        q_len, kv_len = mask.seq_lengths
        mask = create_mask(mask.mask_mod, b, 1, q_len, kv_len, device="cpu")
    mask = mask.detach().cpu()
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    keep = mask.numpy()
    if keep.ndim == 4:
        keep = keep[:, 0]
    return np.broadcast_to(keep, (b, t, keep.shape[-1]))


# ----------------------------------------------------------------------------- engine


def _cache_kw(model) -> str:
    """The name the model's forward takes its cache under: `cache` (transformers 5) or
    `past_key_values`, from the first forward in its class hierarchy that names either."""
    for cls in type(model).__mro__:
        if "forward" in cls.__dict__:
            params = inspect.signature(cls.forward).parameters
            for name in ("cache", "past_key_values"):
                if name in params:
                    return name
    return "past_key_values"


def new_cache(model: torch.nn.Module, family: str) -> object | None:
    """transformers' `DynamicCache(config=...)` for a transformers model (what `generate`
    builds), past recording on where the family rolls back; None otherwise (the model
    makes its own)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "_supports_default_dynamic_cache"):
        return None
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if family in RECORDING:
        cache.activate_past_recording()
    return cache


def forward(model: torch.nn.Module, step: Step, cache) -> tuple[np.ndarray, object]:
    """The batch forward of `step`: `(logits float64 [B, t, V], cache)`."""
    kwargs = dict(input_ids=torch.as_tensor(step.ids),
                  attention_mask=torch.as_tensor(step.attention_mask()),
                  position_ids=torch.as_tensor(step.position_ids()), use_cache=True)
    kwargs[_cache_kw(model)] = cache
    with torch.no_grad():
        out = model(**kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None) or cache
    return logits.detach().to(torch.float64).numpy(), cache


def layers_of(cache: object) -> list:
    """The cache's layers that hold `keys` and `values` as `[B, H, S, D]` tensors."""
    out = []
    for layer in getattr(cache, "layers", []) or []:
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == 4:
            out.append(layer)
    return out


def relaid(x: torch.Tensor, old: list, new: list) -> torch.Tensor:
    """One layer tensor re-laid from the columns `old` to `new` (each a per-row position
    list), stored right-aligned; dead columns zero."""
    base = len(old[0]) - x.shape[2]
    out = x.new_zeros(x.shape[0], x.shape[1], len(new[0]), x.shape[3])
    for i, (before, after) in enumerate(zip(old, new, strict=True)):
        where = {p: c - base for c, p in enumerate(before) if p is not None}
        for c, p in enumerate(after):
            if p is not None:
                if where[p] < 0:
                    raise ModelRaised(f"the cache layer keeps {x.shape[2]} columns: row {i}'s "
                                      f"position {p} is gone before the re-layout")
                out[i, :, c] = x[i, :, where[p]]
    return out


def relayout(cache: object, old: list, new: list) -> None:
    """The per-row rollback by re-laying every layer: row i's kept positions move to its
    columns in `new` (front-aligned), zeros in front (cache-and-draft §4.1)."""
    for layer in layers_of(cache):
        layer.keys = relaid(layer.keys, old, new)
        layer.values = relaid(layer.values, old, new)
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = len(new[0])


def roll_back(model: torch.nn.Module, cache, step: Step, family: str) -> None:
    """The family's rollback after a verify forward."""
    if step.kind != "verify" or family == "mask":
        return
    if step.drop is not None:
        hook = getattr(model, "rollback_rows", None)
        if callable(hook):
            hook(cache, list(step.drop), torch.as_tensor(step.attention_mask()))
        else:
            relayout(cache, step.cols, step.cols_after)
    else:
        cache.crop(-step.crop)


def snapshot(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys.clone(), layer.values.clone()) for layer in layers_of(cache)]


# ----------------------------------------------------------------------------- solo


@dataclass
class Solo:
    """Row i run alone: logits `[S, V]` by position, and per layer its keys and values
    `[H, R, D]` for its last R positions."""

    logits: np.ndarray
    kv: list[tuple[torch.Tensor, torch.Tensor]]


def run_alone(model: torch.nn.Module, tokens: list[int]) -> Solo | None:
    """The row's tokens alone, unpadded, no mask, positions left to the model."""
    if not tokens:
        return None
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), use_cache=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    kv = [(layer.keys[0], layer.values[0]) for layer in layers_of(cache)]
    logits = out.logits if hasattr(out, "logits") else out[0]
    return Solo(logits[0].detach().to(torch.float64).numpy(), kv)


# ----------------------------------------------------------------------------- checks


def check_positions(positions: list, step: Step) -> str | None:
    """Every rotary call's live positions equal the reference's (masks §11)."""
    want = step.slot_pos
    for got in positions:
        got = np.broadcast_to(got, (len(want), len(want[0])))
        for i, row in enumerate(want):
            live = [j for j, p in enumerate(row) if p is not None]
            if any(int(got[i, j]) != row[j] for j in live):
                return explain_positions(step, got)
    return None


def check_masks(masks: list, step: Step) -> str | None:
    """Every attention call's mask keeps, on every live query, the reference's key set for
    its layer's window; keys the window needs are within the mask's columns."""
    b, t, width = len(step.cols), step.width, len(step.cols[0])
    for layer, window, mask in masks:
        keep = keep_of(mask, b, t, width)
        for i in range(b):
            want = expected_keep(step.cols[i], step.slot_pos[i], window)
            if keep.shape[2] > width or not _row_agrees(keep[i], want, step.slot_pos[i]):
                return explain_mask(step, layer, window, keep, mask is None)
    return None


def _row_agrees(keep: np.ndarray, want: np.ndarray, slots: list) -> bool:
    m = keep.shape[1]
    for j, p in enumerate(slots):
        if p is not None and (want[j, : want.shape[1] - m].any()
                              or (keep[j] != want[j, want.shape[1] - m:]).any()):
            return False
    return True


def compare_logits(step: Step, logits: np.ndarray, solos: list, rtol: float,
                   diff: list[float], cache) -> str | None:
    """Every logit finite; each live query's logits equal those of its row alone."""
    if not np.isfinite(logits).all():
        return explain_nonfinite(step, logits, [(x.keys, x.values) for x in layers_of(cache)])
    for i, solo in enumerate(solos):
        for j, p in enumerate(step.slot_pos[i]):
            if p is None:
                continue
            err = float(np.abs(logits[i, j] - solo.logits[p]).max())
            diff[0] = max(diff[0], err)
            bound = rtol * max(1.0, float(np.abs(solo.logits).max()))
            if err > bound:
                small = rtol < RTOL["float32"] and err <= RTOL["float32"] * bound / rtol
                why = ("; within float32 precision: part of the forward runs in float32 "
                       "(a precision difference, not a rule of the spec)" if small else "")
                return (f"row {i}, query slot {j} (position {p}): logits differ from the row "
                        f"run alone by {err:.3g} (bound {bound:.3g}), with positions and masks "
                        f"as the reference's{why}")
    return None


def check_cache(cache, step: Step, solos: list, rtol: float, before, family: str) -> str | None:
    """After the rollback, each row's live columns hold the keys and values of its own
    positions, as the row run alone computed them (cache-and-draft §12)."""
    layers = layers_of(cache)
    for n, layer in enumerate(layers):
        for i, solo in enumerate(solos):
            if solo is None or n >= len(solo.kv):
                continue
            bad = _first_wrong_column(layer, i, step.cols_after[i], solo, n, rtol)
            if bad is not None:
                return explain_cache(step, family, n, i, bad, layers, before, solo, rtol,
                                     relaid)
    return None


def _first_wrong_column(layer, i: int, cols: list, solo: Solo, n: int, rtol: float):
    """`(column, position)` of the first live column of row i whose key or value differs
    from the row alone's at that position; None if all agree where both hold it."""
    keys, values = layer.keys[i], layer.values[i]
    if keys.shape[1] > len(cols):
        return (len(cols), None)
    sk, sv = solo.kv[n]
    base, first = len(cols) - keys.shape[1], solo.logits.shape[0] - sk.shape[1]
    scale = rtol * max(1.0, float(sk.abs().max()), float(sv.abs().max()))
    for c in range(keys.shape[1]):
        p = cols[base + c]
        if p is None or not 0 <= p - first < sk.shape[1]:
            continue
        err = max(float((keys[:, c] - sk[:, p - first]).abs().max()),
                  float((values[:, c] - sv[:, p - first]).abs().max()))
        if not err <= scale:
            return (base + c, p)
    return None


# ----------------------------------------------------------------------------- a case


def run_case(subject: Subject, case: Case) -> Outcome:
    """The case through the subject's model: the first difference's report, or None."""
    model = subject.model(case.kv_heads, case.window)
    plan = plan_steps(case, subject.vocab())
    watch = Watch(model)
    diff = [0.0]
    try:
        report = _run(model, case, plan, watch, RTOL[subject.dtype], diff)
    finally:
        watch.close()
    if report is not None:
        report = f"{case.describe()}\n{report}"
    return Outcome(report, diff[0])


def _run(model, case: Case, plan: Plan, watch: Watch, rtol: float, diff) -> str | None:
    cache = new_cache(model, case.family)
    for s, (step, tokens) in enumerate(zip(plan.steps, plan.solo_tokens, strict=True)):
        head = f"step {s} ({step.kind}), the batch as fed:\n{show_layout(step)}"
        watch.clear()
        try:
            logits, cache = forward(model, step, cache)
        except PluginError:
            raise
        except Exception as exc:  # noqa: BLE001 (the model failing on a batch is a finding)
            return f"{head}\nthe model raised {type(exc).__name__}: {str(exc)[:400]}"
        positions, masks = watch.positions, watch.masks
        watch.pause()
        solos = [run_alone(model, t) for t in tokens]
        report = (check_positions(positions, step) or check_masks(masks, step)
                  or compare_logits(step, logits, solos, rtol, diff, cache))
        if report is None:
            before = snapshot(cache)
            try:
                roll_back(model, cache, step, case.family)
            except Exception as exc:  # noqa: BLE001
                return f"{head}\nthe rollback raised {type(exc).__name__}: {str(exc)[:400]}"
            report = check_cache(cache, step, solos, rtol, before, case.family)
        if report is not None:
            return f"{head}\n{report}"
    return None
