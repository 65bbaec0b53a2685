"""The engine policy both simulator modes share: the choices that decide a step, as functions.

The tensor mode (`reference.simulator`) and the lengths-only mode (`reference.lengths`) take
identical decisions; what they decide from lives here once: the trace's error kinds, the row
array layout, the simulated target cache's slot layout and the `kv_advance()` latch it
grants, whether a batch may be ragged, the guards' failure text, the cache growth rule, the
per-step trace fields and the summary. The choices where the spec is silent are listed in
docs/simulator.md.
"""

from __future__ import annotations

import math

import numpy as np

from raggedspec.reference.accounting import AcceptanceTelemetry
from raggedspec.reference.cache import KvCache, NormalCache, block_capacity
from raggedspec.reference.capability import KvAdvance, KvAdvanceLatch
from raggedspec.reference.scenario import Scenario, model_config
from raggedspec.reference.scheduler_telemetry import BucketTelemetry
from raggedspec.reference.trace import COL, ROW_COLUMNS, Trace
from raggedspec.reference.xs_rolling import XsRolling

NCOL = len(ROW_COLUMNS)
ROW_DTYPE = np.int32  # trace rows: lengths fit in 32 bits; halves a long run's memory

# The trace's `error` field names the kind of failure (identical in both modes); the detail
# text goes to `Trace.messages` in the tensor mode.
ERR_GUARD_LEFT = "left-aligned guard"
ERR_GUARD_FOLLOWS = "follows guard"
ERR_CLONE_IN = "clone_in refused"
ERR_CAPACITY = "capacity refused"
ERR_XS_ROLLBACK = "xs rollback refused"
ERR_CHAIN = "draft chain refused"
ERR_COMMIT = "per-sequence commit refused"
# `step.window_guard`'s refusing answers -> the trace's error kind ("defer" refuses nothing).
GUARD_ERRORS = {"left_aligned_guard": ERR_GUARD_LEFT, "follows_guard": ERR_GUARD_FOLLOWS}

# Row columns a failed or undrafted row carries as null (-1).
NULL_COLS = [COL["group_u"], COL["group_start"], COL["chain_start"]]


def target_cache_skeleton(sc: Scenario) -> NormalCache:
    """The simulated V4 target cache's slot layout (no tensors): one Normal K/V slot per
    target layer, then one XsRolling slot per compressed layer. The capability chain
    (`per_sequence_refusal`) is evaluated on it."""
    cfg = model_config(sc)
    slots = [KvCache.new_normal(sc.max_seq_len) for _ in cfg.compress_ratios]
    slots += [XsRolling(r, max_seq_len=sc.max_seq_len) for r in cfg.compress_ratios if r > 0]
    return NormalCache(slots)


def advance_latch(sc: Scenario) -> tuple[KvAdvanceLatch, KvAdvance]:
    """The pipeline's `kv_advance()` latch and its decision for this scenario (depth 0 has no
    MTP pipeline: Cohort, nothing requested)."""
    latch = KvAdvanceLatch(sc.per_seq_kv and sc.depth > 0, sc.xs_per_seq, sc.admission)
    return latch, latch.kv_advance(target_cache_skeleton(sc))


def ragged_capable(sc: Scenario) -> bool:
    """`batch_can_be_ragged` of the target cache: Normal slots always, XsRolling slots only
    with `xs_per_seq` (the WA channel `ragged_decode_supported`)."""
    cfg = model_config(sc)
    return sc.xs_per_seq or not any(r > 0 for r in cfg.compress_ratios)


def guard_error(kind: str, cache_lens, tok_lens, w: int) -> str:
    """The text of a failed step whose window check refused (§16 step 4)."""
    if kind == "left_aligned_guard":
        return (
            f"MTP step refused by the left-aligned guard: per-row cache_lens {list(cache_lens)} "
            "and "
            f"token lengths {list(tok_lens)} leave a tail outside [1, {w}]"
        )
    return (
        f"MTP step refused by the follows guard: kv_advance is PerSequence but this step did not "
        f"assemble the batch (cache_lens {list(cache_lens)}, token lengths {list(tok_lens)}, w "
        f"{w}); "
        f"the resident batched cache is C + w wide"
    )


def grown_capacity(cap, need):
    """`SingleCache.append`'s growth: capacity after holding `need` columns, an array
    (`reference.cache.block_capacity`, the one 512-column block rounding); arrays or ints."""
    return np.asarray(block_capacity(cap, need))


LENGTH_PHASES = ("decode", "defer")  # steps run on the batched cache: their rows carry leads


def summarize(trace: Trace, telemetry: AcceptanceTelemetry, sched: BucketTelemetry,
              latch: KvAdvanceLatch, errors: int) -> dict:
    """The summary object (both modes), from the recorded steps. `max_spread` and
    `mean_padding_fraction` cover every step that ran on the batched cache: decode steps and
    the window deferral's plain decode (`defer`), which carries the same leads. A step's rows
    are the scheduled bucket only: `shattered_steps` counts the measured steps whose
    scheduler formed more than one bucket, whose spread therefore leaves out the rows that
    waited in the other buckets."""
    committed = decode = shattered = 0
    spreads, pads = [], []
    for i in range(len(trace)):
        f = trace.step_fields(i)
        committed += f["committed"]
        decode += f["phase"] == "decode"
        if f["phase"] in LENGTH_PHASES:
            pads.append(f["padding_fraction"])
            shattered += f["buckets"] > 1
            own = trace.row_array(i)[:, COL["own_len"]]
            if own.size:
                spreads.append(int(own.max() - own.min()))
    tps = telemetry.total.tokens_per_step()
    markers = [telemetry.marker("agg")]
    sm = sched.sched_bucket_marker()
    if sm is not None:
        markers.append(sm)
    return {"steps": len(trace), "decode_steps": decode, "committed": committed,
            "tok_per_step": 0.0 if tps is None else tps, "max_spread": max(spreads, default=0),
            "mean_padding_fraction": (math.fsum(pads) / len(pads)) if pads else 0.0,
            "refusal": latch.refusal and latch.messages[-1], "errors": errors, "markers": markers,
            "shattered_steps": shattered}


def step_fields(
    step,
    phase,
    advance,
    instr,
    running,
    waiting,
    buckets,
    groups,
    width,
    pad,
    committed,
    tps,
    bucket,
    prefill,
    error,
) -> dict:
    """One step's scalar trace fields (`Trace.add_step`), in schema order."""
    return {
        "step": step,
        "phase": phase,
        "advance": advance,
        "cache_instruction": instr,
        "running": running,
        "waiting": waiting,
        "buckets": buckets,
        "groups": groups,
        "width": width,
        "padding_fraction": pad,
        "committed": committed,
        "tok_per_step": tps,
        "bucket": bucket,
        "prefill": prefill,
        "error": error,
    }


def fill_rows(rows: np.ndarray, which=slice(None), **values) -> None:
    """Set the named trace columns (`ROW_COLUMNS` names) of `rows[which]`. An unknown name
    raises KeyError naming it."""
    for name, value in values.items():
        rows[which, COL[name]] = value


def idle_fields(t: int, waiting: int, tps: float) -> dict:
    """The trace fields of a step that ran nothing (every waiting request deferred)."""
    return step_fields(t, "idle", "cohort", None, 0, waiting, 0, 0, 0, 0.0, 0, tps, None, [], None)


def prompt_phase(width: int, error: str | None) -> dict:
    """The phase fields of a step that ran only a prompt (`width` its longest prompt)."""
    return {"phase": "prompt", "advance": "cohort", "instr": "Reset", "width": width,
            "pad": 0.0, "groups": 0, "error": error}


def decode_phase(instr: str | None = None) -> dict:
    """The phase fields a decode step starts from (`instr` its pre-op cache instruction)."""
    return {"phase": "decode", "advance": "cohort", "instr": instr, "width": 0, "pad": 0.0,
            "groups": 0, "error": None}


def with_prompt_error(fields: dict, error: str | None) -> dict:
    """A decode step's phase fields with the prompt's error (if any) appended."""
    if error is not None:
        fields["error"] = error if fields["error"] is None else fields["error"] + "; " + error
    return fields


def phase_fields(t: int, fields: dict, chosen: int, waiting: int, n_buckets: int,
                 committed: int, tps: float, bucket, prefill: list) -> dict:
    """A scheduled step's trace fields from its phase fields and the scheduler's counts."""
    return step_fields(t, fields["phase"], fields["advance"], fields["instr"], chosen, waiting,
                       n_buckets, fields["groups"], fields["width"], fields["pad"], committed,
                       tps, bucket, prefill, fields["error"])
