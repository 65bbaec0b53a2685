"""Port conformance: malformed input to the port's dispatch predicates.

A demanding user gets a ValueError whose message names the bad parameter and its values.
Each case below breaks exactly one condition (so a check that joins its conditions with the
wrong `and`/`or` lets one case through), and the message must carry every listed fragment.
Cases at the boundary of a condition must pass. The other length rules run on host integers
through the reference's own functions (their refusals are tested there).
"""

from __future__ import annotations

import pytest
import torch

import raggedspec.gpu.dispatch as dispatch
from raggedspec.gpu.testing import DEVICE


def vec(xs, dtype=torch.int64):
    return torch.tensor(list(xs), dtype=dtype, device=DEVICE)


TWO_D = [[1, 2], [3, 4]]

# (function, valid keyword arguments, the length-vector parameters to break one at a time)
VECTOR_PARAMS = [
    (dispatch.resolve_ragged_rows, dict(rows=[3, 2], q0=3, b=2), ["rows"]),
    (dispatch.uniform_seqlen_offset, dict(offsets=[3, 3]), ["offsets"]),
]


def _tensors(kwargs):
    """Vectors as the device's int64 tensors, grids as [B, *] tensors."""
    return {
        k: torch.tensor(v, dtype=torch.int64, device=DEVICE) if isinstance(v, list) else v
        for k, v in kwargs.items()
    }


@pytest.mark.rule("uniform_seqlen_offset on the RoPE path, port", "resolve_ragged_rows, port")
@pytest.mark.parametrize(
    "fn, kwargs, params", VECTOR_PARAMS, ids=[f.__name__ for f, _, _ in VECTOR_PARAMS]
)
def test_every_length_vector_must_be_one_dimensional_and_the_error_names_it(fn, kwargs, params):
    fn(**_tensors(kwargs))  # the valid call passes, so only the broken parameter can refuse
    for name in params:
        with pytest.raises(ValueError) as err:
            fn(**_tensors(dict(kwargs, **{name: TWO_D})))
        assert str(err.value).startswith(f"{name} must be a 1-D vector, got shape [2, 2]"), str(
            err.value
        )


# (case id, call, fragments the message must carry)
REFUSALS = [
    (
        "ragged_rows q0",
        lambda: dispatch.resolve_ragged_rows(None, -1, 2),
        ["q0 -1", "b 2", "must be >= 0"],
    ),
    (
        "ragged_rows b",
        lambda: dispatch.resolve_ragged_rows(None, 3, -1),
        ["q0 3", "b -1", "must be >= 0"],
    ),
    (
        "ragged_rows row",
        lambda: dispatch.resolve_ragged_rows(vec([-1, 3]), 3, 2),
        ["row positions [-1, 3]", "must be >= 0"],
    ),
]


@pytest.mark.rule("resolve_ragged_rows, port")
@pytest.mark.parametrize("call, fragments", [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
def test_each_malformed_input_is_refused_alone_and_named(call, fragments):
    with pytest.raises(ValueError) as err:
        call()
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} not in {str(err.value)!r}"


@pytest.mark.rule("uniform_seqlen_offset on the RoPE path, port", "resolve_ragged_rows, port")
def test_inputs_on_the_boundary_of_each_check_pass():
    """The smallest valid value of every checked quantity is accepted (a `<` that became
    `<=` refuses it)."""
    assert dispatch.resolve_ragged_rows(None, 0, 0) is None
    assert dispatch.resolve_ragged_rows(vec([0, 0]), 0, 2) is None
    assert dispatch.uniform_seqlen_offset(vec([0])) == 0
