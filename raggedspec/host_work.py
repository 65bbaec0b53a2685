"""Count the host work of a decode step: blocking tensor->host reads, host->tensor uploads
and aten ops, split into model compute and bookkeeping.

On a GPU every read of a device tensor's value from the host (`item`, `tolist`, `bool()`,
`int()`, `float()`, `__index__`, `cpu`, `numpy`, `nonzero`) is a device synchronisation,
every tensor built from host data (`torch.tensor`, `torch.as_tensor` of a non-tensor,
`torch.from_numpy`, `Tensor.new_tensor`) a host-to-device transfer, and every aten op a
kernel launch, so a port whose step does O(B) of any cannot run like an engine. This tool runs
the tensor-mode simulator on the torch backend (on the CPU: the Python paths are those of
CUDA) and counts them, only inside the decode steps (the simulator's `_decode`: clone-in to
clone-out and the per-sequence commit; prompt forwards are not counted), per decode step.
An aten op is model compute when it runs inside the port model's forward (`MODEL_REGIONS`:
the target's layers and logits, the MTP block's fuse, step and logits, the backend's
general-layout layers; their KV writes included), bookkeeping otherwise (clone-in, strips,
rollbacks, the draft loop's grouping, seeds and write-back, the draft-KV extension).

The reads are counted by wrapping those `torch.Tensor` methods (a read that calls another,
e.g. a `tolist` inside `bool()`, counts once), plus the syncs aten runs on its own (a
boolean-mask index or `nonzero` inside aten: counted by the aten op's name); the ops by a
`TorchDispatchMode` that counts every aten call. Scenario: `examples/per-sequence-b128.toml`
or `examples/cohort-b128.toml`
(depth 3, profile 0.74/0.54/0.41) with the batch and step count overridden. Run
`python -m raggedspec.host_work` (or `scripts/count_host_work.py`) for the table in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READ_METHODS = (
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "cpu",
    "numpy",
    "nonzero",
)
UPLOAD_FUNCTIONS = ("tensor", "as_tensor", "from_numpy")
# (module, class, method): the port model's forward, where an aten op is model compute
MODEL_REGIONS = (
    ("raggedspec.gpu.model", "TinyModel", "forward"),
    ("raggedspec.gpu.model", "TinyModel", "logits"),
    ("raggedspec.gpu.model", "DecoderLayer", "forward"),
    ("raggedspec.gpu.model", "MtpBlock", "fuse"),
    ("raggedspec.gpu.model", "MtpBlock", "logits"),
    ("raggedspec.gpu.model", "MtpBlock", "forward_tokens_rows"),
    ("raggedspec.gpu.backend", "TorchBackend", "_forward_general"),
)
EXAMPLES = Path(__file__).parent / "examples"  # the package's (a link in a checkout)
SCENARIOS = {
    "per-sequence": EXAMPLES / "per-sequence-b128.toml",
    "cohort": EXAMPLES / "cohort-b128.toml",
}


# ops whose output size or value the host must wait for, when no wrapped method called them
# (a boolean-mask index runs `nonzero` inside aten)
_IMPLICIT_SYNCS = {
    torch.ops.aten.nonzero,
    torch.ops.aten.masked_select,
    torch.ops.aten._local_scalar_dense,
}


_INDEX_OPS = {torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_}


def _bool_index(func, args) -> bool:
    """An advanced index by a boolean mask: its size is the mask's count, a sync on a GPU."""
    if func.overloadpacket not in _INDEX_OPS or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())


class _Counter(TorchDispatchMode):
    """Counts aten ops while `on` (`model_ops` inside a model region, `ops` in all); reads
    and uploads are counted by the wrappers."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.ops = 0
        self.model_ops = 0
        self.reads: collections.Counter = collections.Counter()
        self.uploads: collections.Counter = collections.Counter()
        self.depth = 0
        self.model_depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            self.ops += 1
            self.model_ops += self.model_depth > 0
            if self.depth == 0 and (
                func.overloadpacket in _IMPLICIT_SYNCS or _bool_index(func, args)
            ):
                self.reads[f"aten.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _wrapped_reads(counter: _Counter):
    """Every read method of `torch.Tensor` counting into `counter` while it is on."""
    saved = {name: getattr(torch.Tensor, name) for name in READ_METHODS}

    def wrap(name, fn):
        def method(self, *args, **kwargs):
            if counter.on and counter.depth == 0:
                counter.reads[name] += 1
            counter.depth += 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                counter.depth -= 1

        return method

    try:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@contextlib.contextmanager
def _wrapped_uploads(counter: _Counter):
    """`torch.tensor`, `torch.as_tensor` (of host data), `torch.from_numpy` and
    `Tensor.new_tensor` counting into `counter.uploads` while it is on."""
    saved = {name: getattr(torch, name) for name in UPLOAD_FUNCTIONS}
    saved_new = torch.Tensor.new_tensor

    def wrap(name, fn):
        def function(data, *args, **kwargs):
            if counter.on and counter.depth == 0 and not isinstance(data, torch.Tensor):
                counter.uploads[name] += 1
            return fn(data, *args, **kwargs)

        return function

    def new_tensor(self, data, *args, **kwargs):
        if counter.on and counter.depth == 0 and not isinstance(data, torch.Tensor):
            counter.uploads["new_tensor"] += 1
        return saved_new(self, data, *args, **kwargs)

    try:
        for name, fn in saved.items():
            setattr(torch, name, wrap(name, fn))
        torch.Tensor.new_tensor = new_tensor
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)
        torch.Tensor.new_tensor = saved_new


@contextlib.contextmanager
def _model_regions(counter: _Counter):
    """Every `MODEL_REGIONS` method marking its aten ops as model compute."""
    import importlib

    saved = []
    for mod, cls_name, name in MODEL_REGIONS:
        cls = getattr(importlib.import_module(mod), cls_name)
        saved.append((cls, name, cls.__dict__[name]))

    def wrap(fn):
        def method(*args, **kwargs):
            counter.model_depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.model_depth -= 1

        return method

    try:
        for cls, name, fn in saved:
            setattr(cls, name, wrap(fn) if not isinstance(fn, staticmethod)
                    else staticmethod(wrap(fn.__func__)))
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def count_decode_steps(batch: int, advance: str, steps: int = 8, backend: str = "torch") -> dict:
    """Run `advance`'s example scenario at `batch` rows for `steps` engine steps on `backend`
    and return `{"batch", "advance", "decode_steps", "reads", "uploads", "ops", "model_ops",
    "bookkeeping_ops", "reads_per_step", "uploads_per_step", "ops_per_step",
    "model_ops_per_step", "bookkeeping_ops_per_step", "read_kinds", "upload_kinds"}` counted
    inside decode steps only. ValueError for an unknown advance or a run without a decode
    step."""
    from raggedspec.reference.scenario import load_scenario
    from raggedspec.reference.simulator import TensorEngine

    if advance not in SCENARIOS:
        raise ValueError(f"advance {advance!r} must be one of {sorted(SCENARIOS)}")
    sc = load_scenario(
        SCENARIOS[advance], [f"batch={batch}", f"steps={steps}", f"max_draft_kv_seqs={batch}"]
    )
    engine = TensorEngine(sc, backend=backend)
    counter = _Counter()
    phases: list[str] = []
    inner = engine._decode

    def counted(*args, **kwargs):
        counter.on = True
        try:
            res, rows = inner(*args, **kwargs)
        finally:
            counter.on = False
        phases.append(res["phase"] if res["error"] is None else "error")
        return res, rows

    engine._decode = counted
    with _wrapped_reads(counter), _wrapped_uploads(counter), _model_regions(counter), counter:
        trace = engine.run()
    bad = [p for p in phases if p != "decode"]
    if not phases or bad:
        raise ValueError(
            f"B={batch} {advance}: decode steps ran as {phases} (messages {trace.messages[:3]})"
        )
    n = len(phases)
    reads, uploads = sum(counter.reads.values()), sum(counter.uploads.values())
    book = counter.ops - counter.model_ops
    return {
        "batch": batch,
        "advance": advance,
        "decode_steps": n,
        "reads": reads,
        "uploads": uploads,
        "ops": counter.ops,
        "model_ops": counter.model_ops,
        "bookkeeping_ops": book,
        "reads_per_step": reads / n,
        "uploads_per_step": uploads / n,
        "ops_per_step": counter.ops / n,
        "model_ops_per_step": counter.model_ops / n,
        "bookkeeping_ops_per_step": book / n,
        "read_kinds": dict(counter.reads),
        "upload_kinds": dict(counter.uploads),
    }


def table(results: list[dict]) -> str:
    """The markdown table of `count_decode_steps` results."""
    lines = [
        "| B | advance | decode steps | host reads / step | uploads / step | aten ops / step | "
        "model compute | bookkeeping |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['batch']} | {r['advance']} | {r['decode_steps']} | {r['reads_per_step']:,.1f} | "
            f"{r['uploads_per_step']:,.1f} | {r['ops_per_step']:,.1f} | "
            f"{r['model_ops_per_step']:,.1f} | {r['bookkeeping_ops_per_step']:,.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI: `python -m raggedspec.host_work [--batch 8 32 128] [--advance cohort per-sequence]
    [--steps 8]`; prints the table and the read kinds."""
    p = argparse.ArgumentParser(
        prog="python -m raggedspec.host_work", description=__doc__.splitlines()[0]
    )
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument(
        "--advance", nargs="+", choices=sorted(SCENARIOS), default=["cohort", "per-sequence"]
    )
    p.add_argument(
        "--steps", type=int, default=8, help="engine steps per run (the first is the prompt)"
    )
    args = p.parse_args(argv)
    results = [count_decode_steps(b, a, args.steps) for b in args.batch for a in args.advance]
    print(table(results))
    for r in results:
        print(f"B={r['batch']} {r['advance']}: reads {r['read_kinds']}, uploads "
              f"{r['upload_kinds']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
