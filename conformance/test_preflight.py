"""`raggedspec preflight` (raggedspec/preflight.py), the device script's first-run checks of
the hand-written kernels, run here under the g++ emulator (the CuPy run skips with its reason):
it passes on the kernel that ships and skips the side-stream check (it needs CUDA); it stops at
the first failed check and names it (exit 4), the rest listed as not run; it names the check
running in its JSON before running it (so a run killed at a time limit says where it was);
every variant is compiled once, by its compile check, and the later checks launch those
builds; its reference reads only each row's live keys; asking for CuPy where it cannot run
exits 2. The device script's handling of its verdicts: conformance/test_device_script.py.
"""

from __future__ import annotations

import json

import pytest

from raggedspec import preflight
from raggedspec.gpu import cupy_kernels as ck
from raggedspec.gpu import kernel_emulator

pytestmark = pytest.mark.rule("GPU session script and raggedspec preflight")
needs_gxx = pytest.mark.skipif(kernel_emulator.compilers()["g++"] is None,
                               reason="the kernel emulator needs g++ on the PATH")


@pytest.mark.rule("GPU session script and raggedspec preflight")
@needs_gxx
def test_the_preflight_stops_at_the_first_failed_check_and_names_it(monkeypatch, capsys, tmp_path):
    real = ck.ragged_verify_attention_emulated

    def one_key_too_many(q, k, v, lens):  # every row short of the capacity reads a slack key
        return real(q, k, v, (lens + 1).clamp(max=k.shape[2]))

    monkeypatch.setattr(ck, "ragged_verify_attention_emulated", one_key_too_many)
    rc = preflight.main(["--mode", "emulate", "--out", str(tmp_path / "p.json")])
    assert rc == preflight.EXIT_PREFLIGHT_FAILED == 4
    assert "FAILED check(s): reference:float64" in capsys.readouterr().err
    result = json.loads((tmp_path / "p.json").read_text())
    assert result["checks"][-1]["check"] == "reference:float64"
    assert result["checks"][-1]["detail"].startswith("AssertionError: rel err")
    assert [c["status"] for c in result["checks"][:-1]].count("failed") == 0
    assert result["not_run"] == ["reference:float32", "reference:bfloat16", "timing"]
    assert result["running"] is None


@pytest.mark.rule("GPU session script and raggedspec preflight")
def test_the_preflight_names_the_running_check_in_its_file_before_it_runs(monkeypatch, tmp_path):
    out = tmp_path / "p.json"
    seen = []

    def check(name):
        return lambda: seen.append(json.loads(out.read_text())["running"]) or "fine"

    monkeypatch.setattr(preflight, "check_plan", lambda mode: [("a", check("a")),
                                                               ("b", check("b"))])
    result = preflight.run_checks("emulate", None, out, log=lambda msg: None)
    assert seen == ["a", "b"] and result["running"] is None
    assert [c["status"] for c in result["checks"]] == ["ok", "ok"]


@pytest.mark.rule("GPU session script and raggedspec preflight")
@needs_gxx
def test_the_preflight_compiles_each_variant_once_and_the_later_checks_reuse_it(monkeypatch):
    built: dict[str, list[str]] = {}
    current = ["?"]
    real_build, real_plan = kernel_emulator.build, preflight.check_plan

    def build(defines, source=None):
        built.setdefault(current[0], []).append(defines)
        return real_build(defines, source)

    def plan(mode):
        def named(name, thunk):
            return lambda: (current.__setitem__(0, name), thunk())[1]
        return [(name, named(name, thunk)) for name, thunk in real_plan(mode)]

    monkeypatch.setattr(kernel_emulator, "build", build)
    monkeypatch.setattr(preflight, "check_plan", plan)
    result = preflight.run_checks("emulate", None, None, log=lambda msg: None)
    assert result["failed"] == []
    compiled = {name: set(texts) for name, texts in built.items() if name.startswith("compile:")}
    assert len(compiled) == len(preflight.KERNEL_VARIANTS["smoke"])
    firsts = [texts for texts in compiled.values()]
    assert all(not (a & b) for i, a in enumerate(firsts) for b in firsts[i + 1:])  # each its own
    made = set().union(*firsts)
    later = {name: set(texts) for name, texts in built.items()
             if name.startswith(("reference:", "timing", "side_stream"))}
    assert later and all(texts <= made for texts in later.values()), later


@pytest.mark.rule("GPU session script and raggedspec preflight")
@needs_gxx
def test_the_preflight_passes_under_the_emulator_and_skips_the_stream_check(tmp_path):
    result = preflight.run_checks("emulate", None, tmp_path / "p.json", log=lambda msg: None)
    rows = {c["check"]: c for c in result["checks"]}
    assert result["failed"] == [] and result["not_run"] == []
    assert json.loads((tmp_path / "p.json").read_text())["checks"] == result["checks"]
    for dtype in ("float64", "float32", "bfloat16"):
        assert rows[f"reference:{dtype}"]["status"] == "ok"
    assert rows["timing"]["detail"]["kernel_ms"] > 0
    assert rows["side_stream"]["status"] == "skipped" and "CUDA" in rows["side_stream"]["detail"]


NO_CUPY = ck.cupy_unavailable()


@pytest.mark.rule("GPU session script and raggedspec preflight")
@pytest.mark.skipif(NO_CUPY is not None, reason=f"CuPy needs a CUDA GPU: {NO_CUPY}")
def test_the_preflight_passes_through_cupy_with_the_stream_check(tmp_path):
    assert preflight.pick_mode("auto") == ("cupy", None)
    result = preflight.run_checks("cupy", None, tmp_path / "p.json", log=lambda msg: None)
    assert result["failed"] == []
    assert {c["check"]: c["status"] for c in result["checks"]}["side_stream"] == "ok"


@pytest.mark.rule("GPU session script and raggedspec preflight")
def test_the_reference_reads_only_each_rows_live_keys():
    c = preflight.REFERENCE_CASES["smoke"]
    q, k, v = preflight.ragged_inputs(4, c["hk"], c["g"], c["w"], 8, 20, [20, 5, 9, 2], seed=3)
    want = preflight.reference_attention(q, k, v, [20, 5, 9, 2])
    k2, v2 = k.copy(), v.copy()
    k2[1, :, 5:], v2[1, :, 5:] = 7.0, -3.0  # slack of row 1 rewritten: no change
    assert (preflight.reference_attention(q, k2, v2, [20, 5, 9, 2]) == want).all()
    # row 3 has exactly w keys: its first query sees key 0 alone, so it returns v[0]
    assert abs(want[3, 0, 0] - v[3, 0, 0]).max() < 1e-12
    assert preflight.rel_err(want * float("nan"), want) == float("inf")


@pytest.mark.rule("GPU session script and raggedspec preflight")
@pytest.mark.skipif(NO_CUPY is None, reason="CuPy runs here: the refusal needs a machine without")
def test_asking_for_cupy_where_it_cannot_run_exits_2(capsys):
    assert preflight.main(["--mode", "cupy"]) == preflight.EXIT_USAGE
    assert "--mode cupy: " in capsys.readouterr().err
