"""`raggedspec conformance` (conformance/runner.py) and bringing your own port
(docs/conformance.md): the runner, in a child process, on the example backend
`raggedspec.conformance.examples.buggy_backend` (the reference with masks that forget the
dead prefix) fails exactly the rules that bug breaks and passes the others, and the same run
on the reference passes; an end-to-end failure blames the rule of its first differing
tensor; options it does not know go to pytest (-v, --junitxml, -n, --lf); a -k matching
nothing, a missing path, an unknown backend or an unavailable device exit 2; a backend
factory that raises exits 1 with its traceback; a backend module in the working folder is
found."""

from __future__ import annotations

import pytest

from raggedspec.conformance.helpers import PACKAGE, TRACEBACK, console_script, run_module, write
from raggedspec.conformance.runner import E2E_RULE, NO_RULE, _examples, rule_table

TABLE_RULE = "raggedspec conformance and its per-rule table"
SUBSET = ["--tests", "conformance/test_backend.py", "conformance/test_end_to_end.py", "-k",
          "union_mask or rope_positions or verify_first or generated_scenario "
          "or per_sequence_example"]
MASKS = ["--backend", "numpy", "--profile", "short", "--tests", "conformance/test_masks.py",
         "-k", "union or left_padded"]
MASK = "dead-prefix union mask, backend"
E2E = "end to end: the same scenario on two backends"
EXAMPLE = "the spec's worked examples end to end"
ROPE = "RoPE positions and rotation, backend"


def table(stdout: str) -> dict[str, tuple[int, str]]:
    """The runner's per-rule table: rule -> (examples, result)."""
    out, started = {}, False
    for line in stdout.splitlines():
        if line.startswith("rule "):
            started = True
            continue
        if not started or line.startswith("---"):
            continue
        if " rows: " in line and line.split()[0].isdigit():  # the summary line ends the table
            break
        parts = line.rsplit(None, 2)
        if len(parts) == 3 and parts[1].isdigit():
            out[parts[0].strip()] = (int(parts[1]), parts[2])
    return out


# ------------------------------------------------------------------------ the rule table


@pytest.mark.rule(TABLE_RULE)
def test_rule_table_fails_the_rules_a_failed_test_carries_or_the_tensor_it_names():
    mask, rope = "dead-prefix union mask, backend", "RoPE positions and rotation, backend"
    rules = [mask, rope, E2E_RULE]
    ok = {"outcome": "passed", "examples": 2}
    results = {
        "t_mask": dict(ok, rules=[mask]),
        "t_rope": dict(ok, rules=[rope]),
        "t_e2e": {"outcome": "failed", "examples": 1, "rules": [E2E_RULE], "blame": rope},
    }
    got = {rule: (n, result) for rule, n, result in rule_table(results, rules)}
    assert got == {mask: (2, "pass"), rope: (2, "FAIL"), E2E_RULE: (1, "FAIL")}
    del results["t_e2e"]["blame"]  # no tensor named: only the rules the test carries fail
    got = {rule: result for rule, _, result in rule_table(results, rules)}
    assert got == {mask: "pass", rope: "pass", E2E_RULE: "FAIL"}
    results["t_mask"]["outcome"] = "failed"  # a failed test fails every rule it carries
    assert dict((r, x) for r, _, x in rule_table(results, rules))[mask] == "FAIL"
    results = {"t": dict(ok, rules=[]), "u": dict(ok, rules=["a rule the table lacks"]),
               "s": {"outcome": "skipped", "examples": 0, "rules": [rope]}}
    got = {rule: result for rule, _, result in rule_table(results, [mask, rope])}
    assert got == {mask: "not run", rope: "skipped", NO_RULE: "pass",
                   "a rule the table lacks": "pass"}


@pytest.mark.rule(TABLE_RULE)
def test_the_runner_reads_example_counts_in_both_hypothesis_wordings():
    """Hypothesis reworded its statistics ("60 passing examples, 0 failing examples" became
    "60 passing, 0 failing, and 2 invalid test cases"); the per-rule table must count both,
    and must not count the shrink phase."""
    old = ("t:\n  - during generate phase (1.3 seconds):\n    - 60 passing examples, 0 failing "
           "examples, 2 invalid examples\n  - during shrink phase (0.1 seconds):\n    - 5 "
           "passing examples, 1 failing examples\n")
    new = ("t:\n  - during reuse phase (0.1 seconds):\n    - 3 passing, 0 failing, and 0 invalid "
           "test cases\n  - during generate phase (1.5 seconds):\n    - 57 passing, 1 failing, "
           "and 2 invalid test cases\n")
    assert _examples(old) == 60
    assert _examples(new) == 61
    assert _examples(None) is None


# --------------------------------------------------------------------- your own port


@pytest.mark.slow
@pytest.mark.rule("bring your own port")
def test_the_suite_names_the_rule_an_example_port_breaks():
    bad = run_module("conformance", "--backend",
                     "raggedspec.conformance.examples.buggy_backend:BuggyBackend",
                     "--profile", "mutmut", *SUBSET)
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-2000:]
    rows = table(bad.stdout)
    assert "backend buggy-example (cpu, float64)" in bad.stdout
    assert rows[MASK][1] == "FAIL" and rows[E2E][1] == "FAIL" and rows[EXAMPLE][1] == "FAIL"
    assert rows[ROPE] == (60, "pass")  # the mutmut profile: 60 examples
    assert ("Falsifying example" in bad.stdout or "@reproduce_failure" in bad.stdout
            or "Mismatch" in bad.stdout)
    good = run_module("conformance", "--backend", "numpy", "--profile", "mutmut", *SUBSET)
    assert good.returncode == 0, good.stdout[-3000:]
    rows = table(good.stdout)
    assert rows[MASK][1] == rows[E2E][1] == rows[EXAMPLE][1] == rows[ROPE][1] == "pass"


@pytest.mark.slow
@pytest.mark.rule(TABLE_RULE)
def test_an_end_to_end_failure_blames_the_rule_of_its_first_differing_tensor():
    """A port that rotates every row at row 0's offset: the RoPE row fails, the union-mask row
    (which also lists the failing end-to-end test) passes, and the failure is named."""
    p = run_module("conformance", "--backend", "conformance.examples.rope_row0:factory",
                   "--profile", "ci", "--tests", "conformance/test_backend.py",
                   "conformance/test_end_to_end.py", "-k",
                   "rope_positions_and_rotation or union_mask_matches or per_sequence_example")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    rows = {ln.rsplit(None, 2)[0].strip(): ln.split()[-1] for ln in p.stdout.splitlines()
            if ln.endswith(("  pass", "  FAIL"))}
    rope = next(r for r in rows if r.startswith("RoPE positions and rotation, backend"))
    mask = next(r for r in rows if r.startswith("dead-prefix union mask, backend"))
    assert rows[rope] == "FAIL" and rows[mask] == "pass", rows
    blame = [ln for ln in p.stdout.splitlines() if ln.startswith("blamed: ")]
    assert len(blame) == 1 and "rope_positions" in blame[0]
    assert "RoPE positions and rotation" in blame[0]


@pytest.mark.slow
@pytest.mark.rule("bring your own port")
def test_unknown_backends_and_unavailable_devices_exit_2():
    missing = run_module("conformance", "--backend", "no_such_package.module:factory")
    assert missing.returncode == 2 and "cannot import 'no_such_package.module'" in missing.stderr
    numpy32 = run_module("conformance", "--backend", "numpy", "--dtype", "float32")
    assert numpy32.returncode == 2 and "float64 only" in numpy32.stderr
    import torch
    if not torch.cuda.is_available():
        cuda = run_module("conformance", "--device", "cuda")
        assert cuda.returncode == 2 and "CUDA is not available" in cuda.stderr


@pytest.mark.slow
@pytest.mark.rule("bring your own port")
def test_a_backend_factory_that_raises_exits_1_with_its_traceback(tmp_path):
    """The factory's exception is the run's failure, blamed on it, never an internal error;
    and a backend module beside the user is found from the console script."""
    work = tmp_path / "work"
    work.mkdir()
    write(work / "rs_port.py", "from raggedspec.reference.backend import NumpyBackend\n"
                               "def good(**kw):\n    return NumpyBackend(**kw)\n"
                               "def broken(**kw):\n    raise RuntimeError('no device found')\n")
    run = console_script(tmp_path)
    done = run("conformance", "--backend", "rs_port:broken", cwd=work)
    assert done.returncode == 1 and TRACEBACK in done.stderr, done.stderr
    assert "raised by your backend 'rs_port:broken'" in done.stderr
    assert "no device found" in done.stderr and "internal error" not in done.stderr
    done = run("conformance", "--backend", "rs_port:good", "--profile", "short", "--tests",
               PACKAGE / "conformance" / "test_masks.py", "-k", "union or left_padded", cwd=work)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


# ------------------------------------------------------------- options, selections, paths


@pytest.mark.slow
@pytest.mark.rule(TABLE_RULE)
def test_a_missing_path_or_an_empty_selection_exits_2():
    p = run_module("conformance", "--backend", "numpy", "--tests", "conformance/no_such_test.py")
    assert p.returncode == 2 and "--tests conformance/no_such_test.py" in p.stderr
    assert "INTERNALERROR" not in p.stdout
    p = run_module("conformance", "--backend", "numpy", "--tests", "conformance/test_rope.py",
                   "-k", "no_such_name")
    assert p.returncode == 2 and "no test selected" in p.stderr and "no_such_name" in p.stderr
    # found by the collection alone, before the suite is run: no table, no pytest summary
    assert "rows:" not in p.stdout and "pytest exit" not in p.stderr


@pytest.mark.slow
@pytest.mark.rule(TABLE_RULE)
def test_options_it_does_not_know_go_to_pytest(tmp_path):
    xml = tmp_path / "junit.xml"
    p = run_module("conformance", *MASKS, "-v", f"--junitxml={xml}")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "PASSED" in p.stdout  # -v reached pytest
    assert xml.is_file() and "<testcase" in xml.read_text()
    rows = table(p.stdout)
    assert rows and all(result == "pass" for _, result in rows.values())
    p = run_module("conformance", *MASKS, "--no-such-pytest-option")
    assert p.returncode == 2 and "pytest refused the options --no-such-pytest-option" in p.stderr


@pytest.mark.slow
@pytest.mark.rule(TABLE_RULE)
def test_the_rule_table_works_under_xdist_and_the_cache_options(tmp_path):
    pytest.importorskip("xdist", reason="pytest-xdist (the mutation extra) is not installed")
    alone = table(run_module("conformance", *MASKS).stdout)
    p = run_module("conformance", *MASKS, "-n", "2")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert table(p.stdout) == alone and alone  # the same rules and example counts
    cache = tmp_path / "cache"
    p = run_module("conformance", *MASKS, "--lf", XDG_CACHE_HOME=str(cache))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert (cache / "raggedspec" / "pytest").is_dir()  # the cache kept out of the package
