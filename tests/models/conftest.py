from __future__ import annotations

import pytest
import torch

from tests.models.hf_fixtures import MOE_KINDS, save_hf_model


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """These models are tiny: a second intra-op thread buys nothing, and on a busy machine every
    parallel op waits for a thread that is not running. An MoE step is many small ops (a few
    an expert): its flat-batch tests took 73 s with torch's default threads at load 10 on two
    cores, 6 s with one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", params=["nemotron_h", "qwen3", "qwen3_5", *MOE_KINDS])
def hf_model(request, tmp_path_factory):
    """(kind, path, transformers model) for each supported architecture and its MoE variant
    (those saved sharded, Qwen3.5-MoE as the released multimodal directory)."""
    out = tmp_path_factory.mktemp(request.param)
    return request.param, out, save_hf_model(request.param, out)


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request):
    """Run a test on the C++ CPU kernels and again on the torch path (the one a GPU takes), so
    both stay covered on a CPU-only machine: the kernel choice a worker would decide with
    `--cpu-kernels` or `--no-cpu-kernels`, installed for the test (a model packed under the
    first then runs none of them, panel_linear included, under the second)."""
    from kernels.cpu import ops as cpu_kernels

    choice = cpu_kernels.decide(request.param == "kernel")
    if request.param == "kernel":
        assert choice.on, f"the CPU kernels are off: {choice.why}"
    with cpu_kernels.using(choice):
        yield request.param
