import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
FIXTURES = REPO / "tests" / "fixtures"


def pytest_configure(config):
    # The suite makes its own lab and hubs, each with its own token. A Hugging Face token of the
    # user's would be sent to them and refused (401): the README has the demo lab's exported
    # (`export HF_TOKEN=...`), and `make test` run in that shell failed every test that stages
    # (seen in a fresh clone); `hf auth login`'s token file would do the same. Tests that need a
    # token set their own.
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        os.environ.pop(var, None)
    os.environ["HF_TOKEN_PATH"] = str(REPO / ".lab-cache" / "no-hf-token-in-tests")


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
