"""The reliability suite runs on the same 2-host lab as tests/lab, in the same pytest session.

pytest only shows a conftest's fixtures to the tests under its directory, so `lab` is defined
here too. When tests/lab's fixture (or `invoke lab.up`) already has the lab up, this one takes
it as it is: no second bring-up and no teardown (its owner tears it down at the end of the
session). Run alone (`pytest tests/reliability`), it brings the lab up and down itself.
"""
from __future__ import annotations

import pytest

from tests.lab.conftest import LabHandle, _skip_reason, snapshot


def _handle(res_hosts: dict[str, str], inventory, baseline) -> LabHandle:
    from sparkprov.lab import state

    return LabHandle(hosts=res_hosts, key=state.key_path(), known_hosts=state.known_hosts_path(),
                     password=state.password_path().read_text().strip(), password_file=state.password_path(),
                     inventory=inventory, state_dir=state.STATE_DIR, baseline=baseline)


@pytest.fixture(scope="session")
def lab():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from sparkprov.lab import state, up
    from sparkprov.lab.hosts import anchor_alive

    rec = state.LabRecord.load()
    if len(rec.hosts) == 2 and all(anchor_alive(h) for h in rec.hosts.values()):
        yield _handle({n: h.address for n, h in sorted(rec.hosts.items())}, state.inventory_path(), None)
        return
    baseline = snapshot()
    res = up.up(2, images=False, quiet=True)
    yield _handle(res.hosts, res.inventory, baseline)
    up.down(quiet=True)
