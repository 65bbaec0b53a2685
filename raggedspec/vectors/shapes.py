"""The JSON shape of every vector function's inputs and outputs (`SHAPES`), by function key.

Each entry gives `registry.Fn`'s `inputs`, `outputs`, `tensor_inputs`, `tensor_outputs`
(and, for the K/V slot rules, `policy` and `policy_cases`): what a consumer reads and returns.
`schema.case_schema` writes them as each function's schema.json, and the vectors' tests check
every written case against it, so a declaration here cannot drift from what the cases hold.
"""

from __future__ import annotations

from raggedspec.vectors.schema import (
    BOOL,
    INT,
    NULL,
    NUM,
    STR,
    Maybe,
    arr,
    doc,
    enum,
    obj,
    opt,
    tensor,
    tup,
)

INTS = arr(INT)
ADVANCE = enum("Cohort", "PerSequence")
WORLD = enum("W0", "WA", "WB")
ADMISSION = enum("refuse", "grant")
SLOTS = doc(arr(STR), 'slot kinds in layer order: "Normal", "XsRolling:<ratio>", "Rotating", '
            '"TurboQuant"')
KEY = doc(tup(INT, BOOL, INT), "a scheduler key [len, images, token_offset]")
FLAG = {"value": doc(opt(STR), "the environment variable's value; null when it is unset")}
COUNTERS = doc(
    obj(
        {
            "accepted": INT,
            "proposed": INT,
            "steps": INT,
            "drafted_steps": INT,
            "committed": INT,
            "batch_steps": INT,
            "pos_over_cap": INT,
            "accepted_at": doc(INTS, "per draft position, 8 long"),
            "reached_at": doc(INTS, "per draft position, 8 long"),
        }
    ),
    "the MtpAcceptance counters",
)
OP = obj({"kind": enum("In", "Nothing", "Out", "Reset"), "load_preallocated_cache": BOOL,
          "reset_non_granular": BOOL})
SEQ = obj({"id": INT, "n_tokens": INT, "cache_len": doc(opt(INT), "null before a cache exists"),
           "is_prompt": BOOL, "token_offset": INT, "images": BOOL})
F64 = tensor("F64", 4)
KV_IN = {"k.<i>": F64, "v.<i>": F64}
KV_JSON_IN = {"n_rows": INT, "max_seq_len": INT}
CAPACITY = doc(INTS, "per slot, its buffer capacity: engine policy (512-column growth)")
KV_OUT = {"lens": INTS, "capacities": CAPACITY, "k.<i>": Maybe(NULL), "v.<i>": Maybe(NULL)}
KV = dict(tensor_inputs=KV_IN, tensor_outputs=KV_IN, policy=("capacities",))
CAPABILITY_IN = {"slots": SLOTS, "paged": BOOL}
OK = {"ok": doc(BOOL, "true: the check passed (a refusal is raised otherwise)")}
MASK = {"mask": F64}

SHAPES: dict[str, dict] = {
    # ------------------------------------------------------------------ dispatch
    "dispatch/resolve_ragged_rows": dict(
        inputs={"rows": opt(INTS), "q0": INT, "b": INT},
        outputs={"rows": doc(opt(INTS), "null: the uniform (scalar) path")},
    ),
    "dispatch/uniform_seqlen_offset": dict(
        inputs={"offsets": INTS}, outputs={"offset": doc(opt(INT), "null: not uniform")}
    ),
    "dispatch/resolve_row_offsets": dict(
        inputs={"per_seq": arr(opt(INT)), "shared": INT}, outputs={"offsets": opt(INTS)}
    ),
    "dispatch/resolve_row_cache_lens": dict(
        inputs={"enabled": BOOL, "cache_len": INT, "lead_pad": INTS},
        outputs={"row_cache_lens": doc(opt(INTS), "null: every row at cache_len")},
    ),
    "dispatch/resolve_ragged_chain_starts": dict(
        inputs={"starts": INTS}, outputs={"starts": opt(INTS)}
    ),
    "dispatch/resolve_draft_leads": dict(
        inputs={"enabled": BOOL, "starts": INTS}, outputs={"leads": opt(INTS)}
    ),
    "dispatch/ragged_row_q0": dict(
        inputs={"offsets": INTS, "per_seq_kv": BOOL}, outputs={"row_q0": opt(INTS)}
    ),
    "dispatch/draft_step_end_column": dict(
        inputs={"start_pos": INTS, "b": INT, "cached": INT}, outputs={"end_column": INT}
    ),
    "dispatch/resolve_capture_offsets": dict(
        inputs={"offsets": INTS, "b": INT, "rows": INTS},
        outputs={
            "values": INTS,
            "describes": BOOL,
            "row": doc(arr(opt(INT)), "row(r) for each r of `rows`; null: no offset"),
        },
    ),
    "dispatch/mtp_hidden_capture": dict(
        inputs={
            "ops": doc(
                arr({"anyOf": [
                    tup(enum("arm", "take", "clear")),
                    tup({"const": "store_rows"}, INTS, INT),
                    tup({"const": "store"}, INT, INT),
                ]}),
                '["arm"], ["store_rows", offsets, h], ["store", start, h], ["take"], ["clear"]; '
                "h is an opaque tag standing for the hidden tensor",
            )
        },
        outputs={
            "taken": doc(arr(opt(obj({"offsets": INTS, "h": INT}))),
                         "what each take returned; null: nothing stored")
        },
    ),
    # ------------------------------------------------------------------ draft
    "draft/chain_starts": dict(
        inputs={"cache_lens": INTS, "uncached": INTS}, outputs={"starts": INTS}
    ),
    "draft/draft_group_keys": dict(
        inputs={"uncached": INTS, "cache_lens": INTS, "carries_per_row": BOOL},
        outputs={"keys": doc(arr(tup(INT, INT)), "[u, chain start or 0] per row")},
    ),
    "draft/draft_groups": dict(
        inputs={"uncached": INTS, "cache_lens": INTS, "may_draft": arr(BOOL), "w": INT,
                "per_seq_advance": BOOL},
        outputs={
            "groups": doc(
                arr(tup(INT, INT, INTS)),
                "[u, chain start (0 when keys carry per-row starts), rows ascending] per "
                "group, in key order",
            )
        },
    ),
    # ------------------------------------------------------------------ step
    "step/mtp_window": dict(inputs={"depth": INT}, outputs={"w": INT}),
    "step/plan_step_window": dict(
        inputs={"cache_lens": INTS, "tok_lens": INTS, "w": INT},
        outputs={"uncached": INTS, "ok": BOOL},
    ),
    "step/window_verify_row": dict(inputs={"u": INT, "j": INT}, outputs={"row": INT}),
    "step/verify_accept": dict(
        inputs={"proposed": arr(INTS), "targets": arr(INTS)},
        outputs={"accepted": doc(INTS, "accepted drafts per row")},
    ),
    "step/verify_proposed": dict(
        inputs={"proposed": arr(INTS), "targets": arr(INTS)},
        outputs={
            "accepted": doc(arr(INTS), "the accepted tokens per row"),
            "rejections": doc(arr(opt(tup(INT, INT))), "[proposed, target] at the first "
                              "mismatch per row; null when every draft was accepted"),
        },
    ),
    "step/n_cache_positions_to_drop": dict(
        inputs={"proposed": INTS, "target": INTS}, outputs={"commit_len": INT, "n_drop": INT}
    ),
    "step/budget_clamp": dict(
        inputs={"max_seq_len": INT, "tok_lens": INTS, "accepted": INTS},
        outputs={"budgets": INTS, "accepted": INTS},
    ),
    "step/plan_batch_step": dict(
        inputs={"uncached": INTS, "accepted": INTS, "w": INT},
        outputs={"keep": INT, "n_drop": INT, "next_uncached": INTS},
    ),
    "step/plan_per_sequence_step": dict(
        inputs={"uncached": INTS, "accepted": INTS, "w": INT},
        outputs={"committed": INTS, "dropped": INTS, "next_uncached": INTS},
    ),
    "step/window_guard": dict(
        inputs={"row_cache_lens_is_some": BOOL, "advance": ADVANCE},
        outputs={"guard": enum("left_aligned_guard", "follows_guard", "defer")},
    ),
    "step/per_seq_advance": dict(
        inputs={"assembled_here": BOOL, "post_op_out": BOOL, "advance": ADVANCE},
        outputs={"per_seq_advance": BOOL},
    ),
    # ------------------------------------------------------------------ capability
    "capability/per_sequence_kv_requested": dict(inputs=FLAG, outputs={"enabled": BOOL}),
    "capability/xs_per_sequence_enabled": dict(inputs=FLAG, outputs={"enabled": BOOL}),
    "capability/acceptance_logging_enabled": dict(inputs=FLAG, outputs={"enabled": BOOL}),
    "capability/fp8_kv_enabled": dict(inputs=FLAG, outputs={"enabled": BOOL}),
    "capability/kv_window_retain": dict(inputs={"window": INT}, outputs={"retain": INT}),
    "capability/mtp_tail_isq": dict(
        inputs={"isq": opt(STR), "allow_sub_int8": BOOL}, outputs={"isq": opt(STR)}
    ),
    "capability/seq_may_draft": dict(
        inputs={"temperature": opt(NUM), "frequency_penalty": opt(NUM),
                "presence_penalty": opt(NUM), "repetition_penalty": opt(NUM), "dry": BOOL,
                "custom_processor": BOOL},
        outputs={"may_draft": BOOL},
    ),
    "capability/cache_supports_per_sequence_advance": dict(
        inputs=CAPABILITY_IN | {"xs_per_seq": BOOL}, outputs=OK
    ),
    "capability/model_masks_ragged_batches": dict(inputs=CAPABILITY_IN, outputs=OK),
    "capability/draft_chain_carries_per_sequence_positions": dict(
        inputs=CAPABILITY_IN, outputs=OK
    ),
    "capability/batch_admission_admits_ragged_cohorts": dict(
        inputs={"admission": ADMISSION}, outputs=OK
    ),
    "capability/per_sequence_refusal": dict(
        inputs=CAPABILITY_IN | {"xs_per_seq": BOOL, "admission": ADMISSION},
        outputs={
            "refusal": doc(opt(obj({"class": STR, "message": STR})),
                           "null: per-sequence advance may be granted; else the first refusal")
        },
    ),
    "capability/kv_advance": dict(
        inputs={"requested": BOOL, "xs_per_seq": BOOL, "admission": ADMISSION,
                "calls": doc(arr(SLOTS), "one cache (its slot kinds) per call")},
        outputs={"decisions": arr(ADVANCE), "refusal": opt(STR), "messages": arr(STR)},
    ),
    # ------------------------------------------------------------------ scheduler
    "scheduler/cache_bucket_len": dict(
        inputs={"cache_len": opt(INT), "n_tokens": INT}, outputs={"len": INT}
    ),
    "scheduler/bucket_keys": dict(
        inputs={"world": WORLD, "granted": BOOL, "ragged_decode_supported": BOOL,
                "running": arr(SEQ)},
        outputs={"keys": doc(arr(arr({"anyOf": [INT, BOOL]})), "one key per running sequence"),
                 "ragged_bucket_len": opt(INT)},
    ),
    "scheduler/select_running_bucket": dict(
        inputs={"buckets": doc(arr(tup(KEY, INT)), "[key, member count] pairs"),
                "priorities": doc(arr(tup(KEY, NUM)), "[key, summed priority] pairs"),
                "discrete": BOOL},
        outputs={"key": KEY},
    ),
    "scheduler/issues_cache_in": dict(
        inputs={"no_kv": BOOL, "cohort_changed": BOOL, "granted": BOOL},
        outputs={"cache_in": BOOL},
    ),
    "scheduler/engine_cache_instruction": dict(
        inputs={"world": WORLD, "batch": enum("completion", "prompt"), "ids": INTS,
                "last_completion_ids": INTS, "no_kv_cache": BOOL, "granted": BOOL,
                "first_token_offset": INT},
        outputs={"pre_op": OP, "post_op": OP},
    ),
    # ------------------------------------------------------------------ accounting
    "accounting/from_fused_verify": dict(
        inputs={"d": doc(INT, "drafted"), "a": doc(INT, "accepted")}, outputs={"step": COUNTERS}
    ),
    "accounting/from_verify": dict(
        inputs={"d": INT, "proposed": INTS, "target": INTS}, outputs={"step": COUNTERS}
    ),
    "accounting/accumulate": dict(
        inputs={"every": INT, "steps": doc(arr(tup(INT, INT)), "[drafted, accepted] per step")},
        outputs={"fired": arr(BOOL), "total": COUNTERS},
    ),
    "accounting/record_batch": dict(
        inputs={"batches": doc(arr(arr(tup(INT, INT))), "per batch, [drafted, accepted] per row")},
        outputs={"by_batch": doc(arr(tup(INT, COUNTERS)), "[batch size, counters], ascending"),
                 "total_batch_steps": INT},
    ),
    # ------------------------------------------------------------------ masks, RoPE, attention
    "masks/raw_keep_span": dict(
        inputs={"t_q": INT, "window": INT, "t_k_full": INT},
        outputs={"raw_base": INT, "keep": INT},
    ),
    "masks/union_mask": dict(
        inputs={"t_q": INT, "t_k_full": INT, "row_q0": opt(INTS), "window": INT, "ratio": INT,
                "t_c": INT},
        tensor_outputs=MASK,
    ),
    "masks/make_left_padded_causal_mask": dict(
        inputs={"b": INT, "t_q": INT, "past": INT, "live": INTS}, tensor_outputs=MASK
    ),
    "masks/make_causal_mask_matrix": dict(
        inputs={"b": INT, "t_q": INT, "past": INT, "per_seq_kv_lens": opt(INTS),
                "channel_lead": opt(INTS), "flash_on_cuda": BOOL},
        outputs={"mask": Maybe(doc(NULL, "no mask: t_q 1 without a ragged lead"))},
        tensor_outputs={"mask": doc(tensor("F64"), "[B, 1, t_q, past + t_q] left-padded, "
                                    "[t_q, past + t_q] causal, or the [1, 1] flash placeholder")},
    ),
    "masks/graph_mode_length_mask": dict(
        inputs={"positions": INTS, "cap": INT}, tensor_outputs=MASK
    ),
    "masks/compose_caller_mask": dict(
        inputs={"t_q": INT, "t_k_full": INT, "raw_base": INT, "t_k": INT, "t_c": INT,
                "has_caller": BOOL},
        tensor_inputs={"local": F64, "caller": tensor("F64")},
        tensor_outputs=MASK,
    ),
    "masks/sdpa_sliding_window": dict(
        inputs={"ratio": INT, "w": INT}, outputs={"window": opt(INT)}
    ),
    "masks/mask_must_be_applied_as_bias": dict(
        inputs={"dims": opt(INTS)}, outputs={"bias": BOOL}
    ),
    "rope/rope_positions": dict(
        inputs={"offsets": INTS, "b": INT, "t": INT},
        tensor_outputs={"positions": tensor("I64", 2)},
    ),
    "rope/apply_rope": dict(
        inputs={"offsets": INTS, "rope_dims": INT, "theta": NUM, "inverse": BOOL},
        tensor_inputs={"x": F64},
        tensor_outputs={"y": F64},
    ),
    "rope/compressed_key_positions": dict(
        inputs={"t_c": INT, "ratio": INT}, outputs={"positions": INTS}
    ),
    "attention/dsv4_attention": dict(
        inputs={"compress_ratio": INT, "sliding_window": INT, "raw_prefix": INT,
                "row_q0": opt(INTS), "has_compressed_kv": BOOL, "has_sinks": BOOL},
        tensor_inputs={"q": F64, "k": F64, "v": F64, "compressed_kv": F64,
                       "sinks": tensor("F64", 1)},
        tensor_outputs={"out": F64},
    ),
    # ------------------------------------------------------------------ K/V slots
    "align/front_align": dict(
        inputs=KV_JSON_IN,
        outputs=KV_OUT | {"leads": INTS},
        policy_cases=("refusal-capacity-above-max-seq-len",),
        **KV,
    ),
    "align/strip_dead_prefix": dict(inputs=KV_JSON_IN | {"lead": INT}, outputs=KV_OUT, **KV),
    "align/concat": dict(
        inputs=KV_JSON_IN | {"capacities": Maybe(doc(INTS, "per slot; default 512"))},
        outputs=KV_OUT,
        **KV,
    ),
    "align/split": dict(
        inputs=KV_JSON_IN | {"rows_of_batch": INT, "g": INT},
        outputs={
            "pieces": doc(opt(INT), "null: the piece count is not g"),
            "lens": Maybe(INTS),
            "capacities": Maybe(CAPACITY),
            "k.<i>": Maybe(NULL),
            "v.<i>": Maybe(NULL),
        },
        **KV,
    ),
    "align/front_align_draft_group": dict(
        inputs=KV_JSON_IN | {"starts": INTS}, outputs=KV_OUT, **KV
    ),
}
