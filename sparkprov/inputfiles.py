"""Reading a file a user named: checked to be a regular file of sane size before it is read.

A FIFO named as an inventory blocks `open()` forever; /dev/zero (or a multi-gigabyte log named
by mistake) is read until memory runs out; a directory gives a raw OSError. Every file sparkprov
reads (inventory, playbooks, recipe files, become_password_file, known_hosts, ssh_key) goes
through `read_text_checked` or `check_regular_file`, which say what is wrong in one line.

The file is opened with O_NONBLOCK so that even a FIFO swapped in after the check cannot block
the open, and its type is judged with fstat on the open descriptor (no check-then-open race);
the read itself stops at max_bytes + 1 whatever the size claimed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from sparkprov.errors import InputError

# Limits by kind of file; the largest real ones are a few hundred KB.
MAX_YAML = 8 * 2**20  # playbooks, recipe files
# An inventory of a thousand Sparks is about 100 KiB; PyYAML's pure-Python composer needs ~6 s per
# MiB on a small machine, so the bound is what keeps a wrong file (a log, a dump) a fast refusal.
MAX_INVENTORY = 256 * 2**10
MAX_SECRET = 64 * 2**10  # a password file
MAX_KNOWN_HOSTS = 16 * 2**20
MAX_KEY = 1 * 2**20


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.0f} {unit}"
    return f"{n} bytes"


def _error(path: str, what: str, message: str, fix: str | None) -> InputError:
    return InputError(f"{what}: {message}", file=path, fix=fix)


def _open_checked(path: str | Path, what: str, max_bytes: int) -> int:
    """An fd for a regular file of at most max_bytes, or one InputError."""
    p = str(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(p, flags)
    except FileNotFoundError:
        raise _error(p, what, "file not found", "check the path") from None
    except PermissionError:
        raise _error(p, what, "permission denied", f"make it readable by {_me()}") from None
    except IsADirectoryError:
        raise _error(p, what, "is a directory", "name a file") from None
    except OSError as exc:  # ELOOP, ENAMETOOLONG, ENXIO (a FIFO or socket with no writer), ...
        reason = exc.strerror or str(exc)
        try:
            mode = os.stat(p).st_mode
            if not stat.S_ISREG(mode):
                reason = f"is {file_kind(mode)}"
        except OSError:
            pass
        raise _error(p, what, f"cannot open: {reason}", "name a regular file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _error(p, what, f"is {file_kind(st.st_mode)}, not a regular file", "name a regular file")
        if st.st_size > max_bytes:
            raise _error(p, what, f"is {_human(st.st_size)}, more than the {_human(max_bytes)} such a file may be",
                         "check that this is the right file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _me() -> str:
    import getpass

    try:
        return getpass.getuser()
    except Exception:  # no passwd entry for this uid (a container): the message still reads
        return "this user"


def check_regular_file(path: str | Path, what: str, max_bytes: int) -> None:
    """Only the checks (for files another program reads: ssh keys, known_hosts via paramiko)."""
    os.close(_open_checked(path, what, max_bytes))


def read_bytes_checked(path: str | Path, what: str, max_bytes: int) -> bytes:
    fd = _open_checked(path, what, max_bytes)
    try:
        with os.fdopen(fd, "rb", closefd=True) as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise _error(str(path), what, f"cannot read: {exc.strerror or exc}", None) from None
    if len(data) > max_bytes:  # grew after the check, or a file system that reports no size
        raise _error(str(path), what, f"is more than the {_human(max_bytes)} such a file may be",
                     "check that this is the right file")
    return data


def read_text_checked(path: str | Path, what: str, max_bytes: int = MAX_YAML) -> str:
    """The file's text (UTF-8). A byte that is not UTF-8 is reported at its line and column."""
    raw = read_bytes_checked(path, what, max_bytes)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise InputError(f"not UTF-8: byte 0x{raw[exc.start]:02x} ({exc.reason})", file=str(path), line=line,
                         column=column, fix="save the file as UTF-8") from None


# -- files sparkprov wrote itself, read back ----------------------------------------------------------


class Stored(BaseModel):
    """The model of a file sparkprov wrote (a bench run, a history record, the guard's state, a
    qualification record) as it must read back: types strict (a number is a number, never a string
    that looks like one; no NaN), keys it does not know kept (a newer sparkprov's). A reader
    validates the document and keeps it as it is."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


def shape_problem(exc: ValidationError) -> str:
    """The first thing a document does not fit, in one line: where in it, and what was expected
    (never the value: it may be megabytes). "rows[0].completed should be a valid integer"."""
    err = exc.errors(include_input=False)[0]
    where = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p))
                    for i, p in enumerate(err.get("loc", ())))
    what = err.get("msg", "does not fit").replace("Input should be", "should be")
    if err.get("type") == "missing":
        what = "is missing"
    elif err.get("type") in ("model_type", "model_attributes_type", "dict_type"):
        what = "should be a JSON object"
    return f"{where} {what}" if where else f"the document {what}"
