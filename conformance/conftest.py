"""Hypothesis profiles. CI sets CI=true and gets the "ci" profile; choose another with
HYPOTHESIS_PROFILE=dev|ci|short|thorough|mutmut|explore (or pytest --hypothesis-profile=NAME).
"short" (20 examples) is the device script's conformance profile.

Every profile but "explore" is derandomized (examples drawn from a fixed seed, no example
database), so a port gets the same verdict on every run; "explore" draws fresh random examples
and keeps a database, for hunting bugs no fixed seed reaches."""

import os

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


# --- protocol coverage gate (conformance/test_protocol_coverage.py) -------------------------

GATE = "test_protocol_coverage.py::test_every_protocol_method_is_called_by_the_suite"


def pytest_configure(config):
    """Record every backend protocol call of the session (`backends.record_protocol_calls`)."""
    from raggedspec.conformance.backends import record_protocol_calls
    from raggedspec.gpu.backend import TorchBackend
    from raggedspec.gpu.cupy_backend import CupyBackend
    from raggedspec.reference.backend import NumpyBackend

    record_protocol_calls([NumpyBackend, TorchBackend, CupyBackend])


def pytest_collection_modifyitems(session, config, items):
    """The coverage gate runs last, and only in a session that runs the whole conformance
    folder unfiltered (no -k/-m, no xdist worker): elsewhere it is deselected (reported as
    deselected, never as a pass), since a partial session calls only part of the protocol."""
    gate = [it for it in items if it.nodeid.endswith(GATE)]
    if not gate:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    args = [os.path.abspath(a) for a in config.args]
    whole = (bool(args) and all(a in (here, os.path.dirname(here)) for a in args)
             and not config.option.keyword and not config.option.markexpr
             and not config.getoption("deselect", None)
             and not os.environ.get("PYTEST_XDIST_WORKER"))
    for it in gate:
        items.remove(it)
    if whole:
        items.extend(gate)
    else:
        config.hook.pytest_deselected(items=gate)
