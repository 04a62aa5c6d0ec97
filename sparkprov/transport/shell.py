"""Building shell text safely. Every word a user could influence goes through `quote`."""

from __future__ import annotations

import base64
import secrets
import shlex

quote = shlex.quote


def cmd(*argv: object) -> str:
    """One command line from argv words, each quoted."""
    return " ".join(quote(str(a)) for a in argv)


def pipeline(*commands: str) -> str:
    return " | ".join(commands)


def heredoc_bytes(data: bytes, target_cmd: str) -> str:
    """Feed `data` to `target_cmd` through a quoted here-document (base64, so any bytes pass).

    The data travels inside the script on stdin, never on a command line."""
    tag = "SPARKPROV_" + secrets.token_hex(8)
    encoded = base64.encodebytes(data).decode("ascii")
    return f"base64 -d <<'{tag}' | {target_cmd}\n{encoded}{tag}\n"

