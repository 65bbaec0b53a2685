"""An example port with one deliberate defect: **every row is rotated at row 0's offset**.

A ragged batch's rows other than row 0 get the wrong RoPE positions (a uniform batch is
unaffected); run it with `raggedspec conformance --backend
conformance.examples.rope_row0:factory`. What the per-rule table shows: docs/conformance.md,
section "conformance/examples/rope_row0.py".
"""

from __future__ import annotations

from raggedspec.reference.backend import NumpyBackend


class RopeRow0Backend(NumpyBackend):
    """`NumpyBackend` that rotates every row at row 0's offset (module docstring)."""

    name = "rope-row0-example"

    def rope_positions(self, offsets, b, t):
        return super().rope_positions([list(offsets)[0]], b, t)  # BUG: row 0's offset for all

    def apply_rope(self, x, offsets, rope_dims, theta, inverse=False):
        return super().apply_rope(x, [list(offsets)[0]], rope_dims, theta, inverse=inverse)  # BUG


def factory(device: str = "cpu", dtype: str = "float64") -> RopeRow0Backend:
    """What `--backend conformance.examples.rope_row0:factory` calls."""
    return RopeRow0Backend(device, dtype)
