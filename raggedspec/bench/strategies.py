"""The ragged verify attention benchmark's case and strategies.

A `Case` is one batch: B rows of live KV lengths `lens` (the longest L, the shortest
`L - spread`), `w` verify queries per row, GQA heads, held both in place (the port's
`RaggedKv` layout, stale values past each row's length) and front-aligned (the reference's
batch). `reference_attention` is the float64 row-by-row answer every strategy is checked
against; each `Strategy` computes `out [B, H, w, D]` one way (per-row loop, padded SDPA,
flex_attention, cohort truncation, the torch port, in-place SDPA, the CuPy kernel, and a
negative control). What each measures and why is in docs/bench.md.
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
import math
import random

STRATEGIES = {
    "per_row": "per-row loop (one SDPA call per sequence)",
    "padded_sdpa": "padded SDPA, boolean mask, front-aligned batch",
    "flex": "flex_attention, block mask, front-aligned batch",
    "cohort": "cohort truncation to the shortest row (LOSSY, reference only)",
    "port": "torch port: dsv4_attention_in_place on RaggedKv (offsets)",
    "inplace_sdpa": "in-place RaggedKv + per-row offset mask, SDPA (no copy)",
    "cupy": "CuPy kernel (raggedspec.gpu.cupy_kernels.ragged_verify_attention)",
}
NEGATIVE_CONTROLS = {
    "no_dead_prefix_mask": "NEGATIVE CONTROL: padded SDPA without the dead-prefix mask"
}
LOSSY = ("cohort",)
# ||out - ref|| / ||ref|| against the float64 reference on the same (dtype-rounded) inputs.
# bf16 operands land between 1e-3 and 1e-2 (device/METHOD.md); float32 without TF32 far under
# 1e-4; a wrong mask moves the precheck's output by percents (one key among <= 48).
TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "float16": 5e-3, "bfloat16": 1e-2}
HEADLINE = dict(b=128, L=4096, spread=64)  # the headline case: run first, reported first
SLACK_SCALE = 16.0          # stale columns past lens[i]: loud, finite


# ----------------------------------------------------------------------------- the case


def make_lens(b: int, L: int, spread: int, w: int, seed: int) -> list[int]:
    """Row lengths in `[L - spread, L]`: row 0 is L, row 1 (if any) `L - spread`, the rest drawn
    from a RNG seeded by (seed, b, L, spread, w). ValueError if `L - spread < w`."""
    if L - spread < w:
        raise ValueError(f"L {L} - spread {spread} < window {w}")
    rng = random.Random(f"{seed}/{b}/{L}/{spread}/{w}")
    lens = [L - rng.randint(0, spread) for _ in range(b)]
    lens[0] = L
    if b >= 2:
        lens[1] = L - spread
    return lens


def capacity_for(n: int) -> int:
    """The port's capacity rule (512 columns, grown by whole 512-column blocks) for n columns."""
    from raggedspec.reference.cache import PLAIN_CACHE_CAPACITY, block_capacity

    return block_capacity(PLAIN_CACHE_CAPACITY, n)


class Case:
    """One benchmark case on one device: `q [B,H,w,D]`; the in-place `kv` (RaggedKv, capacity for
    one more step's append, slack loud); the front-aligned `kf, vf [B,Hk,T,D]`; `lens` (host) and
    `lens_t` (device int64)."""

    def __init__(
        self, w: int, lens: list[int], hk: int, h: int, d: int, dtype, device, seed: int
    ) -> None:
        import torch

        from raggedspec.gpu.align import materialize_front_aligned
        from raggedspec.gpu.cache import RaggedKv

        self.w, self.lens, self.hk, self.h, self.d = w, list(lens), hk, h, d
        self.b, self.g, self.T = len(lens), h // hk, max(lens)
        self.dtype, self.device = dtype, torch.device(device)
        self.cap = capacity_for(self.T + w)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.lens_t = torch.tensor(self.lens, dtype=torch.int64, device=self.device)
        slack = (torch.arange(self.cap, device=self.device)[None, :] >= self.lens_t[:, None])[
            :, None, :, None
        ]

        def kv_buffer():
            x = torch.randn(
                (self.b, hk, self.cap, d), generator=gen, device=self.device, dtype=dtype
            )
            return torch.where(slack, x * SLACK_SCALE, x)

        k, v = kv_buffer(), kv_buffer()
        self.kv = RaggedKv(k, v, self.lens_t.clone(), max_seq_len=self.cap)
        self.q = torch.randn((self.b, h, w, d), generator=gen, device=self.device, dtype=dtype)
        self.kf, self.vf = materialize_front_aligned(self.kv)
        self.new_k = torch.randn((self.b, hk, w, d), generator=gen, device=self.device, dtype=dtype)
        self.new_v = torch.randn((self.b, hk, w, d), generator=gen, device=self.device, dtype=dtype)

    @property
    def packed_q(self):
        """`[B, Hk, G*w, D]`: query j of KV head kh is head `kh*G + j // w`, window row `j % w`."""
        return self.q.view(self.b, self.hk, self.g * self.w, self.d)

    def unpack(self, out):
        return out.reshape(self.b, self.h, self.w, self.d)

    def window_row(self):
        import torch
        return torch.arange(self.g * self.w, device=self.device) % self.w        # [G*w]

    def elsize(self) -> int:
        return self.q.element_size()

    def live_kv_bytes(self) -> int:
        return 2 * sum(self.lens) * self.hk * self.d * self.elsize()


def reference_attention(case: Case, keep: int | None = None):
    """float64 `[B,H,w,D]`, row by row from the in-place live runs: row i's keys are its positions
    `[lens[i] - keep, lens[i])` (all of them when keep is None), query r (position
    `lens[i] - w + r`) sees key p iff `p <= lens[i] - w + r`; query head h reads KV head
    `h // G`. Plain softmax in float64 on the case's device, independent of every strategy."""
    import torch

    out = torch.empty((case.b, case.h, case.w, case.d), dtype=torch.float64, device=case.device)
    for i, n in enumerate(case.lens):
        lo = 0 if keep is None else n - keep
        k = case.kv.k[i, :, lo:n].double()                          # [Hk, m, D]
        v = case.kv.v[i, :, lo:n].double()
        q = case.q[i].double().view(case.hk, case.g, case.w, case.d)
        logits = torch.einsum("hgrd,hmd->hgrm", q, k) / math.sqrt(case.d)
        qpos = n - case.w + torch.arange(case.w, device=case.device)
        kpos = lo + torch.arange(n - lo, device=case.device)
        valid = kpos[None, :] <= qpos[:, None]                      # [w, m]
        p = torch.softmax(logits.masked_fill(~valid, float("-inf")), dim=-1)
        out[i] = torch.einsum("hgrm,hmd->hgrd", p, v).reshape(case.h, case.w, case.d)
    return out


def rel_err(out, ref) -> float:
    """`||out - ref|| / ||ref||` in float64; inf for a wrong shape or any non-finite value."""
    if tuple(out.shape) != tuple(ref.shape):
        return math.inf
    o = out.double()
    if not bool(torch_isfinite_all(o)):
        return math.inf
    return float((o - ref).norm() / ref.norm().clamp_min(1e-300))


def torch_isfinite_all(x) -> bool:
    import torch
    return bool(torch.isfinite(x).all())


# ----------------------------------------------------------------------------- strategies


def _sdpa(q, k, v, mask):
    import torch
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Strategy(abc.ABC):
    """`unavailable()` -> None or the reason it cannot run here; `prepare(case)` -> ctx (the
    per-step masks / metadata, timed separately as mask_ms); `run(case, ctx)` -> out."""

    name = ""
    lossy = False
    note = ""

    def unavailable(self, device) -> str | None:
        return None

    def prepare(self, case: Case):
        return None

    def kernel_only(self, case: Case, ctx):
        """None, or a zero-argument callable that issues the device work of one `run` alone
        (no wrapper around it), timed beside `run` to show the wrapper's overhead."""
        return None

    @abc.abstractmethod
    def run(self, case: Case, ctx):
        """The strategy's output for `case` (prepared context `ctx`)."""


class PerRow(Strategy):
    name = "per_row"

    def prepare(self, case):
        import torch
        r = case.window_row()
        out = []
        for n in case.lens:
            c = torch.arange(n, device=case.device)
            out.append((c[None, :] <= (n - case.w + r)[:, None])[None, None])    # [1,1,G*w,n]
        return out

    def run(self, case, masks):
        import torch
        qp, T = case.packed_q, case.T
        outs = [
            _sdpa(
                qp[i : i + 1],
                case.kf[i : i + 1, :, T - n :],
                case.vf[i : i + 1, :, T - n :],
                masks[i],
            )
            for i, n in enumerate(case.lens)
        ]
        return case.unpack(torch.cat(outs))


class PaddedSdpa(Strategy):
    name = "padded_sdpa"

    def prepare(self, case):
        import torch
        c = torch.arange(case.T, device=case.device)
        live = c[None, :] >= (case.T - case.lens_t)[:, None]                          # [B, T]
        causal = c[None, :] <= (case.T - case.w + case.window_row())[:, None]          # [G*w, T]
        return (live[:, None, :] & causal[None])[:, None]                             # [B,1,G*w,T]

    def run(self, case, mask):
        return case.unpack(_sdpa(case.packed_q, case.kf, case.vf, mask))


class NoDeadPrefixMask(PaddedSdpa):
    name = "no_dead_prefix_mask"

    def prepare(self, case):
        import torch
        c = torch.arange(case.T, device=case.device)
        return (c[None, :] <= (case.T - case.w + case.window_row())[:, None])[None, None]


class Cohort(Strategy):
    name = "cohort"
    lossy = True

    def prepare(self, case):
        import torch
        m = min(case.lens)
        c = torch.arange(m, device=case.device)
        return m, (c[None, :] <= (m - case.w + case.window_row())[:, None])[None, None]

    def run(self, case, ctx):
        m, mask = ctx
        t = case.T
        return case.unpack(_sdpa(case.packed_q, case.kf[:, :, t - m:], case.vf[:, :, t - m:], mask))


def _flex_mask_mod(live_start, q_pos):
    """Module-level factory, so every case shares one code object (compiled flex does not
    recompile for a new closure of the same shapes). Tensors only, no Python ints."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= live_start[b]) & (kv_idx <= q_pos[q_idx])
    return mask_mod


class Flex(Strategy):
    name = "flex"

    def __init__(self, compile_mode: str) -> None:
        self.compile_mode = compile_mode
        self._fn = self._fallback = None
        self.compiled = False

    def unavailable(self, device):
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except Exception as exc:  # noqa: BLE001 - any import failure is a reason
            return f"torch.nn.attention.flex_attention not importable ({type(exc).__name__}: {exc})"
        return None

    def _flex(self, device):
        if self._fn is None:
            import torch
            from torch.nn.attention.flex_attention import flex_attention

            want = self.compile_mode == "on" or (
                self.compile_mode == "auto" and device.type == "cuda"
            )
            if want:
                import torch._dynamo
                for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                             "accumulated_recompile_limit"):
                    if hasattr(torch._dynamo.config, knob):
                        setattr(
                            torch._dynamo.config,
                            knob,
                            max(getattr(torch._dynamo.config, knob), 512),
                        )
                # dynamic=True: B, the query and the KV lengths symbolic from the first compile, so
                # the grid's 12 shapes cost two compiles (B = 1 is specialized), not 12. If that
                # compile fails (it does in torch 2.13's CPU backend), run() falls back to the
                # default automatic dynamic shapes (a recompile at each new kind of size change:
                # about 5 compiles for the grid; dynamic=False would be 12)
                self._fn, self.compiled = torch.compile(flex_attention, dynamic=True), True
                self._fallback = lambda: torch.compile(flex_attention)
            else:
                import warnings

                warnings.filterwarnings(
                    "ignore", message=".*flex_attention called without torch.compile.*"
                )
                self._fn = flex_attention
            self.note = "compiled (torch.compile, dynamic=True)" if want else \
                "eager, uncompiled: checks the block mask only (unfused math path)"
        return self._fn

    def prepare(self, case):
        from torch.nn.attention.flex_attention import create_block_mask
        self._flex(case.device)
        live_start = (case.T - case.lens_t).contiguous()
        q_pos = (case.T - case.w + case.window_row()).contiguous()
        return create_block_mask(
            _flex_mask_mod(live_start, q_pos),
            case.b,
            None,
            case.g * case.w,
            case.T,
            device=case.device,
        )

    def run(self, case, block_mask):
        fn = self._flex(case.device)
        try:
            return case.unpack(fn(case.packed_q, case.kf, case.vf, block_mask=block_mask))
        except Exception as exc:  # one retry with automatic dynamic shapes, then it is reported
            if not self.compiled or self._fallback is None:
                raise
            self._fn, self._fallback = self._fallback(), None
            self.note = (
                "compiled (torch.compile, automatic dynamic shapes; the dynamic=True compile "
                "failed: "
                f"{type(exc).__name__})"
            )
            return case.unpack(self._fn(case.packed_q, case.kf, case.vf, block_mask=block_mask))


class Port(Strategy):
    name = "port"
    note = (
        "KV heads folded into rows (the port's in-place attention is one-KV-head); sliding window "
        "= capacity "
        "(full attention), so its raw-window gather (keep = min(w + window - 1, max len) columns "
        "per row) "
        "copies B x T columns of K and V on every call, the bytes of a front-align copy, and its "
        "bf16 inputs "
        "are upcast to float32 (more copies); with DSV4's 128-token window the gather is w + 127 "
        "columns"
    )

    def prepare(self, case):
        from raggedspec.gpu.cache import RaggedKv
        b, hk, cap, d = case.kv.k.shape
        return RaggedKv(case.kv.k.view(b * hk, 1, cap, d), case.kv.v.view(b * hk, 1, cap, d),
                        case.lens_t.repeat_interleave(hk), max_seq_len=case.cap)

    def run(self, case, kv_folded):
        from raggedspec.gpu.attention import dsv4_attention_in_place
        q = case.q.view(case.b * case.hk, case.g, case.w, case.d)
        out = dsv4_attention_in_place(q, kv_folded, None, 0, sliding_window=case.cap)
        return case.unpack(out)


class InplaceSdpa(Strategy):
    name = "inplace_sdpa"

    def prepare(self, case):
        import torch
        c = torch.arange(case.T, device=case.device)
        qpos = (case.lens_t - case.w)[:, None] + case.window_row()[None, :]         # [B, G*w]
        return (c[None, None, :] <= qpos[:, :, None])[:, None]                        # [B,1,G*w,T]

    def run(self, case, mask):
        t = case.T
        return case.unpack(_sdpa(case.packed_q, case.kv.k[:, :, :t], case.kv.v[:, :, :t], mask))


class Cupy(Strategy):
    name = "cupy"
    MODULE = "raggedspec.gpu.cupy_kernels"
    FUNCTION = "ragged_verify_attention"

    def __init__(self) -> None:
        self._fn = None

    def unavailable(self, device):
        try:
            spec = importlib.util.find_spec(self.MODULE)
        except (ImportError, ValueError) as exc:
            return f"{self.MODULE} cannot be found ({type(exc).__name__}: {exc})"
        if spec is None:
            return f"no module {self.MODULE} (the CuPy kernels are not written yet)"
        try:
            mod = importlib.import_module(self.MODULE)
        except Exception as exc:  # noqa: BLE001
            return f"{self.MODULE} failed to import ({type(exc).__name__}: {exc})"
        why = mod.cupy_unavailable()
        if why is not None or device.type != "cuda":
            return self._emulated(
                device, why or f"device is {device}, the CuPy kernel runs on CUDA only"
            )
        self._fn = getattr(mod, self.FUNCTION, None)
        if self._fn is None:
            return f"{self.MODULE} has no {self.FUNCTION}(q, k, v, lens)"
        return None

    def _emulated(self, device, why: str):
        """On the CPU, the same kernel source run by the g++ emulator (gpu/kernel_emulator.py):
        the bench's layout contract is checked against the reference like every strategy,
        and the timing is the emulator's (marked; no performance claim). Elsewhere: `why`."""
        from raggedspec.gpu import kernel_emulator

        if device.type != "cpu" or kernel_emulator.compilers()["g++"] is None:
            return why
        self._fn = importlib.import_module(self.MODULE).ragged_verify_attention_emulated
        self.note = (
            f"g++ emulation of the CUDA kernel on the CPU ({why}): correctness only, "
            "the time is meaningless"
        )
        return None

    def run(self, case, ctx):
        return self._fn(case.q, case.kv.k, case.kv.v, case.lens_t)

    def kernel_only(self, case, ctx):
        """The kernel launches of one `run`, recorded with their bound buffers, replayed on
        the stream `run` launches on: the wrapper's DLPack views, allocations, host checks and
        row-index upload are left out (its overhead = `run`'s time minus this one's)."""
        _, launches = recorded_launches(lambda: self.run(case, ctx))
        stream = _launch_stream(case.device)

        def replay():
            with stream():
                for launch in launches:
                    launch()

        return replay


def recorded_launches(call) -> tuple[object, list]:
    """`(call(), launches)`: every kernel launch `call` made through
    `raggedspec.gpu.cupy_kernels.Kernels._launch` (the one place that module launches a
    kernel), each as a zero-argument callable that launches it again with the same
    arguments and buffers."""
    import functools

    from raggedspec.gpu import cupy_kernels as ck

    real, seen = ck.Kernels._launch, []

    def spy(kern, *args, **kwargs):
        seen.append(functools.partial(real, kern, *args, **kwargs))
        return real(kern, *args, **kwargs)

    ck.Kernels._launch = spy
    try:
        out = call()
    finally:
        ck.Kernels._launch = real
    return out, seen


def _launch_stream(device):
    """The context the CuPy entry point launches in: torch's current CUDA stream for CuPy;
    nothing to enter on the CPU (the emulator)."""
    import contextlib

    if device.type != "cuda":
        return contextlib.nullcontext
    import cupy
    import torch

    return lambda: cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)


def make_strategies(names: list[str], flex_compile: str) -> list[Strategy]:
    table = {
        "per_row": PerRow,
        "padded_sdpa": PaddedSdpa,
        "flex": lambda: Flex(flex_compile),
        "cohort": Cohort,
        "port": Port,
        "inplace_sdpa": InplaceSdpa,
        "cupy": Cupy,
        "no_dead_prefix_mask": NoDeadPrefixMask,
    }
    return [table[n]() for n in names]
