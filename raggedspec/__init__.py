"""raggedspec: the command-line entry point (`raggedspec --help`, or `python -m raggedspec`).

The rules live in `reference/`; this package only parses arguments and drives them.
"""

__version__ = "0.1.0"
