"""The torch port's host work per decode step does not grow with the batch.

`raggedspec.host_work` counts the blocking tensor->host reads (and aten ops) inside each
decode step of the tensor-mode simulation on the torch backend. A read per row (a length
checked by reading the device, a message built from a device vector, a per-row slot object)
makes the count grow with B; on a GPU each read is a device synchronisation. The budget of 32
reads per step is the documented target (docs/benchmarks.md "Host work per decode step").
"""

import pytest

from raggedspec.host_work import count_decode_steps

READ_BUDGET = 32


@pytest.mark.rule("host work per decode step, port")
@pytest.mark.parametrize("advance", [pytest.param("per-sequence", marks=pytest.mark.slow),
                                     "cohort"])
def test_host_reads_per_decode_step_are_flat_in_the_batch(advance):
    small, large = (count_decode_steps(b, advance, steps=4) for b in (2, 16))
    assert large["reads_per_step"] <= small["reads_per_step"], (small, large)
    assert large["reads_per_step"] <= READ_BUDGET, large
    assert large["ops_per_step"] <= 1.5 * small["ops_per_step"], (small, large)


@pytest.mark.rule("host work per decode step, port")
def test_the_counter_sees_a_read_per_row():
    """Negative control: a step path that reads one length per row is counted as such."""
    import torch

    from raggedspec.gpu.slots import TorchKv
    from raggedspec import host_work

    counter = host_work._Counter()
    lens = torch.arange(16)
    with host_work._wrapped_reads(counter), counter:
        counter.on = True
        for i in range(16):
            int(lens[i])
        TorchKv(4096).check_append(1)  # host integers only: no read
        counter.on = False
    assert sum(counter.reads.values()) == 16 and counter.reads["__int__"] == 16
