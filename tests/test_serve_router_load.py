"""One model's load does not starve another behind ``kvcached serve``'s router: each engine has its
own connection pool, and a request that finds its engine's pool full is answered 503 in the OpenAI
shape after the pool timeout instead of hanging."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("fastapi", reason="kvcached serve needs the serve extra: pip install '.[serve]'")
pytest.importorskip("uvicorn", reason="kvcached serve needs the serve extra: pip install '.[serve]'")
pytest.importorskip("prometheus_client", reason="kvcached serve needs the serve extra: pip install '.[serve]'")
httpx = pytest.importorskip("httpx", reason="kvcached serve needs the serve extra: pip install '.[serve]'")

from kvcached.serve.config import parse_config  # noqa: E402
from kvcached.serve.metrics import ServeMetrics  # noqa: E402
from kvcached.serve.router import create_app  # noqa: E402
from kvcached.serve.upstreams import UpstreamLimits  # noqa: E402
from serve_fakes import FakeRoute, FakeRoutes, Seen, ServerThread, fake_engine  # noqa: E402

# A shared pool of 100 connections was what 100 streams exhausted; 100 it is.
LONG_STREAMS = 100
# A request to an idle model answers in milliseconds; a starved one waited for a stream to end (10 s here).
IDLE_ANSWER_S = 2.0
STREAM = b'{"model": "a", "stream": true, "chunks": 200}'  # 200 chunks, 50 ms apart: 10 s


def router_for():
    config = parse_config({"device": "cpu", "models": [{"name": n, "engine": "vllm", "model": "/m"} for n in "ab"]})
    return config, ServeMetrics(list(config.models))


async def hold_streams(url: str, count: int, body: bytes = STREAM):
    """Opens ``count`` streams and reads the first chunk of each; returns what closes them."""
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None), timeout=60)
    streams = []
    for _ in range(count):
        context = client.stream("POST", url + "/v1/completions", content=body)
        answer = await context.__aenter__()
        assert answer.status_code == 200
        chunks = answer.aiter_raw()  # kept: a chunk iterator dropped closes its stream
        await chunks.__anext__()
        streams.append((context, chunks))

    async def close() -> None:
        for context, chunks in streams:
            await chunks.aclose()
            await context.__aexit__(None, None, None)
        await client.aclose()

    return close


def test_long_streams_to_one_model_do_not_delay_a_request_to_another():
    config, metrics = router_for()
    with ServerThread(fake_engine(Seen())) as engine_a, ServerThread(fake_engine(Seen())) as engine_b:
        routes = FakeRoutes({"a": FakeRoute(engine_a.url), "b": FakeRoute(engine_b.url)})
        with ServerThread(create_app(routes, ["a", "b"], metrics)) as router:

            async def scenario() -> float:
                close = await hold_streams(router.url, LONG_STREAMS)
                try:
                    async with httpx.AsyncClient(timeout=60) as other:
                        started = time.monotonic()
                        answer = await other.post(router.url + "/v1/completions", content=b'{"model": "b"}')
                        assert answer.status_code == 200
                        return time.monotonic() - started
                finally:
                    await close()

            assert asyncio.run(scenario()) < IDLE_ANSWER_S


def test_a_full_pool_is_an_openai_503_after_the_pool_timeout_and_others_still_answer():
    config, metrics = router_for()
    limits = UpstreamLimits(connections=2, pool_timeout_s=0.5)
    with ServerThread(fake_engine(Seen())) as engine_a, ServerThread(fake_engine(Seen())) as engine_b:
        routes = FakeRoutes({"a": FakeRoute(engine_a.url), "b": FakeRoute(engine_b.url)})
        with ServerThread(create_app(routes, ["a", "b"], metrics, limits)) as router:

            async def scenario():
                close = await hold_streams(router.url, limits.connections)
                try:
                    async with httpx.AsyncClient(timeout=60) as other:
                        started = time.monotonic()
                        busy = await other.post(router.url + "/v1/completions", content=b'{"model": "a"}')
                        waited_s = time.monotonic() - started
                        idle = await other.post(router.url + "/v1/completions", content=b'{"model": "b"}')
                        return busy, waited_s, idle
                finally:
                    await close()

            busy, waited_s, idle = asyncio.run(scenario())
            text = httpx.get(router.url + "/metrics").text
    assert busy.status_code == 503 and busy.headers["retry-after"] == "5"
    error = busy.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == "engine_busy" and error["param"] == "model"
    assert "`a` has 2 requests in flight" in error["message"]
    assert 0.5 <= waited_s < 5
    assert idle.status_code == 200
    assert 'kvcached_serve_requests_total{endpoint="/v1/completions",model="a",status="503"} 1.0' in text
