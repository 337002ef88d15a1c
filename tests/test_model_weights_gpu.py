"""kvcached.ModelWeights on a real GPU: CUDA graphs survive a sleep, the memory goes back to the device."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import kvcached  # noqa: E402

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture
def gpu():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    backend = "hip" if torch.version.hip else "cuda"
    return torch.device("cuda", 0), f"{backend}:0"


def test_a_graph_captured_before_a_sleep_replays_right_after_the_wake(gpu):
    device, name = gpu
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024)).to(device)
    x = torch.randn(64, 1024, device=device)
    with kvcached.ModelWeights(model, device=name, register=False) as weights:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            out = model(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out = model(x)
        graph.replay()
        torch.cuda.synchronize()
        expected = out.clone()
        for level in (1, 2):
            saved = {k: v.clone() for k, v in model.state_dict().items()}
            weights.sleep(level)
            weights.wake_up()
            if level == 2:
                model.load_state_dict(saved)  # a reload, in place
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, expected), f"level {level}"


def test_asleep_the_weights_memory_is_free_on_the_device(gpu):
    device, name = gpu
    model = torch.nn.Linear(8192, 8192, bias=False).to(device)  # 256 MiB of fp32
    with kvcached.ModelWeights(model, device=name, register=False) as weights:
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info(device)[0]
        weights.sleep(2)
        free_asleep = torch.cuda.mem_get_info(device)[0]
        assert free_asleep - free_awake >= weights.nbytes - 2 * MiB
        weights.wake_up()
        assert torch.cuda.mem_get_info(device)[0] <= free_asleep - weights.nbytes + 2 * MiB
