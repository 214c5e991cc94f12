"""CUDA graphs: a whole AMP training step (forward under fusedamp.autocast, backward,
GradScaler.step with FusedAdamW/FusedSGD, update) captured once with torch.cuda.graph and
replayed matches the same steps run eagerly; grad_stats replays on new values; a CPU lr tensor,
which a graph would freeze, is refused under capture.

The step is capturable because nothing in it reads a device value on the host: the loss scale,
found_inf, the clip coefficient, the step counts and a tensor lr all stay on the device.
"""

from __future__ import annotations

import pytest
import torch
from helpers import MixedPrecisionNet
from torch import nn

import fusedamp

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and fusedamp.build_info()["cuda_compiled"]),
    reason="needs a CUDA GPU and fusedamp's CUDA kernels",
)

STEPS = 8
# Input batches holding an inf: the step is skipped inside the graph and the scale backs off.
OVERFLOW_STEPS = (3, 6)
WARMUP = 3


def make(optimizer: str) -> tuple[nn.Module, torch.optim.Optimizer, fusedamp.GradScaler, torch.Tensor]:
    model = MixedPrecisionNet((16, 32, 4)).cuda()  # an fp32 and a bf16 layer
    lr = torch.tensor(1e-2, device="cuda")  # on the device: changed between replays
    opt: torch.optim.Optimizer
    if optimizer == "adamw":
        opt = fusedamp.FusedAdamW(model.parameters(), lr=lr, max_grad_norm=1.0)
    else:
        opt = fusedamp.FusedSGD(model.parameters(), lr=lr, momentum=0.9, max_grad_norm=1.0)
    scaler = fusedamp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
    return model, opt, scaler, lr


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(32, 16, generator=generator)
    target = torch.randn(32, 4, generator=generator)
    if step in OVERFLOW_STEPS:
        inputs[5, 2] = float("inf")
    return inputs.cuda(), target.cuda()


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: fusedamp.GradScaler,
    inputs: torch.Tensor,
    target: torch.Tensor,
) -> torch.Tensor:
    opt.zero_grad(set_to_none=False)
    # No cast cache: a graph must not keep casts from the capture.
    with fusedamp.autocast("cuda", dtype=torch.float16, cache_enabled=False):
        loss = nn.functional.mse_loss(model(inputs), target)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return scaler.step_skipped


def learning_rate(step: int) -> float:
    return 1e-2 * 0.8**step


def run(optimizer: str, graphed: bool) -> tuple[list[torch.Tensor], list[float], list[bool]]:
    model, opt, scaler, lr = make(optimizer)
    # The same warm-up steps in both runs (a graph is captured after its allocations settle).
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for step in range(WARMUP):
            train_step(model, opt, scaler, *data(100 + step))
    torch.cuda.current_stream().wait_stream(stream)

    static_inputs, static_target = data(0)
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_skipped = train_step(model, opt, scaler, static_inputs, static_target)
    scales, skipped = [], []
    for step in range(STEPS):
        lr.fill_(learning_rate(step))
        inputs, target = data(step)
        static_inputs.copy_(inputs)
        static_target.copy_(target)
        if graphed:
            graph.replay()
            step_skipped = static_skipped
        else:
            step_skipped = train_step(model, opt, scaler, static_inputs, static_target)
        skipped.append(bool(step_skipped))
        scales.append(scaler._scale.item())
    torch.cuda.synchronize()
    return [param.detach().clone() for param in model.parameters()], scales, skipped


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_graphed_training_step_matches_eager(optimizer: str) -> None:
    """8 replays of one captured step (a tensor lr changed before each, overflows at steps 3
    and 6) against 8 eager steps: the same skips, scales and weights."""
    eager_params, eager_scales, eager_skipped = run(optimizer, graphed=False)
    graph_params, graph_scales, graph_skipped = run(optimizer, graphed=True)
    assert graph_skipped == eager_skipped == [step in OVERFLOW_STEPS for step in range(STEPS)]
    assert graph_scales == eager_scales
    assert len(set(graph_scales)) > 1  # the scale moved inside the graph
    for graphed, eager in zip(graph_params, eager_params, strict=True):
        torch.testing.assert_close(graphed, eager, rtol=1e-6, atol=1e-6)
    initial, _, _, _ = make(optimizer)
    for graphed, start in zip(graph_params, initial.parameters(), strict=True):
        assert not torch.equal(graphed, start)  # the replays did train


def capture(call) -> torch.cuda.CUDAGraph:
    """A graph of `call` captured after one eager warm-up run on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


CPU_LR_UNDER_CAPTURE = r"lr is a CPU tensor.*captured into a CUDA graph.*Put lr on the device"


def test_ops_refuse_a_cpu_lr_tensor_under_capture() -> None:
    """A CPU lr tensor is read when the step is issued: a graph would replay the captured value
    forever. Eagerly it is fine; under capture it is an error."""
    p, g, m, v, b = (torch.full((1000,), 0.5, device="cuda") for _ in range(5))
    step = torch.zeros((), device="cuda")
    lr = torch.tensor(1e-2)
    calls = {
        "adamw_": lambda: fusedamp.ops.adamw_(
            [p],
            [g],
            [m],
            [v],
            [],
            [],
            [step],
            lr=lr,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
        ),
        "sgd_": lambda: fusedamp.ops.sgd_([p], [g], [b], [], [step], lr=lr, momentum=0.9),
    }
    for call in calls.values():
        call()
        with pytest.raises(RuntimeError, match=CPU_LR_UNDER_CAPTURE):
            capture(call)
    # With lr on the device (the calls read `lr` when they run) the same steps capture.
    lr = lr.cuda()
    for call in calls.values():
        capture(call)


@pytest.mark.parametrize("optimizer", [fusedamp.FusedAdamW, fusedamp.FusedSGD])
def test_fused_optimizers_refuse_a_cpu_lr_tensor_under_capture(optimizer: type) -> None:
    param = nn.Parameter(torch.randn(64, device="cuda"))
    param.grad = torch.randn(64, device="cuda")
    opt = optimizer([param], lr=torch.tensor(1e-2))
    with pytest.raises(RuntimeError, match=CPU_LR_UNDER_CAPTURE):
        capture(opt.step)


def test_grad_stats_is_captured_and_replays_on_new_values() -> None:
    """grad_stats passes its metadata as kernel parameters: a replay reads the grads it was
    captured with, whatever pinned host memory was allocated and overwritten in between."""
    shapes = [(70000, torch.float16), (5, torch.float32), (0, torch.bfloat16), (300, torch.bfloat16)]
    grads = [torch.zeros(n, device="cuda", dtype=dtype) for n, dtype in shapes]
    inv_scale = torch.ones((), device="cuda")
    outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
    graph = capture(lambda: outputs.append(torch.ops.fusedamp.grad_stats(grads, inv_scale)))
    counts, max_abs = outputs[-1]
    # Freed pinned blocks are handed out again: take them and fill them with junk before replays.
    pinned = [torch.empty(1 << e, dtype=torch.uint8).pin_memory() for e in range(4, 17)]
    for seed in range(3):
        for block in pinned:
            block.fill_(255)
        generator = torch.Generator().manual_seed(seed)
        values = [
            (torch.randn(n, generator=generator) * 10.0 ** -(seed + 3)).to(dtype) for n, dtype in shapes
        ]
        values[0][7 * seed] = float("inf")
        for grad, value in zip(grads, values, strict=True):
            grad.copy_(value)
        inv_scale.fill_(2.0**-seed)
        graph.replay()
        expected_counts, expected_max_abs = torch.ops.fusedamp.grad_stats(values, torch.tensor(2.0**-seed))
        assert torch.equal(counts.cpu(), expected_counts)
        assert torch.equal(max_abs.cpu(), expected_max_abs)
