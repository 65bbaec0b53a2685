"""mutmut over the rule modules and the checkers, read back per module and gated.

mutmut itself does the work (`[tool.mutmut]` in pyproject.toml): it keeps its results in
`mutants/`, re-tests only the functions whose source changed, and runs each mutant against the
tests that reached its function. Two scopes: *all* is pyproject's own (`only_mutate` /
`do_not_mutate`, the whole default suite as the test selection; a plain `mutmut run` is the
same run), *gate* is the CI's, `reference/dispatch.py` with its topic tests. A run's scope is
set on mutmut's configuration before its `run` starts (a different scope resets mutmut's
results, as any change of its test selection does). A module passes with a score of at least
95% and no survivor: an equivalent mutant is marked where it stands, `# pragma: no mutate` on
its line with the reason, so it is never generated.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import raggedspec

THRESHOLD = 95.0
GATE_MODULE = "raggedspec/reference/dispatch.py"
GATE_TESTS = ["raggedspec/conformance/test_dispatch.py"]
KILLED = ("killed", "timeout", "segfault")  # segfault: mutmut's name for a SIGKILL past the limit
BOOT = """import json, sys
import mutmut.__main__ as m
from mutmut.configuration import config
o = json.loads(sys.argv[1])
cfg = config()
if o["only"] is not None:
    cfg.only_mutate, cfg.do_not_mutate = o["only"], []
if o["tests"] is not None:
    cfg.pytest_add_cli_args_test_selection = o["tests"]
m._run(o["names"], o["jobs"])
"""


class MutmutUnavailable(RuntimeError):
    """mutmut cannot run here: not installed, or not a checkout with [tool.mutmut]."""


def checkout() -> Path:
    """The checkout whose pyproject.toml configures mutmut (the package folder's parent)."""
    root = Path(raggedspec.__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file() or "tool" not in _pyproject(root):
        raise MutmutUnavailable("mutmut runs from a checkout of raggedspec (its pyproject.toml "
                                "configures it); this is an installed package")
    return root


def _pyproject(root: Path) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text())


def configured_scope(root: Path) -> tuple[list[str], list[str]]:
    """(only_mutate, do_not_mutate) globs of pyproject's [tool.mutmut]."""
    cfg = _pyproject(root)["tool"]["mutmut"]
    return cfg.get("only_mutate", []), cfg.get("do_not_mutate", [])


def in_scope(path: str, only: list[str], skip: list[str]) -> bool:
    """Whether mutmut mutates `path` under these globs (its own rule: fnmatch on the path)."""
    return any(fnmatch.fnmatch(path, p) for p in only) and not any(
        fnmatch.fnmatch(path, p) for p in skip)


def run(root: Path, only: list[str] | None, tests: list[str] | None, jobs: int,
        names: tuple[str, ...] = (), progress=None) -> float:
    """`mutmut run` in `root` with its scope set as given (None: pyproject's); returns the
    wall seconds. mutmut's own output goes to `mutants/mutmut-run.log`; `progress(done,
    total)` follows its mutant count as it runs."""
    if subprocess.run([sys.executable, "-c", "import mutmut"], capture_output=True).returncode:
        raise MutmutUnavailable("mutmut is not installed: pip install 'raggedspec[mutation]'")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONDONTWRITEBYTECODE="1")
    options = json.dumps({"only": only, "tests": tests, "jobs": jobs, "names": list(names)})
    log = root / "mutants" / "mutmut-run.log"  # its spinner frames, kept out of the console
    log.parent.mkdir(exist_ok=True)
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", BOOT, options], cwd=root, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(2.0)
            if progress is not None and (count := last_count(log)):
                progress(*count)
    if proc.returncode:
        tail = "\n".join(log.read_text(errors="replace").replace("\r", "\n").splitlines()[-25:])
        raise MutmutUnavailable(f"mutmut stopped with exit {proc.returncode} ({log}; its last "
                                f"lines below): the unmutated tests must pass first\n{tail}")
    return time.monotonic() - start


def last_count(log: Path) -> tuple[int, int] | None:
    """The last `done/total` mutant count mutmut's spinner wrote to `log`."""
    with log.open("rb") as f:
        f.seek(max(0, log.stat().st_size - 4096))
        found = re.findall(rb"(\d+)/(\d+) ", f.read())
    return (int(found[-1][0]), int(found[-1][1])) if found else None


@dataclass
class ModuleScore:
    module: str  # the path mutmut mutated, e.g. raggedspec/reference/dispatch.py
    counts: Counter = field(default_factory=Counter)
    seconds: float = 0.0  # the sum of its mutants' test runs

    @property
    def mutants(self) -> int:
        return sum(self.counts.values()) - self.counts["skipped"]

    @property
    def score(self) -> float:
        killed = sum(self.counts[k] for k in KILLED)
        return 100.0 * killed / self.mutants if self.mutants else 0.0

    @property
    def open(self) -> int:
        """Mutants neither killed nor skipped: survivors, untested, unchecked, suspicious."""
        return self.mutants - sum(self.counts[k] for k in KILLED)

    def passed(self, threshold: float = THRESHOLD) -> bool:
        return self.mutants > 0 and self.score >= threshold and self.open == 0


def status(code: int | None) -> str:
    """mutmut's status name for a mutant's recorded exit code (its own table)."""
    from mutmut.stats import status_by_exit_code

    return status_by_exit_code[code]


def scores(root: Path, modules: list[str]) -> list[ModuleScore]:
    """Per module of `modules`, its mutants' statuses from mutmut's `mutants/*.meta` files."""
    out = []
    for module in modules:
        meta = root / "mutants" / (module + ".meta")
        got = ModuleScore(module)
        if meta.is_file():
            data = json.loads(meta.read_text())
            got.counts.update(status(c) for c in data["exit_code_by_key"].values())
            got.seconds = sum(data.get("durations_by_key", {}).values())
        out.append(got)
    return out


def survivors(root: Path, module: str) -> list[str]:
    """The names of a module's mutants that are not killed (for `mutmut show NAME`)."""
    meta = root / "mutants" / (module + ".meta")
    codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.is_file() else {}
    return sorted(k for k, c in codes.items() if status(c) not in KILLED + ("skipped",))


def scope_modules(root: Path, scope: str, modules: list[str]) -> list[str]:
    """The modules a run covers: the gate's, the given ones, or every module pyproject's
    globs select, as mutmut names them (paths under raggedspec/)."""
    if scope == "gate":
        return [GATE_MODULE]
    only, skip = configured_scope(root)
    found = sorted(
        Path(folder, name).relative_to(root).as_posix()
        for folder, _, names in os.walk(root / "raggedspec", followlinks=True)
        for name in names if name.endswith(".py"))
    found = [m for m in found if in_scope(m, only, skip)]
    return [m for m in found if m in modules] if modules else found
