"""Where a server is reached, given the address it binds: one rule for every server sparkprov starts
(vLLM's API, the gateway, Prometheus)."""

from __future__ import annotations

ANY_ADDRESS = ("", "0.0.0.0", "::")  # a server bound to these listens on every address of its host


def reached_at(bind: str | None, address: str) -> str:
    """The address to reach a server bound to `bind` on a host reached at `address`: that address
    when it binds every address of the host, else the one address it binds."""
    return address if (bind or "") in ANY_ADDRESS else str(bind)
