"""node_container: the container this node runs for a deployment, built on the control machine.

Reads what the build needs of the node (fabric bindings and driver, for the catalog's launch) and
what the plays before exported (rank 0's fabric address and container ID, every node's image ID
and registry digest, the image's own flags), builds the node's container once (serving/node.py
build: the image decision, the rendered launch, the `docker run` argv, labels and recipe hash) and
hands it to vllm_container, the next task of the same play, which compares it with what runs and
starts it. Changes nothing. Fails, naming every problem, where the node's container cannot start:
rank 0 has no fabric address, the nodes hold different builds of the image (G34), the image's vLLM
does not know a flag (G4), or a pinned deployment (cluster-up --pin) finds no single registry
digest on its nodes.
"""

from __future__ import annotations

from sparkprov.facts.fabric import FabricInfo
from sparkprov.facts.hardware import NvidiaSmi
from sparkprov.modules._serving import ServeArgs, head_ip
from sparkprov.modules.base import FactView, HostContext, Module, Plan
from sparkprov.modules.docker_image import IMAGE_DIGESTS, IMAGE_IDS
from sparkprov.modules.image_flags import IMAGE_FLAGS
from sparkprov.modules.vllm_container import CONTAINERS, NODE_CONTAINER
from sparkprov.serving import node


class BuildNodeContainer(Module):
    name = "node_container"
    Args = ServeArgs
    doc = "This node's container of a deployment, built from its facts and the plays before (for vllm_container)."

    def needs(self, args: ServeArgs, host: HostContext):
        named = {"smi": NvidiaSmi()}
        if args.deployment.cluster:
            named["fabric"] = FabricInfo()
        return named

    def plan(self, args: ServeArgs, facts: FactView, host: HostContext) -> Plan:
        dep, h = args.deployment, host.name
        rank0 = CONTAINERS.entry(host.exports, dep.hosts[0], dep.name) or {}
        built, problems = node.build(dep, node.NodeInputs(
            h, host.vars, host.home, facts.fabric if dep.cluster else None, facts.smi, head_ip(host, dep),
            rank0.get("id"), IMAGE_IDS.by_host(host.exports, dep.hosts), IMAGE_DIGESTS.by_host(host.exports, dep.hosts),
            IMAGE_FLAGS.read(host.exports, dep.hosts[0])))
        if built is None:
            return Plan.fail(" | ".join(problems))
        return Plan(msg=f"{built.spec.name}: recipe {built.spec.hash} ({built.image.runs})",
                    exports=NODE_CONTAINER({**(NODE_CONTAINER.read(host.exports, h) or {}), dep.name: built}))
