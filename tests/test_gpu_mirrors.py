"""On a real GPU: a BlockManager deciding in one process, a KV space on the GPU
in another applying its page ops — with kernels still running when pages are
unmapped, which the KV space must fence (synchronise) before unmapping."""

from __future__ import annotations

import multiprocessing as mp

import pytest

import kvcached
from kvcached import _core

pytestmark = pytest.mark.gpu

NUM_LAYERS = 4
BLOCK_BYTES = 256 << 10
NUM_BLOCKS = 512
LAYOUT = kvcached.KVLayout(
    NUM_LAYERS, BLOCK_BYTES, NUM_BLOCKS, page_bytes=2 << 20, kind="contiguous"
)  # one value on both sides


def gpu_mirror_main(conn, device: str) -> None:
    import torch

    space = kvcached.KVSpace(LAYOUT, device, kvcached.KVSpaceOptions(zero_backing=True))
    flat = torch.from_dlpack(space.tensor())
    busy = torch.randn(4096, 4096, device=flat.device)

    def block_view(layer: int, buffer: int, block: int):
        start = space.offset_of(layer, buffer, block)
        return flat[start : start + BLOCK_BYTES]

    while True:
        command, *args = conn.recv()
        if command == "apply":
            conn.send(space.apply(args[0]))
        elif command == "write_then_apply":
            # Queue writes behind a long matmul chain, then unmap at once: the
            # KV space must wait for the kernels before it unmaps.
            blocks, value, ops = args
            for _ in range(20):
                busy = busy @ busy
                busy /= busy.norm()
            for block in blocks:
                for layer in range(NUM_LAYERS):
                    for buffer in range(2):
                        block_view(layer, buffer, block).fill_(value)
            seq = space.apply(ops)
            torch.cuda.synchronize()  # raises if a kernel touched unmapped memory
            conn.send(seq)
        elif command == "write":
            blocks, value = args
            for block in blocks:
                for layer in range(NUM_LAYERS):
                    for buffer in range(2):
                        block_view(layer, buffer, block).fill_(value)
            torch.cuda.synchronize()
            conn.send(None)
        elif command == "read":
            values = []
            for block in args[0]:
                view = torch.stack([block_view(layer, b, block) for layer in range(NUM_LAYERS) for b in range(2)])
                values.append(sorted(set(view.unique().tolist())))
            conn.send(values)
        elif command == "close":
            import gc

            device = space.device
            del flat, block_view
            space.close()
            pages_left = space.mapped_pages
            del space  # the zero backing lives as long as the space or a tensor into it
            gc.collect()
            conn.send((pages_left, device.counters()["mapped_bytes"], device.counters()["reserved_bytes"]))
            return


@pytest.fixture
def gpu_mirror():
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=gpu_mirror_main, args=(child, kvcached.default_device()), daemon=True)
    process.start()

    def call(*message):
        conn.send(message)
        assert conn.poll(120), f"GPU mirror did not answer {message[0]!r}"
        return conn.recv()

    yield call
    process.join(timeout=60)


def test_gpu_mirror_maps_fences_and_releases_after_acknowledgement(gpu_mirror):
    budget = _core.FixedBudget(1 << 34)
    manager = kvcached.BlockManager(LAYOUT, kvcached.BlockManagerOptions(), budget=budget)
    blocks = manager.alloc(40).tolist()
    seq = gpu_mirror("apply", manager.take_page_ops())
    manager.acknowledge(0, seq)
    gpu_mirror("write", blocks, 7)
    assert gpu_mirror("read", blocks) == [[7]] * len(blocks)

    held = budget.used_bytes
    assert held > 0
    manager.free(blocks[8:])
    manager.trim()  # the idle owner flushes its free pages
    ops = manager.take_page_ops()
    assert ops.unmap_pages
    assert budget.used_bytes == held, "memory counts as released only once the mirror acknowledged"
    # The last step's kernels are still writing the freed blocks when the unmap arrives.
    seq = gpu_mirror("write_then_apply", blocks[8:], 9, ops)
    manager.acknowledge(0, seq)
    assert budget.used_bytes < held
    assert gpu_mirror("read", blocks[:8]) == [[7]] * 8
    # Unmapped blocks read zeros (zero backing), never fault.
    assert gpu_mirror("read", blocks[8:12]) == [[0]] * 4

    manager.free(blocks[:8])
    manager.trim()
    manager.acknowledge(0, gpu_mirror("apply", manager.take_page_ops()))
    assert budget.used_bytes == 0
    assert gpu_mirror("close") == (0, 0, 0)
    manager.close()
