"""Every inventory variable sparkprov reads, declared once: its name, what it accepts (type and
range), its default with the source of that default, who reads it, and what it does.

The inventory is checked against this table when it is loaded (sparkprov/data/inventory.py),
before any host is contacted: a value of the wrong type or out of range is one line at its
FILE:LINE:COL saying what the variable accepts, and a variable that is not declared but is close
to one that is (`guard_interval` for `guard_interval_s`) is named with the suggestion. A variable
of the user's own, far from every declared name, is left alone: playbooks may use it.

Code reads a variable only through `value(variables, name)` (or `setting(...)`, where a task
argument may override it): the default comes from here and the value is checked again, so a
play variable or an extra var of the wrong type is refused in the same words.

This module sits below every layer (.importlinter): data, engine, modules, serving, staging,
catalog and the plays import it, and it imports nothing of sparkprov but the node guard's own
table of settings (`guard_variables`: sparkprov/node/settings.py). The README's list of variables is generated from it (`invoke schema`).
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from sparkprov.errors import InputError

# -- what a value may be -----------------------------------------------------------------------------


class VarError(InputError, ValueError):
    """A variable's value that its declaration refuses: the message names it, the fix says what it
    accepts. An InputError (one line; a task planning with it fails with that line)."""

    def __init__(self, message: str, fix: str):
        super().__init__(message, fix=fix)


def shown(value: Any) -> str:
    """A value as the user wrote it in YAML (true, not True; .nan, not nan), cut to stay one line."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else ("-.inf" if value < 0 else ".inf")
    if isinstance(value, dict):
        return "a mapping"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Refusal(ValueError):
    """Why a kind refuses a value, with a fix of its own where "give <accepts>" is not the best one."""

    def __init__(self, reason: str, fix: str | None = None):
        super().__init__(reason)
        self.fix = fix


@dataclass(frozen=True)
class Kind:
    """What a variable accepts. `check` returns the value as readers get it (a list of interface
    names from "a,b" too) or raises ValueError with the reason; `accepts` is said in the fix."""

    accepts: str

    def check(self, v: Any) -> Any:  # pragma: no cover - every kind overrides it
        raise NotImplementedError

    def json_schema(self) -> dict[str, Any]:
        return {}


def _not_bool(v: Any, what: str) -> None:
    # YAML's true is a bool, and bool is an int to Python: `port: true` would be port 1
    if isinstance(v, bool):
        raise ValueError(f"is a boolean, not {what}")


@dataclass(frozen=True)
class Number(Kind):
    """A number in [lo, hi] (an end is open where lo_open/hi_open); `whole`: an integer."""

    lo: float | None = None
    hi: float | None = None
    whole: bool = False
    lo_open: bool = False
    hi_open: bool = False
    noun: str = ""  # "a port": every refusal says "is not a port"

    def check(self, v: Any) -> Any:
        what = self.noun or ("a whole number" if self.whole else "a number")
        _not_bool(v, what)
        if self.whole and isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        if not isinstance(v, (int, float)) or (self.whole and not isinstance(v, int)):
            raise ValueError(f"is not {what}")
        if not math.isfinite(v):
            raise ValueError(f"is not {self.noun or 'a finite number'}")
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo) or \
                self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi):
            raise ValueError(f"is not {self.noun}" if self.noun else "is out of range")
        return v if self.whole else float(v)

    def json_schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "integer" if self.whole else "number"}
        if self.lo is not None:
            out["exclusiveMinimum" if self.lo_open else "minimum"] = self.lo
        if self.hi is not None:
            out["exclusiveMaximum" if self.hi_open else "maximum"] = self.hi
        return out


def number(lo: float | None, hi: float | None, *, whole: bool = False, lo_open: bool = False, hi_open: bool = False,
           unit: str = "") -> Number:
    """A Number with its `accepts` said in words ("a number above 0 and at most 1")."""
    parts = ["a whole number" if whole else "a number"]
    if lo is not None and hi is not None and not lo_open and not hi_open:
        parts.append(f"from {lo:g} to {hi:g}")
    else:
        ends = []
        if lo is not None:
            ends.append(f"above {lo:g}" if lo_open else f"at least {lo:g}")
        if hi is not None:
            ends.append(f"below {hi:g}" if hi_open else f"at most {hi:g}")
        parts.append(" and ".join(ends))
    if unit:
        parts.append(f"({unit})")
    return Number(" ".join(p for p in parts if p), lo, hi, whole, lo_open, hi_open)


PORT = Number("a whole number from 1 to 65535", 1, 65535, True, noun="a port")


@dataclass(frozen=True)
class Flag(Kind):
    def check(self, v: Any) -> Any:
        if not isinstance(v, bool):
            raise ValueError("is not true or false")
        return v

    def json_schema(self) -> dict[str, Any]:
        return {"type": "boolean"}


FLAG = Flag("true or false")


def _one_line_text(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise ValueError(f"is not {what}")
    if not v.strip() or any(not c.isprintable() for c in v):
        raise ValueError(f"is not {what} (empty, or a line break or control character in it)")
    return v


@dataclass(frozen=True)
class Text(Kind):
    """One line of text matching `pattern` (a full match), at most `max_len` characters."""

    pattern: str = r"[^\s].*"
    what: str = "text"
    max_len: int = 256

    def check(self, v: Any) -> Any:
        _one_line_text(v, self.what)
        if len(v) > self.max_len or not re.fullmatch(self.pattern, v):
            raise ValueError(f"is not {self.what}")
        return v

    def json_schema(self) -> dict[str, Any]:
        return {"type": "string", "maxLength": self.max_len}


@dataclass(frozen=True)
class HostPath(Kind):
    """A path on the host: absolute, or `~/...` in the login user's home there (never `~other/`:
    sparkprov expands only the login user's home, and a relative path would depend on the working
    folder of whatever reads it); no `..` (the store's paths are compared as written); not / or ~
    itself (provision chowns the store); one line.
    `empty_means_none`: "" is allowed and means "none" (api_key_file: no API key)."""

    empty_means_none: bool = False

    def check(self, v: Any) -> Any:
        if self.empty_means_none and v in ("", False):
            return ""
        if not isinstance(v, str):
            raise Refusal("is not a path", 'write it as a string, e.g. "~/vllm"')
        if any(not c.isprintable() for c in v):
            raise Refusal("is not a usable path", "remove newlines, carriage returns and other control characters")
        if not v.strip():
            raise ValueError("is not a usable path")
        if v.startswith("~") and not (v == "~" or v.startswith("~/")):
            raise ValueError("names another user's home (~user)")
        if not (v.startswith("/") or v == "~" or v.startswith("~/")):
            raise ValueError("is a relative path")
        if ".." in v.split("/"):
            raise ValueError("goes up with '..'")
        if v.rstrip("/") in ("", "~"):
            raise ValueError("is / or ~ itself, not a place of its own")
        if len(v) > 4096:
            raise ValueError("is longer than a path may be")
        return v

    def json_schema(self) -> dict[str, Any]:
        return {"type": "string", "pattern": r"^(/|~/)" + ("|^$" if self.empty_means_none else "")}


def host_path(*, empty_means_none: bool = False) -> HostPath:
    return HostPath("an absolute path or ~/path (in the login user's home on the host), one line, no '..'"
                    + ('; "" for none' if empty_means_none else ""), empty_means_none)


# RFC 1123 host name labels (underscore allowed: ~/.ssh/config aliases use it); no label starts
# or ends with '-', so an address can never read as an option on an ssh or rsync command line.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


def valid_address(v: Any) -> bool:
    """A host name, an IPv4 address or an IPv6 address (bare, optionally with a %scope)."""
    if not isinstance(v, str) or not v or len(v) > 253:
        return False
    if ":" in v:
        addr, _, scope = v.partition("%")
        try:
            ipaddress.IPv6Address(addr)
        except ValueError:
            return False
        return not scope or bool(re.fullmatch(r"[A-Za-z0-9_.-]{1,15}", scope)) and not scope.startswith("-")
    if re.fullmatch(r"[0-9.]+", v):  # all digits and dots: must be a real IPv4 address
        try:
            ipaddress.IPv4Address(v)
        except ValueError:
            return False
        return True
    return bool(_HOSTNAME.fullmatch(v))


@dataclass(frozen=True)
class IPAddress(Kind):
    """An IPv4 or IPv6 address (no host name: it lands in VLLM_HOST_IP, --master-addr, a bind)."""

    def check(self, v: Any) -> Any:
        if not isinstance(v, str):
            raise ValueError("is not an IP address")
        try:
            ipaddress.ip_address(v)
        except ValueError:
            raise ValueError("is not an IP address") from None
        return v

    def json_schema(self) -> dict[str, Any]:
        return {"type": "string", "anyOf": [{"format": "ipv4"}, {"format": "ipv6"}]}


IP = IPAddress("an IPv4 or IPv6 address, e.g. 192.168.100.10")


def interface_name_ok(name: Any) -> bool:
    """A Linux network interface name as the kernel takes it (dev_valid_name: at most IFNAMSIZ-1 =
    15 bytes, not . or .., no '/', ':' or white space), kept to the characters real names use:
    NCCL reads a comma-separated list with ^ and = prefixes, so ',' '^' '=' could never name one."""
    return isinstance(name, str) and name not in (".", "..") and bool(re.fullmatch(r"[A-Za-z0-9._@-]{1,15}", name)) \
        and not name.startswith("-")


def hca_name_ok(name: Any) -> bool:
    """An RDMA device name as NCCL_IB_HCA takes it: the device (IB_DEVICE_NAME_MAX 64, e.g.
    rocep1s0f1, mlx5_0), optionally :PORT."""
    return isinstance(name, str) and bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}(:[0-9]{1,3})?", name))


@dataclass(frozen=True)
class Names(Kind):
    """A list of names (or one string of them separated by commas or spaces), each passing `ok`."""

    ok: Any = None
    what: str = "a name"

    def check(self, v: Any) -> Any:
        plural = self.what.split(" ", 1)[1] + "s"
        if isinstance(v, str):
            if any(not c.isprintable() for c in v):
                raise ValueError(f"is not a list of {plural} (a line break or control character in it)")
            items: list[Any] = [x for x in v.replace(",", " ").split(" ") if x]
        elif isinstance(v, list):
            items = v
        else:
            raise ValueError(f"is not a list of {plural}")
        for item in items:
            if not self.ok(item):
                raise ValueError(f"holds {shown(item)}, which is not {self.what}")
        return [str(x) for x in items]

    def json_schema(self) -> dict[str, Any]:
        return {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}]}


IFACES = Names("interface names, a list or comma-separated (1-15 of A-Z a-z 0-9 . _ @ -, e.g. enp1s0f1np1)",
               interface_name_ok, "an interface name")
HCAS = Names("RDMA device names, a list or comma-separated (e.g. rocep1s0f1,roceP2p1s0f1; an optional :PORT)",
             hca_name_ok, "an RDMA device name")


@dataclass(frozen=True)
class Strings(Kind):
    """A list of one-line strings (argv words, CIDRs...), each passing `item` when given."""

    item: Any = None
    what: str = "a string"

    def check(self, v: Any) -> Any:
        if not isinstance(v, list):
            raise ValueError(f"is not a list of {self.what.split(' ', 1)[1]}s")
        for x in v:
            if not isinstance(x, str) or any(not c.isprintable() for c in x):
                raise ValueError(f"holds {shown(x)}, which is not {self.what}")
            if self.item is not None:
                try:
                    self.item(x)
                except ValueError:
                    raise ValueError(f"holds {shown(x)}, which is not {self.what}") from None
        return list(v)

    def json_schema(self) -> dict[str, Any]:
        return {"type": "array", "items": {"type": "string"}}


@dataclass(frozen=True)
class WholeNumbers(Kind):
    lo: int = 0
    hi: int = 2**31

    def check(self, v: Any) -> Any:
        if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) or not self.lo <= x <= self.hi
                                          for x in v):
            raise ValueError("is not a list of whole numbers in range")
        return list(v)

    def json_schema(self) -> dict[str, Any]:
        return {"type": "array", "items": {"type": "integer", "minimum": self.lo, "maximum": self.hi}}


@dataclass(frozen=True)
class Special(Kind):
    """A value whose full rule lives with the code that owns it (an image reference: the
    catalog's; a hub endpoint: staging's; a host: the inventory's). Here: a string; the inventory
    loader applies the owner's rule (`rule`) at the value's line, in the owner's words."""

    rule: str = ""

    def check(self, v: Any) -> Any:
        if not isinstance(v, str):
            raise ValueError("is not a string")
        return v

    def json_schema(self) -> dict[str, Any]:
        return {"type": "string"}


@dataclass(frozen=True)
class Owned(Kind):
    """A value whose shape is checked here (`shape`) and whose whole rule lives with the code that
    owns it (the fabric's cabling: facts/topology.py check_var); the inventory loader applies the
    owner's `rule` at the value's line, in the owner's words."""

    rule: str = ""
    shape: Kind | None = None

    def check(self, v: Any) -> Any:
        return v if self.shape is None else self.shape.check(v)

    def json_schema(self) -> dict[str, Any]:
        return {} if self.shape is None else self.shape.json_schema()


# The fabric's cablings (issue 34): facts/topology.py discovers one of these, `invoke plan --topology`
# and the inventory's fabric_topology name one
TOPOLOGIES = ("pair", "mesh", "ring", "switch")
_ONE_TOPOLOGY = "one of " + ", ".join(TOPOLOGIES)

IMAGE = Special("an image reference, registry/repo[:tag][@sha256:...]", "image")
URL = Special("an http(s) URL, e.g. https://huggingface.co", "url")
INVENTORY_HOST = Special("the name of a host of this inventory", "host")

# Prometheus' own duration syntax, as `invoke monitor --scrape-interval` takes it (cli/monitor.py)
DURATION_RE = r"[1-9][0-9]*(ms|s|m)"
DURATION = Text("a duration, e.g. 15s, 500ms or 1m", DURATION_RE, "a duration", 16)
VERSION = Text("a version, e.g. 580.95.05", r"[0-9]+(\.[0-9]+){0,3}", "a version", 32)
ENV_NAME = Text("an environment variable name", r"[A-Za-z_][A-Za-z0-9_]*", "an environment variable name", 128)


def _cidr(text: str) -> None:
    ipaddress.ip_interface(text)
    if "/" not in text:
        raise ValueError(text)


CIDRS = Strings("a list of ADDRESS/PREFIX, e.g. [192.168.100.0/24]", _cidr, "a CIDR")
ARGV = Strings("a list of words, e.g. [nvidia-smi]", None, "a one-line word")

# -- the declaration ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Var:
    name: str
    kind: Kind
    default: Any
    source: str             # where the default comes from (a measurement, a note, a choice of ours)
    readers: tuple[str, ...]
    doc: str                # one line: what it does

    def check(self, v: Any) -> Any:
        """The value as readers get it; VarError naming the variable and what it accepts."""
        try:
            return self.kind.check(v)
        except ValueError as exc:
            raise VarError(f"{self.name}: {shown(v)} {exc}",
                           getattr(exc, "fix", None) or f"give {self.kind.accepts}") from None


# Who reads them (one name per reader, as the README lists them)
RENDER = "recipe rendering (invoke recipe, lint, cluster-up)"
PLAN = "invoke plan"
STAGE = "stage-weights"
STORE = "invoke store"
PROVISION = "provision"
GATEWAY = "invoke gateway"
MONITOR = "invoke monitor"
GUARD = "the node guard (provision)"
CLUSTER = "cluster-up"

_DECLARED: list[Var] = [
    # -- serving: where things live on a host and how the API is reached -----------------------------
    Var("model_store", host_path(), "~/vllm", "seed 001 §3: HF_HOME with the hub layout, same path in the container (G22)",
        (RENDER, STAGE, STORE, PROVISION, CLUSTER), "the model store on the host (HF_HOME)"),
    Var("compile_cache", host_path(), "~/vllm-compile-cache", "seed 001 §4: -v ~/vllm-compile-cache:/root/.cache/vllm",
        (RENDER, STORE, PROVISION), "vLLM's compile cache, mounted at /root/.cache/vllm"),
    Var("api_key_file", host_path(empty_means_none=True), "~/.config/sparkprov/api_key",
        "seed 001 §14.4: a persistent API key (G31), a 0600 file read into VLLM_API_KEY",
        (RENDER, CLUSTER, MONITOR), 'the API key file on the head ("" for no key)'),
    Var("serve_port", PORT, 8000, "vLLM's default port (seed 001 §3)", (RENDER, CLUSTER, MONITOR),
        "the port of a deployment's API"),
    Var("serve_bind", IP, "0.0.0.0", "host networking (G31): the API on every address, the firewall keeps it to peers",
        (RENDER, CLUSTER, MONITOR), "the address vLLM binds (--host)"),
    # -- the fabric a multi-node launch runs over -----------------------------------------------------
    Var("fabric_ip", IP, None, "none: the fabric fact (provision) fills it at cluster-up",
        (RENDER, CLUSTER), "this node's fabric address (VLLM_HOST_IP, --master-addr on rank 0)"),
    Var("fabric_ifaces", IFACES, None, "none: the fabric fact (the Up ConnectX-7 twins) at cluster-up",
        (RENDER, CLUSTER), "the fabric interfaces (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)"),
    Var("ib_hcas", HCAS, None, "none: every rail's HCA from the fabric fact at cluster-up",
        (RENDER, CLUSTER, PROVISION), "the RDMA devices NCCL uses (NCCL_IB_HCA)"),
    Var("fabric_address", IP, None, "none: the fabric fact's node address", (STAGE,),
        "the address other Sparks fetch staged weights from"),
    Var("fabric_rails", IFACES, None, "none: the ConnectX-7 twins ibdev2netdev shows Up", (PROVISION,),
        "the interfaces provision configures as fabric rails"),
    Var("fabric_subnets", CIDRS, None, "none: modules/fabric.py's pool, minus subnets routed elsewhere", (PROVISION,),
        "one subnet per rail"),
    Var("fabric_addresses", CIDRS, None, "none: host number fabric_host_id in each rail's subnet", (PROVISION,),
        "this host's ADDRESS/PREFIX on each rail"),
    Var("fabric_host_id", number(1, 254, whole=True), None, "none: 10 + the host's position in the inventory",
        (PROVISION,), "this host's number in each rail's subnet"),
    # the fabric's topology (issue 34; facts/topology.py): discovered by provision; an owner may pin it,
    # and a declaration the cabling contradicts is refused naming the link
    Var("fabric_topology", Text(_ONE_TOPOLOGY, "|".join(TOPOLOGIES), _ONE_TOPOLOGY, 16), None,
        "none: discovered by provision (which port reaches which peer's)", (PROVISION, CLUSTER, PLAN),
        "the cabling as the owner pins it"),
    Var("fabric_links", Owned("a list of cables, each \"HOST:PORT HOST:PORT\" with PORT p0, p1 or a ConnectX-7 "
                              "interface (e.g. \"spark1:p0 spark2:p1\")", "fabric",
                              Strings("", None, "a one-line cable")), None,
        "none: discovered by provision", (PROVISION,), "the cables as the owner pins them"),
    Var("fabric_requalify", FLAG, False, "sparkprov: measure only when something the figure depends on changed",
        (PROVISION,), "true: measure the rails on this run whatever the record says"),
    Var("fabric_qualify_max_age_hours", number(0, 100000, lo_open=True, unit="hours"), 168.0,
        "sparkprov: a week; a record older than this is measured again", (PROVISION,),
        "hours after which a qualification is measured again"),
    # Under this a rail fails: half the lower healthy figure (92.57 / 2). The degraded links seen on
    # Sparks are far under it: 13.23 Gb/s (8-QP ib_write_bw) and 12.86 Gb/s (TCP) on a 200G link
    # that ethtool called healthy (NVIDIA/dgx-spark-playbooks PR#108, whose own check flags 8-25 Gb/s;
    # gb10-failure-outputs.md §4.8); a port that negotiated 100000Mb/s instead of 200000Mb/s (§4.3,
    # NVIDIA's multi-sparks-through-switch README) leaves its two twins half the bandwidth together.
    Var("rail_min_gbps", number(0, 1000, lo_open=True, unit="Gb/s"), 46.0,
        "half the lower healthy figure, 92.57 / 2; degraded links carried 13 (dgx-spark-playbooks PR#108; "
        "gb10-failure-outputs.md §4.5, §4.8)", (PROVISION, CLUSTER, GUARD),
        "a rail carrying less fails qualification (and multi-node starts over it)"),
    # A healthy GB10 rail (one ConnectX-7 twin) carries 92.57 and 97.28 Gb/s with ib_write_bw at 1 QP
    # (NVIDIA/dgx-spark-playbooks performance_benchmarking_guide.md, commit 998f217a; cited as the
    # healthy reference by PR#108; gb10-failure-outputs.md §4.5).
    Var("rail_expected_gbps", number(0, 1000, lo_open=True, unit="Gb/s"), 90.0,
        "a healthy rail carries 92.57-97.28 Gb/s at 1 QP (NVIDIA performance_benchmarking_guide.md, commit 998f217a; "
        "gb10-failure-outputs.md §4.5)", (PROVISION,),
        "a rail carrying less is warned about (at least rail_min_gbps)"),
    # -- memory: what the planner and lint assume of a host ------------------------------------------
    Var("host_memory_gib", number(0, 1024, lo_open=True, unit="GiB"), 119.6,
        "seed 002: '0.55 -> ~65.8 GB reserved', '119 GB total' (catalog/memory.py)", (PLAN, RENDER),
        "the unified memory vLLM sees on the host"),
    Var("max_gpu_memory_utilization", number(0, 1, lo_open=True), None,
        "none: set on a host with nvidia modeset=0, whose cap gpu_check reports (G18)", (PLAN, RENDER, PROVISION),
        "the highest --gpu-memory-utilization the host allows"),
    Var("other_services_gib", number(0, 1024, unit="GiB"), 0.0, "none: nothing else runs beside vLLM", (PLAN, RENDER),
        "memory other services on the host hold"),
    Var("min_headroom_gib", number(0, 1024, unit="GiB"), 4.0,
        "sparkprov: what the OS, sshd, docker and the page cache keep at least (catalog/memory.py)", (PLAN, RENDER),
        "memory left free beside vLLM's budget"),
    Var("driver_version", VERSION, None, "none: gpu_check's nvidia-smi at cluster-up", (RENDER,),
        "the host's NVIDIA driver, for lint's image rules"),
    Var("min_driver", VERSION, None, "none: the catalog images' own minimum", (PROVISION,),
        "the lowest driver gpu_check accepts where the images state none"),
    # -- staging and provisioning --------------------------------------------------------------------
    Var("hf_endpoint", URL, "https://huggingface.co", "the Hugging Face Hub", (STAGE,),
        "the hub stage-weights downloads from (a mirror, the lab's hub)"),
    Var("stage_image", IMAGE, None, "none: the catalog's image of the model, else the host's python3", (STAGE,),
        "the image stage-weights hashes and downloads in"),
    Var("hf_token_file", host_path(), None, "none: the token from HF_TOKEN or the huggingface login", (RENDER,),
        "a token file for gated repos (lint notes that one is available)"),
    Var("hf_token_env", ENV_NAME, None, "none", (RENDER,), "an environment variable holding the token (as above)"),
    Var("smoke_image", IMAGE, None, "none: the GPU smoke test is skipped", (PROVISION,),
        "the image `docker run --gpus all` is checked with"),
    Var("smoke_command", ARGV, [], "none: the image's own command", (PROVISION,), "the smoke test's command"),
    Var("native_runtime", FLAG, False, "sparkprov: containers are the default runtime", (PROVISION,),
        "provision fails where the native runtime (no docker) is missing"),
    # -- the gateway and the monitor ------------------------------------------------------------------
    Var("gateway_host", INVENTORY_HOST, None, "none: the first target host", (GATEWAY,), "where the gateway runs"),
    Var("gateway_port", PORT, 4000, "LiteLLM's default port", (GATEWAY,), "the gateway's port"),
    Var("gateway_image", IMAGE, "ghcr.io/berriai/litellm:main-stable", "LiteLLM's image (pin it)", (GATEWAY,),
        "the gateway's image"),
    Var("ondemand_budget_gib", number(0, 1024, unit="GiB"), None,
        "none: host_memory_gib less min_headroom_gib less what the deployments not on demand that run there "
        "reserve (0.9 of the host each: vLLM's default; their containers do not say theirs)", (GATEWAY,),
        "what on-demand deployments may take of this host (the gateway's admission, docs/on-demand.md)"),
    Var("monitor_host", INVENTORY_HOST, None, "none: the first target host", (MONITOR,), "where Prometheus runs"),
    Var("prometheus_port", PORT, 9090, "Prometheus' default port", (MONITOR,), "Prometheus' port"),
    Var("prometheus_image", IMAGE, "prom/prometheus:v3.5.0", "an LTS release of upstream's image (pin a digest)",
        (MONITOR,), "Prometheus' image"),
    Var("prometheus_bind", IP, None, "none: the host's first fabric address, else its inventory address", (MONITOR,),
        "the address Prometheus binds"),
    Var("prometheus_scrape_interval", DURATION, "15s", "Prometheus' usual interval", (MONITOR,),
        "how often Prometheus scrapes (written into prometheus.yml)"),
]

# -- the node guard's settings: guard_<key> -----------------------------------------------------------

# Each guard setting is a row of the node guard's own table (sparkprov/node/settings.py: type, bounds,
# default, the default's source), which the program on the node reads too.
_GUARD_UNITS = {"_s": "seconds", "_h": "hours", "_gib": "GiB", "_mib": "MiB"}


def _guard_kind(name: str, kind: str, lo: float | None, hi: float | None) -> Kind:
    """The declaration's kind for a setting of the node guard's table (sparkprov/node/settings.py),
    its unit said as its name's suffix says it."""
    if name == "port":
        return PORT
    if kind in ("float", "int"):
        unit = next((u for suffix, u in _GUARD_UNITS.items() if name.endswith(suffix)), "")
        return number(lo, hi, whole=kind == "int", unit=unit)
    if kind == "list[int]":
        return WholeNumbers(f"a list of whole numbers from {lo:g} to {hi:g}", int(lo or 0), int(hi or 0))
    return {"bool": FLAG, "path": Text("an absolute path", r"/.*", "an absolute path", 4096),
            "str": Text("a command name or path", r"[^\s].*", "a command name or path", 4096),
            "list[str]": IFACES}[kind]


def guard_variables() -> list[Var]:
    """`guard_<name>` for every setting of the node guard's table (sparkprov/node/settings.py, which
    the node reads too): its bounds, default and the default's source are the table's. The one place
    the guard's settings become inventory variables."""
    from sparkprov.node.settings import SETTINGS

    return [Var(f"guard_{name}", _guard_kind(name, kind, lo, hi), default, "sparkprov/node/settings.py", (GUARD,), source)
            for name, kind, lo, hi, default, source in SETTINGS]


GUARD_PREFIX = "guard_"


def _table() -> dict[str, Var]:
    out: dict[str, Var] = {}
    for var in _DECLARED + guard_variables():
        assert var.name not in out, var.name
        out[var.name] = var
    return out


VARS: dict[str, Var] = _table()


def default(name: str) -> Any:
    """A variable's default, in the form its readers get a value (20 seconds as 20.0; a list is a
    fresh copy: a reader may extend it)."""
    var = VARS[name]
    return None if var.default is None else var.kind.check(var.default)


def value(variables: Mapping[str, Any], name: str) -> Any:
    """The variable as a reader uses it: its value where set (not null), checked and normalized,
    else its default. VarError when the value is not what it accepts (a play or extra variable:
    the inventory's own values were checked when it was loaded)."""
    var = VARS[name]  # KeyError: a read of a variable nobody declared
    if name not in variables or variables[name] is None:
        return default(name)
    return var.check(variables[name])


def given(variables: Mapping[str, Any], name: str) -> Any:
    """The variable where set (not null), checked and normalized; else None (for a reader whose
    fallback comes before the default: a running container's own image)."""
    return value(variables, name) if variables.get(name) is not None else None


def setting(argument: Any, variables: Mapping[str, Any], name: str) -> Any:
    """A task's argument where given, else the variable (value())."""
    return argument if argument is not None else value(variables, name)


def close_to_declared(name: str) -> str | None:
    """The declared variable a name not declared is probably a misspelling of, or None. Every
    guard_ name is the guard's: one not declared is always named (with the closest)."""
    found = difflib.get_close_matches(name, list(VARS), n=1, cutoff=0.85)
    if found:
        return found[0]
    if name.startswith(GUARD_PREFIX):
        found = difflib.get_close_matches(name, [n for n in VARS if n.startswith(GUARD_PREFIX)], n=1, cutoff=0.0)
        return found[0] if found else None
    return None


def unknown_fix(name: str, close: str) -> str:
    if name.startswith(GUARD_PREFIX) and close.startswith(GUARD_PREFIX):
        return f"did you mean {close!r}? (guard_ names are the node guard's settings)"
    return (f"did you mean {close!r}? (a variable of your own must not be this close to one of sparkprov's: "
            "rename it)")


# -- the README's list ---------------------------------------------------------------------------------

README_BEGIN = "<!-- inventory variables: generated by `invoke schema` from sparkprov/inventory_vars.py -->"
README_END = "<!-- end of inventory variables -->"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default_text(v: Var) -> str:
    if v.default is None or v.default == []:
        return "-"
    if isinstance(v.default, bool):
        return f"`{str(v.default).lower()}`"
    return f"`{v.default}`" if not isinstance(v.default, list) else f"`{', '.join(map(str, v.default))}`"


def readme_table(variables: Iterable[Var] | None = None) -> str:
    """The README section listing every variable (between README_BEGIN and README_END)."""
    rows = [README_BEGIN, "", "| variable | accepts | default (source) | read by | what it does |",
            "|---|---|---|---|---|"]
    for v in variables if variables is not None else VARS.values():
        rows.append(f"| `{v.name}` | {_cell(v.kind.accepts)} | {_cell(_default_text(v))} ({_cell(v.source)}) | "
                    f"{_cell(', '.join(v.readers))} | {_cell(v.doc)} |")
    return "\n".join(rows + ["", README_END])


def json_schema_properties() -> dict[str, Any]:
    """Each variable's JSON Schema, for the `vars:` mappings of schemas/inventory.schema.json."""
    out = {}
    for v in VARS.values():
        schema = dict(v.kind.json_schema())
        schema["description"] = f"{v.doc}. Accepts {v.kind.accepts}."
        if v.default is not None:
            schema["default"] = v.default
        out[v.name] = schema
    return out


__all__ = ["VARS", "Var", "VarError", "value", "setting", "default", "close_to_declared", "guard_variables",
           "valid_address", "interface_name_ok", "hca_name_ok", "readme_table"]
