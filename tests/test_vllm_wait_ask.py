"""What a vLLM engine short of blocks asks the device for (kvcached's scheduler side, no vLLM needed):
the whole of every waiting request and what every running request has yet to grow, so that a
higher-priority burst asks lower priorities for all it needs at once."""

from __future__ import annotations

from types import SimpleNamespace

from kvcached.integration.vllm.v0_32.scheduler import _blocks_waited_for


def request(prompt: int, max_tokens: int, generated: int = 0) -> SimpleNamespace:
    return SimpleNamespace(num_prompt_tokens=prompt, max_tokens=max_tokens, num_tokens=prompt + generated)


def scheduler(waiting=(), running=(), block_size=128, max_model_len=2048) -> SimpleNamespace:
    return SimpleNamespace(
        waiting=list(waiting), running=list(running), block_size=block_size, max_model_len=max_model_len
    )


def test_a_waiting_request_asks_for_its_prompt_and_its_output():
    # 500 + 32 tokens: 5 blocks of 128, not the 4 its prompt alone takes.
    assert _blocks_waited_for(scheduler(waiting=[request(500, 32)] * 16)) == 80


def test_a_running_request_asks_for_what_it_has_yet_to_grow():
    # 500 prompt + 10 generated (4 blocks held), 32 at most: one more block to come.
    assert _blocks_waited_for(scheduler(running=[request(500, 32, generated=10)])) == 1
    assert _blocks_waited_for(scheduler(running=[request(512, 0)])) == 0


def test_the_ask_stops_at_the_models_length_and_never_below_what_a_request_holds():
    assert _blocks_waited_for(scheduler(waiting=[request(1000, 5000)], max_model_len=1024)) == 8
    preempted = SimpleNamespace(num_prompt_tokens=100, max_tokens=None, num_tokens=300)
    assert _blocks_waited_for(scheduler(waiting=[preempted])) == 3
