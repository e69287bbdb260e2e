"""`bench.served_ab` refuses what it cannot compare before it starts anything, and sends each
round prompts that no earlier round sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.served_ab import _parse, round_prompts

ROOT = Path(__file__).resolve().parents[2]


def test_a_directory_that_is_no_checkout_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _parse(["--a", str(tmp_path), "--b", str(ROOT)])
    assert f"{tmp_path} is not a raypd checkout" in capsys.readouterr().err


def test_stream_counts_must_be_integers(capsys):
    with pytest.raises(SystemExit):
        _parse(["--a", str(ROOT), "--b", str(ROOT), "--streams", "1,eight"])
    assert "--streams '1,eight' is not a comma-separated list of integers" in capsys.readouterr().err


def test_two_checkouts_and_stream_counts_parse():
    args = _parse(["--a", str(ROOT), "--b", str(ROOT), "--streams", "1,8", "--model", "dense"])
    assert (args.streams, args.model, args.rounds) == ([1, 8], "dense", 4)


def test_a_model_dir_without_a_checkpoint_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _parse(["--a", str(ROOT), "--b", str(ROOT), "--model-dir", str(tmp_path)])
    assert f"--model-dir {tmp_path} holds no checkpoint" in capsys.readouterr().err


def test_a_model_dir_with_a_checkpoint_parses(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    args = _parse(["--a", str(ROOT), "--b", str(ROOT), "--model-dir", str(tmp_path)])
    assert args.model_dir == tmp_path


def test_each_round_sends_prompts_no_earlier_round_sent():
    """Both servers stay up across rounds: a prompt sent again would find its prefix cached
    (a first block of 16 tokens in common is enough for a hit)."""
    args = _parse(["--a", str(ROOT), "--b", str(ROOT), "--requests-per-stream", "3", "--prompt-len", "64"])
    rounds = [round_prompts(r, 4, args) for r in range(args.rounds)]
    assert all(len(prompts) == 12 and all(len(p) == 64 for p in prompts) for prompts in rounds)
    assert round_prompts(1, 4, args) == rounds[1]
    firsts = [tuple(p[:16]) for prompts in rounds for p in prompts]
    assert len(set(firsts)) == len(firsts)


def test_each_side_takes_its_own_server_flags():
    args = _parse(["--a", str(ROOT), "--b", str(ROOT), "--b-args", "--max-num-batched-tokens 256"])
    assert (args.a_args, args.b_args) == ([], ["--max-num-batched-tokens", "256"])


def test_unbalanced_quotes_in_a_sides_flags_are_named(capsys):
    with pytest.raises(SystemExit):
        _parse(["--a", str(ROOT), "--b", str(ROOT), "--a-args", "--served-model-name 'x"])
    assert '--a-args "--served-model-name \'x": No closing quotation' in capsys.readouterr().err
