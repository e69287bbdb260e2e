"""Where Ray puts each engine: pure functions from the config, the engine's role and the
cluster's resources to the `.options(...)` of its engine actor and of its worker actor.

Nodes say what they are for with the custom resources `prefill` and `decode` (ray_cluster.yaml,
or `ray start --resources '{"prefill": 1}'` on-prem). A prefill engine asks for a sliver of
`prefill`, a decode engine of `decode`, so each lands on such a node when the cluster has one
and anywhere when it has none (a laptop, CI). The sliver is a label, not a quota: a node with
`prefill: 1` takes up to 1000 engines, and GPUs are what bound them. With `--device cuda` each
worker asks for one GPU, so Ray gives it its own device and no two workers share one; the
engine actors compute nothing and ask for none. Colocated engines go anywhere.

Every process of the service runs at normal priority. Ray starts its worker processes at nice
15 (its `worker_niceness`), so that the raylet and GCS stay responsive when tasks load a node;
raypd's engines, workers and API replicas are the service itself, and at nice 15 any other
process on the node (a client, an agent, a neighbour's busy loop) takes a core from a forward
the moment it wants one. Ray reads the setting from the new process's environment, so the
actor's `runtime_env` carries it (as Ray's job supervisor does for drivers); no privilege is
needed, since the process never lowers its niceness. A cluster raypd starts itself runs every
worker at 0 (serve/launch.py), Serve's proxy and controller among them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.config import Config

ROLE_RESOURCES = {"prefill": "prefill", "decode": "decode"}
LABEL_AMOUNT = 0.001
NORMAL_PRIORITY: dict[str, Any] = {"env_vars": {"RAY_worker_niceness": "0"}}


def role_resources(role: str, cluster_resources: Mapping[str, float]) -> dict[str, float]:
    """The custom resource pinning `role` to its node type, if the cluster has nodes of it."""
    name = ROLE_RESOURCES.get(role)
    return {name: LABEL_AMOUNT} if name is not None and cluster_resources.get(name, 0) > 0 else {}


def engine_options(cfg: Config, role: str, cluster_resources: Mapping[str, float]) -> dict[str, Any]:
    """`.options(...)` for an engine's engine actor (name, namespace and lifetime are the
    caller's: engines are detached named actors, serve/engines.py)."""
    options: dict[str, Any] = {"runtime_env": NORMAL_PRIORITY}
    if resources := role_resources(role, cluster_resources):
        options["resources"] = resources
    return options


def worker_options(cfg: Config, role: str, cluster_resources: Mapping[str, float]) -> dict[str, Any]:
    """`.options(...)` for an engine's worker actor."""
    options: dict[str, Any] = {"runtime_env": NORMAL_PRIORITY}
    if resources := role_resources(role, cluster_resources):
        options["resources"] = resources
    if cfg.device == "cuda":
        options["num_gpus"] = 1
    return options
