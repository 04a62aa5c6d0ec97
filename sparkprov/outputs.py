"""Paths a user names for sparkprov to write, checked before anything is read or contacted, and
the one way files are written there (atomically).

A command that writes its result last must not find out at the end, after minutes of work on the
hosts, that its output path is a directory, a FIFO (open() blocks), /dev/full, something under
/proc or /sys, a symlink to nowhere, or the very file it read its input from. These checks say
so in one line naming the option, before the first connection.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Iterable

from sparkprov.errors import InputError
from sparkprov.inputfiles import file_kind

# Kernel file systems: a write there is a kernel interface call, never a file.
_KERNEL_DIRS = ("/proc", "/sys", "/dev")


def _flag(option: str) -> str:
    return "--" + option.lstrip("-").replace("_", "-")


def _error(option: str, text: str, message: str, fix: str) -> InputError:
    return InputError(f"{_flag(option)} {text[:200]!r}: {message}", fix=fix)


def _common_checks(option: str, text: str) -> Path:
    """The path, refused when it is under a kernel file system or a symlink to nowhere."""
    path = Path(text).expanduser()
    real = os.path.realpath(path)
    for top in _KERNEL_DIRS:
        if real == top or real.startswith(top + "/"):
            raise _error(option, text, f"is under {top}, a kernel file system, not a place for files",
                         "name a path in your home or working directory")
    if path.is_symlink() and not path.exists():
        raise _error(option, text, f"is a symlink to {os.readlink(path)!r}, which does not exist",
                     "remove the symlink or name another path")
    return path


def check_output_file(option: str, text: str, *, inputs: Iterable[str | Path] = ()) -> Path:
    """A file sparkprov will (re)write: a regular file or nothing yet, in a folder that exists
    and is writable, and none of `inputs` (the files the command reads)."""
    path = _common_checks(option, text)
    try:
        st = path.stat()
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise _error(option, text, f"cannot be checked: {exc.strerror or exc}", "name a file you can write") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise _error(option, text, f"is {file_kind(st.st_mode)}, not a file", "name a file to write")
    parent = path.parent
    if not parent.is_dir():
        raise _error(option, text, f"its folder {str(parent)!r} does not exist", "create the folder first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _error(option, text, f"the folder {str(parent)!r} is not writable", "name a folder you can write to")
    for source in inputs:
        if _same_file(path, Path(source).expanduser()):
            raise _error(option, text, f"is the input file {str(source)!r}: it would be overwritten",
                         "write the result to another file")
    return path


def check_output_dir(option: str, text: str) -> Path:
    """A folder sparkprov will write into (created if missing): not a file, FIFO or device."""
    path = _common_checks(option, text)
    try:
        st = path.stat()
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise _error(option, text, f"cannot be checked: {exc.strerror or exc}", "name a folder you can write") from None
    if not stat.S_ISDIR(st.st_mode):
        raise _error(option, text, f"is {file_kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else 'a file'}, "
                     "not a folder", "name a folder (it is created if missing)")
    return path


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare where they would be
        return os.path.realpath(a) == os.path.realpath(b)


def write_text_atomic(path: Path, text: str, *, mode: int = 0o644) -> None:
    """Write `text` to a temporary file beside `path` and rename it over `path`: a reader sees
    the old file or the whole new one, and a failure leaves no partial file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
