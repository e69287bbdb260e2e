"""bench.peers_pd's logic that runs without vLLM (no vLLM in `make test`): the proxy's two
requests, each vLLM role's flags, raypd's placements read by raypd's own CLI, and the ratios of
the last line."""

from __future__ import annotations

import json
import math

import pytest

from bench.peers_pd import RAYPD_LAYOUT, headline, ratios, table, vllm_role_args
from bench.vllm_pd_proxy import decode_request, prefill_request
from engine.build import worker_config
from serve.config import load_config

BODY = {
    "model": "dense",
    "prompt": [5, 6, 7],
    "max_tokens": 64,
    "temperature": 0,
    "stream": True,
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
}


def test_the_prefill_request_computes_one_token_and_keeps_the_kv_for_a_remote_decode():
    sent = dict(BODY)
    got = prefill_request(sent)
    assert sent == BODY  # the client's body is reused for the decode request
    assert got["max_tokens"] == 1 and got["stream"] is False and "stream_options" not in got
    assert got["kv_transfer_params"]["do_remote_decode"] is True
    assert got["kv_transfer_params"]["do_remote_prefill"] is False
    assert {k: got[k] for k in ("model", "prompt", "temperature", "ignore_eos")} == {
        k: BODY[k] for k in ("model", "prompt", "temperature", "ignore_eos")
    }


def test_the_decode_request_is_the_clients_with_the_returned_transfer_params():
    params = {"do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_engine_id": "e", "remote_port": 5}
    assert decode_request(BODY, {"choices": [], "kv_transfer_params": params}) == BODY | {"kv_transfer_params": params}
    with pytest.raises(ValueError, match="no kv_transfer_params: is it started with --kv-transfer-config"):
        decode_request(BODY, {"choices": [], "kv_transfer_params": None})


@pytest.mark.parametrize("role, kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_each_vllm_role_gets_a_nixl_connector_with_kv_in_host_memory(role, kv_role):
    args = vllm_role_args(role, hybrid=False)
    assert args[0] == "--kv-transfer-config"
    assert json.loads(args[1]) == {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}
    assert vllm_role_args(role, hybrid=True) == [*args, "--no-enable-prefix-caching"]


def test_raypd_placements_as_raypds_cli_reads_them():
    shipped = load_config(RAYPD_LAYOUT["shipped"], {})
    equal = load_config(RAYPD_LAYOUT["equal"], {})
    assert (shipped.prefill, shipped.decode, equal.prefill, equal.decode) == (1, 1, 1, 1)
    assert worker_config(shipped, "prefill").cpus == worker_config(shipped, "decode").cpus == ()
    assert (worker_config(equal, "prefill").cpus, worker_config(equal, "decode").cpus) == ((0,), (1,))
    assert equal.worker_threads == 1 and equal.bound_cpus == (0, 1)


def _row(model: str, tok_s: dict[str, tuple[float, float]], ttft: dict[str, tuple[float, float]]) -> dict:
    def cell(p: str, i: int) -> dict[str, float]:
        return {"output_tok_per_s": tok_s[p][i], "ttft_p50_ms": ttft[p][i], "tpot_p50_ms": 10.0, "itl_p50_ms": 10.0}

    return {
        "model": model,
        "pd_c8": {p: {"raypd": cell(p, 0), "vllm": cell(p, 1)} for p in tok_s},
        "greedy_agreement": 0.75 if model == "dense" else 1.0,
    }


def test_the_last_line_has_geometric_means_over_models_and_each_models_ratios():
    rows = [
        _row("hybrid", {"shipped": (400, 100), "equal": (200, 100)}, {"shipped": (50, 100), "equal": (100, 100)}),
        _row("dense", {"shipped": (100, 100), "equal": (100, 200)}, {"shipped": (200, 100), "equal": (100, 400)}),
    ]
    assert ratios(rows[0], 8, "shipped") == (4.0, 0.5)
    got = headline(rows, [8], ["shipped", "equal"])
    assert got["pd_c8"] == {"shipped": 2.0, "equal": round(math.sqrt(2 * 0.5), 3)}
    assert got["pd_ttft_c8"] == {"shipped": 1.0, "equal": 0.5}
    assert got["pd_c8_hybrid"] == {"shipped": 4.0, "equal": 2.0}
    assert got["pd_ttft_c8_dense"] == {"shipped": 2.0, "equal": 0.25}
    assert got["greedy_agreement"] == 0.75
    lines = table(rows, [8], ["shipped", "equal"]).splitlines()
    assert len(lines) == 2 + 4
    assert lines[2].startswith("| hybrid | shipped | 8 | 400.0 | 100.0 | 4.00 | 50.0 | 100.0 |")
