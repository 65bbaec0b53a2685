"""The function tables that run the vectors: the reference's and the torch port's.

A table maps `"<family>/<function>"` to a callable `inputs -> outputs` (what
examples/vectors_consumer.py is given). `reference_table()` runs every function on the
reference. `port_table(device, dtype)` runs the port: the functions of the backend protocol
through `raggedspec.gpu.backend.TorchBackend` (the same adapter as the reference, a different
backend), and the other rules the port implements through their `gpu.*` function, with its
tensors read back as host values. The host-only rules the port takes from the reference
unchanged (flags, capability, scheduler, step guards, capture offsets, accounting, the length
rules and dispatch predicates it computes on host integers; see the port rows of
docs/rules.md), and the rules no path of the port builds (the masker's causal masks), are
listed in `PORT_HOST_ONLY` and are absent from the port table.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from raggedspec.vectors import functions
from raggedspec.reference.backend import NumpyBackend

# functions whose adapter calls only backend protocol methods: a port backend runs them as is
PROTOCOL = {
    "masks/union_mask",
    "rope/rope_positions",
    "rope/apply_rope",
    "align/front_align",
    "align/strip_dead_prefix",
    "align/concat",
    "align/split",
    "align/front_align_draft_group",
    "attention/dsv4_attention",
}
# host rules the port does not reimplement (it imports the reference's)
PORT_HOST_ONLY = {
    "dispatch/resolve_row_offsets",
    "step/mtp_window",
    "step/window_guard",
    "step/per_seq_advance",
    "capability/per_sequence_kv_requested",
    "capability/xs_per_sequence_enabled",
    "capability/acceptance_logging_enabled",
    "capability/fp8_kv_enabled",
    "capability/kv_window_retain",
    "capability/mtp_tail_isq",
    "capability/seq_may_draft",
    "capability/cache_supports_per_sequence_advance",
    "capability/model_masks_ragged_batches",
    "capability/draft_chain_carries_per_sequence_positions",
    "capability/batch_admission_admits_ragged_cohorts",
    "capability/per_sequence_refusal",
    "scheduler/cache_bucket_len",
    "scheduler/bucket_keys",
    "scheduler/select_running_bucket",
    "scheduler/issues_cache_in",
    "dispatch/resolve_capture_offsets",
    "dispatch/mtp_hidden_capture",
    "capability/kv_advance",
    "accounting/from_fused_verify",
    "accounting/from_verify",
    "accounting/accumulate",
    "accounting/record_batch",
    "scheduler/engine_cache_instruction",
    # length rules the port computes on host integers once per step, with the reference's
    # own functions (no device twin): the step plan's rules
    "dispatch/resolve_row_cache_lens",
    "dispatch/ragged_row_q0",
    "draft/chain_starts",
    "draft/draft_group_keys",
    "draft/draft_groups",
    "step/plan_step_window",
    "step/verify_accept",
    "step/budget_clamp",
    "step/plan_batch_step",
    "step/plan_per_sequence_step",
    "step/verify_proposed",
    "step/window_verify_row",
    "step/n_cache_positions_to_drop",
    "dispatch/resolve_ragged_chain_starts",
    "dispatch/resolve_draft_leads",
    "dispatch/draft_step_end_column",
    # the dispatch predicates and the scalar mask rules: the port's attention and RoPE call the
    # reference's functions on host integers
    "dispatch/resolve_ragged_rows",
    "dispatch/uniform_seqlen_offset",
    "masks/raw_keep_span",
    "masks/sdpa_sliding_window",
    "masks/mask_must_be_applied_as_bias",
    # rules with no tensor path in the port: the masker's causal masks (the port's attention is
    # dsv4's union mask) and the compressed keys' positions (the port's model rotates its
    # compressed keys from its RoPE table)
    "masks/make_left_padded_causal_mask",
    "masks/make_causal_mask_matrix",
    "masks/graph_mode_length_mask",
    "rope/compressed_key_positions",
}


def reference_table() -> dict[str, Callable[[dict], dict]]:
    """Every vector function on the reference (`NumpyBackend`)."""
    backend = NumpyBackend()
    return {fn.key: partial(fn.call, backend) for fn in functions()}


def _mask(x) -> np.ndarray | None:
    return None if x is None else x.detach().cpu().double().numpy()


def _gpu_functions() -> dict[str, Callable[[dict], dict]]:
    from raggedspec.gpu import masks as gm

    def caller(i):
        import torch

        c = i.get("caller")
        out = gm.compose_caller_mask(
            torch.from_numpy(i["local"]),
            None if c is None else torch.from_numpy(c),
            i["t_q"],
            i["t_k_full"],
            i["raw_base"],
            i["t_k"],
            i["t_c"],
        )
        return {"mask": _mask(out)}

    return {"masks/compose_caller_mask": caller}


def port_table(device: str = "cpu", dtype: str = "float64") -> dict[str, Callable[[dict], dict]]:
    """The torch port: protocol functions through `TorchBackend(device, dtype)`, the others
    through their `gpu.*` function; `PORT_HOST_ONLY` functions are left out."""
    from raggedspec.gpu.backend import TorchBackend

    backend = TorchBackend(device=device, dtype=dtype)
    table = {fn.key: partial(fn.call, backend) for fn in functions() if fn.key in PROTOCOL}
    table.update(_gpu_functions())
    return table
