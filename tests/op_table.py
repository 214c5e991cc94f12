"""One entry per fusedamp op: samples, float64 reference, mutated args, tolerances, bad inputs."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import fusedamp  # noqa: F401  (registers torch.ops.fusedamp)

Args = tuple[Any, ...]
# Every output of an op call as a list of tensors, by name: a mutated argument (a list, a
# tensor, or nothing for an absent optional one) or a returned tensor.
Outputs = dict[str, list[Tensor]]

HALF_DTYPES = (torch.float16, torch.bfloat16)
FLOAT_DTYPES = (torch.float32, *HALF_DTYPES)


@dataclass(frozen=True)
class Tol:
    rtol: float
    atol: float


EXACT = Tol(0.0, 0.0)
# One ulp of the dtype (relative), the most that one rounding to it, plus fp32 error, may cost.
ONE_ULP = {torch.float16: Tol(2.0**-10, 1e-5), torch.bfloat16: Tol(2.0**-7, 1e-5)}


@dataclass(frozen=True)
class Sample:
    name: str
    args: Args  # the op's positional arguments, in schema order


@dataclass(frozen=True)
class BadInput:
    name: str
    make_args: Callable[[], Args]  # fresh tensors per call; CUDA ones only built on a GPU
    error: type[Exception]
    message: str  # a fragment of the message, matched literally
    device: str = "cpu"


@dataclass(frozen=True)
class OpEntry:
    name: str
    dtypes: tuple[torch.dtype, ...]  # the dtype axis of the samples (of params, grads, operands)
    samples: Callable[[str, torch.dtype], list[Sample]]  # (device, dtype) -> samples
    reference: Callable[..., Outputs]  # float64 (or exact integer) results from the CPU args
    mutates: tuple[str, ...]  # the schema arguments the op writes
    tolerances: Mapping[str, Tol | Mapping[torch.dtype, Tol]]  # per output, per output dtype
    bad_inputs: tuple[BadInput, ...]
    devices: tuple[str, ...] = ("cpu", "cuda")
    uses_cpu_isa: bool = False  # whether the CPU kernel comes in AVX-512 / AVX2 / baseline builds
    returns: tuple[str, ...] = ()  # names of the returned tensors
    observe: Callable[[Args, Any], Outputs] | None = None  # default: mutated args and returns
    invariants: Callable[[Args, Any], None] | None = None  # checks beyond the reference
    notes: str = ""

    @property
    def op(self) -> torch._ops.OpOverload:
        return getattr(torch.ops.fusedamp, self.name).default

    def call(self, args: Args) -> Any:
        return self.op(*args)

    def outputs(self, args: Args, returned: Any) -> Outputs:
        if self.observe is not None:
            return self.observe(args, returned)
        names = [argument.name for argument in self.op._schema.arguments]
        result = {name: as_list(args[names.index(name)]) for name in self.mutates}
        values = () if returned is None else returned if isinstance(returned, tuple) else (returned,)
        result.update({name: [value] for name, value in zip(self.returns, values, strict=True)})
        return result


def as_list(value: Any) -> list[Tensor]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


# --- shared helpers ---------------------------------------------------------------------------


def schema_args(op: str, **named: Any) -> Args:
    """The positional arguments of ``torch.ops.fusedamp.<op>`` from keywords (schema defaults
    fill the rest)."""
    args = []
    for argument in getattr(torch.ops.fusedamp, op).default._schema.arguments:
        if argument.name in named:
            args.append(named.pop(argument.name))
        elif argument.has_default_value():
            args.append(argument.default_value)
        else:
            raise TypeError(f"{op}: missing argument {argument.name}")
    if named:
        raise TypeError(f"{op}: unknown arguments {sorted(named)}")
    return tuple(args)


def tensors_in(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors_in(item)


def map_tensors(value: Any, function: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(value, Tensor):
        return function(value)
    if isinstance(value, list):
        return [map_tensors(item, function) for item in value]
    if isinstance(value, tuple):
        return tuple(map_tensors(item, function) for item in value)
    return value


def clone_args(args: Args) -> Args:
    """Copies of every tensor (same strides for dense ones, requires_grad kept)."""
    return map_tensors(args, lambda t: t.detach().clone().requires_grad_(t.requires_grad))


def to_device(args: Args, device: str) -> Args:
    return map_tensors(args, lambda t: t.detach().to(device).requires_grad_(t.requires_grad))


def as_bytes(tensor: Tensor) -> Tensor:
    dense = tensor.detach().to_dense() if tensor.layout != torch.strided else tensor.detach()
    return dense.cpu().contiguous().reshape(-1).view(torch.uint8)


def snapshot(args: Args) -> list[Tensor]:
    return [as_bytes(tensor).clone() for tensor in tensors_in(args)]


def assert_unchanged(before: list[Tensor], args: Args) -> None:
    """Every tensor in ``args`` holds the bytes it held at ``snapshot`` (NaN payloads included)."""
    after = list(tensors_in(args))
    assert len(before) == len(after)
    for index, (old, new) in enumerate(zip(before, after, strict=True)):
        assert torch.equal(old, as_bytes(new)), f"tensor argument {index} was written"


def assert_outputs_close(entry: OpEntry, actual: Outputs, expected: Outputs, factor: float = 1.0) -> None:
    """``actual`` matches ``expected`` output by output within the entry's tolerances (times
    ``factor``). Expected float64 tensors are unrounded results; any other dtype must match."""
    assert actual.keys() == expected.keys() == entry.tolerances.keys()
    for name, spec in entry.tolerances.items():
        assert len(actual[name]) == len(expected[name]), name
        for index, (got, want) in enumerate(zip(actual[name], expected[name], strict=True)):
            where = f"{entry.name}: {name}[{index}]"
            got, want = got.detach().cpu(), want.detach().cpu()
            assert got.shape == want.shape, where
            if want.dtype != torch.float64:
                assert got.dtype == want.dtype, where
            if not got.is_floating_point():
                assert torch.equal(got, want), where
                continue
            tol = spec if isinstance(spec, Tol) else spec[got.dtype]
            torch.testing.assert_close(
                got.double(),
                want.double(),
                rtol=tol.rtol * factor,
                atol=tol.atol * factor,
                equal_nan=True,
                msg=lambda message, where=where: f"{where}: {message}",
            )


def read_only_tensors(entry: OpEntry, args: Args) -> list[Tensor]:
    """The tensors of the arguments the schema does not let the op write."""
    arguments = entry.op._schema.arguments
    return [
        tensor
        for argument, value in zip(arguments, args, strict=True)
        if not (argument.alias_info is not None and argument.alias_info.is_write)
        for tensor in tensors_in(value)
    ]


def assert_matches_reference(entry: OpEntry, args: Args, expected: Outputs | None = None) -> tuple[Args, Any]:
    """Runs the op on copies of ``args``: its outputs match the float64 reference (``expected``
    when given: the reference of ``args``), its invariants hold and it writes no argument it does
    not mutate. Returns (the copies, the op's result)."""
    if expected is None:
        expected = entry.reference(*clone_args(args))
    args = clone_args(args)
    read_only = read_only_tensors(entry, args)
    before = snapshot(tuple(read_only))
    returned = entry.call(args)
    assert_outputs_close(entry, entry.outputs(args, returned), expected)
    if entry.invariants is not None:
        entry.invariants(args, returned)
    assert_unchanged(before, tuple(read_only))
    return args, returned


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(
    shape: int | tuple[int, ...], dtype: torch.dtype, generator: torch.Generator, scale: float = 1.0
) -> Tensor:
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


def _scalar(value: float, device: str = "cpu") -> Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def _int32(value: int, device: str = "cpu") -> Tensor:
    return torch.tensor(value, dtype=torch.int32, device=device)


def _other_dtypes(dtype: torch.dtype) -> list[torch.dtype]:
    return [other for other in FLOAT_DTYPES if other != dtype]


MANY = 45  # "many tensors": more than 40 in one call


def _many_sizes(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 21) for _ in range(MANY)]


def _split_bits(master: Tensor) -> tuple[Tensor, Tensor]:
    """[note: remainder encoding] on int64 bit patterns: (bf16 param bits, int16 remainder)."""
    bits = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    nan = master.isnan()
    high = torch.where(nan, (bits >> 16) | 0x40, (bits + 0x8000) >> 16) & 0xFFFF
    remainder = torch.where(nan, 0, bits - (high << 16)) & 0xFFFF
    return _to_int16(high), _to_int16(remainder)


def _to_int16(values: Tensor) -> Tensor:
    return ((values ^ 0x8000) - 0x8000).to(torch.int16)


def _join_bits(param: Tensor, remainder: Tensor) -> Tensor:
    """The fp32 master bits a bf16 param and its int16 remainder encode, as int32."""
    high = param.view(torch.int16).to(torch.int64) & 0xFFFF
    bits = ((high << 16) + remainder.to(torch.int64)) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def master_value(param: Tensor, master: Tensor | None) -> Tensor:
    """The fp32 value an optimizer updates: the param, its fp32 master, or param + remainder."""
    if master is None:
        return param.detach().float()
    if master.dtype == torch.int16:
        return _join_bits(param.detach().cpu(), master.cpu()).view(torch.float32).to(param.device)
    return master.detach()


# --- unscale_ and check_and_norm_ -------------------------------------------------------------


def _grad_lists(dtype: torch.dtype) -> dict[str, list[Tensor]]:
    """Grads of magnitude up to ~1e3 (finite in fp16): odd sizes (65537 spans three CPU chunks of
    2^15 and two CUDA blocks of 2^16), an empty tensor among others, only empty tensors (no
    chunk, no CUDA block: the sum of squares must stay as it was), no tensor at all, many small
    tensors, three dtypes in one list, and inf, -inf and NaN (one at a chunk boundary)."""
    generator = _generator(int(dtype.itemsize) * 7 + (dtype == torch.bfloat16))

    def grads(sizes: list[int], dtypes: list[torch.dtype] | None = None) -> list[Tensor]:
        dtypes = dtypes or [dtype] * len(sizes)
        return [_randn(size, d, generator, 300.0) for size, d in zip(sizes, dtypes, strict=True)]

    non_finite = grads([33, 65537, 7])
    non_finite[1][40000] = math.inf
    non_finite[1][32768] = math.nan
    non_finite[0][32] = -math.inf
    minus_inf = grads([7, 129])
    minus_inf[1][128] = -math.inf
    others = _other_dtypes(dtype)
    return {
        "odd_sizes": grads([1, 7, 65537]),
        "empty_tensor": grads([0, 5, 0, 0, 33, 0]),
        "only_empty_tensors": grads([0, 0, 0]),
        "no_tensors": [],
        f"{MANY}_tensors": grads(_many_sizes(1)),
        "mixed_dtypes": grads([257, 31, 9, 3], [dtype, *others, dtype]),
        "inf_nan": non_finite,
        "minus_inf": minus_inf,
    }


# found_inf before the call: 2.5 stands for a value set elsewhere (another device's count); the
# op leaves it as it was when every grad is finite and sets it to 1 otherwise.
_FOUND_INF_BEFORE = {"no_tensors": 2.5, f"{MANY}_tensors": 2.5, "inf_nan": 2.5}


def _unscale_samples(device: str, dtype: torch.dtype) -> list[Sample]:
    inv_scale = 1.0 / 3000.0  # not a power of two: every product is rounded
    return [
        Sample(
            name, to_device((grads, _scalar(_FOUND_INF_BEFORE.get(name, 0.0)), _scalar(inv_scale)), device)
        )
        for name, grads in _grad_lists(dtype).items()
    ]


def _found_inf_after(grads: list[Tensor], found_inf: Tensor) -> Tensor:
    non_finite = any(not grad.isfinite().all() for grad in grads)
    return _scalar(1.0) if non_finite else found_inf.detach().cpu().clone()


def _unscale_reference(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> Outputs:
    # One fp32 product (exact in float64: 24 x 24 bits), rounded to fp32, then to the grad dtype.
    unscaled = [(grad.double() * inv_scale.double()).float().to(grad.dtype) for grad in grads]
    return {"grads": unscaled, "found_inf": [_found_inf_after(grads, found_inf)]}


def _check_and_norm_samples(device: str, dtype: torch.dtype) -> list[Sample]:
    # (sum_of_squares before, inv_scale); None: the optional argument absent.
    options = {"empty_tensor": (None, None), f"{MANY}_tensors": (0.25, None), "minus_inf": (None, 1 / 700)}
    samples = []
    for name, grads in _grad_lists(dtype).items():
        total, inv = options.get(name, (0.25, 1.0 / 700.0))
        args = (
            grads,
            _scalar(_FOUND_INF_BEFORE.get(name, 0.0)),
            None if total is None else _scalar(total),
            None if inv is None else _scalar(inv),
        )
        samples.append(Sample(name, to_device(args, device)))
    return samples


def _check_and_norm_reference(
    grads: list[Tensor], found_inf: Tensor, sum_of_squares: Tensor | None, inv_scale: Tensor | None
) -> Outputs:
    result = {"found_inf": [_found_inf_after(grads, found_inf)], "sum_of_squares": []}
    if sum_of_squares is not None:
        multiplier = _scalar(1.0) if inv_scale is None else inv_scale.float()
        total = sum(float((grad.float() * multiplier).double().square().sum()) for grad in grads)
        result["sum_of_squares"] = [torch.tensor(sum_of_squares.item() + total, dtype=torch.float64)]
    return result


def _bad_amp_inputs(op: str) -> list[BadInput]:
    """What unscale_ and check_and_norm_ both refuse (the list is made last, as a kernel that
    started before checking would write the first grads)."""

    def args(grads: list[Tensor], found_inf: Tensor | None = None, scale: Tensor | None = None) -> Args:
        found_inf = _scalar(0.0) if found_inf is None else found_inf
        scale = _scalar(0.5) if scale is None else scale
        if op == "unscale_":
            return (grads, found_inf, scale)
        return (grads, found_inf, _scalar(0.25, found_inf.device.type), scale)

    def grad() -> Tensor:
        return torch.randn(3) + 2.0

    return [
        BadInput(
            "int_grad",
            lambda: args([grad(), torch.ones(3, dtype=torch.int32)]),
            TypeError,
            f"{op}: grads[1] has dtype Int; expected float32, float16 or bfloat16",
        ),
        BadInput(
            "float64_grad",
            lambda: args([grad(), torch.ones(3, dtype=torch.float64)]),
            TypeError,
            f"{op}: grads[1] has dtype Double",
        ),
        BadInput(
            "complex_grad",
            lambda: args([grad(), torch.ones(3, dtype=torch.complex64)]),
            TypeError,
            f"{op}: grads[1] has dtype ComplexFloat",
        ),
        BadInput(
            "half_found_inf",
            lambda: args([grad()], found_inf=torch.zeros((), dtype=torch.half)),
            TypeError,
            f"{op}: found_inf must be a float32 tensor, got Half",
        ),
        BadInput(
            "two_element_found_inf",
            lambda: args([grad()], found_inf=torch.zeros(2)),
            RuntimeError,
            f"{op}: found_inf must hold exactly one element, got shape [2]",
        ),
        BadInput(
            "two_element_inv_scale",
            lambda: args([grad()], scale=torch.ones(2)),
            RuntimeError,
            f"{op}: inv_scale must hold exactly one element, got shape [2]",
        ),
        BadInput(
            "float64_inv_scale",
            lambda: args([grad()], scale=torch.ones((), dtype=torch.float64)),
            TypeError,
            f"{op}: inv_scale must be a float32 tensor, got Double",
        ),
        BadInput(
            "overlapping_grad",
            lambda: args([grad(), torch.randn(1, 4).expand(4, 4)]),
            RuntimeError,
            f"{op}: grads[1] has gaps or overlaps in memory (sizes [4, 4], strides [0, 1])",
        ),
        BadInput(
            "grad_with_gaps",
            lambda: args([grad(), torch.randn(8)[::2]]),
            RuntimeError,
            f"{op}: grads[1] has gaps or overlaps in memory (sizes [4], strides [2])",
        ),
        BadInput(
            "sparse_grad",
            lambda: args([torch.randn(3).to_sparse()]),
            NotImplementedError,
            f"Could not run 'fusedamp::{op}' with arguments from the 'SparseCPU' backend",
        ),
        BadInput(
            "grad_on_another_device",
            lambda: args(
                [torch.randn(3, device="cuda"), torch.randn(3)],
                _scalar(0.0, "cuda"),
                _scalar(0.5, "cuda"),
            ),
            RuntimeError,
            f"{op}: grads[1] is on cpu, expected cuda:0",
            device="cuda",
        ),
        BadInput(
            "grads_on_cpu_scalars_on_cuda",
            lambda: args([torch.randn(3)], _scalar(0.0, "cuda"), _scalar(0.5, "cuda")),
            RuntimeError,
            f"{op}: grads[0] is on cpu, expected cuda:0",
            device="cuda",
        ),
    ]


def _shared_grads() -> Args:
    shared = torch.randn(3)
    return ([shared, torch.randn(2), shared], _scalar(0.0), _scalar(0.5))


def _found_inf_in_a_grad() -> Args:
    grad = torch.randn(3)
    return ([grad], grad[:1], _scalar(0.5))


def _found_inf_is_sum_of_squares() -> Args:
    flag = _scalar(0.0)
    return ([torch.randn(3)], flag, flag, None)


UNSCALE = OpEntry(
    name="unscale_",
    dtypes=FLOAT_DTYPES,
    samples=_unscale_samples,
    reference=_unscale_reference,
    mutates=("grads", "found_inf"),
    tolerances={"grads": EXACT, "found_inf": EXACT},
    bad_inputs=(
        *_bad_amp_inputs("unscale_"),
        BadInput("grad_twice", _shared_grads, RuntimeError, "unscale_: grads[0] and grads[2] share memory"),
        BadInput(
            "found_inf_in_a_grad",
            _found_inf_in_a_grad,
            RuntimeError,
            "unscale_: grads[0] and found_inf share memory",
        ),
    ),
    uses_cpu_isa=True,
    notes="Grads may mix fp32, fp16 and bf16; every product is rounded once, so results are exact.",
)

CHECK_AND_NORM = OpEntry(
    name="check_and_norm_",
    dtypes=FLOAT_DTYPES,
    samples=_check_and_norm_samples,
    reference=_check_and_norm_reference,
    mutates=("found_inf", "sum_of_squares"),
    # fp32 sums per chunk (per SIMD lane on CPU): the error grows like sqrt(terms per lane) ulps.
    tolerances={"found_inf": EXACT, "sum_of_squares": Tol(1e-5, 1e-6)},
    bad_inputs=(
        *_bad_amp_inputs("check_and_norm_"),
        BadInput(
            "int64_sum_of_squares",
            lambda: ([torch.randn(3)], _scalar(0.0), torch.zeros((), dtype=torch.int64), None),
            TypeError,
            "check_and_norm_: sum_of_squares must be a float32 tensor, got Long",
        ),
        BadInput(
            "two_element_sum_of_squares",
            lambda: ([torch.randn(3)], _scalar(0.0), torch.zeros(2), None),
            RuntimeError,
            "check_and_norm_: sum_of_squares must hold exactly one element, got shape [2]",
        ),
        BadInput(
            "found_inf_is_sum_of_squares",
            _found_inf_is_sum_of_squares,
            RuntimeError,
            "check_and_norm_: found_inf and sum_of_squares share memory",
        ),
    ),
    uses_cpu_isa=True,
    notes="Read-only on the grads (the driver checks every argument it does not mutate).",
)


# --- update_scale_ ----------------------------------------------------------------------------


def _update_scale_samples(device: str, dtype: torch.dtype) -> list[Sample]:
    def sample(name: str, state: tuple[float, int, int], found_inf: float, **config: Any) -> Sample:
        scale, growth, left = state
        config = {
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 3,
            "hysteresis": 1,
            "min_scale": 0.0,
            "max_scale": math.inf,
            **config,
        }
        args = schema_args(
            "update_scale_",
            scale=_scalar(scale, device),
            growth_tracker=_int32(growth, device),
            hysteresis_tracker=_int32(left, device),
            found_inf=_scalar(found_inf, device),
            **config,
        )
        return Sample(name, args)

    return [
        sample("counts_a_clean_step", (1024.0, 0, 1), 0.0),
        sample("grows_and_refills_hysteresis", (1024.0, 2, 1), 0.0, hysteresis=3),
        # float32 cannot hold 1.7: torch multiplies by the double and rounds once.
        sample("grows_by_a_factor_fp32_cannot_hold", (12345.678, 2, 1), 0.0, growth_factor=1.7),
        sample("growth_capped_at_max_scale", (3000.0, 2, 1), 0.0, max_scale=4096.0),
        sample("growth_to_inf_keeps_the_scale", (3.0e38, 2, 1), 0.0),
        sample("backs_off", (1000.0, 2, 1), 1.0, backoff_factor=0.3),
        sample("backoff_floored_at_min_scale", (300.0, 0, 1), 1.0, min_scale=200.0),
        sample("hysteresis_absorbs_an_overflow", (1024.0, 2, 3), 3.0, hysteresis=3),
        # [note: found_inf]: any value but 0 is an overflow (a NaN summed into a count too).
        sample("nan_found_inf_backs_off", (1024.0, 5, 1), math.nan, growth_interval=6),
        sample("negative_found_inf_backs_off", (1024.0, 5, 1), -1.0, growth_interval=6),
    ]


def _to_f32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float64).float().item()


def _update_scale_reference(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
) -> Outputs:
    """torch._amp_update_scale_'s rule (the fp32 scale times the float64 factor, rounded once)
    with hysteresis and bounds, math/scale.h."""
    value, tracker, left = scale.item(), int(growth_tracker.item()), int(hysteresis_tracker.item())
    if found_inf.item() != 0.0:
        tracker, left = 0, max(left - 1, 0)
        if left == 0:
            value = max(_to_f32(value * backoff_factor), _to_f32(min_scale))
    elif tracker + 1 < growth_interval:
        tracker += 1
    else:
        grown = min(_to_f32(value * growth_factor), _to_f32(max_scale))
        value = grown if math.isfinite(grown) else value
        tracker, left = 0, hysteresis
    return {
        "scale": [_scalar(value)],
        "growth_tracker": [_int32(tracker)],
        "hysteresis_tracker": [_int32(left)],
    }


def _update_scale_args(**changes: Any) -> Callable[[], Args]:
    def make() -> Args:
        named = {
            "scale": _scalar(1024.0),
            "growth_tracker": _int32(1),
            "hysteresis_tracker": _int32(2),
            "found_inf": _scalar(0.0),
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 10,
            "hysteresis": 2,
            "min_scale": 0.0,
            "max_scale": math.inf,
        }
        named.update({key: value() if callable(value) else value for key, value in changes.items()})
        return schema_args("update_scale_", **named)

    return make


def _one_tracker_twice() -> Args:
    tracker = _int32(1)
    return _update_scale_args(growth_tracker=lambda: tracker, hysteresis_tracker=lambda: tracker)()


UPDATE_SCALE = OpEntry(
    name="update_scale_",
    dtypes=(torch.float32,),
    samples=_update_scale_samples,
    reference=_update_scale_reference,
    mutates=("scale", "growth_tracker", "hysteresis_tracker"),
    tolerances={"scale": EXACT, "growth_tracker": EXACT, "hysteresis_tracker": EXACT},
    bad_inputs=(
        BadInput(
            "float_growth_tracker",
            _update_scale_args(growth_tracker=lambda: torch.zeros(())),
            TypeError,
            "update_scale_: growth_tracker must be a one-element int32 tensor, got Float",
        ),
        BadInput(
            "float_hysteresis_tracker",
            _update_scale_args(hysteresis_tracker=lambda: torch.ones(())),
            TypeError,
            "update_scale_: hysteresis_tracker must be a one-element int32 tensor, got Float",
        ),
        BadInput(
            "float64_scale",
            _update_scale_args(scale=lambda: torch.ones((), dtype=torch.float64)),
            TypeError,
            "update_scale_: scale must be a float32 tensor, got Double",
        ),
        BadInput(
            "two_element_scale",
            _update_scale_args(scale=lambda: torch.ones(2)),
            RuntimeError,
            "update_scale_: scale must hold exactly one element, got shape [2]",
        ),
        BadInput(
            "int_found_inf",
            _update_scale_args(found_inf=lambda: _int32(1)),
            TypeError,
            "update_scale_: found_inf must be a float32 tensor, got Int",
        ),
        BadInput(
            "zero_growth_interval",
            _update_scale_args(growth_interval=0, hysteresis=1),
            ValueError,
            "growth_interval and hysteresis must be positive, got 0 and 1",
        ),
        BadInput(
            "zero_hysteresis",
            _update_scale_args(hysteresis=0),
            ValueError,
            "growth_interval and hysteresis must be positive, got 10 and 0",
        ),
        BadInput(
            "nan_backoff_factor",
            _update_scale_args(backoff_factor=math.nan),
            ValueError,
            "update_scale_: backoff_factor is nan; it must be a finite number",
        ),
        BadInput(
            "negative_growth_factor",
            _update_scale_args(growth_factor=-2.0),
            ValueError,
            "update_scale_: growth_factor is -2; it must be positive",
        ),
        BadInput(
            "min_scale_above_max_scale",
            _update_scale_args(min_scale=2.0, max_scale=1.0),
            ValueError,
            "update_scale_: min_scale (2) must not exceed max_scale (1)",
        ),
        BadInput("one_tracker_twice", _one_tracker_twice, RuntimeError, "share memory"),
    ),
    notes="Scalar state only: no sizes, empty tensors, tensor lists or dtypes besides float32 apply.",
)


# --- adamw_ and sgd_ --------------------------------------------------------------------------


@dataclass
class OptimizerSample:
    """The tensors and options of one optimizer call, before they become the op's arguments."""

    sizes: list[int]
    param_dtype: torch.dtype
    seed: int
    grad_dtype: torch.dtype | None = None  # default: the param dtype
    master: str | None = "default"  # None, "fp32" or "remainder"; default: fp32 for half params
    lr: float = 1e-2
    lr_tensor: str | None = None  # None, "device" or "cpu" (a host lr drives a step on any device)
    amp: dict[str, float] = field(default_factory=dict)  # inv_grad_scale, found_inf, clip_coef
    maximize: bool = False
    write_unscaled_grads: bool = True
    moments: str = "fp32"  # the state codec: fp32, bf16 or int8 ([note: state codecs])
    stochastic: bool = False  # half params without masters, rounded stochastically

    def tensors(self, states: int) -> dict[str, list[Tensor]]:
        generator = _generator(self.seed)
        grad_dtype = self.grad_dtype or self.param_dtype
        master = self.master
        if master == "default":
            master = None if self.param_dtype == torch.float32 else "fp32"
        fp32 = [_randn(size, torch.float32, generator) for size in self.sizes]
        params = [value.to(self.param_dtype) for value in fp32]
        masters: list[Tensor] = []
        if master == "fp32":
            masters = fp32
        elif master == "remainder":
            masters = [
                torch.randint(-(2**15), 2**15, (size,), generator=generator, dtype=torch.int16)
                for size in self.sizes
            ]
        moments = [
            [_randn(size, torch.float32, generator, 0.1) for size in self.sizes],
            [_randn(size, torch.float32, generator, 0.3).square() for size in self.sizes],
        ]
        # amsgrad's running max: above the new second moment in some places, below in others.
        moments.append([v * (0.5 + torch.rand(v.shape, generator=generator)) for v in moments[1]])
        return {
            "params": params,
            "grads": [_randn(size, grad_dtype, generator) for size in self.sizes],
            "masters": masters,
            "states": moments[:states],
            # The count before this step: 0 is the first step (SGD: the buffer becomes the grad).
            "steps": [_scalar(float((3 * index) % 10)) for index in range(len(self.sizes))],
        }

    def scalars(self, device: str) -> dict[str, Any]:
        """The op's arguments besides the lists and the optimizer's own hyperparameters."""
        named: dict[str, Any] = {name: None for name in ("inv_grad_scale", "found_inf", "clip_coef")}
        named.update({name: _scalar(value, device) for name, value in self.amp.items()})
        named.update(lr=self.lr, lr_tensor=None, maximize=self.maximize)
        if self.lr_tensor is not None:
            named.update(lr=0.0, lr_tensor=_scalar(self.lr, "cpu" if self.lr_tensor == "cpu" else device))
        named["write_unscaled_grads"] = self.write_unscaled_grads
        if self.stochastic:
            ids = [3 * index + 1 for index in range(len(self.sizes))]
            named.update(rounding_ids=ids, rounding_seed=5, stochastic_params=True)
        return named

    def coded(self, states: list[Tensor], signed: bool) -> tuple[list[Tensor], list[Tensor] | None]:
        """``states`` (fp32) stored under this sample's codec: (states, scales or None)."""
        if self.moments == "bf16":
            return [state.to(torch.bfloat16) for state in states], None
        if self.moments == "int8":
            # encode_state is a CPU op (the optimizers encode on the host too): codes made there.
            pairs = [torch.ops.fusedamp.encode_state(state.cpu(), signed) for state in states]
            device = states[0].device if states else torch.device("cpu")
            return [codes.to(device) for codes, _ in pairs], [scales.to(device) for _, scales in pairs]
        return states, None


def _state_values(states: list[Tensor], scales: list[Tensor] | None, signed: bool) -> list[Tensor]:
    """The fp32 values of coded states (as they are when stored as fp32)."""
    if scales is None or not states or states[0].dtype != torch.uint8:
        return list(states)
    return [
        torch.ops.fusedamp.decode_state(c.cpu(), s.cpu(), signed) for c, s in zip(states, scales, strict=True)
    ]


def _observed_states(states: list[Tensor], scales: list[Tensor] | None, signed: bool) -> list[Tensor]:
    """States as the op table compares them: fp32 and bf16 as they are; 8-bit codes decoded, as
    float64, the dtype their tolerance (a unit of the codes' 3 mantissa bits) is listed under."""
    if scales is None or not states or states[0].dtype != torch.uint8:
        return list(states)
    return [value.double() for value in _state_values(states, scales, signed)]


def _optimizer_cases(dtype: torch.dtype) -> dict[str, OptimizerSample]:
    """Odd sizes, an empty tensor, many tensors, grads of another dtype than the params, every
    master kind, the AMP scalars (found_inf 0 steps, anything else skips), tensor lrs."""
    other_grad = torch.bfloat16 if dtype == torch.float32 else torch.float32
    amp = {"inv_grad_scale": 2.0**-3, "clip_coef": 0.7, "found_inf": 0.0}
    cases = {
        "odd_sizes": OptimizerSample([1, 7, 33, 65537], dtype, 1, amp=amp),
        "empty_tensor": OptimizerSample([0, 5, 0, 0, 3, 0], dtype, 2, maximize=True),
        f"{MANY}_tensors": OptimizerSample(
            _many_sizes(3),
            dtype,
            3,
            lr_tensor="device",
            amp={"inv_grad_scale": 0.5},
            write_unscaled_grads=False,
        ),
        f"{str(other_grad).removeprefix('torch.')}_grads": OptimizerSample(
            [7, 300], dtype, 4, grad_dtype=other_grad, amp={"clip_coef": 0.25}
        ),
        "host_lr_tensor": OptimizerSample([3, 11], dtype, 5, lr=1.0, lr_tensor="cpu"),
        "found_inf_skips": OptimizerSample([7, 65], dtype, 6, amp={**amp, "found_inf": 1.0}),
        "nan_found_inf_skips": OptimizerSample([9], dtype, 7, amp={"found_inf": math.nan}),
    }
    cases["int8_moments"] = OptimizerSample([1, 257, 65537], dtype, 10, amp=amp, moments="int8")
    cases["bf16_moments"] = OptimizerSample([7, 300], dtype, 11, moments="bf16")
    if dtype != torch.float32:
        cases["no_masters"] = OptimizerSample([7, 129], dtype, 8, master=None, amp=amp)
        cases["stochastic_params"] = OptimizerSample(
            [5, 70001], dtype, 12, master=None, amp=amp, moments="int8", stochastic=True
        )
    if dtype == torch.bfloat16:
        cases["remainder_masters"] = OptimizerSample([1, 7, 65537], dtype, 9, master="remainder", amp=amp)
    return cases


# lr 1 with small betas and a large eps (in host_lr_tensor) makes every term of the update count.
_ADAMW_OPTIONS = {
    "odd_sizes": {"amsgrad": True},
    "int8_moments": {"amsgrad": True},
    "remainder_masters": {"amsgrad": True},
    "host_lr_tensor": {"beta1": 0.1, "beta2": 0.25, "eps": 0.05},
}


def _adamw_samples(device: str, dtype: torch.dtype) -> list[Sample]:
    samples = []
    for name, case in _optimizer_cases(dtype).items():
        options = {"beta1": 0.8, "beta2": 0.95, "eps": 1e-6, "weight_decay": 0.1, "amsgrad": False}
        options.update(_ADAMW_OPTIONS.get(name, {}))
        tensors = to_device(tuple(case.tensors(states=3).values()), device)
        params, grads, masters, (exp_avgs, exp_avg_sqs, max_exp_avg_sqs), steps = tensors
        exp_avgs, exp_avg_scales = case.coded(exp_avgs, True)
        exp_avg_sqs, exp_avg_sq_scales = case.coded(exp_avg_sqs, False)
        max_exp_avg_sqs, max_exp_avg_sq_scales = case.coded(max_exp_avg_sqs, False)
        amsgrad = options["amsgrad"]
        args = schema_args(
            "adamw_",
            params=params,
            grads=grads,
            exp_avgs=exp_avgs,
            exp_avg_sqs=exp_avg_sqs,
            max_exp_avg_sqs=max_exp_avg_sqs if amsgrad else [],
            masters=masters,
            steps=steps,
            exp_avg_scales=exp_avg_scales,
            exp_avg_sq_scales=exp_avg_sq_scales,
            max_exp_avg_sq_scales=max_exp_avg_sq_scales if amsgrad else None,
            **case.scalars(device),
            **options,
        )
        samples.append(Sample(name, args))
    return samples


def _multiplier(inv_grad_scale: Tensor | None, clip_coef: Tensor | None) -> Tensor:
    """inv_grad_scale * clip_coef in fp32, as the kernels take it."""
    multiplier = _scalar(1.0)
    for factor in (inv_grad_scale, clip_coef):
        if factor is not None:
            multiplier = multiplier * factor.float().cpu()
    return multiplier


@dataclass
class _StepInputs:
    """What every optimizer step reads besides its lists (math/master.h, prepare_grad)."""

    skip: bool
    lr: float
    multiplier: Tensor
    writes_grads: bool

    @classmethod
    def of(
        cls,
        lr: float,
        lr_tensor: Tensor | None,
        inv_grad_scale: Tensor | None,
        found_inf: Tensor | None,
        clip_coef: Tensor | None,
        write_unscaled_grads: bool,
    ) -> _StepInputs:
        return cls(
            skip=found_inf is not None and found_inf.item() != 0.0,  # NaN too
            lr=lr if lr_tensor is None else lr_tensor.item(),
            multiplier=_multiplier(inv_grad_scale, clip_coef),
            writes_grads=write_unscaled_grads and (inv_grad_scale is not None or clip_coef is not None),
        )

    def grad(self, grad: Tensor) -> tuple[Tensor, Tensor]:
        """(the fp32 grad the update uses, the grad tensor after the step)."""
        used = grad.float() * self.multiplier
        return used, used.to(grad.dtype) if self.writes_grads else grad.clone()


def _optimizer_outputs(
    params: list[Tensor],
    grads: list[Tensor],
    states: dict[str, list[Tensor]],
    masters: list[Tensor],
    steps: list[Tensor],
) -> Outputs:
    """What an optimizer op is compared on: masters as their fp32 values (remainders joined)."""
    return {
        "params": list(params),
        "grads": list(grads),
        **{name: list(values) for name, values in states.items()},
        "masters": [master_value(p, m) for p, m in zip(params, masters, strict=True)] if masters else [],
        "steps": list(steps),
    }


def _adamw_observe(args: Args, returned: Any) -> Outputs:
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps = args[:7]
    m_scales, v_scales, max_scales = args[19:22]
    states = {
        "exp_avgs": _observed_states(exp_avgs, m_scales, True),
        "exp_avg_sqs": _observed_states(exp_avg_sqs, v_scales, False),
        "max_exp_avg_sqs": _observed_states(max_exp_avg_sqs, max_scales, False),
    }
    return _optimizer_outputs(params, grads, states, masters, steps)


def _adamw_reference(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    masters: list[Tensor],
    steps: list[Tensor],
    lr: float,
    lr_tensor: Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    inv_grad_scale: Tensor | None,
    found_inf: Tensor | None,
    clip_coef: Tensor | None,
    write_unscaled_grads: bool,
    exp_avg_scales: list[Tensor] | None = None,
    exp_avg_sq_scales: list[Tensor] | None = None,
    max_exp_avg_sq_scales: list[Tensor] | None = None,
    rounding_ids: list[int] | None = None,
    rounding_seed: int = 0,
    stochastic_params: bool = False,
) -> Outputs:
    """torch.optim.AdamW's update in float64, on the fp32 master where there is one, from the
    decoded states (the exact value: stochastic rounding lands within one ulp of it)."""
    exp_avgs = _state_values(exp_avgs, exp_avg_scales, True)
    exp_avg_sqs = _state_values(exp_avg_sqs, exp_avg_sq_scales, False)
    max_exp_avg_sqs = _state_values(max_exp_avg_sqs, max_exp_avg_sq_scales, False)
    step_inputs = _StepInputs.of(lr, lr_tensor, inv_grad_scale, found_inf, clip_coef, write_unscaled_grads)
    lr = step_inputs.lr
    result: Outputs = {
        name: []
        for name in ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "masters", "steps")
    }
    for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
        value = master_value(param, masters[index] if masters else None).double()
        exp_avg, exp_avg_sq = exp_avgs[index].double(), exp_avg_sqs[index].double()
        max_exp_avg_sq = max_exp_avg_sqs[index].double() if amsgrad else None
        step = steps[index].item()
        grad_after = grad.clone()
        if not step_inputs.skip:
            used, grad_after = step_inputs.grad(grad)
            g = -used.double() if maximize else used.double()
            step += 1
            value = value * (1 - lr * weight_decay)
            exp_avg = beta1 * exp_avg + (1 - beta1) * g
            exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
            second_moment = exp_avg_sq
            if max_exp_avg_sq is not None:
                max_exp_avg_sq = second_moment = torch.maximum(max_exp_avg_sq, exp_avg_sq)
            denom = second_moment.sqrt() / math.sqrt(1 - beta2**step) + eps
            value = value - lr / (1 - beta1**step) * exp_avg / denom
        result["params"].append(value)
        result["grads"].append(grad_after)
        result["exp_avgs"].append(exp_avg)
        result["exp_avg_sqs"].append(exp_avg_sq)
        if max_exp_avg_sq is not None:
            result["max_exp_avg_sqs"].append(max_exp_avg_sq)
        if masters:
            result["masters"].append(value)
        result["steps"].append(_scalar(step))
    return result


# fp32 params and states: where a result cancels to near zero it keeps the rounding of its terms
# (a few ulps of values up to about 10 in these samples: lr times an update, the param itself).
FP32_STATE = Tol(1e-5, 2e-6)
# bf16 states: one stochastic rounding (under one ulp); 8-bit codes (observed as float64): under a
# code step, which is at most 2^-3 of a value in a block's top 4 binades and at most 2^-8 of the
# block's scale below them, where the codes have fewer mantissa bits (atol, for these samples'
# scales, [note: block codes]).
CODED_STATE = {torch.bfloat16: Tol(2.0**-7, 1e-9), torch.float64: Tol(2.0**-3, 5e-4)}
OPTIMIZER_PARAMS = {torch.float32: FP32_STATE, **ONE_ULP}


def _uint8_codes(key: str) -> Callable[[dict[str, Any]], list[Tensor]]:
    """A bad-input change: the state list ``key`` replaced by uint8 codes (without their scales)."""
    return lambda named: [torch.zeros(4, dtype=torch.uint8) for _ in named[key]]


def _optimizer_bad_inputs(op: str) -> list[BadInput]:
    """Lists of two tensors with the bad one last, where a kernel that started before checking
    would already have written the first."""

    def base(**changes: Any) -> dict[str, Any]:
        generator = _generator(11)
        named: dict[str, Any] = {
            "params": [_randn(4, torch.float32, generator) for _ in range(2)],
            "grads": [_randn(4, torch.float32, generator) for _ in range(2)],
            "masters": [],
            "steps": [_scalar(1.0), _scalar(1.0)],
            "lr": 1e-2,
            "lr_tensor": None,
            "weight_decay": 0.1,
            "maximize": False,
            "inv_grad_scale": None,
            "found_inf": None,
            "clip_coef": None,
            "write_unscaled_grads": True,
        }
        if op == "adamw_":
            named.update(
                exp_avgs=[_randn(4, torch.float32, generator) for _ in range(2)],
                exp_avg_sqs=[torch.rand(4, generator=generator) for _ in range(2)],
                max_exp_avg_sqs=[],
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                amsgrad=False,
            )
        else:
            named.update(
                momentum_buffers=[_randn(4, torch.float32, generator) for _ in range(2)],
                momentum=0.9,
                dampening=0.0,
                nesterov=False,
            )
        for key, change in changes.items():
            named[key] = change(named) if callable(change) else change
        return named

    def bad(name: str, error: type[Exception], message: str, **changes: Any) -> BadInput:
        return BadInput(name, lambda: schema_args(op, **base(**changes)), error, f"{op}: {message}")

    def last(key: str, make: Callable[[dict[str, Any]], Tensor]) -> Callable[[dict[str, Any]], list[Tensor]]:
        return lambda named: [*named[key][:-1], make(named)]

    state = "exp_avgs" if op == "adamw_" else "momentum_buffers"
    cases = [
        bad(
            "short_grads",
            RuntimeError,
            "grads has 1 tensors but params has 2; pass one per param",
            grads=lambda n: n["grads"][:1],
        ),
        bad(
            "short_state",
            RuntimeError,
            f"{state} has 1 tensors but params has 2; pass one per param",
            **{state: lambda n: n[state][:1]},
        ),
        bad(
            "one_master",
            RuntimeError,
            "masters has 1 tensors but params has 2; pass none (no master weights) or one per param",
            masters=[torch.zeros(4)],
        ),
        bad(
            "masters_of_fp32_params",
            TypeError,
            "float32 params need no master weights; pass an empty masters list",
            masters=lambda n: [torch.zeros(4), torch.zeros(4)],
        ),
        bad(
            "remainders_of_fp16_params",
            TypeError,
            "int16 remainder masters need bfloat16 params, got Half",
            params=lambda n: [p.half() for p in n["params"]],
            grads=lambda n: [g.half() for g in n["grads"]],
            masters=lambda n: [torch.zeros(4, dtype=torch.int16) for _ in range(2)],
        ),
        bad(
            "fp16_masters",
            TypeError,
            "masters must be float32 (full master weights) or int16 (bf16 remainders), got Half",
            params=lambda n: [p.half() for p in n["params"]],
            grads=lambda n: [g.half() for g in n["grads"]],
            masters=lambda n: [p.half() for p in n["params"]],
        ),
        bad(
            "complex_param",
            TypeError,
            "params[1] is ComplexFloat but params[0] is Float; one call takes one param dtype",
            params=last("params", lambda n: torch.ones(4, dtype=torch.complex64)),
        ),
        bad(
            "int_grad",
            TypeError,
            "grads[1] is Int, expected Float",
            grads=last("grads", lambda n: torch.ones(4, dtype=torch.int32)),
        ),
        bad(
            "fp16_state",
            TypeError,
            f"{state}[1] is Half, expected Float",
            **{state: last(state, lambda n: torch.ones(4, dtype=torch.half))},
        ),
        bad(
            "grad_size",
            RuntimeError,
            f"grads[1] has 5 elements but {op}: params[1] has 4",
            grads=last("grads", lambda n: torch.randn(5)),
        ),
        bad(
            "state_in_another_order",
            RuntimeError,
            f"{state}[1] (sizes [2, 2], strides [1, 2]) does not store its elements in the order of "
            f"{op}: params[1]",
            **{state: last(state, lambda n: torch.randn(2, 2).t())},
        ),
        bad(
            "overlapping_state",
            RuntimeError,
            f"{state}[1] has gaps or overlaps in memory",
            **{state: last(state, lambda n: torch.randn(1).expand(4))},
        ),
        bad(
            "float64_step",
            TypeError,
            "steps[1] must be a float32 tensor, got Double",
            steps=last("steps", lambda n: torch.ones((), dtype=torch.float64)),
        ),
        bad(
            "two_element_step",
            RuntimeError,
            "steps[1] must hold exactly one element, got shape [2]",
            steps=last("steps", lambda n: torch.ones(2)),
        ),
        bad(
            "codes_without_scales",
            RuntimeError,
            f"{state.removesuffix('s')}_scales has 0 tensors but params has 2; uint8 states need one "
            "scale tensor per param",
            **{
                key: _uint8_codes(key)
                for key in (("exp_avgs", "exp_avg_sqs") if op == "adamw_" else (state,))
            },
        ),
        bad(
            "stochastic_params_of_fp32_params",
            TypeError,
            "stochastic_params is for float16 / bfloat16 params without master weights",
            stochastic_params=True,
        ),
        bad("nan_lr", ValueError, "lr is nan; it must be a finite number", lr=math.nan),
        bad("inf_lr", ValueError, "lr is inf; it must be a finite number", lr=math.inf),
        bad(
            "nan_weight_decay",
            ValueError,
            "weight_decay is nan; it must be a finite number",
            weight_decay=math.nan,
        ),
        bad(
            "two_element_lr_tensor",
            RuntimeError,
            "lr_tensor must hold exactly one element, got shape [2]",
            lr_tensor=lambda n: torch.ones(2),
        ),
        bad(
            "float64_lr_tensor",
            TypeError,
            "lr_tensor must be a float32 tensor, got Double",
            lr_tensor=lambda n: torch.ones((), dtype=torch.float64),
        ),
        bad(
            "float64_found_inf",
            TypeError,
            "found_inf must be a float32 tensor, got Double",
            found_inf=lambda n: torch.zeros((), dtype=torch.float64),
        ),
        bad(
            "int_clip_coef",
            TypeError,
            "clip_coef must be a float32 tensor, got Int",
            clip_coef=lambda n: torch.ones((), dtype=torch.int32),
        ),
        bad(
            "two_element_inv_grad_scale",
            RuntimeError,
            "inv_grad_scale must hold exactly one element, got shape [2]",
            inv_grad_scale=lambda n: torch.ones(2),
        ),
        bad(
            "grad_is_its_param",
            RuntimeError,
            "params[1] and grads[1] share memory",
            grads=last("grads", lambda n: n["params"][-1]),
        ),
        bad(
            "overlapping_params",
            RuntimeError,
            "params[0] and params[1] share memory",
            params=lambda n: list(torch.randn(6).as_strided((2, 4), (2, 1))),
        ),
    ]
    if op == "adamw_":
        cases += [
            bad("nan_eps", ValueError, "eps is nan; it must be a finite number", eps=math.nan),
            bad("nan_beta1", ValueError, "beta1 is nan; it must be a finite number", beta1=math.nan),
            bad(
                "amsgrad_without_max_exp_avg_sqs",
                RuntimeError,
                "max_exp_avg_sqs has 0 tensors but params has 2; pass one per param",
                amsgrad=True,
            ),
            bad(
                "one_moment_twice",
                RuntimeError,
                "exp_avgs[1] and exp_avg_sqs[1] share memory",
                exp_avg_sqs=last("exp_avg_sqs", lambda n: n["exp_avgs"][-1]),
            ),
        ]
    else:
        cases += [
            bad("nan_momentum", ValueError, "momentum is nan; it must be a finite number", momentum=math.nan),
            bad(
                "momentum_without_buffers",
                RuntimeError,
                "momentum_buffers has 0 tensors but params has 2; pass one per param",
                momentum_buffers=[],
            ),
        ]

    def state_on_cpu() -> Args:
        args = schema_args(op, **base())
        on_cuda = to_device(args, "cuda")
        return (*on_cuda[:2], args[2], *on_cuda[3:])

    cases.append(
        BadInput(
            "state_on_cpu", state_on_cpu, RuntimeError, f"{op}: {state}[0] is on cpu, expected cuda:0", "cuda"
        )
    )
    return cases


def _masters_rounded(masters_index: int) -> Callable[[Args, Any], None]:
    def check(args: Args, returned: Any) -> None:
        """A half param with an fp32 master is that master rounded to nearest even, bit for bit."""
        masters = args[masters_index]
        for param, master in zip(args[0], masters, strict=bool(masters)):
            if master.dtype == torch.float32:
                assert torch.equal(param.view(torch.int16), master.to(param.dtype).view(torch.int16))

    return check


ADAMW = OpEntry(
    name="adamw_",
    dtypes=FLOAT_DTYPES,
    samples=_adamw_samples,
    reference=_adamw_reference,
    mutates=(
        "params",
        "grads",
        "exp_avgs",
        "exp_avg_sqs",
        "max_exp_avg_sqs",
        "masters",
        "steps",
        "exp_avg_scales",
        "exp_avg_sq_scales",
        "max_exp_avg_sq_scales",
    ),
    tolerances={
        "params": OPTIMIZER_PARAMS,
        "grads": EXACT,
        "exp_avgs": {torch.float32: FP32_STATE, **CODED_STATE},
        "exp_avg_sqs": {torch.float32: Tol(1e-5, 1e-9), **CODED_STATE},
        "max_exp_avg_sqs": {torch.float32: Tol(1e-5, 1e-9), **CODED_STATE},
        "masters": FP32_STATE,
        "steps": EXACT,
    },
    bad_inputs=tuple(_optimizer_bad_inputs("adamw_")),
    uses_cpu_isa=True,
    observe=_adamw_observe,
    invariants=_masters_rounded(5),
    notes="steps hold the count before the step (fp32 scalars), incremented unless found_inf skips; "
    "masters are none, fp32, or int16 remainders of bf16 params (compared as the fp32 they encode); "
    "moments fp32, bf16 or 8-bit codes with scales (compared decoded); stochastic rounding_ids.",
)


def _sgd_samples(device: str, dtype: torch.dtype) -> list[Sample]:
    # Per case: nesterov (which needs no dampening), no momentum (no buffers), no weight decay.
    variants = {
        "empty_tensor": {"nesterov": True, "dampening": 0.0},
        f"{MANY}_tensors": {"momentum": 0.0},
        "no_masters": {"weight_decay": 0.0},
    }
    samples = []
    for name, case in _optimizer_cases(dtype).items():
        options = {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01, "nesterov": False}
        options.update(variants.get(name, {}))
        params, grads, masters, (buffers,), steps = to_device(tuple(case.tensors(states=1).values()), device)
        buffers, buffer_scales = case.coded(buffers, True)
        has_momentum = options["momentum"] != 0.0
        args = schema_args(
            "sgd_",
            params=params,
            grads=grads,
            momentum_buffers=buffers if has_momentum else [],
            masters=masters,
            steps=steps,
            momentum_buffer_scales=buffer_scales if has_momentum else None,
            **case.scalars(device),
            **options,
        )
        samples.append(Sample(name, args))
    return samples


def _sgd_observe(args: Args, returned: Any) -> Outputs:
    params, grads, momentum_buffers, masters, steps = args[:5]
    buffers = _observed_states(momentum_buffers, args[16], True)
    return _optimizer_outputs(params, grads, {"momentum_buffers": buffers}, masters, steps)


def _sgd_reference(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    masters: list[Tensor],
    steps: list[Tensor],
    lr: float,
    lr_tensor: Tensor | None,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    inv_grad_scale: Tensor | None,
    found_inf: Tensor | None,
    clip_coef: Tensor | None,
    write_unscaled_grads: bool,
    momentum_buffer_scales: list[Tensor] | None = None,
    rounding_ids: list[int] | None = None,
    rounding_seed: int = 0,
    stochastic_params: bool = False,
) -> Outputs:
    """torch.optim.SGD's update in float64 from the decoded buffers; a param whose count is 0
    takes its first step (the buffer becomes the grad)."""
    momentum_buffers = _state_values(momentum_buffers, momentum_buffer_scales, True)
    step_inputs = _StepInputs.of(lr, lr_tensor, inv_grad_scale, found_inf, clip_coef, write_unscaled_grads)
    result: Outputs = {name: [] for name in ("params", "grads", "momentum_buffers", "masters", "steps")}
    for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
        value = master_value(param, masters[index] if masters else None).double()
        buffer = momentum_buffers[index].double() if momentum != 0.0 else None
        step = steps[index].item()
        grad_after = grad.clone()
        if not step_inputs.skip:
            used, grad_after = step_inputs.grad(grad)
            g = -used.double() if maximize else used.double()
            if weight_decay != 0.0:
                g = g + weight_decay * value
            if buffer is not None:
                buffer = g if step == 0.0 else momentum * buffer + (1 - dampening) * g
                g = g + momentum * buffer if nesterov else buffer
            value = value - step_inputs.lr * g
            step += 1
        result["params"].append(value)
        result["grads"].append(grad_after)
        if buffer is not None:
            result["momentum_buffers"].append(buffer)
        if masters:
            result["masters"].append(value)
        result["steps"].append(_scalar(step))
    return result


SGD = OpEntry(
    name="sgd_",
    dtypes=FLOAT_DTYPES,
    samples=_sgd_samples,
    reference=_sgd_reference,
    mutates=("params", "grads", "momentum_buffers", "masters", "steps", "momentum_buffer_scales"),
    tolerances={
        "params": OPTIMIZER_PARAMS,
        "grads": EXACT,
        "momentum_buffers": {torch.float32: FP32_STATE, **CODED_STATE},
        "masters": FP32_STATE,
        "steps": EXACT,
    },
    bad_inputs=tuple(_optimizer_bad_inputs("sgd_")),
    uses_cpu_isa=True,
    observe=_sgd_observe,
    invariants=_masters_rounded(3),
    notes="momentum_buffers empty when momentum is 0 (fp32, bf16 or 8-bit codes); otherwise as adamw_.",
)


# --- muon_momentum_ ---------------------------------------------------------------------------

# A value the op never reads: updates hold it after a skipped step, and nowhere else.
_UNWRITTEN_UPDATE = 7.0


def _muon_samples(device: str, dtype: torch.dtype) -> list[Sample]:
    # dtype is the grads'; the updates bf16 (the orthogonalization's) for bf16 grads, else fp32 (the
    # kernels pair fp16 with fp16 or fp32 only).
    update_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    variants = {"empty_tensor": {"nesterov": False}, "no_masters": {"momentum": 0.3}}
    samples = []
    for name, case in _optimizer_cases(dtype).items():
        options = {"momentum": 0.95, "nesterov": True, **variants.get(name, {})}
        _, grads, _, (buffers,), steps = to_device(tuple(case.tensors(states=1).values()), device)
        buffers, buffer_scales = case.coded(buffers, True)
        scalars = case.scalars(device)
        args = schema_args(
            "muon_momentum_",
            updates=[torch.full_like(grad, _UNWRITTEN_UPDATE, dtype=update_dtype) for grad in grads],
            grads=grads,
            momentum_buffers=buffers,
            steps=steps,
            momentum_buffer_scales=buffer_scales,
            rounding_ids=scalars.get("rounding_ids"),
            rounding_seed=scalars.get("rounding_seed", 0),
            **{key: scalars[key] for key in ("inv_grad_scale", "found_inf", "clip_coef")},
            write_unscaled_grads=scalars["write_unscaled_grads"],
            **options,
        )
        samples.append(Sample(name, args))
    return samples


def _muon_observe(args: Args, returned: Any) -> Outputs:
    updates, grads, buffers, steps = args[:4]
    return {
        "updates": list(updates),
        "grads": list(grads),
        "momentum_buffers": _observed_states(buffers, args[10], True),
        "steps": list(steps),
    }


def _muon_reference(
    updates: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    steps: list[Tensor],
    momentum: float,
    nesterov: bool,
    inv_grad_scale: Tensor | None,
    found_inf: Tensor | None,
    clip_coef: Tensor | None,
    write_unscaled_grads: bool,
    momentum_buffer_scales: list[Tensor] | None = None,
    rounding_ids: list[int] | None = None,
    rounding_seed: int = 0,
) -> Outputs:
    """torch.optim.Muon's momentum in float64 from the decoded buffers: buffer.lerp_(grad, 1 - m),
    update = grad.lerp(buffer, m) with nesterov, else the buffer; steps unchanged."""
    buffers = _state_values(momentum_buffers, momentum_buffer_scales, True)
    step_inputs = _StepInputs.of(0.0, None, inv_grad_scale, found_inf, clip_coef, write_unscaled_grads)
    result: Outputs = {"updates": [], "grads": [], "momentum_buffers": []}
    result["steps"] = [step.clone() for step in steps]
    for update, grad, buffer in zip(updates, grads, buffers, strict=True):
        value, buffer, grad_after = update.double(), buffer.double(), grad.clone()
        if not step_inputs.skip:
            used, grad_after = step_inputs.grad(grad)
            buffer = torch.lerp(buffer, used.double(), 1 - momentum)
            value = torch.lerp(used.double(), buffer, momentum) if nesterov else buffer
        result["updates"].append(value)
        result["grads"].append(grad_after)
        result["momentum_buffers"].append(buffer)
    return result


def _muon_bad_inputs() -> list[BadInput]:
    def args(**changes: Any) -> Callable[[], Args]:
        def make() -> Args:
            generator = _generator(13)
            named: dict[str, Any] = {
                "updates": [torch.zeros(4) for _ in range(2)],
                "grads": [_randn(4, torch.float32, generator) for _ in range(2)],
                "momentum_buffers": [_randn(4, torch.float32, generator) for _ in range(2)],
                "steps": [_scalar(1.0), _scalar(1.0)],
                "momentum": 0.95,
                "nesterov": True,
                "inv_grad_scale": None,
                "found_inf": None,
                "clip_coef": None,
                "write_unscaled_grads": True,
            }
            for key, change in changes.items():
                named[key] = change(named) if callable(change) else change
            return schema_args("muon_momentum_", **named)

        return make

    def buffers_on_cpu() -> Args:
        on_cpu = args()()
        on_cuda = to_device(on_cpu, "cuda")
        return (*on_cuda[:2], on_cpu[2], *on_cuda[3:])

    op = "muon_momentum_"
    fp16_updates = [torch.zeros(4, dtype=torch.float16) for _ in range(2)]
    return [
        BadInput(
            "short_grads", args(grads=lambda n: n["grads"][:1]), RuntimeError,
            f"{op}: grads has 1 tensors but params has 2; pass one per param",
        ),
        BadInput(
            "short_buffers", args(momentum_buffers=lambda n: n["momentum_buffers"][:1]), RuntimeError,
            f"{op}: momentum_buffers has 1 tensors but params has 2; pass one per param",
        ),
        BadInput("fp16_updates", args(updates=fp16_updates), TypeError, f"{op}: updates must be float32"),
        BadInput("nan_momentum", args(momentum=float("nan")), ValueError, "momentum"),
        BadInput(
            "codes_without_scales", args(momentum_buffers=_uint8_codes("momentum_buffers")), RuntimeError,
            "momentum_buffer_scales",
        ),
        BadInput(
            "buffers_on_cpu", buffers_on_cpu, RuntimeError,
            f"{op}: momentum_buffers[0] is on cpu, expected cuda:0", "cuda",
        ),
    ]


MUON_MOMENTUM = OpEntry(
    name="muon_momentum_",
    dtypes=FLOAT_DTYPES,
    samples=_muon_samples,
    reference=_muon_reference,
    mutates=("updates", "grads", "momentum_buffers", "momentum_buffer_scales"),
    tolerances={
        "updates": OPTIMIZER_PARAMS,
        "grads": EXACT,
        "momentum_buffers": {torch.float32: FP32_STATE, **CODED_STATE},
        "steps": EXACT,
    },
    bad_inputs=tuple(_muon_bad_inputs()),
    uses_cpu_isa=True,
    observe=_muon_observe,
    notes="the dtype is the grads'; updates bf16 (bf16 grads) or fp32, written, never read (a skipped "
    "step leaves them as they were); momentum buffers fp32, bf16 or 8-bit codes; steps read only.",
)


# --- split_bf16_remainder and join_bf16_remainder (CPU only) ------------------------------------

# NaNs whose bits + 0x8000 once wrapped into signed zeros, exact ties (rounded half-up on the
# bits, not to even), the largest finite, a master that rounds up to inf, infs, -0, subnormals.
SPECIAL_MASTER_BITS = [
    0x7FFF8000, 0x7FFFFFFF, 0x7FC00000, 0x7F800001, -0x00008000, -0x00000001, -0x00400000,
    0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F7F8000, 0x7F800000, -0x00800000, -0x80000000,
    0x00000001, 0x00008000,
]  # fmt: skip


def _bits_as(values: list[int] | Tensor, dtype: torch.dtype) -> Tensor:
    bits = torch.as_tensor(values, dtype=torch.int64)
    integer = torch.int32 if dtype == torch.float32 else torch.int16
    return bits.to(integer).view(dtype)


def _split_samples(device: str, dtype: torch.dtype) -> list[Sample]:
    generator = _generator(21)
    random_bits = torch.randint(-(2**31), 2**31, (1027,), generator=generator, dtype=torch.int64)
    masters = {
        "random_bit_patterns_1027": _bits_as(random_bits, torch.float32),
        "special_values": _bits_as(SPECIAL_MASTER_BITS, torch.float32),
        "odd_shape_7x13": _randn((7, 13), torch.float32, generator, 1e3),
        "channels_last": _randn((2, 3, 4, 5), torch.float32, generator).to(memory_format=torch.channels_last),
        "transposed": _randn((9, 5), torch.float32, generator).t(),
        "empty": _randn((0, 3), torch.float32, generator),
    }
    return [Sample(name, to_device((master,), device)) for name, master in masters.items()]


def _split_observe(args: Args, returned: tuple[Tensor, Tensor]) -> Outputs:
    param, remainder = returned
    return {"param": [param.view(torch.int16)], "remainder": [remainder]}


def _split_reference(master: Tensor) -> Outputs:
    param, remainder = _split_bits(master)
    return {"param": [param], "remainder": [remainder]}


def _same_layout(outputs: list[Tensor], source: Tensor) -> None:
    for output in outputs:
        assert output.stride() == source.stride(), "the output does not take the input's memory format"


def _split_invariants(args: Args, returned: tuple[Tensor, Tensor]) -> None:
    param, remainder = returned
    assert (param.dtype, remainder.dtype) == (torch.bfloat16, torch.int16)
    _same_layout([param, remainder], args[0])


SPLIT = OpEntry(
    name="split_bf16_remainder",
    dtypes=(torch.float32,),
    samples=_split_samples,
    reference=_split_reference,
    mutates=(),
    tolerances={"param": EXACT, "remainder": EXACT},
    bad_inputs=(
        BadInput(
            "float64_master",
            lambda: (torch.randn(3, dtype=torch.float64),),
            TypeError,
            "split_bf16_remainder: master must be float32, got Double",
        ),
        BadInput(
            "bf16_master",
            lambda: (torch.randn(3).bfloat16(),),
            TypeError,
            "split_bf16_remainder: master must be float32, got BFloat16",
        ),
        BadInput(
            "cuda_master",
            lambda: (torch.randn(3, device="cuda"),),
            NotImplementedError,
            "Could not run 'fusedamp::split_bf16_remainder' with arguments from the 'CUDA' backend",
            device="cuda",
        ),
    ),
    devices=("cpu",),
    returns=("param", "remainder"),
    observe=_split_observe,
    invariants=_split_invariants,
    notes="CPU only (the optimizers call it once per param, when its master state is made). The "
    "encoding is defined on bits: the reference is integer arithmetic, compared bit for bit.",
)


def _join_samples(device: str, dtype: torch.dtype) -> list[Sample]:
    generator = _generator(22)

    def pair(*shape: int) -> tuple[Tensor, Tensor]:
        param = (
            torch.randint(-(2**15), 2**15, shape, generator=generator).to(torch.int16).view(torch.bfloat16)
        )
        return param, torch.randint(-(2**15), 2**15, shape, generator=generator).to(torch.int16)

    cl = torch.channels_last
    param_4d, remainder_4d = pair(2, 3, 4, 5)
    param_t, remainder_t = pair(9, 5)
    pairs = {
        "random_bit_patterns_1027": pair(1027),
        "channels_last": (param_4d.to(memory_format=cl), remainder_4d.to(memory_format=cl)),
        "param_channels_last_remainder_contiguous": (param_4d.to(memory_format=cl), remainder_4d),
        "transposed": (param_t.t(), remainder_t.t()),
        "empty": pair(0, 3),
    }
    return [Sample(name, to_device(args, device)) for name, args in pairs.items()]


def _join_invariants(args: Args, returned: Tensor) -> None:
    assert returned.dtype == torch.float32
    _same_layout([returned], args[0])


JOIN = OpEntry(
    name="join_bf16_remainder",
    dtypes=(torch.bfloat16,),
    samples=_join_samples,
    reference=lambda param, remainder: {"master": [_join_bits(param, remainder)]},
    mutates=(),
    tolerances={"master": EXACT},
    bad_inputs=(
        BadInput(
            "float32_param",
            lambda: (torch.randn(3), torch.randint(-9, 9, (3,), dtype=torch.int16)),
            TypeError,
            "join_bf16_remainder: param must be bfloat16 and remainder int16, got Float and Short",
        ),
        BadInput(
            "int32_remainder",
            lambda: (torch.randn(3).bfloat16(), torch.randint(-9, 9, (3,), dtype=torch.int32)),
            TypeError,
            "join_bf16_remainder: param must be bfloat16 and remainder int16, got BFloat16 and Int",
        ),
        BadInput(
            "other_shape",
            lambda: (torch.randn(3).bfloat16(), torch.randint(-9, 9, (4,), dtype=torch.int16)),
            RuntimeError,
            "join_bf16_remainder: param has shape [3] but remainder has [4]",
        ),
        BadInput(
            "cuda_param",
            lambda: (
                torch.randn(3, device="cuda").bfloat16(),
                torch.ones(3, dtype=torch.int16, device="cuda"),
            ),
            NotImplementedError,
            "Could not run 'fusedamp::join_bf16_remainder' with arguments from the 'CUDA' backend",
            device="cuda",
        ),
    ),
    devices=("cpu",),
    returns=("master",),
    observe=lambda args, returned: {"master": [returned.view(torch.int32)]},
    invariants=_join_invariants,
    notes="CPU only, like split_bf16_remainder; the master takes the param's memory format.",
)


# --- gemm -------------------------------------------------------------------------------------

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "none": lambda z: z,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
}


def _gemm_samples(device: str, dtype: torch.dtype) -> list[Sample]:
    """Every activation, layout (a and b transposed or not), bias kind and output dtype; the
    shapes 1x1x1, odd sizes, leading dims, a vector a, M = 0 and K = 0; one with autograd."""
    generator = _generator(31)

    def rand(*shape: int, to: torch.dtype = dtype) -> Tensor:
        return _randn(shape, to, generator)

    def operands(m: int, n: int, k: int, a_t: bool, b_t: bool) -> tuple[Tensor, Tensor]:
        a = rand(k, m).t() if a_t else rand(m, k)
        b = rand(n, k).t() if b_t else rand(k, n)
        return a, b

    def sample(
        name: str, a: Tensor, b: Tensor, bias: Tensor | None, activation: str, **options: Any
    ) -> Sample:
        args = schema_args("gemm", a=a, b=b, bias=bias, activation=activation, **options)
        return Sample(name, to_device(args, device))

    grad_a, grad_b = operands(6, 5, 7, False, True)
    return [
        sample("7x9x13_gelu", *operands(7, 9, 13, False, False), rand(9), "gelu", keep_preactivation=True),
        sample(
            "65x63x129_b_transposed_relu_fp32_out",
            *operands(65, 63, 129, False, True),
            rand(63, to=torch.float32),
            "relu",
            out_dtype=torch.float32,
            keep_preactivation=True,
        ),
        sample("17x24x40_both_transposed_gelu_tanh", *operands(17, 24, 40, True, True), None, "gelu_tanh"),
        sample(
            "1x1x1_a_transposed", *operands(1, 1, 1, True, False), rand(1), "none", keep_preactivation=True
        ),
        sample(
            "leading_dims_2x3x5",
            rand(2, 3, 5, 16),
            rand(8, 16).t(),
            rand(8, to=torch.float32),
            "gelu",
            keep_preactivation=True,
        ),
        sample("vector_a", rand(16), rand(16, 8), None, "relu", out_dtype=torch.float32),
        sample("m_zero", *operands(0, 4, 5, False, False), rand(4), "relu", keep_preactivation=True),
        sample("k_zero", *operands(3, 4, 0, False, False), rand(4), "gelu", keep_preactivation=True),
        sample(
            "requires_grad",
            grad_a.requires_grad_(),
            grad_b.requires_grad_(),
            rand(5, to=torch.float32).requires_grad_(),
            "gelu",
            keep_preactivation=True,
        ),
    ]


def _gemm_reference(
    a: Tensor,
    b: Tensor,
    bias: Tensor | None,
    activation: str,
    out_dtype: torch.dtype | None,
    keep_preactivation: bool,
) -> Outputs:
    z = a.detach().double().reshape(math.prod(a.shape[:-1]), a.shape[-1]) @ b.detach().double()
    if bias is not None:
        z = z + bias.detach().double()
    z = z.reshape(*a.shape[:-1], b.shape[1])
    preactivation = z if keep_preactivation else torch.empty(0, dtype=torch.float64)
    return {"out": [ACTIVATIONS[activation](z)], "preactivation": [preactivation]}


def _gemm_invariants(args: Args, returned: tuple[Tensor, Tensor]) -> None:
    a, _, _, _, out_dtype, keep_preactivation = args
    out, preactivation = returned
    assert out.dtype == preactivation.dtype == (out_dtype or a.dtype)
    assert out.requires_grad == (a.requires_grad or args[1].requires_grad)


def _gemm_bad(name: str, error: type[Exception], message: str, make: Callable[[], Args]) -> BadInput:
    return BadInput(name, make, error, f"fusedamp.gemm: {message}")


def _half(*shape: int, dtype: torch.dtype = torch.float16, device: str = "cpu") -> Tensor:
    return torch.randn(shape, device=device).to(dtype)


GEMM = OpEntry(
    name="gemm",
    dtypes=HALF_DTYPES,
    samples=_gemm_samples,
    reference=_gemm_reference,
    mutates=(),
    # fp32 accumulation (error ~ sqrt(K) fp32 ulps of sum |a||b|), then one rounding.
    tolerances={
        "out": {torch.float32: Tol(1e-5, 2e-4), **{d: Tol(t.rtol, 2e-4) for d, t in ONE_ULP.items()}},
        "preactivation": {
            torch.float32: Tol(1e-5, 2e-4),
            **{d: Tol(t.rtol, 2e-4) for d, t in ONE_ULP.items()},
        },
    },
    bad_inputs=(
        _gemm_bad(
            "fp32_a",
            TypeError,
            "a must be float16 or bfloat16, got Float",
            lambda: schema_args("gemm", a=torch.randn(2, 3), b=torch.randn(3, 4)),
        ),
        _gemm_bad(
            "b_of_another_dtype",
            TypeError,
            "b has dtype BFloat16 but a has Half",
            lambda: schema_args("gemm", a=_half(2, 3), b=_half(3, 4, dtype=torch.bfloat16)),
        ),
        _gemm_bad(
            "other_k",
            RuntimeError,
            "a has shape [2, 3] and b [4, 4]; a's last dim must equal b's first (K)",
            lambda: schema_args("gemm", a=_half(2, 3), b=_half(4, 4)),
        ),
        _gemm_bad(
            "3d_b",
            RuntimeError,
            "b must be 2-D (K, N), got shape [3, 4, 1]",
            lambda: schema_args("gemm", a=_half(2, 3), b=_half(3, 4, 1)),
        ),
        _gemm_bad(
            "0d_a",
            RuntimeError,
            "a must have at least 1 dimension (..., K)",
            lambda: schema_args("gemm", a=_half(), b=_half(3, 4)),
        ),
        _gemm_bad(
            "bias_shape",
            RuntimeError,
            "bias must have shape (4,) to match b's columns, got [5]",
            lambda: schema_args("gemm", a=_half(2, 3), b=_half(3, 4), bias=_half(5)),
        ),
        _gemm_bad(
            "bias_dtype",
            TypeError,
            "bias must be Half or float32, got BFloat16",
            lambda: schema_args("gemm", a=_half(2, 3), b=_half(3, 4), bias=_half(4, dtype=torch.bfloat16)),
        ),
        _gemm_bad(
            "activation",
            ValueError,
            "activation must be 'none', 'relu', 'gelu' or 'gelu_tanh', got 'tanh'",
            lambda: schema_args("gemm", a=_half(2, 3), b=_half(3, 4), activation="tanh"),
        ),
        _gemm_bad(
            "out_dtype",
            TypeError,
            "out_dtype must be Half (a's dtype) or float32, got BFloat16",
            lambda: schema_args("gemm", a=_half(2, 3), b=_half(3, 4), out_dtype=torch.bfloat16),
        ),
        BadInput(
            "b_on_cpu",
            lambda: schema_args("gemm", a=_half(2, 3, device="cuda"), b=_half(3, 4)),
            RuntimeError,
            "fusedamp.gemm: a is on cuda:0 but b on cpu",
            device="cuda",
        ),
    ),
    returns=("out", "preactivation"),
    invariants=_gemm_invariants,
    notes="Nothing mutated (the driver checks the operands are left as they were). CPU and the CUDA "
    "'reference' backend upcast to fp32 ATen; tests/test_gemm_cuda.py tests the CUDA kernels.",
)


# --- grad_stats -------------------------------------------------------------------------------


def stats_grads(sizes: list[int], dtypes: list[torch.dtype], generator: torch.Generator) -> list[Tensor]:
    """Magnitudes log-uniform over 2^-34 .. 2^6 with random signs, some exact zeros (they count as
    neither underflow) and non-finite values."""
    grads = []
    for size, dtype in zip(sizes, dtypes, strict=True):
        exponent = torch.rand(size, generator=generator, dtype=torch.float64) * 40 - 34
        sign = torch.where(torch.rand(size, generator=generator) < 0.5, -1.0, 1.0).double()
        values = sign * torch.exp2(exponent)
        values[torch.rand(size, generator=generator) < 0.05] = 0.0
        special = torch.rand(size, generator=generator)
        values[special < 0.002] = math.inf
        values[(special >= 0.002) & (special < 0.003)] = math.nan
        values[(special >= 0.003) & (special < 0.004)] = -math.inf
        grads.append(values.to(dtype))
    return grads


def _grad_stats_samples(device: str, dtype: torch.dtype) -> list[Sample]:
    generator = _generator(41)

    def grads(sizes: list[int], dtypes: list[torch.dtype] | None = None) -> list[Tensor]:
        return stats_grads(sizes, dtypes or [dtype] * len(sizes), generator)

    channels_last = grads([120])[0].reshape(2, 3, 4, 5).to(memory_format=torch.channels_last)
    cases = {
        # 70001 elements: several CPU chunks of 2^15 and CUDA blocks.
        "odd_sizes": (grads([1, 1000, 70001]), _scalar(2.0**-16)),
        "empty_tensor": (grads([0, 5, 0, 0, 33, 0]), None),
        "no_tensors": ([], _scalar(0.5)),
        f"{MANY}_tensors": (grads(_many_sizes(4)), _scalar(8.0)),
        # A one-element inv_scale of shape [1] is as good as a 0-d one.
        "mixed_dtypes": (grads([4097, 1000, 300], [dtype, *_other_dtypes(dtype)]), torch.tensor([2.0**-10])),
        "channels_last": ([channels_last], None),
    }
    return [Sample(name, to_device(args, device)) for name, args in cases.items()]


def _grad_stats_reference(grads: list[Tensor], inv_scale: Tensor | None) -> Outputs:
    """Per grad: (0 < |g * inv_scale| < 2^-24, same below 2^-14, non-finite count) and the
    largest finite |g * inv_scale|, the product in fp32 as the kernels take it."""
    multiplier = _scalar(1.0) if inv_scale is None else inv_scale.float().reshape(())
    counts, max_abs = [], []
    for grad in grads:
        value = grad.float()
        finite = value.isfinite()
        magnitude = torch.where(finite, (value * multiplier).abs(), 0.0).double()
        nonzero = magnitude > 0
        counts.append(
            [
                int((nonzero & (magnitude < 2.0**-24)).sum()),
                int((nonzero & (magnitude < 2.0**-14)).sum()),
                int((~finite).sum()),
            ]
        )
        max_abs.append(float(magnitude.max()) if magnitude.numel() else 0.0)
    return {
        "counts": [torch.tensor(counts, dtype=torch.int64).reshape(len(grads), 3)],
        "max_abs": [torch.tensor(max_abs, dtype=torch.float32)],
    }


GRAD_STATS = OpEntry(
    name="grad_stats",
    dtypes=FLOAT_DTYPES,
    samples=_grad_stats_samples,
    reference=_grad_stats_reference,
    mutates=(),
    tolerances={"counts": EXACT, "max_abs": EXACT},
    bad_inputs=(
        BadInput(
            "int_grad",
            lambda: ([torch.randn(3), torch.ones(3, dtype=torch.int32)], None),
            TypeError,
            "grad_stats: grads[1] has dtype Int; expected float32, float16 or bfloat16",
        ),
        BadInput(
            "float64_grad",
            lambda: ([torch.randn(3, dtype=torch.float64)], None),
            TypeError,
            "grad_stats: grads[0] has dtype Double",
        ),
        BadInput(
            "grad_with_gaps",
            lambda: ([torch.randn(3), torch.randn(8)[::2]], None),
            RuntimeError,
            "grad_stats: grads[1] has gaps or overlaps in memory",
        ),
        BadInput(
            "float64_inv_scale",
            lambda: ([torch.randn(3)], torch.ones((), dtype=torch.float64)),
            TypeError,
            "grad_stats: inv_scale must be a float32 tensor, got Double",
        ),
        BadInput(
            "two_element_inv_scale",
            lambda: ([torch.randn(3)], torch.ones(2)),
            RuntimeError,
            "grad_stats: inv_scale must hold exactly one element",
        ),
        BadInput(
            "sparse_grad",
            lambda: ([torch.randn(3).to_sparse()], None),
            NotImplementedError,
            "Could not run 'fusedamp::grad_stats' with arguments from the 'SparseCPU' backend",
        ),
        BadInput(
            "grad_on_cpu",
            lambda: ([torch.randn(3, device="cuda"), torch.randn(3)], None),
            RuntimeError,
            "grad_stats: grads[1] is on cpu, expected cuda:0",
            device="cuda",
        ),
    ),
    returns=("counts", "max_abs"),
    notes="Read-only; grads may mix dtypes. The counts are how each value would fare in fp16.",
)


# --- encode_state and decode_state (CPU only) -----------------------------------------------------


def _storage_order(tensor: Tensor) -> Tensor:
    """The elements of a dense tensor in the order of its storage, as a 1-D tensor."""
    dims = sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d))
    return tensor.permute(*dims).reshape(-1)


# The code forms of [note: block codes]: (offset, shift, bias) of signed narrow, signed wide and
# unsigned codes, and each form's top code's relative value.
_FORMS = {"narrow": (0, 1, 0xB9800000), "wide": (0, 2, 0x33800000), "unsigned": (32, 3, 0x23000000)}
_FORM_TOP = {"narrow": 0x3F7C0000, "wide": 0x3F780000, "unsigned": 0x3F7C0000}
_SMALLEST_CODE = {"narrow": 3, "wide": 4, "unsigned": 3}


def _float32_of_bits(bits: Tensor) -> Tensor:
    return bits.to(torch.int64).bitwise_and(0xFFFFFFFF).to(torch.int32).view(torch.float32)


def _bits_of_float32(values: Tensor) -> Tensor:
    return values.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _code_bits(values: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """[note: block codes] in int64 and float32 arithmetic (each operation rounded once, as the
    kernels do), in storage order: (uint8 codes, bf16 scale bits)."""
    flat = _storage_order(values)
    bits = _bits_of_float32(flat)
    magnitude = bits & 0x7FFFFFFF
    blocks = (flat.numel() + 255) // 256
    padded = torch.zeros(blocks * 256, dtype=torch.int64)
    padded[: flat.numel()] = torch.where(magnitude < 0x7F800000, magnitude, 0)
    block_max = padded.view(blocks, 256).amax(1)
    exponents = torch.zeros(blocks * 256, dtype=torch.int64)
    exponents[: flat.numel()] = magnitude >> 23
    counts = torch.full((blocks,), 256, dtype=torch.int64)
    if blocks:
        counts[-1] = flat.numel() - 256 * (blocks - 1)
    wide = (counts * (block_max >> 23) > exponents.view(blocks, 256).sum(1) + 4 * counts) & signed
    top = torch.where(wide, _FORM_TOP["wide"], _FORM_TOP["narrow"] if signed else _FORM_TOP["unsigned"])
    quotient = _bits_of_float32(_float32_of_bits(block_max) / _float32_of_bits(top))
    scale = ((quotient + 0xFFFF) >> 16).clamp(max=0x7F7F)
    scale = torch.where(block_max < 0x00800000, 0, scale)
    scale_value = _float32_of_bits(scale << 16)
    inverse = torch.where(scale_value == 0, 0.0, torch.tensor(1.0) / scale_value)
    per_element = {
        name: t.repeat_interleave(256)[: flat.numel()] for name, t in (("wide", wide), ("inverse", inverse))
    }
    relative = _float32_of_bits(magnitude) * per_element["inverse"]
    relative_bits = _bits_of_float32(relative)
    codes = torch.zeros_like(bits)
    for form in (("narrow", "wide") if signed else ("unsigned",)):
        offset, shift, bias = _FORMS[form]
        smallest_code = _SMALLEST_CODE[form]
        integer_bits = int(_bits_of_float32(torch.tensor(float(smallest_code + offset))))
        smallest_bits = ((integer_bits << shift) + bias) & 0xFFFFFFFF
        position = relative_bits.clamp(min=smallest_bits, max=_FORM_TOP[form])
        dropped = integer_bits & ~(0xFFFFFFFF >> shift)
        real = _float32_of_bits((((position - bias) & 0xFFFFFFFF) >> shift) | dropped)
        code = (real + 1.5).to(torch.int64) - (offset + 1)
        below = relative_bits < smallest_bits
        if signed:
            scaled = relative * _float32_of_bits(torch.tensor((254 << 23) - smallest_bits))
            code = torch.where(below, torch.where(scaled + 1.5 >= 2.0, smallest_code, 0), code)
        else:
            code = torch.where(below, torch.where(magnitude != 0, smallest_code, 0), code)
        in_form = per_element["wide"] if form == "wide" else ~per_element["wide"]
        codes = torch.where(in_form, code, codes)
    codes = torch.where(magnitude >= 0x7F800000, torch.where(magnitude == 0x7F800000, 2, 1), codes)
    if signed:
        codes = codes | torch.where(magnitude > 0x7F800000, 0, (bits >> 24) & 0x80)
    return codes.to(torch.uint8), (scale | torch.where(wide, 0x8000, 0)).to(torch.int16)


def _encode_samples(device: str, dtype: torch.dtype) -> list[Sample]:
    generator = _generator(23)
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 3.0e38, 1e-40, 1e-30, -2.5, 7.0])
    wide = torch.randn(1027, generator=generator) * 10 ** torch.randint(-8, 3, (1027,), generator=generator)
    samples = []
    for signed in (True, False):
        values = {
            "wide_range_1027": wide if signed else wide.square(),
            "special_values": special,
            "channels_last": _randn((2, 3, 9, 11), torch.float32, generator).to(
                memory_format=torch.channels_last
            ),
            "empty": _randn((0, 3), torch.float32, generator),
        }
        kind = "signed" if signed else "unsigned"
        samples += [Sample(f"{kind}_{name}", (value, signed)) for name, value in values.items()]
    return samples


def _encode_reference(values: Tensor, is_signed: bool) -> Outputs:
    codes, scale_bits = _code_bits(values, is_signed)
    return {"codes": [codes], "scales": [scale_bits.view(torch.bfloat16)]}


def _encode_observe(args: Args, returned: tuple[Tensor, Tensor]) -> Outputs:
    codes, scales = returned
    _same_layout([codes], args[0])
    return {"codes": [_storage_order(codes)], "scales": [scales]}


ENCODE = OpEntry(
    name="encode_state",
    dtypes=(torch.float32,),
    samples=_encode_samples,
    reference=_encode_reference,
    mutates=(),
    tolerances={"codes": EXACT, "scales": EXACT},
    bad_inputs=(
        BadInput(
            "float16_values",
            lambda: (torch.randn(3).half(), True),
            TypeError,
            "encode_state: values must be float32, got Half",
        ),
        BadInput(
            "cuda_values",
            lambda: (torch.randn(3, device="cuda"), True),
            NotImplementedError,
            "Could not run 'fusedamp::encode_state' with arguments from the 'CUDA' backend",
            device="cuda",
        ),
    ),
    devices=("cpu",),
    returns=("codes", "scales"),
    observe=_encode_observe,
    notes="CPU only (the optimizers use it to import and export states). The reference takes the "
    "definition's integer and float32 steps, compared bit for bit (tests/test_codec.py checks the "
    "codes against a float64 reading of the definition).",
)


def _decode_samples(device: str, dtype: torch.dtype) -> list[Sample]:
    generator = _generator(24)
    every_code = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(4)
    scales = torch.tensor([2.0**-20, 1.0, 0.0, -3.0]).bfloat16()  # -3: scale 3, the wide form
    random_codes = torch.randint(0, 256, (3, 5, 7), generator=generator, dtype=torch.uint8)
    random_scales = (2.0 ** torch.randint(-60, 60, (1,), generator=generator).float()).bfloat16()
    samples = []
    for signed in (True, False):
        kind = "signed" if signed else "unsigned"
        samples += [
            Sample(f"{kind}_every_code", (every_code, scales, signed)),
            Sample(
                f"{kind}_channels_last",
                (
                    random_codes.unsqueeze(0).to(memory_format=torch.channels_last).squeeze(0).contiguous(),
                    random_scales,
                    signed,
                ),
            ),
            Sample(f"{kind}_empty", (torch.zeros(0, dtype=torch.uint8), torch.zeros(0).bfloat16(), signed)),
        ]
    return samples


def _relative_code_value(code: Tensor, form: str) -> Tensor:
    """A value code's relative value from the definition in float64: the integer n = code +
    offset = 2^p (1 + m) stands for 2^(2^shift p + floor(2^shift m) + c) (1 + frac(2^shift m)),
    with c putting the top code into [0.5, 1)."""
    offset, shift, _ = _FORMS[form]
    n = (code + offset).double()
    power = torch.floor(torch.log2(n))
    moved = (n / 2**power - 1) * 2**shift
    top = 0x7F if form != "unsigned" else 0xFF
    top_n = top + offset
    top_power = math.floor(math.log2(top_n))
    top_moved = (top_n / 2**top_power - 1) * 2**shift
    top_log = 2**shift * top_power + math.floor(top_moved)  # the top code's value: 2^top_log (1 + frac)
    return 2.0 ** (2**shift * power + torch.floor(moved) - top_log - 1) * (1 + moved - torch.floor(moved))


def _decode_reference(codes: Tensor, scales: Tensor, is_signed: bool) -> Outputs:
    """The definition in float64: rel(code) * scale under the block's form; codes 0, 1, 2: zero,
    NaN, inf."""
    flat = _storage_order(codes).to(torch.int64)
    magnitude = flat & (0x7F if is_signed else 0xFF)
    stored = scales.view(torch.int16).to(torch.int64).repeat_interleave(256)[: flat.numel()]
    scale = (stored & 0x7FFF).to(torch.int16).view(torch.bfloat16).double()
    wide = (stored & 0x8000) != 0
    if is_signed:
        narrow = _relative_code_value(magnitude, "narrow")
        relative = torch.where(wide, _relative_code_value(magnitude, "wide"), narrow)
    else:
        relative = _relative_code_value(magnitude, "unsigned")
    values = relative * scale
    special = torch.where(magnitude == 0, 0.0, torch.where(magnitude == 1, math.nan, math.inf)).double()
    values = torch.where(magnitude >= 3, values, special)
    if is_signed:
        values = torch.where(flat >= 0x80, -values, values)
    return {"values": [values.float().view(codes.shape) if codes.is_contiguous() else values.float()]}


DECODE = OpEntry(
    name="decode_state",
    dtypes=(torch.uint8,),
    samples=_decode_samples,
    reference=_decode_reference,
    mutates=(),
    tolerances={"values": EXACT},
    bad_inputs=(
        BadInput(
            "int8_codes",
            lambda: (torch.zeros(3, dtype=torch.int8), torch.ones(1).bfloat16(), True),
            TypeError,
            "decode_state: codes must be uint8 and scales bfloat16, got Char and BFloat16",
        ),
        BadInput(
            "short_scales",
            lambda: (torch.zeros(300, dtype=torch.uint8), torch.ones(1).bfloat16(), True),
            RuntimeError,
            "decode_state: scales must be a contiguous tensor of one scale per 256 codes (2), got 1",
        ),
        BadInput(
            "cuda_codes",
            lambda: (
                torch.zeros(3, dtype=torch.uint8, device="cuda"),
                torch.ones(1, device="cuda").bfloat16(),
                True,
            ),
            NotImplementedError,
            "Could not run 'fusedamp::decode_state' with arguments from the 'CUDA' backend",
            device="cuda",
        ),
    ),
    devices=("cpu",),
    returns=("values",),
    notes="CPU only; the float64 reading of [note: block codes], compared exactly (every value is an "
    "fp32 number).",
)


OP_TABLE: dict[str, OpEntry] = {
    entry.name: entry
    for entry in (
        UNSCALE,
        CHECK_AND_NORM,
        UPDATE_SCALE,
        ADAMW,
        SGD,
        MUON_MOMENTUM,
        SPLIT,
        JOIN,
        GEMM,
        GRAD_STATS,
        ENCODE,
        DECODE,
    )
}
