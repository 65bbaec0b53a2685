"""`raggedspec bench`: ragged verify attention over a front-aligned batch, the strategies side
by side in one run, against the live-KV bound (issue 5, item 3; docs/benchmarks.md).

    python -m raggedspec.gpu.bench [--smoke] [--device cuda] [--dtype bfloat16] [--out out/bench] ...
    python -m raggedspec.gpu.bench --replot out/bench/bench.json     # table and plot again from the JSON

The problem. B rows; row i holds `lens[i]` live KV positions (this step's `w` verify tokens
included: its queries sit at positions `lens[i] - w + r`, r < w). Each query attends, causally,
to every live key of its own row (no sliding window: the whole live KV is read, so the bound
below is the real floor). `Hk` KV heads, `H = G * Hk` query heads (GQA), head dim D. Lengths:
the longest row is L, the shortest `L - spread` (rows between drawn from a seeded RNG).

Two physical layouts hold the same KV:
- in place (`gpu.cache.RaggedKv`, the port's layout): row i's position p at column p;
  columns past `lens[i]` are slack, filled with loud stale values (16x the live scale) so a
  strategy that reads them unmasked fails the correctness check;
- front-aligned (the reference's batch): row i's live run at columns `[T - lens[i], T)`,
  `T = max(lens)`, zeros in front; built once per case by `gpu.align.materialize_front_aligned`
  (its cost is reported separately, as the data movement front-alignment would cost per step).

Strategies (each computes `out [B, H, w, D]`):
- `per_row`: one SDPA call per sequence over its own live run (the baseline the source calls
  "B x slower");
- `padded_sdpa`: one `torch.nn.functional.scaled_dot_product_attention` over the front-aligned
  batch with a boolean mask (dead prefix + causal);
- `flex`: `torch.nn.attention.flex_attention` with a block mask (compiled on CUDA; on the CPU it
  runs uncompiled, which only checks the mask logic; the table says which);
- `cohort`: every row truncated to the shortest row's length (LOSSY, reference only: it is
  checked against the truncated reference, and its error against the full one is reported);
- `port`: the torch port as shipped, `gpu.attention.dsv4_attention_in_place` on the in-place
  `RaggedKv` (alignment by offsets; its KV heads folded into rows, since that function is the
  one-KV-head DSV4 form; sliding window = capacity, i.e. full attention);
- `inplace_sdpa`: the in-place layout read directly by SDPA with a mask from the per-row
  offsets (alignment by index, no gather, no copy);
- `cupy`: the CuPy kernel, when a module `raggedspec.gpu.cupy_kernels` exists and CUDA is available, else
  reported as "not run: <reason>" (never a made-up number). Contract, for the session that
  writes it:

      raggedspec.gpu.cupy_kernels.ragged_verify_attention(q, k, v, lens) -> out
        q    torch [B, H, w, D] on CUDA (bf16, fp16 or fp32), contiguous
        k, v torch [B, Hk, cap, D]: the RaggedKv buffers (row i's position p at column p;
             live iff p < lens[i]; columns past lens[i] hold stale values and must not be read)
        lens torch int64 [B] on the device, each >= w
        out  torch [B, H, w, D] in q.dtype; query head h reads KV head h // (H // Hk); query r
             of row i (position lens[i] - w + r) attends to keys p <= lens[i] - w + r
      launched on torch.cuda.current_stream() (e.g. via cupy.cuda.ExternalStream).

- `no_dead_prefix_mask` (negative control, only when asked for by --strategies): padded SDPA
  that forgets the dead prefix; it must come out WRONG whenever the rows differ in length.

SDPA strategies pack the G query heads of a KV head into the query axis (`[B, Hk, G*w, D]`),
so every SDPA call is plain multi-head attention (no GQA fallback) with a per-row mask.

Correctness before timing: every strategy's output is compared with a float64 reference
computed row by row from the live KV (`reference_attention`, independent of every strategy)
by `||out - ref|| / ||ref||` against a dtype tolerance (TOLERANCE); NaN never passes. First on
a small precheck batch (where one key too many or too few moves the output by percents, so an
off-by-one fails even in bf16), then on every case. A strategy that disagrees is WRONG and is
not timed. Timing: on CUDA, events around each call, warm-up, the median of the repeats, the
L2 flushed (a 256 MiB write) before each repeat; on the CPU `time.perf_counter`, marked SMOKE
(no performance claims). The bound: live K+V bytes / the copy bandwidth measured in the same
run (a large device-to-device copy, bytes read + written), at the start and the end; the
higher is used. Outputs: `bench.json` (rewritten after every case, so a run cut short keeps
what it measured), `bench.md` (tables) and `bench.png` (ms vs B per strategy, bound drawn).

torch is imported inside the functions, so `raggedspec --help` does not pay for it.
"""

from __future__ import annotations

import abc
import argparse
import importlib
import importlib.util
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

SCHEMA = "raggedspec-bench/1"
STRATEGIES = {
    "per_row": "per-row loop (one SDPA call per sequence)",
    "padded_sdpa": "padded SDPA, boolean mask, front-aligned batch",
    "flex": "flex_attention, block mask, front-aligned batch",
    "cohort": "cohort truncation to the shortest row (LOSSY, reference only)",
    "port": "torch port: dsv4_attention_in_place on RaggedKv (offsets)",
    "inplace_sdpa": "in-place RaggedKv + per-row offset mask, SDPA (no copy)",
    "cupy": "CuPy kernel (raggedspec.gpu.cupy_kernels.ragged_verify_attention)",
}
NEGATIVE_CONTROLS = {"no_dead_prefix_mask": "NEGATIVE CONTROL: padded SDPA without the dead-prefix mask"}
LOSSY = ("cohort",)
# ||out - ref|| / ||ref|| against the float64 reference on the same (dtype-rounded) inputs.
# bf16 operands land between 1e-3 and 1e-2 (device/METHOD.md); float32 without TF32 far under
# 1e-4; a wrong mask moves the precheck's output by percents (one key among <= 48).
TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "float16": 5e-3, "bfloat16": 1e-2}
SLACK_SCALE = 16.0          # stale columns past lens[i]: loud, finite
FLUSH_BYTES = 256 << 20     # L2 flush between timed repeats on CUDA (H200 L2: 60 MB)

FULL = dict(device="cuda", dtype="bfloat16", batches=[1, 32, 128], lengths=[2048, 4096],
            spreads=[0, 64, 1024], windows=[2, 4], kv_heads=8, q_heads=32, head_dim=128,
            warmup=3, reps=20, copy_mib=2048)
SMOKE = dict(device="cpu", dtype="float32", batches=[1, 5], lengths=[40, 72],
             spreads=[0, 24], windows=[2, 4], kv_heads=2, q_heads=4, head_dim=16,
             warmup=1, reps=3, copy_mib=32)
HEADLINE = dict(b=128, L=4096, spread=64)      # the target case: run it first
# End-to-end (--e2e): the scenario keys given to the simulator. A uniform prompt, so every
# request is prefilled in the first step and the batch runs all B rows from then on; under
# per-sequence advance the rows' own lengths then drift apart, under cohort they do not.
E2E_FULL = dict(device="cuda", dtype="float32", batch=128, prompt=1024, steps=24, depth=3,
                acceptance="profile:0.74,0.54,0.41", max_seq_len=4096,
                model={"vocab": 1024, "hidden": 1024, "n_heads": 8, "head_dim": 128, "rope_dims": 64,
                       "sliding_window": 128, "compress_ratios": [0, 4]})
E2E_SMOKE = dict(device="cpu", dtype="float64", batch=8, prompt=32, steps=6, depth=3,
                 acceptance="profile:0.74,0.54,0.41", max_seq_len=4096, model={})


# ----------------------------------------------------------------------------- arguments


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 0")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke: tiny sizes, float32, a few repeats, seconds; checks every strategy "
                        "that can run on the CPU; no performance claims")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default cuda; cpu with --smoke)")
    p.add_argument("--dtype", default=None, choices=sorted(TOLERANCE),
                   help="KV/query dtype (default bfloat16; float32 with --smoke)")
    p.add_argument("--batches", type=_ints, default=None, help="batch sizes (default 1,32,128)")
    p.add_argument("--lengths", type=_ints, default=None, help="longest row's length L (default 2048,4096)")
    p.add_argument("--spreads", type=_ints, default=None, help="L - shortest row (default 0,64,1024)")
    p.add_argument("--windows", type=_ints, default=None, help="verify window w = depth + 1 (default 2,4)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 8)")
    p.add_argument("--q-heads", type=int, default=None, help="query heads, a multiple of --kv-heads (default 32)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 128)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per timing (default 3)")
    p.add_argument("--reps", type=int, default=None, help="timed repeats, median reported (default 20)")
    p.add_argument("--copy-mib", type=int, default=None, help="size of the bandwidth copy (default 2048 MiB)")
    p.add_argument("--strategies", default="all",
                   help="comma-separated subset of " + ", ".join(list(STRATEGIES) + list(NEGATIVE_CONTROLS))
                        + " (default all = every strategy, no negative control)")
    p.add_argument("--flex-compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile flex_attention: auto = on CUDA only (default)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new case after this many seconds (the rest are listed as not run)")
    p.add_argument("--seed", type=int, default=0, help="seed of lengths and data (default 0)")
    p.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder (default out/bench)")
    p.add_argument("--replot", type=Path, default=None, metavar="JSON",
                   help="only rewrite bench.md and bench.png beside JSON from it (e.g. after a cut-short run)")
    p.add_argument("--e2e", action="store_true",
                   help="instead of the attention table: end-to-end step time of the tensor-mode simulator "
                        "on the torch backend, cohort vs per-sequence advance (writes e2e.json, e2e.md)")
    p.add_argument("--e2e-batch", type=int, default=None, help="--e2e: requests B (default 128; 8 with --smoke)")
    p.add_argument("--e2e-prompt", type=int, default=None,
                   help="--e2e: prompt length of every request (default 1024; 32 with --smoke)")
    p.add_argument("--e2e-steps", type=int, default=None, help="--e2e: engine steps per run (default 24; 6 with --smoke)")
    p.add_argument("--e2e-backend", default="torch",
                   help="--e2e: the simulator's backend: torch (default), cupy (the kernels; CUDA only), or "
                        "package.module:factory")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-case progress lines on stderr")


def add_parser(sub) -> argparse.ArgumentParser:
    """The `bench` subcommand for `raggedspec.cli` (a COMMANDS entry: `(add_parser, run)`)."""
    p = sub.add_parser(
        "bench", help="ragged verify attention: strategies vs the live-KV bound (table, JSON, plot)",
        description="Ragged verify attention over a front-aligned batch: per-row loop, padded SDPA, "
                    "flex_attention, cohort truncation (lossy), the torch port, the in-place layout "
                    "with SDPA and the CuPy kernel side by side; each checked against a float64 "
                    "reference first (WRONG ones are not timed), then timed against the live-KV bound "
                    "(live K+V bytes / copy bandwidth measured in the same run). Writes bench.json, "
                    "bench.md and bench.png under --out. --smoke: tiny CPU run, no claims.")
    add_arguments(p)
    return p


def settings_from(args) -> dict:
    base = dict(SMOKE if args.smoke else FULL)
    for key in ("device", "dtype", "batches", "lengths", "spreads", "windows", "kv_heads", "q_heads",
                "head_dim", "warmup", "reps", "copy_mib"):
        value = getattr(args, key)
        if value is not None:
            base[key] = value
    names = list(STRATEGIES) if args.strategies == "all" else [s.strip() for s in args.strategies.split(",")
                                                               if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES and s not in NEGATIVE_CONTROLS]
    if unknown or not names:
        raise ValueError(f"--strategies: unknown {unknown or names}; allowed: "
                         + ", ".join(list(STRATEGIES) + list(NEGATIVE_CONTROLS)))
    hk, h = base["kv_heads"], base["q_heads"]
    if hk < 1 or h < hk or h % hk:
        raise ValueError(f"--q-heads {h} must be a positive multiple of --kv-heads {hk}")
    if min(base["windows"]) < 1 or min(base["batches"]) < 1 or base["head_dim"] < 1:
        raise ValueError("windows, batches and head dim must be >= 1")
    for L in base["lengths"]:
        for s in base["spreads"]:
            if L - s < max(base["windows"]):
                raise ValueError(f"L {L} - spread {s} is shorter than the window {max(base['windows'])}")
    if base["reps"] < 1 or base["warmup"] < 0:
        raise ValueError("--reps must be >= 1 and --warmup >= 0")
    base.update(strategies=names, smoke=bool(args.smoke), seed=args.seed, flex_compile=args.flex_compile,
                budget_s=args.budget_s)
    return base


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
    from raggedspec.reference.cache import CACHE_GROW_SIZE, PLAIN_CACHE_CAPACITY
    return PLAIN_CACHE_CAPACITY + max(0, -(-(n - PLAIN_CACHE_CAPACITY) // CACHE_GROW_SIZE)) * CACHE_GROW_SIZE


class Case:
    """One benchmark case on one device: `q [B,H,w,D]`; the in-place `kv` (RaggedKv, capacity for
    one more step's append, slack loud); the front-aligned `kf, vf [B,Hk,T,D]`; `lens` (host) and
    `lens_t` (device int64)."""

    def __init__(self, w: int, lens: list[int], hk: int, h: int, d: int, dtype, device, seed: int) -> None:
        import torch

        from raggedspec.gpu.align import materialize_front_aligned
        from raggedspec.gpu.cache import RaggedKv

        self.w, self.lens, self.hk, self.h, self.d = w, list(lens), hk, h, d
        self.b, self.g, self.T = len(lens), h // hk, max(lens)
        self.dtype, self.device = dtype, torch.device(device)
        self.cap = capacity_for(self.T + w)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.lens_t = torch.tensor(self.lens, dtype=torch.int64, device=self.device)
        slack = (torch.arange(self.cap, device=self.device)[None, :] >= self.lens_t[:, None])[:, None, :, None]

        def kv_buffer():
            x = torch.randn((self.b, hk, self.cap, d), generator=gen, device=self.device, dtype=dtype)
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
        outs = [_sdpa(qp[i: i + 1], case.kf[i: i + 1, :, T - n:], case.vf[i: i + 1, :, T - n:], masks[i])
                for i, n in enumerate(case.lens)]
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
            want = self.compile_mode == "on" or (self.compile_mode == "auto" and device.type == "cuda")
            if want:
                import torch._dynamo
                for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                             "accumulated_recompile_limit"):
                    if hasattr(torch._dynamo.config, knob):
                        setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 512))
                # dynamic=True: B, the query and the KV lengths symbolic from the first compile, so
                # the grid's 12 shapes cost two compiles (B = 1 is specialized), not 12. If that
                # compile fails (it does in torch 2.13's CPU backend), run() falls back to the
                # default automatic dynamic shapes (a recompile at each new kind of size change:
                # about 5 compiles for the grid; dynamic=False would be 12)
                self._fn, self.compiled = torch.compile(flex_attention, dynamic=True), True
                self._fallback = lambda: torch.compile(flex_attention)
            else:
                import warnings
                warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
                self._fn = flex_attention
            self.note = "compiled (torch.compile, dynamic=True)" if want else \
                "eager, uncompiled: checks the block mask only (unfused math path)"
        return self._fn

    def prepare(self, case):
        from torch.nn.attention.flex_attention import create_block_mask
        self._flex(case.device)
        live_start = (case.T - case.lens_t).contiguous()
        q_pos = (case.T - case.w + case.window_row()).contiguous()
        return create_block_mask(_flex_mask_mod(live_start, q_pos), case.b, None, case.g * case.w, case.T,
                                 device=case.device)

    def run(self, case, block_mask):
        fn = self._flex(case.device)
        try:
            return case.unpack(fn(case.packed_q, case.kf, case.vf, block_mask=block_mask))
        except Exception as exc:  # one retry with automatic dynamic shapes, then it is reported
            if not self.compiled or self._fallback is None:
                raise
            self._fn, self._fallback = self._fallback(), None
            self.note = ("compiled (torch.compile, automatic dynamic shapes; the dynamic=True compile failed: "
                         f"{type(exc).__name__})")
            return case.unpack(self._fn(case.packed_q, case.kf, case.vf, block_mask=block_mask))


class Port(Strategy):
    name = "port"
    note = ("KV heads folded into rows (the port's in-place attention is one-KV-head); sliding window = capacity "
            "(full attention), so its raw-window gather (keep = min(w + window - 1, max len) columns per row) "
            "copies B x T columns of K and V on every call, the bytes of a front-align copy, and its bf16 inputs "
            "are upcast to float32 (more copies); with DSV4's 128-token window the gather is w + 127 columns")

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
            return self._emulated(device, why or f"device is {device}, the CuPy kernel runs on CUDA only")
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
        self.note = f"g++ emulation of the CUDA kernel on the CPU ({why}): correctness only, the time is meaningless"
        return None

    def run(self, case, ctx):
        return self._fn(case.q, case.kv.k, case.kv.v, case.lens_t)


def make_strategies(names: list[str], flex_compile: str) -> list[Strategy]:
    table = {"per_row": PerRow, "padded_sdpa": PaddedSdpa, "flex": lambda: Flex(flex_compile), "cohort": Cohort,
             "port": Port, "inplace_sdpa": InplaceSdpa, "cupy": Cupy, "no_dead_prefix_mask": NoDeadPrefixMask}
    return [table[n]() for n in names]


# ----------------------------------------------------------------------------- timing


class Timer:
    """Median milliseconds of `fn()`: CUDA events (warm-up, L2 flush before each repeat) or
    `time.perf_counter` on the CPU."""

    def __init__(self, device, warmup: int, reps: int) -> None:
        import torch
        self.device, self.warmup, self.reps = device, warmup, reps
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if self.cuda else None

    def __call__(self, fn, reps: int | None = None, warmup: int | None = None) -> float:
        import torch
        reps = self.reps if reps is None else reps
        for _ in range(self.warmup if warmup is None else warmup):
            fn()
        times = []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            pairs = []
            for _ in range(reps):
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                pairs.append((start, end))
            torch.cuda.synchronize(self.device)
            times = [s.elapsed_time(e) for s, e in pairs]
        else:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def copy_bandwidth(device, mib: int, timer: Timer) -> dict:
    """A large device-to-device copy: bytes read + written over the median time, GB/s."""
    import torch
    n = mib << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), reps=max(5, min(timer.reps, 20)), warmup=2)
    return {"bytes": 2 * n, "ms": ms, "GBps": 2 * n / (ms * 1e-3) / 1e9}


# ----------------------------------------------------------------------------- one case


def tolerance(dtype_name: str) -> float:
    return TOLERANCE[dtype_name]


def check_strategy(s: Strategy, case: Case, ref, ref_keep, tol: float) -> dict:
    """Prepare, run once, compare. Returns {status: ok|lossy|WRONG|error, err, [err_full], ctx}."""
    try:
        ctx = s.prepare(case)
        out = s.run(case, ctx)
    except Exception as exc:  # noqa: BLE001 - reported, never hidden
        return {"status": "error", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if s.lossy:
        target = ref_keep if ref_keep is not None else ref
        err = rel_err(out, target)
        res = {"err": err, "err_full": rel_err(out, ref)}
        res["status"] = "WRONG" if not err <= tol else ("lossy" if ref_keep is not None else "ok")
    else:
        err = rel_err(out, ref)
        res = {"err": err, "status": "ok" if err <= tol else "WRONG"}
    res["_ctx"] = ctx
    return res


def run_case(cfg: dict, strategies: list[Strategy], reasons: dict, timer: Timer, w: int, b: int, L: int,
             spread: int, precheck_failed: dict, log) -> dict:
    import torch

    from raggedspec.gpu.align import materialize_front_aligned

    device, dtype = torch.device(cfg["device"]), getattr(torch, cfg["dtype"])
    lens = make_lens(b, L, spread, w, cfg["seed"])
    row = {"w": w, "B": b, "L": L, "spread": spread, "lens": lens, "min_len": min(lens), "mean_len": sum(lens) / b}
    case = Case(w, lens, cfg["kv_heads"], cfg["q_heads"], cfg["head_dim"], dtype, device,
                seed=hash((cfg["seed"], w, b, L, spread)) & 0x7FFFFFFF)
    es, hk, d = case.elsize(), case.hk, case.d
    row["live_kv_bytes"] = case.live_kv_bytes()
    # front-alignment by copy: the gather reads B*T columns and writes B*T columns, K and V
    row["align_bytes"] = 2 * 2 * b * case.T * hk * d * es
    row["align_ms"] = timer(lambda: materialize_front_aligned(case.kv), reps=max(3, timer.reps // 2))
    # the port's per-step append (new tokens' K/V written at each row's own offset) and the
    # per-sequence commit / strip (lens only, no data): written bytes
    row["append_bytes"] = 2 * b * w * hk * d * es
    row["strip_bytes"] = 0
    ref = reference_attention(case)
    ref_keep = reference_attention(case, keep=min(lens)) if min(lens) < max(lens) else None
    tol = tolerance(cfg["dtype"])
    row["strategies"] = {}
    for s in strategies:
        if s.name in reasons:
            row["strategies"][s.name] = {"status": "not run", "reason": reasons[s.name]}
            continue
        if s.name in precheck_failed:
            row["strategies"][s.name] = {"status": "WRONG", "reason": "failed the precheck: " + precheck_failed[s.name]}
            continue
        res = check_strategy(s, case, ref, ref_keep, tol)
        ctx = res.pop("_ctx", None)
        if res["status"] in ("ok", "lossy"):
            try:
                res["ms"] = timer(lambda s=s, ctx=ctx: s.run(case, ctx))
                res["mask_ms"] = timer(lambda s=s: s.prepare(case), reps=max(3, timer.reps // 4), warmup=1)
            except Exception as exc:  # noqa: BLE001
                res = {"status": "error", "error": f"timing: {type(exc).__name__}: {str(exc)[:300]}"}
        row["strategies"][s.name] = res

    def append_commit():      # after the strategies: it overwrites w slack columns per row
        case.kv.append(case.new_k, case.new_v)
        case.kv.commit_per_sequence(case.lens_t, torch.zeros_like(case.lens_t))

    row["append_ms"] = timer(append_commit, reps=max(3, timer.reps // 2))
    log(f"w={w} B={b} L={L} spread={spread}: " + ", ".join(
        f"{n}={r.get('ms', float('nan')):.3f}ms" if "ms" in r else f"{n}={r['status']}"
        for n, r in row["strategies"].items()))
    return row


def precheck(cfg: dict, strategies: list[Strategy], reasons: dict) -> tuple[dict, list]:
    """Every available strategy on a small ragged batch (B=6, L=48, spread=24, each window), in the
    run's dtype and device: `{name: why}` for those that fail, and the checks' rows."""
    import torch

    device, dtype = torch.device(cfg["device"]), getattr(torch, cfg["dtype"])
    failed, rows = {}, []
    for w in cfg["windows"]:
        lens = make_lens(6, 48, 24, w, cfg["seed"] + 1)
        case = Case(w, lens, cfg["kv_heads"], cfg["q_heads"], cfg["head_dim"], dtype, device, seed=cfg["seed"] + 7)
        ref = reference_attention(case)
        ref_keep = reference_attention(case, keep=min(lens))
        for s in strategies:
            if s.name in reasons:
                continue
            res = check_strategy(s, case, ref, ref_keep, tolerance(cfg["dtype"]))
            res.pop("_ctx", None)
            rows.append({"w": w, "lens": lens, "strategy": s.name, **res})
            if res["status"] not in ("ok", "lossy") and s.name not in failed:
                failed[s.name] = f"w={w} lens={lens}: {res['status']} " + \
                    (f"err {res['err']:.3g} > tol {tolerance(cfg['dtype']):g}" if "err" in res else res.get("error", ""))
    return failed, rows


# ----------------------------------------------------------------------------- the run


def machine_info(device) -> dict:
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, sm_count=p.multi_processor_count, gpu_mem_gib=round(p.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, capability=f"{p.major}.{p.minor}")
    try:
        info["cupy"] = importlib.import_module("cupy").__version__
    except Exception:  # noqa: BLE001
        info["cupy"] = None
    return info


def case_order(cfg: dict) -> list[tuple[int, int, int, int]]:
    """(w, B, L, spread) for the whole grid, the issue's headline case (B=128, L=4096, spread 64,
    every w) first, then whole plot panels (every B of one (w, L, spread)), the longest L and the
    headline spread first, so a run cut short by its budget still has the cases that matter."""
    spreads = sorted(cfg["spreads"], key=lambda s: (s != HEADLINE["spread"], -s))
    grid = [(w, b, L, s) for L in sorted(cfg["lengths"], reverse=True) for s in spreads for w in cfg["windows"]
            for b in sorted(cfg["batches"], reverse=True)]
    head = [c for c in grid if (c[1], c[2], c[3]) == (HEADLINE["b"], HEADLINE["L"], HEADLINE["spread"])]
    return head + [c for c in grid if c not in head]


def run_bench(cfg: dict, out_dir: Path, log=None) -> dict:
    """The whole run; writes bench.json after every case and bench.md / bench.png at the end.
    Returns the result dict."""
    import torch

    log = log or (lambda msg: None)
    device = torch.device(cfg["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch.cuda.is_available() is False (use --smoke or --device cpu)")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    timer = Timer(device, cfg["warmup"], cfg["reps"])
    strategies = make_strategies(cfg["strategies"], cfg["flex_compile"])
    reasons = {}
    for s in strategies:
        why = s.unavailable(device)
        if why:
            reasons[s.name] = why
    result = {"schema": SCHEMA, "smoke": cfg["smoke"],
              "timer": "CUDA events, median, L2 flushed" if device.type == "cuda" else "time.perf_counter (SMOKE)",
              "settings": {k: v for k, v in cfg.items() if k != "strategies"}, "strategies": cfg["strategies"],
              "labels": {s.name: STRATEGIES.get(s.name) or NEGATIVE_CONTROLS[s.name] for s in strategies},
              "machine": machine_info(device), "tolerance": tolerance(cfg["dtype"]),
              "not_run": reasons, "rows": [], "cases_not_run": [], "complete": False}
    log(f"machine: {result['machine']}")
    result["copy_bandwidth"] = [copy_bandwidth(device, cfg["copy_mib"], timer)]
    log(f"copy bandwidth: {result['copy_bandwidth'][0]['GBps']:.1f} GB/s")
    failed, pre_rows = precheck(cfg, strategies, reasons)
    result["precheck"] = {"failed": failed, "rows": pre_rows}
    for name, why in failed.items():
        log(f"precheck: {name} WRONG: {why}")
    notes = {}
    path = out_dir / "bench.json"
    for (w, b, L, spread) in case_order(cfg):
        if cfg.get("budget_s") is not None and time.monotonic() - t_start > cfg["budget_s"]:
            result["cases_not_run"].append({"w": w, "B": b, "L": L, "spread": spread, "reason": "time budget"})
            continue
        try:
            row = run_case(cfg, strategies, reasons, timer, w, b, L, spread, failed, log)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the case is reported, the run goes on
            row = {"w": w, "B": b, "L": L, "spread": spread, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            log(f"w={w} B={b} L={L} spread={spread}: case failed: {row['error']}")
        if device.type == "cuda":       # the case's tensors died with run_case
            torch.cuda.empty_cache()
        result["rows"].append(row)
        for s in strategies:
            if s.note:
                notes[s.name] = s.note
        result["notes"] = notes
        _write_json(result, path)
    result["copy_bandwidth"].append(copy_bandwidth(device, cfg["copy_mib"], timer))
    result["elapsed_s"] = time.monotonic() - t_start
    result["complete"] = True
    _write_json(result, path)
    write_reports(result, out_dir)
    return result


def _write_json(result: dict, path: Path) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=_json_default))
    tmp.replace(path)


def _json_default(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, Path):
        return str(x)
    return str(x)


# ----------------------------------------------------------------------------- reports


def bandwidth_GBps(result: dict) -> float:
    """The copy bandwidth the bound uses: the higher of the measurements in the run."""
    return max(m["GBps"] for m in result["copy_bandwidth"])


def bound_ms(result: dict, row: dict) -> float:
    return row["live_kv_bytes"] / (bandwidth_GBps(result) * 1e9) * 1e3


def _cell(res: dict, bound: float) -> str:
    st = res["status"]
    if st in ("ok", "lossy") and "ms" in res:
        return f"{res['ms']:.3f} ({res['ms'] / bound:.2f}x)"
    if st == "WRONG":
        return f"WRONG (err {res['err']:.2g})" if "err" in res else "WRONG (precheck)"
    if st == "not run":
        return "not run"
    return "error"


def render_markdown(result: dict) -> str:
    m = result["machine"]
    s = result["settings"]
    bw = bandwidth_GBps(result)
    where = m.get("gpu") or f"CPU ({m.get('cpu')}, {m.get('cpu_count')} cores)"
    lines = []
    if result["smoke"]:
        lines.append("**SMOKE run (CPU, tiny sizes, time.perf_counter): it checks that every path runs and "
                     "agrees with the reference; its times are no performance claim.**")
        lines.append("")
    lines += [
        f"Machine: {where}; torch {m['torch']}" + (f", CUDA {m['cuda']}" if m.get("cuda") else "")
        + (f", CuPy {m['cupy']}" if m.get("cupy") else ", no CuPy") + f"; Python {m['python']}.",
        (f"Sizes: dtype {s['dtype']}, {s['kv_heads']} KV heads, {s['q_heads']} query heads, head dim "
         f"{s['head_dim']}; timer: {result['timer']}; warm-up {s['warmup']}, median of {s['reps']}; seed {s['seed']}."),
        "Copy bandwidth (device-to-device, read + write): "
        + ", ".join(f"{c['GBps']:.1f} GB/s" for c in result["copy_bandwidth"])
        + (f"; the bound uses {bw:.1f} GB/s. Bound = live K+V bytes / bandwidth. "
           f"Cells: median ms (ms / bound). Correctness tolerance: rel. error <= {result['tolerance']:g} "
           "against the float64 reference (WRONG: not timed)."),
        "",
    ]
    names = result["strategies"]
    hdr = ["w", "B", "L", "spread", "live KV MiB", "bound ms"] + [n + (" (lossy)" if n in LOSSY else "") for n in names]
    lines.append("| " + " | ".join(hdr) + " |")
    lines.append("|" + "---|" * len(hdr))
    rows = sorted(result["rows"], key=lambda r: (r["w"], r["L"], r["spread"], r["B"]))
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['w']} | {r['B']} | {r['L']} | {r['spread']} | case failed: {r['error']} |")
            continue
        bound = bound_ms(result, r)
        cells = [_cell(r["strategies"][n], bound) for n in names]
        lines.append(f"| {r['w']} | {r['B']} | {r['L']} | {r['spread']} | {r['live_kv_bytes'] / 2**20:.2f} | "
                     f"{bound:.4f} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Strategies:")
    for n in names:
        extra = []
        if n in result.get("not_run", {}):
            extra.append("not run: " + result["not_run"][n])
        if n in result.get("precheck", {}).get("failed", {}):
            extra.append("WRONG in the precheck: " + result["precheck"]["failed"][n])
        if n in result.get("notes", {}):
            extra.append(result["notes"][n])
        if n in LOSSY:
            errs = [r["strategies"][n]["err_full"] for r in rows
                    if "strategies" in r and r["strategies"][n].get("status") == "lossy"]
            if errs:
                extra.append(f"error against the full reference where rows differ: {min(errs):.2g} .. {max(errs):.2g}")
        lines.append(f"- `{n}`: {result['labels'][n]}" + ("; " + "; ".join(extra) if extra else ""))
    if result.get("cases_not_run"):
        lines.append("- cases not run (time budget): "
                     + ", ".join(f"w={c['w']} B={c['B']} L={c['L']} spread={c['spread']}" for c in result["cases_not_run"]))
    if not result.get("complete"):
        lines.append("- the run did not complete: the table holds the cases it finished")
    lines += headline_lines(result, rows)
    lines += ["", "Data movement per step, against the live KV (bytes counted, times measured):", "",
              ("| w | B | L | spread | live KV MiB | front-align copy MiB (x live) | front-align ms | "
               "port append KiB (x live) | append+commit ms | strip bytes |"),
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            continue
        live = r["live_kv_bytes"]
        lines.append(f"| {r['w']} | {r['B']} | {r['L']} | {r['spread']} | {live / 2**20:.2f} | "
                     f"{r['align_bytes'] / 2**20:.2f} ({r['align_bytes'] / live:.2f}x) | {r['align_ms']:.3f} | "
                     f"{r['append_bytes'] / 2**10:.1f} ({r['append_bytes'] / live:.2g}x) | {r['append_ms']:.3f} | "
                     f"{r['strip_bytes']} |")
    lines += ["", ("Front-align copy = the gather `gpu.align.materialize_front_aligned` does (reads and writes B x T "
                   "columns of K and V); port append = the new tokens' K/V written at each row's own offset "
                   "(`RaggedKv.append`, w columns per row); the per-sequence commit / dead-prefix strip moves no "
                   "data in the in-place layout (lengths only).")]
    return "\n".join(lines) + "\n"


TARGET_X_BOUND, TARGET_SPEEDUP = 1.10, 30.0     # issue 5: the CuPy kernel at the headline case


def headline_lines(result: dict, rows: list[dict]) -> list[str]:
    """For the issue's headline case (B=128, L=4096, spread 64), each timed strategy's ms / bound
    and speed-up over the per-row loop, and whether the CuPy kernel meets the targets."""
    out = []
    for r in rows:
        if "strategies" not in r or (r["B"], r["L"], r["spread"]) != (HEADLINE["b"], HEADLINE["L"], HEADLINE["spread"]):
            continue
        bound = bound_ms(result, r)
        base = r["strategies"].get("per_row", {}).get("ms")
        parts = []
        for n, res in r["strategies"].items():
            if "ms" in res:
                speed = f", {base / res['ms']:.1f}x the per-row loop's speed" if base else ""
                parts.append(f"`{n}` {res['ms']:.3f} ms = {res['ms'] / bound:.2f}x bound{speed}")
        cupy = r["strategies"].get("cupy", {})
        if "emulation" in result.get("notes", {}).get("cupy", ""):
            verdict = "targets not assessed (the cupy column is the g++ emulator on the CPU)"
        elif "ms" in cupy and base:
            ok = cupy["ms"] / bound <= TARGET_X_BOUND and base / cupy["ms"] >= TARGET_SPEEDUP
            verdict = "targets MET" if ok else "targets MISSED"
        else:
            verdict = f"targets not assessed (cupy: {cupy.get('status', 'absent')})"
        out.append(f"- headline w={r['w']} (B=128, L=4096, spread 64; bound {bound:.3f} ms): " + "; ".join(parts)
                   + f". CuPy targets (<= {TARGET_X_BOUND:.2f}x bound and >= {TARGET_SPEEDUP:.0f}x the per-row "
                   f"loop): {verdict}.")
    return out


def render_plot(result: dict, path: Path) -> Path | None:
    """ms vs B per strategy (log-log), one panel per (w, L, spread), the live-KV bound dashed."""
    rows = [r for r in result["rows"] if "error" not in r]
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["w"], r["L"], r["spread"]) for r in rows})
    ncol = min(4, len(panels))
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow), squeeze=False)
    for ax, (w, L, spread) in zip(axes.flat, panels):
        sel = sorted((r for r in rows if (r["w"], r["L"], r["spread"]) == (w, L, spread)), key=lambda r: r["B"])
        bs = [r["B"] for r in sel]
        ax.plot(bs, [bound_ms(result, r) for r in sel], "k--", lw=2, label="live-KV bound")
        for n in result["strategies"]:
            pts = [(r["B"], r["strategies"][n]["ms"]) for r in sel if "ms" in r["strategies"].get(n, {})]
            if pts:
                ax.plot(*zip(*pts), "o-", ms=3, label=n + (" (lossy)" if n in LOSSY else ""))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"w={w} L={L} spread={spread}", fontsize=9)
        ax.set_xlabel("B")
        ax.set_ylabel("ms")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    where = result["machine"].get("gpu") or "CPU"
    fig.suptitle(("SMOKE (no claims): " if result["smoke"] else "") + f"ragged verify attention, {where}, "
                 f"{result['settings']['dtype']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.06 + 0.02 * (len(labels) > 4), 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_reports(result: dict, out_dir: Path) -> list[Path]:
    md = out_dir / "bench.md"
    md.write_text(render_markdown(result))
    written = [out_dir / "bench.json", md]
    png = render_plot(result, out_dir / "bench.png")
    if png:
        written.append(png)
    return written


def wrong_strategies(result: dict) -> list[str]:
    """Strategies (negative controls excepted) that came out WRONG anywhere."""
    bad = set(result.get("precheck", {}).get("failed", {}))
    for r in result["rows"]:
        for n, res in r.get("strategies", {}).items():
            if res.get("status") == "WRONG":
                bad.add(n)
    return sorted(n for n in bad if n not in NEGATIVE_CONTROLS)


# ----------------------------------------------------------------------------- end to end


def e2e_settings(args) -> dict:
    cfg = dict(E2E_SMOKE if args.smoke else E2E_FULL)
    cfg["model"] = dict(cfg["model"])
    for flag, key in (("device", "device"), ("dtype", "dtype"), ("e2e_batch", "batch"), ("e2e_prompt", "prompt"),
                      ("e2e_steps", "steps")):
        value = getattr(args, flag)
        if value is not None:
            cfg[key] = value
    if cfg["dtype"] not in ("float64", "float32", "bfloat16"):
        raise ValueError(f"--e2e runs the torch backend in float64, float32 or bfloat16, not {cfg['dtype']}")
    if min(cfg["batch"], cfg["prompt"], cfg["steps"]) < 1:
        raise ValueError("--e2e-batch, --e2e-prompt and --e2e-steps must be >= 1")
    cfg.update(smoke=bool(args.smoke), seed=args.seed, backend=args.e2e_backend)
    return cfg


def e2e_overrides(cfg: dict, advance: str) -> list[str]:
    """The scenario (load_scenario overrides) of one e2e run."""
    out = [f"batch={cfg['batch']}", f"prompt_len={cfg['prompt']}", "max_new_tokens=1000000",
           f"steps={cfg['steps']}", f"depth={cfg['depth']}", f"max_seq_len={cfg['max_seq_len']}",
           f"seed={cfg['seed']}", f"acceptance={json.dumps(cfg['acceptance'])}", f"advance={json.dumps(advance)}"]
    if advance == "per-sequence":
        out += ['world="WB"', 'admission="grant"', "xs_per_seq=true"]
    out += [f"model.{k}={json.dumps(v)}" for k, v in cfg["model"].items()]
    return out


def run_e2e(cfg: dict, out_dir: Path, log=None) -> dict:
    """Cohort and per-sequence advance through `reference.simulator.run` on the backend
    `cfg["backend"]` (default torch: `raggedspec.gpu.backend.TorchBackend(device, dtype)`; "cupy": the
    kernels); each step's wall time from the simulator's
    progress callback (the device synchronized first), its live KV tokens (sum of the rows'
    own lengths) and padded tokens (rows x batch width) from the trace. Writes e2e.json and
    e2e.md under out_dir; returns the result."""
    import torch

    from raggedspec.reference import simulator
    from raggedspec.reference.backend import load_backend
    from raggedspec.reference.scenario import load_scenario

    log = log or (lambda msg: None)
    device = torch.device(cfg["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch.cuda.is_available() is False")
    load_backend(cfg.get("backend", "torch"), cfg["device"], cfg["dtype"])  # a backend that cannot run: exit 2 now
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"schema": SCHEMA + "/e2e", "smoke": cfg["smoke"], "settings": cfg, "machine": machine_info(device),
              "runs": []}
    for advance in ("cohort", "per-sequence"):
        sc = load_scenario(None, e2e_overrides(cfg, advance))
        backend = load_backend(cfg.get("backend", "torch"), cfg["device"], cfg["dtype"])
        stamps = []

        def progress(done, total, stamps=stamps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            stamps.append(time.perf_counter())

        t0 = time.perf_counter()
        try:
            trace = simulator.run(sc, progress=progress, backend=backend)
        except Exception as exc:  # noqa: BLE001 - reported, the other run still goes
            result["runs"].append({"advance": advance, "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
            log(f"e2e {advance}: failed: {result['runs'][-1]['error']}")
            continue
        wall = [(b - a) * 1e3 for a, b in zip([t0] + stamps, stamps)]
        steps = []
        for st, ms in zip(trace.steps(), wall):
            rows = st["rows"]
            steps.append({"step": st["step"], "phase": st["phase"], "running": st["running"], "width": st["width"],
                          "live_tokens": sum(r["own_len"] for r in rows), "padded_tokens": len(rows) * st["width"],
                          "committed": st["committed"], "ms": ms, "error": st.get("error")})
        # steady state: decode steps after the first two (warm-up, allocator growth)
        dec = [x for x in steps if x["phase"] == "decode"][2:]
        run = {"advance": advance, "steps": steps, "summary": trace.summary}
        if dec:
            run.update(decode_steps=len(dec), median_ms=statistics.median(x["ms"] for x in dec),
                       mean_live_tokens=statistics.mean(x["live_tokens"] for x in dec),
                       mean_padded_tokens=statistics.mean(x["padded_tokens"] for x in dec),
                       committed_per_step=statistics.mean(x["committed"] for x in dec),
                       max_rows=max(x["running"] for x in dec))
            run["ms_per_committed_token"] = run["median_ms"] / max(run["committed_per_step"], 1e-9)
        result["runs"].append(run)
        log(f"e2e {advance}: {len(steps)} steps, decode median {run.get('median_ms', float('nan')):.2f} ms")
        _write_json(result, out_dir / "e2e.json")
    _write_json(result, out_dir / "e2e.json")
    (out_dir / "e2e.md").write_text(render_e2e(result))
    return result


def render_e2e(result: dict) -> str:
    c, m = result["settings"], result["machine"]
    where = m.get("gpu") or f"CPU ({m.get('cpu')}, {m.get('cpu_count')} cores)"
    lines = []
    if result["smoke"]:
        lines += ["**SMOKE run (CPU, tiny model): it checks that the path runs; no performance claim.**", ""]
    model = json.dumps(c["model"]) if c["model"] else "default tiny"
    lines += [(f"End-to-end step time, tensor-mode simulator on the {c.get('backend', 'torch')} backend "
               f"({c['device']}, {c['dtype']}); "
               f"{where}; torch {m['torch']}. B = {c['batch']} requests of prompt {c['prompt']}, depth {c['depth']}, "
               f"acceptance {c['acceptance']}, {c['steps']} steps, model {model}. "
               "Step time = wall time between the simulator's per-step callbacks (device synchronized); "
               "steady state = decode steps after the first two."), "",
              ("| advance | decode steps | max rows | median step ms | mean live KV tokens | mean padded tokens "
               "(rows x width) | live / padded | committed / step | ms per committed token |"),
              "|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"| {r['advance']} | failed: {r['error']} |")
        elif "median_ms" not in r:
            lines.append(f"| {r['advance']} | no steady-state decode step in {len(r['steps'])} steps |")
        else:
            lines.append(f"| {r['advance']} | {r['decode_steps']} | {r['max_rows']} | {r['median_ms']:.2f} | "
                         f"{r['mean_live_tokens']:.0f} | {r['mean_padded_tokens']:.0f} | "
                         f"{r['mean_live_tokens'] / max(r['mean_padded_tokens'], 1):.3f} | "
                         f"{r['committed_per_step']:.1f} | {r['ms_per_committed_token']:.3f} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- entry points


def run(args) -> int:
    """Run from parsed arguments (the CLI's `run`): 0 ok; 1 a strategy came out WRONG (negative
    controls excepted); 2 bad usage."""
    if args.replot is not None:
        result = json.loads(args.replot.read_text())
        if str(result.get("schema", "")).endswith("/e2e"):
            (args.replot.parent / "e2e.md").write_text(render_e2e(result))
            print(render_e2e(result))
            return 0
        written = write_reports(result, args.replot.parent)
        print(render_markdown(result))
        print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
        return 0
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.e2e:
        try:
            cfg = e2e_settings(args)
            result = run_e2e(cfg, args.out, log)
        except ValueError as exc:
            print(f"raggedspec bench: error: {exc}", file=sys.stderr)
            return 2
        print(render_e2e(result))
        print(f"wrote {args.out}/e2e.json, e2e.md", file=sys.stderr)
        return 1 if any("error" in r for r in result["runs"]) else 0
    try:
        cfg = settings_from(args)
    except ValueError as exc:
        print(f"raggedspec bench: error: {exc}", file=sys.stderr)
        return 2
    if cfg["smoke"]:
        import torch
        torch.set_num_threads(int(os.environ.get("RAGGEDSPEC_TORCH_THREADS", "1")))
    try:
        result = run_bench(cfg, args.out, log)
    except ValueError as exc:
        print(f"raggedspec bench: error: {exc}", file=sys.stderr)
        return 2
    print(render_markdown(result))
    print(f"wrote {args.out}/bench.json, bench.md, bench.png in {result['elapsed_s']:.1f} s", file=sys.stderr)
    bad = wrong_strategies(result)
    if bad:
        print(f"raggedspec bench: WRONG: {', '.join(bad)} disagree with the reference", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m raggedspec.gpu.bench", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
