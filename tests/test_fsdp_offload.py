"""FusedAdamW / FusedSGD as the optimizer of FSDP2 with CPU offload (``fully_shard(...,
offload_policy=CPUOffloadPolicy())``), which hands the optimizer CPU DTensor shards.

Two gloo ranks on the CPU, where ``CPUOffloadPolicy(pin_memory=False)`` runs FSDP2's offload code
with the CPU as the compute device, train every mode (AdamW and SGD; moments fp32, bf16, int8;
fp32 / remainder / stochastic masters of bf16 params, and fp32 params computed in bf16 through
``mp_policy``) with clipping to the global norm under either GradScaler, on 1-D and HSDP meshes:
the gathered weights match one process on the global batch, the norm is the full grads' norm on
every rank (one read-only pass and one small all-reduce per step), and an inf written into a grad
shard that only rank 1 holds skips the step bitwise on every rank. The offloaded state checkpoints
through torch.distributed.checkpoint: resumed bitwise, loaded without offload, resharded onto one
rank.

Under NCCL alone a process group has no CPU backend: the found_inf and norm reductions of CPU
shards go through the current CUDA device (fusedamp/_dtensor.py). Without a GPU, the rule is
tested on fake groups and on a real group of a backend registered for CUDA only (which fails on CPU
tensors as NCCL does), and the layout of offloaded params (a CUDA mesh, CPU shards) on a mesh of
device type "cuda" over gloo. With a GPU, FSDP2 offload runs on NCCL (skipped here without one).

The ranks run every scenario in one spawn (starting processes is the slow part); the one-process
references run in the test process.
"""

from __future__ import annotations

import functools
import math
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import MixedPrecisionNet
from test_distributed import run_ranks
from test_distributed_checkpoint import assert_state_matches, full_state, mismatches, save
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

import fusedamp
from fusedamp import _dtensor

WORLD_SIZE = 2
# An fp32 layer (48 x 6: rank 1 holds rows 24-47) and two bf16 layers.
FEATURES = (6, 48, 24, 3)
STEPS = 6
GLOBAL_BATCH = 16
# At this step an inf is written into the fp32 weight's grad after backward, at row OVERFLOW_ROW
# (held by the last rank only, or by each replica of an HSDP mesh whose shard dim has size 1:
# there only into the last rank's), so that only that rank finds it.
OVERFLOW_STEP = 3
OVERFLOW_ROW = 24
MAX_GRAD_NORM = 0.5
MOMENTS = ("fp32", "bf16", "int8")
# master_weights of the two bf16 layers.
MASTERS = {"masters": (True, "remainder"), "stochastic": ("stochastic", "stochastic")}
CONFIGS = {
    f"{kind}-{moments}-{masters}": (kind, moments, MASTERS[masters])
    for kind in ("adamw", "sgd") for moments in MOMENTS for masters in MASTERS
}
SCALERS = ("fusedamp", "torch")
HSDP_MESHES = {"hsdp-2x1": (2, 1), "hsdp-1x2": (1, 2)}
# (layout, config, scaler): "fsdp" is fully_shard over both ranks, "mp" the same with bf16
# compute of the fp32 layer (MixedPrecisionPolicy), "hsdp-RxS" a (replicate, shard) mesh.
# torch.amp.GradScaler reduces found_inf over the mesh dims that are not Replicate only (its
# DTensor rule), which misses an inf written into one replica alone: it runs on 1 x 2 HSDP.
RUNS = [("fsdp", config, scaler) for config in CONFIGS for scaler in SCALERS] + [
    ("mp", "adamw-int8-masters", "fusedamp"),
    ("mp", "sgd-fp32-masters", "torch"),
    ("hsdp-2x1", "adamw-int8-masters", "fusedamp"),
    ("hsdp-2x1", "sgd-bf16-stochastic", "fusedamp"),
    ("hsdp-1x2", "adamw-int8-masters", "fusedamp"),
    ("hsdp-1x2", "sgd-bf16-stochastic", "fusedamp"),
    ("hsdp-1x2", "adamw-fp32-masters", "torch"),
]
RUN_IDS = [f"{layout}-{config}-{scaler}" for layout, config, scaler in RUNS]
# Trained once more without CPUOffloadPolicy: the same bits.
NO_OFFLOAD = ("fsdp", "adamw-int8-masters", "fusedamp")
# (layout, config) of the checkpoint runs.
DCP_RUNS = [
    ("fsdp", "adamw-int8-masters"),
    ("fsdp", "sgd-bf16-stochastic"),
    ("hsdp-2x1", "adamw-int8-masters"),
    ("hsdp-1x2", "sgd-bf16-stochastic"),
]
DCP_IDS = [f"{layout}-{config}" for layout, config in DCP_RUNS]
SAVE_AT = 3
TIMEOUT_S = 240
CUDA_ONLY_BACKEND = "fusedamp_test_cuda_only"


# --- building and training --------------------------------------------------------------------


def make_optimizer(config: str, model: MixedPrecisionNet) -> torch.optim.Optimizer:
    kind, moments, masters = CONFIGS[config]
    layers = model.layers()
    groups = [{"params": list(layers[0].parameters())}] + [
        {"params": list(layer.parameters()), "master_weights": mode}
        for layer, mode in zip(layers[1:], masters, strict=True)
    ]
    if kind == "adamw":
        return fusedamp.FusedAdamW(
            groups, lr=1e-2, weight_decay=0.1, moments=moments, max_grad_norm=MAX_GRAD_NORM
        )
    return fusedamp.FusedSGD(groups, lr=0.5, momentum=0.9, moments=moments, max_grad_norm=MAX_GRAD_NORM)


def build(
    config: str, layout: str = "fsdp", mesh: DeviceMesh | None = None, offload: bool = True,
    device: str = "cpu",
) -> tuple[MixedPrecisionNet, torch.optim.Optimizer]:
    """A model (``layout`` "plain": not sharded; else fully_shard on ``mesh``, default every rank,
    with CPU offload unless ``offload`` is False) on ``device`` and its optimizer."""
    model = MixedPrecisionNet(FEATURES).to(device)
    if layout != "plain":
        options: dict[str, Any] = {"mesh": mesh}
        if offload:  # pinning the host copies needs a GPU
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=device != "cpu")
        if layout == "mp":
            options["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        for layer in model.layers():
            fully_shard(layer, **options)
        fully_shard(model, **options)
    return model, make_optimizer(config, model)


def rows(group: dist.ProcessGroup | None = None) -> slice:
    """This rank's rows of each global batch."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = GLOBAL_BATCH // size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def batch(step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(300 + step)
    inputs = torch.randn(GLOBAL_BATCH, FEATURES[0], generator=generator)
    return inputs, torch.randn(GLOBAL_BATCH, FEATURES[-1], generator=generator)


def write_overflow(grad: Tensor) -> None:
    """An inf at row OVERFLOW_ROW of the fp32 weight's full grad, in the last rank's shard only."""
    if not isinstance(grad, DTensor):
        grad[OVERFLOW_ROW, 0] = float("inf")
    elif dist.get_rank() == dist.get_world_size() - 1:
        shard = grad.to_local()  # the last rows of the weight: the second half, or all of them
        shard[OVERFLOW_ROW - (FEATURES[1] - shard.shape[0]), 0] = float("inf")


def gathered(tensor: Tensor) -> Tensor:
    """The full tensor of a DTensor on the CPU (gathered on its mesh's device, as NCCL needs for
    the CPU shards of offloaded params), or the tensor."""
    if not isinstance(tensor, DTensor):
        return tensor.detach().cpu()
    on_mesh_device = DTensor.from_local(
        tensor.to_local(), tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape,
        stride=tensor.stride(),
    )
    return on_mesh_device.full_tensor().cpu()


def full_grad_norm(params: list[nn.Parameter]) -> float:
    """The L2 norm of the params' full grads, each element once, in float64."""
    return math.sqrt(sum(gathered(param.grad).double().square().sum().item() for param in params))


def snapshot(params: list[nn.Parameter], opt: torch.optim.Optimizer) -> list[Tensor]:
    """The bits of this rank's shards of ``params`` and of every state tensor (masters,
    remainders, moments, codes, scales, steps)."""
    bits = []
    for param in params:
        bits.append(_bits(_dtensor.local(param)))
        state = opt.state[param].values()
        bits += [_bits(_dtensor.local(value)) for value in state if isinstance(value, Tensor)]
    return bits


def _bits(tensor: Tensor) -> Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8).clone()


def found_inf(scaler: Any, opt: torch.optim.Optimizer) -> bool:
    """Whether this iteration's step was skipped (asked before scaler.update())."""
    if isinstance(scaler, fusedamp.GradScaler):
        return bool(scaler.step_skipped)
    return sum(value.item() for value in scaler._found_inf_per_device(opt).values()) > 0


@contextmanager
def counting_reductions() -> Iterator[dict[str, Any]]:
    """Counts fusedamp's read-only passes over the grads and the all-reduces (with the device of
    their tensor) while it is open."""
    calls: dict[str, Any] = {"checks": 0, "all_reduces": []}
    check, all_reduce = fusedamp.ops.check_and_norm_, dist.all_reduce

    def counted_check(*args: Any, **kwargs: Any) -> None:
        calls["checks"] += 1
        check(*args, **kwargs)

    def counted_all_reduce(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        calls["all_reduces"].append(tensor.device.type)
        return all_reduce(tensor, *args, **kwargs)

    fusedamp.ops.check_and_norm_, dist.all_reduce = counted_check, counted_all_reduce
    try:
        yield calls
    finally:
        fusedamp.ops.check_and_norm_, dist.all_reduce = check, all_reduce


def train(
    model: MixedPrecisionNet, opt: torch.optim.Optimizer, scaler_kind: str, batch_rows: slice,
    device: str = "cpu",
) -> dict[str, Any]:
    """STEPS steps of bf16 autocast training under ``scaler_kind``'s GradScaler on ``batch_rows``
    of each global batch, with the overflow at OVERFLOW_STEP; what the tests compare."""
    scaler_class = fusedamp.GradScaler if scaler_kind == "fusedamp" else torch.amp.GradScaler
    scaler = scaler_class(device, init_scale=2.0**8, growth_interval=2)
    params = list(model.parameters())
    log: dict[str, Any] = {
        "skipped": [], "unchanged": [], "scales": [], "norms": [], "expected_norms": [], "calls": [],
    }
    for step in range(STEPS):
        inputs, target = batch(step)
        opt.zero_grad()
        with fusedamp.autocast(device, dtype=torch.bfloat16):
            output = model(inputs[batch_rows].to(device))
            loss = nn.functional.mse_loss(output, target[batch_rows].to(device))
        scaler.scale(loss).backward()
        if step == OVERFLOW_STEP:
            write_overflow(model.fp32.weight.grad)
        log["expected_norms"].append(full_grad_norm(params) / scaler.get_scale())
        before = snapshot(params, opt)
        with counting_reductions() as calls:
            scaler.step(opt)
        log["calls"].append(calls)
        log["skipped"].append(found_inf(scaler, opt))
        scaler.update()
        log["scales"].append(scaler.get_scale())
        log["norms"].append(opt.last_grad_norm.item())
        after = snapshot(params, opt)
        log["unchanged"].append(all(torch.equal(a, b) for a, b in zip(before, after, strict=True)))
    log["params"] = [gathered(param) for param in params]
    log["devices"] = devices(model, opt)
    return log


def devices(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[str]]:
    """Where this rank's shards of params, grads, state and state_dict() entries are, and the
    device type of the state_dict() DTensors' mesh."""
    found: dict[str, set[str]] = {"params": set(), "grads": set(), "state": set(), "state_dict": set(),
                                  "state_dict_mesh": set()}
    for param in model.parameters():
        found["params"].add(_dtensor.local(param).device.type)
        if param.grad is not None:
            found["grads"].add(_dtensor.local(param.grad).device.type)
        state = opt.state[param].values()
        found["state"].update(
            _dtensor.local(value).device.type for value in state if isinstance(value, Tensor)
        )
    for entries in opt.state_dict()["state"].values():
        for value in entries.values():
            if isinstance(value, DTensor):
                found["state_dict"].add(value.to_local().device.type)
                found["state_dict_mesh"].add(value.device_mesh.device_type)
    return {key: sorted(value) for key, value in found.items()}


# --- the scenarios on the ranks ---------------------------------------------------------------


def hsdp_meshes() -> dict[str, DeviceMesh]:
    return {
        name: init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        for name, shape in HSDP_MESHES.items()
    }


def training_runs(meshes: dict[str, DeviceMesh]) -> dict[str, Any]:
    """Every run of RUNS, and NO_OFFLOAD without CPUOffloadPolicy."""
    results = {}
    for (layout, config, scaler), run_id in zip(RUNS, RUN_IDS, strict=True):
        model, opt = build(config, layout, meshes.get(layout))
        results[run_id] = train(model, opt, scaler, rows())
    layout, config, scaler = NO_OFFLOAD
    model, opt = build(config, layout, offload=False)
    results["no-offload"] = train(model, opt, scaler, rows())
    return results


def load(
    config: str, path: Path, mesh: DeviceMesh | None = None, group: dist.ProcessGroup | None = None,
    offload: bool = True, device: str = "cpu",
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The DCP recipe: a fresh model and optimizer, their state_dict loaded in place, set back."""
    model, opt = build(config, mesh=mesh, offload=offload, device=device)
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt


def plain_train(
    model: nn.Module, opt: torch.optim.Optimizer, steps: range, batch_rows: slice, device: str = "cpu"
) -> None:
    """Steps without a scaler or autocast (clipping still on) on ``batch_rows``."""
    for step in steps:
        inputs, target = batch(step)
        opt.zero_grad(set_to_none=True)
        output = model(inputs[batch_rows].to(device))
        nn.functional.mse_loss(output, target[batch_rows].to(device)).backward()
        opt.step()


def checkpoints(
    root: Path, runs: list[tuple[str, str]], meshes: dict[str, DeviceMesh], device: str = "cpu"
) -> dict[str, Any]:
    """For each (layout, config) of ``runs``, offloaded: 6 steps straight against 3 steps,
    dcp.save, a fresh offloaded (and a not offloaded) model and optimizer of the same layout
    loaded from it and 3 steps."""
    results: dict[str, Any] = {"resume": {}, "into_not_offloaded": {}, "saved": {}, "devices": {}}
    for layout, config in runs:
        run_id, mesh = f"{layout}-{config}", meshes.get(layout)
        straight, straight_opt = build(config, mesh=mesh, device=device)
        plain_train(straight, straight_opt, range(STEPS), rows(), device)
        first, first_opt = build(config, mesh=mesh, device=device)
        plain_train(first, first_opt, range(SAVE_AT), rows(), device)
        save(first, first_opt, root / run_id)
        if device == "cpu":  # a full state dict gathers the CPU shards: not over NCCL
            results["saved"][run_id] = full_state(first, first_opt)
        results["devices"][run_id] = devices(first, first_opt)
        for key, offload in (("resume", True), ("into_not_offloaded", False)):
            resumed, resumed_opt = load(config, root / run_id, mesh, offload=offload, device=device)
            plain_train(resumed, resumed_opt, range(SAVE_AT, STEPS), rows(), device)
            results[key][run_id] = mismatches(straight, straight_opt, resumed, resumed_opt)
    return results


def one_rank_loads(solo: dist.ProcessGroup, root: Path) -> dict[str, Any]:
    """Rank 0 alone: each 2-rank offloaded checkpoint loaded into a 1-rank offloaded model."""
    mesh = DeviceMesh.from_group(solo, "cpu")
    results = {}
    for (_, config), run_id in zip(DCP_RUNS, DCP_IDS, strict=True):
        model, opt = load(config, root / run_id, mesh, solo)
        results[run_id] = full_state(model, opt)
    return results


def cpu_shard(full: Tensor, mesh: DeviceMesh) -> DTensor:
    """This rank's Shard(0) piece of ``full`` as a DTensor on ``mesh``, kept on the CPU whatever
    the mesh's device type, as FSDP2 keeps its CPU-offloaded params."""
    rank, size = mesh.get_local_rank(), mesh.size()
    local = full.chunk(size)[rank].clone()
    meta = TensorMeta(full.shape, full.stride(), full.dtype)
    return DTensor(local, DTensorSpec(mesh, (Shard(0),), tensor_meta=meta), requires_grad=False)


def cuda_mesh_shards() -> dict[str, Any]:
    """Params laid out as FSDP2 offloads them on a GPU (CPU shards on a mesh of device type
    "cuda"), here over gloo: a step with clipping under fusedamp.GradScaler, the state_dict, its
    round trip, and an inf in rank 1's shard skipping the step on both ranks."""
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
    generator = torch.Generator().manual_seed(11)
    fulls = [torch.randn(10, 4, generator=generator), torch.randn(6, 8, generator=generator).bfloat16()]
    grads = [torch.randn(10, 4, generator=generator), torch.randn(6, 8, generator=generator).bfloat16()]
    params = [nn.Parameter(cpu_shard(full, mesh)) for full in fulls]
    for param, grad in zip(params, grads, strict=True):
        param.grad = cpu_shard(grad, mesh)
    opt = fusedamp.FusedAdamW(params, lr=1e-2, moments="int8", master_weights="remainder", max_grad_norm=1.0)
    scaler = fusedamp.GradScaler("cpu", init_scale=1.0)
    scaler.scale(torch.ones(()))  # makes the scale (grads set by hand: a scale of 1)
    with counting_reductions() as calls:
        scaler.step(opt)
    scaler.update()
    results: dict[str, Any] = {
        "expected_norm": math.sqrt(sum(grad.double().square().sum().item() for grad in grads)),
        "norm": opt.last_grad_norm.item(),
        "all_reduces": calls["all_reduces"],
    }
    state_dict = opt.state_dict()
    results["state_dict"] = sorted(
        {(key, value.to_local().device.type, value.device_mesh.device_type)
         for entries in state_dict["state"].values() for key, value in entries.items()
         if isinstance(value, DTensor)}
    )
    again = fusedamp.FusedAdamW(
        [nn.Parameter(cpu_shard(full, mesh)) for full in fulls], lr=1e-2, moments="int8",
        master_weights="remainder", max_grad_norm=1.0,
    )
    again.load_state_dict(state_dict)
    results["round_trip"] = all(
        torch.equal(_bits(_dtensor.local(value)), _bits(again.state[again_param][key]))
        for param, again_param in zip(params, again.param_groups[0]["params"], strict=True)
        for key, value in opt.state[param].items()
    )
    for param, grad in zip(params, grads, strict=True):
        param.grad = cpu_shard(grad, mesh)
    if dist.get_rank() == 1:
        params[0].grad.to_local()[0, 0] = float("inf")
    before = snapshot(params, opt)
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()
    results["skip_unchanged"] = all(
        torch.equal(a, b) for a, b in zip(before, snapshot(params, opt), strict=True)
    )
    return results


def cuda_only_group() -> dict[str, Any]:
    """A process group whose backend (gloo, registered for CUDA tensors only) has no CPU backend,
    as an NCCL group: what fusedamp asks of it, the plain all_reduce of a CPU tensor (fails), and
    fusedamp's sum over it (through the CUDA device; without one, a clear error)."""
    group = dist.new_group(backend=CUDA_ONLY_BACKEND)
    results: dict[str, Any] = {
        "cpu": _dtensor.has_backend_for(group, "cpu"),
        "cuda": _dtensor.has_backend_for(group, "cuda"),
        "world_cpu": _dtensor.has_backend_for(dist.group.WORLD, "cpu"),
    }
    try:
        dist.all_reduce(torch.ones(()), group=group)
        results["plain_error"] = ""
    except RuntimeError as error:
        results["plain_error"] = str(error)
    ones = torch.ones(())
    try:
        _dtensor.sum_over_groups_(ones, [group])
        results["routed"] = (ones.item(), ones.device.type)
    except RuntimeError as error:
        results["routed"] = str(error)
    return results


def _gloo_for_cuda(store: Any, rank: int, size: int, timeout: Any) -> Any:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def worker(rank: int, port: int, root: str, out_dir: str) -> None:
    try:
        torch.set_num_threads(1)
        dist.Backend.register_backend(CUDA_ONLY_BACKEND, _gloo_for_cuda, devices=["cuda"])
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
        )
        try:
            solo = dist.new_group([0])
            meshes = hsdp_meshes()
            result: dict[str, Any] = {
                "cuda_only_group": cuda_only_group(),
                "cuda_mesh": cuda_mesh_shards(),
                "runs": training_runs(meshes),
                "checkpoints": checkpoints(Path(root), DCP_RUNS, meshes),
            }
            dist.barrier()
            if rank == 0:
                result["one_rank_loads"] = one_rank_loads(solo, Path(root))
            torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("offload-checkpoints")
    return run_ranks(worker, (str(root),), tmp_path_factory.mktemp("offload"), timeout=TIMEOUT_S)


@functools.cache
def reference(config: str, scaler: str) -> dict[str, Any]:
    """One process, not sharded, on the whole global batch."""
    model, opt = build(config, "plain")
    return train(model, opt, scaler, slice(0, GLOBAL_BATCH))


# --- tests ------------------------------------------------------------------------------------


def assert_matches_reference(ranks: list[dict[str, Any]], single: dict[str, Any]) -> None:
    """Both ranks' gathered weights equal each other and are near the one-process run's: per
    tensor, the mean difference under 8% of the mean distance training moved the weights, and
    none over 0.04 (4 AdamW steps of lr; SGD moved weights up to 0.15).

    The grads are bf16 sums over 8 rows reduced across ranks against sums over 16, and 8-bit codes
    and stochastic rounding draw on each rank's shard (other blocks and element indices than one
    process'). AdamW's first steps move an element by +-lr whatever its grad's size, so an element
    whose grad is within rounding of zero may step the other way (2 lr apart). Observed: mean
    differences up to 4.6% of the distance moved (int8 moments and stochastic rounding; 2.6% with
    fp32 state), the largest 0.027.
    """
    initial = list(MixedPrecisionNet(FEATURES).parameters())
    for got, other, want, start in zip(
        ranks[0]["params"], ranks[1]["params"], single["params"], initial, strict=True
    ):
        assert torch.equal(got, other)
        assert got.dtype == start.dtype and got.shape == start.shape
        moved = (got.float() - start.float()).abs()
        difference = (got.float() - want.float()).abs()
        assert moved.max() > 2e-2
        assert difference.mean() <= 0.08 * moved.mean()
        assert difference.max() <= 0.04


@pytest.mark.parametrize(("layout", "config", "scaler"), RUNS, ids=RUN_IDS)
def test_offloaded_training_matches_one_process(
    layout: str, config: str, scaler: str, results: list[dict[str, Any]]
) -> None:
    """Each mode on CPU-offloaded FSDP2 shards under either GradScaler with clipping: every rank
    skips the overflow step, leaving every param shard and state tensor bitwise as it was, and
    steps the others; the scales follow one process' run and the weights come near it."""
    run_id = RUN_IDS[RUNS.index((layout, config, scaler))]
    ranks = [result["runs"][run_id] for result in results]
    single = reference(config, scaler)
    expected_skips = [step == OVERFLOW_STEP for step in range(STEPS)]
    assert single["skipped"] == expected_skips
    for run in ranks:
        assert run["skipped"] == expected_skips
        assert run["unchanged"] == expected_skips  # bitwise unchanged when skipped, changed otherwise
        assert run["scales"] == single["scales"]
        assert run["devices"] == {
            "params": ["cpu"], "grads": ["cpu"], "state": ["cpu"], "state_dict": ["cpu"],
            "state_dict_mesh": ["cpu"],
        }
    assert_matches_reference(ranks, single)


@pytest.mark.parametrize(("layout", "config", "scaler"), RUNS, ids=RUN_IDS)
def test_clipping_norm_is_global_and_computed_once(
    layout: str, config: str, scaler: str, results: list[dict[str, Any]]
) -> None:
    """The clipping norm is the full grads' norm (unscaled), bitwise the same on every rank, from
    one read-only pass over the grads per step; the reductions are small all-reduces on the CPU:
    found_inf over each mesh dim (fusedamp.GradScaler; torch's reduces its own) and the norm over
    the dims that shard the grads. Clipping is active in some steps. At the skipped step the norm
    is not finite on the rank that holds the inf (on 2 x 1 HSDP, the other replica's is its own
    grads' norm: the replicas hold the same elements, and the inf was written into one of them)."""
    run_id = RUN_IDS[RUNS.index((layout, config, scaler))]
    ranks = [result["runs"][run_id] for result in results]
    mesh_dims = 2 if layout.startswith("hsdp") else 1
    all_reduces = (mesh_dims if scaler == "fusedamp" else 0) + 1
    stepped = [step for step in range(STEPS) if step != OVERFLOW_STEP]
    assert [ranks[0]["norms"][step] for step in stepped] == [ranks[1]["norms"][step] for step in stepped]
    assert not math.isfinite(ranks[-1]["norms"][OVERFLOW_STEP])
    for run in ranks:
        for step in stepped:
            assert run["norms"][step] == pytest.approx(run["expected_norms"][step], rel=1e-5)
        assert max(run["norms"][step] for step in stepped) > MAX_GRAD_NORM
        assert run["calls"] == [{"checks": 1, "all_reduces": ["cpu"] * all_reduces}] * STEPS


def test_offload_changes_no_bit(results: list[dict[str, Any]]) -> None:
    """The same training without CPUOffloadPolicy: the same weights, norms and scales, bitwise."""
    run_id = RUN_IDS[RUNS.index(NO_OFFLOAD)]
    for result in results:
        offloaded, not_offloaded = result["runs"][run_id], result["runs"]["no-offload"]
        for a, b in zip(offloaded["params"], not_offloaded["params"], strict=True):
            assert torch.equal(a, b)
        assert offloaded["norms"] == not_offloaded["norms"]
        assert offloaded["scales"] == not_offloaded["scales"]


@pytest.mark.parametrize(("layout", "config"), DCP_RUNS, ids=DCP_IDS)
def test_offloaded_checkpoint_resumes_and_reshards(
    layout: str, config: str, results: list[dict[str, Any]]
) -> None:
    """dcp.save of the offloaded state (DTensors of CPU shards), loaded into fresh offloaded and
    not offloaded models of the same layout: 3 more steps bitwise as 6 straight; loaded onto one
    rank: state as saved (8-bit codes within the bound of a reshard where blocks of both ranks
    meet, docs/distributed-checkpoint.md; a 2 x 1 HSDP rank holds whole tensors)."""
    run_id = f"{layout}-{config}"
    for result in results:
        checkpoint = result["checkpoints"]
        assert checkpoint["resume"][run_id] == []
        assert checkpoint["into_not_offloaded"][run_id] == []
        assert checkpoint["devices"][run_id]["state_dict"] == ["cpu"]
    saved = results[0]["checkpoints"]["saved"][run_id]
    changed = assert_state_matches(saved, results[0]["one_rank_loads"][run_id])
    assert (changed > 0) == ("-int8-" in config and layout != "hsdp-2x1")


def test_cuda_mesh_with_cpu_shards(results: list[dict[str, Any]]) -> None:
    """The layout of FSDP2's offloaded params on a GPU (a mesh of device type "cuda", CPU shards):
    the step clips to the global norm with reductions on the CPU (the group, gloo, has a CPU
    backend), state_dict() keeps the DTensor state on the CPU (no copy to the GPU) and loads
    back bitwise, and an inf in one rank's shard skips the step on both."""
    for result in results:
        run = result["cuda_mesh"]
        assert run["norm"] == pytest.approx(run["expected_norm"], rel=1e-5)
        assert run["all_reduces"] == ["cpu", "cpu"]
        assert {(device, mesh) for _, device, mesh in run["state_dict"]} == {("cpu", "cuda")}
        assert {key for key, _, _ in run["state_dict"]} == {
            "exp_avg", "exp_avg_sq", "exp_avg_scales", "exp_avg_sq_scales", "master_remainder",
        }
        assert run["round_trip"] is True
        assert run["skip_unchanged"] is True


def test_group_without_cpu_backend(results: list[dict[str, Any]]) -> None:
    """A real process group without a CPU backend (as NCCL): a plain all_reduce of a CPU tensor
    fails there, fusedamp sees it and sums through the CUDA device (on a machine without one it
    says so)."""
    for result in results:
        group = result["cuda_only_group"]
        assert (group["cpu"], group["cuda"], group["world_cpu"]) == (False, True, True)
        assert "No backend type associated with device type cpu" in group["plain_error"]
        if torch.cuda.is_available():
            assert group["routed"] == (2.0, "cpu")
        else:
            assert "CUDA is not available" in group["routed"]


class FakeGroup:
    """A process group with backends for ``device_types`` only, as far as fusedamp asks."""

    def __init__(self, *device_types: str) -> None:
        self.device_types = device_types

    def _get_backend(self, device: torch.device) -> object:
        if device.type not in self.device_types:
            raise RuntimeError(f"No backend type associated with device type {device.type}")
        return object()


def test_reduction_device_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a small tensor is all-reduced: on its device when every group has a backend for it;
    CPU tensors over a group without a CPU backend (NCCL) on the current CUDA device; CUDA
    tensors over a CPU-only group on the CPU; a clear error when nothing fits."""
    cpu, cuda0 = torch.device("cpu"), torch.device("cuda", 0)
    gloo, mixed = FakeGroup("cpu", "cuda"), FakeGroup("cpu", "cuda")  # gloo; "cpu:gloo,cuda:nccl"
    nccl, cpu_only = FakeGroup("cuda"), FakeGroup("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert _dtensor.reduction_device(cpu, [gloo]) == cpu
    assert _dtensor.reduction_device(cpu, [mixed, gloo]) == cpu
    assert _dtensor.reduction_device(cpu, [nccl]) == torch.device("cuda", 1)
    assert _dtensor.reduction_device(cpu, [gloo, nccl]) == torch.device("cuda", 1)  # one device for all
    assert _dtensor.reduction_device(cuda0, [nccl]) == cuda0
    assert _dtensor.reduction_device(cuda0, [cpu_only]) == cpu
    assert _dtensor.reduction_device(cpu, [object()]) == cpu  # not a c10d group: not asked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="without a cpu backend"):
        _dtensor.reduction_device(cpu, [nccl])


def test_sum_over_groups_goes_and_comes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """sum_over_groups_ reduces over every group on the device the rule picks and leaves the sum
    in the tensor it was given; no all_reduce without groups."""
    seen: list[tuple[str, object]] = []

    def fake_all_reduce(tensor: Tensor, op: Any = None, group: Any = None) -> None:
        seen.append((tensor.device.type, group))
        tensor.add_(1.0)

    monkeypatch.setattr(_dtensor.dist, "all_reduce", fake_all_reduce)
    first, second = FakeGroup("cpu"), FakeGroup("cpu")
    value = torch.zeros(())
    _dtensor.sum_over_groups_(value, [first, second])
    assert value.item() == 2.0 and seen == [("cpu", first), ("cpu", second)]
    _dtensor.sum_over_groups_(value, [])
    assert len(seen) == 2


# --- with a GPU: FSDP2 offload on NCCL ----------------------------------------------------------

GPU_CONFIGS = ("adamw-int8-masters", "sgd-bf16-stochastic")


def gpu_worker(rank: int, port: int, root: str, out_dir: str) -> None:
    """One rank per GPU (at most two) on NCCL alone: offloaded training under fusedamp.GradScaler
    (reductions through the GPU) and torch.amp.GradScaler on a "cpu:gloo,cuda:nccl" group, and
    the DCP checkpoints of the offloaded state."""
    try:
        torch.set_num_threads(1)
        torch.cuda.set_device(rank)
        world_size = min(WORLD_SIZE, torch.cuda.device_count())
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            device_id=torch.device("cuda", rank),
        )
        try:
            result: dict[str, Any] = {
                "has_cpu": _dtensor.has_backend_for(dist.group.WORLD, "cpu"),
                "routing": str(_dtensor.reduction_device(torch.device("cpu"), [dist.group.WORLD])),
                "runs": {},
            }
            for config in GPU_CONFIGS:
                model, opt = build(config, device="cuda")
                result["runs"][config] = train(model, opt, "fusedamp", rows(), device="cuda")
            both = dist.new_group(backend="cpu:gloo,cuda:nccl")
            mesh = DeviceMesh.from_group(both, "cuda")
            model, opt = build("adamw-fp32-masters", mesh=mesh, device="cuda")
            result["runs"]["torch-scaler"] = train(model, opt, "torch", rows(), device="cuda")
            runs = [("fsdp", config) for config in GPU_CONFIGS]
            result["checkpoints"] = checkpoints(Path(root), runs, {}, device="cuda")
            torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise


@pytest.mark.skipif(
    not (torch.cuda.is_available() and fusedamp.build_info()["cuda_compiled"]),
    reason="needs a GPU and fusedamp's CUDA kernels",
)
def test_offload_on_nccl(tmp_path: Path) -> None:
    """FSDP2 with CPUOffloadPolicy on NCCL (one rank per GPU, at most two): params, grads, state
    and state_dict() on the CPU; found_inf and the norm all-reduced through the GPU (the group has
    no CPU backend) and right; the skip bitwise; near one process on the GPU; DCP resumes bitwise.
    torch.amp.GradScaler runs on a "cpu:gloo,cuda:nccl" group: under NCCL alone its own DTensor
    found_inf rule all-reduces a CPU tensor and fails (docs/distributed.md)."""
    world_size = min(WORLD_SIZE, torch.cuda.device_count())
    (tmp_path / "out").mkdir()
    ranks = run_ranks(gpu_worker, (str(tmp_path / "dcp"),), tmp_path / "out", world_size, TIMEOUT_S)
    expected_skips = [step == OVERFLOW_STEP for step in range(STEPS)]
    for rank, result in enumerate(ranks):
        assert result["has_cpu"] is False
        assert result["routing"] == f"cuda:{rank}"
        for name, run in result["runs"].items():
            assert run["skipped"] == expected_skips, name
            assert run["unchanged"] == expected_skips, name
            assert run["devices"] == {
                "params": ["cpu"], "grads": ["cpu"], "state": ["cpu"], "state_dict": ["cpu"],
                "state_dict_mesh": ["cuda"],
            }, name
            if name == "torch-scaler":
                # torch's own found_inf reduction, one per step, on the device torch picks (the
                # CPU in the gloo tests here; the GPU with torch 2.11 on one H200).
                assert len(run["calls"]) == STEPS, name
                assert all(call["checks"] == 1 and len(call["all_reduces"]) == 1
                           for call in run["calls"]), name
            else:
                assert run["calls"] == [{"checks": 1, "all_reduces": ["cuda", "cuda"]}] * STEPS, name
            for step, (norm, expected) in enumerate(zip(run["norms"], run["expected_norms"], strict=True)):
                if step != OVERFLOW_STEP:
                    assert norm == pytest.approx(expected, rel=1e-5), name
        for config in GPU_CONFIGS:
            # Resumed offloaded, bitwise. Not offloaded, the steps after the load run on the GPU,
            # whose clipping norm sums the squares in another order than the CPU's.
            assert result["checkpoints"]["resume"][f"fsdp-{config}"] == []
    for config in GPU_CONFIGS:
        model, opt = build(config, "plain", device="cuda")
        single = train(model, opt, "fusedamp", slice(0, GLOBAL_BATCH), device="cuda")
        assert single["scales"] == ranks[0]["runs"][config]["scales"]
        assert_matches_reference([ranks[0]["runs"][config], ranks[-1]["runs"][config]], single)
