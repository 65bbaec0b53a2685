"""A pytest plugin: one JUnit XML per test file, rewritten after every test of that file, so a
run killed part-way (the GPU run script's deadline) keeps the results of every test that
finished. Load it with `-p junit_per_file` (this folder on PYTHONPATH) and name the folder:

    python -m pytest -p junit_per_file --junit-dir out/junit conformance/test_masks.py

Each file `test_x.py` gives `<junit-dir>/test_x.xml`: one `<testsuite>` (tests, failures,
errors, skipped, time) of `<testcase>`s, a failure or error with pytest's long report, a skip
with its reason. Without `--junit-dir` the plugin does nothing. Under pytest-xdist (`-n N`) the
controller writes the files from its workers' reports.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--junit-dir", default=None, help="write one JUnit XML per test file into this folder"
    )


class _PerFile:
    """Outcomes per test file; `record` rewrites that file's XML."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files: dict[str, dict[str, dict]] = {}
        folder.mkdir(parents=True, exist_ok=True)

    def record(self, report) -> None:
        path = report.nodeid.split("::", 1)[0]
        cases = self.files.setdefault(path, {})
        case = cases.setdefault(report.nodeid, {"outcome": "passed", "time": 0.0, "text": ""})
        case["time"] += float(getattr(report, "duration", 0.0))
        if report.when == "call" or report.outcome != "passed":
            if report.outcome == "failed":
                case["outcome"] = "failed" if report.when == "call" else "error"
                case["text"] = str(report.longrepr)[-20000:]
            elif report.outcome == "skipped":
                case["outcome"] = "skipped"
                reason = (
                    report.longrepr[2]
                    if isinstance(report.longrepr, tuple)
                    else str(report.longrepr)
                )
                case["text"] = str(reason)
        if report.when == "teardown":
            self.write(path)

    def write(self, path: str) -> None:
        cases = self.files[path]
        counts = {
            o: sum(c["outcome"] == o for c in cases.values())
            for o in ("failed", "error", "skipped")
        }
        suite = ET.Element(
            "testsuite",
            name=path,
            tests=str(len(cases)),
            failures=str(counts["failed"]),
            errors=str(counts["error"]),
            skipped=str(counts["skipped"]),
            time=f"{sum(c['time'] for c in cases.values()):.3f}",
        )
        for nodeid, c in cases.items():
            el = ET.SubElement(
                suite,
                "testcase",
                classname=path,
                name=nodeid.split("::", 1)[-1],
                time=f"{c['time']:.3f}",
            )
            if c["outcome"] in ("failed", "error", "skipped"):
                tag = {"failed": "failure", "error": "error", "skipped": "skipped"}[c["outcome"]]
                sub = ET.SubElement(
                    el, tag, message=c["text"].splitlines()[-1][:500] if c["text"] else ""
                )
                sub.text = c["text"]
        target = self.folder / (Path(path).stem + ".xml")
        tmp = target.with_name(target.name + ".tmp")
        ET.ElementTree(suite).write(tmp, encoding="utf-8", xml_declaration=True)
        tmp.replace(target)


def pytest_configure(config) -> None:
    """Register the writer in the session that reports: the only one, or under pytest-xdist
    the controller (which receives every worker's reports), never in a worker."""
    folder = config.getoption("--junit-dir")
    if folder and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_PerFileHook(_PerFile(Path(folder))), "junit_per_file_writer")


class _PerFileHook:
    def __init__(self, writer: _PerFile) -> None:
        self.writer = writer

    def pytest_runtest_logreport(self, report) -> None:
        self.writer.record(report)
