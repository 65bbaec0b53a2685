"""The function tables that run the vectors: the reference's and the torch port's.

A table maps `"<family>/<function>"` to a callable `inputs -> outputs` (what
examples/vectors_consumer.py is given). `reference_table()` runs every function on the
reference. `port_table(device, dtype)` runs the port: the functions of the backend protocol
through `raggedspec.gpu.backend.TorchBackend` (the same adapter as the reference, a different
backend), and the other rules the port implements through their `gpu.*` function, with its
tensors read back as host values. The host-only rules the port takes from the reference
unchanged (flags, capability, scheduler, step guards, capture offsets, accounting, the length
rules it computes on host integers; see the port rows of docs/rules.md) are listed in
`PORT_HOST_ONLY` and are absent from the port table.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from raggedspec.vectors import functions
from raggedspec.reference.backend import NumpyBackend

# functions whose adapter calls only backend protocol methods: a port backend runs them as is
PROTOCOL = {
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
    # own functions (no device twin)
    "step/verify_proposed",
    "step/window_verify_row",
    "step/n_cache_positions_to_drop",
    "dispatch/resolve_ragged_chain_starts",
    "dispatch/resolve_draft_leads",
    "dispatch/draft_step_end_column",
}


def reference_table() -> dict[str, Callable[[dict], dict]]:
    """Every vector function on the reference (`NumpyBackend`)."""
    backend = NumpyBackend()
    return {fn.key: partial(fn.call, backend) for fn in functions()}


def _host(x):
    """A port result as a host value: tensors -> lists (None stays None)."""
    return x.tolist() if hasattr(x, "tolist") else x


def _mask(x) -> np.ndarray | None:
    return None if x is None else x.detach().cpu().double().numpy()


def _gpu_functions() -> dict[str, Callable[[dict], dict]]:
    from raggedspec.gpu import dispatch as gd
    from raggedspec.gpu import masks as gm
    from raggedspec.gpu import rope as gr

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

    return {
        "masks/compose_caller_mask": caller,
        "dispatch/resolve_ragged_rows": lambda i: {
            "rows": _host(gd.resolve_ragged_rows(i["rows"], i["q0"], i["b"]))
        },
        "dispatch/uniform_seqlen_offset": lambda i: {
            "offset": gd.uniform_seqlen_offset(i["offsets"])
        },
        "masks/raw_keep_span": lambda i: dict(
            zip(
                ("raw_base", "keep"),
                gm.raw_keep_span(i["t_q"], i["window"], i["t_k_full"]),
                strict=True,
            )
        ),
        "masks/make_left_padded_causal_mask": lambda i: {
            "mask": _mask(gm.make_left_padded_causal_mask(i["b"], i["t_q"], i["past"], i["live"]))
        },
        "masks/make_causal_mask_matrix": lambda i: {
            "mask": _mask(
                gm.make_causal_mask_matrix(
                    i["b"],
                    i["t_q"],
                    i["past"],
                    i["per_seq_kv_lens"],
                    i["channel_lead"],
                    i["flash_on_cuda"],
                )
            )
        },
        "masks/graph_mode_length_mask": lambda i: {
            "mask": _mask(gm.graph_mode_length_mask(i["positions"], i["cap"]))
        },
        "masks/sdpa_sliding_window": lambda i: {
            "window": gm.sdpa_sliding_window(i["ratio"], i["w"])
        },
        "masks/mask_must_be_applied_as_bias": lambda i: {
            "bias": gm.mask_must_be_applied_as_bias(i["dims"])
        },
        "rope/compressed_key_positions": lambda i: {
            "positions": _host(gr.compressed_key_positions(i["t_c"], i["ratio"]))
        },
    }


def port_table(device: str = "cpu", dtype: str = "float64") -> dict[str, Callable[[dict], dict]]:
    """The torch port: protocol functions through `TorchBackend(device, dtype)`, the others
    through their `gpu.*` function; `PORT_HOST_ONLY` functions are left out."""
    from raggedspec.gpu.backend import TorchBackend

    backend = TorchBackend(device=device, dtype=dtype)
    table = {fn.key: partial(fn.call, backend) for fn in functions() if fn.key in PROTOCOL}
    table.update(_gpu_functions())
    return table
