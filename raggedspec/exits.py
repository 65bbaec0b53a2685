"""The exit codes every `raggedspec` command returns, and the usage error that maps to 2.

A tool beside the CLI (vectors, bench, check-trace, ...) raises `UsageError` for bad input
and returns these codes; `raggedspec.cli` turns the error into its message and exit 2.
"""

from __future__ import annotations

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_CODES = ("exit codes: 0 ok; 1 a rule of the spec refused (the message names it); 2 bad "
              "input (the message names the file or flag, the value and what is allowed); 3 "
              "internal error (a bug in raggedspec: the traceback is saved to a file whose path "
              "is printed)")


class UsageError(Exception):
    """Bad usage or bad configuration: exit 2 with this message."""
