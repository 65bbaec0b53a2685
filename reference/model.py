"""A tiny seeded DeepSeek-V4-like model: embedding, target decoder layers over a batched
`NormalCache`, and the MTP block with its own single-layer draft KV.

Spec: cache-and-draft.md §6.3, §10.1, §17.2; masks-and-scheduling.md §4, §11, §12. Random
seeded weights, deterministic float64 forwards, so the rules run on real tensors; the
draft-KV rules of `reference.draft` are re-exported. The V4-like shape: docs/simulator.md,
section "reference/model.py".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from raggedspec.reference.attention import Dsv4AttentionConfig, dsv4_attention
from raggedspec.reference.cache import DRAFT_CACHE_CAPACITY, KvCache, NormalCache
from raggedspec.reference.dispatch import draft_step_end_column
from raggedspec.reference.errors import require
from raggedspec.reference.rope import apply_rope, apply_rope_at_positions, compressed_key_positions
from raggedspec.reference.xs_rolling import compress_blocks


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and seeds of the tiny model. `mtp` is "block" (a full MTP block: norms, one
    Standard decoder layer with its own draft KV, final norm; Tier B) or "heads" (Tier A:
    only `h_proj`/`e_proj`, no block, no draft KV). `n_kv_heads` KV heads (K == V) serve
    the `n_heads` query heads: 1 is V4's MQA (the default; the weights and every output
    are those of the one-head model), more is GQA, query head h reading KV head
    `h // (n_heads // n_kv_heads)`. ValueError on inconsistent sizes, including an
    `n_kv_heads` that does not divide `n_heads`."""

    vocab: int = 64
    hidden: int = 32
    n_heads: int = 2
    head_dim: int = 16
    rope_dims: int = 8
    compress_ratios: tuple[int, ...] = (0, 4)
    sliding_window: int = 16
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    seed: int = 0
    mlp_mult: int = 2
    eps: float = 1e-6
    mtp: str = "block"
    n_kv_heads: int = 1

    def __post_init__(self) -> None:
        require(self.vocab >= 1 and self.hidden >= 1 and self.n_heads >= 1 and self.head_dim >= 2,
                f"vocab {self.vocab}, hidden {self.hidden}, n_heads {self.n_heads}, "
                f"head_dim {self.head_dim} must be positive (head_dim >= 2)")
        require(self.rope_dims >= 2 and self.rope_dims % 2 == 0 and self.rope_dims <= self.head_dim,
                f"rope_dims {self.rope_dims} must be even, >= 2 and <= head_dim {self.head_dim}")
        require(len(self.compress_ratios) >= 1 and all(r >= 0 for r in self.compress_ratios),
                f"compress_ratios {self.compress_ratios} must be a non-empty tuple of ratios >= 0")
        require(self.sliding_window >= 1 and self.max_seq_len >= 1 and self.mlp_mult >= 1,
                f"sliding_window {self.sliding_window}, max_seq_len {self.max_seq_len} and "
                f"mlp_mult {self.mlp_mult} must be >= 1")
        require(self.mtp in ("block", "heads"), f"mtp {self.mtp!r} must be 'block' or 'heads'")
        require(isinstance(self.n_kv_heads, int) and self.n_kv_heads >= 1
                and self.n_heads % self.n_kv_heads == 0,
                f"n_kv_heads {self.n_kv_heads} must be >= 1 and divide n_heads {self.n_heads}")


@dataclass
class Forward:
    """A target forward's result: `logits [B,T,V]` and `hidden [B,T,H]`, the hidden state
    after the last layer and **before** the final norm (what V4 captures, §6.3)."""

    logits: np.ndarray
    hidden: np.ndarray


def rms_norm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: `x / sqrt(mean(x^2) + eps) * gain`. Row-local: no value
    depends on another row or another position."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def silu(x: np.ndarray) -> np.ndarray:
    """`x * sigmoid(x)`."""
    return x / (1.0 + np.exp(-x))


def _gain(rng: np.random.Generator, n: int) -> np.ndarray:
    """An RMSNorm gain: `1 + 0.1 * z`, z the generator's next `n` standard normals."""
    return 1.0 + 0.1 * rng.standard_normal(n)


def _proj(rng: np.random.Generator, fan_in: int, fan_out: int) -> np.ndarray:
    """A projection `[fan_in, fan_out]`: the generator's next standard normals / sqrt(fan_in)."""
    return rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)


class DecoderLayer:
    """One V4-like decoder layer over one K/V cache slot.

    Invariant: each row is computed exactly as if it ran alone with its own cache, provided
    the batch is front-aligned (row i's live run occupies columns `[lead_i, C)` of the
    shared cache), RoPE gets each row's own positions, and `row_q0` carries each row's own
    position of query 0 (so `dsv4_attention` masks the dead prefix and rebuilds the
    compressed threshold per row). With `row_q0 = None` on a ragged batch the dead prefix is
    attended and shorter rows come out wrong (the negative control).
    """

    def __init__(self, cfg: ModelConfig, ratio: int, rng: np.random.Generator) -> None:
        h, nh, hd = cfg.hidden, cfg.n_heads, cfg.head_dim
        self.cfg = cfg
        self.ratio = int(ratio)
        self.theta = cfg.compress_rope_theta if self.ratio else cfg.rope_theta
        self.attn_norm = _gain(rng, h)
        self.wq = _proj(rng, h, nh * hd)
        self.q_norm = _gain(rng, hd)
        self.wkv = _proj(rng, h, cfg.n_kv_heads * hd)
        self.kv_norm = _gain(rng, hd)
        self.wo = _proj(rng, nh * hd, h)
        self.sinks = rng.standard_normal(nh)
        self.mlp_norm = _gain(rng, h)
        self.w_up = _proj(rng, h, cfg.mlp_mult * h)
        self.w_down = _proj(rng, cfg.mlp_mult * h, h)

    def key(self, x: np.ndarray) -> np.ndarray:
        """The un-rotated KV heads `[B,n_kv,T,hd]` of input `x [B,T,H]` (row- and
        token-local; `kv_norm` per head, shared by the heads)."""
        b, t, _ = x.shape
        h = rms_norm(x, self.attn_norm, self.cfg.eps)
        kv = (h @ self.wkv).reshape(b, t, self.cfg.n_kv_heads, self.cfg.head_dim)
        return rms_norm(kv, self.kv_norm, self.cfg.eps).transpose(0, 2, 1, 3)

    def compressed_keys(self, keys: np.ndarray, leads: Sequence[int]) -> np.ndarray | None:
        """Start-anchored compressed keys `[B,n_kv,t_c,hd]`, each KV head compressed on its
        own (None when no row has a complete
        block). Row i's live run is `keys[i, :, lead_i:]`, its own positions `0..len_i-1`;
        it is un-rotated (inverse RoPE at those positions), averaged over each complete
        `ratio` block by `compress_blocks`, and block j is rotated at `j * ratio` with
        `compress_rope_theta`. `t_c = max_i floor(len_i / ratio)`; a shorter row's missing
        blocks are zeros (never valid for it: `dsv4_attention` masks them per row)."""
        cfg = self.cfg
        b, n_kv, width, d = keys.shape
        per_row = []
        for i in range(b):
            live = keys[i: i + 1, :, int(leads[i]):, :]
            n = live.shape[2] // self.ratio
            if n == 0:
                per_row.append(None)
                continue
            raw = apply_rope(live, [0], cfg.rope_dims, self.theta, inverse=True)
            blocks = compress_blocks(raw, self.ratio)
            per_row.append(
                apply_rope_at_positions(
                    blocks,
                    compressed_key_positions(n, self.ratio),
                    cfg.rope_dims,
                    cfg.compress_rope_theta,
                )
            )
        t_c = max((0 if r is None else r.shape[2]) for r in per_row)
        if t_c == 0:
            return None
        out = np.zeros((b, n_kv, t_c, d))
        for i, r in enumerate(per_row):
            if r is not None:
                out[i, :, : r.shape[2]] = r[0]
        return out

    def forward(self, x: np.ndarray, slot: KvCache, offsets: Sequence[int],
                row_q0: Sequence[int] | None, leads: Sequence[int] | None) -> np.ndarray:
        """Run the layer on `x [B,T,H]`: append this step's K (== V) to `slot` at its one
        shared offset, attend with `dsv4_attention` (raw keys after the append, compressed
        keys for a compressed layer, the per-head sinks, `cfg.row_q0 = row_q0`,
        `raw_prefix = slot.k.first_cached`), inverse-rotate, project, add, then the MLP.
        RoPE positions: row i, token t at `offsets[i] + t` (`offsets` of length 1 or B).
        `leads` (row i's live run starts at column `leads[i]`) is required by a compressed
        layer only. Refusals: those of `SingleCache.append` and `dsv4_attention`; a
        compressed layer refuses nothing more but needs an unwindowed slot (ValueError)."""
        cfg = self.cfg
        b, t, _ = x.shape
        nh, hd = cfg.n_heads, cfg.head_dim
        h = rms_norm(x, self.attn_norm, cfg.eps)
        q = rms_norm(
            (h @ self.wq).reshape(b, t, nh, hd).transpose(0, 2, 1, 3), self.q_norm, cfg.eps
        )
        q = apply_rope(q, offsets, cfg.rope_dims, self.theta)
        k = apply_rope(self.key(x), offsets, cfg.rope_dims, self.theta)
        slot.append(k, k.copy())
        keys, vals = slot.k.current_data(), slot.v.current_data()
        comp = None
        if self.ratio:
            require(
                leads is not None and len(leads) == b,
                f"a compressed layer needs {b} leads, got {leads}",
            )
            require(
                slot.k.first_cached == 0,
                f"a compressed layer needs the whole history (first_cached {slot.k.first_cached})",
            )
            comp = self.compressed_keys(keys, leads)
        acfg = Dsv4AttentionConfig(self.ratio, cfg.sliding_window, slot.k.first_cached,
                                   None if row_q0 is None else [int(r) for r in row_q0])
        o = dsv4_attention(q, keys, vals, comp, None, acfg, sinks=self.sinks)
        o = apply_rope(o, offsets, cfg.rope_dims, self.theta, inverse=True)
        x = x + o.transpose(0, 2, 1, 3).reshape(b, t, nh * hd) @ self.wo
        m = rms_norm(x, self.mlp_norm, cfg.eps)
        return x + silu(m @ self.w_up) @ self.w_down


@dataclass
class MtpHeads:
    """The MTP projections shared by Tier A and Tier B: `h_proj [H,H]` (previous hidden)
    and `e_proj [H,H]` (embedded next token)."""

    h_proj: np.ndarray
    e_proj: np.ndarray


class MtpBlock:
    """The MTP block (Tier B): `fused = h_proj(hnorm(h)) + e_proj(enorm(embed(tok)))`, one
    Standard V4 decoder layer over the sequence's own draft KV, `logits =
    lm_head(norm_out(hidden))`. Embedding and lm_head are the target's (shared).

    Draft-KV invariant (cache-and-draft.md §1): slot k holds the MTP state of
    `(h_k, tok_{k+1})` at absolute position k, so a step's rows always end at the cache's
    end column (`draft_step_end_column`).
    """

    def __init__(self, cfg: ModelConfig, heads: MtpHeads, embed: np.ndarray, lm_head: np.ndarray,
                 rng: np.random.Generator) -> None:
        self.cfg = cfg
        self.heads = heads
        self.embed = embed
        self.lm_head = lm_head
        self.hnorm = _gain(rng, cfg.hidden)
        self.enorm = _gain(rng, cfg.hidden)
        self.layer = DecoderLayer(cfg, 0, rng)
        self.norm_out = _gain(rng, cfg.hidden)

    def new_draft_cache(self) -> KvCache:
        """`KvCache::new_normal(dim 2, max_seq_len, capacity 16)`: an empty draft KV."""
        return KvCache.new_normal(self.cfg.max_seq_len, DRAFT_CACHE_CAPACITY)

    def fuse(self, h: np.ndarray, tokens) -> np.ndarray:
        """`h_proj(hnorm(h)) + e_proj(enorm(embed(tokens)))`; `h [..., H]`, `tokens` of shape
        `h.shape[:-1]` (read as float64 and int64). Row- and token-local. ValueError on a shape or
        token mismatch."""
        h = np.asarray(h, dtype=np.float64)
        tokens = np.asarray(tokens, dtype=np.int64)
        require(h.shape[-1] == self.cfg.hidden and tokens.shape == h.shape[:-1],
                f"hidden {h.shape} and tokens {tokens.shape} disagree (hidden {self.cfg.hidden})")
        require(tokens.size == 0 or (tokens.min() >= 0 and tokens.max() < self.cfg.vocab),
                f"tokens must be in [0, {self.cfg.vocab})")
        eps = self.cfg.eps
        return (rms_norm(h, self.hnorm, eps) @ self.heads.h_proj
                + rms_norm(self.embed[tokens], self.enorm, eps) @ self.heads.e_proj)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """`lm_head(norm_out(hidden))`: `[..., H] -> [..., V]`."""
        return rms_norm(hidden, self.norm_out, self.cfg.eps) @ self.lm_head

    def forward_tokens_rows(self, fused: np.ndarray, start_pos: Sequence[int], cache: KvCache,
                            tokens=None) -> np.ndarray:
        """One MTP decoder-layer step on `fused [G,T,H]` whose row r starts at absolute
        position `start_pos[r]` (or the one shared `start_pos[0]`); returns the **pre-norm**
        hidden `[G,T,H]` and leaves `cache` `T` entries longer (`fused` is read as float64).

        First `draft_step_end_column(start_pos, G, cache.current_seq_len)`: the cache must
        hold exactly `max(start_pos)` entries (refused otherwise: "desync"; also "given no
        absolute position at all" and "{n} absolute position(s) for a batch of {b}"). Then
        the Standard layer with `seqlen_offsets = start_pos` (per-row RoPE) and
        `row_q0 = start_pos` (a one-element or uniform vector is filtered back to the
        scalar path by `resolve_ragged_rows`; per-row masking of a ragged group's dead
        prefix `max - start_r` otherwise). The gating on `ARC_MTP_PER_SEQ_KV` happens
        upstream: a ragged `start_pos` only arises from `resolve_draft_leads`, which is
        gated on the same flag. `tokens` is accepted for signature parity and unused.
        """
        fused = np.asarray(fused, dtype=np.float64)
        require(fused.ndim == 3 and fused.shape[2] == self.cfg.hidden,
                f"fused {fused.shape} must be [G,T,{self.cfg.hidden}]")
        pos = [int(p) for p in start_pos]
        draft_step_end_column(pos, fused.shape[0], cache.current_seq_len)
        return self.layer.forward(fused, cache, pos, pos, None)

    def forward_tokens(
        self, fused: np.ndarray, start: int, cache: KvCache, tokens=None
    ) -> np.ndarray:
        """`forward_tokens_rows(fused, [start], cache)`: every row at one position."""
        return self.forward_tokens_rows(fused, [start], cache, tokens)

    def forward_step(self, fused: np.ndarray, pos: int, cache: KvCache) -> np.ndarray:
        """`forward_tokens(fused, pos)`: the scalar chain step."""
        return self.forward_tokens(fused, pos, cache)

    def forward_step_rows(
        self, fused: np.ndarray, positions: Sequence[int], cache: KvCache
    ) -> np.ndarray:
        """`forward_tokens_rows(fused, positions)`: the ragged chain step."""
        return self.forward_tokens_rows(fused, positions, cache)


class TinyModel:
    """The target model plus its MTP part. `self.mtp` is the `MtpBlock` (None for Tier A,
    `cfg.mtp == "heads"`); `self.mtp_heads` always exists. Weights are drawn from
    `np.random.default_rng(cfg.seed)` in a fixed order, so equal configs give equal models.
    """

    def __init__(self, cfg: ModelConfig | None = None) -> None:
        cfg = ModelConfig() if cfg is None else cfg
        self.cfg = cfg
        rng = np.random.default_rng(cfg.seed)
        self.embed = rng.standard_normal((cfg.vocab, cfg.hidden))
        self.layers = [DecoderLayer(cfg, r, rng) for r in cfg.compress_ratios]
        self.norm = _gain(rng, cfg.hidden)
        self.lm_head = _proj(rng, cfg.hidden, cfg.vocab)
        self.mtp_heads = MtpHeads(
            _proj(rng, cfg.hidden, cfg.hidden), _proj(rng, cfg.hidden, cfg.hidden)
        )
        self.mtp = (MtpBlock(cfg, self.mtp_heads, self.embed, self.lm_head, rng)
                    if cfg.mtp == "block" else None)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def new_cache(self) -> NormalCache:
        """`NormalCache::new_plain(n_layers, max_seq_len)`: one K/V slot per target layer."""
        return NormalCache.new_plain(self.n_layers, self.cfg.max_seq_len)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """`lm_head(norm(hidden))` of the target."""
        return rms_norm(hidden, self.norm, self.cfg.eps) @ self.lm_head

    def forward(self, tokens, cache: NormalCache, seqlen_offsets: Sequence[int],
                row_q0: Sequence[int] | None = None, lead_pad: Sequence[int] | None = None,
                capture=None) -> Forward:
        """Run `tokens [B,T]` (ids, read as int64) through every target layer, appending their
        K/V to the batched `cache` (layer i uses `cache.slots[i]`; extra slots are ignored).

        Layout invariant (ValueError otherwise): the batch is front-aligned, so row i's live
        run is columns `[lead_i, C + T)` and its first query sits at its own position
        `seqlen_offsets[i] = C - lead_i` (`lead_pad` None means all zero; `seqlen_offsets`
        has length 1, shared, or B). `row_q0` goes to every layer's `Dsv4AttentionConfig`
        (None on the scalar path). After the last layer and before the final norm the
        hidden is stored with `capture.store_rows(seqlen_offsets, hidden)` when a capture is
        given (§6.3: every input position, pre-norm). Returns `Forward(logits, hidden)`.
        Refusals: those of the cache append and `dsv4_attention`.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        require(
            tokens.ndim == 2 and tokens.size > 0, f"tokens {tokens.shape} must be [B,T], B, T >= 1"
        )
        require(tokens.min() >= 0 and tokens.max() < self.cfg.vocab,
                f"tokens must be in [0, {self.cfg.vocab}), got [{tokens.min()}, {tokens.max()}]")
        b, t = tokens.shape
        require(len(cache.slots) >= self.n_layers,
                f"cache has {len(cache.slots)} slots for {self.n_layers} layers")
        offsets = [int(o) for o in seqlen_offsets]
        require(len(offsets) in (1, b), f"{len(offsets)} seqlen offsets for a batch of {b}")
        leads = [0] * b if lead_pad is None else [int(pad) for pad in lead_pad]
        require(len(leads) == b, f"{len(leads)} leads for a batch of {b}")
        c = cache.current_seq_len
        for i in range(b):
            off = offsets[i if len(offsets) == b else 0]
            require(
                off == c - leads[i],
                f"row {i}: seqlen offset {off} disagrees with the layout (cache {c}, lead "
                f"{leads[i]})",
            )
        x = self.embed[tokens]
        for layer, slot in zip(self.layers, cache.slots, strict=False):
            x = layer.forward(x, slot, offsets, row_q0, leads)
        if capture is not None:
            capture.store_rows(offsets, x.copy())
        return Forward(self.logits(x), x)


from raggedspec.reference.draft import (  # noqa: E402  (re-export; reference.draft does not import this module)
    MAX_DRAFT_KV_SEQS,
    DraftKv,
    argmax_token,
    DraftKvMap,
    extend_draft_cache,
    extend_draft_kv_row,
    extend_draft_kvs,
    group_drafting_loop,
    prime_draft_kv,
    propose_chain,
    propose_chain_batched,
)

__all__ = [
    "ModelConfig", "Forward", "TinyModel", "MtpBlock", "MtpHeads", "DecoderLayer", "rms_norm",
    "argmax_token", "MAX_DRAFT_KV_SEQS", "DraftKv", "DraftKvMap", "extend_draft_cache",
    "extend_draft_kv_row", "extend_draft_kvs", "group_drafting_loop", "prime_draft_kv",
    "propose_chain", "propose_chain_batched",
]
