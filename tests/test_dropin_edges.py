"""Edges where fusedamp did something other than torch.optim: a grad of another shape, two
params with one grad tensor, hyperparameters changed after construction to values torch
refuses, keys the optimizer never reads, and an op call mixing meta and CPU tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusedamp import FusedAdamW, FusedSGD, GradScaler, ops


@pytest.mark.parametrize("cls", [FusedAdamW, FusedSGD, torch.optim.AdamW])
def test_grad_of_another_shape_with_the_same_numel_is_refused(cls) -> None:
    param = nn.Parameter(torch.randn(4, 6))
    param.grad = torch.randn(4, 6)
    param.grad.data = torch.randn(6, 4)  # torch's .grad setter checks the shape; .data does not
    before = param.detach().clone()
    with pytest.raises(RuntimeError, match="size|shape"):
        cls([param], lr=0.1).step()
    if cls is not torch.optim.AdamW:  # torch raises halfway through its step
        assert torch.equal(param.detach(), before)


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_two_params_sharing_one_grad_tensor_step_like_torch(max_grad_norm) -> None:
    """The read-only check (here for clipping) and a step that does not write the grads take a
    grad tensor shared by two params; the reference is torch on two copies of the grad (torch's
    clip_grad_norm_ would scale a shared grad twice)."""
    results = []
    for fused in (True, False):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(5))]
        shared = torch.randn(5)
        if fused:
            for param in params:
                param.grad = shared
            opt = FusedAdamW(params, lr=0.1, max_grad_norm=max_grad_norm, write_unscaled_grads=False)
        else:
            for param in params:
                param.grad = shared.clone()
            opt = torch.optim.AdamW(params, lr=0.1)
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        results.append([p.detach().clone() for p in params])
    for ours, theirs in zip(*results, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_shared_grad_under_a_grad_scaler_is_checked_read_only() -> None:
    params = [nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(5))]
    found_inf = torch.zeros(())
    shared = torch.randn(7)
    ops.check_and_norm_([shared, shared], found_inf)
    assert found_inf.item() == 0
    with pytest.raises(RuntimeError, match="share memory"):
        ops.unscale_([shared, shared], found_inf, torch.ones(()))
    with pytest.raises(RuntimeError, match="share memory"):  # a written scalar over a read grad
        ops.check_and_norm_([shared], shared[2:3].view(()))
    scaler = GradScaler("cpu", init_scale=4.0)
    opt = FusedSGD(params, lr=0.1, write_unscaled_grads=False)
    loss = scaler.scale(sum(p.sum() for p in params))
    loss.backward()
    grad = params[0].grad
    params[1].grad = grad
    scaler.step(opt)  # the check passes; the step, writing no grad, takes the shared grad
    scaler.update()


@pytest.mark.parametrize("order", ["ascending", "descending", "runs", "shuffled"])
def test_shared_memory_is_found_in_any_order_of_many_tensors(order) -> None:
    """The aliasing check sorts the tensors' byte ranges by merging the runs the lists come in
    (or, past 64 runs, with a general sort): each order must find the one overlapping pair, and
    pass the same tensors without it."""
    count = 300
    buffer = torch.randn(4 * count + 8)
    slices = [buffer[4 * i : 4 * i + 4] for i in range(count)]
    positions = list(range(count))
    if order == "descending":
        positions.reverse()
    elif order == "runs":  # five ascending and descending runs, as params and grads lists come
        runs = [range(0, 60), range(119, 59, -1), range(120, 200), range(299, 249, -1), range(200, 250)]
        positions = [position for run in runs for position in run]
    elif order == "shuffled":
        positions = torch.randperm(count, generator=torch.Generator().manual_seed(0)).tolist()
    grads = [slices[position] for position in positions]
    found_inf = torch.zeros(())
    ops.unscale_(grads, found_inf, torch.ones(()))
    clash = 137
    overlapping = buffer[4 * clash + 2 : 4 * clash + 6]  # over slices `clash` and `clash + 1`
    at = len(grads) // 3
    named = rf"unscale_: (grads\[\d+\] and grads\[{at}\]|grads\[{at}\] and grads\[\d+\]) share memory"
    with pytest.raises(RuntimeError, match=named):
        ops.unscale_([*grads[:at], overlapping, *grads[at:]], found_inf, torch.ones(()))


@pytest.mark.parametrize(
    ("cls", "key", "value", "match"),
    [
        (FusedAdamW, "betas", (1.0, 0.999), "beta parameter at index 0"),
        (FusedAdamW, "betas", (0.9, 1.0), "beta parameter at index 1"),
        (FusedAdamW, "lr", 1e38, "overflows float32"),
        (FusedAdamW, "lr", 1e39, "float32's range"),
        (FusedSGD, "lr", 1e39, "float32's range"),
        (FusedSGD, "momentum", float("nan"), "must be finite"),
    ],
)
def test_bad_hyperparameters_set_after_construction_raise(cls, key, value, match) -> None:
    param = nn.Parameter(torch.randn(4))
    param.grad = torch.randn(4)
    opt = cls([param], lr=0.1)
    opt.param_groups[0][key] = value
    before = param.detach().clone()
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert torch.equal(param.detach(), before)


def test_non_finite_float_under_an_unread_key_is_ignored() -> None:
    param = nn.Parameter(torch.randn(4))
    param.grad = torch.randn(4)
    opt = FusedAdamW([{"params": [param], "initial_lr": float("inf"), "my_score": float("nan")}])
    opt.step()
    assert torch.isfinite(param).all()


def test_op_call_mixing_meta_and_cpu_tensors_is_refused() -> None:
    params = [torch.randn(4), torch.randn(4, device="meta")]
    grads = [torch.randn(4), torch.randn(4)]
    moments = [[torch.zeros(4), torch.zeros(4)] for _ in range(2)]
    steps = [torch.zeros(()), torch.zeros(())]
    with pytest.raises(RuntimeError, match="meta device"):
        ops.adamw_(
            params, grads, *moments, [], [], steps, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0
        )
    with pytest.raises(RuntimeError, match="meta device"):
        ops.unscale_([torch.randn(3, device="meta")], torch.zeros(()), torch.ones(()))
    # All on meta (shape propagation): still a no-op, as before.
    ops.unscale_(
        [torch.randn(3, device="meta")], torch.zeros((), device="meta"), torch.ones((), device="meta")
    )


@pytest.mark.parametrize(
    "options",
    [
        {"lr": 0.1},
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.1},
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "maximize": True},
    ],
    ids=["plain", "momentum-dampening", "nesterov-maximize"],
)
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "grad-scaler"])
def test_fused_sgd_takes_sparse_embedding_grads_like_torch(options, scaled) -> None:
    results = []
    for cls in (FusedSGD, torch.optim.SGD):
        torch.manual_seed(0)
        embedding = nn.Embedding(11, 3, sparse=True)
        opt = cls(embedding.parameters(), **options)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0, enabled=scaled)
        for step in range(3):
            indices = torch.tensor([[1, 4, 4, 9], [0, 4, 7, 7]])[step % 2]  # duplicates summed
            scaler.scale(embedding(indices).square().sum()).backward()
            assert embedding.weight.grad.is_sparse
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        results.append(embedding.weight.detach().clone())
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-7)
