"""`python -m serve --prefill-tp 2 --decode-tp 1` serves the shipped model disaggregated with
a two-rank prefill engine; a TP size the model's heads cannot split over is a one-line error."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.api.test_cli import ROOT, SHIPPED, run_server, stop_server, wait_until_up


def test_serve_prefill_tp_2_decode_tp_1(tmp_path):
    if not (SHIPPED / "config.json").exists():
        pytest.skip("the shipped model models/tiny-hybrid is not built (make model)")
    proc, url, log = run_server(
        tmp_path, str(SHIPPED), "--prefill-tp", "2", "--decode-tp", "1", "--worker-threads", "1"
    )
    try:
        wait_until_up(proc, url, log)
        (card,) = httpx.get(url + "/v1/models").json()["data"]
        r = httpx.post(
            url + "/v1/completions", json={"model": card["id"], "prompt": "t1 t2 t3", "max_tokens": 4}, timeout=30
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    stop_server(proc, log)
    text = log.read_text()
    assert "prefill_tp" in text and "= 2" in text


def test_serve_refuses_a_tp_size_the_heads_cannot_split_over():
    proc = subprocess.run(
        [sys.executable, "-m", "serve", "--decode-tp", "3"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "invalid decode_tp 3" in proc.stderr and "Traceback" not in proc.stderr
