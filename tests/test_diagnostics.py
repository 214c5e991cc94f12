"""fusedamp.diagnostics (the grad_stats op against plain PyTorch, ScaleHistory, advice) and
fusedamp.half_model."""

import pytest
import torch
from torch import nn

from fusedamp import diagnostics
from fusedamp.diagnostics import (
    FP16_MIN_NORMAL,
    FP16_MIN_SUBNORMAL,
    LayerStats,
    ScaleHistory,
    advice,
    grad_stats,
)
from fusedamp.precision import half_model


def reference_stats(grad: torch.Tensor, inv_scale: float) -> tuple[list[int], float]:
    """The same statistics in float64 plain PyTorch."""
    value = grad.double()
    finite = torch.isfinite(value)
    # The op multiplies in fp32: do the same before comparing with the thresholds.
    magnitude = (grad.float() * torch.tensor(inv_scale, dtype=torch.float32)).double().abs()
    magnitude = torch.where(finite, magnitude, 0.0)
    nonzero = magnitude > 0
    counts = [
        int((nonzero & (magnitude < FP16_MIN_SUBNORMAL)).sum()),
        int((nonzero & (magnitude < FP16_MIN_NORMAL)).sum()),
        int((~finite).sum()),
    ]
    return counts, float(magnitude.max()) if magnitude.numel() else 0.0


def random_grads(seed: int) -> list[torch.Tensor]:
    # Magnitudes log-uniform over 2^-34 .. 2^6, random signs, some exact zeros and non-finites,
    # in every float dtype; one tensor spans several CPU chunks (2^15 elements each).
    generator = torch.Generator().manual_seed(seed)
    grads = []
    for numel, dtype in (
        (1, torch.float32),
        (1000, torch.float16),
        (100_003, torch.float32),
        (4097, torch.bfloat16),
        (0, torch.float32),
        (70_000, torch.float16),
    ):
        exponent = torch.rand(numel, generator=generator, dtype=torch.float64) * 40 - 34
        sign = torch.where(torch.rand(numel, generator=generator) < 0.5, -1.0, 1.0).double()
        values = sign * torch.exp2(exponent)
        values[torch.rand(numel, generator=generator) < 0.05] = 0.0
        special = torch.rand(numel, generator=generator)
        values[special < 0.002] = float("inf")
        values[(special >= 0.002) & (special < 0.003)] = float("nan")
        values[(special >= 0.003) & (special < 0.004)] = -float("inf")
        grads.append(values.to(dtype))
    return grads


@pytest.mark.parametrize("inv_scale", [None, 1.0, 2.0**-16, 8.0])
def test_grad_stats_matches_plain_pytorch(inv_scale):
    grads = random_grads(0)
    stats = grad_stats(grads, inv_scale=inv_scale)
    multiplier = 1.0 if inv_scale is None else inv_scale
    for layer, grad in zip(stats.layers(), grads, strict=True):
        counts, max_abs = reference_stats(grad, multiplier)
        assert layer.numel == grad.numel()
        assert [
            round(layer.underflow_fp16 * max(grad.numel(), 1)),
            round(layer.subnormal_fp16 * max(grad.numel(), 1)),
            layer.non_finite,
        ] == counts
        assert layer.max_abs == pytest.approx(max_abs, rel=1e-6)
    total = stats.total()
    everything = torch.cat([g.double() for g in grads])
    counts, max_abs = reference_stats(everything, multiplier)
    assert total.numel == everything.numel()
    assert round(total.underflow_fp16 * total.numel) == counts[0]
    assert total.non_finite == counts[2]
    assert total.max_abs == pytest.approx(max_abs, rel=1e-6)
    assert float(stats.underflow_fraction()) == pytest.approx(total.underflow_fp16, rel=1e-6)


def test_grad_stats_raw_op_counts_and_tensor_inv_scale():
    grad = torch.tensor([0.0, 2.0**-25, 2.0**-20, 1.0, -3.0, float("nan")])
    counts, max_abs = torch.ops.fusedamp.grad_stats([grad], torch.tensor(1.0))
    assert counts.tolist() == [[1, 2, 1]] and counts.dtype == torch.int64
    assert max_abs.tolist() == [3.0] and max_abs.dtype == torch.float32
    # Scaled by 2^10, then unscaled by the op: the same answer.
    counts, max_abs = torch.ops.fusedamp.grad_stats([grad * 1024], torch.tensor([2.0**-10]))
    assert counts.tolist() == [[1, 2, 1]] and max_abs.tolist() == [3.0]


def test_grad_stats_reads_channels_last_grads():
    grad = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last) * 1e-8
    counts, max_abs = torch.ops.fusedamp.grad_stats([grad], None)
    expected, largest = reference_stats(grad.contiguous(), 1.0)
    assert counts.tolist() == [expected] and max_abs.item() == pytest.approx(largest)


def test_grad_stats_opcheck():
    grads = [torch.randn(10), torch.randn(3, 4).half(), torch.randn(5).bfloat16()]
    torch.library.opcheck(torch.ops.fusedamp.grad_stats, (grads, torch.tensor(0.5)))
    torch.library.opcheck(torch.ops.fusedamp.grad_stats, (grads, None))


@pytest.mark.parametrize(
    "grads, inv_scale, error, message",
    [
        ([torch.zeros(3, dtype=torch.int32)], None, TypeError, r"grads\[0\] has dtype Int"),
        (
            [torch.zeros(3), torch.zeros(8)[::2]],
            None,
            RuntimeError,
            r"grads\[1\] has gaps or overlaps in memory",
        ),
        ([torch.zeros(3)], torch.tensor(1.0, dtype=torch.float64), TypeError, "inv_scale must be a float32"),
        ([torch.zeros(3)], torch.ones(2), RuntimeError, "inv_scale must hold exactly one element"),
    ],
)
def test_grad_stats_rejects_bad_inputs(grads, inv_scale, error, message):
    with pytest.raises(error, match=message):
        torch.ops.fusedamp.grad_stats(grads, inv_scale)


def test_grad_stats_of_a_module_names_layers_and_skips_missing_grads():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model[0].weight.requires_grad_(False)
    model(torch.randn(5, 4)).sum().backward()
    stats = grad_stats(model)
    assert [layer.name for layer in stats.layers()] == ["0.bias", "1.weight", "1.bias"]
    assert stats.total().numel == 3 + 6 + 2
    empty = grad_stats(nn.Linear(2, 2))
    assert empty.layers() == [] and empty.total().numel == 0
    assert float(empty.underflow_fraction()) == 0.0


def test_scale_history_infers_or_takes_skipped_steps():
    history = ScaleHistory(initial_scale=1024.0)
    for scale in (512.0, 512.0, 1024.0, 256.0):
        history.record(torch.tensor(scale))
    assert history.scales() == [512.0, 512.0, 1024.0, 256.0]
    assert history.skipped() == [True, False, False, True]
    assert history.num_skipped() == 2 and len(history) == 4
    given = ScaleHistory()
    given.record(torch.tensor(8.0), torch.tensor(True))
    given.record(8.0, False)
    given.record(4.0)
    assert given.skipped() == [True, False, True]


def test_scale_history_copies_the_tensor_it_records():
    scale = torch.tensor(4.0)
    history = ScaleHistory()
    history.record(scale)
    scale.fill_(1.0)
    assert history.scales() == [4.0]


def test_advice_reflects_the_statistics():
    underflowing = advice(LayerStats("total", 100, 0.25, 0.5, 0, 2.0), scale=65536.0)
    assert underflowing[0].startswith("fp16 needs a loss scaler here: 25.00%")
    assert any("overflow at loss scale 65536" in line for line in underflowing)
    assert any(line.startswith("bf16 would not overflow") for line in underflowing)
    clean = advice(LayerStats("total", 100, 0.0, 0.0, 0, 1e-3))
    assert clean[0].startswith("fp16 would lose only 0.00%")
    assert not any("overflow at loss scale" in line for line in clean)
    huge = advice(LayerStats("total", 100, 0.0, 0.0, 3, 1e6))
    assert any("fp16 overflows even unscaled" in line for line in huge)
    assert any("3 gradient values are inf/NaN" in line for line in huge)
    assert not any(line.startswith("bf16 would not overflow") for line in huge)
    grads = [torch.full((10,), 1e-9)]
    assert advice(grad_stats(grads))[0].startswith("fp16 needs a loss scaler here: 100.00%")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.norm = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x, *, shift=None):
        features = self.bn(self.conv(x)).mean(dim=(2, 3))
        if shift is not None:
            features = features + shift
        return self.fc(self.norm(features))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_model_keeps_norms_fp32_and_trains(dtype):
    torch.manual_seed(0)
    model = Net()
    reference = Net()
    reference.load_state_dict(model.state_dict())
    conv_weight = model.conv.weight
    assert half_model(model, dtype) is model
    assert model.conv.weight is conv_weight  # optimizers built before would still see it
    assert model.conv.weight.dtype == dtype and model.fc.bias.dtype == dtype
    for norm in (model.bn, model.norm):
        assert all(p.dtype == torch.float32 for p in norm.parameters())
    assert model.bn.running_mean.dtype == torch.float32
    assert model.bn.num_batches_tracked.dtype == torch.int64
    x = torch.randn(6, 1, 5, 5)
    out = model(x, shift=torch.randn(6, 4))
    assert out.dtype == torch.float32
    out.sum().backward()
    assert model.conv.weight.grad.dtype == dtype and model.bn.weight.grad.dtype == torch.float32
    # Same weights, half precision: the outputs agree to half-precision accuracy.
    torch.testing.assert_close(model(x), reference(x), atol=0.1, rtol=0.1)


def test_half_model_options():
    model = half_model(Net(), torch.bfloat16, keep_norm_fp32=False, cast_inputs=False, cast_outputs=False)
    assert model.bn.weight.dtype == torch.bfloat16 and model.norm.weight.dtype == torch.bfloat16
    out = model(torch.randn(2, 1, 5, 5, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be torch.float16 or torch.bfloat16"):
        half_model(Net(), torch.float64)


def test_diagnostics_exports():
    assert diagnostics.FP16_MIN_SUBNORMAL == 2.0**-24 and diagnostics.FP16_MAX == 65504.0
