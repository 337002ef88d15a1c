"""The router of ``kvcached serve`` against fake engines: routing on `model`, bodies unchanged,
OpenAI-style 404 / 503, streaming, and a client that goes away cancelling its request upstream."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi", reason="kvcached serve needs the serve extra: pip install '.[serve]'")
pytest.importorskip("uvicorn", reason="kvcached serve needs the serve extra: pip install '.[serve]'")
pytest.importorskip("prometheus_client", reason="kvcached serve needs the serve extra: pip install '.[serve]'")
httpx = pytest.importorskip("httpx", reason="kvcached serve needs the serve extra: pip install '.[serve]'")

from kvcached.serve.config import parse_config  # noqa: E402
from kvcached.serve.metrics import ServeMetrics  # noqa: E402
from kvcached.serve.router import create_app  # noqa: E402
from serve_fakes import FakeRoute, FakeRoutes, Seen, ServerThread, fake_engine  # noqa: E402

DISCONNECT_NOTICED_S = 5.0


@pytest.fixture
def served():
    """A router in front of one fake engine ("a"), a model that is restarting ("b") and one whose
    engine is ready but no longer listens ("c")."""
    seen = Seen()
    config = parse_config(
        {
            "device": "cpu",
            "models": [{"name": n, "engine": "vllm", "model": "/m"} for n in ("a", "b", "c")],
        }
    )
    with ServerThread(fake_engine(Seen())) as gone:
        gone_url = gone.url
    with ServerThread(fake_engine(seen)) as engine:
        routes = FakeRoutes({"a": FakeRoute(engine.url), "b": FakeRoute(None, "restarting"), "c": FakeRoute(gone_url)})
        metrics = ServeMetrics(list(config.models))
        with ServerThread(create_app(routes, ["a", "b", "c"], metrics)) as router:
            yield router.url, seen, routes


def post(url: str, path: str, body: bytes, headers: dict | None = None, timeout=30) -> httpx.Response:
    headers = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(url + path, content=body, headers=headers, timeout=timeout)


def test_models_are_listed_in_openai_shape(served):
    url, _, _ = served
    answer = httpx.get(url + "/v1/models").json()
    assert answer["object"] == "list" and [m["id"] for m in answer["data"]] == ["a", "b", "c"]
    assert all(m["object"] == "model" for m in answer["data"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bodies_pass_unchanged_both_ways(served, path):
    url, seen, _ = served
    body = '{ "model":"a",  "prompt": "héllo", "max_tokens" :3, "extra_field": [1,2]}'.encode()
    answer = post(url, path, body, headers={"Content-Type": "application/json", "Authorization": "Bearer k"})
    assert seen.bodies[-1] == body and seen.headers[-1]["authorization"] == "Bearer k"
    assert answer.status_code == 200 and answer.content == b'{"z": 1,  "model" : "a", "text": "\\u00e9"}'
    assert answer.headers["x-engine"] == "fake"


def test_an_engine_error_passes_with_its_status(served):
    url, _, _ = served
    answer = post(url, "/v1/completions", b'{"model": "a", "status": 400}')
    assert answer.status_code == 400 and answer.json() == {"error": {"message": "engine says no"}}


def test_an_unknown_model_is_an_openai_404(served):
    url, seen, _ = served
    answer = post(url, "/v1/completions", b'{"model": "nope", "prompt": "x"}')
    assert answer.status_code == 404 and not seen.bodies
    error = answer.json()["error"]
    assert error["type"] == "NotFoundError" and error["code"] == "model_not_found" and error["param"] == "model"
    assert "`nope` does not exist" in error["message"] and "a, b, c" in error["message"]


def test_a_model_whose_engine_is_down_is_an_openai_503(served):
    url, _, _ = served
    answer = post(url, "/v1/chat/completions", b'{"model": "b", "messages": []}')
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
    error = answer.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == "engine_restarting"
    assert "restarting" in error["message"]


def test_an_engine_that_stopped_answering_is_a_503(served):
    url, _, _ = served
    answer = post(url, "/v1/completions", b'{"model": "c", "prompt": "x"}')
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "ServiceUnavailableError"
    # The engine died a moment ago: its state still reads "ready", which the answer must not repeat.
    error = answer.json()["error"]
    assert error["code"] == "engine_unreachable" and "ready" not in error["message"], error
    assert error["message"] == "The model `c` is not available now (its engine did not answer); retry in a few seconds."


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"prompt": "no model"}'])
def test_a_request_without_a_model_is_a_400(served, body):
    url, _, _ = served
    answer = post(url, "/v1/completions", body)
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "BadRequestError"


def test_streaming_passes_every_chunk(served):
    url, seen, routes = served
    with httpx.stream(
        "POST", url + "/v1/completions", content=b'{"model": "a", "stream": true, "chunks": 20}', timeout=60
    ) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        assert answer.headers["x-engine"] == "fake"
        text = b"".join(answer.iter_raw()).decode()
    events = [line for line in text.split("\n\n") if line]
    assert events[:2] == ['data: {"i": 0}', 'data: {"i": 1}'] and events[-1] == "data: [DONE]" and len(events) == 21


def test_a_client_leaving_a_stream_cancels_it_upstream(served):
    url, seen, _ = served
    with httpx.stream("POST", url + "/v1/completions", content=b'{"model": "a", "stream": true}', timeout=60) as answer:
        lines = answer.iter_lines()
        assert next(lines) == 'data: {"i": 0}'
    assert seen.disconnected.wait(DISCONNECT_NOTICED_S), "the engine still streams to a client that left"
    sent = seen.chunks_sent
    time.sleep(0.3)
    assert seen.chunks_sent == sent < 200


def test_a_client_leaving_before_the_answer_cancels_it_upstream(served):
    url, seen, _ = served
    with pytest.raises(httpx.ReadTimeout):
        post(url, "/v1/completions", b'{"model": "a", "sleep_s": 20}', timeout=httpx.Timeout(30, read=0.5))
    assert seen.disconnected.wait(DISCONNECT_NOTICED_S), "the engine still works for a client that left"


def test_an_engine_dying_mid_stream_ends_the_stream_and_is_counted(served):
    url, _, _ = served
    body = b'{"model": "a", "stream": true, "chunks": 20, "die_after": 3}'
    with httpx.stream("POST", url + "/v1/completions", content=body, timeout=60) as answer:
        lines = [line for line in answer.iter_lines() if line]
    assert lines == ['data: {"i": 0}', 'data: {"i": 1}', 'data: {"i": 2}']
    assert 'model="a",status="502"} 1.0' in httpx.get(url + "/metrics").text


def test_health_gives_every_model_state(served):
    url, _, routes = served
    answer = httpx.get(url + "/health")
    assert answer.status_code == 503 and answer.json()["models"] == {"a": "ready", "b": "restarting", "c": "ready"}
    routes.routes["b"].state_name = "ready"
    routes.routes["b"].base_url = routes.routes["a"].base_url
    assert httpx.get(url + "/health").status_code == 200


def test_metrics_count_requests_by_model_and_status(served):
    url, _, _ = served
    post(url, "/v1/completions", b'{"model": "a", "prompt": "x"}')
    post(url, "/v1/completions", b'{"model": "b", "prompt": "x"}')
    post(url, "/v1/completions", b'{"model": "unheard-of", "prompt": "x"}')
    text = httpx.get(url + "/metrics").text
    assert 'kvcached_serve_requests_total{endpoint="/v1/completions",model="a",status="200"} 1.0' in text
    assert 'kvcached_serve_requests_total{endpoint="/v1/completions",model="b",status="503"} 1.0' in text
    assert 'kvcached_serve_requests_total{endpoint="/v1/completions",model="",status="404"} 1.0' in text
    assert 'kvcached_serve_request_duration_seconds_count{endpoint="/v1/completions",model="a"} 1.0' in text
    assert 'kvcached_serve_model_min_bytes{model="a"} 0.0' in text
    assert json.loads(json.dumps(text))  # plain text, one scrape
