"""The backend protocol's table: every method a backend implements, by section, and what
`clone_in` returns. `reference.backend.Backend` is the protocol itself; the conformance runner
checks a backend against `PROTOCOL` and names what is missing.

Every method touches tensors: the step's integer decisions (window, budgets, leads, offsets,
`row_q0`, draft groups, accepted counts, commit lengths) are the step plan's
(`reference.plan`), computed by the simulator with the reference's own rules and handed to
the backend once per step (`upload_plan`)."""

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
        "upload_plan",
        "cache_len",
        "to_numpy",
        "materialize",
    ),
    "target cache": (
        "clone_in",
        "clone_out",
        "truncate_by",
        "commit",
        "xs_append",
    ),
    "K/V slot": (
        "kv_from_arrays",
        "kv_append",
        "kv_set_len",
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
}
PROTOCOL_METHODS = tuple(m for group in PROTOCOL.values() for m in group)
