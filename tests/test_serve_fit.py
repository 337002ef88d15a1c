"""The check before serve starts anything: what the models need awake against the budget. Models that
never sleep hold their mins together; models that may sleep take turns, so the largest of them (its
checkpoint and its min) must fit beside those; a sleeping model claims no min."""

from __future__ import annotations

import pytest

from kvcached.errors import ServeConfigError
from kvcached.serve.config import parse_config
from kvcached.serve.fit import awake_bytes, checkpoint_bytes

MiB = 1 << 20


def checkpoint(tmp_path, name: str, mib: int) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * (mib * MiB))
    (folder / "config.json").write_text("{}")  # not weights: not counted
    return str(folder)


def config(budget: str, *models: dict):
    return parse_config({"device": "cpu", "budget": budget, "models": list(models)})


def model(name: str, path: str, min_mib: int, sleep: bool) -> dict:
    entry = {"name": name, "engine": "vllm", "model": path, "memory": {"min": f"{min_mib}MiB"}}
    if sleep:
        entry["sleep"] = {"level": 1}
    return entry


def test_a_checkpoint_is_the_size_of_its_weight_files_and_a_hub_id_has_none(tmp_path):
    assert checkpoint_bytes(checkpoint(tmp_path, "m", 3)) == 3 * MiB
    assert checkpoint_bytes("org/some-model") is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert checkpoint_bytes(str(empty)) is None


def test_models_that_take_turns_need_only_the_largest_to_fit(tmp_path):
    # Three sleepy models of 4 MiB + min 8 MiB each: 36 MiB in all, 12 MiB at a time.
    models = [model(n, checkpoint(tmp_path, n, 4), 8, sleep=True) for n in "abc"]
    parsed = config("28MiB", *models)
    assert [awake_bytes(spec) for spec in parsed.models] == [12 * MiB] * 3
    assert config("12MiB", *models).budget_bytes == 12 * MiB


def test_the_largest_sleepy_model_beside_the_mins_of_those_that_never_sleep_must_fit(tmp_path):
    never = model("always", checkpoint(tmp_path, "always", 64), 8, sleep=False)  # weights outside the budget
    small = model("small", checkpoint(tmp_path, "small", 2), 2, sleep=True)
    large = model("large", checkpoint(tmp_path, "large", 10), 4, sleep=True)
    assert config("22MiB", never, small, large).budget_bytes == 22 * MiB  # 8 + (10 + 4)
    with pytest.raises(ServeConfigError) as refused:
        config("21MiB", never, small, large)
    message = str(refused.value)
    assert message.startswith("budget: the model 'large' needs 14.0 MiB awake"), message
    assert "beside the mins of the models that never sleep (8.0 MiB): 22.0 MiB, above the budget of 21.0 MiB" in message


def test_a_sleepy_model_alone_larger_than_the_budget_is_refused(tmp_path):
    with pytest.raises(
        ServeConfigError, match=r"^budget: the model 'big' needs 20.0 MiB awake .*above the budget of 16.0"
    ):
        config("16MiB", model("big", checkpoint(tmp_path, "big", 12), 8, sleep=True))


def test_without_sleep_the_mins_must_add_up_within_the_budget(tmp_path):
    # The same mins that fit while the models take turns do not fit awake together.
    models = [model(n, "org/" + n, 8, sleep=False) for n in "abc"]
    with pytest.raises(ServeConfigError, match=r"^budget: the models' memory.min add up to 24.0 MiB"):
        config("20MiB", *models)
    sleepy = [model(n, "org/" + n, 8, sleep=True) for n in "abc"]
    assert config("20MiB", *sleepy).budget_bytes == 20 * MiB
