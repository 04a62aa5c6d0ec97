import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
FIXTURES = REPO / "tests" / "fixtures"


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture(scope="module")
def local_hub(request, tmp_path_factory):
    """The lab's hub on loopback serving one generated repo named by the test module's REPO:
    (server, repo), for staging to hosts of connection: local without the lab."""
    from sparklab.hub import RepoSpec, ensure_generated, start_in_thread

    repo = ensure_generated(RepoSpec(request.module.REPO, num_shards=2, total_size=2 * 1024 * 1024),
                            tmp_path_factory.mktemp("hub"))
    server = start_in_thread([repo], bind="127.0.0.1", port=0)
    yield server, repo
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def lab():
    """The simulated Spark lab, one per session for tests/lab and tests/reliability alike (here so
    that both see the same fixture): fresh at the start of the session, needs root and the lab's
    tools (under CI their absence is a failure that names them). See tests/lab/conftest.py."""
    from tests.lab.conftest import lab_session

    yield from lab_session()
