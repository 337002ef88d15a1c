"""Two KV pools sharing one device budget: memory moves to whichever needs it.

Runs with kvcached alone (no engine, no torch), on host memory by default:

    python examples/two_pools_one_budget.py
    python examples/two_pools_one_budget.py --device cuda:0 --budget 256MiB

Two pools register on one device, each planning for more than the whole budget (a
large virtual KV cache), so neither has a fixed share. Pool "a" fills the budget and
"b" is refused; "a" frees its blocks and gives its pages back; then "b" gets
the same memory. Physical memory follows use, never exceeding the budget.

The budget lives in a registry of its own (a temporary KVCACHED_REGISTRY_DIR),
so the example never changes the budget engines on this machine share.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

NUM_LAYERS = 4
BLOCK_BYTES = 16 << 10  # one layer's K (or V) of one block


def mapped_by_pool(registry) -> str:
    """What each pool holds, as the device registry (kvctl, kvtop) counts it."""
    return ", ".join(f"{entry['name']} {entry['mapped_bytes'] >> 20} MiB" for entry in registry.entries())


def fill(pool, name: str) -> list[int]:
    """Allocates blocks until the shared budget says no; returns them."""
    from kvcached import OutOfMemoryError

    blocks: list[int] = []
    while True:
        try:
            blocks += [int(block) for block in pool.alloc(64)]
        except OutOfMemoryError as refused:
            print(f"  {name}: {len(blocks)} blocks, then refused: {str(refused).splitlines()[0]}")
            return blocks


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or a GPU such as cuda:0")
    parser.add_argument("--budget", default="64MiB", help="the device budget the two pools share")
    args = parser.parse_args(argv)

    os.environ["KVCACHED_REGISTRY_DIR"] = tempfile.mkdtemp(prefix="kvcached-example-")
    from kvcached import KVPool
    from kvcached.registry import parse_bytes, registry_for

    budget_bytes = parse_bytes(args.budget, "--budget")
    registry = registry_for(args.device, budget_bytes=budget_bytes)
    # Each pool's virtual KV cache is twice the budget: the shared budget, not the size
    # of either cache, is what bounds them.
    shape = {
        "num_layers": NUM_LAYERS,
        "block_bytes": BLOCK_BYTES,
        "capacity_bytes": 2 * budget_bytes,
        "device": args.device,
        "background_worker": False,
    }
    with KVPool(name="a", **shape) as a, KVPool(name="b", **shape) as b:
        print(f"budget {budget_bytes >> 20} MiB on {registry.device}; each pool plans for twice that")
        held_by_a = fill(a, "a")
        print(f"  registry: {mapped_by_pool(registry)}")
        refused_b = fill(b, "b")  # nothing: a holds the whole budget

        a.free(held_by_a)
        a.trim()  # give a's free pages back to the budget now, not at the worker's next round
        print(f"a freed its blocks: {mapped_by_pool(registry)}")

        held_by_b = fill(b, "b")
        print(f"  registry: {mapped_by_pool(registry)}")
        peak_ok = registry.mapped_bytes <= budget_bytes
    print(f"both closed: {registry.mapped_bytes} bytes mapped")
    moved = bool(held_by_a) and not refused_b and len(held_by_b) == len(held_by_a)
    return 0 if moved and peak_ok and registry.mapped_bytes == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
