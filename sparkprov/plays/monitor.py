"""`invoke monitor` as playbooks for the engine (after the status play that finds the deployments):

    monitor: fabric       every host        fabric_rails: where each node guard answers (read only)
    monitor: keys on H    each keyed rank 0 gateway_keys (no_log): the API keys its scrape presents
    monitor               the chosen host   prometheus: the files and the container

`write` runs the first play only (the files are rendered and written on this machine); `down` runs
the prometheus task with state absent on the hosts it may be on."""

from __future__ import annotations

from typing import Any

from sparkprov.data.playbook import Playbook
from sparkprov.plays.book import play, task

WHERE = ("monitor", None, None)


def rails_play(hosts: list[str]):
    return play("monitor: fabric", hosts, [task("fabric rails", "fabric_rails", {}, WHERE)], where=WHERE)


def rails_book(hosts: list[str]) -> Playbook:
    return Playbook("monitor", [rails_play(hosts)])


def up_book(prometheus_host: str, targets: list[dict[str, Any]], deployments: list[dict[str, Any]],
            **prometheus: Any) -> Playbook:
    """`targets`, `deployments`: modules/prometheus.py Target's and Served's fields. The hosts' rails
    and the rank 0s' keys first."""
    names = [t["name"] for t in targets]
    plays = [rails_play(list(dict.fromkeys(names + [prometheus_host])))]
    keyed: dict[str, list[str]] = {}
    for d in deployments:
        if d.get("api_key_file") and d["api_key_file"] not in keyed.setdefault(d["host"], []):
            keyed[d["host"]].append(d["api_key_file"])
    for host, files in keyed.items():
        t = task("API keys", "gateway_keys", {"key_files": files}, WHERE)
        t.no_log = True
        plays.append(play(f"monitor: keys on {host}", [host], [t], where=WHERE))
    plays.append(play("monitor", [prometheus_host], [task("prometheus", "prometheus", {
        **prometheus, "hosts": targets, "deployments": deployments}, WHERE)], where=WHERE))
    return Playbook("monitor", plays)


def down_book(hosts: list[str]) -> Playbook:
    return Playbook("monitor", [play("monitor", hosts, [task("prometheus", "prometheus", {"state": "absent"}, WHERE)],
                                     where=WHERE)])
