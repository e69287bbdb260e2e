"""bench.peers_real's report from its rows: the JSON line's ratios (raypd / vLLM, the roofline
ratios) and the table, for a model both engines ran and one only raypd ran."""

from __future__ import annotations

from bench.machine import FLAGS, ModelCost
from bench.peers_real import headline, roofline, table


def _served(tok_s: float, ttft: float, tpot: float, **machine: float) -> dict[str, float]:
    return {"output_tok_per_s": tok_s, "ttft_p50_ms": ttft, "tpot_p50_ms": tpot, "itl_p50_ms": tpot} | machine


def _row(model: str, engines: list[str]) -> dict:
    # 2 GB a token and 100 GFLOP a prompt (of one token); raypd's 1-stream run had 10 GB/s and 200 GFLOP/s
    # (bounds 200 and 500 ms), vLLM's, measured around its own, 20 GB/s and 100 GFLOP/s.
    row: dict = {
        "model": model,
        "engines": engines,
        "weight_bytes_per_token": 2_000_000_000,
        "prompt_gflop": 100.0,
        "served_c1": {
            "raypd": _served(2.5, 1000.0, 400.0, bandwidth_gb_s=10.0, matmul_peak_gflop_s=200.0),
            "vllm": _served(2.0, 4000.0, 500.0, bandwidth_gb_s=20.0, matmul_peak_gflop_s=100.0),
        },
        "served_c4": {"raypd": _served(8.0, 2000.0, 450.0), "vllm": _served(4.0, 9000.0, 900.0)},
        "offline_b1": {"raypd_tok_s": 3.0, "vllm_tok_s": 2.0, "greedy_agreement": 1.0},
        "offline_b16": {"raypd_tok_s": 20.0, "vllm_tok_s": 25.0, "greedy_agreement": 0.75},
    }
    if engines == ["raypd"]:
        for key in ("served_c1", "served_c4"):
            del row[key]["vllm"]
        for key in ("offline_b1", "offline_b16"):
            row[key] = {"raypd_tok_s": row[key]["raypd_tok_s"]}
    cost = ModelCost(2_000_000_000, 50_000_000_000, 0, 0, 0)
    row["roofline"] = {e: roofline(row, e, cost, 1) for e in engines}
    return row


def test_headline_ratios_and_roofline():
    out = headline([_row("dense", ["raypd", "vllm"]), _row("moe", ["raypd"])], [1, 4])
    assert out["real_dense_c1"] == 1.25 and out["real_dense_c4"] == 2.0
    assert out["real_dense_ttft_c1"] == 0.25  # raypd / vLLM TTFT: below 1 is raypd faster
    assert out["real_dense_b1"] == 1.5 and out["real_dense_b16"] == 0.8
    assert out["real_dense_tpot_roofline"] == 2.0 and out["real_dense_ttft_roofline"] == 2.0
    # Each engine against the machine measured around its own run: bounds 100 and 1000 ms.
    assert out["real_dense_tpot_roofline_vllm"] == 5.0 and out["real_dense_ttft_roofline_vllm"] == 4.0
    assert out["real_dense_greedy_agreement"] == 0.75
    # raypd alone: absolute figures and the reason vLLM did not run, no ratios.
    assert "real_moe_c1" not in out and out["real_moe_raypd_c1_tok_s"] == 2.5
    assert not any(k.endswith("_bound_ms_roofline") for k in out)
    assert out["real_moe_raypd_b16_tok_s"] == 20.0 and out["real_moe_tpot_roofline"] == 2.0
    assert out["real_moe_vllm"].startswith("not run: vLLM 0.32 CPU")
    assert out["cpu"].startswith("cpu: ") and set(out["cpu_flags"]) <= set(FLAGS)


def test_table_has_a_line_per_model_and_run():
    lines = table([_row("dense", ["raypd", "vllm"]), _row("moe", ["raypd"])], [1, 4])
    assert len(lines) == 1 + 2 * 4
    dense_c4 = next(line.split() for line in lines if line.split()[:3] == ["dense", "served", "c4"])
    assert dense_c4[3:6] == ["8.00", "4.00", "2.00"]
    moe_b1 = next(line.split() for line in lines if line.split()[:3] == ["moe", "offline", "b1"])
    assert moe_b1[3:] == ["3.00", "-", "-"]
