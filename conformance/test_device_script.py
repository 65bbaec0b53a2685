"""The GPU run script (scripts/gpu_session.py, scripts/gpu_session.sh) and its preflight
(raggedspec/preflight.py), run here on the CPU: the kernel under the g++ emulator, the CuPy
checks skipped with their reason.

- the whole `--cpu-smoke` plan inside its deadline (under 90 s), every step accounted for;
- a tiny `--deadline`: the later steps skipped, each with a note saying why;
- a step over its clipped limit killed with its children, and the running step taken along
  when the script itself is stopped;
- a kernel that computes wrong numbers: the preflight names the failed checks, exits 4, the
  CuPy steps are skipped and the others still run;
- the per-file JUnit plugin's counts; bad usage exits 2 and writes nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from raggedspec.gpu import cupy_kernels as ck
from raggedspec.gpu import kernel_emulator
from raggedspec import preflight

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_session.py"
pytestmark = pytest.mark.skipif(
    not SCRIPT.is_file(), reason="needs the checkout's scripts/ (an installed raggedspec has none)"
)
NO_GXX = kernel_emulator.compilers()["g++"] is None
needs_gxx = pytest.mark.skipif(NO_GXX, reason="the kernel emulator needs g++ on the PATH")


@pytest.fixture(scope="module")
def session_module():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location("gpu_session", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_session"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("gpu_session", None)
        sys.path.remove(str(ROOT / "scripts"))


def run_script(out: Path, *args: str, env: dict | None = None, timeout: float = 150):
    """Run the shell wrapper with OUT=out; returns (completed process, wall seconds)."""
    full_env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, **(env or {}))
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_session.sh"), *args],
        cwd=ROOT,
        env=full_env,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - t0


def step_rows(summary: str, column: int = 1) -> dict[str, str]:
    """step name -> status (column 1; 3: the timeout it was given), from summary.md's first
    table."""
    rows = {}
    for line in summary.split("## ")[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] not in ("step", "---"):
            rows[cells[0]] = cells[column]
    return rows


# --------------------------------------------------------------------------- the whole smoke


@needs_gxx
def test_the_cpu_smoke_ends_inside_its_deadline_and_accounts_for_every_step(
    tmp_path, session_module
):
    out = tmp_path / "out"
    proc, wall = run_script(out, "--cpu-smoke")
    summary = (out / "summary.md").read_text()
    assert wall < 90, f"--cpu-smoke took {wall:.1f} s"
    rows = step_rows(summary)
    planned = [s.name for s in session_module.plan("cpu-smoke", tmp_path, sys.executable)]
    assert list(rows) == planned, summary
    for name, status in rows.items():
        # a step either passed, or was cut by the deadline (clipped timeout, or skipped with why)
        assert status == "ok" or status == "timed out" or status.startswith("skipped: needs >="), (
            name,
            status,
            proc.stdout[-3000:],
        )
    for name in ("env", "preflight", "headline"):  # the first steps always have their time
        assert rows[name] == "ok", (name, rows[name], proc.stdout[-3000:])
    assert proc.returncode == (0 if "timed out" not in rows.values() else 1), proc.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert set(files) <= set(session_module.OUT_FILES) and len(files) <= 8, files
    pf = json.loads((out / "preflight.json").read_text())
    assert pf["mode"] == "emulate" and pf["failed"] == []
    assert {c["check"]: c["status"] for c in pf["checks"]}["side_stream"] == "skipped"
    head = json.loads((out / "headline.json").read_text())
    assert set(head["strategies"]) == {"cupy", "padded_sdpa", "flex"}
    assert head["rows"] and all(
        r["strategies"]["cupy"]["status"] == "ok" for r in head["rows"] if "strategies" in r
    ), head["rows"]
    assert "## Preflight (emulate): no check failed" in summary


# --------------------------------------------------------------------------- the deadline


@needs_gxx
def test_a_tiny_deadline_skips_the_later_steps_each_with_a_note(tmp_path, session_module):
    out = tmp_path / "out"
    proc, wall = run_script(out, "--cpu-smoke", "--deadline", "12")
    assert wall < 12 + 5
    summary = (out / "summary.md").read_text()
    rows = step_rows(summary)
    # env's 30 s cap clipped to 12 - 3 (final collect) - 3 (kill grace) = 6 s; on a loaded
    # machine it may use them all and be stopped: exit 1 then
    assert int(step_rows(summary, column=3)["env"]) <= 6
    assert rows["env"] in ("ok", "timed out")
    assert proc.returncode == (0 if rows["env"] == "ok" else 1), proc.stderr[-2000:]
    cupy = {st.name for st in session_module.plan("cpu-smoke", tmp_path, sys.executable) if st.cupy}
    later = [n for n in rows if n != "env"]
    assert len(later) >= 8 and cupy <= set(later)
    for name in later:
        if name in cupy:  # no preflight ran, so no CuPy step may
            assert rows[name] == "skipped: the preflight did not run: the CuPy steps are not run"
        else:
            assert rows[name].startswith("skipped: needs >="), (name, rows[name])
            assert "12 s deadline" in rows[name]
    assert "## Notes" in (out / "summary.md").read_text()


def test_each_timeout_is_the_cap_clipped_to_the_time_left(session_module, tmp_path):
    gs = session_module
    out = tmp_path / "out"
    out.mkdir()
    s = gs.Run("cpu-smoke", out, 100.0, tmp_path)
    step = gs.Step("x", ["true"], cap=60, min_s=5, reserve=20)
    s.t0 = time.monotonic() - 10  # 10 s gone: 100 - 10 - final 3 - reserve 20 - grace 3
    limit, why = s.limit_for(step)
    assert why is None and 60 - 1 < limit <= 60  # the cap is below 64 s left
    s.t0 = time.monotonic() - 40
    limit, why = s.limit_for(step)
    assert why is None and 34 - 1 < limit <= 34
    limit, why = s.limit_for(step, last=True)  # nothing after it: no reserve kept
    assert why is None and 54 - 1 < limit <= 54
    s.t0 = time.monotonic() - 70  # 4 s: under its 5 s minimum
    limit, why = s.limit_for(step)
    assert limit == 0 and why.startswith("skipped: needs >= 5 s") and "20 s kept" in why


def test_a_step_over_its_limit_is_killed_with_its_children(session_module, tmp_path):
    gs = session_module
    out = tmp_path / "out"
    out.mkdir()
    s = gs.Run("cpu-smoke", out, 100.0, tmp_path)
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(120)"
    )
    step = gs.Step("sleeper", [sys.executable, "-c", code], cap=2, min_s=1)
    t0 = time.monotonic()
    rc = s.run_step(step, dict(os.environ), last=True)
    assert rc == 124 and s.rows[-1]["status"] == "timed out"
    assert time.monotonic() - t0 < 2 + gs.KILL_GRACE + 2
    child = Path(f"/proc/{int(pid_file.read_text())}/stat")
    time.sleep(0.2)
    # gone, or a zombie (dead, waiting for a parent that reaps it)
    assert not child.exists() or child.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_script_stopped_from_outside_takes_its_running_step_along(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--cpu-smoke",
        "--only",
        "conf_port_torch",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    first = proc.stdout.readline()  # "... work folder /tmp/gpu-session.X, ..."
    work = first.split("work folder ", 1)[1].split(",", 1)[0]
    time.sleep(2)
    proc.terminate()
    assert proc.wait(timeout=30) == 128 + 15
    assert "the script was stopped by signal 15" in (out / "summary.md").read_text()
    time.sleep(0.3)
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if work in text and "pytest" in text:
            state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                left.append(text)
    assert left == []


# --------------------------------------------------------------------------- preflight failure

WRONG_KERNEL = """\
import raggedspec.gpu.cupy_kernels as _ck
_real = _ck.ragged_verify_attention_emulated
def _wrong(q, k, v, lens):
    return _real(q, k, v, lens) * 1.5     # a kernel that computes the wrong numbers
_ck.ragged_verify_attention_emulated = _wrong
"""


@needs_gxx
def test_a_failing_preflight_exits_3_skips_the_cupy_steps_and_runs_the_rest(tmp_path):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(WRONG_KERNEL)  # loaded by every step's Python
    out = tmp_path / "out"
    proc, _ = run_script(
        out,
        "--cpu-smoke",
        "--deadline",
        "85",
        "--only",
        "preflight,headline,conf_cupy_float64,e2e_cupy",
        env={"PYTHONPATH": str(inject)},
    )
    assert proc.returncode == 4, proc.stdout[-3000:]
    rows = step_rows((out / "summary.md").read_text())
    assert rows["preflight"] == "failed (exit 4)"
    for name in ("conf_cupy_float64", "e2e_cupy"):
        assert rows[name].startswith("skipped: the preflight failed"), rows[name]
    assert rows["headline"] == "ok"
    head = json.loads((out / "headline.json").read_text())
    assert head["strategies"] == ["padded_sdpa", "flex"]
    pf = json.loads((out / "preflight.json").read_text())
    assert pf["failed"] == ["reference:float64", "reference:float32", "reference:bfloat16"]
    assert "FAILED check(s): reference:float64" in (out / "session.log").read_text()


@needs_gxx
def test_the_preflight_catches_a_wrong_kernel_and_names_the_check(monkeypatch, capsys, tmp_path):
    real = ck.ragged_verify_attention_emulated

    def one_key_too_many(q, k, v, lens):  # every row short of the capacity reads a slack key
        return real(q, k, v, (lens + 1).clamp(max=k.shape[2]))

    monkeypatch.setattr(ck, "ragged_verify_attention_emulated", one_key_too_many)
    rc = preflight.main(["--mode", "emulate", "--out", str(tmp_path / "p.json")])
    assert rc == preflight.EXIT_PREFLIGHT_FAILED
    assert (
        "FAILED check(s): reference:float64, reference:float32, reference:bfloat16"
        in capsys.readouterr().err
    )
    result = json.loads((tmp_path / "p.json").read_text())
    failed = {c["check"]: c["detail"] for c in result["checks"] if c["status"] == "failed"}
    assert set(failed) == {"reference:float64", "reference:float32", "reference:bfloat16"}
    assert all(d.startswith("AssertionError: rel err") for d in failed.values())


NO_CUPY = ck.cupy_unavailable()


def _passing_run(mode: str, tmp_path: Path) -> dict:
    """The preflight in `mode` on the kernel that ships: no check failed, every variant and
    dtype checked, the timing measured; returns `{check: row}`."""
    result = preflight.run_checks(mode, None, tmp_path / "p.json", log=lambda msg: None)
    rows = {c["check"]: c for c in result["checks"]}
    assert result["failed"] == [], result["checks"]
    assert json.loads((tmp_path / "p.json").read_text())["checks"] == result["checks"]
    variants = preflight.KERNEL_VARIANTS["gpu" if mode == "cupy" else "smoke"]
    assert sum(name.startswith("compile:") for name in rows) == len(variants)
    for dtype in ("float64", "float32", "bfloat16"):
        assert rows[f"reference:{dtype}"]["status"] == "ok"
    timing = rows["timing"]["detail"]
    assert timing["kernel_ms"] > 0 and timing["wrapper_wall_ms"] > 0
    return rows


@needs_gxx
def test_the_preflight_passes_under_the_emulator_and_skips_the_stream_check(tmp_path):
    side = _passing_run("emulate", tmp_path)["side_stream"]
    assert side["status"] == "skipped" and "CUDA" in side["detail"]


@pytest.mark.skipif(NO_CUPY is not None, reason=f"CuPy needs a CUDA GPU: {NO_CUPY}")
def test_the_preflight_passes_through_cupy_with_the_stream_check(tmp_path):
    assert preflight.pick_mode("auto") == ("cupy", None)
    assert _passing_run("cupy", tmp_path)["side_stream"]["status"] == "ok"


def test_the_reference_reads_only_each_rows_live_keys():
    c = preflight.REFERENCE_CASE
    q, k, v = preflight.ragged_inputs(4, c["hk"], c["g"], c["w"], 8, 20, [20, 5, 9, 2], seed=3)
    want = preflight.reference_attention(q, k, v, [20, 5, 9, 2])
    k2, v2 = k.copy(), v.copy()
    k2[1, :, 5:], v2[1, :, 5:] = 7.0, -3.0  # slack of row 1 rewritten: no change
    assert (preflight.reference_attention(q, k2, v2, [20, 5, 9, 2]) == want).all()
    # row 3 has exactly w keys: its first query sees key 0 alone, so it returns v[0]
    assert abs(want[3, 0, 0] - v[3, 0, 0]).max() < 1e-12
    assert preflight.rel_err(want * float("nan"), want) == float("inf")


@pytest.mark.skipif(NO_CUPY is None, reason="CuPy runs here: the refusal needs a machine without")
def test_asking_for_cupy_where_it_cannot_run_exits_2(capsys):
    assert preflight.main(["--mode", "cupy"]) == preflight.EXIT_USAGE
    assert "--mode cupy: " in capsys.readouterr().err


# --------------------------------------------------------------------------- plugin, usage


def test_a_bench_cut_short_still_shows_its_finished_cases_in_the_summary(session_module, tmp_path):
    import session_report

    (tmp_path / "headline").mkdir()
    rows = [
        {
            "w": 2,
            "B": 128,
            "L": 4096,
            "spread": 64,
            "strategies": {
                "cupy": {"status": "ok", "ms": 0.5123},
                "flex": {"status": "WRONG", "err": 0.3},
            },
        },
        {"w": 4, "B": 128, "L": 4096, "spread": 64, "error": "OutOfMemoryError: ..."},
    ]
    (tmp_path / "headline" / "bench.json").write_text(json.dumps({"rows": rows}))
    text = session_report.render_summary("gpu", 100.0, 330.0, [], [], tmp_path)
    assert "## Headline (cut short: the cases bench.json holds)" in text
    assert "- w=2 B=128 L=4096 spread=64: cupy ok 0.512 ms, flex WRONG" in text
    assert "- w=4 B=128 L=4096 spread=64: OutOfMemoryError: ..." in text
    (tmp_path / "preflight.json").write_text(
        json.dumps(
            {
                "mode": "cupy",
                "failed": ["timing"],
                "checks": [
                    {
                        "check": "timing",
                        "status": "failed",
                        "seconds": 1.0,
                        "detail": "AssertionError: x | y",
                    },
                    {
                        "check": "timing2",
                        "status": "ok",
                        "seconds": 2.0,
                        "detail": {"kernel_ms": 0.51234, "shape": {"b": 128}},
                    },
                ],
            }
        )
    )
    text = session_report.render_summary("gpu", 100.0, 330.0, [], [], tmp_path)
    assert "## Preflight (cupy): FAILED: timing" in text
    assert "| timing | failed | 1.0 | AssertionError: x / y |" in text  # no cell split
    assert '| timing2 | ok | 2.0 | kernel_ms 0.5123; shape {"b": 128} |' in text
    (tmp_path / "headline" / "bench.md").write_text("| the full table |\n")
    text = session_report.render_summary("gpu", 100.0, 330.0, [], [], tmp_path)
    assert "| the full table |" in text and "cut short" not in text


def test_the_junit_plugin_writes_one_file_per_test_file_with_its_counts(tmp_path):
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_a.py").write_text(
        "import pytest\n"
        "def test_ok(): assert True\n"
        "def test_bad(): assert 1 == 2\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skipped(): pass\n"
    )
    (tests / "test_b.py").write_text("def test_ok(): assert True\n")
    junit = tmp_path / "junit"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "scripts"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "junit_per_file",
            "--junit-dir",
            str(junit),
            str(tests),
        ],
        cwd=tmp_path,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stdout
    assert sorted(p.name for p in junit.iterdir()) == ["test_a.xml", "test_b.xml"]
    a = ET.parse(junit / "test_a.xml").getroot()
    counts = (a.get("tests"), a.get("failures"), a.get("errors"), a.get("skipped"))
    assert counts == ("3", "1", "0", "1")
    assert "assert 1 == 2" in a.find("testcase[@name='test_bad']/failure").text
    assert a.find("testcase[@name='test_skipped']/skipped").get("message").endswith("not here")
    b = ET.parse(junit / "test_b.xml").getroot()
    assert (b.get("tests"), b.get("failures"), b.get("skipped")) == ("1", "0", "0")


def test_bad_usage_exits_2_and_writes_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke"],
        cwd=ROOT,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "set OUT or pass --out" in proc.stderr
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    proc, _ = run_script(out, "--cpu-smoke")
    assert proc.returncode == 2 and "is not empty (it holds 'mine.txt')" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    (out / "mine.txt").unlink()
    (out / "summary.md").write_text("an earlier run")  # one of its own names: kept too
    proc, _ = run_script(out, "--cpu-smoke")
    assert proc.returncode == 2 and (out / "summary.md").read_text() == "an earlier run"
    for args, words in (
        (["--deadline", "0"], "--deadline 0.0 must be > 0"),
        (["--only", "env,nope"], "unknown step(s) ['nope']"),
    ):
        proc, _ = run_script(tmp_path / "fresh", "--cpu-smoke", *args)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr
