"""Security at the API (in-process app over an in-process engine, real HTTP via httpx's ASGI
transport): several API keys, size limits with a 400 naming the field, transfer parameters
never taken from a client, the loopback default bind, and no unpickling in the serving code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from api.protocol import MAX_N
from engine.config import Config, ConfigError
from serve.config import load_config
from tests.api.test_app_local import config, run

ROOT = Path(__file__).resolve().parents[2]
BODY = {"model": "tiny", "prompt": "t1 t2 t3", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def test_every_one_of_several_keys_is_accepted_and_nothing_else(checkpoint):
    keys = ("sk-one", "sk-two", "sk-three")

    async def fn(c):
        out = {}
        for key in (*keys, "sk-on", "sk-one-more", "sk-one,sk-two", ""):
            r = await c.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"})
            out[key] = r.status_code
        return out

    got = run(config(checkpoint, api_key=",".join(keys)), fn)
    assert got == {
        "sk-one": 200,
        "sk-two": 200,
        "sk-three": 200,
        "sk-on": 401,
        "sk-one-more": 401,
        "sk-one,sk-two": 401,
        "": 401,
    }


def test_keys_come_from_a_repeated_flag_a_comma_list_or_the_environment():
    assert load_config(["--api-key", "a", "--api-key", "b"], env={}).api_keys == ("a", "b")
    assert load_config(["--api-key", "a,b"], env={}).api_keys == ("a", "b")
    assert load_config([], env={"RAYPD_API_KEY": "a, b"}).api_keys == ("a", "b")
    assert load_config([], env={}).api_keys == ()


@pytest.mark.parametrize("value", ["sk-a,,sk-b", "sk-a,", "sk a", ""])
def test_a_bad_key_list_is_refused_without_quoting_the_keys(value):
    with pytest.raises(ConfigError) as info:
        Config(api_key=value)
    assert info.value.field == "api_key" and "sk" not in str(info.value)


def test_the_server_binds_loopback_unless_told():
    assert Config().host == "127.0.0.1"
    assert load_config([], env={}).host == "127.0.0.1"
    assert load_config(["--host", "0.0.0.0"], env={}).host == "0.0.0.0"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"prompt": " ".join(["t1"] * 256)}, "prompt"),  # the context is 256 tokens
        ({"max_tokens": 256}, "max_tokens"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"n": MAX_N + 1}, "n"),
        ({"prompt": [["t1"]] * 65}, "prompt"),
    ],
)
def test_size_limits_answer_400_naming_the_field(checkpoint, change, param):
    async def fn(c):
        return await c.post("/v1/completions", json={**BODY, **change})

    r = run(config(checkpoint), fn)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_client_cannot_supply_kv_transfer_parameters(checkpoint):
    """A decode engine given a client's transfer parameters would READ whatever memory they name;
    the API has no such field, so they are refused by name like any field it does not implement."""
    forged = {
        "engine_id": "raypd-prefill-0",
        "agent_name": "evil",
        "block_ids": [[0, 1, 2, 3]],
        "num_tokens": 16,
        "req_id": "someone-else",
    }

    async def fn(c):
        plain = await c.post("/v1/completions", json=BODY)
        sneaky = await c.post("/v1/completions", json={**BODY, "kv_transfer_params": forged, "do_remote_decode": True})
        return plain, sneaky

    plain, sneaky = run(config(checkpoint), fn)
    assert plain.status_code == 200
    assert sneaky.status_code == 400 and sneaky.json()["error"]["param"] == "kv_transfer_params", sneaky.text


UNPICKLERS = {"pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}


# The channels between an engine and the processes on its node: their unpickler builds only
# raypd's message dataclasses and exceptions, from the one process the channel was opened for
# (tests/actors/test_socket_frames.py).
CHANNEL_FRAMES = "actors/socket_frames.py: pickle"


def test_nothing_in_the_serving_code_unpickles():
    """Requests arrive as JSON (pydantic), a prefill engine's transfer parameters as a typed
    message validated where it enters the decode engine (`KVTransferParams.validate`), NIXL
    metadata as NIXL's own bytes, weights as safetensors.
    Ray's own control plane pickles between cluster members: the cluster's token keeps others out.
    The channels' frames are pickles that only a restricted unpickler reads."""
    found = []
    for folder in ("api", "serve", "engine", "worker", "actors", "kv", "kernels", "models"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                elif (
                    isinstance(node, ast.Attribute) and node.attr == "load" and getattr(node.value, "id", "") == "torch"
                ):
                    names = ["torch.load"]
                found += [
                    f"{path.relative_to(ROOT)}: {n}"
                    for n in names
                    if n.split(".")[0] in UNPICKLERS or n == "torch.load"
                ]
    assert found == [CHANNEL_FRAMES]
