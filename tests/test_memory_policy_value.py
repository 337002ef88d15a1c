"""One MemoryPolicy value (min, max, priority) from serve's YAML and the KVCACHED_* variables to the
registry entry: checked once, passed whole, the same value at every step."""

from __future__ import annotations

import pickle

import pytest

from kvcached.integration.common.rank_devices import describe_rank
from kvcached.integration.common.registration import register_rank
from kvcached.integration.common.settings import Settings
from kvcached.registry import DeviceRegistry, MemoryPolicy

PAGE_BYTES = 2 << 20


@pytest.fixture(autouse=True)
def isolated_registry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))


def test_a_policy_is_one_immutable_comparable_picklable_value():
    policy = MemoryPolicy(min_bytes=PAGE_BYTES, max_bytes=4 * PAGE_BYTES, priority=-3)
    assert (policy.min_bytes, policy.max_bytes, policy.priority) == (PAGE_BYTES, 4 * PAGE_BYTES, -3)
    assert pickle.loads(pickle.dumps(policy)) == policy and hash(pickle.loads(pickle.dumps(policy))) == hash(policy)
    assert policy != MemoryPolicy(min_bytes=PAGE_BYTES, max_bytes=None, priority=-3)
    assert MemoryPolicy() == MemoryPolicy(0, None, 0)
    with pytest.raises(AttributeError):
        policy.priority = 5


@pytest.mark.parametrize(
    "fields, error, words",
    [
        (dict(min_bytes=2 * PAGE_BYTES, max_bytes=PAGE_BYTES), ValueError, "min_bytes .* is above max_bytes"),
        (dict(min_bytes=-1), ValueError, "min_bytes must not be negative"),
        (dict(max_bytes=-1), ValueError, "max_bytes must not be negative"),
        (dict(priority=2**31), ValueError, "priority 2147483648 is out of range"),
        (dict(priority=-(2**31) - 1), ValueError, "out of range"),
        (dict(priority=True), TypeError, "priority must be an integer"),
        (dict(priority="1"), TypeError, "priority must be an integer"),
        (dict(min_bytes=1 << 60), ValueError, "larger than any device"),
    ],
)
def test_a_policy_no_instance_could_have_is_refused_when_made(fields, error, words):
    with pytest.raises(error, match=words):
        MemoryPolicy(**fields)


def test_the_engine_settings_read_the_variables_into_one_policy(monkeypatch):
    monkeypatch.setenv("KVCACHED_MIN_BYTES", "2MiB")
    monkeypatch.setenv("KVCACHED_LIMIT_BYTES", "8MiB")
    monkeypatch.setenv("KVCACHED_PRIORITY", "4")
    assert Settings.from_env().policy == MemoryPolicy(2 << 20, 8 << 20, 4)
    monkeypatch.setenv("KVCACHED_MIN_BYTES", "16MiB")  # above the max: refused where it is read
    with pytest.raises(ValueError, match="above max_bytes"):
        Settings.from_env()


def test_registration_writes_the_policy_it_is_given_into_the_entry():
    registry = DeviceRegistry("cpu", 64 * PAGE_BYTES)
    policy = MemoryPolicy(min_bytes=PAGE_BYTES, max_bytes=8 * PAGE_BYTES, priority=9)
    budget = register_rank("whole", describe_rank("cpu", 0), policy=policy)
    try:
        (entry,) = [e for e in registry.entries() if e["name"] == "whole"]
        assert MemoryPolicy(entry["min_bytes"], entry["max_bytes"], entry["priority"]) == policy
        assert entry["limit_bytes"] == entry["max_bytes"], "the older name of the max stays for kvctl --json readers"
        assert (budget.min_bytes, budget.max_bytes, budget.priority) == (PAGE_BYTES, 8 * PAGE_BYTES, 9)
    finally:
        budget.unregister()


def test_registering_takes_a_policy_not_loose_numbers():
    registry = DeviceRegistry("cpu", 64 * PAGE_BYTES)
    with pytest.raises(TypeError):
        registry.register("loose", limit_bytes=PAGE_BYTES)
    assert not hasattr(registry, "set_limit"), "one way to change the max: set_policy(max_bytes=...)"
    assert registry.entries() == []


def test_serve_passes_the_yaml_policy_to_its_engine_as_the_same_value(monkeypatch):
    from kvcached.serve.config import parse_config
    from kvcached.serve.engines import engine_environment

    memory = {"min": "2MiB", "max": "8MiB", "priority": 3}
    data = {"device": "cpu", "models": [{"name": "a", "engine": "vllm", "model": "/m", "memory": memory}]}
    (spec,) = parse_config(data).models
    assert spec.memory == MemoryPolicy(2 << 20, 8 << 20, 3)
    for name, value in engine_environment(spec, "cpu", {}).items():
        monkeypatch.setenv(name, value)
    assert Settings.from_env().policy == spec.memory, "what the engine reads back is what serve was given"
