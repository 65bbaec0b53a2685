"""raggedspec's torch port of the tensor-side rules (`reference/` is the NumPy oracle).

Module layout mirrors `reference/` (gpu.masks, gpu.rope, gpu.attention,
gpu.cache, gpu.align, gpu.xs_rolling, gpu.model, gpu.draft); the length rules run on host
integers through the reference's own functions. Refusals raise the same `reference.errors`
classes. The module table and the port's conventions (device /
dtype, int64 length vectors, additive masks, `None` for a uniform batch): docs/conformance.md,
section "gpu/__init__.py".
"""
