"""Vector functions of the length rules: dispatch resolvers, draft group keys and chain starts,
the step window, accept / advance and the budget clamp.

Each `Fn` (see `registry`) pairs an adapter with its cases: the spec's worked examples and
refusals, then generated ragged / uniform / empty / boundary batches. These are host rules
of the step plan (`reference.plan`): no backend implements them, so their adapters call the
reference's functions (`length_rules.LengthRules`) whatever backend they are given.
"""

from __future__ import annotations

from raggedspec.vectors.registry import Fn, fixed, generated, leads, lengths, plain
from raggedspec.reference import dispatch, step
from raggedspec.vectors.length_rules import RULES
from raggedspec.reference.capability import KvAdvance



# ------------------------------------------------------------------------------ dispatch


def _ragged_rows_cases(rng, n):
    def make(shape, i):
        rows = lengths(rng, shape, 0, 30)
        q0 = max(rows, default=int(rng.integers(0, 30)))
        b = len(rows) if i % 8 < 6 else len(rows) + 1
        if i % 5 == 4 and rows:
            q0 += int(rng.integers(-1, 2))
        return {"rows": None if i % 11 == 10 else rows, "q0": q0, "b": b}

    return fixed(
        example_none={"rows": None, "q0": 12, "b": 3},
        example_uniform={"rows": [7, 7, 7, 7], "q0": 7, "b": 4},
        example_ragged={"rows": [12, 10, 7], "q0": 12, "b": 3},
        example_uniform_wrong_width={"rows": [9, 9], "q0": 9, "b": 3},
        refusal_width={"rows": [6, 4], "q0": 6, "b": 3},
        refusal_ahead={"rows": [7, 4, 2], "q0": 6, "b": 3},
        refusal_too_many_rows={"rows": [6, 4, 2], "q0": 6, "b": 2},
        refusal_no_row_at_end={"rows": [5, 4, 2], "q0": 6, "b": 3},
    ) + generated(n, make)


def _offsets_cases(rng, n):
    return fixed(
        example_uniform={"offsets": [6, 6, 6]},
        example_ragged={"offsets": [6, 4, 2]},
        example_empty={"offsets": []},
    ) + generated(n, lambda shape, i: {"offsets": lengths(rng, shape, 0, 600)})


def _row_offsets_cases(rng, n):
    def make(shape, i):
        lens = lengths(rng, shape, 0, 50)
        return {
            "per_seq": [None if rng.random() < 0.4 else x for x in lens],
            "shared": int(rng.integers(0, 50)),
        }

    return fixed(
        example_shared={"per_seq": [None, None], "shared": 5},
        example_one_override={"per_seq": [None, 9], "shared": 5},
        example_equal_overrides={"per_seq": [7, 7], "shared": 0},
    ) + generated(n, make)


def _row_cache_lens_cases(rng, n):
    def make(shape, i):
        lens = lengths(rng, shape, 0, 40)
        c = max(lens, default=int(rng.integers(0, 40)))
        lp = leads(lens)
        if i % 7 == 5 and lp:
            lp = [x + 1 for x in lp]  # nobody at the shared end column
        if i % 9 == 8 and lp:
            lp[0] = c + 1  # wider than the cache
        return {"enabled": i % 6 != 3, "cache_len": c, "lead_pad": lp}

    return fixed(
        example_ragged={"enabled": True, "cache_len": 12, "lead_pad": [0, 2, 5]},
        example_all_zero={"enabled": True, "cache_len": 12, "lead_pad": [0, 0]},
        example_disabled={"enabled": False, "cache_len": 12, "lead_pad": [0, 2]},
        example_leads_0_7_0_3={"enabled": True, "cache_len": 40, "lead_pad": [0, 7, 0, 3]},
        refusal_wider_than_cache={"enabled": True, "cache_len": 4, "lead_pad": [0, 5]},
        refusal_every_row_dead={"enabled": True, "cache_len": 12, "lead_pad": [1, 2]},
    ) + generated(n, make)


def _starts_cases(rng, n, with_flag=False):
    def make(shape, i):
        inp = {"starts": lengths(rng, shape, 0, 60)}
        if with_flag:
            inp["enabled"] = i % 5 != 2
        return inp

    ex = {
        "example_ragged": {"starts": [10, 7, 12]},
        "example_uniform": {"starts": [9, 9]},
        "example_empty": {"starts": []},
        "example_40_33_37_40": {"starts": [40, 33, 37, 40]},
    }
    if with_flag:
        ex = {k: dict(v, enabled=True) for k, v in ex.items()}
        ex["example_disabled"] = {"starts": [10, 7], "enabled": False}
    return fixed(**ex) + generated(n, make)


def _end_column_cases(rng, n):
    def make(shape, i):
        pos = lengths(rng, shape, 0, 40)
        b = len(pos) if i % 6 != 5 else len(pos) + 2
        if i % 7 == 3 and pos:
            pos, b = pos[:1], max(b, 2)
        cached = max(pos, default=0) if i % 4 != 1 else max(pos, default=0) + 1
        return {"start_pos": pos, "b": b, "cached": cached}

    return fixed(
        example_batch_max={"start_pos": [10, 7, 12], "b": 3, "cached": 12},
        example_one_position={"start_pos": [9], "b": 4, "cached": 9},
        refusal_no_position={"start_pos": [], "b": 2, "cached": 0},
        refusal_width={"start_pos": [3, 4], "b": 3, "cached": 4},
        refusal_desync={"start_pos": [3, 4], "b": 2, "cached": 7},
    ) + generated(n, make)


def _row_q0_cases(rng, n):
    return fixed(
        example_on={"offsets": [10, 7], "per_seq_kv": True},
        example_off={"offsets": [10, 7], "per_seq_kv": False},
    ) + generated(
        n, lambda shape, i: {"offsets": lengths(rng, shape, 0, 60), "per_seq_kv": i % 3 != 2}
    )


# ------------------------------------------------------------------------------ draft


def _window_inputs(rng, shape, i, w):
    c = lengths(rng, shape, 0, 30)
    u = [int(x) for x in rng.integers(0, w + 2, size=len(c))]
    return c, u


def _chain_start_cases(rng, n):
    def make(shape, i):
        c, u = _window_inputs(rng, shape, i, 4)
        return {"cache_lens": c, "uncached": u}

    return fixed(
        example_seed_pair={"cache_lens": [40, 33, 37], "uncached": [1, 1, 1]},
        malformed_no_pair={"cache_lens": [1], "uncached": [0]},
    ) + generated(n, make)


# cache-and-draft §9.1's examples: u = 1 at eight lengths (8 keys vs 1), and eight tails at one
# shared length (4 keys under either flag)
EIGHT_LENGTHS = {"uncached": [1] * 8, "cache_lens": [40, 33, 37, 31, 39, 35, 30, 38]}
EIGHT_TAILS = {"uncached": [1, 2, 1, 3, 2, 1, 4, 1], "cache_lens": [40] * 8}


def _group_key_cases(rng, n):
    def make(shape, i):
        c, u = _window_inputs(rng, shape, i, 4)
        return {"uncached": u, "cache_lens": c, "carries_per_row": i % 2 == 0}

    return fixed(
        example_scalar={"uncached": [1, 1], "cache_lens": [40, 33], "carries_per_row": False},
        example_per_row={"uncached": [1, 1], "cache_lens": [40, 33], "carries_per_row": True},
        example_u_zero={"uncached": [0], "cache_lens": [5], "carries_per_row": False},
        example_eight_lengths_scalar=dict(EIGHT_LENGTHS, carries_per_row=False),
        example_eight_lengths_per_row=dict(EIGHT_LENGTHS, carries_per_row=True),
    ) + generated(n, make)


def _groups_cases(rng, n):
    def make(shape, i):
        c, u = _window_inputs(rng, shape, i, 4)
        return {
            "uncached": u,
            "cache_lens": c,
            "may_draft": [bool(rng.random() < 0.8) for _ in c],
            "w": 4,
            "per_seq_advance": i % 2 == 1,
        }

    ex = {
        "uncached": [1, 1, 1],
        "cache_lens": [40, 33, 37],
        "may_draft": [True, True, True],
        "w": 4,
    }
    return fixed(
        example_cohort=dict(ex, per_seq_advance=False),
        example_per_sequence=dict(ex, per_seq_advance=True),
        example_may_not_draft=dict(ex, may_draft=[True, False, True], per_seq_advance=True),
        **{
            f"example_eight_{what}_{adv}": dict(
                rows, may_draft=[True] * 8, w=5, per_seq_advance=adv == "per_sequence"
            )
            for what, rows in (("lengths", EIGHT_LENGTHS), ("tails", EIGHT_TAILS))
            for adv in ("cohort", "per_sequence")
        },
    ) + generated(n, make)


def _draft_groups(b, inp):
    groups = RULES.draft_groups(
        inp["uncached"], inp["cache_lens"], inp["may_draft"], inp["w"], inp["per_seq_advance"]
    )
    return {
        "groups": [[int(k[0]), int(k[1]), [int(r) for r in rows]] for k, rows in groups.items()]
    }


# ------------------------------------------------------------------------------ step


def _step_window_cases(rng, n):
    def make(shape, i):
        c = lengths(rng, shape, 0, 30)
        return {"cache_lens": c, "tok_lens": [x + int(rng.integers(0, 6)) for x in c], "w": 4}

    return fixed(
        example_per_row={"cache_lens": [40, 33, 37], "tok_lens": [41, 34, 38], "w": 4},
        example_shared_width={"cache_lens": [40, 40, 40], "tok_lens": [41, 34, 38], "w": 4},
        example_not_ok={"cache_lens": [12, 12], "tok_lens": [13, 9], "w": 4},
        example_u_equals_w={"cache_lens": [10, 10], "tok_lens": [14, 11], "w": 4},
        example_u_past_w={"cache_lens": [10, 10], "tok_lens": [15, 11], "w": 4},
    ) + generated(n, make)


def _accept_inputs(rng, shape, w=4):
    u = [max(1, x) for x in lengths(rng, shape, 1, w)]
    a = [int(rng.integers(0, w)) for _ in u]
    return u, a


def _plan_cases(rng, n):
    def make(shape, i):
        u, a = _accept_inputs(rng, shape)
        return {"uncached": u, "accepted": a, "w": 4}

    return fixed(
        example_cohort={"uncached": [1, 1, 1], "accepted": [3, 0, 1], "w": 4},
        example_all_accept={"uncached": [1, 1], "accepted": [3, 3], "w": 4},
        example_u_1_1_2_a_3_0_1={"uncached": [1, 1, 2], "accepted": [3, 0, 1], "w": 4},
        example_w5_seven_rows={
            "uncached": [1, 1, 2, 3, 5, 1, 4],
            "accepted": [0, 4, 3, 2, 0, 1, 0],
            "w": 5,
        },
    ) + generated(n, make)


def _verify_cases(rng, n):
    def make(shape, i):
        rows = lengths(rng, shape, 0, 5)
        props = [[int(x) for x in rng.integers(0, 4, size=m)] for m in rows]
        targ = [
            [int(x) for x in rng.integers(0, 4, size=m + int(rng.integers(0, 2)))] for m in rows
        ]
        return {"proposed": props, "targets": targ}

    return fixed(
        example_lossless={
            "proposed": [[5, 6, 7], [5, 6, 7], [1]],
            "targets": [[5, 6, 7, 8], [5, 9, 7, 8], [2, 3]],
        }
    ) + generated(n, make)


def _verify_rows(_b, inp):
    rows = [
        step.verify_proposed(p, t) for p, t in zip(inp["proposed"], inp["targets"], strict=True)
    ]
    return {
        "accepted": [v.accepted for v in rows],
        "rejections": [None if v.rejection is None else list(v.rejection) for v in rows],
    }


def _budget_cases(rng, n):
    def make(shape, i):
        toks = lengths(rng, shape, 0, 70)
        return {
            "max_seq_len": 64,
            "tok_lens": toks,
            "accepted": [int(rng.integers(0, 5)) for _ in toks],
        }

    return fixed(
        example_room_for_sampled={
            "max_seq_len": 64,
            "tok_lens": [60, 62, 63, 64, 70],
            "accepted": [3, 3, 3, 3, 3],
        }
    ) + generated(n, make)


def _budget_clamp(b, inp):
    budgets = RULES.token_budget(inp["max_seq_len"], inp["tok_lens"])
    return {
        "budgets": [int(x) for x in budgets],
        "accepted": [int(x) for x in RULES.budget_clamp(inp["accepted"], budgets)],
    }


def _verify_row_cases(rng, n):
    return fixed(example_u1_j0={"u": 1, "j": 0}, example_u3_j2={"u": 3, "j": 2}) + generated(
        n, lambda shape, i: {"u": int(rng.integers(1, 6)), "j": int(rng.integers(0, 6))}
    )


def _rollback_cases(rng, n):
    return fixed(
        example_rejected={"proposed": [5, 6, 7], "target": [5, 9, 7, 8]},
        example_all_accepted={"proposed": [5, 6], "target": [5, 6]},
    ) + generated(
        n,
        lambda shape, i: {
            "proposed": [int(x) for x in rng.integers(0, 3, size=int(rng.integers(0, 5)))],
            "target": [int(x) for x in rng.integers(0, 3, size=int(rng.integers(0, 6)))],
        },
    )


def _rollback(_b, inp):
    v = step.verify_proposed(inp["proposed"], inp["target"])
    return {
        "commit_len": v.commit_len,
        "n_drop": step.n_cache_positions_to_drop(len(inp["proposed"]), v),
    }


def _guard_cases(rng, n):
    return [
        (
            f"domain-{'some' if some else 'none'}-{adv.value}",
            {"row_cache_lens_is_some": some, "advance": adv.value},
        )
        for some in (False, True)
        for adv in KvAdvance
    ]


def _per_seq_advance_cases(rng, n):
    return [
        (
            f"domain-{int(a)}{int(o)}-{adv.value}",
            {"assembled_here": a, "post_op_out": o, "advance": adv.value},
        )
        for a in (False, True)
        for o in (False, True)
        for adv in KvAdvance
    ]


def length_functions() -> list[Fn]:
    """The dispatch, draft and step vector functions, in manifest order."""
    d, s = dispatch, step
    return [
        Fn(
            "dispatch",
            "resolve_ragged_rows",
            "M §2",
            "reference.dispatch.resolve_ragged_rows",
            plain(d.resolve_ragged_rows, "rows", "rows", "q0", "b"),
            _ragged_rows_cases,
        ),
        Fn(
            "dispatch",
            "uniform_seqlen_offset",
            "M §11",
            "reference.dispatch.uniform_seqlen_offset",
            plain(d.uniform_seqlen_offset, "offset", "offsets"),
            _offsets_cases,
        ),
        Fn(
            "dispatch",
            "resolve_row_offsets",
            "M §22",
            "reference.dispatch.resolve_row_offsets",
            plain(d.resolve_row_offsets, "offsets", "per_seq", "shared"),
            _row_offsets_cases,
        ),
        Fn(
            "dispatch",
            "resolve_row_cache_lens",
            "C §8.2",
            "reference.dispatch.resolve_row_cache_lens",
            lambda b, i: {
                "row_cache_lens": RULES.resolve_row_cache_lens(
                    i["enabled"], i["cache_len"], i["lead_pad"]
                )
            },
            _row_cache_lens_cases,
        ),
        Fn(
            "dispatch",
            "resolve_ragged_chain_starts",
            "C §9.4",
            "reference.dispatch.resolve_ragged_chain_starts",
            plain(d.resolve_ragged_chain_starts, "starts", "starts"),
            _starts_cases,
        ),
        Fn(
            "dispatch",
            "resolve_draft_leads",
            "C §9.5",
            "reference.dispatch.resolve_draft_leads",
            plain(d.resolve_draft_leads, "leads", "enabled", "starts"),
            lambda rng, n: _starts_cases(rng, n, with_flag=True),
        ),
        Fn(
            "dispatch",
            "ragged_row_q0",
            "M §12",
            "reference.dispatch.ragged_row_q0",
            lambda b, i: {"row_q0": RULES.ragged_row_q0(i["offsets"], i["per_seq_kv"])},
            _row_q0_cases,
        ),
        Fn(
            "dispatch",
            "draft_step_end_column",
            "C §10.1",
            "reference.dispatch.draft_step_end_column",
            plain(d.draft_step_end_column, "end_column", "start_pos", "b", "cached"),
            _end_column_cases,
        ),
        Fn(
            "draft",
            "chain_starts",
            "C §9.1",
            "reference.dispatch.chain_start_of",
            lambda b, i: {"starts": RULES.chain_starts(i["cache_lens"], i["uncached"])},
            _chain_start_cases,
        ),
        Fn(
            "draft",
            "draft_group_keys",
            "C §9.1",
            "reference.dispatch.draft_group_key",
            lambda b, i: {
                "keys": [
                    list(k)
                    for k in RULES.draft_group_keys(
                        i["uncached"], i["cache_lens"], i["carries_per_row"]
                    )
                ]
            },
            _group_key_cases,
        ),
        Fn(
            "draft",
            "draft_groups",
            "C §9.1",
            "reference.dispatch.draft_groups",
            _draft_groups,
            _groups_cases,
        ),
        Fn(
            "step",
            "mtp_window",
            "C §2",
            "reference.step.mtp_window",
            plain(s.mtp_window, "w", "depth"),
            lambda rng, n: [(f"domain-depth-{x}", {"depth": x}) for x in range(-1, 10)],
        ),
        Fn(
            "step",
            "plan_step_window",
            "C §8.1",
            "reference.step.plan_step_window",
            lambda b, i: dict(
                zip(
                    ("uncached", "ok"),
                    RULES.plan_step_window(i["cache_lens"], i["tok_lens"], i["w"]),
                    strict=True,
                )
            ),
            _step_window_cases,
        ),
        Fn(
            "step",
            "window_verify_row",
            "C §8.3",
            "reference.step.window_verify_row",
            plain(s.window_verify_row, "row", "u", "j"),
            _verify_row_cases,
        ),
        Fn(
            "step",
            "verify_accept",
            "C §11.1",
            "reference.step.verify_proposed",
            lambda b, i: {"accepted": RULES.verify_accept(i["proposed"], i["targets"])},
            _verify_cases,
        ),
        Fn(
            "step",
            "verify_proposed",
            "C §11.1",
            "reference.step.verify_proposed",
            _verify_rows,
            _verify_cases,
        ),
        Fn(
            "step",
            "n_cache_positions_to_drop",
            "C §12.3",
            "reference.step.n_cache_positions_to_drop",
            _rollback,
            _rollback_cases,
        ),
        Fn(
            "step",
            "budget_clamp",
            "C §11.2",
            "reference.step.budget_clamp",
            _budget_clamp,
            _budget_cases,
        ),
        Fn(
            "step",
            "plan_batch_step",
            "C §12.1",
            "reference.step.plan_batch_step",
            lambda b, i: dict(
                zip(
                    ("keep", "n_drop", "next_uncached"),
                    RULES.plan_batch_step(i["uncached"], i["accepted"], i["w"]),
                    strict=True,
                )
            ),
            _plan_cases,
        ),
        Fn(
            "step",
            "plan_per_sequence_step",
            "C §12.2",
            "reference.step.plan_per_sequence_step",
            lambda b, i: dict(
                zip(
                    ("committed", "dropped", "next_uncached"),
                    RULES.plan_per_sequence_step(i["uncached"], i["accepted"], i["w"]),
                    strict=True,
                )
            ),
            _plan_cases,
        ),
        Fn(
            "step",
            "window_guard",
            "C §16",
            "reference.step.window_guard",
            lambda _b, i: {
                "guard": s.window_guard(i["row_cache_lens_is_some"], KvAdvance(i["advance"]))
            },
            _guard_cases,
        ),
        Fn(
            "step",
            "per_seq_advance",
            "C §16",
            "reference.step.per_seq_advance",
            lambda _b, i: {
                "per_seq_advance": s.per_seq_advance(
                    i["assembled_here"], i["post_op_out"], KvAdvance(i["advance"])
                )
            },
            _per_seq_advance_cases,
        ),
    ]
