from __future__ import annotations

import pytest

from tests.models.hf_fixtures import save_hf_model


@pytest.fixture(scope="session", params=["nemotron_h", "qwen3", "qwen3_5"])
def hf_model(request, tmp_path_factory):
    """(kind, path, transformers model) for each supported architecture."""
    out = tmp_path_factory.mktemp(request.param)
    return request.param, out, save_hf_model(request.param, out)
