"""fusedamp.autocast behaves as torch.autocast: defaults, nesting, decorator, errors, compile."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from fusedamp import ops
from fusedamp.autocast import autocast

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def model_and_input(device: str = "cpu") -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).to(device)
    return model, torch.randn(5, 16, device=device)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    """A loss that autocast runs in fp32 on every device."""
    return nn.functional.mse_loss(out, torch.zeros_like(out))


def test_is_a_torch_autocast() -> None:
    assert isinstance(autocast("cpu"), torch.autocast)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16], ids=str)
def test_cpu_regions_match_torch(dtype: torch.dtype | None) -> None:
    model, x = model_and_input()
    with torch.autocast("cpu", dtype=dtype):
        expected = model(x)
        expected_loss = loss_of(expected)
    with autocast("cpu", dtype=dtype):
        out = model(x)
        loss = loss_of(out)
    assert out.dtype == (dtype or torch.bfloat16)
    assert loss.dtype == torch.float32
    assert torch.equal(out, expected)
    assert torch.equal(loss, expected_loss)


def test_default_dtypes() -> None:
    assert autocast("cpu").fast_dtype == torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without a GPU it warns and disables itself
        assert autocast("cuda").fast_dtype == torch.float16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a machine without CUDA")
def test_cuda_without_gpu_warns_and_disables() -> None:
    model, x = model_and_input()
    message = "CUDA is not available or torch_xla is imported. Disabling autocast."
    with pytest.warns(UserWarning, match=message):
        region = autocast("cuda")
    with region:
        assert not torch.is_autocast_enabled("cuda")
        assert model(x).dtype == torch.float32


def test_disabled_and_nested_regions() -> None:
    model, x = model_and_input()
    with autocast("cpu", enabled=False):
        assert model[0](x).dtype == torch.float32
    with autocast("cpu"):
        with autocast("cpu", enabled=False):
            assert model[0](x).dtype == torch.float32
        # Without the cache, which still holds the bf16 weight of the outer region.
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            assert model[0](x).dtype == torch.float16
        assert model[0](x).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def test_state_is_restored_after_an_exception() -> None:
    with pytest.raises(KeyError, match="inside"):
        with autocast("cpu", dtype=torch.float16, cache_enabled=False):
            assert torch.is_autocast_enabled("cpu")
            assert not torch.is_autocast_cache_enabled()
            raise KeyError("inside")
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert torch.is_autocast_cache_enabled()


def test_decorator() -> None:
    model, x = model_and_input()

    @autocast("cpu")
    def forward(inputs: torch.Tensor) -> torch.Tensor:
        """Runs the first layer."""
        return model[0](inputs)

    assert forward(x).dtype == torch.bfloat16
    assert forward.__name__ == "forward" and forward.__doc__ == "Runs the first layer."
    assert not torch.is_autocast_enabled("cpu")


BAD_CALLS = {
    "device_without_autocast": lambda make: make("hip"),
    "device_object": lambda make: make(torch.device("cpu")),
    "not_a_callable": lambda make: make("cpu")(3),
}


@pytest.mark.parametrize("call", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_arguments_fail_like_torch(call) -> None:
    errors = []
    for make in (autocast, torch.autocast):
        with pytest.raises(Exception) as error:
            call(make)
        errors.append((error.type, str(error.value)))
    assert errors[0] == errors[1]


def test_unsupported_dtype_warns_and_disables() -> None:
    with pytest.warns(UserWarning, match="In CPU autocast, but the target dtype is not supported"):
        region = autocast("cpu", dtype=torch.float64)
    with region:
        assert not torch.is_autocast_enabled("cpu")


def test_compiles_without_graph_break() -> None:
    model, x = model_and_input()

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        with autocast("cpu"):
            return model(inputs)

    compiled = torch.compile(forward, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, forward(x))


@needs_cuda
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=str)
def test_cuda_regions_match_torch(dtype: torch.dtype | None) -> None:
    model, x = model_and_input("cuda")
    with torch.autocast("cuda", dtype=dtype):
        expected = model(x)
        expected_loss = loss_of(expected)
    with autocast("cuda", dtype=dtype):
        out = model(x)
        loss = loss_of(out)
    assert out.dtype == (dtype or torch.float16)
    assert loss.dtype == torch.float32
    assert torch.equal(out, expected)
    assert torch.equal(loss, expected_loss)


def test_fused_gemm_routes_linear_and_matmul_through_fusedamp(monkeypatch: pytest.MonkeyPatch) -> None:
    """With fused_gemm=True the region's F.linear and matmul run on ops.gemm (counted
    through a wrapper), with results equal to torch's bf16 autocast up to rounding order."""
    calls = []
    real_gemm = ops.gemm

    def counting_gemm(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(args[0].shape)
        return real_gemm(*args, **kwargs)

    monkeypatch.setattr(ops, "gemm", counting_gemm)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, 24, generator=generator)
    layer = torch.nn.Linear(24, 16)
    other = torch.randn(16, 9, generator=generator)
    with torch.autocast("cpu"):
        expected = layer(x) @ other
    with autocast("cpu", fused_gemm=True):
        routed = layer(x) @ other
    assert len(calls) == 2
    assert routed.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(routed.float(), expected.float(), rtol=2e-2, atol=2e-2)
    with autocast("cpu"):
        layer(x)
    with autocast("cpu", fused_gemm=True, enabled=False):
        layer(x)
    assert len(calls) == 2, "routing must be off by default and when autocast is disabled"
