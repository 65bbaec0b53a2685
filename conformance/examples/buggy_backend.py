"""An example "bring your own port" backend with one deliberate bug, for
docs/conformance.md and `conformance/test_conformance_command.py`.

The NumPy reference with a classic ragged-batch defect: its masks forget the dead prefix, so
a front-aligned row attends the zero-filled columns in front of its own run. The suite's
union-mask property and end-to-end comparison fail, every other rule passes. The command
that runs it and why production never shows the bug: docs/conformance.md, section
"conformance/examples/buggy_backend.py".
"""

from __future__ import annotations

import numpy as np

from raggedspec.reference.backend import NumpyBackend


class BuggyBackend(NumpyBackend):
    """`NumpyBackend` whose masks forget the dead prefix (module docstring)."""

    name = "buggy-example"

    def union_mask(self, t_q, t_k_full, row_q0, window, ratio, t_c):
        mask = super().union_mask(t_q, t_k_full, None, window, ratio, t_c)  # BUG: row_q0 ignored
        b = 1 if row_q0 is None or len(set(row_q0)) == 1 else len(row_q0)
        return np.broadcast_to(mask, (b,) + mask.shape[1:]).copy()

    def forward(self, model, tokens, cache, offsets, row_q0, lead_pad, capture=None, plan=None):
        return super().forward(
            model, tokens, cache, offsets, None, lead_pad, capture, plan
        )  # BUG: the same


def factory(device: str = "cpu", dtype: str = "float64") -> BuggyBackend:
    """What `--backend raggedspec.conformance.examples.buggy_backend:factory` calls."""
    return BuggyBackend(device, dtype)
