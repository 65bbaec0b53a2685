"""Vector functions of the policy rules: the environment flags, the capability chain and its
refusals, the sampler gate, and the scheduler's buckets and the engine's cache instruction.

These are host rules over strings, booleans and small records (a cache is described by its
slot kinds, a running sequence by its `SeqRecord` fields); the cases enumerate each rule's
whole small domain or its worked examples, and seeded draws where the domain is large.
"""

from __future__ import annotations

from collections.abc import Callable

from raggedspec.vectors.registry import Fn, fixed, generated, lengths, plain
from raggedspec.reference import capability, scheduler
from raggedspec.reference.cache import KvCache, NormalCache, OtherSlot
from raggedspec.reference.xs_rolling import XsRolling

# ------------------------------------------------------------------------------ capability


def cache_of(slots: list[str], paged: bool):
    """A cache from slot kinds: "Normal", "XsRolling:<ratio>", "Rotating", "TurboQuant"."""
    built = []
    for s in slots:
        if s == "Normal":
            built.append(KvCache.new_normal(4096))
        elif s.startswith("XsRolling:"):
            built.append(XsRolling(int(s.split(":")[1]), max_seq_len=4096))
        else:
            built.append(OtherSlot(s))
    return NormalCache(built, paged)


CACHE_SHAPES = {
    "v4": ["Normal", "Normal", "XsRolling:4", "XsRolling:128"],
    "plain": ["Normal", "Normal", "Normal"],
    "rotating": ["Normal", "Rotating", "XsRolling:4"],
    "turboquant": ["TurboQuant", "XsRolling:4"],
    "lone_xs": ["XsRolling:4"],
}


def _capability_cases(with_admission: bool, with_xs: bool = True):
    def cases(rng, n):
        out = []
        for name, slots in CACHE_SHAPES.items():
            for paged in (False, True):
                for xs in (False, True) if with_xs else (False,):
                    for adm in ("refuse", "grant") if with_admission else (None,):
                        inp = {"slots": slots, "paged": paged}
                        if with_xs:
                            inp["xs_per_seq"] = xs
                        if adm is not None:
                            inp["admission"] = adm
                        tag = f"{name}-{'paged' if paged else 'unpaged'}"
                        tag += (f"-xs-{'on' if xs else 'off'}" if with_xs else "") + (
                            f"-{adm}" if adm else ""
                        )
                        out.append((f"domain-{tag}", inp))
        return out

    return cases


def _checked(check: Callable, *args) -> dict:
    check(*args)
    return {"ok": True}


def _per_sequence_refusal(_b, inp):
    r = capability.per_sequence_refusal(
        cache_of(inp["slots"], inp["paged"]), inp["xs_per_seq"], inp["admission"]
    )
    return {"refusal": None if r is None else {"class": type(r).__name__, "message": str(r)}}


FLAG_VALUES = [
    None,
    "",
    "0",
    "1",
    "true",
    "TRUE",
    "True",
    "tRuE",
    " 1",
    "1 ",
    "yes",
    "on",
    "off",
    "no",
    "false",
    "FALSE",
    " 0 ",
    "2",
]


def _flag_cases(rng, n):
    return [(f"domain-value-{i:02d}", {"value": v}) for i, v in enumerate(FLAG_VALUES)]


def _isq_cases(rng, n):
    names = [
        None,
        "AFQ2",
        "AFQ3",
        "AFQ4",
        "AFQ6",
        "AFQ8",
        "HQQ4",
        "HQQ8",
        "Q4_0",
        "Q8_0",
        "Q4K",
        "F16",
    ]
    return [
        (
            f"domain-{(x or 'none').lower()}-{'allowed' if allow else 'floored'}",
            {"isq": x, "allow_sub_int8": allow},
        )
        for x in names
        for allow in (False, True)
    ]


def _may_draft_cases(rng, n):
    base = {
        "temperature": None,
        "frequency_penalty": None,
        "presence_penalty": None,
        "repetition_penalty": None,
        "dry": False,
        "custom_processor": False,
    }
    alts = [
        {},
        {"temperature": 0.0},
        {"temperature": 5e-8},
        {"temperature": 1e-7},
        {"temperature": 0.7},
        {"frequency_penalty": 0.0},
        {"frequency_penalty": 0.5},
        {"presence_penalty": 0.1},
        {"repetition_penalty": 1.0},
        {"repetition_penalty": 1.1},
        {"dry": True},
        {"custom_processor": True},
    ]
    return [(f"domain-{i:02d}", dict(base, **a)) for i, a in enumerate(alts)]


def _may_draft(_b, inp):
    return {
        "may_draft": capability.seq_may_draft(
            inp["temperature"],
            inp["frequency_penalty"],
            inp["presence_penalty"],
            inp["repetition_penalty"],
            inp["dry"],
            inp["custom_processor"],
        )
    }


# ------------------------------------------------------------------------------ scheduler


def _bucket_len_cases(rng, n):
    return fixed(
        example_fresh_101={"cache_len": None, "n_tokens": 101},
        example_own_cache={"cache_len": 40, "n_tokens": 101},
        example_empty_cache={"cache_len": 0, "n_tokens": 1},
        example_one_token={"cache_len": None, "n_tokens": 1},
    ) + generated(
        n,
        lambda shape, i: {
            "cache_len": None if i % 3 == 0 else int(rng.integers(0, 600)),
            "n_tokens": int(rng.integers(1, 600)),
        },
    )


def _cache_in_cases(rng, n):
    return [
        (f"domain-{int(a)}{int(b)}{int(c)}", {"no_kv": a, "cohort_changed": b, "granted": c})
        for a in (False, True)
        for b in (False, True)
        for c in (False, True)
    ]


def _instruction_cases(rng, n):
    out = []
    for world in scheduler.WORLDS:
        for ids, last in (([1, 2], [1, 2]), ([1, 2], [2, 1]), ([1, 2, 3], [1, 2])):
            for no_kv in (False, True):
                for granted in (False, True):
                    out.append(
                        (
                            f"domain-{world.lower()}-completion-{len(out):02d}",
                            {
                                "world": world,
                                "batch": "completion",
                                "ids": ids,
                                "last_completion_ids": last,
                                "no_kv_cache": no_kv,
                                "granted": granted,
                                "first_token_offset": 0,
                            },
                        )
                    )
        for off in (0, 5):
            out.append(
                (
                    f"domain-{world.lower()}-prompt-{len(out):02d}",
                    {
                        "world": world,
                        "batch": "prompt",
                        "ids": [3],
                        "last_completion_ids": [1],
                        "no_kv_cache": False,
                        "granted": False,
                        "first_token_offset": off,
                    },
                )
            )
    return out


def _op(op) -> dict:
    return {
        "kind": op.kind,
        "load_preallocated_cache": op.load_preallocated_cache,
        "reset_non_granular": op.reset_non_granular,
    }


def _instruction(_b, inp):
    pre, post = scheduler.engine_cache_instruction(
        inp["world"],
        inp["batch"],
        inp["ids"],
        inp["last_completion_ids"],
        inp["no_kv_cache"],
        inp["granted"],
        inp["first_token_offset"],
    )
    return {"pre_op": _op(pre), "post_op": _op(post)}


def _seq(d: dict) -> scheduler.SeqRecord:
    return scheduler.SeqRecord(
        d["id"], d["n_tokens"], d["cache_len"], d["is_prompt"], d["token_offset"], d["images"]
    )


def _running(rng, shape) -> list[dict]:
    return [
        {
            "id": i,
            "n_tokens": n + 1,
            "cache_len": None if rng.random() < 0.3 else n,
            "is_prompt": bool(rng.random() < 0.25),
            "token_offset": 0,
            "images": bool(rng.random() < 0.2),
        }
        for i, n in enumerate(lengths(rng, shape, 0, 600))
    ]


def _keys_cases(rng, n):
    def make(shape, i):
        return {
            "world": scheduler.WORLDS[i % 3],
            "granted": i % 2 == 0,
            "ragged_decode_supported": i % 4 < 2,
            "running": _running(rng, shape),
        }

    seqs = [
        {
            "id": 0,
            "n_tokens": 101,
            "cache_len": None,
            "is_prompt": True,
            "token_offset": 0,
            "images": True,
        },
        {
            "id": 1,
            "n_tokens": 60,
            "cache_len": 59,
            "is_prompt": False,
            "token_offset": 0,
            "images": True,
        },
        {
            "id": 2,
            "n_tokens": 90,
            "cache_len": 89,
            "is_prompt": False,
            "token_offset": 0,
            "images": False,
        },
    ]
    ex = {
        f"example_{w.lower()}_{'granted' if g else 'refused'}": {
            "world": w,
            "granted": g,
            "ragged_decode_supported": g,
            "running": seqs,
        }
        for w in scheduler.WORLDS
        for g in (False, True)
    }
    short_prompt = dict(seqs[0], id=3, n_tokens=20)  # a prompt shorter than every completion
    ex["example_wb_granted_short_prompt"] = {
        "world": "WB",
        "granted": True,
        "ragged_decode_supported": True,
        "running": seqs + [short_prompt],
    }
    return fixed(**ex) + generated(n, make)


def _bucket_keys(_b, inp):
    state = scheduler.SchedulerState(inp["world"])
    state.admission = scheduler.RaggedAdmission(inp["granted"], None)
    state.ragged_decode_supported = inp["ragged_decode_supported"]
    running = [_seq(s) for s in inp["running"]]
    return {
        "keys": [list(k) for k in scheduler.bucket_keys(running, state)],
        "ragged_bucket_len": scheduler.ragged_bucket_len(running, state.admission),
    }


def _select_cases(rng, n):
    def make(shape, i):
        lens = sorted(set(lengths(rng, shape, 0, 600))) or [int(rng.integers(0, 600))]
        return {
            "buckets": [[[x, False, 0], int(rng.integers(1, 40))] for x in lens],
            "priorities": [[[x, False, 0], round(float(rng.uniform(0, 400)), 3)] for x in lens],
            "discrete": i % 5 == 4,
        }

    return fixed(
        example_payback_bound_equal={
            "buckets": [[[100, False, 0], 1], [[356, False, 0], 1]],
            "priorities": [[[100, False, 0], 1.0], [[356, False, 0], 2.0]],
            "discrete": False,
        },
        example_payback_bound_past={
            "buckets": [[[100, False, 0], 1], [[357, False, 0], 1]],
            "priorities": [[[100, False, 0], 1.0], [[357, False, 0], 2.0]],
            "discrete": False,
        },
        example_next_len_needs_equal_images_and_offset={
            "buckets": [[[100, False, 0], 32], [[101, True, 0], 32], [[102, False, 5], 32]],
            "priorities": [[[100, False, 0], 1.0], [[101, True, 0], 9.0], [[102, False, 5], 3.0]],
            "discrete": False,
        },
        example_coalesce_32_at_101_with_32_at_102={
            "buckets": [[[101, False, 0], 32], [[102, False, 0], 32]],
            "priorities": [[[101, False, 0], 100.0], [[102, False, 0], 200.0]],
            "discrete": False,
        },
        example_keep_1_at_21_vs_63_at_600={
            "buckets": [[[21, False, 0], 1], [[600, False, 0], 63]],
            "priorities": [[[21, False, 0], 5.0], [[600, False, 0], 500.0]],
            "discrete": False,
        },
        example_discrete={
            "buckets": [[[21, False, 0], 1], [[600, False, 0], 63]],
            "priorities": [[[21, False, 0], 5.0], [[600, False, 0], 500.0]],
            "discrete": True,
        },
    ) + generated(n, make)


def _select(_b, inp):
    buckets = {tuple(k): [0] * m for k, m in inp["buckets"]}
    priorities = {tuple(k): p for k, p in inp["priorities"]}
    return {"key": list(scheduler.select_running_bucket(buckets, priorities, inp["discrete"]))}


def policy_functions() -> list[Fn]:
    """The capability and scheduler vector functions, in manifest order."""
    c, sch = capability, scheduler
    cap = "reference.capability."
    return [
        Fn(
            "capability",
            "per_sequence_kv_requested",
            "C §2",
            cap + "per_sequence_kv_requested",
            plain(c.per_sequence_kv_requested, "enabled", "value"),
            _flag_cases,
        ),
        Fn(
            "capability",
            "xs_per_sequence_enabled",
            "C §2",
            cap + "xs_per_sequence_enabled",
            plain(c.xs_per_sequence_enabled, "enabled", "value"),
            _flag_cases,
        ),
        Fn(
            "capability",
            "acceptance_logging_enabled",
            "C §2",
            cap + "acceptance_logging_enabled",
            plain(c.acceptance_logging_enabled, "enabled", "value"),
            _flag_cases,
        ),
        Fn(
            "capability",
            "fp8_kv_enabled",
            "C §2",
            cap + "fp8_kv_enabled",
            plain(c.fp8_kv_enabled, "enabled", "value"),
            _flag_cases,
        ),
        Fn(
            "capability",
            "kv_window_retain",
            "C §2",
            cap + "kv_window_retain",
            plain(c.kv_window_retain, "retain", "window"),
            lambda rng, n: [
                (f"domain-window-{w}", {"window": w}) for w in (-1, 0, 1, 2, 128, 4096)
            ],
        ),
        Fn(
            "capability",
            "mtp_tail_isq",
            "C §2",
            cap + "mtp_tail_isq",
            plain(c.mtp_tail_isq, "isq", "isq", "allow_sub_int8"),
            _isq_cases,
        ),
        Fn(
            "capability",
            "seq_may_draft",
            "C §9.2",
            cap + "seq_may_draft",
            _may_draft,
            _may_draft_cases,
        ),
        Fn(
            "capability",
            "cache_supports_per_sequence_advance",
            "C §13",
            cap + "cache_supports_per_sequence_advance",
            lambda _b, i: _checked(
                c.cache_supports_per_sequence_advance,
                cache_of(i["slots"], i["paged"]),
                i["xs_per_seq"],
            ),
            _capability_cases(False),
        ),
        Fn(
            "capability",
            "model_masks_ragged_batches",
            "C §13",
            cap + "model_masks_ragged_batches",
            lambda _b, i: _checked(c.model_masks_ragged_batches, cache_of(i["slots"], i["paged"])),
            _capability_cases(False, with_xs=False),
        ),
        Fn(
            "capability",
            "draft_chain_carries_per_sequence_positions",
            "C §13",
            cap + "draft_chain_carries_per_sequence_positions",
            lambda _b, i: _checked(
                c.draft_chain_carries_per_sequence_positions, cache_of(i["slots"], i["paged"])
            ),
            _capability_cases(False, with_xs=False),
        ),
        Fn(
            "capability",
            "batch_admission_admits_ragged_cohorts",
            "C §13",
            cap + "batch_admission_admits_ragged_cohorts",
            lambda _b, i: _checked(c.batch_admission_admits_ragged_cohorts, i["admission"]),
            lambda rng, n: fixed(
                example_grant={"admission": "grant"}, refusal_refuse={"admission": "refuse"}
            ),
        ),
        Fn(
            "capability",
            "per_sequence_refusal",
            "C §13",
            cap + "per_sequence_refusal",
            _per_sequence_refusal,
            _capability_cases(True),
        ),
        Fn(
            "scheduler",
            "cache_bucket_len",
            "M §15",
            "reference.scheduler.cache_bucket_len",
            plain(sch.cache_bucket_len, "len", "cache_len", "n_tokens"),
            _bucket_len_cases,
        ),
        Fn(
            "scheduler",
            "bucket_keys",
            "M §15",
            "reference.scheduler.bucket_keys",
            _bucket_keys,
            _keys_cases,
        ),
        Fn(
            "scheduler",
            "select_running_bucket",
            "M §16",
            "reference.scheduler.select_running_bucket",
            _select,
            _select_cases,
        ),
        Fn(
            "scheduler",
            "issues_cache_in",
            "M §17",
            "reference.scheduler.issues_cache_in",
            plain(sch.issues_cache_in, "cache_in", "no_kv", "cohort_changed", "granted"),
            _cache_in_cases,
        ),
        Fn(
            "scheduler",
            "engine_cache_instruction",
            "M §18",
            "reference.scheduler.engine_cache_instruction",
            _instruction,
            _instruction_cases,
        ),
    ]
