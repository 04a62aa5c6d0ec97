"""SSH identities for the mesh (ssh_keypair, ssh_mesh): the node's key pair and host keys, a user's
authorized_keys."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from sparkprov.facts.base import Fact, FactError, ShellCtx, home_of, key_values
from sparkprov.transport.shell import quote

# ---------------------------------------------------------------------------------------------
# SSH identities (ssh_mesh)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SshIdentity(Fact):
    """A key pair of the login user (public half and private key's mode only: the private key
    itself is never read) and this host's public host keys."""

    keyfile: str  # path of the private key, e.g. ~/.ssh/id_ed25519_sparkprov

    def command(self, sh: ShellCtx) -> str:
        k = sh.path(self.keyfile)
        return (f"k={k}\n"
                "if [ -f \"$k\" ]; then stat -c 'key=%U|%a' -- \"$k\"; else echo key=absent; fi\n"
                # `read` is a builtin: no process per key file
                "if [ -f \"$k.pub\" ]; then l=; read -r l < \"$k.pub\"; printf 'pub=%s\\n' \"$l\"; fi\n"
                "for f in /etc/ssh/ssh_host_*_key.pub; do [ -r \"$f\" ] && read -r t b _ < \"$f\" && "
                "printf 'hostkey=%s %s\\n' \"$t\" \"$b\"; done; true")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        state: dict[str, Any] = {"exists": False, "pub": None, "host_keys": []}
        for line in out.splitlines():
            k, _, v = line.partition("=")
            if k == "key" and v != "absent":
                owner, mode = v.split("|")
                state.update(exists=True, owner=owner, mode=int(mode, 8))
            elif k == "pub":
                state["pub"] = v.strip() or None
            elif k == "hostkey" and v.strip():
                state["host_keys"].append(v.strip())
        if state["pub"] and "PRIVATE KEY" in state["pub"]:
            raise FactError(f"{self.keyfile}.pub holds a private key")
        return state


@dataclass(frozen=True)
class AuthorizedKeys(Fact):
    """The authorized_keys file sshd reads for USER (first AuthorizedKeysFile entry from
    `sshd -T`, else sshd_config, else ~/.ssh/authorized_keys), with %u/%h expanded; its state
    and content."""

    user: str
    needs_root = True

    def command(self, sh: ShellCtx) -> str:
        u = quote(self.user)
        return (
            f"u={u}; " + home_of("h", '"$u"') + "\n"
            "f=$( (sshd -T -C user=\"$u\",host=localhost,addr=127.0.0.1 2>/dev/null || /usr/sbin/sshd -T -C user=\"$u\",host=localhost,addr=127.0.0.1 2>/dev/null) "
            "| awk 'tolower($1)==\"authorizedkeysfile\" {print $2; exit}')\n"
            "[ -n \"$f\" ] || f=$(cat /etc/ssh/sshd_config /etc/ssh/sshd_config.d/*.conf 2>/dev/null | "
            "awk 'tolower($1)==\"authorizedkeysfile\" {print $2; exit}')\n"
            "[ -n \"$f\" ] || f=.ssh/authorized_keys\n"
            "case \"$f\" in *%*) f=$(printf '%s' \"$f\" | sed -e \"s|%%|\\x01|g\" -e \"s|%u|$u|g\" -e \"s|%h|$h|g\" -e \"s|\\x01|%|g\");; esac\n"
            "case \"$f\" in /*) ;; *) f=\"$h/$f\";; esac\n"
            "printf 'path=%s\\n' \"$f\"\n"
            "if [ -f \"$f\" ]; then stat -c 'stat=%U|%G|%a' -- \"$f\"; echo @content; base64 < \"$f\"; fi"
        )

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        head, _, content = out.partition("@content\n")
        kv = key_values(head)
        if "path" not in kv:
            raise FactError(err.strip() or "cannot find the authorized_keys file")
        state: dict[str, Any] = {"path": kv["path"], "exists": "stat" in kv, "content": ""}
        if "stat" in kv:
            owner, group, mode = kv["stat"].split("|")
            state.update(owner=owner, group=group, mode=int(mode, 8),
                         content=base64.b64decode("".join(content.split())).decode(errors="replace"))
        return state
