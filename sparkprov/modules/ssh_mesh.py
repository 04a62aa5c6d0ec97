"""ssh_mesh: passwordless SSH between the nodes over the fabric (rsync, Ray tooling).

Runs in the play after ssh_keypair and fabric, from what they exported:
- each peer's public key is in this node's authorized_keys (the file sshd really reads: the
  first AuthorizedKeysFile of `sshd -T`), replacing an older sparkprov-mesh key of that peer;
- each peer's host keys are pinned in ~/.ssh/known_hosts for its fabric addresses (lines for
  those addresses with other keys are replaced);
- a managed block at the top of ~/.ssh/config makes ssh use the mesh key for those addresses.
Only public keys travel; no private key ever leaves its node.

The guarantee (verified by fabric_mesh in the next play): on every node the login user can run
`ssh -o BatchMode=yes -o StrictHostKeyChecking=yes USER@PEER_RAIL_ADDRESS true` for every peer
and every rail. Exports `ssh_mesh`: {peers: {host: [addresses]}, converged}.
"""

from __future__ import annotations

from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, Plan
from sparkprov.facts.files import PathState
from sparkprov.facts.ssh import AuthorizedKeys
from sparkprov.modules._provision import write_file_script
from sparkprov.modules.ssh_keypair import Args as KeyArgs, DEFAULT_KEY, SSH_KEY, mesh_files
from sparkprov.modules.fabric import FABRIC
from typing import TypedDict

BEGIN = "# BEGIN sparkprov ssh_mesh (managed by sparkprov; edits inside are replaced)"
END = "# END sparkprov ssh_mesh"
COMMENT = "sparkprov-mesh@"


class Args(KeyArgs):
    key: str = DEFAULT_KEY


def _text(state: dict) -> str:
    c = state.get("content")
    if isinstance(c, bytes):
        return c.decode(errors="replace")
    return c or ""


def authorized_after(current: str, peers: dict[str, str]) -> str:
    """Keep every line but older mesh keys of these peers; add each peer's key once."""
    lines = current.splitlines()
    keep = []
    wanted = {pub.split()[1] for pub in peers.values()}
    for ln in lines:
        parts = ln.split()
        comment = parts[-1] if len(parts) >= 3 else ""
        if comment.startswith(COMMENT) and comment[len(COMMENT):] in peers and (len(parts) < 2 or parts[-2] not in wanted):
            continue
        keep.append(ln)
    have = {p for ln in keep for p in ln.split()}
    for peer, pub in sorted(peers.items()):
        if pub.split()[1] not in have:
            keep.append(pub)
    return "\n".join(keep) + ("\n" if keep else "")


def known_hosts_after(current: str, pins: dict[str, list[str]]) -> str:
    """Replace the lines naming any pinned address with one line per host key."""
    addrs = {a for group in pins for a in group.split(",")}
    keep = [ln for ln in current.splitlines()
            if not (ln.split() and not ln.startswith("#") and set(ln.split()[0].split(",")) & addrs)]
    for names, keys in sorted(pins.items()):
        for k in keys:
            keep.append(f"{names} {k}")
    return "\n".join(keep) + ("\n" if keep else "")


def config_after(current: str, addresses: list[str], key: str) -> str:
    """The managed block first (ssh takes the first value it sees), the rest as it was."""
    lines = current.splitlines()
    if BEGIN in lines and END in lines[lines.index(BEGIN):]:
        i = lines.index(BEGIN)
        j = i + lines[i:].index(END)
        lines = lines[:i] + lines[j + 1:]
        while lines and not lines[0].strip():
            lines.pop(0)
    block = [BEGIN]
    if addresses:
        block += [f"Host {' '.join(addresses)}", f"    IdentityFile {key}", "    IdentitiesOnly yes"]
    block.append(END)
    rest = ("\n" + "\n".join(lines)) if lines else ""
    return "\n".join(block) + "\n" + (rest + "\n" if rest else "")


class SshMesh(TypedDict):
    peers: dict[str, list[str]]   # peer -> its fabric addresses
    converged: bool
    digest: str                   # what this node's logins depend on, as converged


SSH_MESH: Export[SshMesh] = Export("ssh_mesh", SshMesh, "the peers this node logs in to, and a digest of that setup")


class SshMeshModule(Module):
    name = "ssh_mesh"
    Args = Args
    doc = "Authorize peers' public keys, pin their host keys for their fabric addresses, use the mesh key for them."

    def needs(self, args: Args, host: HostContext):
        return mesh_files(host)

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        user = host.user
        peers = [p for p in host.play_hosts if p != host.name]
        if not peers:
            return Plan.skip("no peers in this play")
        pubs, pins, addresses, pending = {}, {}, {}, []
        for p in peers:
            ssh, fab = SSH_KEY.read(host.exports, p), FABRIC.read(host.exports, p)
            if not ssh or not fab:
                return Plan.fail(f"{host.name}: peer {p} exported no {'ssh key' if not ssh else 'fabric'} "
                                 "(ssh_keypair and fabric run in an earlier play)")
            addrs = [r["address"] for r in fab["rails"]]
            addresses[p] = addrs
            if ssh["pub"]:
                pubs[p] = ssh["pub"]
            else:
                pending.append(p)
            pins[",".join(addrs)] = ssh["host_keys"]
        if pending and not host.check:
            return Plan.fail(f"{host.name}: peers {', '.join(pending)} have no mesh key after ssh_keypair")
        ak, kh, cf = facts.authorized_keys, facts.known_hosts, facts.config
        changes = []
        before = ak["content"]
        after = authorized_after(before, pubs)
        in_home = ak["path"].startswith(host.home.rstrip("/") + "/") if host.home else False
        if after != before or pending:
            owner = ak.get("owner") or (user if in_home else "root")
            group = ak.get("group") or ("" if in_home else "root")
            mode = format(ak.get("mode") or (0o600 if in_home else 0o644), "04o")
            who = sorted(set(pubs) | set(pending))
            note = f" (generated in this run: {', '.join(pending)})" if pending else ""
            changes.append(Change(f"authorize the mesh keys of {', '.join(who)} in {ak['path']}{note}",
                                  write_file_script(ak["path"], after.encode(), mode=mode, owner=owner, group=group),
                                  Diff(ak["path"], before, after), [AuthorizedKeys(user)]))
        khp = host.path("~/.ssh/known_hosts")
        kb = _text(kh) if kh["exists"] else ""
        ka = known_hosts_after(kb, pins)
        if ka != kb:
            changes.append(Change(f"pin the host keys of {', '.join(peers)} for their fabric addresses in {khp}",
                                  write_file_script(khp, ka.encode(), mode=format(kh.get("mode") or 0o644, "04o"), owner=user),
                                  Diff(khp, kb, ka), [PathState("~/.ssh/known_hosts", with_content=True)]))
        cfp = host.path("~/.ssh/config")
        cb = _text(cf) if cf["exists"] else ""
        all_addrs = [a for p in peers for a in addresses[p]]
        ca = config_after(cb, all_addrs, args.key)
        if ca != cb:
            changes.append(Change(f"use {args.key} for the peers' fabric addresses in {cfp}",
                                  write_file_script(cfp, ca.encode(), mode=format(cf.get("mode") or 0o600, "04o"), owner=user),
                                  Diff(cfp, cb, ca), [PathState("~/.ssh/config", with_content=True)]))
        return Plan(changes, msg=f"{len(peers)} peer(s): " + ", ".join(f"{p} {' '.join(addresses[p])}" for p in peers),
                    exports=SSH_MESH({"peers": addresses, "converged": not changes, "digest": _digest(after, ka, ca)}))


def _digest(*contents: str) -> str:
    """What this node's logins depend on, as converged (authorized_keys, known_hosts, config):
    part of fabric_mesh's proof key, so that a change on either end proves the mesh again."""
    import hashlib

    return hashlib.sha256("\0".join(contents).encode()).hexdigest()
