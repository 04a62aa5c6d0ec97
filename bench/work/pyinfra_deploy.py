"""bench/work/pyinfra_deploy.py: the benchmark's provisioning work as a pyinfra deploy
(same work as sparkprov.yaml and ansible.yaml). Run by bench/run_engines.py as

    pyinfra -y --sudo --parallel N bench/work/pyinfra_inventory.py bench/work/pyinfra_deploy.py

The sudo password comes from the inventory's host data (_sudo_password, read from the lab's
password file), not from the command line.
"""

from pathlib import Path

from pyinfra import host
from pyinfra.facts.server import Command
from pyinfra.operations import files, server

HERE = Path(__file__).resolve().parent

server.group(name="group sparkbench", group="sparkbench", system=True)
server.user(name="nvidia in sparkbench", user="nvidia", groups=["sparkbench"], append=True)
for path, mode, user, group in (
    ("/etc/sparkbench", "0755", "root", "root"),
    ("/etc/netplan", "0755", "root", "root"),
    ("/opt/sparkbench", "0775", "root", "sparkbench"),
    ("/opt/sparkbench/models", "0755", "nvidia", "nvidia"),
    ("/var/log/sparkbench", "0750", "root", "adm"),
):
    files.directory(name=path, path=path, mode=mode, user=user, group=group)
files.put(name="config file", src=str(HERE / "files" / "bench.conf"),
          dest="/etc/sparkbench/bench.conf", mode="0644", user="root", group="root")
files.put(name="netplan-like file", src=str(HERE / "files" / "40-sparkbench.yaml"),
          dest="/etc/netplan/40-sparkbench.yaml", mode="0600", user="root", group="root")

# The nvidia-smi check: a fact (read during pyinfra's prepare phase), checked here.
driver = host.get_fact(Command, "nvidia-smi --query-gpu=driver_version --format=csv,noheader",
                       _sudo=False)
if int(driver.split(".")[0]) < 580:
    raise SystemExit(f"{host.name}: driver {driver} < 580")
