"""The hand-written kernels of `gpu/kernels.cu`, launched by CuPy on a CUDA GPU or by the g++
emulator on the CPU. Same rules, same refusals as the torch port.

`Kernels("cupy")` and `Kernels("emulate")` run one set of operations (`front_align`,
`strip_dead_prefix`, `ragged_union_mask`, `rope`, `verify_attention` /
`dsv4_attention_rows`), each one launch over all rows through per-row offsets;
`ragged_verify_attention` is the torch-facing entry point `raggedspec bench` calls. The
operations, dtypes, tensor-core path and host-check rules: docs/conformance.md, section
"gpu/cupy_kernels.py".
"""

from __future__ import annotations

import math

import numpy as np

from raggedspec.gpu import kernel_emulator as emu
from raggedspec.reference.errors import CacheRefusal, MaskRefusal, require

# storage dtype name -> (RS_ELEM, RS_ACC)
ELEM = {"float32": ("float", "float"), "float64": ("double", "double"),
        "bfloat16": ("rs_bf16", "float")}
ACC_NUMPY = {"float": np.float32, "double": np.float64}


def dtype_name(dtype) -> str:
    """'float32' | 'float64' | 'bfloat16' for a NumPy/CuPy dtype (16-bit ints are bf16 bits)."""
    name = np.dtype(dtype).name
    if name in ("uint16", "int16"):
        return "bfloat16"
    require(name in ELEM,
            f"dtype {name} is not supported by the kernels (float32, float64, bf16 bits)")
    return name


def defines(dtype: str, nq: int = 1, d: int = 1, nt: int = 32, warps: int = 4,
            stages: int = 3) -> str:
    """The #defines a build of gpu/kernels.cu is specialised by (see the source's header)."""
    elem, acc = ELEM[dtype]
    return (f"#define RS_ELEM {elem}\n#define RS_ACC {acc}\n#define RS_NQ {nq}\n#define RS_D {d}\n"
            f"#define RS_NT {nt}\n#define RS_WARPS {warps}\n#define RS_STAGES {stages}\n")


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float -> bf16 bits (uint16), round to nearest even: how tests feed the bf16 kernels."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def verify_dtype(q, k, v) -> str:
    """The dtype name of `verify_attention`'s operands. Refuses with ValueError: `q` not
    `[B,H,w,D]`, `k, v` not one `[Bkv,Hk,cap,D]` shape, the head dims or the GQA grouping
    (`Hk` dividing `H`) disagreeing, dtypes that differ or the kernels do not take."""
    require(q.ndim == 4 and k.ndim == 4 and tuple(k.shape) == tuple(v.shape),
            f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}: "
            "need [B,H,w,D] and [B,Hk,cap,D]")
    h, d, hk = q.shape[1], q.shape[3], k.shape[1]
    require(k.shape[3] == d and hk >= 1 and h % hk == 0,
            f"q {list(q.shape)} against k {list(k.shape)}: head dim or GQA grouping disagree")
    dtype = dtype_name(q.dtype)
    require(dtype == dtype_name(k.dtype) == dtype_name(v.dtype),
            f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype} must agree")
    return dtype


def refuse_short_rows(row_lens: np.ndarray, w: int) -> None:
    """Every query row's KV row holds at least its `w` queries. Refuses with MaskRefusal
    ("query rows against only") naming the first row's length that does not."""
    short = np.flatnonzero(row_lens < w)
    if short.size:
        raise MaskRefusal(f"{w} query rows against only {int(row_lens[short[0]])} keys")


def check_verify_extras(compressed, t_c: int, ratio: int, sinks, kv_shape: tuple[int, int, int],
                        h: int, dtype: str) -> None:
    """`compressed` (when it holds `t_c > 0` keys) is `[Bkv,Hk,t_c,D]` in k's dtype with a
    compress ratio `>= 1`, and `sinks` (when given) is `[H]` in q's dtype; `kv_shape` is
    `(Bkv, Hk, D)`. Refuses with ValueError otherwise."""
    b_kv, hk, d = kv_shape
    if t_c:
        same = tuple(compressed.shape) == (b_kv, hk, t_c, d)
        require(same and dtype_name(compressed.dtype) == dtype,
                f"compressed {list(compressed.shape)} must be [{b_kv},{hk},t_c,{d}] "
                "in k's dtype")
        require(ratio >= 1,
                f"compress ratio {ratio} must be >= 1 when there are {t_c} compressed keys")
    if sinks is not None:
        require(tuple(sinks.shape) == (h,) and dtype_name(sinks.dtype) == dtype,
                f"sinks {list(sinks.shape)} must be [{h}] in q's dtype")


class Kernels:
    """Launch gpu/kernels.cu with `mode` "cupy" (CUDA) or "emulate" (g++ on the CPU)."""

    def __init__(self, mode: str = "cupy") -> None:
        require(mode in ("cupy", "emulate"), f"kernel mode {mode!r} must be 'cupy' or 'emulate'")
        self.mode = mode
        self.source = emu.SOURCE_PATH.read_text()
        self.sigs = emu.signatures(self.source)
        if mode == "cupy":
            import cupy

            self.xp = cupy
            dev = cupy.cuda.Device()
            self.sm_count = dev.attributes["MultiProcessorCount"]
            self.block = 256
            self.attn_threads = 128
            # the device's own limits, read once: mma.sync on bf16 needs compute capability 8.0
            self.tc_capable = int(dev.compute_capability) >= 80
            self.tc_shared_limit = dev.attributes["MaxSharedMemoryPerBlockOptin"]
            self.sm_shared = dev.attributes["MaxSharedMemoryPerMultiprocessor"]
        else:
            self.xp = np
            self.sm_count = 2
            self.block = 32
            self.attn_threads = 32
            # the emulator routes work as an H200 would
            self.tc_capable, self.tc_shared_limit, self.sm_shared = True, TC_SHARED_LIMIT, SM_SHARED
        self.tc_warps, self.tc_stages = TC_WARPS, TC_STAGES
        self._modules: dict[str, object] = {}
        self._functions: dict[tuple[str, str], object] = {}

    # ------------------------------------------------------------------ launching
    def _launch(self, name: str, dtype: str, grid, block: int, args: list, nq=1, d=1, nt=32,
                warps=4, stages=3,
                shared: int = 0) -> None:
        """One launch of kernel `name` of the build `defines(...)` names, with `shared` bytes of
        dynamic shared memory. CUDA modules and functions are compiled and configured once
        per build (the dynamic-shared limit raised once, when above 48 KB)."""
        text = defines(dtype, nq, d, nt, warps, stages)
        if self.mode == "emulate":
            emu.launch(emu.build(text, self.source), name, tuple(grid), block, args, shared)
            return
        fn = self._functions.get((text, name))
        if fn is None:
            import cupy

            module = self._modules.get(text)
            if module is None:
                module = cupy.RawModule(code=text + self.source, options=("-std=c++17",))
                self._modules[text] = module
            fn = module.get_function(name)
            if shared > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = shared
            self._functions[(text, name)] = fn
        fn(tuple(grid), (block,), tuple(emu.bind(name, self.sigs[name], args)), shared_mem=shared)

    def _elementwise_grid(self, n: int) -> tuple[int, int, int]:
        """Grid-stride launches: up to 32 blocks per SM on CUDA; 4 blocks emulated (each
        emulated thread walks the grid-stride loop, so fewer threads cost less)."""
        blocks = max(1, min(-(-n // self.block), 32 * self.sm_count if self.mode == "cupy" else 4))
        return (blocks, 1, 1)

    def _ints(self, x):
        return self.xp.ascontiguousarray(self.xp.asarray(x, dtype=self.xp.int64).reshape(-1))

    # ------------------------------------------------------------------ operations
    def front_align(self, k, v, lens, target: int | None = None):
        """`(k_front, v_front)` `[B,H,T,D]` from in-place `k, v [B,H,C,D]`: row b's live run
        at `[T - lens[b], T)`, zeros in front (`T = max(lens)` by default). ValueError when
        `target < max(lens)` or a length is negative or past C."""
        lens = self._ints(lens)
        b, h, c, d = k.shape
        require(tuple(v.shape) == tuple(k.shape) and lens.size == b,
                f"k {list(k.shape)}, v {list(v.shape)} and {lens.size} lens must agree")
        require(not bool((lens < 0).any() or (lens > c).any()),
                f"lens {lens.tolist()} must lie in [0, {c}]")
        top = int(lens.max()) if b else 0
        target = top if target is None else int(target)
        require(target >= top, f"target {target} is shorter than the longest row {top}")
        k, v = self.xp.ascontiguousarray(k), self.xp.ascontiguousarray(v)   # the kernels index flat
        ko = self.xp.empty((b, h, target, d), k.dtype)
        vo = self.xp.empty((b, h, target, d), v.dtype)
        n = b * h * target * d
        if n:
            self._launch("rs_front_align", dtype_name(k.dtype), self._elementwise_grid(n),
                         self.block,
                         [k, v, lens, ko, vo, b, h, c, target, d])
        return ko, vo

    def strip_dead_prefix(self, k, v, leads, current: int):
        """In-place `(k, v, lens)` from a front-aligned batch of `current` columns (row b's
        live run `[leads[b], current)`); the buffer width kept. CacheRefusal (as the port)
        when a lead exceeds `current`."""
        leads = self._ints(leads)
        b, h, width, d = k.shape
        require(tuple(v.shape) == tuple(k.shape),
                f"k {list(k.shape)} and v {list(v.shape)} must agree")
        require(leads.size == b, f"{leads.size} leads for a batch of {b}")
        require(not bool((leads < 0).any()), f"dead-prefix leads {leads.tolist()} must be >= 0")
        require(0 <= current <= width, f"current {current} must lie in [0, width {width}]")
        over = np.flatnonzero(self._host(leads > current))
        if over.size:
            raise CacheRefusal(f"cannot drop a {int(leads[over[0]])}-column dead prefix from a "
                               f"slot that holds only {current}")
        k, v = self.xp.ascontiguousarray(k), self.xp.ascontiguousarray(v)   # the kernels index flat
        ko, vo = self.xp.empty_like(k), self.xp.empty_like(v)
        n = k.size
        if n:
            self._launch("rs_strip_dead_prefix", dtype_name(k.dtype), self._elementwise_grid(n),
                         self.block,
                         [k, v, leads, ko, vo, b, h, width, d])
        return ko, vo, current - leads

    def ragged_union_mask(self, rows, q0: int, t_q: int, raw_base: int, t_k: int, t_c: int,
                          ratio: int,
                          window: int, dtype: str = "float64"):
        """The additive `[B,1,t_q,t_k+t_c]` mask of `reference.masks.ragged_union_mask` (rows
        already through `resolve_ragged_rows`). ValueError on rows outside `[0, q0]` or with
        `max != q0`, negative sizes, `window < 1`, `ratio < 1` with compressed keys."""
        rows = self._ints(rows)
        require(rows.size >= 1, "ragged_union_mask needs at least one row")
        require(not bool((rows < 0).any() or (rows > q0).any()) and int(rows.max()) == q0,
                f"rows {rows.tolist()} must lie in [0, q0={q0}] with max == q0 "
                "(resolve_ragged_rows first)")
        require(t_q >= 1 and raw_base >= 0 and t_k >= 0 and t_c >= 0,
                f"t_q {t_q} must be >= 1; raw_base {raw_base}, t_k {t_k}, t_c {t_c} must be >= 0")
        require(window >= 1, f"window {window} must be >= 1")
        require(t_c == 0 or ratio >= 1,
                f"compress ratio {ratio} must be >= 1 when there are {t_c} compressed keys")
        b = rows.size
        out = self.xp.empty((b, 1, t_q, t_k + t_c),
                            dtype=np.float64 if dtype == "float64" else np.float32)
        n = out.size
        if n:
            self._launch("rs_ragged_union_mask", dtype_name(out.dtype), self._elementwise_grid(n),
                         self.block,
                         [rows, b, t_q, q0, raw_base, t_k, t_c, max(ratio, 1), window, out])
        return out

    def rope(self, x, offsets, rope_dims: int, theta: float, inverse: bool = False):
        """Rotate `x [B,H,T,D]`, row b's token t at `offsets[b or 0] + t` (gpu.rope.apply_rope).
        ValueError for a bad `rope_dims`, `theta <= 0`, an `offsets` length neither 1 nor B, a
        negative offset."""
        offsets = self._ints(offsets)
        require(x.ndim == 4, f"x {list(x.shape)} must be [B,H,T,D]")
        b, h, t, d = x.shape
        require(rope_dims >= 2 and rope_dims % 2 == 0 and rope_dims <= d,
                f"rope_dims {rope_dims} must be even, >= 2 and <= head dim {d}")
        require(theta > 0, f"theta {theta} must be > 0")
        require(offsets.size in (1, b), f"{offsets.size} offsets for a batch of {b} (need 1 or B)")
        require(not bool((offsets < 0).any()), f"offsets {offsets.tolist()} must be >= 0")
        x = self.xp.ascontiguousarray(x)
        out = self.xp.empty_like(x)
        if x.size:
            self._launch("rs_rope", dtype_name(x.dtype), self._elementwise_grid(x.size), self.block,
                         [x, offsets, offsets.size, b, h, t, d, rope_dims, float(theta),
                          int(bool(inverse)), out])
        return out

    def n_split(self, b: int, hk: int, longest: int, tile: int, per_sm: int = 1) -> int:
        """Key-axis splits from host-known sizes: the fewest splits whose `b * hk * splits`
        blocks fill whole waves (`sm_count * per_sm` resident blocks) to at least 95%, else
        the best-filling count; never more splits than `tile`-key tiles in `longest`."""
        base, wave = max(b * hk, 1), max(self.sm_count * per_sm, 1)
        most = max(1, -(-longest // tile))

        def filled(s: int) -> float:
            return base * s / (-(-base * s // wave) * wave)

        good = [s for s in range(1, most + 1) if filled(s) >= 0.95]
        return good[0] if good else max(range(1, most + 1), key=lambda s: (filled(s), -s))

    def verify_attention(self, q, k, v, lens, rows=None, window: int | None = None, compressed=None,
                         ratio: int = 0, sinks=None, n_split: int | None = None,
                         nt: int | None = None,
                         path: str | None = None):
        """`out [B,H,w,D]` in q's dtype, read in place, DSV4's rules
        (`gpu.model.dsv4_attention_rows`).

        Query row b reads KV row `rows[b]` (default b) of `k, v [Bkv,Hk,cap,D]`, which holds
        `n = lens[rows[b]]` live positions; query r sits at `qp = n - w + r`, query head h reads
        KV head `h // (H // Hk)`. Raw key p is valid iff `qp - window < p <= qp` (`window`
        None: every earlier key, the bench's full causal attention); only keys some query can
        see are read, nothing at or past n. `compressed [Bkv,Hk,t_c,D]` (K == V,
        start-anchored): block c valid iff `c < (qp + 1) // ratio`. `sinks [H]`: a per-head
        logit in the denominator only. Scale `1/sqrt(D)`. `path` "tc" | "simt" forces a kernel
        (default: tensor cores where `tc_fits`). `lens` / `rows` as host integers are checked
        here; as device arrays they are not read (bad values give NaN rows, see the module).
        MaskRefusal ("query rows against only") for a row shorter than w; ValueError on shapes,
        lens past cap, `window < 1`, `ratio < 1` with compressed keys."""
        xp = self.xp
        dtype = verify_dtype(q, k, v)
        b, h, w, d = q.shape
        b_kv, hk, cap, _ = k.shape
        host_lens, host_rows, rows = self._verify_rows(lens, rows, b, b_kv, cap)
        require(window is None or window >= 1, f"window {window} must be >= 1")
        window = cap + w if window is None else min(int(window), cap + w)   # wider: same keys
        if host_lens is not None and host_rows is not None:
            refuse_short_rows(host_lens[host_rows], w)
        t_c = 0 if compressed is None else int(compressed.shape[2])
        check_verify_extras(compressed, t_c, ratio, sinks, (b_kv, hk, d), h, dtype)
        out = xp.empty(q.shape, dtype=q.dtype)
        if out.size == 0:
            return out
        nq = (h // hk) * w
        q, k, v = (xp.ascontiguousarray(t) for t in (q, k, v))
        ck_in = None if not t_c else xp.ascontiguousarray(compressed)
        aligned = self._aligned16([q, k, v] + ([] if ck_in is None else [ck_in]))
        path = self._verify_path(path, aligned, nq, d, dtype, cap, t_c, w)
        nt = self.attn_threads if nt is None else nt
        tile, shared, per_sm = self._verify_occupancy(path, nq, d, dtype, nt)
        if n_split is None:
            n_split = self.n_split(b, hk, min(cap, window + w - 1) + t_c, tile, per_sm)
        require(n_split >= 1, f"n_split {n_split} must be >= 1")
        ck = xp.zeros(1, dtype=q.dtype) if ck_in is None else ck_in
        lens_d = self._ints(lens if host_lens is None else host_lens)
        rows_d = self._ints(rows if host_rows is None else host_rows)
        args = [q, k, v, lens_d, rows_d, ck, t_c, max(ratio, 1), b, hk, cap, w, window,
                n_split, b_kv]
        self._launch_verify(path, dtype, (n_split, hk, b), args, out, sinks, nq, nt, shared)
        return out

    def _verify_rows(self, lens, rows, b: int, b_kv: int, cap: int):
        """`(host_lens, host_rows, rows)` of `verify_attention`: the lengths and the KV row of
        each query row (`0..b-1` when `rows` is None) as host integers, None where given on the
        device (then only their sizes are checked). Refuses with ValueError: `lens` not `b_kv`
        values in `[0, cap]`, `rows` None with `b != b_kv`, `rows` not `b` indices below
        `b_kv`."""
        host_lens = self._host_ints(lens)
        if host_lens is not None:
            bad = (host_lens < 0).any() or (host_lens > cap).any()
            require(host_lens.size == b_kv and not bool(bad),
                    f"lens {host_lens.tolist()} must be {b_kv} values in [0, cap {cap}]")
        else:
            require(lens.size == b_kv, f"{lens.size} lens for {b_kv} KV rows")
        if rows is None:
            require(b_kv == b, f"{b} query rows for {b_kv} KV rows: pass rows")
            rows = np.arange(b, dtype=np.int64)
        host_rows = self._host_ints(rows)
        if host_rows is not None:
            bad = (host_rows < 0).any() or (host_rows >= b_kv).any()
            require(host_rows.size == b and not bool(bad),
                    f"rows {host_rows.tolist()} must be {b} indices into {b_kv} KV rows")
        else:
            require(rows.size == b, f"{rows.size} rows for {b} query rows")
        return host_lens, host_rows, rows

    def _verify_path(self, path: str | None, aligned: bool, nq: int, d: int, dtype: str,
                     cap: int, t_c: int, w: int) -> str:
        """The verify kernel to run: `path` when given, else "tc" where the operands are
        16-byte aligned and `tc_fits`, else "simt". Refuses with ValueError a path other than
        "tc" / "simt", and "tc" on unaligned operands, on a shape it does not take, or with
        `max(cap, t_c) * D` or `cap + w` past its 32-bit indices."""
        path = path or ("tc" if aligned and self.tc_fits(nq, d, dtype) else "simt")
        require(path in ("tc", "simt"), f"verify path {path!r} must be 'tc' or 'simt'")
        if path == "tc":
            require(aligned, "the tensor-core kernel copies 16-byte chunks: q, k, v and "
                    "compressed must start "
                    "16-byte aligned")
            require(self.tc_fits(nq, d, dtype),
                    f"the tensor-core kernel does not take {nq} queries of head dim {d} "
                    f"in {dtype} (bf16, head dim in {TC_HEAD_DIMS}, at most {TC_MAX_TILES} 16x8 "
                    f"accumulator tiles)")
            require(max(cap, t_c) * d < 2**31 and cap + w < 2**31,
                    f"cap {cap} x head dim {d} is past the tensor-core kernel's 32-bit indices")
        return path

    def _verify_occupancy(self, path: str, nq: int, d: int, dtype: str, nt: int):
        """`(tile, shared bytes, blocks per SM)` of the verify kernel on `path` (shared is 0
        for "simt", whose shared memory is static). Refuses with ValueError a "simt" launch
        whose `nq` queries of head dim `d` do not fit its shared memory and accumulators (a
        prefill belongs to the torch port)."""
        require(path == "tc" or self.fits(nq, d, dtype, nt),
                f"{nq} queries per KV head (G * w) of head dim {d} need "
                f"{verify_shared_bytes(nq, d, dtype, nt)} "
                f"bytes of shared memory and {nq} accumulators per thread; the verify kernel "
                "takes at most "
                f"{SHARED_LIMIT} bytes and {MAX_QUERIES} queries (a prefill belongs to the "
                "torch port)")
        if path == "tc":
            shared = tc_shared_bytes(nq, d, self.tc_warps, self.tc_stages)
            per_sm = max(1, min(self.sm_shared // (shared + 1024), 2048 // (32 * self.tc_warps)))
            return TC_TILE, shared, per_sm
        static = verify_shared_bytes(nq, d, dtype, nt)
        return nt, 0, max(1, min(2048 // nt, self.sm_shared // (static + 1024)))

    def _launch_verify(self, path: str, dtype: str, grid: tuple[int, int, int], args: list,
                       out, sinks, nq: int, nt: int, shared: int) -> None:
        """The verify launches into `out [B,H,w,D]`: the partial kernel of `path` over
        `grid = (n_split, Hk, B)` with `args` (q, k, v, lens, rows, compressed, t_c, ratio, b,
        hk, cap, w, window, n_split, b_kv) and its scale, then the combine (sinks folded in).
        No refusals."""
        xp, (n_split, hk, b), w, d = self.xp, grid, out.shape[2], out.shape[3]
        acc = ACC_NUMPY[ELEM[dtype][1]]
        parts = [xp.empty((n_split, b, hk, nq), dtype=acc),
                 xp.empty((n_split, b, hk, nq), dtype=acc),
                 xp.empty((n_split, b, hk, nq, d), dtype=acc)]
        if path == "tc":
            self._launch("rs_verify_attention_tc", dtype, (n_split, hk, b), 32 * self.tc_warps,
                         args + [math.log2(math.e) / math.sqrt(d)] + parts,
                         nq=nq, d=d, nt=nt, warps=self.tc_warps, stages=self.tc_stages,
                         shared=shared)
        else:
            self._launch("rs_verify_attention_partial", dtype, (n_split, hk, b), nt,
                         args + [1.0 / math.sqrt(d)] + parts, nq=nq, d=d, nt=nt,
                         warps=self.tc_warps, stages=self.tc_stages)
        dummy = xp.zeros(1, dtype=out.dtype)
        self._launch("rs_verify_attention_combine", dtype, self._elementwise_grid(out.size),
                     self.block,
                     parts + [dummy if sinks is None else xp.ascontiguousarray(sinks),
                              int(sinks is not None), b, hk, w, n_split, out], nq=nq, d=d, nt=nt,
                     warps=self.tc_warps, stages=self.tc_stages)

    def dsv4_attention_rows(self, q, k, v, lens, rows, compressed, compress_ratio: int,
                            sliding_window: int,
                            sinks=None, n_split: int | None = None, nt: int | None = None,
                            path: str | None = None):
        """`gpu.model.dsv4_attention_rows` as one kernel pass: DSV4 union attention of each
        query row over its own KV row in place. A Standard layer (`compress_ratio <= 1`)
        ignores `compressed`; `window = max(sliding_window, 1)`. Same refusal
        (MaskRefusal "query rows against only")."""
        comp = None if compress_ratio <= 1 else compressed
        return self.verify_attention(q, k, v, lens, rows=rows, window=max(int(sliding_window), 1),
                                     compressed=comp,
                                     ratio=compress_ratio, sinks=sinks, n_split=n_split, nt=nt,
                                     path=path)

    def fits(self, nq: int, d: int, dtype: str, nt: int | None = None) -> bool:
        """Whether a verify kernel takes `nq` queries per KV head of head dim `d` (the same
        rule on both runners, so the emulator routes work exactly as CUDA would)."""
        nt = self.attn_threads if nt is None else nt
        simt = nq <= MAX_QUERIES and verify_shared_bytes(nq, d, dtype, nt) <= SHARED_LIMIT
        return simt or self.tc_fits(nq, d, dtype)

    def tc_fits(self, nq: int, d: int, dtype: str) -> bool:
        """Whether the tensor-core kernel takes `nq` queries of head dim `d`: bf16, `d` in
        TC_HEAD_DIMS (powers of two: the shared-memory swizzle XORs chunk bits), at most
        MAX_QUERIES queries and TC_MAX_TILES accumulator tiles of 16 dims x 8 queries per
        warp, its dynamic shared memory within the device's opt-in limit (an H200's,
        TC_SHARED_LIMIT, on the emulator), and a device with bf16 mma.sync (sm_80 on)."""
        return (dtype == "bfloat16" and d in TC_HEAD_DIMS and 1 <= nq <= MAX_QUERIES
                and (d // 16) * -(-nq // 8) <= TC_MAX_TILES
                and self.tc_capable
                and tc_shared_bytes(nq, d, self.tc_warps, self.tc_stages) <= self.tc_shared_limit)

    def _host_ints(self, x) -> np.ndarray | None:
        """`x` as host int64 when it is host data (a number, list, tuple, NumPy array); None
        for a device array, which is never read back."""
        if self.mode == "cupy" and not isinstance(x, (int, list, tuple, np.ndarray)):
            return None
        return np.asarray(x, dtype=np.int64).reshape(-1)

    def _aligned16(self, arrays: list) -> bool:
        """Whether every array starts 16-byte aligned (host metadata: the data pointer)."""
        return all((a.data.ptr if self.mode == "cupy" else a.ctypes.data) % 16 == 0 for a in arrays)

    def _host(self, a) -> np.ndarray:
        return a.get() if self.mode == "cupy" else np.asarray(a)


SHARED_LIMIT = 48 * 1024   # static shared memory a CUDA block may declare
MAX_QUERIES = 64            # G * w: accumulators and scores held per thread
TC_SHARED_LIMIT = 227 * 1024   # dynamic shared memory an H200 block may opt in to (emulator)
SM_SHARED = 228 * 1024         # shared memory per H200 SM, each block also taking 1 KB (emulator)
TC_WARPS, TC_STAGES, TC_TILE = 4, 3, 64   # tensor-core kernel: warps, cp.async stages, keys a stage
TC_MAX_TILES = 16              # 16x8 float accumulator tiles a lane holds 4 values of: 64 registers
TC_HEAD_DIMS = (16, 32, 64, 128, 256)
TC_PITCH = 24                  # bf16 per row of a warp's P^T tile (16 keys + 8 of padding)


def tc_shared_bytes(nq: int, d: int, warps: int = TC_WARPS, stages: int = TC_STAGES) -> int:
    """Dynamic shared memory of `rs_verify_attention_tc`, laid out as the kernel lays it out:
    K and V stages (bf16; the warps' final float accumulators reuse them, and the region
    grows when those are larger), q padded to a multiple of 8 queries, each warp's P^T tile,
    each warp's max and sum (float)."""
    nqp = -(-nq // 8) * 8
    stages_or_acc = max(2 * 2 * stages * TC_TILE * d, 4 * warps * nqp * d)
    return stages_or_acc + 2 * (nqp * d + warps * nqp * TC_PITCH) + 4 * 2 * warps * nqp


def verify_shared_bytes(nq: int, d: int, dtype: str, nt: int) -> int:
    """Static shared memory of `rs_verify_attention_partial`: q (nq x d), the scores
    (nq x nt) and three per-query values, in the compute type."""
    acc = np.dtype(ACC_NUMPY[ELEM[dtype][1]]).itemsize
    return (nq * d + nq * nt + 3 * nq) * acc


def cupy_unavailable() -> str | None:
    """Why CuPy cannot launch kernels here (not importable, no CUDA device), or None."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - any import failure means "no CuPy here"
        return (f"cupy is not importable ({type(exc).__name__}: {exc}); install the 'cupy' "
                "extra on a CUDA machine")
    try:
        if not cupy.cuda.is_available():
            return "cupy.cuda.is_available() is False: no CUDA device"
    except Exception as exc:  # noqa: BLE001
        return f"no CUDA device ({type(exc).__name__}: {exc})"
    return None


def kernel_array(t, mode: str):
    """A zero-copy kernel array of a torch tensor: NumPy ("emulate", CPU tensors) or CuPy
    through DLPack ("cupy"); bf16 as its int16 bits (neither has a bf16 dtype)."""
    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    if mode == "emulate":
        return t.numpy()
    import cupy

    return cupy.from_dlpack(t)


def torch_tensor(a, dtype, mode: str):
    """The torch tensor over a kernel array (zero-copy), read as `dtype` (bf16 from its bits)."""
    import torch

    t = torch.from_numpy(np.asarray(a)) if mode == "emulate" else torch.from_dlpack(a)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


_KERNELS: dict[str, Kernels] = {}


def _verify_attention_torch(mode: str, q, k, v, lens):
    """`Kernels(mode).verify_attention` on torch tensors, out as a torch tensor in q's dtype."""
    import torch

    kern = _KERNELS.get(mode) or _KERNELS.setdefault(mode, Kernels(mode))
    out = kern.verify_attention(*(kernel_array(t, mode) for t in (q, k, v, lens.to(torch.int64))))
    return torch_tensor(out, q.dtype, mode)


def ragged_verify_attention(q, k, v, lens):
    """The bench's contract (raggedspec/bench/strategies.py): torch CUDA tensors `q [B,H,w,D]`,
    in-place
    `k, v [B,Hk,cap,D]`, int64 `lens [B]` -> `out [B,H,w,D]` in q's dtype, on torch's current
    stream, no copy of KV (DLPack views; bf16 travels as int16 bits)."""
    import cupy
    import torch

    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        return _verify_attention_torch("cupy", q, k, v, lens)


def ragged_verify_attention_emulated(q, k, v, lens):
    """`ragged_verify_attention` for CPU torch tensors, through the g++ emulator (bench smoke
    runs and tests on machines without a GPU). Same contract; bf16 travels as its bits."""
    return _verify_attention_torch("emulate", q, k, v, lens)
