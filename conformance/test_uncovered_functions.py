"""`scripts/uncovered_functions.py`: which functions a coverage run never executed (the probe
is the first statement after the docstring), and a clear refusal of a missing data file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "uncovered_functions.py"
pytestmark = pytest.mark.skipif(
    not SCRIPT.is_file(), reason="needs the checkout's scripts/ (an installed raggedspec has none)"
)
if SCRIPT.is_file():
    _spec = importlib.util.spec_from_file_location("uncovered_functions", SCRIPT)
    tool = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(tool)

SOURCE = '''def ran():
    """doc"""
    return 1


class K:
    def never(self):
        return (
            2
        )

    def only_doc(self):
        """nothing else"""


def outer():
    def inner():
        return 3
    return inner
'''


@pytest.mark.rule("scripts/uncovered_functions.py")
def test_a_function_whose_first_statement_never_ran_is_listed(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    # lines: 3 (ran's return), 17 (outer's def inner), 19 (outer's return)
    assert tool.never_executed(path, {3, 17, 19}) == ["K.never", "K.only_doc", "outer.inner"]
    assert tool.never_executed(path, {3, 9, 12, 17, 18}) == []


@pytest.mark.rule("scripts/uncovered_functions.py")
def test_a_missing_data_file_is_refused_with_its_name(tmp_path, capsys):
    missing = tmp_path / "nope.coverage"
    assert tool.main(["--data", str(missing)]) == 2
    assert f"{missing}: no coverage data file" in capsys.readouterr().err
