"""The step plan on the device: `reference.plan.StepPlan`'s integer arrays as device tensors,
uploaded once per decode step (`TorchBackend.upload_plan`).

The port's layers, draft loop and draft extension read these tensors instead of uploading the
host lengths they need one call at a time. The integers are the reference's (computed by
`reference.plan.plan_step`); nothing here decides anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raggedspec.reference.plan import StepPlan

# the per-row fields uploaded, in the order of the one packed transfer
ROW_FIELDS = ("lead", "cache_lens", "tok_lens", "u", "budgets", "offsets", "row_q0",
              "chain_start")


@dataclass
class DevicePlan:
    """A `StepPlan` with its per-row arrays on the device (int64 `[B]` tensors; `offsets`
    `[1]` or `[B]`; `row_q0` and `chain_start` None where the host plan has none). `host`
    is the plan itself, for the fields a kernel launch reads as Python integers (`width`,
    `per_seq`, `ragged`, `groups`)."""

    host: StepPlan
    lead: torch.Tensor
    cache_lens: torch.Tensor
    tok_lens: torch.Tensor
    u: torch.Tensor
    budgets: torch.Tensor
    offsets: torch.Tensor
    row_q0: torch.Tensor | None
    chain_start: torch.Tensor | None


def upload(plan: StepPlan, device) -> DevicePlan:
    """One host-to-device transfer of the plan's per-row arrays (packed into one int64
    buffer, split on the device by one `split`). Refuses nothing."""
    parts = [getattr(plan, name) for name in ROW_FIELDS]
    present = [np.asarray(p, dtype=np.int64).reshape(-1) for p in parts if p is not None]
    packed = torch.from_numpy(np.concatenate(present) if present else np.zeros(0, np.int64))
    views = iter(packed.to(device).split([p.size for p in present]))
    return DevicePlan(plan, *(None if p is None else next(views) for p in parts))
