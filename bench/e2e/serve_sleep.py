"""Time to first token of a model asleep behind ``kvcached serve``, against starting its engine cold.

``kvcached serve`` holds more models than fit: a model with ``sleep:`` in its config is put to
sleep (its weights and KV cache given back through kvcached) and a request for it waits while serve
wakes it. llama-swap and Ollama do the same job by stopping one engine process and starting
another. This times both, in one run, on N tiny random-weight Llamas (each its own seed, so each
answers other text) in vLLM's CPU build, on a budget that holds two awake (weights + ``min`` each;
the weights measured from a first cold engine's registry entry, ``min`` chosen so two fit and three
do not). For each sleep level (1: weights to host memory; 2: discarded, read from disk on wake) a
serve runs, and each round, for the next model in turn:

* *asleep*: the other models are asked first (so this one is put to sleep), then a streamed
  completion to it through serve: time to its first token (serve wakes it, putting another to sleep);
* *awake*: the same request again, now that it is awake (the floor);
* *cold*: a fresh ``python -m vllm.entrypoints.openai.api_server`` with the command and environment
  serve gives that model's engine (on a registry of its own, so it takes nothing from serve's
  budget), timed from its start to its first token, as a process swapper would start it. The stop
  of the engine it would replace is not counted.

Rounds alternate the order (even: asleep, awake, cold; odd: cold, asleep, awake); every round is
printed, then medians and ratios; the answers are compared (asleep, awake and cold must be the same
text). With ``--plot``, a round robin over the models (a few requests each, in turn) on the first
level's serve, sampling each model's weights and KV memory and the budget from the registry every
30 ms, drawn as stacked areas (``serve_sleep_report.write_plot``).

    python bench/e2e/serve_sleep.py --rounds 3 --json /tmp/serve-sleep.json --plot /tmp/serve-sleep.png

Needs vLLM in this Python, kvcached's serve extra, the ``openai`` client and matplotlib (``--plot``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from e2e_common import in_workdir
from serve_sleep_cold import MAX_TOKENS, PROMPT, cold_start, first_token, openai_client
from serve_sleep_report import MiB, format_table, summarize, write_plot

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve-cpu.yaml"
PAGE_BYTES = 2 * MiB  # kvcached's page on the host backend: what weights and KV are charged in
MIN_FLOOR_BYTES = 8 * MiB  # each model's guaranteed KV memory, at least: a few pages per layer
PLOT_LOAD = dict(sequences=4, prompt_tokens=300, max_tokens=32)  # one request of the picture's round robin
SAMPLE_S = 0.03
_WOKEN = re.compile(r"kvcached serve: (\S+): awake after ([0-9.]+) s")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=_at_least(3), default=3, help="models served (default 3; two fit awake)")
    parser.add_argument("--rounds", type=_at_least(1), default=3, help="timed rounds per level (default 3)")
    parser.add_argument("--levels", type=_levels, default=(1, 2), help="sleep levels, one serve each (default 1,2)")
    parser.add_argument("--plot", metavar="PATH", help="draw the round robin's memory to this PNG")
    parser.add_argument("--plot-turns", type=_at_least(1), default=2, help="round robin passes (default 2)")
    parser.add_argument("--plot-requests", type=_at_least(1), default=3, help="requests per model per turn (default 3)")
    parser.add_argument("--json", metavar="PATH", help="write every round, the samples and the summary here")
    parser.add_argument("--workdir", help="keep the models, configs and logs here (default: a temporary folder)")
    return parser.parse_args(argv)


def _at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"needs at least {low}, got {value}")
        return value

    return parse


def _levels(text: str) -> tuple[int, ...]:
    levels = tuple(int(word) for word in text.split(",") if word.strip())
    if not levels or any(level not in (1, 2) for level in levels) or len(set(levels)) != len(levels):
        raise argparse.ArgumentTypeError(f"expected sleep levels 1 and/or 2, comma-separated, got {text!r}")
    return levels


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def awake_sizes(weights_bytes: int) -> tuple[int, int]:
    """Each model's ``min`` and the budget, for models whose weights hold ``weights_bytes``: two
    models awake (weights + min each) fit, with half a model to spare; three do not."""
    if weights_bytes <= 0:
        raise ValueError(f"weights_bytes must be positive, got {weights_bytes}")
    min_bytes = max(MIN_FLOOR_BYTES, _round_up(2 * weights_bytes, PAGE_BYTES))
    awake = weights_bytes + min_bytes
    budget = _round_up(2 * awake + awake // 2, PAGE_BYTES)
    if not 2 * awake <= budget < 3 * awake:
        raise ValueError(f"no budget holds two models of {awake} bytes awake and not three")
    return min_bytes, budget


def model_names(count: int) -> list[str]:
    return [f"tiny-{k}" for k in range(count)]


def serve_sleep_config(
    model_dirs: dict[str, str], level: int, min_bytes: int, budget_bytes: int, port: int
) -> dict[str, Any]:
    """A serve config of vLLM models that may sleep at ``level`` (only when another needs the room:
    no ``idle_s``), each with the example's tiny-model arguments and environment."""
    import yaml

    example = yaml.safe_load(EXAMPLE.read_text())
    template = next(model for model in example["models"] if model["engine"] == "vllm")
    return {
        "listen": f"127.0.0.1:{port}",
        "device": "cpu",
        "budget": str(budget_bytes),
        "models": [
            {
                "name": name,
                "engine": "vllm",
                "model": path,
                "args": list(template["args"]),
                "env": dict(template["env"]),
                "memory": {"min": str(min_bytes)},
                "sleep": {"level": level},
            }
            for name, path in model_dirs.items()
        ],
    }


class RegistryReader:
    """Each model's weights and KV memory (its live entries summed) and the budget, from one registry."""

    def __init__(self, registry_dir: Path, models: Sequence[str]) -> None:
        from kvcached.registry import open_existing
        from kvcached.testing.registry_env import using_registry_dir

        with using_registry_dir(registry_dir):
            self._registry = open_existing("cpu")
        if self._registry is None:
            raise RuntimeError(f"no cpu registry in {registry_dir}")
        self._models = list(models)

    def read(self) -> tuple[int, dict[str, tuple[int, int]]]:
        by_model = {model: (0, 0) for model in self._models}
        for entry in self._registry.entries():
            if entry["alive"] and entry["name"] in by_model:
                weights, kv = by_model[entry["name"]]
                by_model[entry["name"]] = (weights + entry["weights_bytes"], kv + entry["mapped_bytes"])
        return int(self._registry.budget_bytes), by_model


class SleepBench:
    """One serve of the tiny models at one sleep level, and the steps of a round on it."""

    def __init__(self, serve: Any, config: Any, workdir: Path) -> None:
        self.serve, self.config, self.workdir = serve, config, workdir
        self.models = [spec.name for spec in config.models]
        self.client = openai_client(serve.url)

    def ask(self, model: str) -> None:
        self.client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)

    def states(self) -> dict[str, str]:
        return self.serve.health()[1].get("models", {})

    def wake_seconds(self, model: str) -> list[float]:
        return [float(s) for name, s in _WOKEN.findall(self.serve.log()) if name == model]

    def asleep_and_awake(self, model: str) -> dict[str, Any]:
        for other in self.models:  # asked after it, the others are awake and it is the one asleep
            if other != model:
                self.ask(other)
        before = self.states()
        if before.get(model) != "asleep":
            raise RuntimeError(f"{model} should be asleep after the others were asked; serve says {before}")
        wakes = len(self.wake_seconds(model))
        asleep_s, asleep_text = first_token(self.client, model, time.monotonic())
        woken = self.wake_seconds(model)[wakes:]
        awake_s, awake_text = first_token(self.client, model, time.monotonic())
        return {
            "asleep_ms": asleep_s * 1000,
            "awake_ms": awake_s * 1000,
            "asleep_text": asleep_text,
            "awake_text": awake_text,
            "wake_ms": woken[0] * 1000 if woken else None,
            "states_before": before,
            "states_after": self.states(),
        }

    def round(self, k: int) -> dict[str, Any]:
        model = self.models[k % len(self.models)]
        spec = self.config.model(model)
        record: dict[str, Any] = {"round": k, "model": model, "load_average": os.getloadavg()[0]}
        if k % 2 == 0:
            record["order"] = "asleep, awake, cold"
            record.update(self.asleep_and_awake(model))
            record.update(cold_start(spec, self.workdir, f"{model}-{k}"))
        else:
            record["order"] = "cold, asleep, awake"
            record.update(cold_start(spec, self.workdir, f"{model}-{k}"))
            record.update(self.asleep_and_awake(model))
        record["same_text"] = record["asleep_text"] == record["awake_text"] == record["cold_text"]
        return record

    def round_robin(self, turns: int, requests: int) -> dict[str, Any]:
        """Every model, a few requests each, in turn, while the registry is sampled."""
        from kvcached.testing.serve_session import Sampler
        from kvcached.testing.tiny_llama import prompt_ids

        reader = RegistryReader(self.serve.registry_dir, self.models)
        spans: list[tuple[str, float, float]] = []
        with Sampler(reader.read, SAMPLE_S) as sampler:
            time.sleep(0.5)
            for _ in range(turns):
                for model in self.models:
                    for n in range(requests):
                        begin = time.monotonic()
                        self.client.completions.create(
                            model=model,
                            prompt=prompt_ids(PLOT_LOAD["sequences"], PLOT_LOAD["prompt_tokens"], seed=100 + n),
                            max_tokens=PLOT_LOAD["max_tokens"],
                            temperature=0,
                            extra_body={"ignore_eos": True},
                        )
                        spans.append((model, begin, time.monotonic()))
            time.sleep(1.0)
        samples = [(at, budget, by_model) for at, (budget, by_model) in sampler.samples]
        return {"samples": samples, "requests": spans}


def serve_level(
    args: argparse.Namespace, workdir: Path, model_dirs: dict[str, str], level: int, sizes: tuple[int, int], plot: bool
) -> dict[str, Any]:
    from kvcached.serve.config import parse_config
    from kvcached.serve.ports import free_port
    from kvcached.testing.serve_session import ServeProcess

    where = workdir / f"level-{level}"
    (where / "registry").mkdir(parents=True, exist_ok=True)
    config = serve_sleep_config(model_dirs, level, *sizes, free_port())
    serve = ServeProcess(where, config, where / "registry")
    started = time.monotonic()
    serve.start()
    result: dict[str, Any] = {"rounds": []}
    try:
        serve.wait_healthy()
        result["serve_start_s"] = time.monotonic() - started
        bench = SleepBench(serve, parse_config(config, where), where)
        for k in range(args.rounds):
            result["rounds"].append(bench.round(k))
            r = result["rounds"][-1]
            print(
                f"level {level} round {k} ({r['model']}, {r['order']}, load {r['load_average']:.1f}): "
                f"asleep {r['asleep_ms']:.0f} ms, awake {r['awake_ms']:.0f} ms, cold {r['cold_ms']:.0f} ms "
                f"(up after {r['cold_ready_ms']:.0f} ms), same text: {r['same_text']}",
                flush=True,
            )
        if plot:
            result["round_robin"] = bench.round_robin(args.plot_turns, args.plot_requests)
    finally:
        code = serve.stop()
        if code != 0:
            print(f"kvcached serve exited with {code}; its log: {serve.log_path}", file=sys.stderr)
    result["summary"] = summarize(result["rounds"])
    return result


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from kvcached.serve.config import parse_config
    from kvcached.testing.tiny_llama import make_tiny_llama
    from kvcached.testing.tiny_tokenizer import write_tiny_tokenizer

    names = model_names(args.models)
    model_dirs = {
        name: str(write_tiny_tokenizer(make_tiny_llama(workdir / name, seed=k))) for k, name in enumerate(names)
    }
    # One cold start before anything is timed: reads what the weights take in the registry and
    # warms the page cache and Python's imports, as the timed cold starts will find them. Only its
    # engine's command is used: the budget and serve's port (8000) in this config never serve.
    probe = parse_config(serve_sleep_config(model_dirs, 1, MIN_FLOOR_BYTES, 1 << 30, 8000), workdir).models[0]
    warm_up = cold_start(probe, workdir, "warm-up")
    sizes = awake_sizes(warm_up["cold_weights_bytes"])
    print(
        f"weights {warm_up['cold_weights_bytes'] / MiB:.0f} MiB per model, min {sizes[0] / MiB:.0f} MiB, "
        f"budget {sizes[1] / MiB:.0f} MiB (two models awake fit, three do not); warm-up cold start "
        f"{warm_up['cold_ms']:.0f} ms",
        flush=True,
    )
    levels = {
        level: serve_level(args, workdir, model_dirs, level, sizes, plot=bool(args.plot) and n == 0)
        for n, level in enumerate(args.levels)
    }
    return {
        "models": names,
        "weights_bytes": warm_up["cold_weights_bytes"],
        "min_bytes": sizes[0],
        "budget_bytes": sizes[1],
        "request": {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0},
        "warm_up": warm_up,
        "levels": levels,
    }


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    result = in_workdir(args.workdir, "kvcached-serve-sleep-", lambda workdir: run(args, workdir))
    print(format_table(result["levels"]))
    if args.plot:
        level = args.levels[0]
        picture = result["levels"][level]["round_robin"]
        title = (
            f"kvcached serve: {len(result['models'])} tiny vLLM models at sleep level {level} on a "
            f"{result['budget_bytes'] / MiB:.0f} MiB budget, {args.plot_requests} requests each in turn"
        )
        write_plot(args.plot, picture["samples"], result["models"], picture["requests"], title)
        print(f"picture: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
