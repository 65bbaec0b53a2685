"""Helpers shared by the conformance tests (one module, so no test file copies another's).

Hypothesis strategies live in `conformance/strategies.py`; the backend under test and the
comparison policy in `conformance/backends.py`; everything else two or more test files need is
here, in one section per topic.
"""

from __future__ import annotations

import numpy as np


# --- draft KV, draft chain, tiny model and backends ----------------------------------------


def close(a, b, rel: float = 1e-12) -> bool:
    """`|a - b| <= rel * max(1, max|b|)` elementwise: float64 results that sum the same terms
    in another order (or add exactly-zero masked terms) agree to ~1e-16."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return bool(np.all(np.abs(a - b) <= rel * max(1.0, float(np.max(np.abs(b), initial=0.0)))))


def rms(x, gain, eps: float = 1e-6):
    """RMSNorm over the last axis, written here: `x / sqrt(mean(x^2) + eps) * gain`."""
    return x / np.sqrt((x ** 2).mean(axis=-1, keepdims=True) + eps) * gain


def rope(x, positions, rope_dims: int, theta: float, inverse: bool = False):
    """Rotate the last `rope_dims` dims of `x [..., T, D]` as interleaved pairs, token t at
    `positions[t]` (the conjugate rotation when `inverse`); one loop per pair, written here."""
    x = np.asarray(x, dtype=np.float64)
    out = x.copy()
    d0 = x.shape[-1] - rope_dims
    sign = -1.0 if inverse else 1.0
    for t, pos in enumerate(positions):
        for k in range(rope_dims // 2):
            ang = pos * theta ** (-(2.0 * k) / rope_dims)
            c, s = np.cos(ang), sign * np.sin(ang)
            a, b = x[..., t, d0 + 2 * k], x[..., t, d0 + 2 * k + 1]
            out[..., t, d0 + 2 * k] = a * c - b * s
            out[..., t, d0 + 2 * k + 1] = a * s + b * c
    return out


def rope_at(vec, pos: int, rope_dims: int, theta: float):
    """`rope` of one vector `[D]` at one position."""
    return rope(np.asarray(vec)[None], [pos], rope_dims, theta)[0]


def draft_history(model, n: int, seed: int):
    """A reference draft KV holding `n` slots written from random `(h, tok)` pairs."""
    from raggedspec.reference.draft import extend_draft_cache

    rng = np.random.default_rng(seed)
    cache = model.mtp.new_draft_cache()
    extend_draft_cache(model.mtp, cache, rng.standard_normal((n, model.cfg.hidden)),
                       rng.integers(0, model.cfg.vocab, n), 0)
    return cache


def prompt_cache(be, model, toks, capture=None, own: bool = True):
    """A one-row target cache after a prompt forward of `toks` on backend `be` (compressor
    history fed): the row's own cache (`clone_out`) when `own`, else the batched cache."""
    cfg = model.cfg
    cache = be.new_target_cache(cfg, cfg.max_seq_len, 1)
    fwd = be.forward(model, np.array([list(toks)]), cache, [0], None, None, capture)
    be.xs_append(cache, fwd.hidden)
    return be.clone_out(cache, 1)[0] if own else cache


def primed_state(be, model, toks):
    """A draft state primed on `toks` (L tokens, C §7.4): the prompt forward over `toks[:-1]`
    captured, then `prime_draft_kv`: filled L - 1, seed at L - 2 (no seed without a block)."""
    from raggedspec.reference.dispatch import MtpHiddenCapture
    from raggedspec.reference.draft import DraftKv

    cap = MtpHiddenCapture()
    cap.arm()
    prompt_cache(be, model, toks[:-1], cap)
    state = DraftKv(cache=be.new_draft_cache(model))
    be.prime_draft_kv([state], cap.take(), [list(toks)], 1, model, [])
    return state


def assert_same_draft_states(port_be, ref_be, ps, rs, dtype: str = "float64",
                             committed_only: bool = False, what: str = "") -> None:
    """Two backends' draft states row by row: filled, poisoned and seed position exact; seed
    hidden and draft KV within the comparison policy (`committed_only`: the draft KV's
    columns `[0, filled)` only: past them a chain's entries follow a float argmax)."""
    from raggedspec.conformance.backends import assert_close, assert_exact, assert_same_cache

    assert_exact(len(ps), len(rs), f"{what} row count")
    for i, (a, r) in enumerate(zip(ps, rs, strict=True)):
        if r is None:
            assert a is None, f"{what} row {i}: a state in the port only"
            continue
        assert_exact((a.filled, a.poisoned, None if a.seed is None else a.seed[0]),
                     (r.filled, r.poisoned, None if r.seed is None else r.seed[0]),
                     f"{what} row {i} state")
        if r.seed is not None:
            assert_close(port_be.to_numpy(a.seed[1]), r.seed[1], dtype, f"{what} row {i} seed")
        assert (a.cache is None) == (r.cache is None), f"{what} row {i}: draft KV in one only"
        if r.cache is not None:
            assert_same_cache(port_be.materialize(a.cache), ref_be.materialize(r.cache), dtype,
                              f"{what} row {i} draft KV", r.filled if committed_only else None)


def ref_draft_kv(model, k: np.ndarray):
    """A reference draft KV (capacity 16, growing by 512) holding `k [n, head_dim]` as K and V."""
    cache = model.mtp.new_draft_cache()
    if len(k):
        cache.append(k[None, None], k[None, None].copy())
    return cache


def draft_pool(ks: list[np.ndarray]):
    """The port's pooled draft KV (`gpu.cache.RaggedKv`): row s holds `ks[s] [n_s, head_dim]`
    at columns `[0, n_s)`, capacity the reference's (16, grown by whole 512 blocks)."""
    from raggedspec.gpu.cache import RaggedKv
    from raggedspec.gpu.testing import to_port

    top = max(len(k) for k in ks)
    capacity = 16 if top <= 16 else 16 + 512 * (-(-(top - 16) // 512))
    return RaggedKv.from_rows([to_port(k[None]) for k in ks], [to_port(k[None]) for k in ks],
                              4096, capacity)


def held_k(cache, head_dim: int) -> np.ndarray:
    """A reference draft KV's held K `[n, head_dim]` (none while unmaterialized)."""
    data = cache.k.current_data()
    return np.zeros((0, head_dim)) if data is None else data[0, 0]


class StepSpy:
    """The positions every chain step of a block class is called at: `scalar` (one shared
    position, `forward_step`) or `rows` (per-row positions, `forward_step_rows`)."""

    def __init__(self, monkeypatch, cls):
        self.scalar: list[int] = []
        self.rows: list[list[int]] = []
        orig_step, orig_rows = cls.forward_step, cls.forward_step_rows

        def forward_step(block, fused, pos, cache, *rows):
            self.scalar.append(int(pos))
            return orig_step(block, fused, pos, cache, *rows)

        def forward_step_rows(block, fused, positions, cache, *rows):
            self.rows.append(np.asarray(positions.cpu() if hasattr(positions, "cpu") else positions)
                             .tolist())
            return orig_rows(block, fused, positions, cache, *rows)

        monkeypatch.setattr(cls, "forward_step", forward_step)
        monkeypatch.setattr(cls, "forward_step_rows", forward_step_rows)


def kv_history(model, lens: list[int], rng, dtype=None) -> list[list[np.ndarray]]:
    """`hist[layer][i]`: row i's cached K (== V) of every target layer, `[lens[i], head_dim]`
    (`[n_kv_heads, lens[i], head_dim]` with several KV heads), rounded to the torch `dtype`
    when given (so both sides hold it exactly)."""
    from raggedspec.gpu.testing import representable

    d, hk = model.cfg.head_dim, model.cfg.n_kv_heads
    out = []
    for _ in model.layers:
        rows = [rng.standard_normal((n, d) if hk == 1 else (hk, n, d)) for n in lens]
        out.append([r if dtype is None else representable(r, dtype) for r in rows])
    return out


def front_aligned_batch(model, hist):
    """The reference's front-aligned batch of `kv_history` rows: row i's run ends at column
    C = max(lens), zeros in front (its lead), capacity 512 (the plain cache's); and the
    leads."""
    from raggedspec.reference.cache import KvCache, NormalCache, SingleCache

    lens = [h.shape[-2] for h in hist[0]]
    c = max(lens)
    if c == 0:
        return model.new_cache(), [0] * len(lens)
    slots = []
    for rows in hist:
        data = np.zeros((len(lens), model.cfg.n_kv_heads, 512, model.cfg.head_dim))
        for i, h in enumerate(rows):
            data[i, :, c - h.shape[-2]: c] = h
        slots.append(KvCache(SingleCache(model.cfg.max_seq_len, 512, c, 0, None, data.copy()),
                             SingleCache(model.cfg.max_seq_len, 512, c, 0, None, data.copy())))
    return NormalCache(slots), [c - n for n in lens]


def in_place_cache(model, hist, dtype=None):
    """The port's in-place rows of `kv_history` (one `RaggedKv` per layer): row i's K at
    columns `[0, lens[i])`, in the torch `dtype` (default float64)."""
    from raggedspec.gpu.cache import RaggedKv
    from raggedspec.gpu.testing import to_port

    out = []
    for rows in hist:
        ks = [to_port(h if h.ndim == 3 else h[None], dtype) for h in rows]
        out.append(RaggedKv.from_rows(ks, [k.clone() for k in ks], model.cfg.max_seq_len))
    return out


_BUILT: dict = {}


def built_model(be, cfg=None):
    """`be.build_model(cfg)` (the default config when None), built once per backend object
    and config."""
    from raggedspec.reference.model import ModelConfig

    cfg = cfg or ModelConfig()
    key = (id(be), cfg)
    if key not in _BUILT:
        _BUILT[key] = (be, be.build_model(cfg))  # the backend kept: its id stays its own
    return _BUILT[key][1]
