"""The tiny hybrid models' outputs depend on their KV cache, and the check that says so fails when not."""

from __future__ import annotations

import pytest

from kvcached.errors import InvalidArgumentError
from kvcached.testing.tiny_hybrids import check_outputs_read_context, make_tiny_hybrid, with_context_changed
from kvcached.testing.tiny_llama import prompt_ids

PROMPTS = with_context_changed(prompt_ids(4, 200, seed=1, shared_prefix=130))


def test_the_last_prompt_is_the_first_prompts_last_token_in_the_second_prompts_context():
    assert len(PROMPTS) == 5 and PROMPTS[-1][-1] == PROMPTS[0][-1] and PROMPTS[-1][:-1] == PROMPTS[1][:-1]
    with pytest.raises(InvalidArgumentError, match="same token"):
        with_context_changed([[5, 7], [6, 7]])


def test_the_check_fails_for_a_model_that_reads_only_the_last_token():
    repeats = [[prompt[-1]] * 8 for prompt in PROMPTS]
    with pytest.raises(AssertionError, match="repeats"):
        check_outputs_read_context(repeats)
    # Diverse, but a function of the last token alone (as a model ignoring its KV cache gives).
    last_token_only = [[(prompt[-1] + i) % 512 for i in range(8)] for prompt in PROMPTS]
    with pytest.raises(AssertionError, match="another context"):
        check_outputs_read_context(last_token_only)


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_tiny_gemma_models_read_their_context(family, tmp_path):
    """Gemma scales its (tied) embeddings by sqrt(hidden_size): drawn at the common scale, the tiny
    models repeated their last token whatever came before it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvcached.testing.tiny_hybrids import FAMILIES

    _, model_class = FAMILIES[family]()
    model = model_class.from_pretrained(make_tiny_hybrid(family, tmp_path / family), dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    outputs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            generated = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
            outputs.append(generated[0, len(prompt) :].tolist())
    check_outputs_read_context(outputs)
