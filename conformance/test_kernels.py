"""The hand-written kernels (gpu/kernels.cu, launched by gpu/cupy_kernels.py) against the
reference: front alignment, the dead-prefix strip, the ragged union mask, per-row RoPE and
the CUDA-core verify attention, then the kernel backend end to end. The tensor-core kernel is
test_kernels_tc.py's; the builds for the GPU and the emulator's warp semantics
test_kernel_build.py's. Two runners:

- `emulate`: the same source built by g++ and run block by block with real threads and a real
  barrier (gpu/kernel_emulator.py); needs g++, runs on every machine CI uses;
- `cupy`: NVRTC + CuPy on a CUDA GPU; skipped, with the reason, where there is none.

Data movement and masks: bit for bit. RoPE and attention in float64: `1e-12` relative (the
comparison policy); float32 / bf16 attention: the FlashAttention rule of gpu.testing against a
same-precision naive computation. Refusals: same class and message as the torch port.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedspec.gpu.cupy_kernels as ck
import raggedspec.reference.attention as ratt
import raggedspec.reference.masks as rmasks
import raggedspec.reference.rope as rrope
from raggedspec.conformance.helpers import (
    KERNEL_MODES,
    bf16_values,
    from_kern,
    kernels,
    to_kern,
)
from raggedspec.gpu import kernel_emulator
from raggedspec.gpu.align import materialize_front_aligned
from raggedspec.gpu.cache import RaggedKv
from raggedspec.gpu.testing import outcome
from raggedspec.preflight import ragged_inputs
from raggedspec.reference.errors import CacheRefusal, MaskRefusal

_WHY = ck.cupy_unavailable()
NO_CUPY = None if _WHY is None else f"CuPy needs a CUDA GPU: {_WHY}"   # the skip reason, or None
FEW = settings(max_examples=max(8, settings.default.max_examples // 5), deadline=None)


@pytest.fixture(params=KERNEL_MODES, scope="module")
def kern(request) -> ck.Kernels:
    return kernels(request.param)


@st.composite
def ragged_kv(draw, max_b=3, max_cap=12):
    b = draw(st.integers(1, max_b))
    cap = draw(st.integers(1, max_cap))
    lens = draw(st.lists(st.integers(0, cap), min_size=b, max_size=b))
    h, d = draw(st.integers(1, 2)), draw(st.sampled_from([1, 3, 4]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    return rng.standard_normal((b, h, cap, d)), rng.standard_normal((b, h, cap, d)), lens


# --------------------------------------------------------------------------- data movement
@pytest.mark.rule("front-align kernel")
@FEW
@given(case=ragged_kv(), extra=st.integers(0, 2))
def test_front_align_places_each_live_run_at_the_end_in_one_launch(kern, case, extra):
    k, v, lens = case
    target = max(lens) + extra
    out = kern.front_align(to_kern(kern, k), to_kern(kern, v), lens, target)
    ko, vo = (from_kern(kern, a) for a in out)
    for b, n in enumerate(lens):
        assert np.array_equal(ko[b, :, target - n :], k[b, :, :n]) and np.array_equal(
            vo[b, :, target - n :], v[b, :, :n]
        )
        assert not ko[b, :, : target - n].any() and not vo[b, :, : target - n].any()
    port = materialize_front_aligned(RaggedKv(torch.from_numpy(k), torch.from_numpy(v),
                                                     torch.tensor(lens), k.shape[2] + 4), target)
    assert np.array_equal(ko, port[0].numpy()) and np.array_equal(vo, port[1].numpy())


@pytest.mark.rule("dead-prefix strip kernel")
@FEW
@given(case=ragged_kv())
def test_strip_returns_the_front_aligned_rows_to_their_place(kern, case):
    k, v, lens = case
    t = max(lens)
    kf, vf = kern.front_align(to_kern(kern, k), to_kern(kern, v), lens)
    ks, vs, new_lens = kern.strip_dead_prefix(kf, vf, [t - n for n in lens], t)
    ks, vs = from_kern(kern, ks), from_kern(kern, vs)
    assert from_kern(kern, new_lens).tolist() == lens
    for b, n in enumerate(lens):
        assert np.array_equal(ks[b, :, :n], k[b, :, :n]) and np.array_equal(
            vs[b, :, :n], v[b, :, :n]
        )
        assert not ks[b, :, n:].any() and not vs[b, :, n:].any()


@pytest.mark.rule("front-align kernel")
def test_a_strided_view_is_read_by_value_not_by_its_memory(kern):
    """A non-contiguous input (a slice of a wider buffer) gives what its contiguous copy gives:
    the kernels index flat memory, so the host makes inputs contiguous first."""
    k = np.random.default_rng(1).standard_normal((2, 1, 9, 6))
    view = to_kern(kern, k)[:, :, :, ::2]
    assert not view.flags.c_contiguous
    ko, vo = kern.front_align(view, view, [3, 5])
    want, _ = kern.front_align(
        to_kern(kern, np.ascontiguousarray(k[:, :, :, ::2])), to_kern(kern, k[:, :, :, ::2]), [3, 5]
    )
    assert np.array_equal(from_kern(kern, ko), from_kern(kern, want))


@pytest.mark.rule("dead-prefix strip kernel")
def test_strip_refuses_a_lead_past_the_held_columns_as_the_port_does(kern):
    k = np.ones((2, 1, 4, 2))
    got = outcome(kern.strip_dead_prefix, to_kern(kern, k), to_kern(kern, k), [1, 4], 3)
    # the port's message for a lead past what a row holds (reference.align.drop_front_refusal)
    assert got == ("refused", CacheRefusal,
                   "cannot drop a 4-column dead prefix from a slot that holds only 3")


# --------------------------------------------------------------------------- masks
@pytest.mark.rule("ragged union mask kernel")
@FEW
@given(data=st.data())
def test_ragged_union_mask_equals_the_reference_bit_for_bit(kern, data):
    t_q = data.draw(st.integers(1, 4))
    leads = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))
    leads[data.draw(st.integers(0, len(leads) - 1))] = 0
    q0 = data.draw(st.integers(max(leads), 20))
    rows = [q0 - lead for lead in leads]
    t_k_full = q0 + t_q
    window = data.draw(st.integers(1, 30))
    ratio = data.draw(st.sampled_from([1, 4, 128]))
    t_c = data.draw(st.integers(0, 5)) if ratio < 128 else data.draw(st.integers(0, 1))
    raw_base, keep = rmasks.raw_keep_span(t_q, window, t_k_full)
    valid = np.concatenate([rmasks.raw_validity(t_q, q0, raw_base, keep, window),
                            rmasks.compressed_validity(t_q, q0, t_c, ratio)], axis=1)
    want = rmasks.ragged_union_mask(rows, q0, valid, raw_base, keep, ratio, t_c)
    got = from_kern(kern, kern.ragged_union_mask(rows, q0, t_q, raw_base, keep, t_c, ratio, window))
    assert got.dtype == np.float64 and np.array_equal(got, want)


@pytest.mark.rule("ragged union mask kernel")
def test_ragged_union_mask_refuses_rows_that_skipped_resolve_ragged_rows(kern):
    with pytest.raises(ValueError, match=r"rows \[3, 5\] must lie in \[0, q0=4\]"):
        kern.ragged_union_mask([3, 5], 4, 1, 0, 5, 0, 1, 4)
    with pytest.raises(ValueError, match=r"with max == q0"):
        kern.ragged_union_mask([3, 2], 4, 1, 0, 5, 0, 1, 4)


# --------------------------------------------------------------------------- RoPE
@pytest.mark.rule("per-row RoPE kernel")
@FEW
@given(data=st.data())
def test_per_row_rope_equals_the_reference(kern, data):
    b, h, t = (
        data.draw(st.integers(1, 3)),
        data.draw(st.integers(1, 2)),
        data.draw(st.integers(1, 4)),
    )
    rope_dims = data.draw(st.sampled_from([2, 4, 6]))
    d = rope_dims + data.draw(st.integers(0, 3))
    offsets = data.draw(st.lists(st.integers(0, 5000), min_size=1, max_size=1) | st.lists(
        st.integers(0, 5000), min_size=b, max_size=b))
    inverse = data.draw(st.booleans())
    x = np.random.default_rng(data.draw(st.integers(0, 999))).standard_normal((b, h, t, d))
    want = rrope.apply_rope(x, offsets, rope_dims, 10000.0, inverse=inverse)
    got = from_kern(kern, kern.rope(to_kern(kern, x), offsets, rope_dims, 10000.0, inverse))
    assert np.max(np.abs(got - want)) <= 1e-12 * np.max(np.abs(want))


@pytest.mark.rule("per-row RoPE kernel")
def test_rope_refuses_what_the_port_refuses(kern):
    x = to_kern(kern, np.zeros((2, 1, 1, 4)))
    with pytest.raises(ValueError, match="3 offsets for a batch of 2"):
        kern.rope(x, [1, 2, 3], 4, 10000.0)
    with pytest.raises(ValueError, match=r"offsets \[-1\] must be >= 0"):
        kern.rope(x, [-1], 4, 10000.0)


# --------------------------------------------------------------------------- attention
def reference_verify_attention(q, k, v, lens) -> np.ndarray:
    """Row by row through `reference.attention.attention` on the row's live run only, with
    the causal mask of the verify window: query r at `n - w + r` sees keys `p <= n - w + r`."""
    b, h, w, d = q.shape
    out = np.empty((b, h, w, d))
    for i, n in enumerate(lens):
        mask = np.where(np.arange(n)[None, :] <= (n - w + np.arange(w))[:, None], 0.0, -np.inf)
        out[i] = ratt.attention(
            q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], mask[None, None]
        )[0]
    return out


@st.composite
def verify_cases(draw):
    b = draw(st.integers(1, 3))
    hk, g, w = draw(st.sampled_from([(1, 1, 1), (2, 2, 2), (1, 3, 3)]))
    d = 8
    cap = draw(st.integers(w, 40))
    lens = draw(st.lists(st.integers(w, cap), min_size=b, max_size=b))
    nt = draw(st.sampled_from([8, 32]))
    n_split = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    return b, hk, g, w, d, cap, lens, nt, n_split, seed


@pytest.mark.slow
@pytest.mark.rule("ragged verify attention kernel, CUDA cores")
@FEW
@given(case=verify_cases())
def test_verify_attention_reads_only_live_kv_and_equals_the_reference_in_float64(kern, case):
    b, hk, g, w, d, cap, lens, nt, n_split, seed = case
    q, k, v = ragged_inputs(b, hk, g, w, d, cap, lens, seed)
    want = reference_verify_attention(q, k, v, lens)
    got = from_kern(
        kern,
        kern.verify_attention(
            to_kern(kern, q), to_kern(kern, k), to_kern(kern, v), lens, n_split=n_split, nt=nt
        ),
    )
    assert np.max(np.abs(got - want)) <= 1e-12 * np.max(np.abs(want)), (lens, nt, n_split)


@pytest.mark.slow
@pytest.mark.rule("ragged verify attention kernel, CUDA cores")
@FEW
@given(data=st.data())
def test_dsv4_attention_in_place_equals_the_reference_on_the_front_aligned_batch(kern, data):
    """Window, compressed blocks and sinks (DSV4's rules), read in place: each row's window of
    live keys and its own complete blocks only. Equals the reference's `dsv4_attention` of
    the front-aligned batch with `row_q0 = lens - t_q` (as the torch port's in-place
    attention does, test_attention_dsv4.py). With `rows`, query row g reads KV row rows[g]."""
    t_q = data.draw(st.integers(1, 3))
    own = [n + t_q for n in data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=3))]
    ratio = data.draw(st.sampled_from([0, 4, 16]))
    window = data.draw(st.sampled_from([1, 4, 16, 128]))
    with_sinks, subset = data.draw(st.booleans()), data.draw(st.booleans())
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    b, n_max, h, d = len(own), max(own), 2, 8
    cap = n_max + 5
    k_place, v_place = rng.normal(size=(b, 1, cap, d)) * 3, rng.normal(size=(b, 1, cap, d)) * 3
    for i, n in enumerate(own):
        k_place[i, :, n:], v_place[i, :, n:] = 40.0, 1e6       # slack: loud if ever read
    t_c = n_max // ratio if ratio > 1 else 0
    comp = rng.normal(size=(b, 1, t_c, d)) if t_c else None
    rows = (
        [int(r) for r in rng.permutation(b)[: data.draw(st.integers(1, b))]]
        if subset and ratio <= 1
        else None
    )
    picked = list(range(b)) if rows is None else rows
    q = rng.normal(size=(len(picked), h, t_q, d))
    sinks = rng.normal(size=h) if with_sinks else None
    lens = [own[i] for i in picked]
    top = max(lens)
    k_front, v_front = np.zeros((len(picked), 1, top, d)), np.zeros((len(picked), 1, top, d))
    for g, i in enumerate(picked):
        k_front[g, 0, top - own[i] :], v_front[g, 0, top - own[i] :] = (
            k_place[i, 0, : own[i]],
            v_place[i, 0, : own[i]],
        )
    sub_comp = None if comp is None else comp[picked][:, :, : top // ratio]
    cfg = ratt.Dsv4AttentionConfig(ratio, window, 0, [n - t_q for n in lens])
    want = ratt.dsv4_attention(q, k_front, v_front, sub_comp, None, cfg, sinks)
    got = from_kern(
        kern,
        kern.dsv4_attention_rows(
            to_kern(kern, q),
            to_kern(kern, k_place),
            to_kern(kern, v_place),
            own,
            rows,
            None if comp is None else to_kern(kern, comp),
            ratio,
            window,
            None if sinks is None else to_kern(kern, sinks),
            n_split=data.draw(st.integers(1, 3)),
            nt=8,
        ),
    )
    assert np.max(np.abs(got - want)) <= 1e-12 * np.max(np.abs(want)), (own, rows, ratio, window)


@pytest.mark.rule("ragged verify attention kernel, CUDA cores")
def test_query_rows_read_the_kv_rows_they_name(kern):
    """rows = [2, 0] of three KV rows of different lengths: query row 0 attends over KV row 2
    (its length, its keys), query row 1 over KV row 0; each equals the reference's attention
    over that row's live window, in one split or in three combined."""
    rng = np.random.default_rng(3)
    own, t_q, window, d = [9, 4, 13], 2, 4, 8
    k, v = rng.normal(size=(3, 1, 16, d)), rng.normal(size=(3, 1, 16, d))
    q = rng.normal(size=(2, 2, t_q, d))
    args = (to_kern(kern, q), to_kern(kern, k), to_kern(kern, v), own, [2, 0], None, 0, window)
    got = from_kern(kern, kern.dsv4_attention_rows(*args, nt=8))
    split = from_kern(kern, kern.dsv4_attention_rows(*args, n_split=3, nt=8))
    assert np.max(np.abs(split - got)) <= 1e-12 * np.max(np.abs(got))  # splits combined exactly
    for g, i in enumerate([2, 0]):
        n = own[i]
        qp = n - t_q + np.arange(t_q)
        kp = np.arange(n)
        mask = np.where(
            (kp[None, :] <= qp[:, None]) & (kp[None, :] > qp[:, None] - window), 0.0, -np.inf
        )
        want = ratt.attention(q[g:g + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], mask[None, None])[0]
        assert np.max(np.abs(got[g] - want)) <= 1e-12 * np.max(np.abs(want)), (g, i)


@pytest.mark.rule("ragged verify attention kernel, CUDA cores")
def test_splits_of_the_keys_combine_to_the_attention_over_all_of_them(kern):
    """Rows of 64 and 40 keys (no window) split 1, 2 or 3 ways along the keys: each split's
    running maximum differs, and the combine rescales each split by its own maximum, so
    every split count equals the reference within 1e-12 (slack columns never read)."""
    lens = [64, 40]
    q, k, v = ragged_inputs(2, 1, 2, 2, 8, 64, lens, seed=2)
    want = reference_verify_attention(q, k, v, lens)
    for n_split in (1, 2, 3):
        out = kern.verify_attention(*(to_kern(kern, a) for a in (q, k, v)), lens,
                                    n_split=n_split, nt=8)
        got = from_kern(kern, out)
        assert np.max(np.abs(got - want)) <= 1e-12 * np.max(np.abs(want)), n_split


@pytest.mark.slow
@pytest.mark.rule("ragged verify attention kernel, CUDA cores")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_attention_in_low_precision_meets_the_flash_attention_rule(kern, dtype):
    b, hk, g, w, d, cap, lens = 3, 2, 2, 4, 16, 70, [70, 9, 41]
    q, k, v = ragged_inputs(b, hk, g, w, d, cap, lens, seed=5)
    if dtype == "bfloat16":
        args = [ck.bf16_bits(a) for a in (q, k, v)]
        q, k, v = (bf16_values(a).astype(np.float64) for a in args)
    else:
        args = [a.astype(np.float32) for a in (q, k, v)]
        q, k, v = (a.astype(np.float64) for a in args)
    want = reference_verify_attention(q, k, v, lens)
    naive = reference_verify_attention(
        *(torch.from_numpy(a).to(getattr(torch, dtype)).double().numpy() for a in (q, k, v)), lens
    )
    torch_dtype = getattr(torch, dtype)
    naive = (
        torch.from_numpy(naive).to(torch_dtype).double().numpy()
    )  # one final rounding, like the kernel
    out = kern.verify_attention(*(to_kern(kern, a) for a in args), lens, n_split=2, nt=32)
    got = from_kern(kern, out)
    got = bf16_values(got).astype(np.float64) if dtype == "bfloat16" else got.astype(np.float64)
    eps = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -7}[dtype]
    bound = 2 * np.max(np.abs(naive - want)) + 4 * eps * np.max(np.abs(v[:, :, :70]))
    assert np.max(np.abs(got - want)) <= bound


@pytest.mark.rule("ragged verify attention kernel, CUDA cores")
def test_verify_attention_refuses_a_row_shorter_than_the_window_as_the_port_does(kern):
    q, k, v = ragged_inputs(2, 1, 1, 3, 4, 8, [8, 2], seed=1)
    got = outcome(kern.verify_attention, *(to_kern(kern, a) for a in (q, k, v)), [8, 2])
    assert (
        got[0] == "refused"
        and got[1] is MaskRefusal
        and got[2] == "3 query rows against only 2 keys"
    )


@pytest.mark.slow
@pytest.mark.rule("ragged verify attention kernel, CUDA cores")
def test_the_verify_kernel_refuses_a_prefill_sized_query_block_and_the_backend_routes_it_to_torch(
    kern,
):
    q = np.zeros((1, 65, 1, 8))
    kv = np.zeros((1, 1, 4, 8))
    with pytest.raises(ValueError, match=r"65 queries per KV head .* at most .* 64 queries"):
        kern.verify_attention(to_kern(kern, q), to_kern(kern, kv), to_kern(kern, kv), [4])
    assert kern.fits(64, 8, "float64") and not kern.fits(65, 8, "float64")
    assert not kern.fits(16, 4096, "float64")  # q alone would need 512 KiB of shared memory
    if kern.mode != "emulate":
        return
    from raggedspec.gpu.cupy_backend import emulated
    from raggedspec.gpu.model import dsv4_attention_rows

    backend = emulated()
    rng = np.random.default_rng(0)
    big_q = torch.from_numpy(rng.normal(size=(2, 4, 20, 8)))     # 4 heads x 20 queries: a prefill
    k = torch.from_numpy(rng.normal(size=(2, 1, 24, 8)))
    cache = RaggedKv(k, k.clone(), torch.tensor([20, 24]), 4096)
    got = backend._attend(big_q, cache, None, None, 0, 8)
    assert backend.prefill_fallbacks == 1 and backend.kernel_attentions == 0
    assert torch.equal(got, dsv4_attention_rows(big_q, cache, None, None, 0, 8))
    small = backend._attend(big_q[:, :, :4], cache, None, None, 0, 8)
    assert backend.kernel_attentions == 1
    assert (
        float((small - dsv4_attention_rows(big_q[:, :, :4], cache, None, None, 0, 8)).abs().max())
        <= 1e-12
    )



@pytest.mark.rule("ragged verify attention kernel, CUDA cores")
@pytest.mark.skipif(NO_CUPY is not None, reason=NO_CUPY or "")
def test_the_torch_entry_point_matches_the_reference_on_cuda():
    b, hk, g, w, d, cap, lens = 4, 2, 2, 2, 32, 300, [300, 17, 200, 2]
    q, k, v = ragged_inputs(b, hk, g, w, d, cap, lens, seed=9)
    want = reference_verify_attention(q, k, v, lens)
    got = ck.ragged_verify_attention(*(torch.from_numpy(a).cuda() for a in (q, k, v)),
                                     torch.tensor(lens, device="cuda"))
    assert got.dtype == torch.float64
    assert float((got.cpu() - torch.from_numpy(want)).abs().max()) <= 1e-12 * float(
        np.abs(want).max()
    )
    assert math.isfinite(float(got.abs().max()))


# --------------------------------------------------------------------------- the backend
@pytest.mark.rule("backend protocol: every tensor-side op is one method")
def test_the_cupy_backend_overrides_every_protocol_method_through_the_torch_port():
    from raggedspec.gpu.cupy_backend import CupyBackend
    from raggedspec.reference.backend import missing_methods

    assert missing_methods(CupyBackend.__new__(CupyBackend)) == []
    for method in ("apply_rope", "_ragged_union_mask", "_front_aligned"):
        assert method in vars(CupyBackend), f"CupyBackend.{method} is not the kernel's"


@pytest.mark.rule("raggedspec conformance and its per-rule table")
def test_asking_for_the_cupy_backend_without_a_gpu_says_why_and_exits_2(capsys):
    from raggedspec.gpu.cupy_backend import cupy_unavailable
    from raggedspec import cli
    from raggedspec.reference.backend import load_backend

    why = cupy_unavailable()
    if why is None:  # a CUDA machine: the backend loads, on CUDA, under its own name
        backend = load_backend("cupy")
        assert backend.name == "cupy" and backend.device.startswith("cuda")
        with pytest.raises(ValueError, match="runs on CUDA only"):
            load_backend("cupy", device="cpu")
        return
    with pytest.raises(ValueError, match="backend 'cupy' needs a CUDA GPU: ") as err:
        load_backend("cupy")
    assert why in str(err.value)
    assert cli.main(["conformance", "--backend", "cupy"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.rule("the kernel backend end to end, emulated")
@pytest.mark.skipif(
    kernel_emulator.compilers()["g++"] is None, reason="the kernel emulator needs g++ on the PATH"
)
@pytest.mark.parametrize("case", [0, 8, "gqa 4", "gqa 8"])
def test_the_emulated_kernel_backend_runs_the_simulator_and_matches_the_reference(
    case, monkeypatch
):
    """The whole step simulator on `raggedspec.gpu.cupy_backend:emulated` (every attention and RoPE
    of the
    model forward, the ragged masks and the KV read-back run by the kernels, under g++) against
    the reference, tensor for tensor: a granted per-sequence scenario, one with compressed
    layers of ratio 4 and 128, and two models with two KV heads (GQA ratios 4 and 8: the
    kernel's query head h reads KV head `h // (Hq / Hk)` in place, and `rs_front_align`
    reads every KV head back). The launches are counted, so the kernels are known to have run.
    The full property (200 generated scenarios, three dtypes) runs with
    `RAGGEDSPEC_BACKEND=raggedspec.gpu.cupy_backend:emulated` (docs/conformance.md)."""
    from collections import Counter

    from raggedspec.conformance.backends import compare_runs, reference_backend
    from raggedspec.conformance.test_end_to_end import FIXED, GQA
    from raggedspec.gpu.cupy_backend import emulated
    from raggedspec.reference import simulator
    from raggedspec.reference.scenario import load_scenario

    launches = Counter()
    real = ck.Kernels._launch
    monkeypatch.setattr(
        ck.Kernels,
        "_launch",
        lambda self, name, *a, **k: (launches.update([name]), real(self, name, *a, **k))[1],
    )
    data = GQA[int(case.split()[1])] if isinstance(case, str) else FIXED[case]
    sc = load_scenario(data)
    backend = emulated()
    port = simulator.run(sc, record_tensors=True, backend=backend)
    ref = simulator.run(sc, record_tensors=True, backend=reference_backend())
    counts = compare_runs(port, ref, backend.dtype)
    assert counts["forwards"] >= 3 and counts["tensors"] > 20
    assert launches["rs_verify_attention_partial"] >= counts["forwards"] and launches["rs_rope"] > 0
    assert (
        backend.kernel_attentions == launches["rs_verify_attention_partial"]
        and backend.prefill_fallbacks == 0
    )
    assert launches["rs_front_align"] > 0
