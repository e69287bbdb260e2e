"""Two raypd checkouts served side by side on the same cores: which is faster per stream count.

`bench.peers` compares raypd with vLLM; this compares raypd with itself, for a change whose
effect is smaller than the spread between runs on different minutes. Both servers are up at
once (one colocated engine each, the `bench.peers` models, fp32, one compute thread bound to
the same core) and are driven in alternating rounds, A then B, then B then A, so drift in
the machine falls on both. Each round sends new prompts (`round_prompts`), the same to both.
A side's extra server flags (`--a-args`, `--b-args`) compare two settings of one checkout.
Prints output tokens/s, TPOT and TTFT p50 per stream count and each B/A ratio (tokens a
second), and one JSON line at the end.

    python -m bench.served_ab --a /tmp/old-checkout --b . --model hybrid
    python -m bench.served_ab --a /tmp/old-checkout --b . --model-dir /tmp/raypd/real-ckpt/dense --threads 2
    python -m bench.served_ab --a . --b . --b-args="--max-num-batched-tokens 256" --streams 4,16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path

from actors.ports import free_port
from bench.peer_client import Sample, drive
from bench.peer_models import BUILDERS, make
from bench.peer_servers import raypd_command, running, vllm_env
from bench.peers import prompts_for, settle


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="the baseline checkout")
    parser.add_argument("--b", type=Path, required=True, help="the checkout to compare with it")
    parser.add_argument("--model", choices=sorted(BUILDERS), default="hybrid")
    parser.add_argument(
        "--model-dir",
        type=Path,
        help="serve this checkpoint instead of --model (e.g. one bench.peers_real made, for real sizes)",
    )
    parser.add_argument("--streams", default="1,8,32", help="stream counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds per stream count")
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="compute threads of each engine")
    parser.add_argument("--work-dir", type=Path, help="the model and server logs (default: a temporary dir)")
    parser.add_argument("--a-args", default="", help="extra `python -m serve` flags of side A, one shell-quoted string")
    parser.add_argument("--b-args", default="", help="extra `python -m serve` flags of side B, one shell-quoted string")
    args = parser.parse_args(argv)
    for side in ("a", "b"):
        flags = getattr(args, f"{side}_args")
        try:
            setattr(args, f"{side}_args", shlex.split(flags))
        except ValueError as e:
            parser.error(f"--{side}-args {flags!r}: {e}")
    try:
        args.streams = [int(s) for s in args.streams.split(",")]
    except ValueError:
        parser.error(f"--streams {args.streams!r} is not a comma-separated list of integers")
    if args.model_dir is not None and not (args.model_dir / "config.json").is_file():
        parser.error(f"--model-dir {args.model_dir} holds no checkpoint (no config.json)")
    for side in (args.a, args.b):
        if not (side / "serve" / "__main__.py").is_file():
            parser.error(f"{side} is not a raypd checkout (no serve/__main__.py)")
    return args


def round_prompts(r: int, streams: int, args: argparse.Namespace) -> list[list[int]]:
    """Round `r`'s prompts at `streams` streams, the same for both sides and new each round: both
    servers stay up from round to round, and a prompt sent again would find its prefix cached
    and skip most of its prefill (a 1024-token hybrid prompt's first token came in 0.3 s
    instead of ~1.4)."""
    return prompts_for(streams, streams * args.requests_per_stream, args.prompt_len, 1 + r)


def _tpot_ms(samples: list[Sample]) -> float:
    return 1e3 * statistics.median((s.e2e - s.ttft) / (s.tokens - 1) for s in samples if s.tokens > 1)


def _ttft_ms(samples: list[Sample]) -> float:
    return 1e3 * statistics.median(s.ttft for s in samples)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    with ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        if args.model_dir is not None:
            model, args.model = args.model_dir.resolve(), args.model_dir.resolve().name
        else:
            model = work / args.model
            make(args.model, model)
        urls = {}
        for side in ("a", "b"):
            port = free_port()
            cmd = raypd_command(model, args.model, port, args.threads, max(args.streams)) + getattr(
                args, f"{side}_args"
            )
            log = work / f"served-ab-{side}.log"
            urls[side] = stack.enter_context(running(cmd, vllm_env(args.threads), port, log, getattr(args, side)))
        runs: dict[str, dict[int, list[tuple[float, float, float]]]] = {s: {n: [] for n in args.streams} for s in urls}
        for r in range(args.rounds):
            for streams in args.streams:
                prompts = round_prompts(r, streams, args)
                for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
                    settle()
                    got, wall = asyncio.run(drive(urls[side], args.model, prompts, streams, args.max_tokens))
                    runs[side][streams].append((sum(s.tokens for s in got) / wall, _tpot_ms(got), _ttft_ms(got)))
        ratios = {}
        for streams in args.streams:
            tps, tpot, ttft = ({s: statistics.fmean(r[i] for r in runs[s][streams]) for s in urls} for i in range(3))
            ratios[f"c{streams}"] = round(tps["b"] / tps["a"], 3)
            ratios[f"ttft_c{streams}"] = round(ttft["b"] / ttft["a"], 3)
            print(
                f"{streams:2d} streams: A {tps['a']:7.1f} tok/s TPOT {tpot['a']:6.2f} ms TTFT {ttft['a']:7.1f} ms | "
                f"B {tps['b']:7.1f} tok/s TPOT {tpot['b']:6.2f} ms TTFT {ttft['b']:7.1f} ms | "
                f"B/A {ratios[f'c{streams}']:.3f} (TTFT {ratios[f'ttft_c{streams}']:.3f})",
                flush=True,
            )
        print(json.dumps({"model": args.model} | ratios))


if __name__ == "__main__":
    main()
