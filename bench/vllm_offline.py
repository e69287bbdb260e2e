"""vLLM's offline half of `bench.peers`, run by the vLLM virtual environment's python (it
imports nothing from raypd). It loads the model once with `vllm.LLM`, then serves commands,
one JSON object a line on stdin, so the driver can interleave vLLM's runs with raypd's and
both see the same load on a shared machine:

    {"prompts": [[token ids], ...], "batch": 32, "max_tokens": 64, "out": "/path/result.json"}

Each command generates greedily, `batch` prompts at a time, and writes
`{"wall_s": ..., "token_ids": [...]}` to `out` (renamed into place when complete: vLLM logs
to stdout, so results go to files). The process ends at the end of stdin.

    .venv-vllm/bin/python bench/vllm_offline.py --model DIR --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-num-seqs", type=int, required=True)
    args = ap.parse_args()
    # vLLM starts its engine in a child process that re-imports this module: hence the guard below.
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        dtype="float32",
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.3,
        max_num_seqs=args.max_num_seqs,
        seed=0,
    )
    for line in sys.stdin:
        cmd = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
        params = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True, detokenize=False)
        batch = cmd["batch"]
        outputs = []
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            outputs += llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        wall = time.perf_counter() - start
        tmp = cmd["out"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"wall_s": wall, "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}, f)
        os.replace(tmp, cmd["out"])


if __name__ == "__main__":
    main()
