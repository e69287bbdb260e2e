from __future__ import annotations

import pytest

from tests.models.hf_fixtures import save_hf_model


@pytest.fixture(scope="session", params=["nemotron_h", "qwen3", "qwen3_5"])
def hf_model(request, tmp_path_factory):
    """(kind, path, transformers model) for each supported architecture."""
    out = tmp_path_factory.mktemp(request.param)
    return request.param, out, save_hf_model(request.param, out)


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request, monkeypatch):
    """Run a test on the C++ CPU kernels and again on the torch path (the one a GPU takes), so
    both stay covered on a CPU-only machine."""
    from kernels.cpu import ops as cpu_kernels

    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "usable", lambda *tensors: False)
    else:
        assert cpu_kernels.load() is not None, "the CPU kernels did not build"
    return request.param
