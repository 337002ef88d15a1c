"""kvcached inside the real SGLang 0.5.23 (its CPU engine: scheduler, radix cache, pools, allocators).

Every engine runs in its own process through ``sglang_harness.py`` (or SGLang's
HTTP server) on a tiny random-weight Llama written by the test, with token-id
prompts and greedy sampling. Engines with and without kvcached run side by side;
memory is read from the device registry, as ``kvctl`` reads it. Engines sharing
one budget are in ``test_sglang_shared_budget.py``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from kvcached.testing.sglang_env import require_sglang

require_sglang()
pytest.importorskip("kvcached.pool", reason="kvcached core not built")

from sglang_runs import (  # noqa: E402
    ENGINE,
    ENGINE_TIMEOUT_S,
    LOAD,
    PAGE_ID_BYTES,
    SHARED,
    engine_env,
    finish,
    kvctl,
    probe,
    start,
    wait_for_file,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


@pytest.fixture(scope="module")
def page16(sglang_workdir):
    """Page size 16 with and without kvcached; then ``kvctl set-limit`` caps the
    kvcached engine while it runs (two page ids: its padding page and one more)
    and the load runs again."""
    workdir = sglang_workdir
    registry = workdir / "registry-p16"
    registry.mkdir()
    loaded, limited = workdir / "p16.loaded", workdir / "p16.limited"
    base = start(
        workdir, "base_p16", {"page_size": 16, "engine": ENGINE, "phases": [SHARED, LOAD]}, engine_env(False, registry)
    )
    phases = [SHARED, {**LOAD, "signal": str(loaded)}, {**LOAD, "wait_for": str(limited)}]
    kv = start(
        workdir,
        "kv_p16",
        {"page_size": 16, "engine": ENGINE, "phases": phases},
        engine_env(True, registry, KVCACHED_NAME="kv-p16"),
    )
    try:
        wait_for_file(loaded, [base[0], kv[0]], "the first load")
        set_limit = kvctl(registry, "set-limit", "kv-p16", str(2 * PAGE_ID_BYTES))
        listing = kvctl(registry, "list", "--json")
    finally:
        limited.write_text("done")
    runs = {"base_p16": finish(workdir, "base_p16", *base), "kv_p16": finish(workdir, "kv_p16", *kv)}
    runs["set_limit"], runs["listing"] = set_limit, listing
    return runs


@pytest.fixture(scope="module")
def sleeping(sglang_workdir):
    """kvcached with SGLang's ``sleep_on_idle``: the idle scheduler blocks until
    the next request (or 1 s). The load is probed 0.4 s after it finished, from
    the registry, before anything is sent that would wake the scheduler."""
    registry = sglang_workdir / "registry-sleep"
    registry.mkdir()
    spec = {"page_size": 1, "engine": {**ENGINE, "sleep_on_idle": True}, "phases": [{**LOAD, "settle_s": 0.4}]}
    return finish(
        sglang_workdir,
        "kv_sleep",
        *start(sglang_workdir, "kv_sleep", spec, engine_env(True, registry, KVCACHED_NAME="kv-sleep")),
    )


@pytest.fixture(scope="module")
def holding(sglang_workdir):
    """An idle hold of 2 s, with ``sleep_on_idle`` (the scheduler's idle sleep
    is where kvcached waits): the load is probed 0.4 s after it finished, then
    again once the hold has passed."""
    registry = sglang_workdir / "registry-hold"
    registry.mkdir()
    spec = {
        "page_size": 1,
        "engine": {**ENGINE, "sleep_on_idle": True},
        "phases": [{**LOAD, "settle_s": 0.4}, {"settle_s": 2.6}],
    }
    env = engine_env(True, registry, KVCACHED_NAME="kv-hold", KVCACHED_IDLE_RELEASE_S="2")
    return finish(sglang_workdir, "kv_hold", *start(sglang_workdir, "kv_hold", spec, env))


# --------------------------------------------------------------------------- #


def test_kvcached_is_active_only_when_enabled(sglang_page1):
    stats = probe(sglang_page1["kv_p1"], "after_init")["kvcached"]
    assert stats is not None and stats["engine_blocks"] == 8192 + 1  # SGLang's slots + padding slot
    assert probe(sglang_page1["base_p1"], "after_init")["kvcached"] is None
    assert "kvcached" not in sglang_page1["base_p1"]["log"].replace("KVCACHED", "")


def test_greedy_outputs_match_without_kvcached_page_size_1(sglang_page1):
    assert sglang_page1["kv_p1"]["outputs"] == sglang_page1["base_p1"]["outputs"]
    # The radix cache works as without kvcached: the same later requests hit the shared prefix.
    hits = sglang_page1["kv_p1"]["cached_tokens"][0]
    assert hits == sglang_page1["base_p1"]["cached_tokens"][0] and sum(hits) > 0


def test_greedy_outputs_match_without_kvcached_page_size_16(page16):
    assert page16["kv_p16"]["outputs"][:2] == page16["base_p16"]["outputs"]
    hits = page16["kv_p16"]["cached_tokens"][0]
    assert hits == page16["base_p16"]["cached_tokens"][0] and sum(hits) > 0


def test_kv_memory_grows_with_load_and_returns_when_idle(sglang_page1):
    result = sglang_page1["kv_p1"]
    # Idle: the padding page only. Under load: the load's 3 pages' worth.
    assert probe(result, "after_init")["mapped_bytes"] == PAGE_ID_BYTES
    assert result["peak_mapped_bytes"][1] >= 3 * PAGE_ID_BYTES
    done = probe(result, "phase1_done")
    assert done["mapped_bytes"] == PAGE_ID_BYTES
    assert done["kvcached"]["engine_used_blocks"] == 0 and done["kvcached"]["secured_blocks"] == 0


def test_memory_returns_when_idle_before_sglang_sleeps(sleeping):
    assert sleeping["peak_mapped_bytes"][0] >= 3 * PAGE_ID_BYTES
    assert probe(sleeping, "phase0_done")["mapped_bytes"] == PAGE_ID_BYTES


def test_idle_engine_keeps_its_memory_for_the_hold_then_gives_it_back(holding, sglang_page1):
    held, released = probe(holding, "phase0_done"), probe(holding, "phase1_done")
    # 0.4 s after the load: the radix cache still holds the load's tokens, mapped.
    assert held["mapped_bytes"] >= 2 * PAGE_ID_BYTES, held
    assert held["kvcached"]["idle_release_s"] == 2.0
    # Once the 2 s hold has passed: the padding page only, nothing handed out.
    assert released["mapped_bytes"] == PAGE_ID_BYTES, released
    assert released["kvcached"]["engine_used_blocks"] == 0 and released["kvcached"]["idle_early_releases"] == 0
    assert holding["outputs"][0] == sglang_page1["base_p1"]["outputs"][1]


def test_tight_limit_set_by_kvctl_while_running_makes_requests_wait(page16):
    assert page16["set_limit"].returncode == 0, page16["set_limit"].stderr
    entry = next(e for e in json.loads(page16["listing"].stdout)["instances"] if e["name"] == "kv-p16")
    assert entry["limit_bytes"] == 2 * PAGE_ID_BYTES
    result = page16["kv_p16"]
    # Unlimited, the load runs all at once on 3 page ids; limited to 2, it
    # cannot: requests waited in the queue (or were retracted) and ran later.
    assert result["peak_mapped_bytes"][1] >= 3 * PAGE_ID_BYTES
    assert result["peak_mapped_bytes"][2] <= 2 * PAGE_ID_BYTES
    assert probe(result, "phase2_done")["kvcached"]["limit_pages"] == 2
    # Same tokens as without kvcached, and no crash.
    assert result["outputs"][2] == page16["base_p16"]["outputs"][1]


def test_http_server_answers_generate_with_the_same_tokens(sglang_workdir, sglang_page1):
    """``python -m sglang.launch_server`` with KVCACHED_ENABLE=1: the same command, kvcached inside."""
    workdir = sglang_workdir
    registry = workdir / "registry-http"
    registry.mkdir()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(workdir / "model"),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--page-size",
        "1",
        "--max-total-tokens",
        "8192",
        "--max-running-requests",
        "16",
        "--chunked-prefill-size",
        "512",
        "--max-prefill-tokens",
        "2048",
        "--random-seed",
        "0",
        "--disable-cuda-graph",
        "--log-level",
        "warning",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    log = open(workdir / "http.log", "w")
    server = subprocess.Popen(
        command,
        env=engine_env(True, registry, KVCACHED_NAME="kv-http"),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=workdir,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + ENGINE_TIMEOUT_S
        while True:
            assert server.poll() is None, (workdir / "http.log").read_text()[-6000:]
            assert time.time() < deadline, "the server did not become healthy"
            try:
                with urllib.request.urlopen(f"{url}/health_generate", timeout=30) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(1.0)
        body = json.dumps(
            {
                "input_ids": SHARED["prompts"],
                "sampling_params": {"temperature": 0.0, "max_new_tokens": SHARED["max_new_tokens"], "ignore_eos": True},
            }
        ).encode()
        request = urllib.request.Request(f"{url}/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            answers = json.loads(response.read())
        with urllib.request.urlopen(f"{url}/get_server_info", timeout=60) as response:
            info = json.loads(response.read())
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
    assert [a["output_ids"] for a in answers] == sglang_page1["base_p1"]["outputs"][0]
    assert info["internal_states"][0]["kvcached"]["engine_blocks"] == 8192 + 1
