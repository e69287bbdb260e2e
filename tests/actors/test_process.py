"""`--worker-cpus` and the per-role `--prefill-worker-cpus` / `--decode-worker-cpus`: a list is
parsed and shared out among TP ranks, a bad one is a config error naming it, the compute
stream's thread runs on its CPUs (one thread a CPU where its team has as many threads as it
has CPUs), and a process keeping off them runs on the rest."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from actors.process import parse_cpus, rank_cpus
from engine.build import worker_config
from engine.config import Config, ConfigError
from serve.config import load_config
from worker.compute_stream import ComputeStream

CPUS = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    "text, cpus", [("0", (0,)), ("0-3", (0, 1, 2, 3)), ("0-1,6", (0, 1, 6)), (" 2 , 4-5", (2, 4, 5))]
)
def test_cpu_lists_parse(text, cpus):
    assert parse_cpus(text) == cpus


@pytest.mark.parametrize(
    "text, why",
    [("a", "not a CPU"), ("1,,2", "not a CPU"), ("-1", "not a CPU"), ("3-1", "backwards"), ("1,1", "twice")],
)
def test_bad_cpu_lists_are_config_errors_naming_the_value(text, why):
    with pytest.raises(ConfigError, match=f"invalid worker_cpus {text!r}: .*{why}") as e:
        Config(worker_cpus=text)
    assert e.value.field == "worker_cpus"


def test_tensor_parallel_ranks_share_the_list_out():
    assert [rank_cpus((0, 1, 2, 3), r, 2) for r in range(2)] == [(0, 1), (2, 3)]
    with pytest.raises(ConfigError, match="2 CPUs cannot be shared out among 4"):
        Config(worker_cpus="0-1", tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="1 CPUs cannot be shared out among 2"):
        Config(worker_cpus="0", prefill=1, decode_tp=2)


def test_each_role_binds_its_own_list_and_the_engines_keep_off_both():
    cfg = load_config(
        ["--prefill", "1", "--prefill-worker-cpus", "0-1", "--decode-worker-cpus", "4", "--prefill-tp", "2"], {}
    )
    assert [worker_config(cfg, "prefill", tp_rank=r).cpus for r in range(2)] == [(0,), (1,)]
    assert worker_config(cfg, "decode").cpus == (4,)
    assert cfg.bound_cpus == (0, 1, 4)
    one_side = Config(prefill=1, decode_worker_cpus="3")
    assert (worker_config(one_side, "prefill").cpus, worker_config(one_side, "decode").cpus) == ((), (3,))
    assert one_side.bound_cpus == (3,)
    shared = Config(prefill=1, worker_cpus="2")
    assert (worker_config(shared, "prefill").cpus, worker_config(shared, "decode").cpus) == ((2,), (2,))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_bad_role_lists_are_config_errors_naming_the_field_and_value(role):
    name = f"{role}_worker_cpus"
    with pytest.raises(ConfigError, match=f"invalid {name} '1-0': the range '1-0' runs backwards") as e:
        Config(prefill=1, **{name: "1-0"})
    assert e.value.field == name
    with pytest.raises(ConfigError, match=f"invalid {name} '0': 1 CPUs cannot be shared out among 2") as e:
        Config(prefill=1, **{name: "0", f"{role}_tp": 2})
    assert e.value.field == name


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_role_lists_are_refused_with_worker_cpus_and_on_colocated_engines(role):
    name = f"{role}_worker_cpus"
    with pytest.raises(ConfigError, match=f"invalid {name} '1': give either worker_cpus \\('0'\\)") as e:
        Config(prefill=1, worker_cpus="0", **{name: "1"})
    assert e.value.field == name
    with pytest.raises(ConfigError, match=f"invalid {name} '1': colocated engines \\(--prefill 0\\) have no {role}"):
        Config(**{name: "1"})


def test_the_compute_stream_thread_runs_on_its_cpus_and_its_creator_does_not():
    stream = ComputeStream("cpu", cpus=(CPUS[-1],))
    try:
        assert stream.submit(os.sched_getaffinity, 0).result() == {CPUS[-1]}
    finally:
        stream.close()
    assert sorted(os.sched_getaffinity(0)) == CPUS


def _stream_affinities(threads: int, cpus: tuple[int, ...]) -> tuple[list[int], list[list[int]]]:
    """In a fresh interpreter computing with `threads` torch threads: the CPUs a compute stream
    bound to `cpus` runs its jobs on, and those of every thread of the process once a job ran
    a parallel op (the stream's OpenMP team then exists)."""
    code = (
        "import json, os, torch\n"
        "from worker.compute_stream import ComputeStream\n"
        f"torch.set_num_threads({threads})\n"
        f"stream = ComputeStream('cpu', cpus={cpus!r})\n"
        "own = stream.submit(os.sched_getaffinity, 0).result()\n"
        "stream.submit(lambda: torch.ones(1 << 22).add_(1)).result()\n"
        "tids = os.listdir('/proc/self/task')\n"
        "print(json.dumps([sorted(own), sorted(sorted(os.sched_getaffinity(int(t))) for t in tids)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    own, every = json.loads(out.splitlines()[-1])
    return own, every


@pytest.mark.skipif(len(CPUS) < 2, reason="one thread a CPU needs two CPUs")
def test_a_team_of_one_thread_a_cpu_runs_each_thread_on_its_own():
    own, every = _stream_affinities(2, (CPUS[0], CPUS[1]))
    assert own == [CPUS[0]]  # the stream's thread is its team's thread 0
    assert [CPUS[1]] in every  # and torch's other thread has the second CPU to itself


@pytest.mark.skipif(len(CPUS) < 2, reason="a set of CPUs needs two")
def test_a_team_smaller_than_its_cpus_keeps_the_whole_set():
    own, _ = _stream_affinities(1, (CPUS[0], CPUS[1]))
    assert own == [CPUS[0], CPUS[1]]


def test_cpus_the_node_lacks_are_refused_before_any_thread_starts():
    with pytest.raises(ValueError, match=r"worker_cpus \[4096\]: this node offers CPUs"):
        ComputeStream("cpu", cpus=(4096,))


@pytest.mark.skipif(len(CPUS) < 2, reason="keeping off a CPU needs another one")
def test_a_process_keeping_off_the_workers_cpus_runs_on_the_rest():
    code = (
        "import os, threading\n"
        "from actors.process import keep_off\n"
        "t = threading.Thread(target=threading.Event().wait, daemon=True); t.start()\n"
        f"keep_off(({CPUS[-1]},))\n"
        "tids = os.listdir('/proc/self/task')\n"
        "print(all(os.sched_getaffinity(int(t)) == os.sched_getaffinity(0) for t in tids), sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(
        maxsplit=1
    )
    assert out == ["True", str(CPUS[:-1]) + "\n"]
