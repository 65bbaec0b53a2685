"""A user's plug-in named `module:attr` (an oracle factory, a backend factory, a kernel
function): imported with the current working directory first on `sys.path`, as `python -m`
and pytest have it, so a module beside the user is found from the console script too.

`load_object` returns the named object or raises `PluginSpecError` (a ValueError: the name
does not import, lacks the attribute or is not callable; the caller adds which flag or key
named it). An exception raised while the user's module imports is a `PluginError`, and so
is one raised later inside any function of a loaded plug-in's file: `blame(exc)` finds the
plug-in in the exception's traceback, so a command reports it as the plug-in's failure with
its traceback, not as a bug of raggedspec. The tools (raggedspec/) and the port import this;
it imports nothing of theirs.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType


class PluginSpecError(ValueError):
    """The plug-in's name is wrong: no such module, attribute, or not callable."""


@dataclass(frozen=True)
class Plugin:
    """A loaded plug-in: what it is to the command ("oracle", "backend", "kernel function")
    and the `module:attr` the user gave."""

    what: str
    spec: str


class PluginError(Exception):
    """An exception raised inside a user's plug-in (`__cause__` holds it)."""

    def __init__(self, plugin: Plugin, when: str = "") -> None:
        super().__init__(f"raised by your {plugin.what} {plugin.spec!r}{when}")
        self.plugin, self.when = plugin, when


_FILES: dict[str, Plugin] = {}  # source file of each loaded plug-in module -> the plug-in
_OURS = str(Path(__file__).resolve().parents[1])  # the raggedspec package (reference/ beside)
_SKIP = ("<frozen", _OURS, str(Path(importlib.__file__).parent))  # not the user's frames


@contextmanager
def cwd_first():
    """The current working directory first on `sys.path` for the duration."""
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    try:
        yield
    finally:
        with suppress(ValueError):
            sys.path.remove(cwd)  # the first occurrence: the one inserted above


def _missing(exc: ImportError, mod: str) -> bool:
    """True when the import failed because `mod` itself (or a package above it) is absent,
    not because the user's module failed inside."""
    name = getattr(exc, "name", None)
    return isinstance(exc, ModuleNotFoundError) and name is not None and (
        mod == name or mod.startswith(name + "."))


def import_plugin_module(mod: str, plugin: Plugin):
    """`mod` imported from the working folder first and its file registered for `blame`.
    PluginSpecError when it does not exist; PluginError when importing it raises."""
    try:
        with cwd_first():
            module = importlib.import_module(mod)
    except ImportError as exc:
        if not _missing(exc, mod):
            raise PluginError(plugin, " while importing") from exc
        raise PluginSpecError(
            f"cannot import {mod!r} ({exc}); it must be importable from the current folder "
            f"{os.getcwd()!r} or from sys.path") from None
    except Exception as exc:  # the user's module raised while importing
        raise PluginError(plugin, " while importing") from exc
    if getattr(module, "__file__", None) and not _ours(module.__name__):
        _FILES[str(Path(module.__file__).resolve())] = plugin
    return module


def _ours(name: str) -> bool:
    """A module of raggedspec itself (its example ports excepted): naming one as a plug-in
    does not make an exception raised in its code the user's."""
    return (name == "raggedspec" or name.startswith("raggedspec.")) and not name.startswith(
        "raggedspec.conformance.examples")


def load_object(spec: str, what: str, need: str = "") -> object:
    """The callable named by `module:attr` (`attr` may be dotted). PluginSpecError naming
    the module or attribute when it is absent or not callable (`need` says what it must
    be); PluginError when importing the module raises."""
    mod, _, attr = spec.partition(":")
    module = import_plugin_module(mod, Plugin(what, spec))
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginSpecError(f"module {mod!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PluginSpecError(
            f"{mod}.{attr} is not callable (it is a {type(obj).__name__}: {obj!r})"
            + (f"; {need}" if need else ""))
    return obj


def _frames(exc: BaseException) -> list[TracebackType]:
    tb, out = exc.__traceback__, []
    while tb is not None:
        out.append(tb)
        tb = tb.tb_next
    return out


def _first_foreign(exc: BaseException) -> TracebackType | None:
    """The first traceback entry outside raggedspec and the import machinery: where the
    user's code starts (the whole traceback when there is none)."""
    for tb in _frames(exc):
        name = tb.tb_frame.f_code.co_filename
        if not name.startswith(_SKIP):
            return tb
    return exc.__traceback__


def blame(exc: BaseException) -> tuple[Plugin, BaseException, TracebackType | None] | None:
    """`(plugin, the exception it raised, its first traceback entry inside the plug-in)`
    when `exc` was raised inside a loaded plug-in (or is a PluginError), else None."""
    if isinstance(exc, PluginError):
        cause = exc.__cause__ or exc
        return exc.plugin, cause, _first_foreign(cause)
    for tb in _frames(exc):
        plugin = _FILES.get(str(Path(tb.tb_frame.f_code.co_filename).resolve()))
        if plugin is not None:
            return plugin, exc, tb
    return None


def plugin_traceback(exc: BaseException, start: TracebackType | None) -> str:
    """The traceback of `exc` from the plug-in's first frame (`start`) on."""
    return "".join(traceback.format_exception(type(exc), exc, start))
