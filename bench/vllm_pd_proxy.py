"""The small proxy that makes two vLLM api_servers one disaggregated (1P1D) server for
`bench.peers_pd`, as vLLM's own NixlConnector examples do: each completion goes first to the
prefill server with `max_tokens` 1 and `kv_transfer_params {"do_remote_decode": true}` (it
computes the prompt's KV and keeps it for a remote reader), then to the decode server with the
`kv_transfer_params` that answer returned (the decode side READs that KV over NIXL and
generates the rest), whose response, streamed or not, goes back to the client unchanged.

    python -m bench.vllm_pd_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Only `/v1/completions` (what the bench drives) and `GET /v1/models` (its readiness check) are
served; either server's error answers the client as it was.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

# What the decode server would produce itself: the prefill call answers one token, not streamed.
_PREFILL_ONLY_FIELDS = ("stream", "stream_options", "min_tokens", "max_completion_tokens")


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's request: the prompt and sampling of `body`, one token, not
    streamed, its KV kept for a remote decode."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_ONLY_FIELDS}
    out["max_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return out


def decode_request(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The decode server's request: `body` as the client sent it, plus where its prompt's KV
    waits (the prefill answer's `kv_transfer_params`)."""
    params = prefill_response.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise ValueError(
            "the prefill server's answer has no kv_transfer_params: is it started with "
            "--kv-transfer-config ...kv_producer...?"
        )
    return body | {"kv_transfer_params": params}


def make_app(prefill_url: str, decode_url: str) -> FastAPI:
    clients: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # No pool limit: the bench's streams all run at once, each holding a decode connection.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with (
            httpx.AsyncClient(base_url=prefill_url, timeout=None, limits=limits) as prefill,
            httpx.AsyncClient(base_url=decode_url, timeout=None, limits=limits) as decode,
        ):
            clients.update(prefill=prefill, decode=decode)
            yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/v1/models")
    async def models() -> Response:
        r = await clients["decode"].get("/v1/models")
        return Response(r.content, r.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        first = await clients["prefill"].post("/v1/completions", json=prefill_request(body))
        if first.status_code != 200:
            return Response(first.content, first.status_code, media_type="application/json")
        try:
            second = decode_request(body, first.json())
        except ValueError as e:
            return JSONResponse({"error": {"message": str(e), "type": "proxy_error"}}, status_code=502)
        answer = await clients["decode"].send(
            clients["decode"].build_request("POST", "/v1/completions", json=second), stream=True
        )
        if answer.status_code != 200:
            content = await answer.aread()
            await answer.aclose()
            return Response(content, answer.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:
                await answer.aclose()

        return StreamingResponse(relay(), media_type=answer.headers.get("content-type", "application/json"))

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", required=True, help="the prefill (kv_producer) server's base URL")
    ap.add_argument("--decode", required=True, help="the decode (kv_consumer) server's base URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(make_app(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
