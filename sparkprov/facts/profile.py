"""The facts `invoke facts` shows for a host: what an owner wants to know at a glance."""

from __future__ import annotations

from sparkprov.facts.base import Fact, HostInfo


def host_profile() -> dict[str, Fact]:
    """Section name -> fact. Modules that read hardware add theirs here."""
    profile: dict[str, Fact] = {"host": HostInfo()}
    try:
        from sparkprov.facts.hardware import hardware_profile
    except ImportError:  # hardware facts arrive with the provision modules
        return profile
    profile.update(hardware_profile())
    return profile
