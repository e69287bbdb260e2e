from __future__ import annotations

import socket

import pytest

from tests.models.hf_fixtures import save_hf_model


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    """A tiny random NemotronH with a word-level tokenizer over "t0".."t95" (EOS "t95")."""
    path = tmp_path_factory.mktemp("nemotron_h")
    save_hf_model("nemotron_h", path)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
