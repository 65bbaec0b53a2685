"""Bring your own port (docs/conformance.md): the conformance runner, in a subprocess, on the
example backend `raggedspec.conformance.examples.buggy_backend` (the reference with masks that
forget
the dead prefix) fails exactly the rules that bug breaks and passes the others; the same
run on the reference passes. Unknown backends and unavailable devices exit 2."""

from __future__ import annotations

import pytest
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBSET = [
    "--tests",
    "conformance/test_backend.py",
    "conformance/test_end_to_end.py",
    "-k",
    "union_mask or advance or verify_first or generated_scenario or per_sequence_example",
]


def runner(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("RAGGEDSPEC_") and k != "HYPOTHESIS_PROFILE"
    }
    return subprocess.run(
        [sys.executable, "-m", "raggedspec.conformance.runner", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def table(stdout: str) -> dict[str, tuple[int, str]]:
    """The runner's per-rule table: rule -> (examples, result)."""
    out, started = {}, False
    for line in stdout.splitlines():
        if line.startswith("rule "):
            started = True
            continue
        if not started or line.startswith("---"):
            continue
        parts = line.rsplit(None, 2)
        if len(parts) == 3 and parts[1].isdigit():
            out[parts[0].strip()] = (int(parts[1]), parts[2])
    return out


MASK = "dead-prefix union mask, backend"
E2E = "end to end: the same scenario on two backends"
EXAMPLE = "the spec's worked examples end to end"
ADVANCE = "cohort and per-sequence advance arithmetic, backend"


@pytest.mark.rule("bring your own port")
def test_the_suite_names_the_rule_an_example_port_breaks():
    bad = runner(
        "--backend",
        "raggedspec.conformance.examples.buggy_backend:BuggyBackend",
        "--profile",
        "mutmut",
        *SUBSET,
    )
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-2000:]
    rows = table(bad.stdout)
    assert "backend buggy-example (cpu, float64)" in bad.stdout
    assert rows[MASK][1] == "FAIL" and rows[E2E][1] == "FAIL" and rows[EXAMPLE][1] == "FAIL"
    assert rows[ADVANCE] == (60, "pass")  # the mutmut profile: 60 examples
    assert (
        "Falsifying example" in bad.stdout
        or "@reproduce_failure" in bad.stdout
        or "Mismatch" in bad.stdout
    )
    good = runner("--backend", "numpy", "--profile", "mutmut", *SUBSET)
    assert good.returncode == 0, good.stdout[-3000:]
    rows = table(good.stdout)
    assert rows[MASK][1] == rows[E2E][1] == rows[EXAMPLE][1] == rows[ADVANCE][1] == "pass"


@pytest.mark.rule("bring your own port")
def test_unknown_backends_and_unavailable_devices_exit_2():
    missing = runner("--backend", "no_such_package.module:factory")
    assert missing.returncode == 2 and "cannot import 'no_such_package.module'" in missing.stderr
    numpy32 = runner("--backend", "numpy", "--dtype", "float32")
    assert numpy32.returncode == 2 and "float64 only" in numpy32.stderr
    import torch
    if not torch.cuda.is_available():
        cuda = runner("--device", "cuda")
        assert cuda.returncode == 2 and "CUDA is not available" in cuda.stderr


@pytest.mark.rule("raggedspec conformance and its per-rule table")
def test_the_runner_reads_example_counts_in_both_hypothesis_wordings():
    """Hypothesis reworded its statistics ("60 passing examples, 0 failing examples" became
    "60 passing, 0 failing, and 2 invalid test cases"); the per-rule table must count both,
    and must not count the shrink phase."""
    from raggedspec.conformance.runner import _examples

    old = (
        "t:\n  - during generate phase (1.3 seconds):\n    - 60 passing examples, 0 failing "
        "examples, "
        "2 invalid examples\n  - during shrink phase (0.1 seconds):\n    - 5 passing examples, 1 "
        "failing examples\n"
    )
    new = (
        "t:\n  - during reuse phase (0.1 seconds):\n    - 3 passing, 0 failing, and 0 invalid "
        "test cases\n"
        "  - during generate phase (1.5 seconds):\n    - 57 passing, 1 failing, and 2 invalid "
        "test cases\n"
    )
    assert _examples(old) == 60
    assert _examples(new) == 61
    assert _examples(None) is None
