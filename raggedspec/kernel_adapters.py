"""Built-in adapters for `raggedspec check-kernel`: real attention implementations, each
behind one layout's signature (see gpu/layouts.py for the conventions).

CPU, always available: torch's `scaled_dot_product_attention` over every layout
(`sdpa_varlen`, `sdpa_kvcache`, `sdpa_paged`, `sdpa_padded`), `flex_attention` over the
varlen layout (`flex_varlen`), and the port's in-place verify attention
(`gpu.attention.dsv4_attention_in_place`) over the varlen layout (`port_in_place_varlen`).
CUDA, when the package imports: flash-attn's `flash_attn_varlen_func` and
`flash_attn_with_kvcache` (`flash_attn_varlen`, `flash_attn_kvcache`: the layouts are their
signatures), FlashInfer's batch prefill and decode wrappers over the paged layout
(`flashinfer_prefill`, `flashinfer_decode`; decode needs `--max-query-len 1`). An optional
adapter raises ImportError naming the package when it is absent.

Each adapter computes a row at a time from the layout's own index arrays, so a wrong index
rule in an adapter is a wrong rule a kernel could have; the mutation catalogue plants five.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


def visible(
    q_len: int, k_len: int, window_size: tuple[int, int], causal: bool, device=None
) -> torch.Tensor:
    """flash-attn's mask `bool [q_len, k_len]`: query i sees key j iff
    `i + k_len - q_len - left <= j <= i + k_len - q_len + right` (bottom-right alignment;
    a side of -1 unbounded; `causal` forces right = 0)."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(k_len, device=device)[None, :]
    diag = i + k_len - q_len
    ok = torch.ones((q_len, k_len), dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= diag + right
    if left >= 0:
        ok &= j >= diag - left
    return ok


def kv_head_index(hq: int, hk: int, device=None) -> torch.Tensor:
    """The KV head each query head reads: `h // (hq // hk)`."""
    return torch.arange(hq, device=device) // (hq // hk)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ok: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """SDPA of one row: `q [t_q, Hq, D]`, `k, v [n, Hk, D]`, `ok bool [t_q, n]` -> `[t_q, Hq, D]`
    (a query with no key gives 0)."""
    heads = kv_head_index(q.shape[1], k.shape[1], q.device)
    kk, vv = k[:, heads].transpose(0, 1), v[:, heads].transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=ok, scale=scale)
    return torch.where(ok.any(dim=1)[None, :, None], out, torch.zeros_like(out)).transpose(0, 1)


def sdpa_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
) -> torch.Tensor:
    """flash_attn_varlen_func's signature over torch SDPA."""
    out = torch.zeros_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 > q0:
            ok = visible(q1 - q0, k1 - k0, window_size, causal, q.device)
            out[q0:q1] = _attend(q[q0:q1], k[k0:k1], v[k0:k1], ok, softmax_scale)
    return out


def sdpa_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
) -> torch.Tensor:
    """flash_attn_with_kvcache's signature (no new k/v) over torch SDPA, dense or paged."""
    bsz, t_q = q.shape[0], q.shape[1]
    seqlens = cache_seqlens.tolist()
    out = torch.zeros_like(q)
    for b in range(bsz):
        if block_table is not None:
            n, ps = seqlens[b], k_cache.shape[1]
            pages = block_table[b, : -(-n // ps)].long()
            keys, vals = k_cache[pages].flatten(0, 1)[:n], v_cache[pages].flatten(0, 1)[:n]
        else:
            start = 0 if cache_leftpad is None else int(cache_leftpad[b])
            keys, vals = k_cache[b, start : seqlens[b]], v_cache[b, start : seqlens[b]]
        ok = visible(t_q, keys.shape[0], window_size, causal, q.device)
        out[b] = _attend(q[b], keys, vals, ok, softmax_scale)
    return out


def sdpa_paged(
    q,
    k_pages,
    v_pages,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    page_size=16,
    causal=True,
    window_left=-1,
    sm_scale=None,
) -> torch.Tensor:
    """FlashInfer's paged layout (NHD) over torch SDPA."""
    out = torch.zeros_like(q)
    qo, kvp, last = qo_indptr.tolist(), kv_indptr.tolist(), kv_last_page_len.tolist()
    for b in range(len(qo) - 1):
        pages = kv_indices[kvp[b] : kvp[b + 1]].long()
        n = 0 if len(pages) == 0 else (len(pages) - 1) * page_size + last[b]
        keys, vals = k_pages[pages].flatten(0, 1)[:n], v_pages[pages].flatten(0, 1)[:n]
        if qo[b + 1] > qo[b]:
            ok = visible(qo[b + 1] - qo[b], n, (window_left, 0), causal, q.device)
            out[qo[b] : qo[b + 1]] = _attend(q[qo[b] : qo[b + 1]], keys, vals, ok, sm_scale)
    return out


def sdpa_padded(
    q, k, v, attention_mask, position_ids, sliding_window=None, softmax_scale=None, sinks=None
) -> torch.Tensor:
    """The left-padded layout over one batched SDPA call: key positions from the mask's
    running count, validity by position (causal, window), padding query slots give 0. With
    `sinks [Hq]` the output is rescaled by `sigmoid(lse - sink)`, the share of the softmax
    mass left to the keys once the sink logit joins the denominator."""
    key_pos = attention_mask.long().cumsum(dim=1) - 1  # [B, T]
    qp, kp = position_ids[:, :, None], key_pos[:, None, :]
    ok = attention_mask[:, None, :] & (kp <= qp) & (qp >= 0)
    if sliding_window is not None:
        ok &= kp > qp - sliding_window
    heads = kv_head_index(q.shape[1], k.shape[1], q.device)
    out = F.scaled_dot_product_attention(
        q, k[:, heads], v[:, heads], attn_mask=ok[:, None], scale=softmax_scale
    )
    if sinks is not None:
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        logits = (q.float() @ k[:, heads].float().transpose(-1, -2)) * scale
        lse = logits.masked_fill(~ok[:, None], float("-inf")).logsumexp(dim=-1, keepdim=True)
        share = torch.sigmoid(lse - sinks.float()[None, :, None, None])
        out = (out.float() * share).to(out.dtype)
    return torch.where(ok.any(dim=2)[:, None, :, None], out, torch.zeros_like(out))


def flex_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
) -> torch.Tensor:
    """The varlen layout through `torch.nn.attention.flex_attention` (eager, CPU or CUDA): all
    rows packed as one sequence, a `mask_mod` over row ids and in-row positions."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dev = q.device
    lq, lk = cu_seqlens_q.long(), cu_seqlens_k.long()
    total_q, total_k = q.shape[0], k.shape[0]
    if total_q == 0:
        return torch.zeros_like(q)
    q_row = torch.searchsorted(lq[1:], torch.arange(total_q, device=dev), right=True)
    k_row = torch.searchsorted(lk[1:], torch.arange(total_k, device=dev), right=True)
    q_len, k_len = lq[1:] - lq[:-1], lk[1:] - lk[:-1]
    q_pos = torch.arange(total_q, device=dev) - lq[q_row] + (k_len - q_len)[q_row]  # bottom-right
    k_pos = torch.arange(total_k, device=dev) - lk[k_row]
    left, right = window_size
    right = 0 if causal else right

    def mask_mod(b, h, qi, kj):
        ok = q_row[qi] == k_row[kj]
        if right >= 0:
            ok = ok & (k_pos[kj] <= q_pos[qi] + right)
        if left >= 0:
            ok = ok & (k_pos[kj] >= q_pos[qi] - left)
        return ok

    mask = create_block_mask(mask_mod, None, None, total_q, total_k, device=str(dev))
    with warnings.catch_warnings():  # eager flex_attention warns that it is not compiled
        warnings.simplefilter("ignore", UserWarning)
        out = flex_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            block_mask=mask,
            scale=softmax_scale,
            enable_gqa=True,
        )
    return out[0].transpose(0, 1)


def port_in_place_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
) -> torch.Tensor:
    """The port's in-place verify attention over the varlen layout. That path is one KV head
    with one query length per call, so rows are grouped by query length and each KV head runs
    with its own query heads; the window is `left + 1` keys (unbounded: the longest row)."""
    from raggedspec.gpu.attention import dsv4_attention_in_place
    from raggedspec.gpu.cache import RaggedKv

    if not causal or window_size[1] not in (0, -1):
        raise ValueError("the port's verify attention is causal only")
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    hq, hk = q.shape[1], k.shape[1]
    g = hq // hk
    window = window_size[0] + 1 if window_size[0] >= 0 else max(max_seqlen_k, 1)
    out = torch.zeros_like(q)
    by_len: dict[int, list[int]] = {}
    for b in range(len(cq) - 1):
        if cq[b + 1] > cq[b]:
            by_len.setdefault(cq[b + 1] - cq[b], []).append(b)
    for rows in by_len.values():
        for h in range(hk):
            ks = [k[ck[b] : ck[b + 1], h : h + 1].transpose(0, 1) for b in rows]
            vs = [v[ck[b] : ck[b + 1], h : h + 1].transpose(0, 1) for b in rows]
            kv = RaggedKv.from_rows(ks, vs, max_seq_len=1 << 20)
            qs = torch.stack(
                [q[cq[b] : cq[b + 1], h * g : (h + 1) * g].transpose(0, 1) for b in rows]
            )
            res = dsv4_attention_in_place(qs, kv, None, 0, window)
            for r, b in enumerate(rows):
                out[cq[b] : cq[b + 1], h * g : (h + 1) * g] = res[r].transpose(0, 1)
    return out


# ----------------------------------------------------------------------------- optional (CUDA)


def flash_attn_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
) -> torch.Tensor:
    """flash-attn's own `flash_attn_varlen_func` (the layout is its signature)."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
    )


def flash_attn_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
) -> torch.Tensor:
    """flash-attn's own `flash_attn_with_kvcache` (paged needs `--page-size 256`)."""
    from flash_attn import flash_attn_with_kvcache

    return flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=cache_seqlens,
        cache_leftpad=cache_leftpad,
        block_table=block_table,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
    )


def _flashinfer_workspace(device) -> torch.Tensor:
    return torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)


def flashinfer_prefill(
    q,
    k_pages,
    v_pages,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    page_size=16,
    causal=True,
    window_left=-1,
    sm_scale=None,
) -> torch.Tensor:
    """FlashInfer's `BatchPrefillWithPagedKVCacheWrapper` (NHD): plan, then run."""
    import flashinfer

    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_flashinfer_workspace(q.device), "NHD")
    w.plan(
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        q.shape[1],
        k_pages.shape[2],
        q.shape[2],
        page_size,
        causal=causal,
        window_left=window_left,
        sm_scale=sm_scale,
        q_data_type=q.dtype,
    )
    return w.run(q, (k_pages, v_pages))


def flashinfer_decode(
    q,
    k_pages,
    v_pages,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    page_size=16,
    causal=True,
    window_left=-1,
    sm_scale=None,
) -> torch.Tensor:
    """FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` (NHD): one query per row, so it
    takes the batch's rows that have one (run with `--max-query-len 1`)."""
    import flashinfer

    lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
    if any(n not in (0, 1) for n in lens):
        raise ValueError(f"the decode wrapper takes one query per row, got query lengths {lens}")
    rows = [b for b, n in enumerate(lens) if n == 1]
    sel = torch.tensor(rows, dtype=torch.long, device=q.device)
    starts, ends = kv_indptr[:-1][sel], kv_indptr[1:][sel]
    indices = torch.cat(
        [kv_indices[s:e] for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
    )
    indptr = torch.cat(
        [
            torch.zeros(1, dtype=torch.int32, device=q.device),
            (ends - starts).cumsum(0).to(torch.int32),
        ]
    )
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_flashinfer_workspace(q.device), "NHD")
    w.plan(
        indptr,
        indices,
        kv_last_page_len[sel],
        q.shape[1],
        k_pages.shape[2],
        q.shape[2],
        page_size,
        window_left=window_left,
        sm_scale=sm_scale,
        q_data_type=q.dtype,
    )
    return w.run(q, (k_pages, v_pages))


# ----------------------------------------------------------------------------- torch's own


def _padded_keep(attention_mask, position_ids, sliding_window) -> torch.Tensor:
    """The padded layout's key set `bool [B, t_q, T]`: key positions from the mask's running
    count, causal and windowed by position, padding queries (negative positions) see none."""
    key_pos = attention_mask.long().cumsum(dim=1) - 1
    qp, kp = position_ids[:, :, None], key_pos[:, None, :]
    ok = attention_mask[:, None, :] & (kp <= qp) & (qp >= 0)
    if sliding_window is not None:
        ok &= kp > qp - sliding_window
    return ok


def torch_sdpa(backend: str | None):
    """The padded layout through one call of torch's `scaled_dot_product_attention` with
    torch's own GQA (`enable_gqa=True`), on `backend` (a `torch.nn.attention.SDPBackend`
    name, forced with `sdpa_kernel`) or torch's own choice when None. Padding query slots are
    left as torch computes them (check-kernel reads only live ones)."""

    def sdpa(q, k, v, attention_mask, position_ids, sliding_window=None, softmax_scale=None,
             sinks=None):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if sinks is not None:
            raise ValueError("torch's scaled_dot_product_attention has no sinks argument")
        ok = _padded_keep(attention_mask, position_ids, sliding_window)[:, None]
        call = dict(attn_mask=ok, scale=softmax_scale, enable_gqa=True)
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, **call)
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, **call)

    sdpa.__name__ = f"torch_sdpa_{(backend or 'default').lower()}"
    return sdpa


def torch_flex_compiled(q, k, v, attention_mask, position_ids, sliding_window=None,
                        softmax_scale=None, sinks=None) -> torch.Tensor:
    """The padded layout through `torch.compile(flex_attention)` with a BlockMask over the
    layout's key set and torch's own GQA (CPU: float32, bfloat16, float16 only). Every call
    compiles afresh for its own sizes (`torch._dynamo.reset()`, `dynamic=False`): the same
    batch always runs the same kernel (seconds a batch), never a recompile for new sizes,
    which on a CPU fails to build (docs/third-party.md) and after 8 recompiles falls back to
    eager flex_attention."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if sinks is not None:
        raise ValueError("flex_attention takes no sinks argument here")
    ok = _padded_keep(attention_mask, position_ids, sliding_window)

    def mask_mod(b, h, qi, kj):
        return ok[b, qi, kj]

    b, _h, t_q, _d = q.shape
    mask = create_block_mask(mask_mod, b, None, t_q, k.shape[2], device=str(q.device))
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compiled(q, k, v, block_mask=mask, scale=softmax_scale, enable_gqa=True)


TORCH_TARGETS = {
    "torch:sdpa": lambda: torch_sdpa(None),
    "torch:sdpa-math": lambda: torch_sdpa("MATH"),
    "torch:sdpa-flash": lambda: torch_sdpa("FLASH_ATTENTION"),
    "torch:sdpa-efficient": lambda: torch_sdpa("EFFICIENT_ATTENTION"),
    "torch:sdpa-cudnn": lambda: torch_sdpa("CUDNN_ATTENTION"),
    "torch:flex": lambda: torch_flex_compiled,
}
"""Built-in check-kernel targets: torch's attention in the padded layout (sdpa through its
dispatcher or one forced backend: math and flash run on a CPU, efficient and cudnn on
CUDA; flex_attention compiled)."""


CUDA_ONLY = ("torch:sdpa-efficient", "torch:sdpa-cudnn")


def torch_target(name: str, layout: str, device: str = "cpu"):
    """The built-in torch target called `name`, or None when `name` is not one; ValueError
    when it is one and `layout` is not the padded layout it speaks, or it is a CUDA-only
    backend asked for on another device."""
    if name not in TORCH_TARGETS:
        return None
    if name in CUDA_ONLY and not str(device).startswith("cuda"):
        raise ValueError(f"{name}: torch runs this SDPA backend on CUDA only, not on "
                         f"--device {device}")
    if layout != "padded":
        raise ValueError(f"{name} speaks the padded layout (dense [B, H, T, D] with a key mask "
                         f"and positions): run it with --layout padded, not {layout}")
    return TORCH_TARGETS[name]()
