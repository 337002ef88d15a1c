"""kvcached.ModelWeights: a torch module's weights sleep and wake in place (host backend; GPUs in the gpu run)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import kvcached  # noqa: E402
from kvcached.registry import registry_for  # noqa: E402


class TinyLM(torch.nn.Module):
    """Tied embedding and head, a buffer viewing a parameter, a plain buffer, several dtypes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(97, 32)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        self.head = torch.nn.Linear(32, 97, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.full((32,), 0.5, dtype=torch.float64))
        self.register_buffer("first_row", self.embed.weight.data[0])  # a view of a parameter's storage
        self.register_buffer("steps", torch.arange(5, dtype=torch.int32), persistent=False)

    def forward(self, ids):
        hidden = self.embed(ids) * self.scale.float()
        return self.head(self.mlp(hidden) + self.first_row)


def describe(module):
    return {
        name: (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]
    }


@pytest.fixture
def model():
    return TinyLM()


@pytest.fixture
def ids():
    return torch.tensor([[1, 5, 9, 42, 96]])


def test_adoption_moves_every_tensor_once_and_changes_nothing_else(model, ids):
    before = model(ids).detach()
    shape = describe(model)
    parameters = {name: id(p) for name, p in model.named_parameters()}
    old_pointers = {t.data_ptr() for t in model.parameters()}
    with kvcached.ModelWeights(model, name="tiny-lm") as weights:
        assert describe(model) == shape
        assert {name: id(p) for name, p in model.named_parameters()} == parameters  # the same objects
        assert not old_pointers & {t.data_ptr() for t in model.parameters()}
        base = weights._space.base_address
        assert all(base <= t.data_ptr() < base + weights.nbytes for t in [*model.parameters(), *model.buffers()])
        assert model.head.weight is model.embed.weight
        assert model.first_row.data_ptr() == model.embed.weight.data_ptr()  # still a view of it
        assert torch.equal(model(ids), before)


def test_level_1_sleep_and_wake_keep_the_outputs_and_the_addresses(model, ids):
    before = model(ids).detach()
    with kvcached.ModelWeights(model) as weights:
        pointers = [t.data_ptr() for t in model.parameters()]
        for _ in range(3):
            weights.sleep(level=1)
            assert weights.is_sleeping and weights.sleep_level == 1
            weights.wake_up()
            assert not weights.is_sleeping
            assert [t.data_ptr() for t in model.parameters()] == pointers
            assert torch.equal(model(ids), before)


def test_level_2_discards_the_contents_and_a_reload_brings_them_back(model, ids):
    before = model(ids).detach()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with kvcached.ModelWeights(model) as weights:
        weights.sleep(level=2)
        weights.wake_up()
        assert all(not t.any() for t in model.parameters())
        model.load_state_dict(saved)  # the RL flow: wake the weights, load the new ones in place
        assert torch.equal(model(ids), before)


def test_the_registry_counts_the_weights_and_whether_they_sleep(model):
    def entry():
        (found,) = [e for e in registry_for("cpu").entries() if e["name"] == "counted"]
        return found

    weights = kvcached.ModelWeights(model, name="counted")
    assert (entry()["weights_bytes"], entry()["sleeping"], entry()["mapped_bytes"]) == (weights.nbytes, False, 0)
    weights.sleep(1)
    assert (entry()["weights_bytes"], entry()["sleeping"]) == (0, True)
    weights.wake_up()
    assert (entry()["weights_bytes"], entry()["sleeping"]) == (weights.nbytes, False)
    weights.close()
    assert not [e for e in registry_for("cpu").entries() if e["name"] == "counted"]


def test_a_wake_the_budget_cannot_cover_raises_and_leaves_the_weights_asleep(model, ids, monkeypatch, tmp_path):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    before = model(ids).detach()
    registry = registry_for("cpu", budget_bytes=8 << 20)
    weights = kvcached.ModelWeights(model, name="sleeper")
    weights.sleep(1)
    hog = registry.register("hog")
    assert hog.try_acquire(7 << 20)
    with pytest.raises(kvcached.OutOfMemoryError, match="sleeper"):
        weights.wake_up(timeout_s=0.05)
    assert weights.is_sleeping
    assert hog.pressure_bytes >= weights.nbytes  # the refused wake is demand the others see
    hog.release(7 << 20)
    weights.wake_up()
    assert torch.equal(model(ids), before)
    weights.close()
    hog.unregister()


def test_kv_and_weights_share_one_budget(model, monkeypatch, tmp_path):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    registry_for("cpu", budget_bytes=16 << 20)
    weights = kvcached.ModelWeights(model, name="w")  # 2 MiB
    pool = kvcached.KVPool(
        num_layers=1, block_bytes=2 << 20, num_buffers=1, num_blocks=16, device="cpu", background_worker=False
    )
    assert pool.available() == 7  # 16 MiB less the weights' 2 MiB, in 2 MiB blocks
    weights.sleep(2)
    assert pool.available() == 8
    pool.close()
    weights.close()


def test_misuse_is_refused_and_leaves_the_module_untouched(model):
    pointers = [t.data_ptr() for t in model.parameters()]
    model.register_buffer("elsewhere", torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="meta"):
        kvcached.ModelWeights(model, device="cpu")
    assert [t.data_ptr() for t in model.parameters()] == pointers
    del model.elsewhere
    with pytest.raises(TypeError, match="nn.Module"):
        kvcached.ModelWeights(object())
    with pytest.raises(ValueError, match="no parameters"):
        kvcached.ModelWeights(torch.nn.ReLU())
    with kvcached.ModelWeights(model, name="first") as weights:
        with pytest.raises(ValueError, match="already held by ModelWeights 'first'"):
            kvcached.ModelWeights(model)
        for level in (0, 3, "1", True, None):
            with pytest.raises(ValueError, match="sleep level"):
                weights.sleep(level)
        assert not weights.is_sleeping
        with pytest.raises(ValueError, match="timeout_s"):
            weights.wake_up(timeout_s=-1)


def test_sleeping_twice_and_waking_an_awake_model_are_no_ops(model, ids):
    before = model(ids).detach()
    with kvcached.ModelWeights(model) as weights:
        weights.wake_up()
        weights.sleep(1)
        weights.sleep(1)
        weights.sleep(2)
        assert weights.sleep_level == 1
        weights.wake_up()
        weights.wake_up()
        assert torch.equal(model(ids), before)
        assert (weights.stats()["sleeps"], weights.stats()["wakes"]) == (1, 1)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_close_gives_the_module_back_to_ordinary_memory(model, ids, level):
    before = model(ids).detach()
    weights = kvcached.ModelWeights(model)
    base = weights._space.base_address
    if level:
        weights.sleep(level)
    weights.close()
    weights.close()
    assert all(not base <= t.data_ptr() < base + weights.nbytes for t in model.parameters())
    assert model.head.weight is model.embed.weight
    if level == 2:
        assert all(not t.any() for t in model.parameters())
    else:
        assert torch.equal(model(ids), before)
    with pytest.raises(ValueError, match="closed"):
        weights.sleep(1)
    kvcached.ModelWeights(model).close()  # the module can be adopted again


def test_hundreds_of_cycles_leak_nothing(model, ids):
    device = kvcached.open_device("cpu")
    before_counters = device.counters()
    before = model(ids).detach()
    weights = kvcached.ModelWeights(model, name="cycler")
    held = device.counters()
    for _cycle in range(300):
        weights.sleep(1)
        weights.wake_up()
    assert device.counters() == held
    assert torch.equal(model(ids), before)
    weights.close()
    after = device.counters()
    assert {k: after[k] for k in ("created_bytes", "mapped_bytes", "reserved_bytes")} == {
        k: before_counters[k] for k in ("created_bytes", "mapped_bytes", "reserved_bytes")
    }
