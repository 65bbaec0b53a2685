"""The backend under test and the comparison policy of backend conformance (array-api-tests
style: the implementation under test is chosen by environment variables, the reference is
always `raggedspec.reference.backend.NumpyBackend`).

- `RAGGEDSPEC_BACKEND`: `torch` (default), `numpy` (the reference against itself), or
  `package.module:factory` (your own port: `factory(device=..., dtype=...)` returns a
  `raggedspec.reference.backend.Backend`; see docs/conformance.md "Bring your own port");
- `RAGGEDSPEC_DEVICE`: `cpu` (default), `cuda`, `cuda:N`, ... (passed to the factory);
- `RAGGEDSPEC_DTYPE`: `float64` (default), `float32`, `bfloat16`.

Comparison policy (DESIGN.md "Comparison policy"; docs/conformance.md "Tolerances"):
- integers, lengths, capacities, leads, positions, token ids, masks: equal, bit for bit
  (masks compared as float64 host arrays; -inf == -inf);
- float64 tensors: `max|port - ref| <= 1e-12 * max|ref|` (float64 rounding, summation order
  and vectorized-vs-scalar transcendentals are ~1e-16 relative per op; a real defect is
  O(1e-3) or larger);
- float32 / bfloat16 tensors, compared with the float64 reference:
  `max|port - ref| <= K * eps(dtype) * max|ref|`, K = 16 (`LOW_PRECISION_K`). The per-op
  port tests (`test_port_*.py`) use the FlashAttention rule against a same-precision naive
  implementation; end to end there is no same-precision reference (the reference is float64
  only), so the bound is a multiple of the dtype's unit roundoff at the tensor's scale:
  the tiny model is 2 target layers + the MTP layer deep, and the measured worst errors
  were 3.7 eps (float32) and 1.7 eps (bfloat16) (docs/conformance.md), so K = 16 leaves
  a 4x margin and still fails on any real defect (O(1e-3) relative or larger).
"""

from __future__ import annotations

import os

import numpy as np

from raggedspec.reference.backend import Backend, NumpyBackend, load_backend

BACKEND_ENV, DEVICE_ENV, DTYPE_ENV = "RAGGEDSPEC_BACKEND", "RAGGEDSPEC_DEVICE", "RAGGEDSPEC_DTYPE"
DEFAULT_BACKEND = "torch"
FLOAT64_RTOL = 1e-12
LOW_PRECISION_K = 16.0
EPS = {"float64": float(np.finfo(np.float64).eps), "float32": float(np.finfo(np.float32).eps),
       "bfloat16": 2.0 ** -7}

_cache: dict[tuple, Backend] = {}


def selection() -> tuple[str, str | None, str | None]:
    """`(backend spec, device or None, dtype or None)` from the environment."""
    return (os.environ.get(BACKEND_ENV, DEFAULT_BACKEND), os.environ.get(DEVICE_ENV) or None,
            os.environ.get(DTYPE_ENV) or None)


def backend_under_test() -> Backend:
    """The backend the environment selects (one instance per selection). For `numpy` the
    device and dtype must be unset or `cpu` / `float64`."""
    key = selection()
    if key not in _cache:
        spec, device, dtype = key
        if spec == "torch":
            import torch  # conformance tensors are tiny: one thread (see gpu/testing.py)
            torch.set_num_threads(int(os.environ.get("RAGGEDSPEC_TORCH_THREADS", "1")))
        _cache[key] = load_backend(spec, device, dtype)
    return _cache[key]


def reference_backend() -> NumpyBackend:
    return NumpyBackend()


def describe(backend: Backend) -> str:
    return f"{backend.name} ({backend.device}, {backend.dtype})"


# ----------------------------------------------------------------------------- comparison


class Mismatch(AssertionError):
    """A port state that differs from the reference's; the message names where."""


# The rule (the start of its docs/rules.md row name) each tensor of an end-to-end record
# belongs to, by the word compare_runs names it with; checked in order, the first match wins.
TENSOR_RULES = (
    ("rope_positions", "RoPE positions and rotation, backend"),
    ("mask", "dead-prefix union mask, backend"),
    ("row_q0", "the step plan, made once for both engines"),
    ("draft", "prompt priming, the draft group loop and the MTP step, backend"),
    ("cache", "one verify step through the target-cache rules, backend"),
    ("hidden", "dsv4_attention, backend"),
    ("logits", "dsv4_attention, backend"),
)
E2E_RULE = "end to end: the same scenario on two backends"


def rule_of(what: str) -> str:
    """The docs/rules.md rule (the start of its row's name) a differing end-to-end tensor
    (compare_runs's name for it) belongs to; the end-to-end row when no per-method rule owns it."""
    for word, rule in TENSOR_RULES:
        if word in what:
            return rule
    return E2E_RULE


def bound(dtype: str, scale: float) -> float:
    """The allowed `max|port - ref|` for a tensor of scale `max|ref|` in `dtype`."""
    if dtype == "float64":
        return FLOAT64_RTOL * scale
    return LOW_PRECISION_K * EPS[dtype] * scale


def assert_exact(port, ref, what: str) -> None:
    """Integers, lists of integers, masks: equal (arrays: equal shape and values)."""
    if isinstance(ref, np.ndarray) or isinstance(port, np.ndarray):
        p, r = np.asarray(port), np.asarray(ref)
        if p.shape != r.shape:
            raise Mismatch(f"{what}: shape {p.shape} != reference {r.shape}")
        if not np.array_equal(p, r):
            at = np.argwhere(p != r)[:5].tolist()
            raise Mismatch(f"{what}: differs from the reference at {at}")
        return
    if port != ref:
        raise Mismatch(f"{what}: {port!r} != reference {ref!r}")


def assert_close(port, ref, dtype: str, what: str) -> float:
    """A float tensor within `bound(dtype, max|ref|)`; returns the relative error."""
    if ref is None or port is None:
        if (ref is None) != (port is None):
            raise Mismatch(f"{what}: port {'None' if port is None else 'tensor'} but reference "
                           f"{'None' if ref is None else 'tensor'}")
        return 0.0
    p, r = np.asarray(port, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if p.shape != r.shape:
        raise Mismatch(f"{what}: shape {p.shape} != reference {r.shape}")
    if not r.size:
        return 0.0
    if not np.isfinite(p).all():
        raise Mismatch(f"{what}: the port produced non-finite values")
    scale = float(np.abs(r).max())
    err = float(np.abs(p - r).max())
    if err > bound(dtype, scale):
        at = np.unravel_index(int(np.abs(p - r).argmax()), r.shape)
        raise Mismatch(f"{what}: max error {err:.3e} at {tuple(int(x) for x in at)} > allowed "
                       f"{bound(dtype, scale):.3e} ({dtype}, scale {scale:.3e})")
    return err / scale if scale else 0.0


def assert_same_cache(
    port: dict, ref: dict, dtype: str, what: str, committed: int | None = None
) -> int:
    """Two `Backend.materialize` views: lengths and capacities exact, K/V front-aligned
    within the policy (only the first `committed` columns when given), XsRolling tokens and
    bases exact, compressed rows and histories within the policy. Returns tensors compared."""
    assert_exact(port["len"], ref["len"], f"{what} length")
    assert_exact(port["capacity"], ref["capacity"], f"{what} capacities")
    assert_exact(len(port["kv"]), len(ref["kv"]), f"{what} K/V slot count")
    n = 0
    for layer, ((pk, pv), (rk, rv)) in enumerate(zip(port["kv"], ref["kv"], strict=False)):
        if committed is not None and rk is not None and pk is not None:
            pk, pv, rk, rv = (
                pk[:, :, :committed],
                pv[:, :, :committed],
                rk[:, :, :committed],
                rv[:, :, :committed],
            )
        assert_close(pk, rk, dtype, f"{what} K slot {layer}")
        assert_close(pv, rv, dtype, f"{what} V slot {layer}")
        n += 2
    assert_exact(len(port["xs"]), len(ref["xs"]), f"{what} XsRolling slot count")
    for j, (px, rx) in enumerate(zip(port["xs"], ref["xs"], strict=False)):
        assert_exact(px["tokens"], rx["tokens"], f"{what} xs slot {j} tokens")
        assert_exact(px["base"], rx["base"], f"{what} xs slot {j} base")
        for i, (a, b) in enumerate(zip(px["comp"], rx["comp"], strict=False)):
            assert_close(a, b, dtype, f"{what} xs slot {j} row {i} compressed rows")
        for i, (a, b) in enumerate(zip(px["history"], rx["history"], strict=False)):
            assert_close(a, b, dtype, f"{what} xs slot {j} row {i} history")
        n += 2 * len(rx["comp"])
    return n


def compare_runs(port, ref, dtype: str) -> dict:
    """Compare two `simulator.run(..., record_tensors=True)` traces of one scenario, step by
    step: the integer trace (every JSONL line, the markers), the warnings and failure
    messages, and every record of `tensor_log`: per forward the ids, tokens, offsets,
    row_q0, leads, RoPE positions and masks (exact), hidden states and logits (policy), the
    batched target cache after the forward (`assert_same_cache`); per step end each
    scheduled sequence's own cache (pending lead exact) and draft state (filled, poisoned,
    seed position exact; seed hidden and draft KV within the policy; in float32/bfloat16
    only the committed draft columns `[0, filled)`: past them the chain's speculative
    entries depend on a float argmax). Raises `Mismatch` naming the step and the tensor;
    returns counts `{"forwards", "states", "tensors"}`. The Mismatch message ends with
    `[first differing tensor; rule: RULE]` (`rule_of`), which the conformance table reads."""
    try:
        return _compare_runs(port, ref, dtype)
    except Mismatch as exc:
        rule = rule_of(str(exc).split(":")[0])
        raise Mismatch(f"{exc} [first differing tensor; rule: {rule}]") from None


def _compare_runs(port, ref, dtype: str) -> dict:
    p_lines, r_lines = list(port.lines()), list(ref.lines())
    for k, (a, b) in enumerate(zip(p_lines, r_lines, strict=False)):
        if a != b:
            raise Mismatch(
                f"integer trace line {k} differs:\n  port      {a[:400]}\n  reference {b[:400]}"
            )
    assert_exact(len(p_lines), len(r_lines), "integer trace length")
    assert_exact(port.messages, ref.messages, "warnings and failure messages")
    assert_exact(len(port.tensor_log), len(ref.tensor_log), "tensor records")
    counts = {"forwards": 0, "states": 0, "tensors": 0}
    for p, r in zip(port.tensor_log, ref.tensor_log, strict=False):
        where = f"step {r['step']} ({r['phase']})"
        assert_exact(p["phase"], r["phase"], f"{where} record kind")
        assert_exact(p["ids"], r["ids"], f"{where} sequence ids")
        if r["phase"] == "state":
            counts["states"] += 1
            assert_exact(sorted(p["seqs"]), sorted(r["seqs"]), f"{where} sequences with a cache")
            for i in r["seqs"]:
                assert_exact(
                    p["seqs"][i]["pending"],
                    r["seqs"][i]["pending"],
                    f"{where} seq {i} pending lead",
                )
                counts["tensors"] += assert_same_cache(
                    p["seqs"][i], r["seqs"][i], dtype, f"{where} seq {i} cache"
                )
            assert_exact(
                sorted(p["drafts"]), sorted(r["drafts"]), f"{where} sequences with a draft state"
            )
            for i, rd in r["drafts"].items():
                pd = p["drafts"][i]
                for key in ("filled", "poisoned", "seed_pos"):
                    assert_exact(pd[key], rd[key], f"{where} seq {i} draft {key}")
                assert_close(pd["seed"], rd["seed"], dtype, f"{where} seq {i} draft seed hidden")
                if (pd["kv"] is None) != (rd["kv"] is None):
                    raise Mismatch(f"{where} seq {i}: draft KV present in one backend only")
                if rd["kv"] is not None:
                    committed = None if dtype == "float64" else rd["filled"]
                    counts["tensors"] += 1 + assert_same_cache(
                        pd["kv"], rd["kv"], dtype, f"{where} seq {i} draft KV", committed
                    )
            continue
        counts["forwards"] += 1
        for key in ("tokens", "positions", "row_q0", "lead", "rope_positions"):
            assert_exact(p[key], r[key], f"{where} {key}")
        assert_exact(len(p["masks"]), len(r["masks"]), f"{where} mask count")
        for layer, (pm, rm) in enumerate(zip(p["masks"], r["masks"], strict=False)):
            assert_exact(np.asarray(pm, dtype=np.float64), rm, f"{where} layer {layer} mask")
        assert_close(p["hidden"], r["hidden"], dtype, f"{where} hidden")
        assert_close(p["logits"], r["logits"], dtype, f"{where} logits")
        counts["tensors"] += (
            2
            + len(r["masks"])
            + assert_same_cache(p["target"], r["target"], dtype, f"{where} batched target cache")
        )
    return counts


# ----------------------------------------------------------------------- protocol coverage

PROTOCOL_CALLS: dict[str, set[str]] = {}
"""Backend class name -> the protocol methods called on an instance of exactly that class
during this test session (filled by the wrappers `record_protocol_calls` installs)."""


def _recording(name: str, method):
    def wrapper(self, *args, **kwargs):
        PROTOCOL_CALLS.setdefault(type(self).__name__, set()).add(name)
        return method(self, *args, **kwargs)

    wrapper.__wrapped__ = method
    wrapper.__name__ = getattr(method, "__name__", name)
    wrapper.__doc__ = getattr(method, "__doc__", None)
    return wrapper


def record_protocol_calls(classes) -> None:
    """Wrap every `PROTOCOL_METHODS` entry of each class in `classes` so a call on one of its
    instances lands in `PROTOCOL_CALLS[type(instance).__name__]`. The wrapper passes the call
    through unchanged; a method the class does not override (still `Backend`'s) is not wrapped,
so it is never recorded. Idempotent: a method already wrapped is left alone. Refuses (TypeError)
    a class that lacks a protocol method."""
    from raggedspec.reference.backend import PROTOCOL_METHODS

    for cls in classes:
        for name in PROTOCOL_METHODS:
            method = getattr(cls, name, None)
            if method is None:
                raise TypeError(f"{cls.__name__} has no protocol method {name!r}")
            if method is getattr(Backend, name):
                continue  # not implemented: left as is, so the missing-method check still sees it
            if name in vars(cls) and getattr(method, "__wrapped__", None) is not None:
                continue
            setattr(cls, name, _recording(name, method))


def uncalled_methods(calls: dict[str, set[str]], class_name: str) -> list[str]:
    """The protocol methods (in `PROTOCOL_METHODS` order) never called on `class_name`."""
    from raggedspec.reference.backend import PROTOCOL_METHODS

    seen = calls.get(class_name, set())
    return [m for m in PROTOCOL_METHODS if m not in seen]
