"""Fake engines for the router tests: an OpenAI-shaped upstream that records what it saw, and
uvicorn servers run in threads."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from typing import Any, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse


class ServerThread:
    """An ASGI app served by uvicorn on a free local port, in a thread."""

    def __init__(self, app: Any) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()


@dataclasses.dataclass
class Seen:
    """What the fake engine saw."""

    bodies: list = dataclasses.field(default_factory=list)
    headers: list = dataclasses.field(default_factory=list)
    disconnected: threading.Event = dataclasses.field(default_factory=threading.Event)
    chunks_sent: int = 0


def fake_engine(seen: Seen, stream_chunks: int = 200, chunk_delay_s: float = 0.05) -> FastAPI:
    """An upstream whose answers are fixed bytes (to check they pass unchanged), which streams slowly
    when asked to, and which notes a client that goes away (``seen.disconnected``)."""
    app = FastAPI()

    async def answer(request: Request) -> Response:
        body = await request.body()
        seen.bodies.append(body)
        seen.headers.append(dict(request.headers))
        payload = json.loads(body)
        if payload.get("status"):
            return Response(
                b'{"error": {"message": "engine says no"}}',
                status_code=payload["status"],
                media_type="application/json",
            )
        if payload.get("stream"):
            return StreamingResponse(
                stream(payload.get("chunks", stream_chunks), payload.get("die_after")),
                media_type="text/event-stream",
                headers={"x-engine": "fake"},
            )
        if payload.get("sleep_s"):
            deadline = time.monotonic() + payload["sleep_s"]
            while time.monotonic() < deadline:
                if await request.is_disconnected():
                    seen.disconnected.set()
                    return Response(status_code=499)
                await asyncio.sleep(0.02)
        # Odd spacing and key order: a router that re-encodes JSON would change them.
        return Response(
            b'{"z": 1,  "model" : "%s", "text": "\\u00e9"}' % payload["model"].encode(),
            media_type="application/json",
            headers={"x-engine": "fake"},
        )

    async def stream(chunks: int, die_after: Optional[int]):
        try:
            for i in range(chunks):
                if i == die_after:
                    raise RuntimeError("the fake engine dies mid-stream")
                seen.chunks_sent = i + 1
                yield f'data: {{"i": {i}}}\n\n'.encode()
                await asyncio.sleep(chunk_delay_s)
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit, OSError):
            seen.disconnected.set()
            raise

    app.add_api_route("/v1/completions", answer, methods=["POST"])
    app.add_api_route("/v1/chat/completions", answer, methods=["POST"])
    return app


@dataclasses.dataclass
class FakeRoute:
    base_url: Optional[str]
    state_name: str = "ready"

    @property
    def url(self) -> Optional[str]:
        return self.base_url if self.state_name == "ready" else None

    @property
    def state(self) -> str:
        return self.state_name


class FakeRoutes:
    def __init__(self, routes: dict[str, FakeRoute]) -> None:
        self.routes = routes

    def route(self, name: str) -> Optional[FakeRoute]:
        return self.routes.get(name)
