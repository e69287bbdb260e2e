"""The fleet simulation (bench/fleet_sim.py): the same trace reaches every policy, every request
completes, and routing by cache finds more of the prompts cached than routing in turn."""

from __future__ import annotations

from bench.fleet_model import EngineCosts
from bench.fleet_sim import Simulation, Variant, main
from bench.fleet_trace import TraceShape

SHAPE = TraceShape(num_systems=12, system_tokens=(256, 512), user_tokens=(16, 64), output_tokens=(4, 16))


def run(variant: Variant) -> tuple[Simulation, dict]:
    sim = Simulation(8, variant, EngineCosts(num_blocks=256), SHAPE, rate=6.0, seed=3, poll_s=0.25)
    sim.run(duration_s=4.0, drain_s=60.0)
    return sim, sim.report(slo_ttft_s=2.0, slo_tpot_s=0.1)


def test_cache_aware_finds_more_cached_than_round_robin_on_the_same_trace():
    rr_sim, rr = run(Variant("round_robin", "round_robin", 0))
    ca_sim, ca = run(Variant("cache_aware", "cache_aware", 0))
    assert rr["requests"] == ca["requests"] == rr["completed"] == ca["completed"] > 0
    # The same turns in the same sessions: the prompts differ only in when they came.
    assert sorted(len(r.session.history) for r in rr_sim.requests) == sorted(
        len(r.session.history) for r in ca_sim.requests
    )
    assert ca["prefix_hit_rate"] > rr["prefix_hit_rate"]
    assert rr["local_prefills"] == ca["local_prefills"] == 0


def test_conditional_disaggregation_computes_short_prompts_on_decode_engines():
    _, r = run(Variant("local", "cache_aware", 10_000))
    assert r["local_prefills"] == r["requests"] == r["completed"]


def test_the_command_prints_a_row_per_policy(tmp_path, capsys):
    assert main(["--sizes", "4", "--duration-s", "1", "--rate", "1", "--out", str(tmp_path / "fs")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 |")]
    assert [row.split("|")[2].strip() for row in rows] == [
        "round_robin",
        "least_loaded",
        "cache_aware",
        "cache_aware, local < 512",
    ]
    assert (tmp_path / "fs.json").exists()
