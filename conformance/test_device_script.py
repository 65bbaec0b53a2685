"""The device script (scripts/gpu_session.py and .sh, its plan, step 0 and its reports), run
here on the CPU: the kernel under the g++ emulator, the CuPy checks skipped with their reason.
Its preflight's own tests: conformance/test_preflight.py.

- the plan: step 0, then the headline, then the rest by value; the kept steps fit the deadline
  with their whole caps (checked on a fake clock: no test reads the wall clock);
- step 0: a module that fails to import, or hangs, stops the run with one line (exit 5); a copy
  of the project's own modules from outside the checkout is refused; lost links come back;
- the outputs: results.json and summary.md rewritten after every step, at most the files the
  device returns, flat;
- a failed preflight check rules the CuPy steps out (exit 4); a preflight timeout is recorded
  as a timeout with the check it stopped in;
- a step over its limit, or the script stopped from outside, takes its children along;
- the offline install: a virtual environment without the project, holding only packages the
  GPU machine's Python has, with an old setuptools and pip barred from any index, runs the
  whole CPU smoke from a fresh copy of the checkout;
- the JUnit plugin's counts (also under pytest-xdist); bad usage exits 2 and writes nothing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from raggedspec.conformance.offline_venv import copy_checkout, decoy, offline_venv, venv_run
from raggedspec.gpu import kernel_emulator

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
SCRIPT = SCRIPTS / "gpu_session.py"
pytestmark = [
    pytest.mark.rule("GPU session script and raggedspec preflight"),
    pytest.mark.skipif(not SCRIPT.is_file(),
                       reason="needs the checkout's scripts/ (an installed raggedspec has none)"),
]
NO_GXX = kernel_emulator.compilers()["g++"] is None
needs_gxx = pytest.mark.skipif(NO_GXX, reason="the kernel emulator needs g++ on the PATH")
DEVICE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")  # names the device returns from $OUT


@pytest.fixture(scope="module")
def gs():
    """scripts/gpu_session.py as a module (its siblings import by their bare names)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_session
        import session_imports
        import session_plan
        import session_report

        yield gpu_session, session_plan, session_imports, session_report
    finally:
        sys.path.remove(str(SCRIPTS))
        for name in ("gpu_session", "session_plan", "session_report", "session_imports"):
            sys.modules.pop(name, None)


def run_script(out: Path, *args: str, env: dict | None = None, timeout: float = 300):
    """The shell wrapper with OUT=out, from outside the checkout; the completed process."""
    full_env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, **(env or {}))
    return subprocess.run(["bash", str(SCRIPTS / "gpu_session.sh"), *args], cwd=out.parent,
                          env=full_env, check=False, capture_output=True, text=True,
                          timeout=timeout)


def statuses(out: Path) -> dict[str, str]:
    return {r["step"]: r["status"] for r in json.loads((out / "results.json").read_text())["steps"]}


def assert_device_outputs(out: Path, gpu_session) -> None:
    """What the device returns from $OUT: at most 8 files, flat here, plain names."""
    files = sorted(p.name for p in out.iterdir())
    assert set(files) <= set(gpu_session.OUT_FILES) and len(files) <= 8, files
    assert all(DEVICE_NAME.match(f) and (out / f).is_file() for f in files), files


class FakeDevice:
    """Runs no command: a step takes `seconds[name]` (default 1) on a fake clock, or its whole
    limit and the kill grace when that is longer (it timed out); it exits `rc[name]` (default
    0) after writing `files[name]` into the work folder. Before each step it reads OUT's
    results.json: the steps it already lists."""

    def __init__(self, out: Path, seconds=None, rc=None, files=None, grace: float = 3.0):
        self.out, self.now, self.grace = out, 0.0, grace
        self.seconds, self.rc, self.files = seconds or {}, rc or {}, files or {}
        self.limits: dict[str, float] = {}
        self.seen_before: dict[str, list[str]] = {}

    def clock(self) -> float:
        return self.now

    def __call__(self, cmd, env, limit, log_file: Path):
        name = log_file.stem
        self.limits[name] = limit
        res = self.out / "results.json"
        done = json.loads(res.read_text())["steps"] if res.is_file() else []
        self.seen_before[name] = [r["step"] for r in done]
        for rel, text in self.files.get(name, {}).items():
            (log_file.parent / rel).write_text(text)
        log_file.write_text(f"{name} ran\n")
        took = self.seconds.get(name, 1.0)
        if took > limit:
            self.now += limit + self.grace
            return 124, True
        self.now += took
        return self.rc.get(name, 0), False


def fake_run(gs, tmp_path, mode="gpu", only=None, **fake):
    gpu_session, session_plan, *_ = gs
    out = tmp_path / "out"
    device = FakeDevice(out, grace=session_plan.KILL_GRACE, **fake)
    rc = gpu_session.run_plan(mode, out, session_plan.DEADLINE[mode], only, sys.executable,
                              clock=device.clock, execute=device)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handed back
    return rc, out, device


# --------------------------------------------------------------------------- the plan


@pytest.mark.rule("GPU session script and raggedspec preflight")
@pytest.mark.parametrize("mode", ["gpu", "cpu-smoke"])
def test_step_0_then_the_headline_then_the_conformance_then_flex(gs, tmp_path, mode):
    _, session_plan, *_ = gs
    steps = session_plan.plan(mode, tmp_path, "python3")
    names = [st.name for st in steps]
    assert names[:4] == ["imports", "headline", "env", "preflight"]
    conf = [i for i, n in enumerate(names) if n.startswith("conf_")]
    assert conf == list(range(4, 4 + len(conf))) and names.index("flex") == conf[-1] + 1
    head = steps[1].cmd
    assert head[head.index("--strategies") + 1] == "cupy,padded_sdpa,per_row"  # no compile
    assert head[head.index("--windows") + 1] == "2,4"
    if mode == "gpu":
        assert [head[head.index(f) + 1] for f in ("--batches", "--lengths", "--spreads")] == [
            "128", "4096", "64"]
    kernels = steps[names.index("conf_kernels_cupy")].cmd
    assert {"conformance/test_kernels_tc.py", "conformance/test_kernels.py"} <= set(kernels)
    assert "not emulate" in kernels[kernels.index("-k") + 1]


@pytest.mark.rule("GPU session script and raggedspec preflight")
@pytest.mark.parametrize("mode", ["gpu", "cpu-smoke"])
def test_the_kept_steps_get_their_whole_caps_even_when_every_step_uses_all_of_its(
        gs, tmp_path, mode):
    _, session_plan, *_ = gs
    steps = session_plan.plan(mode, tmp_path, "python3")
    kept = [st.name for st in steps if st.keep]
    assert kept == [st.name for st in steps[: len(kept)]]  # a prefix: the most valuable
    assert kept[-1] == "conf_port_torch"
    deadline = session_plan.DEADLINE[mode]
    assert session_plan.kept_seconds(steps) + session_plan.FINAL_RESERVE <= deadline
    caps = {st.name: st.cap for st in steps}
    # every step takes its whole cap; then every step but step 0 overruns it
    overrun = {n: (c if n == "imports" else 1e9) for n, c in caps.items()}
    for i, seconds in enumerate((caps, overrun)):
        _, out, device = fake_run(gs, tmp_path / f"run{i}", mode, seconds=seconds)
        assert {n: device.limits[n] for n in kept} == {n: caps[n] for n in kept}
        assert device.now <= deadline - session_plan.FINAL_RESERVE
        rows = statuses(out)
        assert list(rows) == list(caps)  # every step accounted for, in order
        cut = [n for n, s in rows.items() if s.startswith("skipped: needs >=")]
        assert cut and all(n not in kept for n in cut)
        assert all(f"{deadline:g} s deadline" in rows[n] for n in cut)


@pytest.mark.rule("GPU session script and raggedspec preflight")
def test_each_timeout_is_the_cap_clipped_to_the_time_left(gs, tmp_path):
    gpu_session, session_plan, *_ = gs
    out = tmp_path / "out"
    out.mkdir()
    now = [0.0]
    s = gpu_session.Run("gpu", out, 100.0, tmp_path, clock=lambda: now[0])
    grace, final = session_plan.KILL_GRACE, session_plan.FINAL_RESERVE
    step = session_plan.Step("x", ["true"], cap=60, what="", min_s=5)
    kept = session_plan.Step("k", ["true"], cap=20, what="", keep=True)
    now[0] = 10.0
    assert s.limit_for(step, []) == (60, None)  # 87 s left: the cap
    now[0] = 40.0
    assert s.limit_for(step, []) == (100 - 40 - final - grace, None)
    # a step that is not kept leaves the kept steps after it their caps and graces
    assert s.limit_for(step, [kept]) == (100 - 40 - final - grace - (20 + grace), None)
    assert s.limit_for(kept, [kept]) == (20, None)  # a kept step holds nothing back
    now[0] = 90.0
    limit, why = s.limit_for(step, [])
    assert limit == 0 and why.startswith("skipped: needs >= 5 s, 7 s left before the 100 s")


# --------------------------------------------------------------------------- the outputs


@pytest.mark.rule("GPU session script and raggedspec preflight")
def test_results_and_summary_are_rewritten_after_every_step(gs, tmp_path):
    gpu_session, session_plan, *_ = gs
    rc, out, device = fake_run(gs, tmp_path)
    names = [st.name for st in session_plan.plan("gpu", tmp_path, "python3")]
    assert rc == 0
    for i, name in enumerate(names):  # each step saw every earlier one in results.json
        assert device.seen_before[name] == names[:i]
    res = json.loads((out / "results.json").read_text())
    assert res["finished"] is True and res["exit_code"] == 0
    assert [r["status"] for r in res["steps"]] == ["ok"] * len(names)
    summary = (out / "summary.md").read_text()
    assert summary.index("## Headline") < summary.index("## Steps")
    assert "finished" in summary.splitlines()[0] and "exit 0" in summary.splitlines()[0]
    assert_device_outputs(out, gpu_session)


@pytest.mark.rule("GPU session script and raggedspec preflight")
def test_the_headline_table_shows_the_kernel_alone_and_the_wrappers_overhead(gs, tmp_path):
    session_report = gs[3]
    # 1 GB/s and 1e6 live bytes: the bound is exactly 1 ms
    row = {"w": 2, "B": 128, "L": 4096, "spread": 64, "live_kv_bytes": 1_000_000,
           "strategies": {"cupy": {"status": "ok", "ms": 1.5, "kernel_ms": 1.05,
                                   "wrapper_ms": 0.45},
                          "padded_sdpa": {"status": "ok", "ms": 3.0},
                          "per_row": {"status": "WRONG", "err": 0.3}}}
    bench = {"copy_bandwidth": [{"GBps": 0.5}, {"GBps": 1.0}], "rows": [row]}
    table = "\n".join(session_report.headline_section(bench))
    assert ("| 2 | 128 | 4096 | 64 | 1.0000 | 1.050 (1.05x) | 1.500 (1.50x) | 0.450 | "
            "3.000 (3.00x) | WRONG: err 0.3 |") in table
    assert "Not measured" in "\n".join(session_report.headline_section(None))
    md = tmp_path / "bench.md"
    line = "- headline w=2 (B=128, L=4096, spread 64; bound 0.5 ms): ... targets MET."
    md.write_text(f"| table |\n{line}\n- `cupy`: a strategy line\n")
    assert session_report.verdict_lines(md) == ["", line]
    assert session_report.verdict_lines(tmp_path / "absent.md") == []


@pytest.mark.rule("GPU session script and raggedspec preflight")
def test_a_bench_cut_short_still_shows_its_finished_cases_in_the_summary(gs):
    session_report = gs[3]
    rows = [{"w": 2, "B": 128, "L": 4096, "spread": 64,
             "strategies": {"flex": {"status": "ok", "ms": 0.5123},
                            "cupy": {"status": "WRONG", "err": 0.3}}},
            {"w": 4, "B": 128, "L": 4096, "spread": 64, "error": "OutOfMemoryError: ..."}]
    text = "\n".join(session_report.bench_rows_section("Flex", {"rows": rows}))
    assert "## Flex (cut short: the cases its JSON holds)" in text
    assert "- w=2 B=128 L=4096 spread=64: flex ok 0.512 ms, cupy WRONG" in text
    assert "- w=4 B=128 L=4096 spread=64: OutOfMemoryError: ..." in text
    pf = {"mode": "cupy", "failed": ["timing"], "not_run": [], "checks": [
        {"check": "timing", "status": "failed", "seconds": 1.0, "detail": "AssertionError: x | y"},
        {"check": "t2", "status": "ok", "seconds": 2.0,
         "detail": {"kernel_ms": 0.51234, "shape": {"b": 128}}}]}
    text = "\n".join(session_report.preflight_section(pf))
    assert "## Preflight (cupy): FAILED: timing; not run after it: none" in text
    assert "| timing | failed | 1.0 | AssertionError: x / y |" in text  # no cell split
    assert '| t2 | ok | 2.0 | kernel_ms 0.5123; shape {"b": 128} |' in text


# --------------------------------------------------------------------------- verdicts


@pytest.mark.rule("GPU session script and raggedspec preflight")
def test_a_failed_preflight_check_rules_the_cupy_steps_out_and_exits_4(gs, tmp_path):
    record = {"mode": "cupy", "failed": ["reference:float64"], "not_run": ["timing"],
              "running": None, "checks": []}
    rc, out, _ = fake_run(gs, tmp_path, rc={"preflight": 4},
                          files={"preflight": {"preflight.json": json.dumps(record)}})
    assert rc == 4
    rows = statuses(out)
    cupy = [n for n in rows if n in ("conf_kernels_cupy", "e2e_cupy") or n.startswith("conf_cupy")]
    assert len(cupy) == 5
    for name in cupy:
        assert rows[name] == ("skipped: the preflight's check reference:float64 failed: the CuPy "
                              "steps are not run")
    assert all(s == "ok" for n, s in rows.items() if n not in cupy + ["preflight"])


@pytest.mark.rule("GPU session script and raggedspec preflight")
def test_a_preflight_timeout_is_a_timeout_named_by_its_check_and_the_cupy_steps_run(gs, tmp_path):
    record = {"mode": "cupy", "failed": [], "running": "compile:bfloat16:G4:w2:d128",
              "checks": []}
    rc, out, _ = fake_run(gs, tmp_path, seconds={"preflight": 1e9},
                          files={"preflight": {"preflight.json": json.dumps(record)}})
    assert rc == 1  # a step did not finish; not 4: no check failed
    rows = statuses(out)
    assert rows["preflight"] == "timed out" and rows["conf_kernels_cupy"] == "ok"
    notes = json.loads((out / "results.json").read_text())["notes"]
    assert ("the preflight timed out while running compile:bfloat16:G4:w2:d128 (a timeout, not "
            "a failed check): the CuPy steps still run") in notes
    assert "stopped while running compile:bfloat16:G4:w2:d128" in (out / "summary.md").read_text()


@pytest.mark.rule("GPU session script and raggedspec preflight")
def test_a_failed_step_0_stops_the_run_with_its_one_line(gs, tmp_path, capsys):
    line = "step 0: cannot import torch: ModuleNotFoundError: No module named 'torch'"
    record = {"python": "3.12", "executable": "python3", "root": "/r", "modules": [],
              "importing": "torch", "failed": line}
    rc, out, device = fake_run(gs, tmp_path, rc={"imports": 1},
                               files={"imports": {"imports.json": json.dumps(record)}})
    assert rc == 5 and list(device.limits) == ["imports"]
    assert capsys.readouterr().err.strip() == f"gpu_session: {line}"
    assert list(statuses(out)) == ["imports"]
    assert f"FAILED: {line}" in (out / "summary.md").read_text()


# --------------------------------------------------------------------------- step 0, real


@pytest.mark.rule("GPU session script and raggedspec preflight")
def test_a_module_that_will_not_import_ends_the_run_at_step_0_with_one_line(tmp_path):
    site = decoy(tmp_path / "site", "numpy", "raise ImportError('no numpy on this machine')\n")
    out = tmp_path / "out"
    proc = run_script(out, "--cpu-smoke", env={"PYTHONPATH": str(site)})
    assert proc.returncode == 5, proc.stdout[-3000:]
    err = proc.stderr.strip().splitlines()
    assert err == ["gpu_session: step 0: cannot import numpy: ImportError: no numpy on this "
                   f"machine (Python {sys.executable})"]
    assert list(statuses(out)) == ["imports"]
    assert "FAILED: step 0: cannot import numpy" in (out / "summary.md").read_text()


@pytest.mark.rule("GPU session script and raggedspec preflight")
@pytest.mark.slow
def test_a_hanging_import_is_stopped_at_step_0s_limit_and_named(tmp_path):
    site = decoy(tmp_path / "site", "numpy", "import time\ntime.sleep(600)\n")
    out = tmp_path / "out"
    proc = run_script(out, "--cpu-smoke", "--deadline", "10", env={"PYTHONPATH": str(site)})
    assert proc.returncode == 5
    # 10 s - 3 (final collect) - 3 (kill grace): a 4 s limit
    assert proc.stderr.strip() == ("gpu_session: step 0: importing numpy did not finish within "
                                   "its 4 s")
    assert statuses(out) == {"imports": "timed out"}


@pytest.mark.rule("GPU session script and raggedspec preflight")
def test_the_projects_modules_must_come_from_the_checkout(gs, tmp_path):
    session_imports = gs[2]
    site = decoy(tmp_path / "site", "shadowpkg", "")
    sys.path.insert(0, str(site))
    try:
        with pytest.raises(session_imports.StepZeroFailed, match="an installed copy shadows it"):
            session_imports.import_one("shadowpkg", True, {}, tmp_path / "rec.json")
        row = session_imports.import_one("shadowpkg", False, {}, tmp_path / "rec.json")
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("shadowpkg", None)
    assert row["file"] == str(site / "shadowpkg" / "__init__.py")
    assert json.loads((tmp_path / "rec.json").read_text())["importing"] == "shadowpkg"
    own = session_imports.import_one("raggedspec.reference.attention", True, {},
                                     tmp_path / "rec.json")
    assert Path(own["file"]).resolve().is_relative_to(ROOT.resolve())


@pytest.mark.rule("GPU session script and raggedspec preflight")
def test_a_copy_that_lost_its_links_gets_them_back(gs, tmp_path):
    gpu_session, *_ = gs
    for name in gpu_session.LINKS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.py").write_text("")
    (tmp_path / "raggedspec").mkdir()
    (tmp_path / "raggedspec" / "gpu").symlink_to("../gpu")
    (tmp_path / "raggedspec" / "docs").symlink_to("../nowhere")  # dangling
    notes = gpu_session.ensure_links(tmp_path)
    assert len(notes) == len(gpu_session.LINKS) - 1 and "raggedspec/docs" in " ".join(notes)
    for name in gpu_session.LINKS:
        link = tmp_path / "raggedspec" / name
        assert os.readlink(link) == f"../{name}" and (link / "x.py").is_file()
    assert gpu_session.ensure_links(tmp_path) == []


# --------------------------------------------------------------------------- processes


@pytest.mark.rule("GPU session script and raggedspec preflight")
@pytest.mark.slow
def test_a_step_over_its_limit_is_killed_with_its_children(gs, tmp_path):
    gpu_session, session_plan, *_ = gs
    out = tmp_path / "out"
    out.mkdir()
    s = gpu_session.Run("cpu-smoke", out, 100.0, tmp_path)
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(120)")
    step = session_plan.Step("sleeper", [sys.executable, "-c", code], cap=2, min_s=1, what="")
    assert s.run_step(step, dict(os.environ), []) == 124 and s.rows[-1]["status"] == "timed out"
    child = Path(f"/proc/{int(pid_file.read_text())}/stat")
    # gone, or a zombie (dead, waiting for a parent that reaps it)
    assert not child.exists() or child.read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.rule("GPU session script and raggedspec preflight")
@pytest.mark.slow
def test_a_script_stopped_from_outside_takes_its_running_step_along(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--cpu-smoke", "--only", "conf_port_torch", "--out",
           str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    work = proc.stdout.readline().split("work folder ", 1)[1].split(",", 1)[0]
    for line in proc.stdout:  # until the pytest step is started
        if "=== conf_port_torch (timeout" in line:
            break
    for _ in range(300):  # and its process is there
        if running_in(work):
            break
        time.sleep(0.1)
    assert running_in(work), "the step's pytest never showed up"
    proc.terminate()
    assert proc.wait(timeout=30) == 128 + 15
    assert "the script was stopped by signal 15" in (out / "summary.md").read_text()
    assert running_in(work) == []


def running_in(work: str) -> list[str]:
    """The live (not zombie) pytest processes whose command line names the work folder."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if work in text and "pytest" in text and state != "Z":
            found.append(text)
    return found


# --------------------------------------------------------------------------- the preflight

WRONG_KERNEL = """\
import raggedspec.gpu.cupy_kernels as _ck
_real = _ck.ragged_verify_attention_emulated
def _wrong(q, k, v, lens):
    return _real(q, k, v, lens) * 1.5     # a kernel that computes the wrong numbers
_ck.ragged_verify_attention_emulated = _wrong
"""


@pytest.mark.rule("GPU session script and raggedspec preflight")
@needs_gxx
@pytest.mark.slow
def test_a_wrong_kernel_fails_the_headline_and_the_preflight_and_rules_out_the_cupy_steps(
        tmp_path):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(WRONG_KERNEL)  # loaded by every step's Python
    out = tmp_path / "out"
    proc = run_script(out, "--cpu-smoke", "--only", "headline,preflight,conf_cupy_float64,e2e_cupy",
                      env={"PYTHONPATH": str(inject)})
    assert proc.returncode == 4, proc.stdout[-3000:]
    rows = statuses(out)
    assert list(rows) == ["imports", "headline", "preflight", "conf_cupy_float64", "e2e_cupy"]
    assert rows["preflight"] == "failed (exit 4)"
    assert rows["headline"] == "failed (exit 1)"  # the bench checks the kernel before timing it
    for name in ("conf_cupy_float64", "e2e_cupy"):
        assert rows[name].startswith("skipped: the preflight's check reference:float64 failed")
    res = json.loads((out / "results.json").read_text())
    head = res["outputs"]["headline"]
    assert all(r["strategies"]["cupy"]["status"] == "WRONG" for r in head["rows"])
    assert all(r["strategies"]["padded_sdpa"]["status"] == "ok" for r in head["rows"])
    pf = res["outputs"]["preflight"]
    assert pf["failed"] == ["reference:float64"]
    assert pf["not_run"] == ["reference:float32", "reference:bfloat16", "timing"]


# --------------------------------------------------------------------------- plugin, usage

JUNIT_TESTS = {
    "test_a.py": ("import pytest\n"
                  "def test_ok(): assert True\n"
                  "def test_bad(): assert 1 == 2\n"
                  "@pytest.mark.skip(reason='not here')\n"
                  "def test_skipped(): pass\n"),
    "test_b.py": "def test_ok(): assert True\n",
}


def run_junit(tmp_path: Path, *extra: str) -> Path:
    tests = tmp_path / "t"
    tests.mkdir()
    for name, text in JUNIT_TESTS.items():
        (tests / name).write_text(text)
    junit = tmp_path / "junit"
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *extra, "-p", "junit_per_file", "--junit-dir", str(junit), str(tests)],
                          cwd=tmp_path, env=env, check=False, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stdout
    return junit


def assert_junit_counts(junit: Path) -> None:
    assert sorted(p.name for p in junit.iterdir()) == ["test_a.xml", "test_b.xml"]
    a = ET.parse(junit / "test_a.xml").getroot()
    assert (a.get("tests"), a.get("failures"), a.get("errors"), a.get("skipped")) == (
        "3", "1", "0", "1")
    assert "assert 1 == 2" in a.find("testcase[@name='test_bad']/failure").text
    assert a.find("testcase[@name='test_skipped']/skipped").get("message").endswith("not here")
    b = ET.parse(junit / "test_b.xml").getroot()
    assert (b.get("tests"), b.get("failures"), b.get("skipped")) == ("1", "0", "0")


@pytest.mark.rule("GPU session script and raggedspec preflight")
def test_the_junit_plugin_writes_one_file_per_test_file_with_its_counts(tmp_path):
    assert_junit_counts(run_junit(tmp_path))


@pytest.mark.rule("GPU session script and raggedspec preflight")
@pytest.mark.slow
def test_under_xdist_the_junit_plugin_writes_the_workers_results_once(tmp_path):
    pytest.importorskip("xdist", reason="pytest-xdist is not installed")
    assert_junit_counts(run_junit(tmp_path, "-n", "2"))


@pytest.mark.rule("GPU session script and raggedspec preflight")
def test_bad_usage_exits_2_and_writes_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke"], cwd=ROOT, env=env,
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "set OUT or pass --out" in proc.stderr
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    proc = run_script(out, "--cpu-smoke")
    assert proc.returncode == 2 and "is not empty (it holds 'mine.txt')" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    (out / "mine.txt").unlink()
    (out / "summary.md").write_text("an earlier run")  # one of its own names: kept too
    proc = run_script(out, "--cpu-smoke")
    assert proc.returncode == 2 and (out / "summary.md").read_text() == "an earlier run"
    for args, words in ((["--deadline", "0"], "--deadline 0.0 must be > 0"),
                        (["--only", "env,nope"], "unknown step(s) ['nope']")):
        proc = run_script(tmp_path / "fresh", "--cpu-smoke", *args)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr
        assert not (tmp_path / "fresh").exists()


# --------------------------------------------------------------------------- offline install

@pytest.mark.rule("GPU session script and raggedspec preflight")
@needs_gxx
@pytest.mark.slow
def test_the_cpu_smoke_runs_offline_from_a_fresh_copy_in_a_venv_without_the_project(
        gs, tmp_path):
    """The GPU machine as far as this one can play it: a Python whose packages are the
    device's (torch, numpy, pytest, xdist, hypothesis, matplotlib, tqdm, safetensors, linked
    from this machine's installs), an old setuptools (65.5), no raggedspec installed but a
    decoy that would break any import that reached it, pip barred from every index
    (PIP_NO_INDEX=1), the script run through its shell wrapper from a fresh copy of the
    checkout. Not simulated: Python 3.12, torch 2.11 with CUDA and CuPy 14 (this machine has
    none of them; the CuPy steps run the g++ emulator or skip with their reason), the
    device's own setuptools, and its missing network (pip is only barred here)."""
    gpu_session, session_plan, *_ = gs
    py = offline_venv(tmp_path / "venv")
    assert venv_run(py, "import setuptools; print(setuptools.__version__)").startswith("65.")
    with pytest.raises(subprocess.CalledProcessError):  # the project is not installed
        venv_run(py, "import importlib.metadata as m; m.distribution('raggedspec')")
    copy = tmp_path / "checkout"
    copy_checkout(copy)
    out = tmp_path / "out"
    env = {"PATH": f"{py.parent}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path),
           "PIP_NO_INDEX": "1", "PYTHONNOUSERSITE": "1", "OUT": str(out), "PYTHON": str(py),
           "VIRTUAL_ENV": str(py.parents[1]), "LANG": "C.UTF-8"}
    proc = subprocess.run(["bash", str(copy / "scripts" / "gpu_session.sh"), "--cpu-smoke"],
                          cwd=tmp_path, env=env, check=False, capture_output=True, text=True,
                          timeout=600)
    res = json.loads((out / "results.json").read_text())
    rows = {r["step"]: r["status"] for r in res["steps"]}
    planned = [st.name for st in session_plan.plan("cpu-smoke", tmp_path, str(py))]
    assert list(rows) == planned, proc.stdout[-3000:]
    assert rows["imports"] == "ok" and rows["headline"] == "ok", proc.stdout[-3000:]
    # the rest passed, or was cut by the plan's own limits (a clipped timeout, or skipped)
    for name, status in rows.items():
        assert status in ("ok", "timed out") or status.startswith("skipped: needs >="), (
            name, status, proc.stdout[-3000:])
    assert proc.returncode == (0 if set(rows.values()) <= {"ok"} else 1), proc.stderr
    imports = res["outputs"]["imports"]
    assert imports["executable"] == str(py) and imports["failed"] is None
    for row in imports["modules"]:
        if row["module"].startswith("raggedspec") or row["module"].startswith(("junit", "sess")):
            assert Path(row["file"]).resolve().is_relative_to(copy.resolve()), row
    head = res["outputs"]["headline"]
    assert set(head["strategies"]) == {"cupy", "padded_sdpa", "per_row"}
    for row in head["rows"]:
        cupy = row["strategies"]["cupy"]
        assert cupy["status"] == "ok" and cupy["kernel_ms"] > 0
        assert cupy["wrapper_ms"] == pytest.approx(cupy["ms"] - cupy["kernel_ms"])
    assert res["finished"] is True and res["exit_code"] == proc.returncode
    assert_device_outputs(out, gpu_session)
    summary = (out / "summary.md").read_text()
    assert summary.index("## Headline") < summary.index("## Steps")
