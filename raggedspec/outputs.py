"""Writing output files so that a failed or interrupted run changes nothing.

Every file the command line writes (simulate's JSONL and CSV, drift's figures and
summary.json, bench's JSON, Markdown and PNG, the conformance and mutation `--json`) goes
through `staged`: each output is first written to a temporary file in the same folder (so
the final rename stays on one file system and is atomic), and only when every output of the
run is complete are they renamed over their final paths. An exception or Ctrl-C before that
point removes the temporaries and leaves any existing file untouched. A temporary is created
with mode 0666 less the umask, as `open` would create the output itself (so a renamed output
has the mode any other new file of the user gets, not `mkstemp`'s 0600).

Output paths are checked before any work (`check_output_file`, `check_output_dir`): a path
under an existing file, a file path that is a directory, a folder that is a file, or a
folder that cannot be written is refused with `OutputPathError` naming the flag and path.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path


class OutputPathError(ValueError):
    """An output path cannot be written; the message names the flag, the path and why."""


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_folder(folder: Path, flag: str, shown: Path) -> None:
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        raise OutputPathError(
            f"{flag} {shown}: {existing} is a file, not a folder, so nothing can be "
            "written under it"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputPathError(f"{flag} {shown}: folder {existing} is not writable")


def check_output_file(path: str | Path, flag: str) -> Path:
    """Refuse (OutputPathError) a file path that is an existing directory, lies under an
    existing file, or whose folder cannot be created or written; return it as a Path.
    Nothing is created."""
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"{flag} {path}: is a directory; give a file path")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputPathError(f"{flag} {path}: the existing file is not writable")
    _check_folder(path.parent, flag, path)
    return path


def check_output_dir(path: str | Path, flag: str) -> Path:
    """Refuse (OutputPathError) a folder path that is an existing file, lies under an
    existing file, or cannot be written; return it as a Path. Nothing is created."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"{flag} {path}: is a file, not a folder")
    _check_folder(path, flag, path)
    return path


def new_temporary(final: Path) -> Path:
    """Create an empty, uniquely named file beside `final` and return its path. Its mode is
    0666 less the umask (the mode `open(final, "w")` would give), so the renamed output is
    readable by whoever the user's umask lets read new files."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    for _ in range(100):
        tmp = final.with_name(f".{final.name}.{secrets.token_hex(4)}.partial{final.suffix}")
        try:
            os.close(os.open(tmp, flags, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"no free temporary name beside {final}")


class Stage:
    """The temporary paths of one `staged` block: `stage[final]` is where to write `final`."""

    def __init__(self) -> None:
        self.temps: dict[Path, Path] = {}

    def __getitem__(self, final: str | Path) -> Path:
        final = Path(final)
        if final not in self.temps:
            final.parent.mkdir(parents=True, exist_ok=True)
            self.temps[final] = new_temporary(final)
        return self.temps[final]

    def _discard(self) -> None:
        for tmp in self.temps.values():
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _commit(self) -> None:
        for final, tmp in self.temps.items():
            os.replace(tmp, final)


@contextlib.contextmanager
def staged() -> Iterator[Stage]:
    """Context manager: write each output to `stage[final_path]`; on a normal exit every
    temporary is renamed over its final path, on any exception (KeyboardInterrupt included)
    every temporary is removed and no final path is touched."""
    stage = Stage()
    try:
        yield stage
    except BaseException:
        stage._discard()
        raise
    try:
        stage._commit()
    except BaseException:
        stage._discard()
        raise


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to `path` through a same-folder temporary and a rename."""
    path = Path(path)
    with staged() as stage:
        stage[path].write_text(text)
    return path


def remove_stale(folder: Path, names: Iterable[str], keep: Iterable[Path]) -> list[Path]:
    """Remove the files `folder/name` for `names` that this run did not write (`keep`), so a
    reused output folder holds no figure of an earlier run; return what was removed."""
    keep = {Path(p).resolve() for p in keep}
    gone = []
    for name in names:
        p = folder / name
        if p.is_file() and p.resolve() not in keep:
            p.unlink()
            gone.append(p)
    return gone
