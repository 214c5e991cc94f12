"""Every op-table entry: opcheck, CPU vs float64 per ISA, CUDA vs CPU, bad inputs, table vs registry."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

import pytest
import torch
from conftest import needs_cuda
from op_table import (
    MANY,
    OP_TABLE,
    OpEntry,
    Outputs,
    Sample,
    assert_matches_reference,
    assert_outputs_close,
    assert_unchanged,
    clone_args,
    read_only_tensors,
    snapshot,
    tensors_in,
)

import fusedamp

# torch.library.opcheck's aot_dispatch_dynamic check traces with a symbolic size per tensor (on
# the MANY-tensor samples that costs seconds each and finds nothing the smaller samples do not),
# and compares returned tensors with NaN != NaN (split and join take NaN bit patterns, decode_state
# makes NaNs): those
# samples run the other checks; the op's other samples run them all.
FEW_TENSORS = 24
CHECKS_WITHOUT_AOT_DISPATCH = ("test_schema", "test_autograd_registration", "test_faketensor")


@functools.cache
def cpu_samples(op: str, dtype: torch.dtype) -> list[Sample]:
    """Built once per op and dtype; the tests run on copies."""
    return OP_TABLE[op].samples("cpu", dtype)


@functools.cache
def cpu_expected(op: str, dtype: torch.dtype, index: int) -> Outputs:
    """The float64 reference of a CPU sample, computed once for every CPU ISA."""
    return OP_TABLE[op].reference(*clone_args(cpu_samples(op, dtype)[index].args))


def sample_on(op: str, device: str, dtype: torch.dtype, index: int) -> Sample:
    if device == "cpu":
        return cpu_samples(op, dtype)[index]
    sample = OP_TABLE[op].samples(device, dtype)[index]
    assert sample.name == cpu_samples(op, dtype)[index].name
    return sample


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cases(device: str | None = None, uses_cpu_isa: bool | None = None) -> Iterator[pytest.ParameterSet]:
    """(op, device, dtype, sample index) for every sample of every op on every device it has."""
    for entry in OP_TABLE.values():
        if uses_cpu_isa is not None and entry.uses_cpu_isa != uses_cpu_isa:
            continue
        for on in entry.devices:
            if device is not None and on != device:
                continue
            for dtype in entry.dtypes:
                for index, sample in enumerate(cpu_samples(entry.name, dtype)):
                    yield pytest.param(
                        entry.name,
                        on,
                        dtype,
                        index,
                        id=f"{entry.name}-{on}-{dtype_name(dtype)}-{sample.name}",
                        marks=[needs_cuda] if on == "cuda" else [],
                    )


CASE_NAMES = ("op", "device", "dtype", "index")


@pytest.mark.parametrize(CASE_NAMES, list(cases()))
def test_opcheck(op: str, device: str, dtype: torch.dtype, index: int) -> None:
    """Schema (aliasing and mutation as declared), fake kernel, autograd registration and
    (on samples of few tensors) AOT dispatch with dynamic shapes."""
    args = clone_args(sample_on(op, device, dtype, index).args)
    tensors = list(tensors_in(args))
    has_nan = any(t.is_floating_point() and t.isnan().any() for t in tensors)
    # decode_state makes NaNs from codes: look at what an op returns, not only at its inputs.
    returns_nan = bool(OP_TABLE[op].returns) and (
        has_nan
        or any(
            t.is_floating_point() and t.isnan().any() for t in tensors_in(OP_TABLE[op].call(clone_args(args)))
        )
    )
    checks = {}
    if len(tensors) > FEW_TENSORS or returns_nan:
        checks["test_utils"] = CHECKS_WITHOUT_AOT_DISPATCH
    torch.library.opcheck(OP_TABLE[op].op, args, **checks)


@pytest.mark.parametrize(CASE_NAMES, list(cases(device="cpu", uses_cpu_isa=True)))
def test_cpu_matches_float64_on_every_isa(
    cpu_isa: str, op: str, device: str, dtype: torch.dtype, index: int
) -> None:
    assert_matches_reference(
        OP_TABLE[op], sample_on(op, device, dtype, index).args, cpu_expected(op, dtype, index)
    )


@pytest.mark.parametrize(CASE_NAMES, list(cases(device="cpu", uses_cpu_isa=False)))
def test_cpu_matches_float64(op: str, device: str, dtype: torch.dtype, index: int) -> None:
    assert_matches_reference(OP_TABLE[op], sample_on(op, device, dtype, index).args)


@pytest.mark.parametrize(CASE_NAMES, list(cases(device="cuda")))
def test_cuda_matches_cpu(op: str, device: str, dtype: torch.dtype, index: int) -> None:
    """Each backend is within the op's tolerances of float64, so within twice them of each other
    (zero for the exact outputs: unscaled grads, found_inf, steps, counts, scales)."""
    entry = OP_TABLE[op]
    cpu_args = clone_args(sample_on(op, "cpu", dtype, index).args)
    cuda_args = clone_args(sample_on(op, device, dtype, index).args)
    read_only = read_only_tensors(entry, cuda_args)
    before = snapshot(tuple(read_only))
    cpu = entry.outputs(cpu_args, entry.call(cpu_args))
    returned = entry.call(cuda_args)
    assert_outputs_close(entry, entry.outputs(cuda_args, returned), cpu, factor=2.0)
    if entry.invariants is not None:
        entry.invariants(cuda_args, returned)
    assert_unchanged(before, tuple(read_only))


def bad_cases() -> Iterator[pytest.ParameterSet]:
    for entry in OP_TABLE.values():
        for index, bad in enumerate(entry.bad_inputs):
            yield pytest.param(
                entry.name,
                bad.device,
                index,
                id=f"{entry.name}-{bad.device}-{bad.name}",
                marks=[needs_cuda] if bad.device == "cuda" else [],
            )


@pytest.mark.parametrize(("op", "device", "index"), list(bad_cases()))
def test_bad_input_is_refused_and_writes_nothing(op: str, device: str, index: int) -> None:
    bad = OP_TABLE[op].bad_inputs[index]
    args = bad.make_args()
    before = snapshot(args)
    with pytest.raises(bad.error, match=re.escape(bad.message)):
        OP_TABLE[op].call(args)
    assert_unchanged(before, args)


# --- the table itself --------------------------------------------------------------------------


def test_every_registered_op_has_an_entry() -> None:
    registered = {
        name.removeprefix("fusedamp::")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("fusedamp::")
    }
    assert registered == set(OP_TABLE)


@pytest.mark.parametrize("entry", OP_TABLE.values(), ids=lambda entry: entry.name)
def test_entry_matches_the_schema(entry: OpEntry) -> None:
    """What the table says an op writes and returns is what its schema declares, and it lists
    CUDA exactly when the op has a CUDA kernel (in a build with CUDA kernels)."""
    schema = entry.op._schema
    written = tuple(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
    assert entry.mutates == written
    assert len(entry.returns) == len(schema.returns)
    if fusedamp.build_info()["cuda_compiled"]:
        has_cuda = torch._C._dispatch_has_kernel_for_dispatch_key(f"fusedamp::{entry.name}", "CUDA")
        assert has_cuda == ("cuda" in entry.devices)
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fusedamp::{entry.name}", "CPU")


def grads_argument(entry: OpEntry) -> int | None:
    """The position of the op's grads list (every op over tensor lists has one), else None."""
    names = [argument.name for argument in entry.op._schema.arguments]
    return names.index("grads") if "grads" in names else None


LIST_OPS = [entry for entry in OP_TABLE.values() if grads_argument(entry) is not None]


def test_list_ops_are_the_ops_over_tensor_lists() -> None:
    over_lists = {
        entry.name
        for entry in OP_TABLE.values()
        if any(str(argument.type) == "List[Tensor]" for argument in entry.op._schema.arguments)
    }
    assert {entry.name for entry in LIST_OPS} == over_lists


@pytest.mark.parametrize("entry", LIST_OPS, ids=lambda entry: entry.name)
def test_list_ops_have_the_samples_that_find_bugs(entry: OpEntry) -> None:
    """For every dtype, grads lists of: many tensors, empty tensors among others, a tensor of odd
    size past a CPU chunk (2^15), grads of another dtype; and bad inputs on CPU and on CUDA."""
    index = grads_argument(entry)
    for dtype in entry.dtypes:
        lists = [sample.args[index] for sample in cpu_samples(entry.name, dtype)]
        assert any(len(grads) >= MANY for grads in lists)
        assert any(len(grads) > 1 and any(g.numel() == 0 for g in grads) for grads in lists)
        assert any(any(g.numel() > 2**15 and g.numel() % 2 for g in grads) for grads in lists)
        assert any(any(g.dtype != dtype for g in grads) for grads in lists)
    assert {bad.device for bad in entry.bad_inputs} == {"cpu", "cuda"}
