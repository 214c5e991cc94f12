"""Offload that hides the CPU step: the params stepped in the order their grads land, the grads
copied in buckets, and the one-step delayed update (``offload_delay=1``), on the CPU (plain copies,
and DeferredTransfers: copies that land only when waited on).

The delayed update is checked against :class:`DelayedReference`, the same schedule written out
with an optimizer that is not offloaded: bitwise against fusedamp's own in every mode, and within
test_optim's tolerance against plain ``torch.optim.AdamW`` / ``SGD``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import threading
from typing import Any

import pytest
import torch
from conftest import needs_cuda
from test_offload import (  # noqa: F401 (transfers: the fixture of both ways to copy)
    KINDS,
    MOMENTS,
    PARAM_MODES,
    SCALERS,
    Net,
    assert_same_bits,
    loss_of,
    make_optimizer,
    mode_id,
    pair,
    train,
    transfers,
)
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import fusedamp
from fusedamp.optim.offload import DELAYED_KEY
from fusedamp.optim.offload import backward as offload_backward

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # test_optim's, for fusedamp against torch.optim


def params_of(model: nn.Module) -> list[Tensor]:
    return [param.detach().clone() for param in model.parameters()]


def without_delayed(state_dict: dict[str, Any]) -> dict[str, Any]:
    state = {
        index: {key: value for key, value in entry.items() if key != DELAYED_KEY}
        for index, entry in state_dict["state"].items()
    }
    return {**state_dict, "state": state}


# --- the order the grads land in, buckets -------------------------------------------------------


@pytest.mark.usefixtures("transfers")
@pytest.mark.parametrize("arrival_order", [True, False], ids=["arrival", "params"])
def test_chunks_follow_the_order_the_grads_land(arrival_order: bool) -> None:
    """The first backward records the order the grads land in (the last layer first); the CPU
    steps the params in that order, or in the optimizer's: the same bits either way."""
    reference, opt, offloaded, offloaded_opt = pair("adamw", moments="int8", max_grad_norm=0.1)
    offloaded_opt._executor.arrival_order = arrival_order
    train(reference, opt, range(3))
    train(offloaded, offloaded_opt, range(3))
    assert_same_bits(params_of(reference), params_of(offloaded))
    assert_same_bits(opt.state_dict(), offloaded_opt.state_dict())
    executor = offloaded_opt._executor
    arrivals = {id(slot.param): slot.arrival for slot in executor.slots}
    layers = [offloaded.last, offloaded.middle, offloaded.first]
    for later, earlier in zip(layers, layers[1:], strict=False):
        last_of_later = max(arrivals[id(p)] for p in later.parameters())
        assert last_of_later < min(arrivals[id(p)] for p in earlier.parameters())
    stepped = [slot.param for chunk in executor._plan.last for slot in chunk.slots]
    expected = sorted(offloaded.parameters(), key=lambda p: arrivals[id(p)]) if arrival_order else list(
        offloaded.parameters()
    )
    assert [id(p) for p in stepped] == [id(p) for p in expected]


@pytest.mark.usefixtures("transfers")
@pytest.mark.parametrize("bucket_bytes", [1, 1 << 30], ids=["a bucket per grad", "one bucket"])
def test_grads_go_to_the_host_in_buckets(bucket_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Backward copies its grads a bucket at a time: one bucket (at the end of backward) when they
    fit, else one per BUCKET_BYTES; bitwise either way."""
    monkeypatch.setattr(offload_backward, "BUCKET_BYTES", bucket_bytes)
    reference, opt, offloaded, offloaded_opt = pair("sgd", master_weights="remainder")
    train(reference, opt, range(3))
    train(offloaded, offloaded_opt, range(3))
    assert_same_bits(params_of(reference), params_of(offloaded))
    counts = offloaded_opt._executor.counts
    assert counts["grads copied in backward"] == 6 * 3 and counts["grads copied in step"] == 0
    assert counts["grad buckets copied in backward"] == (6 if bucket_bytes == 1 else 1) * 3


class Tied(nn.Module):
    """An embedding tied to the output layer (its grad lands last, once, summed) and a layer run
    twice under reentrant checkpointing (its hook runs once per run: twice per backward)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.embed = nn.Embedding(11, 8)
            self.shared = nn.Linear(8, 8)
            self.head_bias = nn.Parameter(torch.zeros(11))
        self.to(dtype)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for _ in range(2):
            x = checkpoint(self.shared, x, use_reentrant=True)
        return nn.functional.linear(torch.tanh(x), self.embed.weight, self.head_bias).float()


def tied_loss(model: Tied, step: int) -> Tensor:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 11, (4, 6), generator=generator)
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(1, 1).flatten())


@pytest.mark.usefixtures("transfers")
@pytest.mark.parametrize("bucket_bytes", [1, 1 << 30], ids=["a bucket per grad", "one bucket"])
@pytest.mark.parametrize("delay", [0, 1])
def test_tied_and_shared_params(delay: int, bucket_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tied param is one slot stepped once; a param whose hook runs twice in one backward is
    copied at each run whose bucket is full (else once, at the end of backward: its summed grad)
    and, delayed, takes its update only after its last run, as the first step counted them."""
    monkeypatch.setattr(offload_backward, "BUCKET_BYTES", bucket_bytes)
    models = [Tied(torch.bfloat16) for _ in range(2)]
    reference = DelayedReference(models[0], make_optimizer("adamw", list(models[0].parameters())), 0, delay)
    offloaded_opt = make_optimizer(
        "adamw", list(models[1].parameters()), offload="cpu", offload_delay=delay, offload_delay_warmup=0
    )
    for step in range(4):
        reference.step(step, loss_fn=tied_loss)
        offloaded_opt.zero_grad()
        tied_loss(models[1], step).backward()
        offloaded_opt.step()
    assert_same_bits(params_of(reference.forward), params_of(models[1]))
    executor = offloaded_opt._executor
    assert [slot.expected for slot in executor.slots] == [1, 1, 2, 2]  # head_bias, embed, shared
    assert executor.counts["grads copied in backward"] == (6 if bucket_bytes == 1 else 4) * 4


# --- the delayed update -----------------------------------------------------------------------


class DelayedReference:
    """``offload_delay=1`` written out with an optimizer that is not offloaded: ``forward`` holds
    the params each forward sees, ``model`` those the optimizer updates. The first ``warmup``
    applied steps (a step a GradScaler skips is not one) step, then show the params to the next
    forward; after them, a step first shows the next forward the params as they are (the update of
    the step before), then steps. ``delay=0``: every step is undelayed."""

    def __init__(self, model: nn.Module, opt: Any, warmup: int, delay: int = 1) -> None:
        self.model, self.opt, self.warmup, self.delay = model, opt, warmup, delay
        self.forward = copy.deepcopy(model)
        self.applied = 0

    def step(self, step: int, scaler: Any = None, corrupt: Any = None, clip: float | None = None,
             loss_fn: Any = loss_of) -> None:
        self.opt.zero_grad()
        self.forward.zero_grad()
        loss = loss_fn(self.forward, step)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if corrupt is not None:
            corrupt(self.forward, step)
        for param, seen in zip(self.model.parameters(), self.forward.parameters(), strict=True):
            param.grad = None if seen.grad is None else seen.grad.clone()
        delayed = self.delay and self.applied >= self.warmup
        if delayed:
            self.show()
        if scaler is None:
            if clip is not None:
                nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            self.opt.step()
            self.applied += 1
        else:
            scale = scaler.get_scale()
            if clip is not None:
                scaler.unscale_(self.opt)
                nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            scaler.step(self.opt)
            scaler.update()
            self.applied += scaler.get_scale() >= scale  # a skipped step backs the scale off
        if not delayed:
            self.show()

    def show(self) -> None:
        with torch.no_grad():
            for seen, param in zip(self.forward.parameters(), self.model.parameters(), strict=True):
                seen.copy_(param)


def assert_like_reference(reference: DelayedReference, offloaded: nn.Module, offloaded_opt: Any) -> None:
    """The offloaded model holds what the reference's forward sees, its optimizer the reference
    optimizer's state, and its delayed params (state_dict) the reference optimizer's params."""
    assert_same_bits(params_of(reference.forward), params_of(offloaded))
    state_dict = offloaded_opt.state_dict()
    assert_same_bits(reference.opt.state_dict(), without_delayed(state_dict))
    # The reference optimizer's params, in the order its state_dict numbers them.
    updated = [param for group in reference.opt.param_groups for param in group["params"]]
    for index, entry in state_dict["state"].items():
        if DELAYED_KEY in entry:
            assert_same_bits(updated[index].detach(), entry[DELAYED_KEY], f"delayed param {index}")


@pytest.mark.usefixtures("transfers")
@pytest.mark.parametrize("moments", MOMENTS)
@pytest.mark.parametrize("mode", PARAM_MODES, ids=mode_id)
@pytest.mark.parametrize("kind", [*KINDS, "muon"])
def test_delayed_update_is_the_reference_schedule_bitwise(
    kind: str, mode: tuple[torch.dtype, Any], moments: str
) -> None:
    """Every mode, clipped, two undelayed warm-up steps: each step's params, state and pending
    update are the reference's bit for bit."""
    dtype, master_weights = mode
    options = {"master_weights": master_weights, "moments": moments, "max_grad_norm": 0.1}
    model = Net(dtype)
    reference = DelayedReference(model, make_optimizer(kind, list(model.parameters()), **options), warmup=2)
    offloaded = Net(dtype)
    offloaded_opt = make_optimizer(
        kind, list(offloaded.parameters()), offload="cpu", offload_delay=1, offload_delay_warmup=2, **options
    )
    for step in range(6):
        reference.step(step)
        train(offloaded, offloaded_opt, range(step, step + 1))
        assert_like_reference(reference, offloaded, offloaded_opt)
    offloaded_opt.offload_flush()  # the last update into the params: the reference's own
    assert_same_bits(params_of(reference.model), params_of(offloaded))


@pytest.mark.usefixtures("transfers")
@pytest.mark.parametrize(
    ("scaler", "offload_gradients"), [("fusedamp", False), ("fusedamp", True), ("torch", False)]
)
@pytest.mark.parametrize("kind", KINDS)
def test_delayed_update_with_scalers_schedulers_and_accumulation(
    kind: str, scaler: str, offload_gradients: bool
) -> None:
    """fp16 (bf16 for torch's scaler), a skipped step (inf grads at step 3) that updates nothing and
    does not count towards the warm-up, clipping, an LR scheduler stepped while the delayed step
    runs, two micro-batches, freed grads (unclipped): the reference's bits, run straight through
    (no state_dict() between steps). At even steps the first micro-batch runs inside
    offload_no_sync(); at odd ones its grads go to the host too and are copied again by the second,
    and the params take their delayed update only in the second backward."""
    dtype = torch.float16 if scaler == "fusedamp" else torch.bfloat16
    options: dict[str, Any] = {"moments": "int8"}
    if scaler == "fusedamp" and not offload_gradients:  # whose norm differs in the last bit (docs)
        options["max_grad_norm"] = 0.5
    model = Net(dtype)
    reference = DelayedReference(model, make_optimizer(kind, list(model.parameters()), **options), warmup=1)
    offloaded = Net(dtype)
    offloaded_opt = make_optimizer(
        kind, list(offloaded.parameters()), offload="cpu", offload_delay=1, offload_delay_warmup=1,
        offload_gradients=offload_gradients, **options,
    )
    scalers = [SCALERS[scaler](), SCALERS[scaler]()]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 1, 0.7) for o in (reference.opt, offloaded_opt)]

    def second(model: nn.Module, step: int) -> Tensor:  # inf grads at step 3
        return loss_of(model, step, 1) * (float("inf") if step == 3 else 1.0)

    def two_micro_batches(model: nn.Module, step: int) -> Tensor:
        return loss_of(model, step, 0) + second(model, step)

    for step in range(6):
        reference.step(step, scaler=scalers[0], loss_fn=two_micro_batches)
        schedulers[0].step()
        offloaded_opt.zero_grad()
        first_on_device = step % 2 == 0 or offload_gradients
        with offloaded_opt.offload_no_sync() if first_on_device else contextlib.nullcontext():
            scalers[1].scale(loss_of(offloaded, step, 0)).backward()
        scalers[1].scale(second(offloaded, step)).backward()
        scalers[1].step(offloaded_opt)
        scalers[1].update()
        schedulers[1].step()
    assert reference.applied == 5 and scalers[0].get_scale() == scalers[1].get_scale()
    assert_like_reference(reference, offloaded, offloaded_opt)


@pytest.mark.parametrize("kind", KINDS)
def test_delayed_update_is_plain_pytorchs_delayed_update(kind: str) -> None:
    """fp32 params: fusedamp's delayed offloaded step against torch.optim.AdamW / SGD run on the
    reference schedule, within test_optim's tolerance (fusedamp's step against torch's), clipped by
    clip_grad_norm_ there and by max_grad_norm here; warm-up 3 of 8 steps."""
    torch_options = (
        {"lr": 1e-2, "weight_decay": 0.1} if kind == "adamw"
        else {"lr": 5e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
    )
    model = Net(torch.float32)
    torch_class = torch.optim.AdamW if kind == "adamw" else torch.optim.SGD
    torch_opt = torch_class(model.parameters(), **torch_options)
    reference = DelayedReference(model, torch_opt, warmup=3)
    offloaded = Net(torch.float32)
    offloaded_opt = make_optimizer(
        kind, list(offloaded.parameters()), offload="cpu", offload_delay=1, offload_delay_warmup=3,
        max_grad_norm=0.3,
    )
    undelayed = Net(torch.float32)
    undelayed_opt = make_optimizer(kind, list(undelayed.parameters()), max_grad_norm=0.3)
    for step in range(8):
        reference.step(step, clip=0.3)
        train(offloaded, offloaded_opt, range(step, step + 1))
        train(undelayed, undelayed_opt, range(step, step + 1))
        for seen, param in zip(reference.forward.parameters(), offloaded.parameters(), strict=True):
            torch.testing.assert_close(param.detach(), seen.detach(), **TOLERANCE)
    # The schedule matters: without the delay the params end elsewhere.
    assert not torch.allclose(params_of(undelayed)[0], params_of(offloaded)[0], **TOLERANCE)


@pytest.mark.usefixtures("transfers")
@pytest.mark.parametrize("kind", KINDS)
def test_delayed_update_resumes_bitwise(kind: str) -> None:
    """A checkpoint of model and optimizer taken while an update is pending (the model's params
    without it, the optimizer's "delayed_param" with it) resumes bitwise: 3 steps + save + load
    into a fresh model and optimizer (model first) + 3 steps equal 6 steps straight. Loaded into
    an optimizer without delay, the pending update goes into the params at once."""
    options = {"moments": "int8", "master_weights": "remainder", "max_grad_norm": 0.2}
    straight = Net()
    straight_opt = make_optimizer(kind, list(straight.parameters()), offload="cpu", offload_delay=1,
                                  offload_delay_warmup=1, **options)
    train(straight, straight_opt, range(6))
    first = Net()
    first_opt = make_optimizer(kind, list(first.parameters()), offload="cpu", offload_delay=1,
                               offload_delay_warmup=1, **options)
    train(first, first_opt, range(3))
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert all(DELAYED_KEY in entry for entry in saved["opt"]["state"].values())
    resumed = Net(seed=5)
    resumed.load_state_dict(saved["model"])
    resumed_opt = make_optimizer(kind, list(resumed.parameters()), offload="cpu", offload_delay=1,
                                 offload_delay_warmup=1, **options)
    resumed_opt.load_state_dict(saved["opt"])
    train(resumed, resumed_opt, range(3, 6))
    assert_same_bits(params_of(straight), params_of(resumed))
    assert_same_bits(straight_opt.state_dict(), resumed_opt.state_dict())
    for offload in (None, "cpu"):
        applied = Net(seed=5)
        applied.load_state_dict(saved["model"])
        applied_opt = make_optimizer(kind, list(applied.parameters()), offload=offload, **options)
        applied_opt.load_state_dict(saved["opt"])
        pending = [saved["opt"]["state"][index][DELAYED_KEY] for index in range(6)]
        assert_same_bits(pending, params_of(applied))
        assert DELAYED_KEY not in applied_opt.state_dict()["state"][0]


def test_delayed_update_overlaps_the_next_forward_and_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The delayed step runs on the worker thread: step() returns before it is done (here it is
    held until the next forward ran, which sees the params of the step before); the next backward
    waits for it and copies its update into the params as its grads are made."""
    model = Net(torch.float32)
    opt = fusedamp.FusedAdamW(
        model.parameters(), lr=1e-2, offload="cpu", offload_delay=1, offload_delay_warmup=0
    )
    executor = opt._executor
    hold = threading.Event()
    step_round = executor._step_round

    def held(*args: Any) -> None:
        hold.wait()
        step_round(*args)

    monkeypatch.setattr(executor, "_step_round", held)
    before = params_of(model)
    train(model, opt, range(1))
    assert all(slot.busy for slot in executor.slots)  # step() returned, the CPU step waits
    opt.zero_grad()
    loss = loss_of(model, 1)
    assert_same_bits(before, params_of(model))  # the forward saw the params of the step before
    hold.set()
    loss.backward()
    assert not any(slot.busy or slot.behind for slot in executor.slots)
    assert_same_bits([slot.host for slot in executor.slots], params_of(model))
    assert not torch.equal(before[0], params_of(model)[0])


def test_delayed_update_errors() -> None:
    params = list(Net().parameters())
    with pytest.raises(ValueError, match="Invalid offload_delay"):
        fusedamp.FusedAdamW(params, offload="cpu", offload_delay=2)
    with pytest.raises(ValueError, match="need offload='cpu'"):
        fusedamp.FusedSGD(params, offload_delay=1)
    with pytest.raises(ValueError, match="one or the other"):
        fusedamp.FusedAdamW(params, offload="cpu", offload_delay=1, step_in_backward=True)
    with pytest.raises(ValueError, match="offload_delay_warmup"):
        fusedamp.FusedMuon(params[2:3], offload="cpu", offload_delay=1, offload_delay_warmup=-1)
    model = Net()
    opt = fusedamp.FusedAdamW(model.parameters(), offload="cpu", offload_delay=1, offload_delay_warmup=0)
    train(model, opt, range(2))  # one backward per step
    opt.zero_grad()
    loss_of(model, 2).backward()
    with pytest.raises(RuntimeError, match="more than the 1 of the first step"):
        loss_of(model, 3).backward()  # a second backward reads params that took their update


# --- CUDA ------------------------------------------------------------------------------------------


def quadratic_loss(model: nn.Module, step: int) -> Tensor:
    """sum(p * c + p^2 / 2): grads c + p, computed alike (exactly, then rounded alike) on any device."""
    generator = torch.Generator().manual_seed(step)
    total = torch.zeros((), device=next(model.parameters()).device)
    for param in model.parameters():
        coef = (torch.randn(param.shape, generator=generator) * 0.1).to(param.device)
        total = total + (param.float() * coef + param.float().square() * 0.5).sum()
    return total


@needs_cuda
@pytest.mark.parametrize("moments", MOMENTS)
@pytest.mark.parametrize("mode", PARAM_MODES, ids=mode_id)
def test_cuda_delayed_update_is_the_reference_schedule_bitwise(
    mode: tuple[torch.dtype, Any], moments: str
) -> None:
    """A GPU model, delayed offload (the update copied back in backward, on the copy streams):
    each step's params and state are those of the GPU optimizer without offload on the reference
    schedule, bit for bit, run straight through; the pending update too, at the end."""
    dtype, master_weights = mode
    options = {"master_weights": master_weights, "moments": moments, "max_grad_norm": 1.0}
    model = Net(dtype).cuda()
    reference_opt = make_optimizer("adamw", list(model.parameters()), **options)
    reference = DelayedReference(model, reference_opt, warmup=1)
    offloaded = Net(dtype).cuda()
    offloaded_opt = make_optimizer(
        "adamw", list(offloaded.parameters()), offload="cpu", offload_delay=1, offload_delay_warmup=1,
        **options,
    )
    for step in range(5):
        reference.step(step, loss_fn=quadratic_loss)
        offloaded_opt.zero_grad()
        quadratic_loss(offloaded, step).backward()
        offloaded_opt.step()
    assert_like_reference(reference, offloaded, offloaded_opt)
    counts = offloaded_opt._executor.counts
    assert counts["grads copied in backward"] == 6 * 5 and counts["grads copied in step"] == 0
