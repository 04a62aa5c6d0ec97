"""The one place a connection to a host is made, from its inventory entry: local or SSH (strict
host keys, ~/.ssh/config honoured). The engine and every command connect through it."""

from __future__ import annotations

from sparkprov.hosts import Host
from sparkprov.transport.base import Transport


def make_transport(host: Host, accept_new_host_keys: bool) -> Transport:
    if host.connection == "local":
        from sparkprov.transport.local import LocalTransport

        return LocalTransport(host.name)
    from sparkprov.transport.ssh import SSHTransport

    return SSHTransport(host.name, host.address, user=host.user, port=host.port, key_file=host.ssh_key,
                        known_hosts=host.known_hosts, accept_new_host_keys=accept_new_host_keys,
                        connect_timeout=host.connect_timeout)
