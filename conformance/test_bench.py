"""`raggedspec bench` (raggedspec/bench/) in its CPU smoke mode, so the benchmark never rots: every
strategy that can run on the CPU runs and agrees with the float64 reference, a wrong strategy is
reported WRONG and not timed, the byte accounting follows its formulas, and the reports are
written. No timing is asserted beyond "measured and positive" (the smoke makes no claims).

Expected values come from oracles written here: a brute-force NumPy attention, the byte
formulas recomputed from the recorded lengths, and deliberately wrong strategies (negative
controls) that the correctness check must reject.
"""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from raggedspec.gpu import kernel_emulator
from raggedspec.bench import report, runner, strategies

CPU_STRATEGIES = ("per_row", "padded_sdpa", "flex", "cohort", "port", "inplace_sdpa")
EMULATED = kernel_emulator.compilers()["g++"] is not None   # the CuPy slot runs emulated on the CPU


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-smoke")
    rc = runner.main(["--smoke", "--out", str(out), "-q"])
    return rc, out, json.loads((out / "bench.json").read_text())


@pytest.mark.rule("raggedspec bench")
def test_smoke_runs_every_cpu_strategy_and_each_agrees(smoke):
    rc, _, res = smoke
    assert rc == 0
    assert res["smoke"] is True and res["complete"] is True
    assert res["precheck"]["failed"] == {}
    s = res["settings"]
    assert len(res["rows"]) == len(s["batches"]) * len(s["lengths"]) * len(s["spreads"]) * len(
        s["windows"]
    )
    tol = strategies.TOLERANCE["float32"]
    for row in res["rows"]:
        for name in CPU_STRATEGIES:
            r = row["strategies"][name]
            ragged = row["min_len"] < row["L"]
            want = "lossy" if name == "cohort" and ragged else "ok"
            assert r["status"] == want, (name, row["w"], row["B"], row["spread"], r)
            assert r["err"] <= tol and r["ms"] > 0 and r["mask_ms"] > 0, (name, r)
        # without CUDA the CuPy slot runs the kernel source under the g++ emulator (checked like
        # every strategy, its time labelled meaningless), or says why it did not run
        cupy = row["strategies"]["cupy"]
        if EMULATED:
            assert cupy["status"] == "ok" and cupy["err"] <= tol, cupy
        else:
            assert cupy["status"] == "not run" and "ms" not in cupy and cupy["reason"]
    if EMULATED:
        assert "g++ emulation" in res["notes"]["cupy"] and "meaningless" in res["notes"]["cupy"]
    assert "eager" in res["notes"]["flex"]  # the table says flex was not compiled on the CPU


@pytest.mark.rule("raggedspec bench")
def test_only_the_cupy_slot_is_timed_alone_beside_its_wrapper(smoke):
    _, _, res = smoke
    for row in res["rows"]:
        for name, r in row["strategies"].items():
            if name == "cupy" and r["status"] == "ok":
                assert r["kernel_ms"] > 0 and r["wrapper_ms"] == r["ms"] - r["kernel_ms"]
            else:
                assert "kernel_ms" not in r and "wrapper_ms" not in r, (name, r)


@pytest.mark.rule("raggedspec bench")
@pytest.mark.skipif(not EMULATED, reason="the CuPy slot runs on the CPU under the g++ emulator")
def test_the_recorded_launches_are_the_whole_kernel_and_replay_into_its_output():
    from raggedspec.gpu import cupy_kernels as ck

    case = strategies.Case(2, [9, 5, 7], 2, 4, 16, torch.float32, "cpu", seed=1)
    slot = strategies.Cupy()
    assert slot.unavailable(torch.device("cpu")) is None
    launch = ck.Kernels._launch
    out, launches = strategies.recorded_launches(lambda: slot.run(case, None))
    assert ck.Kernels._launch is launch  # put back
    assert len(launches) == 2  # the attention's partial pass and the combine
    want = out.clone()
    assert strategies.rel_err(want, strategies.reference_attention(case)) < 1e-5
    out.fill_(float("nan"))
    for again in launches:
        again()
    assert torch.equal(out, want)  # the replay alone rewrote every element
    out.fill_(float("nan"))
    launches[0]()
    assert torch.isnan(out).all()  # the partial pass alone writes no output: both are needed
    replay = slot.kernel_only(case, None)
    replay()  # runs on its own buffers, outside any wrapper


@pytest.mark.rule("raggedspec bench")
def test_the_headline_judges_the_bound_on_the_kernel_alone_and_shows_the_wrapper():
    result = {"copy_bandwidth": [{"GBps": 1.0}]}  # 1e6 live bytes: a 1 ms bound
    row = {"w": 2, "B": 128, "L": 4096, "spread": 64, "live_kv_bytes": 1_000_000,
           "strategies": {"per_row": {"status": "ok", "ms": 60.0},
                          "cupy": {"status": "ok", "ms": 1.5, "kernel_ms": 1.05}}}
    line = report.headline_lines(result, [row])[0]
    assert ("`cupy` kernel 1.050 ms = 1.05x bound (the call with its wrapper 1.500 ms = 1.50x, "
            "wrapper overhead 0.450 ms), 40.0x the per-row loop's speed") in line
    assert line.endswith("targets MET.")
    row["strategies"]["cupy"]["kernel_ms"] = 1.2
    assert report.headline_lines(result, [row])[0].endswith("targets MISSED.")
    cell = report._cell(row["strategies"]["cupy"], 1.0)
    assert cell == "1.200 (1.20x) kernel; 1.500 (1.50x) with its wrapper"


@pytest.mark.rule("raggedspec bench")
def test_cohort_truncation_is_labelled_lossy_and_really_is(smoke):
    _, _, res = smoke
    lossy = [r for r in res["rows"] if r["min_len"] < r["L"]]
    exact = [r for r in res["rows"] if r["min_len"] == r["L"]]
    assert lossy and exact
    for row in lossy:   # it drops the longer rows' oldest keys: far off the full reference
        assert row["strategies"]["cohort"]["err_full"] > 0.05
    for row in exact:   # a uniform batch loses nothing
        assert row["strategies"]["cohort"]["err_full"] <= strategies.TOLERANCE["float32"]


@pytest.mark.rule("raggedspec bench")
def test_smoke_byte_accounting_follows_the_formulas(smoke):
    _, _, res = smoke
    s = res["settings"]
    hk, d, es = s["kv_heads"], s["head_dim"], 4            # float32
    for row in res["rows"]:
        lens, b, w = row["lens"], row["B"], row["w"]
        assert (
            len(lens) == b
            and max(lens) == row["L"]
            and min(lens) == row["L"] - (row["spread"] if b > 1 else 0)
        )
        assert row["live_kv_bytes"] == 2 * sum(lens) * hk * d * es
        assert row["align_bytes"] == 2 * 2 * b * max(lens) * hk * d * es
        assert row["append_bytes"] == 2 * b * w * hk * d * es     # the new tokens' K/V only
        assert row["strip_bytes"] == 0
        assert row["align_ms"] > 0 and row["append_ms"] > 0
    bw = [m["GBps"] for m in res["copy_bandwidth"]]
    assert len(bw) == 2 and min(bw) > 0
    row = res["rows"][0]
    assert report.bound_ms(res, row) == pytest.approx(row["live_kv_bytes"] / (max(bw) * 1e9) * 1e3)


@pytest.mark.rule("raggedspec bench")
def test_smoke_writes_table_json_and_plot_and_replots(smoke, tmp_path):
    _, out, res = smoke
    md = (out / "bench.md").read_text()
    assert md.startswith("**SMOKE run")
    table = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(table) == 2 * len(res["rows"])  # the timing table and the data-movement table
    if EMULATED:  # the CuPy slot's note or reason is in the table
        assert res["notes"]["cupy"] in md
    else:
        assert f"not run: {res['not_run']['cupy']}" in md
    png = out / "bench.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    copy = tmp_path / "bench.json"
    copy.write_text((out / "bench.json").read_text())
    assert runner.main(["--replot", str(copy)]) == 0
    assert (tmp_path / "bench.md").read_text() == md and (
        tmp_path / "bench.png"
    ).stat().st_size > 10_000


@pytest.mark.rule("raggedspec bench")
def test_negative_control_without_dead_prefix_mask_is_wrong_and_not_timed(tmp_path):
    rc = runner.main(
        [
            "--smoke",
            "--strategies",
            "padded_sdpa,no_dead_prefix_mask",
            "--batches",
            "1,4",
            "--lengths",
            "40",
            "--spreads",
            "0,24",
            "--windows",
            "2",
            "--out",
            str(tmp_path),
            "-q",
        ]
    )
    assert rc == 0                                          # negative controls do not fail the run
    res = json.loads((tmp_path / "bench.json").read_text())
    assert "no_dead_prefix_mask" in res["precheck"]["failed"]
    for row in res["rows"]:
        assert row["strategies"]["padded_sdpa"]["status"] == "ok"
        bad = row["strategies"]["no_dead_prefix_mask"]
        assert bad["status"] == "WRONG" and "ms" not in bad
    assert "WRONG" in (tmp_path / "bench.md").read_text()


def _case(dtype, w=2, seed=3):
    lens = strategies.make_lens(6, 48, 24, w, seed)
    return strategies.Case(w, lens, hk=2, h=4, d=16, dtype=dtype, device="cpu", seed=seed)


class _OffByOne(strategies.InplaceSdpa):
    """Each query also sees the next position (a causal off-by-one)."""

    def prepare(self, case):
        c = torch.arange(case.T)
        qpos = (case.lens_t - case.w)[:, None] + case.window_row()[None, :] + 1
        return (c[None, None, :] <= qpos[:, :, None])[:, None]


class _ReadsSlack(strategies.InplaceSdpa):
    """The in-place layout read as if every row were T long (slack columns unmasked)."""

    def prepare(self, case):
        c = torch.arange(case.T)
        qpos = case.T - case.w + case.window_row()
        return (c[None, :] <= qpos[:, None])[None, None]


@pytest.mark.rule("raggedspec bench")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_check_rejects_an_off_by_one_and_a_slack_read(dtype):
    case = _case(dtype)
    ref = strategies.reference_attention(case)
    tol = strategies.TOLERANCE[str(dtype).removeprefix("torch.")]
    assert (
        runner.check_strategy(strategies.InplaceSdpa(), case, ref, None, tol)["status"] == "ok"
    )  # control
    for wrong in (_OffByOne(), _ReadsSlack()):
        res = runner.check_strategy(wrong, case, ref, None, tol)
        assert res["status"] == "WRONG" and res["err"] > tol, type(wrong).__name__


@pytest.mark.rule("raggedspec bench")
def test_a_strategy_that_disagrees_is_wrong_not_timed_and_fails_the_run(tmp_path, monkeypatch):
    monkeypatch.setitem(strategies.TOLERANCE, "float32", 0.0)  # nothing float32 can meet
    rc = runner.main(
        [
            "--smoke",
            "--strategies",
            "per_row,padded_sdpa",
            "--batches",
            "2",
            "--lengths",
            "40",
            "--spreads",
            "8",
            "--windows",
            "2",
            "--out",
            str(tmp_path),
            "-q",
        ]
    )
    assert rc == 1
    res = json.loads((tmp_path / "bench.json").read_text())
    assert set(res["precheck"]["failed"]) == {"per_row", "padded_sdpa"}
    for r in res["rows"][0]["strategies"].values():
        assert r["status"] == "WRONG" and "ms" not in r


def _brute_force(q, k, v, lens, w, keep=None):
    """Per row, per query head, per window row: a plain softmax over the visible keys (NumPy)."""
    b, h, _, d = q.shape
    hk = k.shape[1]
    out = np.zeros(q.shape)
    for i in range(b):
        n = lens[i]
        lo = 0 if keep is None else n - keep
        for hh in range(h):
            kh = hh // (h // hk)
            for r in range(w):
                qp = n - w + r
                ks = [p for p in range(lo, n) if p <= qp]
                logits = np.array([q[i, hh, r] @ k[i, kh, p] for p in ks]) / math.sqrt(d)
                p_ = np.exp(logits - logits.max())
                p_ /= p_.sum()
                out[i, hh, r] = sum(pp * v[i, kh, p] for pp, p in zip(p_, ks, strict=False))
    return out


@pytest.mark.rule("raggedspec bench")
@pytest.mark.parametrize("keep", [None, 10])
def test_reference_attention_equals_brute_force(keep):
    case = strategies.Case(
        3, [13, 10, 12], hk=2, h=4, d=8, dtype=torch.float64, device="cpu", seed=5
    )
    got = strategies.reference_attention(case, keep=keep).numpy()
    want = _brute_force(case.q.numpy(), case.kv.k.numpy(), case.kv.v.numpy(), case.lens, 3, keep)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.rule("raggedspec bench")
def test_make_lens_rules():
    lens = strategies.make_lens(128, 4096, 64, 4, seed=0)
    assert lens == strategies.make_lens(128, 4096, 64, 4, seed=0)          # seeded
    assert lens[0] == 4096 and lens[1] == 4096 - 64 and all(4032 <= n <= 4096 for n in lens)
    assert len(set(lens)) > 10
    assert strategies.make_lens(5, 100, 0, 2, seed=1) == [100] * 5
    assert strategies.make_lens(1, 100, 50, 2, seed=1) == [100]
    with pytest.raises(ValueError, match="L 10 - spread 9 < window 2"):
        strategies.make_lens(3, 10, 9, 2, seed=0)


@pytest.mark.rule("raggedspec bench")
def test_the_headline_case_runs_first():
    order = runner.case_order(dict(runner.FULL))
    assert len(order) == 36 and len(set(order)) == 36
    assert [(b, L, s) for (_, b, L, s) in order[:2]] == [(128, 4096, 64)] * 2
    assert sorted(w for (w, *_rest) in order[:2]) == [2, 4]


@pytest.mark.rule("raggedspec bench")
@pytest.mark.parametrize("argv, needle", [
    (["--strategies", "per_row,bogus"], "unknown ['bogus']"),
    (["--q-heads", "6", "--kv-heads", "4"], "multiple of --kv-heads 4"),
    (["--lengths", "10", "--spreads", "9"], "shorter than the window"),
])
def test_usage_errors_exit_2(argv, needle, tmp_path, capsys):
    assert runner.main(["--smoke", "--out", str(tmp_path), *argv]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.rule("raggedspec bench")
def test_cupy_slot_states_why_it_did_not_run(monkeypatch):
    monkeypatch.setattr(kernel_emulator, "compilers", lambda: {"g++": None, "nvcc": None})
    reason = strategies.Cupy().unavailable(torch.device("cpu"))
    assert isinstance(reason, str) and reason      # on the CPU without g++ it never runs
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "raggedspec.gpu.cupy_kernels" else real(name, *a),
    )
    assert strategies.Cupy().unavailable(torch.device("cuda")) == \
        "no module raggedspec.gpu.cupy_kernels (the CuPy kernels are not written yet)"


@pytest.mark.rule("raggedspec bench")
def test_e2e_smoke_runs_cohort_and_per_sequence(tmp_path):
    assert runner.main(["--e2e", "--smoke", "--out", str(tmp_path), "-q"]) == 0
    res = json.loads((tmp_path / "e2e.json").read_text())
    runs = {r["advance"]: r for r in res["runs"]}
    assert set(runs) == {"cohort", "per-sequence"}
    for r in runs.values():
        assert (
            r["median_ms"] > 0
            and r["decode_steps"] >= 1
            and r["max_rows"] == res["settings"]["batch"]
        )
        for st in r["steps"]:
            assert st["live_tokens"] <= st["padded_tokens"]
    # cohort keeps every row at one length: nothing padded
    assert all(st["live_tokens"] == st["padded_tokens"] for st in runs["cohort"]["steps"])
    md = (tmp_path / "e2e.md").read_text()
    assert md.startswith("**SMOKE run") and "| cohort | " in md and "| per-sequence | " in md
    (tmp_path / "e2e.md").unlink()  # a run cut short: the table again from the JSON
    assert runner.main(["--replot", str(tmp_path / "e2e.json")]) == 0
    assert (tmp_path / "e2e.md").read_text() == md


@pytest.mark.rule("raggedspec bench")
@pytest.mark.parametrize("cupy_ms, per_row_ms, verdict", [
    (1.05, 40.0, "targets MET"),        # 1.05x the bound, 38x the per-row loop
    (1.20, 40.0, "targets MISSED"),     # over 1.10x the bound
    (1.00, 20.0, "targets MISSED"),     # only 20x the per-row loop
])
def test_headline_verdict_on_the_targets(cupy_ms, per_row_ms, verdict):
    # bandwidth 1 GB/s and 1e6 live bytes: the bound is exactly 1 ms
    result = {"copy_bandwidth": [{"GBps": 1.0}]}
    row = {
        "w": 2,
        "B": 128,
        "L": 4096,
        "spread": 64,
        "live_kv_bytes": 1_000_000,
        "strategies": {
            "per_row": {"status": "ok", "ms": per_row_ms},
            "cupy": {"status": "ok", "ms": cupy_ms},
        },
    }
    other = dict(row, spread=0)                      # not the headline case: no line
    lines = report.headline_lines(result, [row, other])
    assert len(lines) == 1 and lines[0].endswith(verdict + ".")
    assert f"`cupy` {cupy_ms:.3f} ms = {cupy_ms:.2f}x bound" in lines[0]
    not_run = dict(row, strategies={"per_row": {"status": "ok", "ms": 9.0},
                                    "cupy": {"status": "not run", "reason": "no module"}})
    assert "targets not assessed (cupy: not run)" in report.headline_lines(result, [not_run])[0]
    emulated = dict(result, notes={"cupy": "g++ emulation of the CUDA kernel on the CPU (...)"})
    assert (
        "targets not assessed (the cupy column is the g++ emulator"
        in report.headline_lines(emulated, [row])[0]
    )


@pytest.mark.rule("raggedspec bench")
@pytest.mark.skipif(not EMULATED, reason="the emulated kernel backend needs g++ on the PATH")
def test_e2e_smoke_runs_on_the_kernel_backend_and_names_it(tmp_path):
    assert (
        runner.main(
            [
                "--e2e",
                "--smoke",
                "--e2e-backend",
                "raggedspec.gpu.cupy_backend:emulated",
                "--out",
                str(tmp_path),
                "-q",
            ]
        )
        == 0
    )
    res = json.loads((tmp_path / "e2e.json").read_text())
    assert res["settings"]["backend"] == "raggedspec.gpu.cupy_backend:emulated"
    assert {r["advance"] for r in res["runs"] if r.get("median_ms", 0) > 0} == {
        "cohort",
        "per-sequence",
    }
    assert (
        "on the raggedspec.gpu.cupy_backend:emulated backend" in (tmp_path / "e2e.md").read_text()
    )


@pytest.mark.rule("raggedspec bench")
def test_e2e_on_a_backend_that_cannot_run_here_exits_2_saying_why(tmp_path, capsys):
    from raggedspec.gpu.cupy_backend import cupy_unavailable

    if cupy_unavailable() is None:  # a CUDA machine: ask for the cupy backend on the CPU instead
        argv, needle = ["--device", "cpu"], "runs on CUDA only"
    else:
        argv, needle = [], "needs a CUDA GPU"
    assert (
        runner.main(
            ["--e2e", "--smoke", "--e2e-backend", "cupy", *argv, "--out", str(tmp_path), "-q"]
        )
        == 2
    )
    assert needle in capsys.readouterr().err


@pytest.mark.rule("raggedspec bench")
def test_an_interrupted_bench_keeps_the_earlier_result_and_its_own_finished_cases(
    tmp_path, monkeypatch
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "bench.json").write_text("an earlier run's result")
    real, calls = runner.run_case, []

    def cut_after_one_case(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_case", cut_after_one_case)
    with pytest.raises(KeyboardInterrupt):
        runner.main(["--smoke", "--out", str(out), "-q"])
    assert (out / "bench.json").read_text() == "an earlier run's result"
    partial = json.loads((out / "bench.partial.json").read_text())
    assert len(partial["rows"]) == 1 and not partial.get("complete")
    assert runner.read_result(out / "bench.partial.json")["rows"] == partial["rows"]


# ---------------------------------------------------------------- the lengths-only benchmark


@pytest.mark.rule("lengths-only benchmark B = 1024, 10,000 steps")
def test_the_lengths_benchmark_times_a_run_of_every_step_and_keeps_its_summary():
    from raggedspec.bench import lengths as lengths_bench

    for advance in ("per-sequence", "cohort"):
        res = lengths_bench.bench(batch=64, steps=50, advance=advance)
        assert (res["batch"], res["steps"], res["advance"]) == (64, 50, advance)
        assert res["summary"]["steps"] == 50 and res["seconds"] > 0 and res["cpu_seconds"] > 0
        # every request is long enough to run all 50 steps: each row commits every step
        assert res["summary"]["committed"] >= 64 * 50
    assert lengths_bench.bench(8, 20, "cohort")["summary"]["max_spread"] == 0


@pytest.mark.rule("lengths-only benchmark B = 1024, 10,000 steps")
def test_the_lengths_benchmark_command_needs_bench_and_times_both_rules(capsys):
    from raggedspec.bench import lengths as lengths_bench

    assert lengths_bench.main([]) == 2
    assert lengths_bench.main(["--bench", "--batch", "4", "--steps", "5"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[-2:]
    assert ["'advance': 'per-sequence'" in lines[0], "'advance': 'cohort'" in lines[1]] == [
        True, True]


@pytest.mark.slow
@pytest.mark.rule("raggedspec bench")
def test_each_case_line_carries_its_count(tmp_path, capsys):
    argv = ["--smoke", "--batches", "1,2", "--lengths", "40", "--spreads", "0", "--windows", "2",
            "--strategies", "per_row", "--out", str(tmp_path / "b")]
    assert runner.main(argv) == 0
    cases = [ln for ln in capsys.readouterr().err.splitlines() if " B=" in ln]
    assert [ln.split()[0] for ln in cases] == ["[1/2]", "[2/2]"], cases
