"""The torch port's host work per decode step does not grow with the batch.

`raggedspec.host_work` counts, inside each decode step of the tensor-mode simulation on the
torch backend, the blocking tensor->host reads, the host->tensor uploads and the aten ops,
split into model compute and bookkeeping. A read, an upload or a bookkeeping op per row (a
length checked by reading the device, a per-row length vector uploaded, a per-row view of a
seed) makes the count grow with B; on a GPU each read is a device synchronisation, each
upload a transfer and each op a launch. The targets (docs/benchmarks.md "Host work per decode
step") are at most 3 reads, 4 uploads and 100 bookkeeping ops per step.
"""

import numpy as np
import pytest
import torch

from raggedspec import host_work
from raggedspec.gpu.cache import RaggedKv
from raggedspec.host_work import count_decode_steps

READ_BUDGET = 32
TARGETS = {"reads_per_step": 3, "uploads_per_step": 4, "bookkeeping_ops_per_step": 100}
METRICS = ("reads_per_step", "uploads_per_step", "bookkeeping_ops_per_step")


def counts(advance: str) -> dict[int, dict]:
    return {b: count_decode_steps(b, advance, steps=4) for b in (2, 8, 16)}


@pytest.mark.rule("host work per decode step, port")
@pytest.mark.parametrize("advance", ["per-sequence", "cohort"])
def test_host_reads_uploads_and_bookkeeping_per_decode_step_are_flat_in_the_batch(advance):
    """Nothing may grow from B = 8 to B = 16: both batches are ragged and draft in every
    group there is (at most w), so a per-row read, upload or op shows as growth. B = 2 is
    smaller on both counts (fewer groups, uniform rows take the shared RoPE table, no
    upload), so it bounds the total ops only."""
    c = counts(advance)
    for m in METRICS:
        assert c[16][m] <= c[8][m], (m, c[8], c[16])
    assert c[16]["reads_per_step"] <= READ_BUDGET, c[16]
    assert c[16]["ops_per_step"] <= 1.5 * c[2]["ops_per_step"], (c[2], c[16])


@pytest.mark.rule("host work per decode step, port")
@pytest.mark.parametrize("advance", ["per-sequence", "cohort"])
def test_host_work_per_decode_step_meets_the_targets(advance):
    """At most 3 reads, 4 uploads and 100 bookkeeping ops per decode step, under either
    advance rule (the cohort drafts in several groups per step)."""
    c = count_decode_steps(16, advance, steps=4)
    assert all(c[m] <= cap for m, cap in TARGETS.items()), c


@pytest.mark.rule("host work per decode step, port")
def test_the_counter_sees_a_read_an_upload_and_an_op_per_row():
    """Negative control: a step path that reads one length per row, uploads one per row and
    indexes one row at a time is counted as such, all of it bookkeeping."""
    import torch

    from raggedspec.gpu.slots import TorchKv
    from raggedspec import host_work

    counter = host_work._Counter()
    lens = torch.arange(16)
    with host_work._wrapped_reads(counter), host_work._wrapped_uploads(counter), counter:
        counter.on = True
        for i in range(16):
            int(lens[i])
            torch.as_tensor([i])
        TorchKv(4096).check_append(1)  # host integers only: no read
        counter.on = False
    assert sum(counter.reads.values()) == 16 and counter.reads["__int__"] == 16
    assert counter.uploads == {"as_tensor": 16}
    assert counter.model_ops == 0 and counter.ops >= 32


def uploads(fn) -> int:
    """The host->device uploads `fn()` makes (raggedspec.host_work's counter)."""
    counter = host_work._Counter()
    with host_work._wrapped_uploads(counter), counter:
        counter.on = True
        fn()
        counter.on = False
    return sum(counter.uploads.values())


@pytest.mark.rule("RaggedKv construction, lengths and copies, port layout")
def test_host_lengths_are_uploaded_once_on_the_first_read_and_a_device_copy_can_be_adopted():
    """Lengths set from host integers twice before any read are uploaded once, on the read;
    a device vector of the same values is adopted instead of an upload, one of other values
    (or once a device copy exists) is not."""
    kv = RaggedKv(torch.zeros(2, 1, 8, 2), torch.zeros(2, 1, 8, 2), [3, 1], 4096)

    def set_twice():
        kv.lens = [2, 1]
        kv.lens = [3, 2]

    assert uploads(set_twice) == 0 and kv.pending_upload().tolist() == [3, 2]
    assert uploads(lambda: kv.lens) == 1 and kv.lens.tolist() == [3, 2]
    assert uploads(lambda: kv.lens) == 0 and kv.pending_upload() is None
    kv.lens = [4, 2]
    kv.adopt_device_lens(np.array([4, 3]), torch.tensor([4, 3]))  # other values: not taken
    assert kv.pending_upload().tolist() == [4, 2]
    given = torch.tensor([4, 2])
    kv.adopt_device_lens(np.array([4, 2]), given)
    assert uploads(lambda: kv.lens) == 0 and kv.lens is given
    kv.adopt_device_lens(np.array([4, 2]), torch.tensor([4, 2]))  # a copy exists: kept
    assert kv.lens is given and kv.host_lens().tolist() == [4, 2]
