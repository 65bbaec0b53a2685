"""Hypothesis profiles. CI sets CI=true and gets the "ci" profile; choose another with
HYPOTHESIS_PROFILE=dev|ci|short|thorough|mutmut|explore (or pytest --hypothesis-profile=NAME).
"short" (20 examples) is the device script's conformance profile.

Every profile but "explore" is derandomized (examples drawn from a fixed seed, no example
database), so a port gets the same verdict on every run; "explore" draws fresh random examples
and keeps a database, for hunting bugs no fixed seed reaches."""

import os

import pytest

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

_common = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
_fixed = dict(derandomize=True, database=None, **_common)
settings.register_profile("dev", max_examples=100, **_fixed)
settings.register_profile("ci", max_examples=200, **_fixed)
settings.register_profile("short", max_examples=20, **_fixed)
settings.register_profile("thorough", max_examples=2000, **_fixed)
settings.register_profile(
    "mutmut", max_examples=60, phases=[Phase.explicit, Phase.generate], **_fixed
)
# explicit, not inherited: with CI set, Hypothesis's own default is derandomized and databaseless
settings.register_profile("explore", max_examples=500, derandomize=False,
                          database=DirectoryBasedExampleDatabase(".hypothesis/examples"), **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


# --- whole-suite checks ----------------------------------------------------------------------
# Some tests check the suite as a whole: the protocol coverage gate (every backend protocol method
# is called by the tests that ran) and the rule map (every modelled docs/rules.md row has a test,
# every test of the spec's §17.2 table has one of ours).
# Each needs a session that collected the whole conformance folder (the gate: and ran all of it,
# outside mutmut's instrumented runs); elsewhere it is deselected (reported as deselected, never
# as a pass).

GATE = "test_protocol_coverage.py::test_every_protocol_method_is_called_by_the_suite"
RULE_MAP = ("test_rules_doc.py::test_every_modelled_rule_has_a_test",
            "test_rules_doc.py::test_every_section_17_2_test_is_mapped_to_a_row")


def pytest_configure(config):
    """Record every backend protocol call of the session (`backends.record_protocol_calls`)."""
    from raggedspec.conformance.backends import record_protocol_calls
    from raggedspec.gpu.backend import TorchBackend
    from raggedspec.gpu.cupy_backend import CupyBackend
    from raggedspec.reference.backend import NumpyBackend

    record_protocol_calls([NumpyBackend, TorchBackend, CupyBackend])


def _collected_whole_folder(config) -> bool:
    here = os.path.dirname(os.path.abspath(__file__))
    args = [os.path.abspath(a) for a in config.args]
    return bool(args) and all(a in (here, os.path.dirname(here)) for a in args)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Before any -k / -m deselection: record every collected test's rule markers (RULE_MARKS)
    and whether the whole folder was collected; then keep each whole-suite check only where it
    means something, the coverage gate last."""
    from raggedspec.conformance.runner import RULE_MARKS, rules_of

    config.stash[RULE_MARKS] = {it.nodeid: rules_of(it) for it in items}
    whole = _collected_whole_folder(config)
    ran_all = (whole and not config.option.keyword
               and config.option.markexpr in ("", "not slow")
               and not config.getoption("deselect", None)
               and not os.environ.get("PYTEST_XDIST_WORKER")
               and "MUTANT_UNDER_TEST" not in os.environ)  # mutmut's runs wrap every method
    for names, keep in (((GATE,), ran_all), (RULE_MAP, whole)):
        found = [it for it in items if it.nodeid.endswith(names)]
        for it in found:
            items.remove(it)
        if keep:
            items.extend(found)
        elif found:
            config.hook.pytest_deselected(items=found)
