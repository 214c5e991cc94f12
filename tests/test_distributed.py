"""fusedamp.GradScaler with FusedAdamW/FusedSGD under DistributedDataParallel and FSDP2
(``fully_shard``): two CPU processes (gloo, 127.0.0.1) train as one process does on the global
batch, and an overflow on one rank skips the step on every rank.

Both ranks run every scenario in one spawn (starting processes is the slow part).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import MixedPrecisionNet, amp_train
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

import fusedamp

WORLD_SIZE = 2
STEPS = 6
GLOBAL_BATCH = 16
# At this step one sample of rank 1's half of the batch is inf: the loss and grads overflow.
OVERFLOW_STEP = 3
OVERFLOW_ROW = GLOBAL_BATCH // WORLD_SIZE + 1
TIMEOUT_S = 120
OPTIMIZERS = ("adamw", "sgd", "muon")
# An fp32 layer and a bf16 one (fp32 master in the optimizer).
FEATURES = (6, 16, 3)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_optimizer(model: nn.Module, optimizer: str) -> torch.optim.Optimizer:
    if optimizer == "adamw":
        return fusedamp.FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if optimizer == "muon":  # the fp32 layer's weight in a Muon group, the rest in an AdamW group
        return fusedamp.FusedMuon(fusedamp.optim.muon_param_groups(model, adamw={"lr": 1e-2}), lr=0.02)
    return fusedamp.FusedSGD(model.parameters(), lr=5e-2, momentum=0.9)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    inputs = torch.randn(GLOBAL_BATCH, 6, generator=generator)
    target = torch.randn(GLOBAL_BATCH, 3, generator=generator)
    if step == OVERFLOW_STEP:
        inputs[OVERFLOW_ROW] = float("inf")
    return inputs, target


def train(
    model: nn.Module, opt: torch.optim.Optimizer, rows: slice, sharded_overflow: bool = False
) -> dict[str, Any]:
    """STEPS steps on ``rows`` of each global batch; returns what the test compares.

    ``sharded_overflow``: at OVERFLOW_STEP the inputs stay finite and an inf is written into
    the first layer's weight grad after backward instead, into rows 8-15, which FSDP2 gives to
    rank 1 only; elsewhere the inputs are finite at every step.
    """
    scaler = fusedamp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    first_weight = model.module.fp32.weight if hasattr(model, "module") else model.fp32.weight

    def rows_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, target = batch(step)
        if sharded_overflow:
            inputs = inputs.nan_to_num(posinf=0.0)
        return inputs[rows], target[rows]

    def overflow(step: int) -> None:
        if not (sharded_overflow and step == OVERFLOW_STEP):
            return
        grad = first_weight.grad
        if isinstance(grad, DTensor):
            if dist.get_rank() == 1:
                grad.to_local()[0, 0] = float("inf")
        else:
            grad[8, 0] = float("inf")

    log = amp_train(model, opt, scaler, range(STEPS), rows_of, corrupt=overflow)
    return {
        "params": [param.detach().clone() for param in model.parameters()],
        "skipped": log.skipped,
        "scales": log.scales,
        "unchanged_by_skip": not log.changed[OVERFLOW_STEP],
    }


def make_fsdp2_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # Clipping needs the global norm: the ranks' sums of squares are all-reduced.
    return fusedamp.FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)


def train_fsdp2(rows: slice) -> dict[str, Any]:
    """FSDP2 on this rank: each layer sharded (the fp32 one and the bf16 one, whose optimizer
    state holds the fp32 master of the local shard), FusedAdamW updating the local shards."""
    model = sharded_net()
    assert isinstance(model.fp32.weight, DTensor)
    opt = make_fsdp2_optimizer(model)
    result = train(model, opt, rows, sharded_overflow=True)
    # The full params, gathered, for comparison with the unsharded run.
    result["params"] = [param.detach().full_tensor() for param in model.parameters()]
    result["resumed_step_equal"] = resume_sharded(model, opt, rows)
    return result


def sharded_net() -> MixedPrecisionNet:
    model = MixedPrecisionNet(FEATURES)
    for layer in model.layers():
        fully_shard(layer)
    fully_shard(model)
    return model


def resume_sharded(model: MixedPrecisionNet, opt: torch.optim.Optimizer, rows: slice) -> bool:
    """Each rank's optimizer state_dict (steps as plain tensors; moments and masters as DTensors
    of this rank's shards) through torch.save / torch.load(weights_only=True) into a fresh
    sharded model and optimizer; whether one more step of both gives bitwise the same local shards."""
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    resumed = sharded_net()
    resumed.load_state_dict(model.state_dict())
    resumed_opt = make_fsdp2_optimizer(resumed)
    resumed_opt.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    inputs, target = batch(STEPS)
    for net, optimizer in ((model, opt), (resumed, resumed_opt)):
        optimizer.zero_grad()
        nn.functional.mse_loss(net(inputs[rows]), target[rows]).backward()
        optimizer.step()
    return all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(model.parameters(), resumed.parameters(), strict=True)
    ) and all(
        torch.equal(a, b)
        for param, resumed_param in zip(model.parameters(), resumed.parameters(), strict=True)
        for a, b in zip(opt.state[param].values(), resumed_opt.state[resumed_param].values(), strict=True)
    )


def full_norm(params: list[nn.Parameter]) -> float:
    """The global L2 norm of the params' full grads, each element once."""
    return sum(p.grad.full_tensor().double().square().sum().item() for p in params) ** 0.5


def clip_norms_hsdp() -> dict[str, float]:
    """HSDP: fully_shard on a (2 replicas, 1 shard) mesh, so that each rank holds whole grads
    as Shard(0) on the size-1 dim and Replicate() on the other: the fused clipping norm (and
    what clipping did) against the norm of the full grads."""
    torch.manual_seed(5)
    model = MixedPrecisionNet(FEATURES)
    mesh = init_device_mesh("cpu", (WORLD_SIZE, 1), mesh_dim_names=("replicate", "shard"))
    for layer in model.layers():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = fusedamp.FusedAdamW(model.parameters(), lr=1e-2, max_grad_norm=1e-3)
    inputs, target = batch(0)
    rows = slice(dist.get_rank() * 8, dist.get_rank() * 8 + 8)
    nn.functional.mse_loss(model(inputs[rows]), target[rows]).backward()
    expected = full_norm(list(model.parameters()))
    opt.step()
    clipped = full_norm(list(model.parameters()))  # the grads the step wrote back, clipped
    return {"expected": expected, "measured": opt.last_grad_norm.item(), "clipped": clipped}


def clip_norms_replicate() -> dict[str, Any]:
    """Tensor-parallel-style DTensors on a 1-D mesh of both ranks: a Replicate() param next to
    a Shard(0) one, both with grads, stepped under fusedamp.GradScaler; then an inf in rank
    1's Replicate() grad alone, which must skip the step on both ranks."""
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    generator = torch.Generator().manual_seed(9)
    full = [torch.randn(5, 7, generator=generator), torch.randn(6, 3, generator=generator)]
    grads = [torch.randn(5, 7, generator=generator), torch.randn(6, 3, generator=generator)]
    placements = [[Replicate()], [Shard(0)]]
    params = [nn.Parameter(distribute_tensor(t, mesh, p)) for t, p in zip(full, placements, strict=True)]
    for param, grad, placement in zip(params, grads, placements, strict=True):
        param.grad = distribute_tensor(grad, mesh, placement)
    opt = fusedamp.FusedAdamW(params, lr=1e-2, max_grad_norm=float("inf"))
    scaler = fusedamp.GradScaler("cpu", init_scale=1.0)
    expected = full_norm(params)
    scaler.scale(torch.ones(()))  # makes the scale (grads set by hand: a scale of 1)
    scaler.step(opt)
    scaler.update()
    measured = opt.last_grad_norm.item()
    before = [p.to_local().clone() for p in params]
    for param, grad, placement in zip(params, grads, placements, strict=True):
        param.grad = distribute_tensor(grad, mesh, placement)
    if dist.get_rank() == 1:
        params[0].grad.to_local()[2, 3] = float("inf")
    scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(a, p.to_local()) for a, p in zip(before, params, strict=True))
    return {
        "expected": expected,
        "measured": measured,
        "skip_unchanged": unchanged,
        "scale": scaler.get_scale(),
    }


def ddp_worker(rank: int, port: int, out_dir: str) -> None:
    """One DDP rank: trains with each optimizer on its half of every global batch, saves the
    results."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
        )
        try:
            per_rank = GLOBAL_BATCH // WORLD_SIZE
            result = {}
            for optimizer in OPTIMIZERS:
                model = DistributedDataParallel(MixedPrecisionNet(FEATURES))
                opt = make_optimizer(model, optimizer)
                result[optimizer] = train(model, opt, slice(rank * per_rank, (rank + 1) * per_rank))
            result["fsdp2"] = train_fsdp2(rows=slice(rank * per_rank, (rank + 1) * per_rank))
            result["hsdp"] = clip_norms_hsdp()
            result["replicate"] = clip_norms_replicate()
            torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
            # Rank 0 hosts the store: it must not leave while rank 1 still talks to it.
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def spawn_ranks(
    target: Any, args: tuple[Any, ...], out_dir: Path, world_size: int = WORLD_SIZE,
    timeout: float = TIMEOUT_S,
) -> list[int | None]:
    """Runs ``target(rank, port, *args, out_dir)`` in ``world_size`` spawned processes, each given
    ``timeout`` seconds; their exit codes."""
    context = multiprocessing.get_context("spawn")
    port = free_port()
    processes = [
        context.Process(target=target, args=(rank, port, *args, str(out_dir)), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    return [process.exitcode for process in processes]


GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def run_ranks(
    target: Any, args: tuple[Any, ...], out_dir: Path, world_size: int = WORLD_SIZE,
    timeout: float = TIMEOUT_S,
) -> list[dict[str, Any]]:
    """Each rank's saved results. A Python error in any rank fails at once with its traceback.

    A rank that dies without one (rarely, gloo aborts a process at teardown with "terminate
    called without an active exception", or the free port was taken in between) is retried
    once in a fresh directory, on a fresh port.
    """
    for attempt in range(2):
        attempt_dir = out_dir / f"attempt{attempt}"
        attempt_dir.mkdir()
        exit_codes = spawn_ranks(target, args, attempt_dir, world_size, timeout)
        errors = sorted(attempt_dir.glob("*.error"))
        assert not errors, "\n".join(path.read_text() for path in errors)
        if all(code == 0 for code in exit_codes):
            break
    assert all(code == 0 for code in exit_codes), f"the ranks exited with {exit_codes}"
    return [torch.load(attempt_dir / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)]


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's results, both optimizers trained in one spawn of the two ranks."""
    return run_ranks(ddp_worker, (), tmp_path_factory.mktemp("ddp"))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_ddp_matches_one_process_and_skips_overflow_on_every_rank(
    optimizer: str, ddp_results: list[dict[str, Any]]
) -> None:
    """Two gloo ranks, each on half of the global batch, under DDP, bf16 autocast and
    fusedamp.GradScaler: the same weights as one process on the whole batch (up to the order of
    the gradient sums), identical on both ranks; the inf in rank 1's inputs reaches rank 0
    through DDP's gradient all-reduce, so both ranks skip that step and back the scale off."""
    ranks = [result[optimizer] for result in ddp_results]
    model = MixedPrecisionNet(FEATURES)
    single = train(model, make_optimizer(model, optimizer), slice(0, GLOBAL_BATCH))

    expected_skips = [step == OVERFLOW_STEP for step in range(STEPS)]
    assert single["skipped"] == expected_skips
    for result in ranks:
        assert result["skipped"] == expected_skips
        assert result["unchanged_by_skip"] is True
        assert result["scales"] == single["scales"] == [256.0, 512.0, 512.0, 256.0, 256.0, 512.0]
    for param0, param1 in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(param0, param1)
    initial = list(MixedPrecisionNet(FEATURES).parameters())
    for got, want, start in zip(ranks[0]["params"], single["params"], initial, strict=True):
        # Under autocast the weight grads are bf16 sums over 8 rows averaged across ranks
        # against sums over 16 rows: they differ by bf16 roundings (2^-8 relative), which the
        # optimizer carries into the weights, ~lr * 2^-8 per step. Training moved them ~10x more.
        assert (got.float() - start.float()).abs().max() > 1e-2
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)


def test_fsdp2_matches_one_process_and_combines_found_inf(ddp_results: list[dict[str, Any]]) -> None:
    """FSDP2 (fully_shard) on two gloo ranks: FusedAdamW steps the DTensor params' local shards
    (fp32 masters of the bf16 layer's shards) with fused clipping to the global norm. An inf
    written into a grad shard that only rank 1 holds is found by rank 1 alone; the scaler sums
    found_inf over the ranks, so rank 0 skips too (> 0 on both) and the shards stay in step.
    The gathered weights match one unsharded process on the global batch, and each rank's
    optimizer state_dict round-trips through torch.load(weights_only=True) to the same next step."""
    ranks = [result["fsdp2"] for result in ddp_results]
    model = MixedPrecisionNet(FEATURES)
    single = train(model, make_fsdp2_optimizer(model), slice(0, GLOBAL_BATCH), sharded_overflow=True)

    expected_skips = [step == OVERFLOW_STEP for step in range(STEPS)]
    assert single["skipped"] == expected_skips
    for result in ranks:
        assert result["skipped"] == expected_skips
        assert result["unchanged_by_skip"] is True
        assert result["scales"] == single["scales"]
        assert result["resumed_step_equal"] is True
    for param0, param1 in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(param0, param1)
    initial = list(MixedPrecisionNet(FEATURES).parameters())
    for got, want, start in zip(ranks[0]["params"], single["params"], initial, strict=True):
        assert got.dtype == start.dtype and got.shape == start.shape
        assert (got.float() - start.float()).abs().max() > 1e-2
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)


def test_torchrun_example_trains_and_checkpoints(tmp_path: Path) -> None:
    """examples/train_ddp.py under torchrun, two CPU processes (gloo): it trains, logs from
    rank 0 only, and leaves a checkpoint that loads with weights_only=True at the last step."""
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    for attempt in range(2):
        # A fresh directory and port per attempt: a retry must not resume the first checkpoint.
        checkpoint = tmp_path / f"run{attempt}" / "checkpoint.pt"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(root / "examples" / "train_ddp.py"),
            "--steps=4",
            "--batch-size=8",
            "--save-every=2",
            "--log-every=2",
            f"--checkpoint={checkpoint}",
        ]
        completed = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
        # gloo now and then aborts a process at interpreter exit, after all the work is done:
        # run again once, as run_ranks does. Any other failure fails at once.
        if completed.returncode == 0 or GLOO_TEARDOWN_ABORT not in completed.stderr:
            break
    assert completed.returncode == 0, completed.stderr[-4000:]
    lines = [line for line in completed.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 2", "step 4"]
    assert all(", 0 skipped, " in line and line.endswith(", 2 ranks") for line in lines)
    state = torch.load(checkpoint, weights_only=True)
    assert state["step"] == 4
    assert state["scaler"]["scale"] == 2.0**16
    assert {float(param_state["step"]) for param_state in state["optimizer"]["state"].values()} == {4.0}


def test_hsdp_clipping_norm_counts_each_element_once(ddp_results: list[dict[str, Any]]) -> None:
    """FSDP2 HSDP (2 replicas of 1 shard): the fused clipping norm is the full grads' norm on
    every rank, not sqrt(2) times it (a sum over the Replicate dim too), and the clipped grads
    have max_grad_norm."""
    for result in ddp_results:
        norms = result["hsdp"]
        assert norms["measured"] == pytest.approx(norms["expected"], rel=1e-5)
        assert norms["clipped"] == pytest.approx(1e-3, rel=1e-3)


def test_replicate_dtensor_norm_and_found_inf(ddp_results: list[dict[str, Any]]) -> None:
    """A Replicate() DTensor param next to a Shard(0) one: the norm counts the replicated grad
    once, and an inf in one rank's replicated grad still skips the step on both ranks."""
    for result in ddp_results:
        norms = result["replicate"]
        assert norms["measured"] == pytest.approx(norms["expected"], rel=1e-5)
        assert norms["skip_unchanged"] is True
        assert norms["scale"] == 0.5
