"""fusedamp.diagnostics (grad_stats per layer and in total against the op table's float64
reference, ScaleHistory, advice) and fusedamp.half_model."""

import pytest
import torch
from op_table import OP_TABLE, stats_grads
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
    """The op table's float64 reference for one grad: (counts, max_abs)."""
    expected = OP_TABLE["grad_stats"].reference([grad], torch.tensor(inv_scale))
    return expected["counts"][0][0].tolist(), expected["max_abs"][0].item()


def random_grads(seed: int) -> list[torch.Tensor]:
    """Every float dtype, an empty tensor, tensors of several CPU chunks (2^15 elements each)."""
    sizes = [1, 1000, 100_003, 4097, 0, 70_000]
    dtypes = [torch.float32, torch.float16, torch.float32, torch.bfloat16, torch.float32, torch.float16]
    return stats_grads(sizes, dtypes, torch.Generator().manual_seed(seed))


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


class ConvNormNet(nn.Module):
    """Conv, batch norm, layer norm and linear layers: what half_model keeps in fp32 or not."""

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
    model = ConvNormNet()
    reference = ConvNormNet()
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
    model = half_model(
        ConvNormNet(), torch.bfloat16, keep_norm_fp32=False, cast_inputs=False, cast_outputs=False
    )
    assert model.bn.weight.dtype == torch.bfloat16 and model.norm.weight.dtype == torch.bfloat16
    out = model(torch.randn(2, 1, 5, 5, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be torch.float16 or torch.bfloat16"):
        half_model(ConvNormNet(), torch.float64)


def test_diagnostics_exports():
    # The thresholds of the op table's grad_stats reference.
    assert FP16_MIN_SUBNORMAL == 2.0**-24 and FP16_MIN_NORMAL == 2.0**-14
    assert diagnostics.FP16_MAX == 65504.0
