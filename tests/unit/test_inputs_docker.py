"""A host where docker cannot be used (issue 24): the gather tells "dockerd is down (fix: start
docker on the host)" from "USER may not use docker (fix: invoke provision)", for stage-weights and
every serving command. stage-weights said `spark1: docker:  (fix: check dockerd on the host)`:
`docker image inspect --format` prints an empty line before its error, and the gather kept the
first line.

The docker outputs below are literal, captured on the development machine with the docker client
28.2.2 (`docker --version`: Docker version 28.2.2, build e6534b4):
- DENIED: as user nobody (no docker group) against a root-owned 0660 socket a process listened on:
  `DOCKER_HOST=unix:///tmp/h24/s.sock docker image inspect --format '{{.Id}}' python:3.12-slim`
  (the same text as against /var/run/docker.sock without the group; only the path differs);
- DOWN: no daemon at the socket: `DOCKER_HOST=unix:///tmp/h24/none.sock docker image inspect ...`;
- REFUSED: the socket file left by a killed daemon (bound, never listened):
  `docker -H unix:///tmp/h24/dead.sock info --format '{{.ServerVersion}}'`;
- NO_INFO: `docker info --format '{{.ServerVersion}}'` on a lab host whose dockerd had just been
  killed (`lab.fault` kill-dockerd; the whole output, docker 28.2.2), as the fresh-clone run of
  2026-11-26 saw it in tests/reliability/test_rel_cluster_faults.py: no "Cannot connect" line at all;
- the STORE_* texts are the whole answer of the stage gather's script (staging/facts.StoreState)
  run by /bin/sh in those two conditions;
- WARNING_THEN_DENIED: the same as nobody with HOME=/root (the client warns about its config file
  before the reason).
"""

import pytest

from sparkprov.facts.accounts import docker_problem, docker_reason, docker_unusable
from sparkprov.facts.serving import parse_containers
from sparkprov.modules.base import FactView, HostContext
from sparkprov.staging.facts import StoreState
from sparkprov.staging.plan import StoreFacts

DENIED = ('\npermission denied while trying to connect to the Docker daemon socket at unix:///tmp/h24/s.sock: '
          'Get "http://%2Ftmp%2Fh24%2Fs.sock/v1.50/images/python:3.12-slim/json": dial unix /tmp/h24/s.sock: '
          'connect: permission denied')
DOWN = "\nCannot connect to the Docker daemon at unix:///tmp/h24/none.sock. Is the docker daemon running?"
REFUSED = "Cannot connect to the Docker daemon at unix:///tmp/h24/dead.sock. Is the docker daemon running?"
NO_INFO = ('template: :1:2: executing "" at <.ServerVersion>: reflect: indirection through nil pointer '
           'to embedded struct field Info')
WARNING_THEN_DENIED = ("WARNING: Error loading config file: open /root/.docker/config.json: permission denied\n"
                       + DENIED.strip())
# the two texts the issue quotes, from a Spark's /var/run/docker.sock
ISSUE_DENIED = "permission denied while trying to connect to the Docker daemon socket"
ISSUE_DOWN = "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?"

STORE_HEAD = ("store\t/tmp/h24/store\nids\tnobody\t65534\t65534\nfree\t69829001216\ntool\trsync\ntool\tssh\n"
              "tool\tsha256sum\ntool\tsha1sum\ntool\tdocker\nimage\terror\t\n")
STORE_DENIED = STORE_HEAD + "imgerr\t" + DENIED.strip() + "\n"
STORE_DOWN = STORE_HEAD.replace("nobody\t65534\t65534", "root\t0\t0") + "imgerr\t" + DOWN.strip() + "\n"


@pytest.mark.parametrize("output,kind,reason", [
    (DENIED, "denied", DENIED.strip()),
    (WARNING_THEN_DENIED, "denied", DENIED.strip()),
    (ISSUE_DENIED, "denied", ISSUE_DENIED),
    (DOWN, "down", DOWN.strip()),
    ("\n" + REFUSED, "down", REFUSED),
    (ISSUE_DOWN, "down", ISSUE_DOWN),
    (NO_INFO, "down", NO_INFO),
    ("\n\nError response from daemon: client version 1.52 is too new\n", "other",
     "Error response from daemon: client version 1.52 is too new"),
    ("", "other", ""),
])
def test_docker_reason_and_kind_from_the_clients_own_words(output, kind, reason):
    assert docker_reason(output) == reason
    assert docker_unusable(output) == kind


def test_the_fix_fits_the_cause():
    assert docker_problem(DOWN, "spark1", "nvidia") == (
        f"dockerd is down: {DOWN.strip()} (fix: start docker on the host: sudo systemctl start docker)")
    assert docker_problem(DENIED, "spark1", "nvidia") == (
        f"nvidia may not use docker: {DENIED.strip()} (fix: invoke provision --hosts spark1 --tags docker, "
        "which adds nvidia to the docker group)")
    assert docker_problem(NO_INFO, "spark2", "nvidia") == (
        f"dockerd is down: no daemon answered docker info ({NO_INFO}) (fix: start docker on the host: "
        "sudo systemctl start docker)")
    assert docker_problem("", "spark1", "nvidia") == (
        "docker cannot be used: docker gave no reason (fix: check docker on the host: docker info)")


@pytest.mark.parametrize("out,want", [(STORE_DENIED, "error: " + DENIED.strip()),
                                      (STORE_DOWN, "error: " + DOWN.strip())])
def test_stage_gather_keeps_dockers_reason_not_its_blank_first_line(out, want):
    facts = StoreState("/tmp/h24/store", ("org/m",), image="python:3.12-slim").parse(out, "", 0)
    assert facts.image == want


def _download(state: str, user: str = "nvidia"):
    from sparkprov.modules.weights_download import WeightsDownload
    from sparkprov.modules.weights_store import store_fact

    m = WeightsDownload()
    args = m.Args.model_validate({
        "model": "m", "items": [{"repo": "o/m", "revision": "main", "commit": "c" * 40, "path": "config.json",
                                 "size": 2, "oid": "a" * 40, "sha256": None}],
        "endpoint": "http://127.0.0.1:9", "hosts": ["spark1"], "source": "spark1", "image": "python:3.12-slim"})
    host = HostContext("spark1", {}, {"user": user, "home": "/home/" + user}, check=False, exports={},
                       play_hosts=["spark1"], become=False)
    sf = StoreFacts(store="/home/nvidia/vllm", uid=1000, gid=1000, tools={"docker"}, image=state)
    return m.plan(args, m.view(args, FactView({store_fact(args, host).key: sf}, {}), host), host)


def test_stage_weights_on_a_host_whose_dockerd_is_down_says_so(monkeypatch):
    monkeypatch.setenv("HF_TOKEN_PATH", "/nonexistent")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    sf = StoreState("/tmp/h24/store", ("o/m",), image="python:3.12-slim").parse(STORE_DOWN, "", 0)
    plan = _download(sf.image)
    assert plan.failed == (f"spark1: dockerd is down: {DOWN.strip()} (fix: start docker on the host: "
                           "sudo systemctl start docker)")


def test_stage_weights_where_the_user_may_not_use_docker_downloads_as_root(monkeypatch):
    """The downloader then runs as root (sudo docker), the store still written as the user: the
    reason now reaches that choice (it was the blank first line, and the stage failed)."""
    monkeypatch.setenv("HF_TOKEN_PATH", "/nonexistent")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    sf = StoreState("/tmp/h24/store", ("o/m",), image="python:3.12-slim").parse(STORE_DENIED, "", 0)
    plan = _download(sf.image)
    assert plan.failed is None
    assert [c.become for c in plan.changes][:1] == [True]


@pytest.mark.parametrize("noaccess,words", [
    (DOWN.strip(), "dockerd is down: Cannot connect to the Docker daemon"),
    (DENIED.strip(), "nvidia may not use docker: permission denied while trying"),
])
def test_serving_commands_say_which(noaccess, words):
    from sparkprov.modules.serve_absent import ServeAbsent

    cont = parse_containers(f"@noaccess {noaccess}\n")
    m = ServeAbsent()
    args = m.Args()
    host = HostContext("spark1", {}, {"user": "nvidia", "home": "/home/nvidia"}, check=False, exports={},
                       play_hosts=["spark1"], become=False)
    plan = m.plan(args, m.view(args, FactView({m.needs(args, host)["containers"].key: cont}, {}), host), host)
    assert plan.failed.startswith(f"spark1: {words}"), plan.failed
    assert ("start docker on the host" in plan.failed) == ("down" in words)
    assert ("invoke provision --hosts spark1 --tags docker" in plan.failed) == ("may not" in words)

