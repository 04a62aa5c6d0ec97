"""ssh_keypair: the login user has a key pair of its own on this node for the SSH mesh.

The key (default ~/.ssh/id_ed25519_sparkprov, no passphrase, comment sparkprov-mesh@HOST) is
made on the node and never leaves it: only its public half and the host's public host keys are
read and exported (`ssh`: {user, pub, host_keys, converged}); ssh_mesh hands them to the peers in
the next play.

It also declares the files ssh_mesh edits (authorized_keys, ~/.ssh/known_hosts, ~/.ssh/config),
so they are read in this play's one gather and the mesh play needs no remote round of its own.
"""

from __future__ import annotations

import posixpath

from pydantic import field_validator

from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.facts.files import PathState
from sparkprov.facts.ssh import AuthorizedKeys, SshIdentity
from sparkprov.transport.shell import cmd
from typing import TypedDict

DEFAULT_KEY = "~/.ssh/id_ed25519_sparkprov"


class Args(ModuleArgs):
    key: str = DEFAULT_KEY

    @field_validator("key")
    @classmethod
    def _key(cls, v):
        if not v.startswith("~/.ssh/") or "/" in v[7:] or not v[7:] or "\n" in v:
            raise ValueError("key must be a file directly in ~/.ssh/")
        return v


def mesh_files(host: HostContext) -> dict:
    """The files ssh_mesh reads (read here too, so that they come in the same gather)."""
    return {"authorized_keys": AuthorizedKeys(host.user), "known_hosts": PathState("~/.ssh/known_hosts", with_content=True),
            "config": PathState("~/.ssh/config", with_content=True)}


class SshKey(TypedDict):
    user: str
    pub: str | None          # the mesh key's public half (None: made by this run's apply)
    host_keys: list[str]     # the host's own public keys, for the peers' known_hosts
    converged: bool


SSH_KEY: Export[SshKey] = Export("ssh", SshKey, "the node's mesh key (public half) and host keys")


class SshKeypairModule(Module):
    name = "ssh_keypair"
    Args = Args
    doc = "A node-local ed25519 key pair for the SSH mesh; exports only public keys."

    def needs(self, args: Args, host: HostContext):
        return {"identity": SshIdentity(args.key), "ssh_dir": PathState("~/.ssh"), **mesh_files(host)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        user = host.user
        ident, sshdir = facts.identity, facts.ssh_dir
        key = host.path(args.key)
        d = posixpath.dirname(key)
        touched = [SshIdentity(args.key), PathState("~/.ssh")]
        changes = []
        if not sshdir["exists"] or sshdir.get("mode") != 0o700 or sshdir.get("owner") != user:
            changes.append(Change(f"{d}: directory mode 0700 owned by {user}",
                                  "\n".join([cmd("mkdir", "-p", "--", d), cmd("chown", f"{user}:", "--", d),
                                             cmd("chmod", "0700", "--", d)]),
                                  Diff(d, "absent\n" if not sshdir["exists"] else
                                       f"mode {sshdir['mode']:04o} owner {sshdir['owner']}\n", f"mode 0700 owner {user}\n"),
                                  touched))
        if not ident["exists"]:
            changes.append(Change(f"generate the mesh key {key} (ed25519, stays on {host.name})",
                                  "\n".join([cmd("rm", "-f", "--", key + ".pub"),
                                             cmd("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C",
                                                 f"sparkprov-mesh@{host.name}", "-f", key),
                                             cmd("chown", f"{user}:", "--", key, key + ".pub"),
                                             cmd("chmod", "0600", "--", key)]),
                                  Diff(key, "absent\n", "ed25519 key pair\n"), touched))
        else:
            if not ident["pub"]:
                changes.append(Change(f"rewrite {key}.pub from the private key",
                                      f"{cmd('ssh-keygen', '-y', '-f', key)} > {cmd(key + '.pub')}\n"
                                      + cmd("chown", f"{user}:", "--", key + ".pub"),
                                      Diff(key + ".pub", "absent\n", "public key\n"), touched))
            if ident.get("mode") != 0o600 or ident.get("owner") != user:
                changes.append(Change(f"{key}: mode 0600 owned by {user}",
                                      cmd("chown", f"{user}:", "--", key) + "\n" + cmd("chmod", "0600", "--", key),
                                      Diff(key, f"mode {ident['mode']:04o} owner {ident['owner']}\n", f"mode 0600 owner {user}\n"),
                                      touched))
        if not ident["host_keys"]:
            return Plan.fail(f"{host.name}: no readable /etc/ssh/ssh_host_*_key.pub: peers could not pin this host's key")
        exports = SSH_KEY({"user": user, "pub": ident["pub"] if ident["exists"] else None,
                           "host_keys": ident["host_keys"], "converged": not changes})
        return Plan(changes, msg=f"{key} ({(ident['pub'] or '').split(' ')[0] or 'new'}), "
                                 f"{len(ident['host_keys'])} host key(s)", exports=exports)
