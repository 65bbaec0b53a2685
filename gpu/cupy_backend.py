"""`--backend cupy`: the torch backend with its hot per-op rules run by the hand-written kernels
of gpu/kernels.cu (issue 5).

`CupyBackend` is `gpu.backend.TorchBackend` on a CUDA device (torch owns the buffers; the
kernels see them zero-copy through DLPack, on torch's current stream) with these protocol
methods replaced by one kernel launch each:
- `apply_rope`: `rs_rope` (per-row RoPE);
- `union_mask`: `rs_ragged_union_mask` on the ragged path (the uniform path is one shared
  `[t_q, t_k + t_c]` validity, left to torch);
- `materialize` of a target or draft KV slot: `rs_front_align` (the in-place rows read out in
  the reference's front-aligned form, which is what conformance compares).
Every other method, and the model forward the simulator drives, is the torch port on CUDA;
the verify-attention kernel (`rs_verify_attention_*`) is measured by `raggedspec bench`.

Refusals: as the torch port (the kernels' hosts raise the same classes and messages).
Construction refuses (ValueError, with the reason) a machine without CuPy or without a CUDA
device, and any device that is not CUDA.
"""

from __future__ import annotations

import torch

from gpu import cupy_kernels as ck
from gpu import dispatch as gdispatch
from gpu import masks as gmasks
from gpu._common import neg_inf_where
from gpu.backend import TorchBackend, TorchKv
from reference.errors import require


def cupy_unavailable() -> str | None:
    """Why the CuPy backend cannot run here, or None when it can."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - any import failure means "no CuPy here"
        return f"cupy is not importable ({type(exc).__name__}: {exc}); install the 'cupy' extra on a CUDA machine"
    try:
        if not cupy.cuda.is_available():
            return "cupy.cuda.is_available() is False: no CUDA device"
    except Exception as exc:  # noqa: BLE001
        return f"no CUDA device ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} has no CUDA here (the backend's buffers are torch CUDA tensors)"
    return None


def _cp(t: torch.Tensor):
    import cupy

    t = t.contiguous()
    return cupy.from_dlpack(t.view(torch.int16) if t.dtype == torch.bfloat16 else t)


def _torch(a, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_dlpack(a)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


class CupyBackend(TorchBackend):
    name = "cupy"

    def __init__(self, device: str | None = None, dtype: str = "float64") -> None:
        why = cupy_unavailable()
        if why is not None:
            raise ValueError(f"backend 'cupy' needs a CUDA GPU: {why}")
        device = device or "cuda"
        require(torch.device(device).type == "cuda", f"backend 'cupy' runs on CUDA only, not on {device!r}")
        super().__init__(device=device, dtype=dtype)
        self.kernels = ck.Kernels("cupy")

    def _run(self, fn, *args):
        import cupy

        with cupy.cuda.Device(self.dev.index or 0), cupy.cuda.ExternalStream(torch.cuda.current_stream(self.dev).cuda_stream):
            return fn(*args)

    def apply_rope(self, x, offsets, rope_dims, theta, inverse=False):
        x = self._t(x)
        out = self._run(self.kernels.rope, _cp(x), [int(o) for o in offsets], rope_dims, theta, inverse)
        return _torch(out, x.dtype)

    def union_mask(self, t_q, t_k_full, row_q0, window, ratio, t_c):
        q0 = t_k_full - t_q
        b = 1 if row_q0 is None else len(row_q0)
        rows = gdispatch.resolve_ragged_rows(None if row_q0 is None else self._ints(row_q0), q0, b)
        raw_base, keep = gmasks.raw_keep_span(t_q, window, t_k_full)
        if rows is None:
            valid = torch.cat([gmasks.raw_validity(t_q, q0, raw_base, keep, window, device=self.dev),
                               gmasks.compressed_validity(t_q, q0, t_c, ratio, device=self.dev)], dim=1)
            return neg_inf_where(valid, self.tdtype)[None, None]
        require(t_c == 0 or ratio >= 1, f"compress ratio {ratio} must be >= 1 when there are {t_c} compressed keys")
        mask_dtype = "float64" if self.tdtype == torch.float64 else "float32"
        out = self._run(self.kernels.ragged_union_mask, rows.tolist(), q0, t_q, raw_base, keep, t_c, ratio,
                        window, mask_dtype)
        return torch.from_dlpack(out).to(self.tdtype)

    def _kv_view(self, slot: TorchKv) -> dict:
        if not isinstance(slot, TorchKv) or slot.kv is None:
            return super()._kv_view(slot)
        kv = slot.kv
        k, v = self._run(self.kernels.front_align, _cp(kv.k), _cp(kv.v), _cp(kv.lens), slot.current)
        return {"k": self.to_numpy(_torch(k, kv.k.dtype)), "v": self.to_numpy(_torch(v, kv.v.dtype)),
                "len": slot.current, "capacity": slot.capacity}
