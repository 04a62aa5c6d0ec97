"""Fixtures the unit tests share."""

from __future__ import annotations

import pytest

from helpers import start_local_hub


@pytest.fixture(scope="module")
def local_hub(request, tmp_path_factory):
    """The lab's hub on loopback serving the module's REPO (one generated repo): (server, repo)."""
    server, repo = start_local_hub(tmp_path_factory.mktemp("hub"), request.module.REPO)
    yield server, repo
    server.shutdown()
    server.server_close()
