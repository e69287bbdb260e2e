"""bench.peer_servers stops a server with everything it started, and starts each server on a
port of its own: raypd's Serve proxy, a Ray worker outside the server's process group, kept
answering on the port after the server stopped, and the next server's readiness probe took it
for the new one. The server here is a real HTTP server run by such an escaped grandchild."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import httpx
import pytest

import bench.peer_servers
from bench.peer_servers import serving

# The leader starts the HTTP server in a session of its own (out of reach of a signal to the
# leader's group, as a Ray worker is) and waits; the grandchild answers GET /v1/models.
_LEADER = textwrap.dedent(
    """
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True)
    time.sleep(3600)
    """
)
_HTTP = textwrap.dedent(
    """
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Models(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

    HTTPServer(("127.0.0.1", int(sys.argv[1])), Models).serve_forever()
    """
)


def _command(port: int) -> list[str]:
    return [sys.executable, "-c", _LEADER, _HTTP, str(port)]


def test_each_start_gets_its_own_port_and_nothing_answers_after_the_stop(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setattr(bench.peer_servers, "_STOP_TIMEOUT_S", 2.0)
    urls = []
    for i in range(2):
        with serving(_command, {}, tmp_path / f"server-{i}.log") as url:
            assert httpx.get(f"{url}/v1/models").status_code == 200
            urls.append(url)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/v1/models")
    assert urls[0] != urls[1]
