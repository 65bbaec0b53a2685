"""Vector functions of the host bookkeeping: the capture offsets and the hidden-state
capture slot, the kv_advance latch and the acceptance accounting.

These rules keep state across calls, so a case is a short sequence of calls and its outputs
are what each call returned plus the state at the end (counters as a JSON object with the
fields of `reference.accounting.MtpAcceptance`). Every case is a worked example or a small
enumerated domain, plus seeded draws where the domain is large.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from raggedspec.vectors.policy_fns import cache_of
from raggedspec.vectors.registry import Fn, fixed, generated, lengths
from raggedspec.reference import accounting, dispatch, step
from raggedspec.reference.capability import KvAdvanceLatch

# ------------------------------------------------------------------------------ capture


def _capture_cases(rng: np.random.Generator, n: int) -> list[tuple[str, dict]]:
    def make(shape, i):
        offs = lengths(rng, shape, 0, 40)
        return {"offsets": offs, "b": len(offs), "rows": list(range(len(offs) + 2))}

    return fixed(
        example_uniform_collapses={"offsets": [7, 7, 7], "b": 3, "rows": [0, 2, 5]},
        example_ragged_survives={"offsets": [10, 7, 12], "b": 3, "rows": [0, 1, 2, 3]},
        example_empty_is_zero={"offsets": [], "b": 2, "rows": [0, 1, 4]},
        example_one_row={"offsets": [9], "b": 1, "rows": [0, 3]},
        example_other_width={"offsets": [10, 7], "b": 3, "rows": [1]},
        example_wider_than_the_batch={"offsets": [10, 7, 12], "b": 2, "rows": [2]},
    ) + generated(n, make)


def _capture(_b, i: dict) -> dict:
    c = dispatch.resolve_capture_offsets(i["offsets"])
    return {
        "values": list(c.values),
        "describes": c.describes(i["b"]),
        "row": [c.row(r) for r in i["rows"]],
    }


def _capture_slot_cases(rng: np.random.Generator, n: int) -> list[tuple[str, dict]]:
    def make(shape, i):
        ops = []
        for k in range(int(rng.integers(2, 8))):
            kind = str(rng.choice(["arm", "store_rows", "store", "take", "take", "clear"]))
            if kind == "store_rows":
                ops.append([kind, lengths(rng, shape, 0, 30), k])
            elif kind == "store":
                ops.append([kind, int(rng.integers(0, 30)), k])
            else:
                ops.append([kind])
        return {"ops": ops + [["take"]]}

    return fixed(
        example_disarmed_stores_nothing={"ops": [["store_rows", [4, 2], 1], ["take"]]},
        example_store_overwrites_and_take_clears={
            "ops": [
                ["arm"],
                ["store_rows", [4, 2], 1],
                ["store_rows", [9, 9], 2],
                ["take"],
                ["take"],
            ]
        },
        example_store_is_one_shared_offset={"ops": [["arm"], ["store", 6, 3], ["take"]]},
        example_clear_empties={"ops": [["arm"], ["store_rows", [5, 1, 3], 4], ["clear"], ["take"]]},
    ) + generated(n, make)


def _capture_slot(_b, i: dict) -> dict:
    """`ops` on one capture slot: ["arm"], ["store_rows", offsets, h], ["store", start, h],
    ["take"], ["clear"]; `h` is an opaque tag standing for the hidden tensor."""
    slot, taken = dispatch.MtpHiddenCapture(), []
    for op in i["ops"]:
        if op[0] == "arm":
            slot.arm()
        elif op[0] == "store_rows":
            slot.store_rows(op[1], op[2])
        elif op[0] == "store":
            slot.store(op[1], op[2])
        elif op[0] == "clear":
            slot.clear()
        else:
            got = slot.take()
            taken.append(None if got is None else {"offsets": list(got[0].values), "h": got[1]})
    return {"taken": taken}


# ------------------------------------------------------------------------------ latch


def _latch_cases(rng: np.random.Generator, n: int) -> list[tuple[str, dict]]:
    v4 = ["Normal", "Normal", "XsRolling:4", "XsRolling:128"]
    plain = ["Normal", "Normal"]
    out = []
    for requested in (False, True):
        for xs in (False, True):
            for admission in ("refuse", "grant"):
                for first, name in ((v4, "v4"), (plain, "plain")):
                    tag = f"{int(requested)}{int(xs)}-{admission}-{name}"
                    out.append(
                        (
                            f"domain-{tag}",
                            {
                                "requested": requested,
                                "xs_per_seq": xs,
                                "admission": admission,
                                "calls": [first, v4, plain],
                            },
                        )
                    )
    return out


def _latch(_b, i: dict) -> dict:
    latch = KvAdvanceLatch(i["requested"], i["xs_per_seq"], i["admission"])
    decisions = [latch.kv_advance(cache_of(slots, False)).value for slots in i["calls"]]
    return {"decisions": decisions, "refusal": latch.refusal, "messages": latch.messages}


# ------------------------------------------------------------------------------ accounting


def _counters(a: accounting.MtpAcceptance) -> dict:
    return asdict(a)


def _drafts(rng: np.random.Generator, shape: str) -> list[list[int]]:
    ds = lengths(rng, shape, 0, 10, max_rows=6)
    return [[d, int(rng.integers(0, d + 1))] for d in ds]


def _fused_cases(rng, n):
    return fixed(
        example_all_accepted={"d": 4, "a": 4},
        example_rejected_at_1={"d": 4, "a": 1},
        example_skipped={"d": 0, "a": 0},
        example_over_the_position_cap={"d": 9, "a": 9},
        malformed_more_accepted_than_drafted={"d": 2, "a": 3},
    ) + generated(
        n, lambda shape, i: dict(zip(("d", "a"), _drafts(rng, "boundary")[0], strict=True))
    )


def _verify_cases(rng, n):
    def make(shape, i):
        proposed = [int(x) for x in rng.integers(0, 3, int(rng.integers(0, 6)))]
        target = [int(x) for x in rng.integers(0, 3, len(proposed) + 1)]
        return {"d": len(proposed), "proposed": proposed, "target": target}

    return fixed(
        example_rejection_counts_as_reached={"d": 3, "proposed": [5, 6, 7], "target": [5, 9, 7, 8]},
        example_all_accepted={"d": 2, "proposed": [5, 6], "target": [5, 6, 1]},
    ) + generated(n, make)


def _accumulate_cases(rng, n):
    return fixed(
        example_straddle_fires_once={"every": 10, "steps": [[6, 2], [8, 8], [3, 0]]},
        example_every_zero_never_fires={"every": 0, "steps": [[4, 4], [4, 1]]},
        example_empty_step_never_fires={"every": 4, "steps": [[4, 0], [0, 0], [4, 4]]},
    ) + generated(
        n, lambda shape, i: {"every": int(rng.integers(0, 12)), "steps": _drafts(rng, shape)}
    )


def _accumulate(_b, i: dict) -> dict:
    total = accounting.MtpAcceptance()
    fired = [
        total.accumulate(accounting.from_fused_verify(d, a), i["every"]) for d, a in i["steps"]
    ]
    return {"fired": fired, "total": _counters(total)}


def _record_batch_cases(rng, n):
    return fixed(
        example_two_batch_sizes={"batches": [[[4, 2], [4, 4]], [[4, 1]], [[2, 2], [3, 0]]]},
    ) + generated(
        n,
        lambda shape, i: {
            "batches": [_drafts(rng, "ragged") for _ in range(int(rng.integers(1, 4)))]
        },
    )


def _record_batch(_b, i: dict) -> dict:
    t = accounting.AcceptanceTelemetry(logging_enabled=False)
    for rows in i["batches"]:
        t.record_batch(len(rows), [accounting.from_fused_verify(d, a) for d, a in rows])
    return {
        "by_batch": [[b, _counters(c)] for b, c in sorted(t.by_batch.items())],
        "total_batch_steps": t.total.batch_steps,
    }


def bookkeeping_functions() -> list[Fn]:
    """The capture-offset, latch and accounting vector functions, in manifest order."""
    acc = "reference.accounting."
    return [
        Fn(
            "dispatch",
            "resolve_capture_offsets",
            "C §6.2",
            "reference.dispatch.resolve_capture_offsets",
            _capture,
            _capture_cases,
        ),
        Fn(
            "dispatch",
            "mtp_hidden_capture",
            "C §6.3",
            "reference.dispatch.MtpHiddenCapture",
            _capture_slot,
            _capture_slot_cases,
        ),
        Fn(
            "capability",
            "kv_advance",
            "C §13",
            "reference.capability.KvAdvanceLatch.kv_advance",
            _latch,
            _latch_cases,
        ),
        Fn(
            "accounting",
            "from_fused_verify",
            "C §15",
            acc + "from_fused_verify",
            lambda _b, i: {"step": _counters(accounting.from_fused_verify(i["d"], i["a"]))},
            _fused_cases,
        ),
        Fn(
            "accounting",
            "from_verify",
            "C §15",
            acc + "from_verify",
            lambda _b, i: {
                "step": _counters(
                    accounting.from_verify(i["d"], step.verify_proposed(i["proposed"], i["target"]))
                )
            },
            _verify_cases,
        ),
        Fn(
            "accounting",
            "accumulate",
            "C §15",
            acc + "MtpAcceptance.accumulate",
            _accumulate,
            _accumulate_cases,
        ),
        Fn(
            "accounting",
            "record_batch",
            "C §15",
            acc + "AcceptanceTelemetry.record_batch",
            _record_batch,
            _record_batch_cases,
        ),
    ]
