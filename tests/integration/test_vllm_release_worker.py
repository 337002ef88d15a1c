"""What each vLLM release's workers do with KV tensors, with kvcached, as far as it runs on the host.

Held against whichever vLLM release is importable (see
``test_vllm_release_scheduler``). Every place the release's workers build KV
tensors (its package's ``KV_TENSOR_SITES``: the V1 runner's and Model Runner
V2's ``allocate_kv_cache``, and 0.34's CPU runner's) is called with a real
KVCacheConfig from vLLM's planner, and its tensors are compared with what
vLLM's own function allocates for the same config: same layers, shapes,
strides and dtype, and every view an alias into the rank's kvcached space.
Model Runner V2's ``init_kv_cache`` (allocation, then binding to the model's
layers) runs with no layers to bind. The runners' ``initialize_kv_cache``
itself needs a loaded model and does not run here (the CPU engine tests run it
end to end on 0.32).
"""

from __future__ import annotations

import importlib
import inspect
import os

import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

import vllm_release_drive as drive  # noqa: E402

pytestmark = pytest.mark.vllm_release

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _environment_kept():
    with drive.environment_kept():
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvcached.testing.tiny_llama import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("vllm-release-worker") / "model")


@pytest.fixture(scope="module")
def planned(model_dir):
    """The release's package, a VllmConfig and rank 0's KVCacheConfig planned by vLLM with kvcached."""
    package = drive.install()
    config = drive.vllm_config(model_dir)
    (kv_cache_config,) = drive.plan_kv_cache(config, num_blocks=64)
    return package, config, kv_cache_config


@pytest.fixture
def spaces():
    """Closes the KV spaces a test's allocations created."""
    from kvcached.integration.vllm.v0_32 import worker

    yield worker._spaces
    space = worker._spaces.pop(os.getpid(), None)
    if space is not None:
        space.close()


def _sites(package):
    return (
        getattr(package, "KV_TENSOR_SITES", None)
        or importlib.import_module("kvcached.integration.vllm.v0_32.patch_points").KV_TENSOR_SITES
    )


def _importable_allocators(package):
    modules = []
    for name in _sites(package).allocators:
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            assert name in _sites(package).optional, f"{name} must import"
    return modules


def _layout():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return KVCacheLayout[drive.LAYOUT]


def _check_views_against_vllms(views, reference, space) -> None:
    flat = space.flat_bytes()
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel()
    assert list(views) == list(reference)
    base, ref_base = min(v.data_ptr() for v in views.values()), min(v.data_ptr() for v in reference.values())
    for name, view in views.items():
        ref = reference[name]
        assert (view.shape, view.stride(), view.dtype) == (ref.shape, ref.stride(), ref.dtype), name
        assert view.data_ptr() - base == ref.data_ptr() - ref_base, name  # same place in the one buffer
        assert start <= view.data_ptr() < end and view.untyped_storage().data_ptr() == start, name


def test_every_kv_tensor_site_of_the_release_is_patched_and_builds_kvcached_views_like_vllms(planned, spaces):
    package, _, kv_cache_config = planned
    modules = _importable_allocators(package)
    assert modules
    for module in modules:
        allocate = module.allocate_kv_cache
        assert getattr(allocate, "_kvcached_patched", False), module.__name__
        reference = inspect.unwrap(allocate)(kv_cache_config, CPU, _layout(), [drive.BLOCK_SIZE])
        views = allocate(kv_cache_config, CPU, _layout(), [drive.BLOCK_SIZE])
        _check_views_against_vllms(views, reference, spaces[os.getpid()])
        spaces.pop(os.getpid()).close()


def test_writes_through_vllms_views_land_in_mapped_kvcached_pages_and_unmapped_blocks_read_zero(planned, spaces):
    package, _, kv_cache_config = planned
    module = _importable_allocators(package)[-1]
    views = module.allocate_kv_cache(kv_cache_config, CPU, _layout(), [drive.BLOCK_SIZE])
    space = spaces[os.getpid()].space
    per_page = space.blocks_per_page
    space.map_pages([1])  # blocks per_page .. 2*per_page-1, in every layer
    flat = spaces[os.getpid()].flat_bytes()
    for layer, view in enumerate(views.values()):
        block = per_page + layer
        view[block].fill_(layer + 1.5)
        offset = space.offset_of(layer, 0, block)
        cell = flat[offset : offset + view[block].numel() * view.element_size()].view(view.dtype)
        assert torch.all(cell == layer + 1.5)
        assert torch.count_nonzero(view[2 * per_page]) == 0  # an unmapped page reads zeros


@pytest.mark.parametrize(
    "attn_utils_module",
    ["vllm.v1.worker.gpu.attn_utils", "vllm.v1.worker.cpu.attn_utils"],
    ids=["model-runner-v2", "standalone-cpu-runner"],
)
def test_model_runner_v2_init_kv_cache_binds_kvcached_views(planned, spaces, attn_utils_module):
    package, config, kv_cache_config = planned
    try:
        attn_utils = importlib.import_module(attn_utils_module)
    except ModuleNotFoundError:
        pytest.skip(f"vLLM {vllm.__version__} has no {attn_utils_module}")
    caches = attn_utils.init_kv_cache({}, kv_cache_config, CPU, [drive.BLOCK_SIZE], config)
    reference = inspect.unwrap(attn_utils.allocate_kv_cache)(kv_cache_config, CPU, _layout(), [drive.BLOCK_SIZE])
    _check_views_against_vllms(caches, reference, spaces[os.getpid()])


def test_a_profiling_cache_is_vllms_own_allocation(planned, spaces):
    from kvcached.integration.vllm.v0_32 import worker

    package, _, kv_cache_config = planned
    module = _importable_allocators(package)[0]

    def initialize_kv_cache(runner, config, is_profiling=False):  # the part of a runner's method that allocates
        return module.allocate_kv_cache(config, CPU, _layout(), [drive.BLOCK_SIZE])

    profiling = worker.wrap_initialize_kv_cache(initialize_kv_cache)(None, kv_cache_config, is_profiling=True)
    assert os.getpid() not in spaces  # no kvcached space: vLLM's torch.zeros
    assert all(torch.count_nonzero(view) == 0 for view in profiling.values())
    served = worker.wrap_initialize_kv_cache(initialize_kv_cache)(None, kv_cache_config)
    assert os.getpid() in spaces and set(served) == set(profiling)


def test_vllms_own_backing_callback_is_refused_for_a_kvcached_cache_and_used_otherwise(planned, spaces):
    from kvcached.integration.vllm.v0_32.plan import PLAN_ATTR, UnsupportedVLLMConfig

    package, _, kv_cache_config = planned
    allocate = importlib.import_module("vllm.v1.worker.utils").allocate_kv_cache
    if "allocate" not in inspect.signature(inspect.unwrap(allocate)).parameters:
        pytest.skip(f"vLLM {vllm.__version__}'s allocate_kv_cache takes no backing callback")
    asked = []

    def backing(size):
        asked.append(size)
        return torch.zeros(size, dtype=torch.int8)

    with pytest.raises(UnsupportedVLLMConfig, match="extensible KV cache"):
        allocate(kv_cache_config, CPU, _layout(), [drive.BLOCK_SIZE], allocate=backing)
    assert asked == [] and os.getpid() not in spaces
    import copy

    plain = copy.deepcopy(kv_cache_config)
    delattr(plain, PLAN_ATTR)
    views = allocate(plain, CPU, _layout(), [drive.BLOCK_SIZE], allocate=backing)
    assert asked == [plain.kv_cache_tensors[0].size] and len(views) == drive.NUM_LAYERS


def test_the_release_sleeps_on_kvcacheds_backend_and_keeps_what_a_weight_update_does_not_rewrite(planned, tmp_path):
    """The factory gives kvcached's backend for vLLM's default name, and its suspend keeps every
    byte the release expects back: all at level 1; at level 2 (0.34: what is not discardable;
    earlier: nothing, the worker saves what it needs itself)."""
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    import kvcached
    from kvcached.integration.vllm.v0_32 import sleep

    package, config, _ = planned
    backend = SleepModeBackendFactory.create_backend(config.model_config)  # "cumem", vLLM's default
    assert type(backend).__name__ == "KvcachedSleepBackend"
    assert type(backend).preserves_compiled_artifacts()
    module = torch.nn.Sequential(torch.nn.Linear(8, 8))
    module.register_buffer("rope", torch.arange(16, dtype=torch.float32))
    weight = module[0].weight.detach().clone()
    os.environ["KVCACHED_REGISTRY_DIR"] = str(tmp_path)
    weights = kvcached.ModelWeights(module, device="cpu", name="release-sleep")
    sleep._held[os.getpid()] = sleep.WorkerWeights(weights, kvcached.registry.registry_for("cpu").register("unused"))
    try:
        takes_discardable = "discardable" in inspect.signature(type(backend).suspend).parameters
        backend.suspend(set() if takes_discardable else 1)
        assert weights.sleep_level == 1
        backend.resume(None)
        assert torch.equal(module[0].weight, weight) and torch.equal(module.rope, torch.arange(16.0))
        if takes_discardable:
            discardable = {module[0].weight.untyped_storage().data_ptr(), module[0].bias.untyped_storage().data_ptr()}
            backend.suspend(discardable)
            backend.resume(["weights"])
            assert torch.equal(module.rope, torch.arange(16.0)), "what is not discardable comes back"
            assert not module[0].weight.any(), "the discardable parameters are not kept"
    finally:
        sleep._held.pop(os.getpid()).close()
