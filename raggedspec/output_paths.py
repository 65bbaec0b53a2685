"""Output paths checked for real before a command does any work.

`raggedspec.outputs` refuses the paths it can judge from what exists (a folder under a file,
a file path that is a folder, a folder without write permission). Permissions do not tell
the whole story (root passes every permission check, and `/proc` or a read-only mount refuses
a folder all the same), so `writable_file` and `writable_dir` also try: they create the
missing folders and a file in the deepest one, then remove what they made. A path that
cannot be written is refused with `OutputPathError` naming the flag, the path and the
system's reason, before the run starts; nothing is left behind either way.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from raggedspec.outputs import OutputPathError, check_output_dir, check_output_file


def _missing_folders(folder: Path) -> list[Path]:
    """The folders from `folder` up that do not exist yet, deepest first."""
    out = []
    while not folder.exists() and folder != folder.parent:
        out.append(folder)
        folder = folder.parent
    return out


def probe_folder(folder: Path, flag: str, shown: Path) -> None:
    """Create `folder` (and the folders above it) and a file in it, then remove what was
    made; OutputPathError naming `flag`, `shown` and the reason when that fails."""
    made = _missing_folders(folder)
    try:
        for f in reversed(made):
            f.mkdir()
        fd, name = tempfile.mkstemp(dir=folder, prefix=".raggedspec-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise OutputPathError(
            f"{flag} {shown}: cannot write there ({exc.strerror or exc}: "
            f"{exc.filename or folder})") from None
    finally:
        for f in made:
            if f.exists():
                f.rmdir()


def writable_file(path: str | Path, flag: str) -> Path:
    """`outputs.check_output_file`, then a real write in its folder (`probe_folder`)."""
    path = check_output_file(path, flag)
    probe_folder(path.parent, flag, path)
    return path


def writable_dir(path: str | Path, flag: str) -> Path:
    """`outputs.check_output_dir`, then a real write in it (`probe_folder`)."""
    path = check_output_dir(path, flag)
    probe_folder(path, flag, path)
    return path
