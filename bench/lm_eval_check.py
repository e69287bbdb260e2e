"""An unmodified lm-eval against `python -m serve`, colocated and 1P1D, checked against the
same scores computed in this process.

    python -m bench.lm_eval_check [--model models/tiny-hybrid] [--limit N] [--port 8011] [--serve-args "..."]

Two tasks (bench/lm_eval_tasks/) over the model's held-out lookups (`eval.jsonl`):
`raypd_kv_loglikelihood` scores the answer's log probability after the prompt (lm-eval's
`local-completions` sends the prompt and answer as token ids with `echo` and `logprobs`) and
`raypd_kv_generate` scores greedy answers by exact match. lm-eval tokenizes through the
server (`tokenizer_backend=remote`: `/tokenize`, `/detokenize`, `/tokenizer_info`), so it needs
no copy of the tokenizer. The in-process scores come from the model's dense forward (the
training path, not the server's paged one) and the reference greedy generation.

Needs the `eval` extra (`make eval-check` installs it). The last line printed is one JSON
object: each source's scores and whether they agree (`acc` and `exact_match` exactly,
`perplexity` within 1e-4 relative). Exits 1 when they do not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import httpx
import torch

from models.loader import load_model
from models.reference import greedy_generate

ROOT = Path(__file__).resolve().parents[1]
TASKS_DIR = ROOT / "bench" / "lm_eval_tasks"
TASKS = ("raypd_kv_loglikelihood", "raypd_kv_generate")
DATA = ROOT / "models" / "tiny-hybrid" / "eval.jsonl"  # the tasks' data_files
STOP, MAX_GEN_TOKS = ";", 4  # raypd_kv_generate's until and max_gen_toks
START_TIMEOUT_S = 300.0
PERPLEXITY_RTOL = 1e-4
SCORES = ("perplexity", "acc", "exact_match")


def records(limit: int | None) -> list[dict[str, str]]:
    lines = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return lines[:limit] if limit is not None else lines


@torch.inference_mode()
def in_process(model_dir: str, docs: list[dict[str, str]]) -> dict[str, float]:
    """The tasks' metrics as lm-eval defines them, from the model in fp32 (the server's CPU dtype)."""
    loaded = load_model(model_dir, dtype=torch.float32)

    def encode(text: str) -> list[int]:  # as lm-eval's remote tokenizer asks /tokenize
        return loaded.tokenizer.encode(text, add_special_tokens=False).ids

    lls, greedy = [], []
    for doc in docs:
        # As lm-eval splits a pair: the answer's tokens are those the whole adds to the prompt's.
        context = encode(doc["prompt"])
        answer = encode(doc["prompt"] + doc["answer"])[len(context) :]
        forward_dense = cast(Callable[[torch.Tensor], torch.Tensor], loaded.model.forward_dense)
        logits = forward_dense(torch.tensor([context + answer]))[0, len(context) - 1 : -1]
        logprobs = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(answer)
        lls.append(float(logprobs.gather(1, target[:, None]).sum()))
        greedy.append(bool((logprobs.argmax(-1) == target).all()))
    prompts = [encode(d["prompt"]) for d in docs]
    outputs = greedy_generate(loaded.model, prompts, MAX_GEN_TOKS, loaded.eos_token_id)
    answers = [loaded.tokenizer.decode(out).split(STOP)[0] for out in outputs]
    return {
        "perplexity": math.exp(-sum(lls) / len(lls)),  # lm-eval's `perplexity` aggregation
        "acc": sum(greedy) / len(greedy),
        "exact_match": sum(a == d["answer"] for a, d in zip(answers, docs, strict=True)) / len(docs),
    }


def served(
    model_dir: str, name: str, port: int, prefill: int, limit: int | None, serve_args: list[str]
) -> dict[str, float]:
    """lm-eval's scores against `python -m serve` (prefill engines: 0 colocated, 1 for 1P1D)."""
    serve_cmd = [sys.executable, "-m", "serve", "--model", model_dir, "--served-model-name", name]
    serve_cmd += ["--port", str(port), "--prefill", str(prefill), "--decode", "1", "--worker-threads", "1"]
    serve_cmd += serve_args
    server = subprocess.Popen(serve_cmd, cwd=ROOT)
    try:
        _wait_healthy(server, f"http://127.0.0.1:{port}/health")
        with tempfile.TemporaryDirectory() as out:
            model_args = (
                f"model={name},base_url=http://127.0.0.1:{port}/v1/completions,"
                "tokenizer_backend=remote,tokenized_requests=True,num_concurrent=4,max_retries=1"
            )
            cmd = [Path(sys.executable).with_name("lm_eval").as_posix(), "run", "--model", "local-completions"]
            cmd += ["--model_args", model_args, "--tasks", ",".join(TASKS), "--include_path", str(TASKS_DIR)]
            cmd += ["--output_path", out, "--seed", "0"]
            if limit is not None:
                cmd += ["--limit", str(limit)]
            env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
            subprocess.run(cmd, cwd=ROOT, env=env, check=True)
            (result,) = Path(out).rglob("results_*.json")
            results = json.loads(result.read_text())["results"]
    finally:
        server.send_signal(2)  # SIGINT: `python -m serve` stops its engines and Ray, then exits
        server.wait(timeout=START_TIMEOUT_S)
    return {
        "perplexity": results["raypd_kv_loglikelihood"]["perplexity,none"],
        "acc": results["raypd_kv_loglikelihood"]["acc,none"],
        "exact_match": results["raypd_kv_generate"]["exact_match,none"],
    }


def _wait_healthy(server: subprocess.Popen[bytes], url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"python -m serve exited with {server.returncode}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server did not answer {url} within {START_TIMEOUT_S:.0f} s")


def agree(a: dict[str, float], b: dict[str, float]) -> bool:
    return (
        a["acc"] == b["acc"]
        and a["exact_match"] == b["exact_match"]
        and math.isclose(a["perplexity"], b["perplexity"], rel_tol=PERPLEXITY_RTOL)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny-hybrid"))
    parser.add_argument("--limit", type=int, default=None, help="score only the first N lookups")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--serve-args", default="", help="more `python -m serve` flags for both deployments")
    args = parser.parse_args(argv)
    name = Path(args.model).name
    scores = {"in-process": in_process(args.model, records(args.limit))}
    for label, prefill in (("colocated", 0), ("1P1D", 1)):
        scores[label] = served(args.model, name, args.port, prefill, args.limit, shlex.split(args.serve_args))
    ok = all(agree(scores["in-process"], s) for s in scores.values())
    print(f"{'':12}" + "".join(f"{m:>14}" for m in SCORES))
    for label, s in scores.items():
        print(f"{label:12}" + "".join(f"{s[m]:>14.6f}" for m in SCORES))
    print(json.dumps({"model": name, "n": len(records(args.limit)), "scores": scores, "agree": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
