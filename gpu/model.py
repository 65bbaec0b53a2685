"""The tiny V4-like model on the port's in-place KV layout (port of `reference.model`).

The port computes with the reference `TinyModel`'s own weights (converted once to `dtype`),
so a port model and its reference compare output for output; what differs is the layout
(one `gpu.cache.RaggedKv` per layer, no front alignment) and the batching (no Python loop
over rows). Layout, RoPE tables, compressed keys, precision and what is not modelled:
docs/conformance.md, section "gpu/model.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raggedspec.gpu._common import (
    arange_like,
    host_ints,
    ints_on,
    lengths_like,
    neg_inf_where,
)
from raggedspec.gpu.attention import attention, dsv4_attention_in_place, is_standard_layer
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.masks import compressed_validity
from raggedspec.gpu.rope import RopeTable, apply_rope, rotate
from raggedspec.reference.dispatch import draft_step_end_column, uniform_seqlen_offset
from raggedspec.reference.errors import DispatchRefusal, MaskRefusal, require


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for the half dtypes (their reductions accumulate in float32), else `dtype`."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * gain` over the last axis (row- and token-local),
    computed in `compute_dtype(x.dtype)` and returned in `x.dtype`."""
    cd = compute_dtype(x.dtype)
    xc = x.to(cd)
    return (xc / torch.sqrt((xc * xc).mean(dim=-1, keepdim=True) + eps) * gain.to(cd)).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """`x / (1 + exp(-x))` (the reference's form), in `compute_dtype`."""
    xc = x.to(compute_dtype(x.dtype))
    return (xc / (1.0 + torch.exp(-xc))).to(x.dtype)


def _tensor(a, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(np.asarray(a, dtype=np.float64))).to(
        device=device, dtype=dtype
    )


class RopeTables:
    """One `RopeTable` per theta, in the model's dtype and device, grown (doubling) when
    a position past its end is asked for: every RoPE of the model is one gather."""

    def __init__(self, rope_dims: int, dtype: torch.dtype, device, n_positions: int = 1024) -> None:
        self.rope_dims, self.dtype, self.device, self.initial = (
            rope_dims,
            dtype,
            device,
            n_positions,
        )
        self.tables: dict[float, RopeTable] = {}

    def get(self, theta: float, needed: int) -> RopeTable:
        """The table of `theta` holding at least positions `[0, needed)`."""
        table = self.tables.get(theta)
        if table is None or table.n_positions < needed:
            n = max(self.initial, 1 if table is None else table.n_positions)
            while n < needed:
                n *= 2
            table = RopeTable(self.rope_dims, theta, n, self.dtype, self.device)
            self.tables[theta] = table
        return table


def _gather_columns(buf: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """`buf[rows[g], h, cols[g, j], :]` as `[G, Hk, keep, D]` for a `[B, Hk, cap, D]` buffer
    (every KV head of the addressed rows): one flat `index_select` (advanced indexing of the
    permuted view was ~100x slower with two CPU threads)."""
    b, hk, cap, d = buf.shape
    heads = arange_like(hk, cols)[None, :, None]
    flat = ((rows[:, None, None] * hk + heads) * cap + cols[:, None, :]).reshape(-1)
    return buf.reshape(b * hk * cap, d).index_select(0, flat).view(
        cols.shape[0], hk, cols.shape[1], d
    )


def dsv4_attention_rows(q: torch.Tensor, kv: RaggedKv, rows, compressed_kv: torch.Tensor | None,
                        compress_ratio: int, sliding_window: int,
                        sinks: torch.Tensor | None = None,
                        dev_rows: torch.Tensor | None = None) -> torch.Tensor:
    """`dsv4_attention_in_place` for the rows `rows` (an int64 index vector into `kv`, one
    per query row) of a shared buffer, or for every row when `rows` is None (then it IS
    `gpu.attention.dsv4_attention_in_place`). Row r's raw window is gathered from
    `kv.k[rows[r]]` at its own columns `lens - keep ..` (dead below 0), masked by
    `qp - window < kp <= qp`; compressed block b valid iff `b < floor((qp + 1) / ratio)`.
    Only the window columns of the addressed rows are read (no copy of a row's history).
    `kv` holds Hk KV heads dividing H (query head h reads KV head `h // (H // Hk)`), and
    `compressed_kv` is `[G,Hk,t_c,D]`. `dev_rows`: the same rows already on the device, read
    instead of an upload. Refusal: MaskRefusal "query rows against only" for a row shorter
    than `t_q`; ValueError on shapes that disagree."""
    if rows is None:
        return dsv4_attention_in_place(q, kv, compressed_kv, compress_ratio, sliding_window, sinks)
    host_rows = host_ints(rows)
    rows = dev_rows if dev_rows is not None else lengths_like(rows, kv.k, name="rows")
    if not (
        q.dim() == 4
        and q.shape[1] % kv.k.shape[1] == 0
        and q.shape[0] == rows.numel()
        and q.shape[3] == kv.k.shape[3]
    ):
        raise ValueError(
            f"q {list(q.shape)} for rows {rows.numel()} of kv {list(kv.k.shape)}: need "
            "[G,H,t_q,D], "
            "[B,Hk,cap,D] with Hk dividing H"
        )
    g, _, t_q, d = q.shape
    dev, cd = q.device, compute_dtype(q.dtype)
    lens = kv.lens[rows]
    host = kv.host_lens()[host_rows]
    short = np.flatnonzero(host < t_q)
    if short.size:
        raise MaskRefusal(f"{t_q} query rows against only {int(host[short[0]])} keys")
    window = max(sliding_window, 1)
    keep = min(t_q + window - 1, int(host.max()))
    cols = (lens - keep)[:, None] + arange_like(keep, q)[None, :]          # [G, keep]
    src = cols.clamp(min=0)
    k_raw = _gather_columns(kv.k, rows, src)  # [G, Hk, keep, D]
    v_raw = _gather_columns(kv.v, rows, src)
    qp = (lens - t_q)[:, None] + arange_like(t_q, q)[None, :]              # [G, t_q]
    kp = cols[:, None, :]
    valid = (kp >= 0) & (kp <= qp[:, :, None]) & (kp > qp[:, :, None] - window)
    k_all, v_all = k_raw, v_raw
    if not is_standard_layer(compress_ratio) and compressed_kv is not None:
        comp = compressed_validity(
            t_q, host - t_q, compressed_kv.shape[2], compress_ratio, device=dev
        )
        valid = torch.cat([valid, comp], dim=2)
        k_all = torch.cat([k_raw, compressed_kv.to(k_raw.dtype)], dim=2)
        v_all = torch.cat([v_raw, compressed_kv.to(v_raw.dtype)], dim=2)
    return attention(q, k_all, v_all, neg_inf_where(valid, cd)[:, None], sinks)


class DecoderLayer:
    """Port of `reference.model.DecoderLayer` (same weights, converted once).

    Invariant: row i computes exactly what the reference computes for it alone: its queries
    and keys at its own positions `lens[i] + t`, its keys appended at its own offset, its
    attention over its own window (and, for a compressed layer, its own start-anchored
    blocks). Refusals: those of `RaggedKv.append` (CacheRefusal, growth above
    `max_seq_len`) and of the attention (MaskRefusal)."""

    WEIGHTS = (
        "attn_norm",
        "wq",
        "q_norm",
        "wkv",
        "kv_norm",
        "wo",
        "sinks",
        "mlp_norm",
        "w_up",
        "w_down",
    )

    def __init__(self, ref_layer, ropes: RopeTables, dtype: torch.dtype, device) -> None:
        self.cfg = ref_layer.cfg
        self.ratio = int(ref_layer.ratio)
        self.theta = float(ref_layer.theta)
        self.ropes = ropes
        for name in self.WEIGHTS:
            setattr(self, name, _tensor(getattr(ref_layer, name), dtype, device))
        # the two hot operations, replaceable by a backend with its own kernels
        # (raggedspec.gpu.cupy_backend): same signatures, same rules, same refusals
        self.attend = dsv4_attention_rows
        self.rope = apply_rope

    def key(self, x: torch.Tensor) -> torch.Tensor:
        """The un-rotated KV heads `[B,n_kv,T,hd]` of `x [B,T,H]` (row- and token-local;
        `kv_norm` per head, as the reference)."""
        cfg = self.cfg
        b, t, _ = x.shape
        kv = (rms_norm(x, self.attn_norm, cfg.eps) @ self.wkv).reshape(
            b, t, cfg.n_kv_heads, cfg.head_dim
        )
        return rms_norm(kv, self.kv_norm, cfg.eps).transpose(1, 2)

    def compressed_keys(self, kv: RaggedKv) -> torch.Tensor | None:
        """Start-anchored compressed keys `[B,n_kv,t_c,hd]` (each KV head on its own) from
        every row's own live run
        (columns `[0, lens[i])`), `t_c = max(lens // ratio)`, None when 0. One un-rotation
        of the first `t_c * ratio` columns at positions `0..` (`theta` of this layer), one
        reshape-mean per complete block, one rotation at `j * ratio`
        (`compress_rope_theta`), then blocks `j >= lens[i] // ratio` set to zero (they
        cover slack, never valid for that row: the mask kills them)."""
        cfg, r = self.cfg, self.ratio
        n = torch.div(kv.lens, r, rounding_mode="floor")
        host = kv.host_lens()
        t_c = int((host // r).max()) if host.size else 0
        if t_c == 0:
            return None
        width = t_c * r
        cos, sin = self.ropes.get(self.theta, width).lookup(
            arange_like(width, kv.k), width - 1
        )
        raw = rotate(kv.k[:, :, :width], cos, sin, cfg.rope_dims, inverse=True)
        blocks = raw.unflatten(2, (t_c, r)).mean(dim=3)  # [B,n_kv,t_c,hd]
        cos, sin = self.ropes.get(cfg.compress_rope_theta, width).lookup(
            arange_like(t_c, kv.k) * r, (t_c - 1) * r
        )
        blocks = rotate(blocks, cos, sin, cfg.rope_dims)
        live = (arange_like(t_c, kv.k)[None, :] < n[:, None])[:, None, :, None]
        return torch.where(live, blocks, blocks.new_zeros(()))

    def forward(self, x: torch.Tensor, kv: RaggedKv, offsets=None, rows=None,
                dev_offsets=None, dev_rows=None) -> torch.Tensor:
        """Run the layer on `x [B,T,H]` whose row r sits in `kv` row `rows[r]` (every row
        of `kv` when `rows` is None): RoPE at `offsets[r] + t` (`offsets` of length 1 or B;
        default the rows' own lengths, which it must equal: the caller checks), append K
        (== V) at each row's own offset, attend (`dsv4_attention_rows`), inverse-rotate,
        project, add, then the MLP. A compressed layer needs `rows` None (ValueError before
        anything is appended). `dev_offsets`, `dev_rows`: the same RoPE offsets and rows
        already on the device (the step plan's, the draft chain's), read instead of an
        upload."""
        cfg = self.cfg
        b, t, _ = x.shape
        nh, hd, eps = cfg.n_heads, cfg.head_dim, cfg.eps
        require(
            not self.ratio or rows is None,
            "a compressed layer runs on every row of its cache (rows must be None)",
        )
        if rows is not None and isinstance(rows, torch.Tensor):
            rows = host_ints(rows)
        held = kv.host_lens() if rows is None else kv.host_lens()[np.asarray(rows, dtype=np.int64)]
        offs = held if offsets is None else offsets
        if isinstance(offs, torch.Tensor):
            offs = host_ints(offs)
        offs = np.asarray(offs, dtype=np.int64).reshape(-1)
        if dev_offsets is None and uniform_seqlen_offset(offs.tolist()) is None:
            dev_offsets = lengths_like(offs, x, name="offsets")  # once for q, k and o
        if dev_rows is None and rows is not None:
            dev_rows = lengths_like(rows, kv.k, name="rows")
        table = self.ropes.get(self.theta, int(offs.max()) + t)
        h = rms_norm(x, self.attn_norm, eps)
        q = rms_norm((h @ self.wq).reshape(b, t, nh, hd).transpose(1, 2), self.q_norm, eps)
        q = self.rope(q, offs, cfg.rope_dims, self.theta, table=table, dev_offsets=dev_offsets)
        k = self.rope(self.key(x), offs, cfg.rope_dims, self.theta, table=table,
                      dev_offsets=dev_offsets)
        kv.append(k, k, rows=rows, dev_rows=dev_rows)
        comp = self.compressed_keys(kv) if self.ratio else None
        o = self.attend(q, kv, rows, comp, self.ratio, cfg.sliding_window, self.sinks,
                        dev_rows=dev_rows)
        o = self.rope(o, offs, cfg.rope_dims, self.theta, inverse=True, table=table,
                      dev_offsets=dev_offsets)
        x = x + o.transpose(1, 2).reshape(b, t, nh * hd) @ self.wo
        m = rms_norm(x, self.mlp_norm, eps)
        return x + silu(m @ self.w_up) @ self.w_down


@dataclass
class MtpHeads:
    h_proj: torch.Tensor
    e_proj: torch.Tensor


class MtpBlock:
    """Port of `reference.model.MtpBlock`: `fuse`, one Standard decoder layer over the
    draft KV (a `RaggedKv`, possibly a pool addressed by `rows`), `logits`.

    Draft-KV invariant (as the reference): a step's rows end at their cache's end, i.e. row
    r holds exactly `start_pos[r]` entries before the step."""

    def __init__(self, ref_block, heads: MtpHeads, embed: torch.Tensor, lm_head: torch.Tensor,
                 ropes: RopeTables, dtype: torch.dtype, device) -> None:
        self.cfg = ref_block.cfg
        self.heads, self.embed, self.lm_head = heads, embed, lm_head
        self.hnorm = _tensor(ref_block.hnorm, dtype, device)
        self.enorm = _tensor(ref_block.enorm, dtype, device)
        self.norm_out = _tensor(ref_block.norm_out, dtype, device)
        self.layer = DecoderLayer(ref_block.layer, ropes, dtype, device)
        self.dtype, self.device = dtype, device

    def fuse(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """`h_proj(hnorm(h)) + e_proj(enorm(embed(tokens)))`, `tokens` of shape
        `h.shape[:-1]` and already known to be in the vocabulary (the chain's own argmax
        tokens, or committed tokens its callers check on the host): no device read."""
        eps = self.cfg.eps
        return (rms_norm(h, self.hnorm, eps) @ self.heads.h_proj
                + rms_norm(self.embed[tokens], self.enorm, eps) @ self.heads.e_proj)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`lm_head(norm_out(hidden))`."""
        return rms_norm(hidden, self.norm_out, self.cfg.eps) @ self.lm_head

    def forward_tokens_rows(
        self, fused: torch.Tensor, start_pos, cache: RaggedKv, rows=None, dev_rows=None,
        dev_pos=None,
    ) -> torch.Tensor:
        """One MTP decoder-layer step on `fused [G,T,H]` (row r in `cache` row `rows[r]`,
        or row r when `rows` is None) at absolute positions `start_pos[r] + t` (or the one
        shared `start_pos[0]`); returns the pre-norm hidden `[G,T,H]`, every addressed
        row `T` entries longer.

        Refusals: `draft_step_end_column(start_pos, G, max(held))` first, exactly as the
        reference (DispatchRefusal "given no absolute position at all", "{n} absolute
        position(s) for a batch of {b}", "MTP draft KV desync"); then, port only (the
        front-aligned layout cannot express it), a row whose own held length is not its
        own start (DispatchRefusal "MTP draft KV desync: draft row {r} holds {n} entries but
        its step starts at absolute position {s}"): in this layout a row's length is its
        write offset, so such a row would be written and rotated at different positions.
        `dev_rows`, `dev_pos`: `rows` and `start_pos` already on the device (read instead of
        an upload)."""
        require(fused.dim() == 3 and fused.shape[2] == self.cfg.hidden,
                f"fused {tuple(fused.shape)} must be [G,T,{self.cfg.hidden}]")
        g = fused.shape[0]
        pos = host_ints(start_pos)
        if rows is not None:
            rows = host_ints(rows)
        held = cache.host_lens() if rows is None else cache.host_lens()[rows]
        require(held.size == g, f"{held.size} draft rows for a step of {g}")
        draft_step_end_column(pos.tolist(), g, int(held.max(initial=0)))
        off = np.flatnonzero(held != pos)
        if off.size:
            r = int(off[0])
            raise DispatchRefusal(
                f"MTP draft KV desync: draft row {r} holds {int(held[r])} entries but its step "
                "starts at "
                f"absolute position {int(pos[r if pos.size > 1 else 0])} (start_pos {pos.tolist()})"
            )
        # offsets: the held lengths (== pos)
        return self.layer.forward(fused, cache, rows=rows, dev_offsets=dev_pos, dev_rows=dev_rows)

    def forward_tokens(
        self, fused: torch.Tensor, start: int, cache: RaggedKv, rows=None
    ) -> torch.Tensor:
        """`forward_tokens_rows(fused, [start])`: every row at one position."""
        return self.forward_tokens_rows(fused, [int(start)], cache, rows)

    def forward_step(
        self, fused: torch.Tensor, pos: int, cache: RaggedKv, rows=None, dev_rows=None
    ) -> torch.Tensor:
        """The scalar chain step (one shared position: the `[1, T]` RoPE table)."""
        return self.forward_tokens_rows(fused, [int(pos)], cache, rows, dev_rows)

    def forward_step_rows(
        self, fused: torch.Tensor, positions, cache: RaggedKv, rows=None, dev_rows=None,
        dev_pos=None,
    ) -> torch.Tensor:
        """The ragged chain step (per-row positions: the gathered `[G, T]` RoPE table)."""
        return self.forward_tokens_rows(fused, positions, cache, rows, dev_rows, dev_pos)


@dataclass
class Forward:
    """`logits [B,T,V]` and the pre-norm `hidden [B,T,H]` (tensors)."""

    logits: torch.Tensor
    hidden: torch.Tensor


class TinyModel:
    """Port of `reference.model.TinyModel`, built from a reference model's weights:
    `TinyModel(ref_model, dtype=torch.float64, device=None)`. `mtp` is the port `MtpBlock`
    (None for Tier A), `mtp_heads` always exists; embedding and lm_head are shared with
    the block as in the reference."""

    def __init__(self, ref_model, dtype: torch.dtype = torch.float64, device=None) -> None:
        self.cfg = ref_model.cfg
        self.dtype, self.device = (
            dtype,
            torch.device(device) if device is not None else torch.device("cpu"),
        )
        self.ropes = RopeTables(self.cfg.rope_dims, dtype, self.device)
        self.embed = _tensor(ref_model.embed, dtype, self.device)
        self.layers = [
            DecoderLayer(layer, self.ropes, dtype, self.device) for layer in ref_model.layers
        ]
        self.norm = _tensor(ref_model.norm, dtype, self.device)
        self.lm_head = _tensor(ref_model.lm_head, dtype, self.device)
        self.mtp_heads = MtpHeads(_tensor(ref_model.mtp_heads.h_proj, dtype, self.device),
                                  _tensor(ref_model.mtp_heads.e_proj, dtype, self.device))
        self.mtp = None if ref_model.mtp is None else MtpBlock(
            ref_model.mtp, self.mtp_heads, self.embed, self.lm_head, self.ropes, dtype, self.device)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`lm_head(norm(hidden))` of the target."""
        return rms_norm(hidden, self.norm, self.cfg.eps) @ self.lm_head

    def forward(self, tokens, cache: list[RaggedKv], seqlen_offsets=None, capture=None,
                device_offsets=None, device_tokens=None) -> Forward:
        """Run `tokens [B,T]` through every target layer over the in-place `cache` (layer i
        uses `cache[i]`; extra entries are ignored); every row's new K/V land at its own
        offset and every layer's lengths grow by T.

        Layout invariant (ValueError otherwise): every layer's cache has B rows and the
        same lengths; row i's first query sits at its own position `lens[i]`.
        `seqlen_offsets` (length 1 or B), when given, must equal those lengths (the
        reference's "disagrees with the layout"). After the last layer the pre-norm hidden
        is stored with `capture.store_rows(lens, hidden)` when a capture is given.
        `device_offsets`: the rows' lengths already on the device (the step plan's), which
        the layers' RoPE reads instead of uploading them; `device_tokens` the tokens already
        there (no upload of their own).
        Refusals: those of the layers (CacheRefusal on growth, MaskRefusal)."""
        host_tokens = host_ints(tokens, flat=False)
        require(host_tokens.ndim == 2 and host_tokens.size > 0,
                f"tokens {tuple(host_tokens.shape)} must be [B,T], B, T >= 1")
        if host_tokens.min() < 0 or host_tokens.max() >= self.cfg.vocab:
            raise ValueError(
                f"tokens must be in [0, {self.cfg.vocab}), got [{int(host_tokens.min())}, "
                f"{int(host_tokens.max())}]"
            )
        tokens = ints_on(tokens, self.device) if device_tokens is None else device_tokens
        b, _ = tokens.shape
        require(
            len(cache) >= self.n_layers, f"cache has {len(cache)} layers for {self.n_layers} layers"
        )
        lens = cache[0].host_lens()
        for i, kv in enumerate(cache[: self.n_layers]):
            if kv.batch != b or not np.array_equal(kv.host_lens(), lens):
                raise ValueError(
                    f"layer {i}'s cache ({kv.batch} rows, lens {kv.host_lens().tolist()}) "
                    "disagrees "
                    f"with a batch of {b} at lens {lens.tolist()}"
                )
        if seqlen_offsets is not None:
            offs = host_ints(seqlen_offsets)
            require(offs.size in (1, b), f"{offs.size} seqlen offsets for a batch of {b}")
            bad = np.flatnonzero(np.broadcast_to(offs, (b,)) != lens)
            if bad.size:
                i = int(bad[0])
                raise ValueError(
                    f"row {i}: seqlen offset {int(offs[i if offs.size > 1 else 0])} disagrees "
                    f"with the layout (own length {int(lens[i])})"
                )
        lens = lens.tolist()
        x = self.embed[tokens]
        for layer, kv in zip(self.layers, cache, strict=False):
            x = layer.forward(x, kv, dev_offsets=device_offsets)
        if capture is not None:
            capture.store_rows(lens, x.clone())
        return Forward(self.logits(x), x)


__all__ = [
    "TinyModel",
    "DecoderLayer",
    "MtpBlock",
    "MtpHeads",
    "Forward",
    "RopeTables",
    "rms_norm",
    "silu",
    "compute_dtype",
    "dsv4_attention_rows",
]
