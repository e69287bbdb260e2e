"""`bench.served_ab` refuses what it cannot compare before it starts anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.served_ab import _parse

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
