"""The request ``serve_sleep.py`` times, and a served model's engine started cold to answer it.

The request is one streamed, greedy completion of a short prompt; its time to first token is
taken from when the caller says it was sent. A cold start is what a process swapper (llama-swap,
Ollama) does for a model whose engine is not running: start ``python -m <engine server>`` and
wait until it answers. Here it gets the command and environment ``kvcached serve`` gives that
model's engine, on a registry of its own (it takes nothing from serve's budget), and is timed from
its start to its first token; the stop of the engine it would replace is not counted.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

PROMPT, MAX_TOKENS = "Hello", 16
HEALTH_POLL_S = 0.05  # how often the cold engine is asked whether it is up (at most this much late)
COLD_START_TIMEOUT_S = 600


def first_token(client: Any, model: str, sent: float) -> tuple[float, str]:
    """Streams the timed completion; (seconds from ``sent`` to its first chunk, the whole text)."""
    first, parts = None, []
    for chunk in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    ):
        if chunk.choices:
            first = time.monotonic() if first is None else first
            parts.append(chunk.choices[0].text or "")
    if first is None:
        raise RuntimeError(f"{model}: the stream ended without a token")
    return first - sent, "".join(parts)


def openai_client(base_url: str) -> Any:
    import openai

    # No retries: a refused request must show, not be retried away.
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=COLD_START_TIMEOUT_S)


def cold_start(spec: Any, workdir: Path, tag: str) -> dict[str, Any]:
    """Starts ``spec``'s engine fresh, as serve would (its command and environment) but on a registry
    of its own; times its start to the first token of the timed request, then stops it."""
    import httpx

    from kvcached.registry import REGISTRY_DIR_ENV
    from kvcached.serve.engines import ENGINES, engine_environment
    from kvcached.serve.ports import free_port
    from kvcached.serve.processes import stop_group
    from kvcached.testing.serve_session import registry_entries

    port = free_port()
    registry = workdir / f"cold-{tag}" / "registry"
    registry.mkdir(parents=True, exist_ok=True)
    env = {**engine_environment(spec, "cpu"), REGISTRY_DIR_ENV: str(registry)}
    log_path = registry.parent / "engine.log"
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        started = time.monotonic()
        process = subprocess.Popen(
            ENGINES[spec.engine].command(spec, port),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        with httpx.Client(timeout=10) as http:
            while not _answers(http, url + "/health"):
                if process.poll() is not None:
                    raise RuntimeError(
                        f"the cold engine exited ({process.returncode}):\n{log_path.read_text()[-4000:]}"
                    )
                if time.monotonic() - started > COLD_START_TIMEOUT_S:
                    raise RuntimeError(f"the cold engine was not up in {COLD_START_TIMEOUT_S} s; its log: {log_path}")
                time.sleep(HEALTH_POLL_S)
        ready = time.monotonic()
        seconds, text = first_token(openai_client(url), spec.name, started)
        weights = sum(e["weights_bytes"] for e in registry_entries(registry) if e["alive"] and e["name"] == spec.name)
    finally:
        stop_group(process.pid, 60)
        process.wait()
    return {
        "cold_ms": seconds * 1000,
        "cold_ready_ms": (ready - started) * 1000,
        "cold_text": text,
        "cold_weights_bytes": weights,
    }


def _answers(http: Any, url: str) -> bool:
    import httpx

    try:
        return http.get(url).status_code == 200
    except httpx.HTTPError:
        return False


__all__ = ["COLD_START_TIMEOUT_S", "MAX_TOKENS", "PROMPT", "cold_start", "first_token", "openai_client"]
