"""The protocol coverage gate: every method of the backend protocol
(`reference.backend.PROTOCOL`) is called by the suite on the reference (`NumpyBackend`) and on
the port (`TorchBackend`). The calls are recorded for the whole session by wrappers
`conformance/conftest.py` installs (`backends.record_protocol_calls`); the gate runs last and
only in a session over the whole conformance folder (elsewhere it is deselected, since a
partial session calls part of the protocol by design). A method no test calls is a method whose
port can be wrong without the suite noticing.

The kernel backend (`gpu.cupy_backend.CupyBackend`, emulated on the CPU with g++) inherits most
methods from the torch port; only the methods it overrides are required of it, and only where
the emulator runs."""

from __future__ import annotations

import pytest

from raggedspec.conformance.backends import PROTOCOL_CALLS, _recording, record_protocol_calls
from raggedspec.conformance.backends import selection, uncalled_methods
from raggedspec.gpu import kernel_emulator
from raggedspec.gpu.backend import TorchBackend
from raggedspec.gpu.cupy_backend import CupyBackend
from raggedspec.reference.backend import PROTOCOL, PROTOCOL_METHODS, Backend, NumpyBackend


def _own_methods(cls: type) -> list[str]:
    """The protocol methods `cls` defines itself (not inherited from its first base), looked
    through the recording wrappers: an inherited method's wrapper wraps the base's attribute."""
    base = cls.__mro__[1]
    return [m for m in PROTOCOL_METHODS
            if getattr(getattr(cls, m), "__wrapped__", getattr(cls, m)) is not getattr(base, m)]


@pytest.mark.rule("every protocol method is called by the suite")
def test_the_recorder_wraps_every_protocol_method_of_the_backends():
    """Each protocol method of the three backends is a recording wrapper (so the gate below
    sees every call), and the list of methods is PROTOCOL's."""
    n = len(PROTOCOL_METHODS)
    assert n == sum(len(g) for g in PROTOCOL.values()) == len(set(PROTOCOL_METHODS))
    for cls in (NumpyBackend, TorchBackend):
        unwrapped = [m for m in PROTOCOL_METHODS
                     if getattr(getattr(cls, m), "__wrapped__", None) is None]
        assert unwrapped == [], f"{cls.__name__}: not recorded: {unwrapped}"


@pytest.mark.rule("every protocol method is called by the suite")
def test_the_kernel_backend_owns_only_the_methods_it_overrides():
    """Looked through the wrappers, `CupyBackend`'s own protocol methods are the ones its
    class body defines."""
    defined = {"build_model", "apply_rope"}
    assert set(_own_methods(CupyBackend)) == defined


@pytest.mark.rule("every protocol method is called by the suite")
def test_uncalled_methods_names_a_method_that_was_never_called():
    """The gate's check fails on a method never called: a record missing one method names it."""
    calls = {"NumpyBackend": set(PROTOCOL_METHODS) - {"propose_chain"}}
    assert uncalled_methods(calls, "NumpyBackend") == ["propose_chain"]
    assert uncalled_methods({}, "TorchBackend") == list(PROTOCOL_METHODS)
    assert uncalled_methods({"TorchBackend": set(PROTOCOL_METHODS)}, "TorchBackend") == []


@pytest.mark.rule("every protocol method is called by the suite")
def test_a_wrapped_method_records_its_class_and_passes_the_call_through():
    class Probe(NumpyBackend):
        def cache_len(self, cache):  # a protocol method, overridden
            return ("seen", cache)

    record_protocol_calls([Probe])
    assert Probe().cache_len(7) == ("seen", 7)
    assert "cache_len" in PROTOCOL_CALLS["Probe"]
    assert _recording("x", lambda self: 1)(None) == 1


@pytest.mark.rule("every protocol method is called by the suite")
def test_a_method_the_class_does_not_implement_is_not_wrapped():
    """A port that leaves a method as `Backend`'s keeps it detectable as missing."""
    class Partial(Backend):
        pass

    record_protocol_calls([Partial])
    assert Partial.cache_len is Backend.cache_len
    with pytest.raises(TypeError, match="Plain has no protocol method 'build_model'"):
        record_protocol_calls([type("Plain", (), {})])


def required_backends() -> list[str]:
    """The classes the gate holds to the whole protocol: the reference always, the torch port
    when it is the backend under test (the default; another selection runs its own port in the
    backend tests instead)."""
    return ["NumpyBackend"] + (["TorchBackend"] if selection()[0] == "torch" else [])


@pytest.mark.rule("every protocol method is called by the suite")
def test_every_protocol_method_is_called_by_the_suite():
    """The gate (run last, over the whole folder only): no protocol method of the reference
    or of the torch port goes uncalled, and, where the g++ kernel emulator runs, every method
    the kernel backend overrides is called on it."""
    missing = {name: uncalled_methods(PROTOCOL_CALLS, name) for name in required_backends()}
    if kernel_emulator.compilers()["g++"] is not None:
        own = set(_own_methods(CupyBackend))
        missing["CupyBackend"] = [m for m in uncalled_methods(PROTOCOL_CALLS, "CupyBackend")
                                  if m in own]
    assert all(not v for v in missing.values()), f"methods the suite never calls: {missing}"
