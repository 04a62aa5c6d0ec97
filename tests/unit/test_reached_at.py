"""One rule for where a server is reached (sparkprov/serving/address.py), used by the deployment's
endpoint, the gateway's readiness wait, its endpoint, and monitoring's scrape targets."""

from __future__ import annotations

import pytest

from sparkprov.serving.address import reached_at
from sparkprov.serving.deployment import Deployment
from sparkprov.serving.gateway import wait_ready_script
from sparkprov.serving.monitor import MonitoredHost, server_address


@pytest.mark.parametrize("bind, want", [("0.0.0.0", "10.77.0.11"), ("::", "10.77.0.11"), ("", "10.77.0.11"),
                                        (None, "10.77.0.11"), ("192.168.100.11", "192.168.100.11")])
def test_a_wildcard_bind_is_reached_at_the_hosts_address_else_at_the_bind(bind, want):
    assert reached_at(bind, "10.77.0.11") == want


def test_every_server_reads_the_same_rule():
    d = Deployment(name="one", model="lab-tiny", hosts=["spark1"], tp=1)
    assert d.endpoint({"serve_bind": "::", "serve_port": 8001}, "10.77.0.11") == "http://10.77.0.11:8001"
    assert d.endpoint({"serve_bind": "192.168.100.11"}, "10.77.0.11") == "http://192.168.100.11:8000"
    assert "'http://127.0.0.1:4000/health/readiness'" in wait_ready_script("c", "0.0.0.0", 4000, "/health/readiness", 30)
    assert "'http://192.168.100.11:4000/x'" in wait_ready_script("c", "192.168.100.11", 4000, "/x", 30)
    assert server_address(MonitoredHost("spark1", "10.77.0.11", bind="::")) == "10.77.0.11"
    assert server_address(MonitoredHost("spark1", "10.77.0.11", bind="192.168.100.11")) == "192.168.100.11"
