"""Small helpers shared by the port: device selection and length-vector coercion."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from raggedspec.reference.errors import require

DEVICE_ENV = "RAGGEDSPEC_DEVICE"


def env_device() -> torch.device:
    """The device named by `RAGGEDSPEC_DEVICE` (default "cpu"): how conformance picks where
    the port runs, so the same tests run on CUDA unchanged."""
    return torch.device(os.environ.get(DEVICE_ENV, "cpu"))


def lengths(x, device: torch.device | str | None = None, name: str = "lengths") -> torch.Tensor:
    """A 1-D int64 tensor from a tensor, array or sequence of ints (`device` None keeps a
    tensor where it is, and puts anything else on the CPU). ValueError unless 1-D."""
    if isinstance(x, torch.Tensor):
        t = x.to(dtype=torch.int64, device=device if device is not None else x.device)
    else:
        t = torch.as_tensor([int(v) for v in x] if isinstance(x, Sequence) else x,
                            dtype=torch.int64, device=device)
    require(t.dim() == 1, f"{name} must be a 1-D vector, got shape {list(t.shape)}")
    return t


def lengths_like(x, like: torch.Tensor, name: str = "lengths") -> torch.Tensor:
    """`lengths(x)` on the device of the tensor `like` (a second vector beside the data it
    indexes): device placement stays here, outside the rule modules' mutated code."""
    return lengths(x, device=like.device, name=name)


def arange_like(n: int, like: torch.Tensor) -> torch.Tensor:
    """`torch.arange(n)` (int64) on the device of the tensor `like`."""
    return torch.arange(n, device=like.device)


def float64_on(values, device) -> torch.Tensor:
    """A float64 tensor of `values` on `device`."""
    return torch.tensor(values, dtype=torch.float64, device=device)


def as_list(t) -> list[int]:
    """Host list of ints (for messages and for comparing with the reference)."""
    if isinstance(t, torch.Tensor):
        return [int(v) for v in t.tolist()]
    return [int(v) for v in t]


def neg_inf_where(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Booleans -> additive mask in `dtype` (True -> 0, False -> -inf); both values are
    exact in every float dtype, so masks compare bit-exactly across dtypes."""
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    return torch.where(keep, zero, torch.full((), float("-inf"), dtype=dtype, device=keep.device))


def host_ints(x, flat: bool = True) -> np.ndarray:
    """`x` (a tensor, array or sequence of ints) as a host int64 array (1-D when `flat`). A
    tensor is read from its device once: callers on the step path pass host integers."""
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    a = np.asarray(x, dtype=np.int64)
    return a.reshape(-1) if flat else a


def ints_on(x, device: torch.device | str | None = None) -> torch.Tensor:
    """`x` (a scalar, sequence, array or tensor of ints) as an int64 tensor on `device` (None:
    a tensor stays where it is, anything else goes to the CPU)."""
    return torch.as_tensor(x, dtype=torch.int64, device=device)


def arange_on(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """`torch.arange(n)` (int64) on `device` (None: the CPU)."""
    return torch.arange(n, device=device)


def on_device_of(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t` moved to the device of `like` (its dtype kept)."""
    return t.to(like.device)


def to_device(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """`t` moved to `device`; None (or "") keeps it where it is."""
    return t.to(device) if device else t


def zeros_on(shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device | str | None = None) -> torch.Tensor:
    """Zeros of `shape` in `dtype` on `device` (None: the CPU)."""
    return torch.zeros(shape, dtype=dtype, device=device)


def as_tensor_like(x, like: torch.Tensor) -> torch.Tensor:
    """`x` as a tensor with the dtype and on the device of `like`."""
    return torch.as_tensor(x, device=like.device).to(like.dtype)


def upload_ints(like: torch.Tensor, *parts) -> list:
    """The host int64 vectors `parts` on the device of `like` in one upload (one packed
    transfer, split there); a None part stays None. Refuses nothing."""
    present = [p for p in parts if p is not None]
    packed = torch.from_numpy(np.concatenate(present) if present else np.zeros(0, np.int64))
    views = iter(on_device_of(packed, like).split([p.size for p in present]))
    return [None if p is None else next(views) for p in parts]
