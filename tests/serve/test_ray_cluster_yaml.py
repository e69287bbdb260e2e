"""`ray_cluster.yaml` passes Ray's own cluster-launcher validation, and its node types carry the
resources that serve/placement.py pins engines with."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from serve.placement import ROLE_RESOURCES

PATH = Path(__file__).resolve().parents[2] / "ray_cluster.yaml"


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return yaml.safe_load(PATH.read_text())


def validate(cfg: dict[str, Any]) -> None:
    validate_config(prepare_config(copy.deepcopy(cfg)))


def test_ray_validates_the_cluster_config(cluster):
    validate(cluster)


def test_prefill_and_decode_node_types_carry_their_resource_and_a_gpu(cluster):
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] in types
    for role, resource in ROLE_RESOURCES.items():
        resources = types[role]["resources"]
        assert resources[resource] >= 1 and resources["GPU"] >= 1, role
    head = types[cluster["head_node_type"]]["resources"]
    assert not set(ROLE_RESOURCES.values()) & set(head), "no engine should be pinned to the head"


def test_setup_installs_the_project_as_the_deploying_guide_does(cluster):
    assert any("make setup" in cmd for cmd in cluster["setup_commands"])
    assert any("ray start --head" in cmd for cmd in cluster["head_start_ray_commands"])


@pytest.mark.parametrize(
    "break_it",
    [
        lambda c: c.update(head_node_type="nowhere"),
        lambda c: c.update(unknown_field=1),
        lambda c: c["available_node_types"]["prefill"].update(resources="prefill"),
    ],
    ids=["unknown head type", "unknown field", "resources not a mapping"],
)
def test_the_validator_rejects_a_broken_variant(cluster, break_it):
    broken = copy.deepcopy(cluster)
    break_it(broken)
    with pytest.raises(Exception):
        validate(broken)
