"""The facts `invoke facts` shows for a host: what an owner wants to know at a glance."""

from __future__ import annotations

from sparkprov.facts.base import Fact, HostInfo
from sparkprov.facts.fabric import FabricInfo
from sparkprov.facts.hardware import CudaToolkit, KernelCmdline, MemInfo, NvidiaSmi
from sparkprov.facts.runtimes import DockerState, OllamaState
from sparkprov.facts.topology import SPARK_TWINS, FabricNeighbours


def host_profile() -> dict[str, Fact]:
    """Section name -> fact; none needs root."""
    return {"host": HostInfo(), "gpu": NvidiaSmi(), "memory": MemInfo(), "kernel": KernelCmdline(),
            "fabric": FabricInfo(), "docker": DockerState(), "ollama": OllamaState(), "cuda_toolkit": CudaToolkit(),
            "neighbours": FabricNeighbours(SPARK_TWINS)}
