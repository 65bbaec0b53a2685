"""The backend protocol's table: every method a backend implements, by section, and what
`clone_in` returns. `reference.backend.Backend` is the protocol itself; the conformance runner
checks a backend against `PROTOCOL` and names what is missing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CloneIn:
    """What `Backend.clone_in` returns: the batched cache, each row's front-alignment lead
    (host ints; all 0 for a batch that was not aligned) and `ragged_decode_supported`."""

    batched: object
    lead_pad: list[int]
    ragged_decode_supported: bool


# Every method of the protocol, in the order of the sections below (the conformance runner
# checks a backend against this list and names what is missing).
PROTOCOL = {
    "construction": (
        "build_model",
        "new_target_cache",
        "new_draft_cache",
        "cache_len",
        "to_numpy",
        "materialize",
    ),
    "target cache": (
        "clone_in",
        "clone_out",
        "truncate_by",
        "commit_per_sequence",
        "set_lens",
        "xs_append",
    ),
    "K/V slot": (
        "kv_from_arrays",
        "kv_append",
        "kv_set_len",
        "kv_len",
        "front_align",
        "strip_dead_prefix",
        "concat",
        "split",
        "front_align_draft_group",
    ),
    "masks, positions, attention": ("rope_positions", "apply_rope", "union_mask", "dsv4_attention"),
    "model and draft": (
        "forward",
        "mtp_step",
        "propose_chain",
        "draft_chain",
        "extend_draft_kvs",
        "prime_draft_kv",
    ),
    "length vectors": (
        "resolve_row_cache_lens",
        "ragged_row_q0",
        "plan_step_window",
        "token_budget",
        "draft_groups",
        "draft_group_keys",
        "chain_starts",
        "verify_accept",
        "budget_clamp",
        "plan_batch_step",
        "plan_per_sequence_step",
    ),
}
PROTOCOL_METHODS = tuple(m for group in PROTOCOL.values() for m in group)
