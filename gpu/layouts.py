"""Converters between the reference's ragged verify batch and four standard kernel layouts.

The canonical form is `VerifyBatch`: a front-aligned (left-padded) cache, as the reference's
ragged batch holds it, plus per-row query lengths. Row i holds `kv_lens[i]` keys in columns
`[lead_i, T)` of `k, v [B, Hk, T, D]` (`lead_i = T - kv_lens[i]`, key column c at position
`c - lead_i`) and `q_lens[i]` queries in slots `[t_q - q_lens[i], t_q)` of `q [B, Hq, t_q, D]`;
its queries are its last keys (query j at position `kv_lens[i] - q_lens[i] + j`). Query head h
reads KV head `h // (Hq // Hk)`. A query at position qp sees key kp iff `kp <= qp` and, with
a window w, `kp > qp - w` (w keys, the diagonal included). Cells outside the live runs are
dead: their contents must never reach an output.

The layouts are those of the kernels engines call: `varlen` (flash-attn's
`flash_attn_varlen_func`), `kvcache` (flash-attn's `flash_attn_with_kvcache`, dense with
`cache_leftpad` or paged with `block_table`), `paged` (FlashInfer's `qo_indptr`, `kv_indptr`,
`kv_indices`, `kv_last_page_len`, NHD pages) and `padded` (a left-padded dense batch with a
boolean key mask and per-query position ids, the Hugging Face convention). Each `to_*`
builds the layout's arrays, each `from_*` reads them back (refusing malformed arrays with a
ValueError naming the field); `*.call()` gives the positional and keyword arguments of the
layout's kernel signature, and `*.output_to_batch` maps the kernel's output back to the
canonical `[B, Hq, t_q, D]` (dead slots zero). The spec's per-head attention sinks (a logit
that joins the softmax denominator only) travel in the padded layout's `sinks` argument;
the other three signatures have no place for them and refuse a batch that has them. None
carries the spec's compressed blocks.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

import torch

LAYOUTS = ("varlen", "kvcache", "paged", "padded")


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _ints(x) -> list[int]:
    return [int(v) for v in (x.tolist() if isinstance(x, torch.Tensor) else x)]


@dataclass
class VerifyBatch:
    """The reference's ragged verify batch (see the module docstring for the conventions).

    Invariants (ValueError otherwise): `q, k, v` rank 4 with matching B and D, Hk dividing
    Hq; `0 <= q_lens[i] <= kv_lens[i]`; `T == max(kv_lens)` and `t_q == max(q_lens)` (the
    batch is front-aligned to its longest row); `window` None (unbounded) or >= 1."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_lens: list[int]
    kv_lens: list[int]
    window: int | None = None
    sinks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.q_lens, self.kv_lens = _ints(self.q_lens), _ints(self.kv_lens)
        _need(self.q.dim() == 4 and self.k.dim() == 4 and self.v.dim() == 4,
              f"q {list(self.q.shape)}, k {list(self.k.shape)}, v {list(self.v.shape)} "
              "must be rank 4")
        b, hq, t_q, d = self.q.shape
        _need(self.k.shape == self.v.shape and self.k.shape[0] == b and self.k.shape[3] == d,
              f"k {list(self.k.shape)} and v {list(self.v.shape)} must be [B={b}, Hk, T, D={d}]")
        hk = self.k.shape[1]
        _need(hk >= 1 and hq % hk == 0, f"KV heads {hk} must divide query heads {hq}")
        _need(len(self.q_lens) == b and len(self.kv_lens) == b,
              f"q_lens {self.q_lens} and kv_lens {self.kv_lens} must have B={b} entries")
        for i, (ql, kl) in enumerate(zip(self.q_lens, self.kv_lens, strict=True)):
            _need(0 <= ql <= kl, f"row {i}: q_len {ql} must lie in [0, kv_len {kl}]")
        _need(self.k.shape[2] == max(self.kv_lens, default=0),
              f"k holds {self.k.shape[2]} columns, max(kv_lens) is {max(self.kv_lens, default=0)}")
        _need(t_q == max(self.q_lens, default=0),
              f"q holds {t_q} query slots, max(q_lens) is {max(self.q_lens, default=0)}")
        _need(self.window is None or self.window >= 1, f"window {self.window} must be None or >= 1")
        _need(self.sinks is None or tuple(self.sinks.shape) == (hq,),
              f"sinks {None if self.sinks is None else list(self.sinks.shape)} must be [Hq={hq}]")

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def leads(self) -> list[int]:
        """Dead columns before each row's keys: `T - kv_lens[i]`."""
        return [self.k.shape[2] - n for n in self.kv_lens]

    @property
    def q_starts(self) -> list[int]:
        """Position of each row's first query: `kv_lens[i] - q_lens[i]`."""
        return [kl - ql for ql, kl in zip(self.q_lens, self.kv_lens, strict=True)]

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.q.shape[3])

    def window_left(self) -> int:
        """flash-attn's / FlashInfer's left window: `w - 1` keys before the diagonal, -1
        unbounded."""
        return -1 if self.window is None else self.window - 1


def zero_dead(batch: VerifyBatch) -> VerifyBatch:
    """A copy of `batch` whose dead query slots and key columns hold zeros."""
    q, k, v = batch.q.clone(), batch.k.clone(), batch.v.clone()
    t_q = q.shape[2]
    for i, (ql, lead) in enumerate(zip(batch.q_lens, batch.leads, strict=True)):
        q[i, :, : t_q - ql] = 0
        k[i, :, :lead] = 0
        v[i, :, :lead] = 0
    return replace(batch, q=q, k=k, v=v)


def live_queries(batch: VerifyBatch, x: torch.Tensor) -> list[torch.Tensor]:
    """Row i's live query slots of a `[B, H, t_q, *]` tensor: `[H, q_lens[i], *]` each."""
    t_q = x.shape[2]
    return [x[i, :, t_q - ql:] for i, ql in enumerate(batch.q_lens)]


def live_keys(batch: VerifyBatch, x: torch.Tensor) -> list[torch.Tensor]:
    """Row i's live key columns of a `[B, Hk, T, D]` tensor: `[Hk, kv_lens[i], D]` each."""
    return [x[i, :, lead:] for i, lead in enumerate(batch.leads)]


def _front_align(rows: list[torch.Tensor], width: int, like: torch.Tensor) -> torch.Tensor:
    """Rows `[H, n_i, D]` right-aligned into one zero buffer `[B, H, width, D]` (`like`: any
    tensor whose last two axes are `[H, D]` after moving the token axis out, i.e. a packed
    `[*, H, D]` tensor; it gives H, D, dtype and device)."""
    h, d = like.shape[-2], like.shape[-1]
    out = torch.zeros((len(rows), h, width, d), dtype=like.dtype, device=like.device)
    for i, r in enumerate(rows):
        if r.shape[1]:
            out[i, :, width - r.shape[1]:] = r
    return out


def _same_shape(out: torch.Tensor, q: torch.Tensor) -> None:
    _need(out.shape == q.shape, f"output {list(out.shape)} must have q's shape {list(q.shape)}")


def _cumulative(lens: list[int], device) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def _check_indptr(name: str, indptr: torch.Tensor, total: int) -> list[int]:
    ptr = _ints(indptr)
    _need(len(ptr) >= 1 and ptr[0] == 0, f"{name} {ptr} must start at 0")
    _need(all(a <= b for a, b in itertools.pairwise(ptr)), f"{name} {ptr} must be non-decreasing")
    _need(ptr[-1] == total, f"{name} ends at {ptr[-1]}, but the packed axis holds {total}")
    return [b - a for a, b in itertools.pairwise(ptr)]


# ----------------------------------------------------------------------------- varlen


@dataclass
class Varlen:
    """flash-attn's varlen layout: `q [total_q, Hq, D]`, `k, v [total_k, Hk, D]` packed row
    after row, `cu_seqlens_q/k` int32 `[B+1]`; causal aligned bottom-right (query i of a row
    with `q_len` queries and `k_len` keys sees key j iff `j <= i + k_len - q_len`);
    `window_size = (left, right)`, -1 unbounded."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    window_size: tuple[int, int]
    softmax_scale: float

    def call(self) -> tuple[tuple, dict]:
        """`flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, softmax_scale=, causal=True, window_size=)`."""
        return ((self.q, self.k, self.v, self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q,
                 self.max_seqlen_k),
                {"softmax_scale": self.softmax_scale, "causal": True,
                 "window_size": self.window_size})

    def output_to_batch(self, out: torch.Tensor) -> torch.Tensor:
        """`[total_q, Hq, D]` -> canonical `[B, Hq, t_q, D]`."""
        _same_shape(out, self.q)
        return _unpack_queries(out, _ints(self.cu_seqlens_q), self.max_seqlen_q)


def _unpack_queries(out: torch.Tensor, indptr: list[int], t_q: int) -> torch.Tensor:
    _need(out.dim() == 3 and out.shape[0] == indptr[-1],
          f"output {list(out.shape)} must be [total_q={indptr[-1]}, Hq, D]")
    rows = [out[a:b].transpose(0, 1) for a, b in itertools.pairwise(indptr)]
    return _front_align(rows, t_q, out)


def _pack_queries(batch: VerifyBatch) -> torch.Tensor:
    rows = live_queries(batch, batch.q)
    return torch.cat([r.transpose(0, 1) for r in rows], dim=0)


def _pack_keys(batch: VerifyBatch, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([r.transpose(0, 1) for r in live_keys(batch, x)], dim=0)


def _no_sinks(batch: VerifyBatch, layout: str) -> None:
    _need(batch.sinks is None, f"the {layout} layout has no argument for attention sinks")


def to_varlen(batch: VerifyBatch) -> Varlen:
    """Pack the live queries and keys; dead cells are not carried. ValueError on sinks."""
    _no_sinks(batch, "varlen")
    dev = batch.q.device
    return Varlen(_pack_queries(batch), _pack_keys(batch, batch.k), _pack_keys(batch, batch.v),
                  _cumulative(batch.q_lens, dev), _cumulative(batch.kv_lens, dev),
                  max(batch.q_lens, default=0), max(batch.kv_lens, default=0),
                  (batch.window_left(), 0), batch.softmax_scale)


def _window_of(left: int, right: int, field_name: str) -> int | None:
    _need(right == 0, f"{field_name} right side {right} must be 0 (causal verify)")
    _need(left >= -1, f"{field_name} left side {left} must be -1 or >= 0")
    return None if left == -1 else left + 1


def from_varlen(x: Varlen) -> VerifyBatch:
    """Read a varlen batch back (dead cells zero). ValueError naming the field on
    inconsistent cumulative lengths or a window with a right side."""
    q_lens = _check_indptr("cu_seqlens_q", x.cu_seqlens_q, x.q.shape[0])
    kv_lens = _check_indptr("cu_seqlens_k", x.cu_seqlens_k, x.k.shape[0])
    _need(len(q_lens) == len(kv_lens),
          f"cu_seqlens_q has {len(q_lens)} rows, cu_seqlens_k {len(kv_lens)}")
    cq, ck = _ints(x.cu_seqlens_q), _ints(x.cu_seqlens_k)
    t_q, t_k = max(q_lens, default=0), max(kv_lens, default=0)
    _need(x.max_seqlen_q >= t_q and x.max_seqlen_k >= t_k,
          f"max_seqlen_q {x.max_seqlen_q} / max_seqlen_k {x.max_seqlen_k} below the longest row")
    q = _front_align([x.q[a:b].transpose(0, 1) for a, b in itertools.pairwise(cq)], t_q, x.q)
    k = _front_align([x.k[a:b].transpose(0, 1) for a, b in itertools.pairwise(ck)], t_k, x.k)
    v = _front_align([x.v[a:b].transpose(0, 1) for a, b in itertools.pairwise(ck)], t_k, x.v)
    return VerifyBatch(q, k, v, q_lens, kv_lens, _window_of(*x.window_size, "window_size"))


# ----------------------------------------------------------------------------- kvcache


@dataclass
class KvCache:
    """flash-attn's `flash_attn_with_kvcache` layout. `q [B, t_q, Hq, D]` with each row's
    queries in its last `q_lens[i]` slots (earlier slots are padding, their outputs unread);
    dense: `k_cache [B, T, Hk, D]` front-aligned, `cache_leftpad[i]` = the row's first key
    column, `cache_seqlens[i]` = its end column (live keys `[leftpad, seqlens)`); paged:
    `k_cache [num_blocks, page_size, Hk, D]`, key p of row i in block
    `block_table[i, p // page_size]` at offset `p % page_size`, `cache_seqlens[i]` its
    length. `q_lens` is metadata (the kernel's signature has no query lengths)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    cache_leftpad: torch.Tensor | None
    block_table: torch.Tensor | None
    window_size: tuple[int, int]
    softmax_scale: float
    q_lens: list[int] = field(default_factory=list)

    def call(self) -> tuple[tuple, dict]:
        """`flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=, cache_leftpad=,
        block_table=, softmax_scale=, causal=True, window_size=)`."""
        return ((self.q, self.k_cache, self.v_cache),
                {"cache_seqlens": self.cache_seqlens, "cache_leftpad": self.cache_leftpad,
                 "block_table": self.block_table, "softmax_scale": self.softmax_scale,
                 "causal": True, "window_size": self.window_size})

    def output_to_batch(self, out: torch.Tensor) -> torch.Tensor:
        """`[B, t_q, Hq, D]` -> canonical `[B, Hq, t_q, D]`, padding slots zeroed."""
        _need(out.shape == self.q.shape,
              f"output {list(out.shape)} must be q's {list(self.q.shape)}")
        res = out.transpose(1, 2).clone()
        t_q = res.shape[2]
        for i, ql in enumerate(self.q_lens):
            res[i, :, : t_q - ql] = 0
        return res


def page_permutation(n_pages: int, seed: int, device=None) -> torch.Tensor:
    """A seeded order of physical pages, so page tables are not the identity."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n_pages, generator=g).to(device)


def _pages_needed(n: int, page_size: int) -> int:
    return -(-n // page_size)


def _fill_pages(batch: VerifyBatch, page_size: int, seed: int, fill: float):
    """Physical pages `[P, page_size, Hk, D]` (one spare page, unused slots = `fill`) and each
    row's page ids in order."""
    _need(page_size >= 1, f"page_size {page_size} must be >= 1")
    counts = [_pages_needed(n, page_size) for n in batch.kv_lens]
    total = sum(counts) + 1
    perm = _ints(page_permutation(total, seed))
    hk, d = batch.k.shape[1], batch.k.shape[3]
    shape = (total, page_size, hk, d)
    kp = torch.full(shape, fill, dtype=batch.k.dtype, device=batch.k.device)
    vp = torch.full(shape, -fill, dtype=batch.v.dtype, device=batch.v.device)
    ids, nxt = [], 0
    for i, (n, c) in enumerate(zip(batch.kv_lens, counts, strict=True)):
        row = perm[nxt: nxt + c]
        nxt += c
        ids.append(row)
        lead = batch.leads[i]
        for p, page in enumerate(row):
            lo, hi = p * page_size, min(n, (p + 1) * page_size)
            kp[page, : hi - lo] = batch.k[i, :, lead + lo: lead + hi].transpose(0, 1)
            vp[page, : hi - lo] = batch.v[i, :, lead + lo: lead + hi].transpose(0, 1)
    return kp, vp, ids


PAGE_FILL = 3.0
"""What unused page slots hold (values get `-PAGE_FILL`): finite, and far from the data."""


def to_kvcache(batch: VerifyBatch, page_size: int | None = None, seed: int = 0) -> KvCache:
    """Dense (`page_size` None: the front-aligned cache itself with `cache_leftpad = leads`,
    dead columns carried as they are) or paged (pages in a seeded order, one spare page,
    `block_table` padded with page 0 past each row's pages). ValueError on sinks."""
    _no_sinks(batch, "kvcache")
    dev = batch.q.device
    q = batch.q.transpose(1, 2).contiguous()
    wsize = (batch.window_left(), 0)
    i32 = torch.int32
    if page_size is None:
        t = batch.k.shape[2]
        return KvCache(q, batch.k.transpose(1, 2).contiguous(),
                       batch.v.transpose(1, 2).contiguous(),
                       torch.full((batch.batch,), t, dtype=i32, device=dev),
                       torch.tensor(batch.leads, dtype=i32, device=dev), None, wsize,
                       batch.softmax_scale, list(batch.q_lens))
    kp, vp, ids = _fill_pages(batch, page_size, seed, PAGE_FILL)
    width = max([len(r) for r in ids] + [1])
    table = torch.zeros((batch.batch, width), dtype=i32)
    for i, r in enumerate(ids):
        table[i, : len(r)] = torch.tensor(r, dtype=i32)
    return KvCache(q, kp, vp, torch.tensor(batch.kv_lens, dtype=i32, device=dev), None,
                   table.to(dev), wsize, batch.softmax_scale, list(batch.q_lens))


def from_kvcache(x: KvCache) -> VerifyBatch:
    """Read a with_kvcache batch back. The query padding slots are kept as they are, and so
    are a dense cache's dead columns; a paged one yields zero dead columns. ValueError
    naming the field on a leftpad past its seqlen, a
    seqlen past the cache, a block table too short, or a query length past the slots."""
    b, t_q = x.q.shape[0], x.q.shape[1]
    seq = _ints(x.cache_seqlens)
    _need(len(seq) == b and len(x.q_lens) == b,
          f"cache_seqlens {seq} / q_lens {x.q_lens} for B={b}")
    _need(all(0 <= ql <= t_q for ql in x.q_lens), f"q_lens {x.q_lens} must lie in [0, {t_q}]")
    q = x.q.transpose(1, 2).clone()
    window = _window_of(*x.window_size, "window_size")
    if x.block_table is None:
        pad = [0] * b if x.cache_leftpad is None else _ints(x.cache_leftpad)
        t = x.k_cache.shape[1]
        for i, (p, s) in enumerate(zip(pad, seq, strict=True)):
            _need(0 <= p <= s <= t,
                  f"row {i}: cache_leftpad {p} / cache_seqlens {s} outside [0, {t}]")
        kv_lens = [s - p for p, s in zip(pad, seq, strict=True)]
        if all(s == t for s in seq) and max(kv_lens, default=0) == t:
            return VerifyBatch(q, x.k_cache.transpose(1, 2).clone(),
                               x.v_cache.transpose(1, 2).clone(),
                               list(x.q_lens), kv_lens, window)
        spans = list(zip(pad, seq, strict=True))
        ks = [x.k_cache[i, p:s].transpose(0, 1) for i, (p, s) in enumerate(spans)]
        vs = [x.v_cache[i, p:s].transpose(0, 1) for i, (p, s) in enumerate(spans)]
    else:
        _need(x.cache_leftpad is None, "cache_leftpad must be None with a block_table")
        ps = x.k_cache.shape[1]
        ks, vs = [], []
        for i, n in enumerate(seq):
            need = _pages_needed(n, ps)
            _need(need <= x.block_table.shape[1],
                  f"row {i}: cache_seqlens {n} needs {need} blocks, "
                  f"block_table has {x.block_table.shape[1]}")
            pages = x.block_table[i, :need].long()
            ks.append(x.k_cache[pages].flatten(0, 1)[:n].transpose(0, 1))
            vs.append(x.v_cache[pages].flatten(0, 1)[:n].transpose(0, 1))
        kv_lens = seq
    t = max(kv_lens, default=0)
    like_k, like_v = x.k_cache, x.v_cache
    return VerifyBatch(q, _front_align(ks, t, like_k), _front_align(vs, t, like_v), list(x.q_lens),
                       kv_lens, window)


# ----------------------------------------------------------------------------- paged


@dataclass
class Paged:
    """FlashInfer's paged layout (NHD): `q [total_q, Hq, D]` packed by `qo_indptr [B+1]`;
    `k_pages, v_pages [num_pages, page_size, Hk, D]`; row i's pages are
    `kv_indices[kv_indptr[i]: kv_indptr[i+1]]` in order, the last holding
    `kv_last_page_len[i]` keys (1..page_size; 0 for a row with no pages), so
    `kv_len = (pages - 1) * page_size + last`. Causal bottom-right; `window_left` -1
    unbounded, else keys `[qp - window_left, qp]`."""

    q: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int
    window_left: int
    sm_scale: float

    def call(self) -> tuple[tuple, dict]:
        """`fn(q, k_pages, v_pages, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
        page_size=, causal=True, window_left=, sm_scale=)`."""
        return ((self.q, self.k_pages, self.v_pages, self.qo_indptr, self.kv_indptr,
                 self.kv_indices,
                 self.kv_last_page_len),
                {"page_size": self.page_size, "causal": True, "window_left": self.window_left,
                 "sm_scale": self.sm_scale})

    def output_to_batch(self, out: torch.Tensor) -> torch.Tensor:
        """`[total_q, Hq, D]` -> canonical `[B, Hq, t_q, D]`."""
        _same_shape(out, self.q)
        qo = _ints(self.qo_indptr)
        t_q = max([b - a for a, b in itertools.pairwise(qo)] + [0])
        return _unpack_queries(out, qo, t_q)


def to_paged(batch: VerifyBatch, page_size: int, seed: int = 0) -> Paged:
    """Pack queries by `qo_indptr`; keys into pages in a seeded order (one spare page,
    unused slots filled with `PAGE_FILL`). ValueError on sinks."""
    _no_sinks(batch, "paged")
    dev = batch.q.device
    kp, vp, ids = _fill_pages(batch, page_size, seed, PAGE_FILL)
    flat = [p for r in ids for p in r]
    last = [0 if n == 0 else n - (len(r) - 1) * page_size
            for n, r in zip(batch.kv_lens, ids, strict=True)]
    i32 = torch.int32
    return Paged(_pack_queries(batch), kp, vp, _cumulative(batch.q_lens, dev),
                 _cumulative([len(r) for r in ids], dev), torch.tensor(flat, dtype=i32, device=dev),
                 torch.tensor(last, dtype=i32, device=dev), page_size, batch.window_left(),
                 batch.softmax_scale)


def from_paged(x: Paged) -> VerifyBatch:
    """Read a FlashInfer paged batch back (dead cells zero). ValueError naming the field on
    inconsistent indptrs, a last-page length outside [1, page_size] (0 only for a row with
    no pages), or a page index outside the pages."""
    q_lens = _check_indptr("qo_indptr", x.qo_indptr, x.q.shape[0])
    counts = _check_indptr("kv_indptr", x.kv_indptr, x.kv_indices.shape[0])
    _need(len(q_lens) == len(counts), f"qo_indptr has {len(q_lens)} rows, kv_indptr {len(counts)}")
    last = _ints(x.kv_last_page_len)
    _need(len(last) == len(counts), f"kv_last_page_len {last} must have {len(counts)} entries")
    ps, n_pages = x.k_pages.shape[1], x.k_pages.shape[0]
    _need(ps == x.page_size, f"page_size {x.page_size} but k_pages holds pages of {ps}")
    indptr, indices = _ints(x.kv_indptr), _ints(x.kv_indices)
    _need(all(0 <= p < n_pages for p in indices), f"kv_indices {indices} outside [0, {n_pages})")
    ks, vs, kv_lens = [], [], []
    for i, (c, lp) in enumerate(zip(counts, last, strict=True)):
        _need((c == 0 and lp == 0) or (c > 0 and 1 <= lp <= ps),
              f"row {i}: kv_last_page_len {lp} with {c} pages (page_size {ps})")
        n = 0 if c == 0 else (c - 1) * ps + lp
        pages = torch.tensor(indices[indptr[i]: indptr[i + 1]], dtype=torch.long, device=x.q.device)
        ks.append(x.k_pages[pages].flatten(0, 1)[:n].transpose(0, 1))
        vs.append(x.v_pages[pages].flatten(0, 1)[:n].transpose(0, 1))
        kv_lens.append(n)
    qo = _ints(x.qo_indptr)
    t_q, t = max(q_lens, default=0), max(kv_lens, default=0)
    q = _front_align([x.q[a:b].transpose(0, 1) for a, b in itertools.pairwise(qo)], t_q, x.q)
    window = None if x.window_left == -1 else x.window_left + 1
    _need(x.window_left >= -1, f"window_left {x.window_left} must be -1 or >= 0")
    return VerifyBatch(q, _front_align(ks, t, x.k_pages), _front_align(vs, t, x.v_pages),
                       q_lens, kv_lens, window)


# ----------------------------------------------------------------------------- padded


@dataclass
class Padded:
    """A left-padded dense batch (the Hugging Face convention): `q [B, Hq, t_q, D]`,
    `k, v [B, Hk, T, D]` with each row's tokens at the right end; `attention_mask bool [B, T]`
    True on real keys (key column c of row i has position `cumsum(mask[i])[c] - 1`);
    `position_ids int64 [B, t_q]` each query's absolute position, -1 on padding slots (their
    outputs are unread); `sliding_window` None or w (keys `qp - w < kp <= qp`); `sinks [Hq]`
    or None, passed to the kernel only when present."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    sliding_window: int | None
    softmax_scale: float
    sinks: torch.Tensor | None = None

    def call(self) -> tuple[tuple, dict]:
        """`fn(q, k, v, attention_mask, position_ids, sliding_window=, softmax_scale=)`, plus
        `sinks=` when the batch has sinks."""
        kwargs = {"sliding_window": self.sliding_window, "softmax_scale": self.softmax_scale}
        if self.sinks is not None:
            kwargs["sinks"] = self.sinks
        return (self.q, self.k, self.v, self.attention_mask, self.position_ids), kwargs

    def output_to_batch(self, out: torch.Tensor) -> torch.Tensor:
        """`[B, Hq, t_q, D]`, padding slots zeroed."""
        _need(out.shape == self.q.shape,
              f"output {list(out.shape)} must be q's {list(self.q.shape)}")
        return torch.where((self.position_ids >= 0)[:, None, :, None], out, torch.zeros_like(out))


def to_padded(batch: VerifyBatch) -> Padded:
    """The canonical batch with its key mask and position ids (dead cells carried as they
    are)."""
    dev = batch.q.device
    t, t_q = batch.k.shape[2], batch.q.shape[2]
    lead = torch.tensor(batch.leads, device=dev)[:, None]
    mask = torch.arange(t, device=dev)[None, :] >= lead
    start = torch.tensor(batch.q_starts, device=dev)[:, None]
    pad = torch.tensor([t_q - ql for ql in batch.q_lens], device=dev)[:, None]
    slot = torch.arange(t_q, device=dev)[None, :]
    pos = torch.where(slot >= pad, start + slot - pad, torch.full_like(slot, -1))
    return Padded(batch.q, batch.k, batch.v, mask, pos.to(torch.int64), batch.window,
                  batch.softmax_scale, batch.sinks)


def from_padded(x: Padded) -> VerifyBatch:
    """Read a padded batch back. ValueError naming the field unless each mask row is
    False then True (left padding), and each row's real queries are its last keys (position
    ids `kv_len - q_len .. kv_len - 1` in its last slots, -1 before)."""
    _b, t = x.attention_mask.shape
    t_q = x.q.shape[2]
    mask = x.attention_mask.bool()
    kv_lens = _ints(mask.sum(dim=1))
    for i, n in enumerate(kv_lens):
        _need(bool(mask[i, t - n:].all()),
              f"attention_mask row {i} is not left-padded: {_ints(mask[i].int())}")
    q_lens = []
    for i, n in enumerate(kv_lens):
        pos = _ints(x.position_ids[i])
        ql = sum(1 for p in pos if p >= 0)
        want = [-1] * (t_q - ql) + list(range(n - ql, n))
        _need(pos == want,
              f"position_ids row {i} {pos} must be {want} (queries are the row's last keys)")
        q_lens.append(ql)
    return VerifyBatch(x.q, x.k, x.v, q_lens, kv_lens, x.sliding_window, x.sinks)


def to_layout(batch: VerifyBatch, layout: str, page_size: int | None = None, seed: int = 0):
    """The batch in `layout` (one of LAYOUTS); `page_size` is required by "paged" and makes
    "kvcache" paged."""
    _need(layout in LAYOUTS, f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if layout == "varlen":
        return to_varlen(batch)
    if layout == "kvcache":
        return to_kvcache(batch, page_size, seed)
    if layout == "paged":
        _need(page_size is not None, "the paged layout needs a page_size")
        return to_paged(batch, page_size, seed)
    return to_padded(batch)


def from_layout(x) -> VerifyBatch:
    """The canonical batch of any layout object of this module."""
    readers = {Varlen: from_varlen, KvCache: from_kvcache, Paged: from_paged, Padded: from_padded}
    _need(type(x) in readers, f"{type(x).__name__} is not a layout of gpu.layouts")
    return readers[type(x)](x)
