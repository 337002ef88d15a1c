"""What the router of ``kvcached serve`` answers itself, always in the OpenAI error shape: a body
nested too deep for Python's parser (400), a ``model`` that is not a string (400), a body over the
size limit (413, refused while it arrives, not after buffering it), an unknown path (404) or method
(405)."""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("fastapi", reason="kvcached serve needs the serve extra: pip install '.[serve]'")
pytest.importorskip("uvicorn", reason="kvcached serve needs the serve extra: pip install '.[serve]'")
pytest.importorskip("prometheus_client", reason="kvcached serve needs the serve extra: pip install '.[serve]'")
httpx = pytest.importorskip("httpx", reason="kvcached serve needs the serve extra: pip install '.[serve]'")

from kvcached.serve.config import parse_config  # noqa: E402
from kvcached.serve.metrics import ServeMetrics  # noqa: E402
from kvcached.serve.request_body import MAX_BODY_BYTES  # noqa: E402
from kvcached.serve.router import create_app  # noqa: E402
from serve_fakes import FakeRoute, FakeRoutes, Seen, ServerThread, fake_engine  # noqa: E402

MiB = 1 << 20
SMALL_LIMIT_BYTES = 1 * MiB


@pytest.fixture
def served():
    """A router in front of one fake engine ("a"), with a 1 MiB body limit; what the engine saw."""
    seen = Seen()
    config = parse_config({"device": "cpu", "models": [{"name": "a", "engine": "vllm", "model": "/m"}]})
    with ServerThread(fake_engine(seen)) as engine:
        app = create_app(
            FakeRoutes({"a": FakeRoute(engine.url)}),
            ["a"],
            ServeMetrics(list(config.models)),
            max_body_bytes=SMALL_LIMIT_BYTES,
        )
        with ServerThread(app) as router:
            yield router, seen


def openai_error(answer: httpx.Response, status: int, error_type: str, code: str) -> str:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == (error_type, code), error
    assert set(error) == {"message", "type", "param", "code"}
    return error["message"]


def test_a_body_nested_deeper_than_the_parser_goes_is_a_400(served):
    router, seen = served
    body = b'{"model": "a", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    answer = httpx.post(router.url + "/v1/completions", content=body, timeout=30)
    assert openai_error(answer, 400, "BadRequestError", "invalid_json") == "the request body is not valid JSON"
    assert not seen.bodies


@pytest.mark.parametrize(
    "body, kind", [(b'{"model": 5}', "a number"), (b'{"model": null}', "null"), (b'{"model": ["a"]}', "an array")]
)
def test_a_model_that_is_not_a_string_is_a_400_saying_so(served, body, kind):
    router, _ = served
    answer = httpx.post(router.url + "/v1/completions", content=body, timeout=30)
    message = openai_error(answer, 400, "BadRequestError", "model_not_string")
    assert message == f"`model` must be a string, not {kind}" and answer.json()["error"]["param"] == "model"


def test_a_body_over_the_limit_is_a_413_before_it_is_read(served):
    router, seen = served
    answer = httpx.post(router.url + "/v1/completions", content=b"x" * (SMALL_LIMIT_BYTES + 1), timeout=30)
    assert "larger than 1 MiB" in openai_error(answer, 413, "RequestTooLargeError", "request_too_large")
    assert not seen.bodies


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(served):
    # No Content-Length: the router can only count. It must answer without the rest of the body,
    # which this client never sends (a router that buffers first would wait for it for ever).
    router, seen = served
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * 65536
        for _ in range(2 * SMALL_LIMIT_BYTES // len(chunk)):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        answer = read_one_answer(sock)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b'"code":"request_too_large"' in answer
    assert not seen.bodies


def read_one_answer(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    """The head and the whole Content-Length body of one HTTP answer: the body may come in a later
    segment than the head, so reading to the blank line alone is not enough."""
    answer = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        head, blank, body = answer.partition(b"\r\n\r\n")
        if blank:
            lengths = [line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
            if lengths and len(body) >= int(lengths[0].split(b":", 1)[1]):
                break
        received = sock.recv(65536)
        if not received:
            break
        answer += received
    return answer


def test_the_default_limit_is_32_mib():
    assert MAX_BODY_BYTES == 32 * MiB


def test_an_unknown_path_or_method_is_answered_in_the_openai_shape(served):
    router, _ = served
    message = openai_error(httpx.get(router.url + "/v1/embeddings"), 404, "NotFoundError", "path_not_found")
    assert message.startswith("There is no /v1/embeddings here") and "POST /v1/chat/completions" in message
    message = openai_error(
        httpx.get(router.url + "/v1/completions"), 405, "MethodNotAllowedError", "method_not_allowed"
    )
    assert message == "/v1/completions does not take GET."


class _FaultyRoutes:
    def route(self, name: str):
        raise RuntimeError("a fault in serve itself")


def test_a_fault_in_the_router_is_a_500_in_the_openai_shape():
    config = parse_config({"device": "cpu", "models": [{"name": "a", "engine": "vllm", "model": "/m"}]})
    with ServerThread(create_app(_FaultyRoutes(), ["a"], ServeMetrics(list(config.models)))) as router:
        answer = httpx.post(router.url + "/v1/completions", content=b'{"model": "a"}', timeout=30)
    assert "its log says why" in openai_error(answer, 500, "InternalServerError", "internal_error")
