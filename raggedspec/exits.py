"""The exit codes every `raggedspec` command returns, the usage error that maps to 2, and the
two failures that are the user's, not raggedspec's: an exception inside the user's plug-in
(exit 1, reported with its traceback) and a missing optional package (exit 2, naming the
`pip install` line of the extra that brings it).

A tool beside the CLI (vectors, bench, check-trace, ...) raises `UsageError` for bad input
and returns these codes; `raggedspec.cli` turns the error into its message and exit 2.
"""

from __future__ import annotations

import sys

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_INTERNAL, EXIT_PREFLIGHT = 0, 1, 2, 3, 4
EXIT_FAILED = EXIT_REFUSED  # a check found a problem, or the user's plug-in raised
EXIT_CODES = ("exit codes: 0 ok; 1 a rule of the spec refused (the message names it), a check "
              "found a mismatch or a violation, or your plug-in (oracle, backend, kernel "
              "function) raised: its traceback is printed; 2 bad input (the message names the "
              "file or flag, the value and what is allowed) or a missing optional package (the "
              "message gives the pip install line); 3 internal error (a bug in raggedspec: the "
              "traceback is saved to a file whose path is printed); 4 preflight only: a "
              "first-run kernel check failed; 130 interrupted (Ctrl-C), no output changed")

EXIT_CODES_SENTENCE = EXIT_CODES[0].upper() + EXIT_CODES[1:] + "."


class UsageError(Exception):
    """Bad usage or bad configuration: exit 2 with this message."""


# the packages each extra of pyproject.toml installs, by import name
EXTRA_MODULES = {
    "conformance": ("pytest", "hypothesis"),
    "check-kernel": ("torch", "hypothesis"),
    "models": ("transformers", "torch", "hypothesis"),
    "vectors": ("safetensors",),
    "mutation": ("mutmut", "xdist", "pytest", "hypothesis"),
    "torch": ("torch",),
    "cupy": ("cupy",),
    "test": ("pytest", "hypothesis", "safetensors", "coverage"),
    "nvrtc": ("cuda",),
}


def missing_extra(own: str | None, exc: BaseException) -> str | None:
    """For a ModuleNotFoundError of an optional package, the `pip install` line of the
    extra that brings it (`own`, the command's extra, when it does; else the first that
    does); None for any other exception."""
    if not isinstance(exc, ModuleNotFoundError):
        return None
    top = (exc.name or "").partition(".")[0]
    if own is not None and top in EXTRA_MODULES[own]:
        return f"pip install 'raggedspec[{own}]'"
    extra = next((e for e, mods in EXTRA_MODULES.items() if top in mods), None)
    return None if extra is None else f"pip install 'raggedspec[{extra}]'"


def report_plugin_failure(command: str, exc: BaseException) -> bool:
    """When `exc` was raised inside the user's plug-in (`reference.plugins.blame`), print
    its traceback and one line saying so on stderr, and return True."""
    from raggedspec.reference.plugins import blame, plugin_traceback

    found = blame(exc)
    if found is None:
        return False
    plugin, raised, start = found
    when = getattr(exc, "when", "")
    print(plugin_traceback(raised, start), end="", file=sys.stderr)
    print(f"raggedspec {command}: failed: {type(raised).__name__}: {str(raised)[:300]} (raised "
          f"by your {plugin.what} {plugin.spec!r}{when}; its traceback is above)",
          file=sys.stderr)
    return True
