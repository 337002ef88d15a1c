"""kvcached.testing.tiny_llama: the one tiny random-weight Llama of the tests, benchmarks and examples."""

from __future__ import annotations

import json

import pytest

from kvcached.testing.tiny_llama import TINY_LLAMA, make_tiny_llama, prompt_ids

# transformers comes with the engines; the vLLM environment has it.
pytestmark = pytest.mark.vllm


def test_the_same_seed_writes_the_same_checkpoint_and_another_seed_another(tmp_path):
    pytest.importorskip("transformers")
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        make_tiny_llama(tmp_path / name, seed=seed)
    weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in "abc"]
    assert weights[0] == weights[1] and weights[0] != weights[2]
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["num_hidden_layers"] == TINY_LLAMA["num_hidden_layers"] == 2
    assert config["num_key_value_heads"] == 4 and config["head_dim"] == 64


def test_the_benchmarks_model_has_more_layers_in_bf16(tmp_path):
    pytest.importorskip("transformers")
    from safetensors import safe_open

    path = make_tiny_llama(tmp_path / "bench", seed=0, layers=6, dtype="bfloat16")
    assert json.loads((tmp_path / "bench" / "config.json").read_text())["num_hidden_layers"] == 6
    with safe_open(f"{path}/model.safetensors", "pt") as weights:
        dtypes = {str(weights.get_tensor(name).dtype) for name in weights.keys()}
    assert dtypes == {"torch.bfloat16"}


def test_an_existing_checkpoint_is_returned_as_it_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert make_tiny_llama(tmp_path, seed=3, layers=9) == str(tmp_path)
    assert (tmp_path / "config.json").read_text() == "{}"


def test_prompts_are_deterministic_and_share_the_asked_prefix():
    prompts = prompt_ids(3, 20, seed=5, shared_prefix=8)
    assert prompts == prompt_ids(3, 20, seed=5, shared_prefix=8)
    assert all(len(p) == 20 and p[:8] == prompts[0][:8] for p in prompts)
    assert all(3 <= token < TINY_LLAMA["vocab_size"] for p in prompts for token in p)
