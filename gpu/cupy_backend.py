"""`--backend cupy`: the torch backend with its hot rules run by the hand-written kernels of
gpu/kernels.cu.

`CupyBackend` is `raggedspec.gpu.backend.TorchBackend` with attention, RoPE, the ragged union
mask and K/V materialize replaced by kernel launches over all rows at once; `emulated()`
runs the same kernel source under the g++ emulator on the CPU. Which operations, the two
ways to run it, refusals and construction errors: docs/conformance.md, section
"gpu/cupy_backend.py".
"""

from __future__ import annotations

import torch

from raggedspec.gpu import cupy_kernels as ck
from raggedspec.gpu import kernel_emulator
from raggedspec.gpu._common import host_ints, lengths
from raggedspec.gpu.backend import TorchBackend
from raggedspec.gpu.slots import TorchKv
from raggedspec.gpu.model import dsv4_attention_rows
from raggedspec.gpu.rope import _check_x
from raggedspec.reference.errors import require


DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16"}


def cupy_unavailable() -> str | None:
    """Why the CUDA mode cannot run here, or None when it can: CuPy's own conditions
    (`cupy_kernels.cupy_unavailable`) and a CUDA build of torch, which owns the buffers."""
    why = ck.cupy_unavailable()
    if why is None and not torch.cuda.is_available():
        why = (f"torch {torch.__version__} has no CUDA here (the backend's buffers are torch "
               "CUDA tensors)")
    return why


class CupyBackend(TorchBackend):
    name = "cupy"

    def __init__(
        self, device: str | None = None, dtype: str = "float64", emulate: bool = False
    ) -> None:
        self.kernel_attentions = 0   # forwards whose attention the kernel ran
        self.prefill_fallbacks = 0   # forwards with too many queries for it (the torch port ran)
        if emulate:
            device = device or "cpu"
            require(
                torch.device(device).type == "cpu",
                f"the emulated kernels run on the cpu only, not {device!r}",
            )
            if kernel_emulator.compilers()["g++"] is None:
                raise ValueError("the emulated kernel backend needs g++ on the PATH")
            super().__init__(device=device, dtype=dtype)
            self.name = "cupy-emulated"
            self.kernels = ck.Kernels("emulate")
            return
        why = cupy_unavailable()
        if why is not None:
            raise ValueError(f"backend 'cupy' needs a CUDA GPU: {why}")
        device = device or "cuda"
        require(
            torch.device(device).type == "cuda",
            f"backend 'cupy' runs on CUDA only, not on {device!r}",
        )
        super().__init__(device=device, dtype=dtype)
        self.kernels = ck.Kernels("cupy")

    # ------------------------------------------------------------------ torch <-> kernel arrays
    def _arr(self, t: torch.Tensor):
        """A zero-copy kernel array of a torch tensor (bf16 as its int16 bits)."""
        return ck.kernel_array(t, self.kernels.mode)

    def _tensor(self, a, dtype: torch.dtype) -> torch.Tensor:
        return ck.torch_tensor(a, dtype, self.kernels.mode)

    def _run(self, fn, *args):
        if self.kernels.mode == "emulate":
            return fn(*args)
        import cupy

        with cupy.cuda.Device(self.dev.index or 0), \
                cupy.cuda.ExternalStream(torch.cuda.current_stream(self.dev).cuda_stream):
            return fn(*args)

    # ------------------------------------------------------------------ the model's hot operations
    def build_model(self, cfg):
        """The torch port's model with every decoder layer's attention and RoPE (target layers
        and the MTP layer) replaced by the kernels."""
        model = super().build_model(cfg)
        layers = list(model.layers) + ([model.mtp.layer] if model.mtp is not None else [])
        for layer in layers:
            layer.attend = self._attend
            layer.rope = self._rope
        return model

    def _attend(self, q, kv, rows, comp, ratio, window, sinks=None, dev_rows=None):
        """`gpu.model.dsv4_attention_rows` by `rs_verify_attention_*` (every KV head in place;
        query head h reads KV head `h // (H / Hk)`).
        A forward with more queries than the verify kernel takes (a prefill: G * t_q over
        `cupy_kernels.MAX_QUERIES`, or over its shared memory) goes to the torch port."""
        h, t_q, d = q.shape[1], q.shape[2], q.shape[3]
        if not self.kernels.fits((h // kv.k.shape[1]) * t_q, d, DTYPE_NAMES[q.dtype]):
            self.prefill_fallbacks += 1
            return dsv4_attention_rows(q, kv, rows, comp, ratio, window, sinks, dev_rows)
        self.kernel_attentions += 1
        a = self._arr
        out = self._run(self.kernels.dsv4_attention_rows, a(q), a(kv.k), a(kv.v), kv.host_lens(),
                        None if rows is None else host_ints(rows),
                        None if comp is None else a(comp.to(kv.k.dtype)), ratio, window,
                        None if sinks is None else a(sinks.to(q.dtype)))
        return self._tensor(out, q.dtype)

    def _rope(self, x, offsets, rope_dims, theta, inverse=False, table=None, dev_offsets=None):
        """`gpu.rope.apply_rope` by `rs_rope` (angles computed in the kernel; `table` unused;
        `dev_offsets`, the same offsets already on the device, read when given)."""
        _check_x(x, rope_dims)
        if dev_offsets is not None and dev_offsets.numel() == len(host_ints(offsets)):
            offsets = dev_offsets
        offs = self._arr(lengths(offsets, device=x.device, name="offsets"))   # stays on the device
        out = self._run(self.kernels.rope, self._arr(x), offs, rope_dims, theta, inverse)
        return self._tensor(out, x.dtype)

    # ------------------------------------------------------------------ protocol methods
    def apply_rope(self, x, offsets, rope_dims, theta, inverse=False):
        return self._rope(self._t(x), offsets, rope_dims, theta, inverse)

    def _ragged_union_mask(self, rows, q0, valid, raw_base, keep, window, ratio, t_c):
        """`rs_ragged_union_mask` (each row's validity rebuilt in the kernel; `valid` unused)."""
        mask_dtype = torch.float64 if self.tdtype == torch.float64 else torch.float32
        out = self._run(
            self.kernels.ragged_union_mask,
            self._arr(rows),
            q0,
            valid.shape[0],
            raw_base,
            keep,
            t_c,
            ratio,
            window,
            str(mask_dtype).removeprefix("torch."),
        )
        return self._tensor(out, mask_dtype).to(self.tdtype)

    def _front_aligned(self, slot):
        """`rs_front_align` for a materialized port K/V slot (one launch for K and V)."""
        if not isinstance(slot, TorchKv) or slot.kv is None:
            return super()._front_aligned(slot)
        kv = slot.kv
        k, v = self._run(
            self.kernels.front_align,
            self._arr(kv.k),
            self._arr(kv.v),
            self._arr(kv.lens),
            slot.current,
        )
        return self._tensor(k, kv.k.dtype), self._tensor(v, kv.v.dtype)


def emulated(device: str | None = None, dtype: str = "float64") -> CupyBackend:
    """The kernel backend on the CPU through the g++ emulator (`--backend
    raggedspec.gpu.cupy_backend:emulated`)."""
    return CupyBackend(device=device, dtype=dtype, emulate=True)
