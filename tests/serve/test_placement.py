"""Placement options: pure functions of the config, the role and the cluster's resources."""

from __future__ import annotations

import pytest

from engine.config import Config
from serve.placement import LABEL_AMOUNT, NORMAL_PRIORITY, engine_options, worker_options

PD_CLUSTER = {"CPU": 24.0, "GPU": 2.0, "prefill": 1.0, "decode": 1.0}
PLAIN = {"CPU": 8.0}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_role_goes_to_its_node_type_when_the_cluster_has_one(role):
    cfg = Config(device="cpu")
    want = {"resources": {role: LABEL_AMOUNT}, "runtime_env": NORMAL_PRIORITY}
    assert engine_options(cfg, role, PD_CLUSTER) == want
    assert worker_options(cfg, role, PD_CLUSTER) == want


@pytest.mark.parametrize(
    ("role", "cluster"),
    [
        ("prefill", PLAIN),
        ("decode", PLAIN),
        ("colocated", PD_CLUSTER),
        ("decode", {"CPU": 8.0, "prefill": 1.0}),  # prefill nodes only: decode engines go anywhere
    ],
)
def test_anywhere_without_nodes_of_its_type(role, cluster):
    cfg = Config(device="cpu")
    assert engine_options(cfg, role, cluster) == {"runtime_env": NORMAL_PRIORITY}
    assert worker_options(cfg, role, cluster) == {"runtime_env": NORMAL_PRIORITY}


def test_a_cuda_worker_asks_for_one_gpu_and_its_scheduler_for_none():
    cfg = Config(device="cuda")
    assert worker_options(cfg, "decode", PD_CLUSTER) == {
        "resources": {"decode": LABEL_AMOUNT},
        "num_gpus": 1,
        "runtime_env": NORMAL_PRIORITY,
    }
    assert worker_options(cfg, "colocated", PLAIN) == {"num_gpus": 1, "runtime_env": NORMAL_PRIORITY}
    assert "num_gpus" not in engine_options(cfg, "decode", PD_CLUSTER)
