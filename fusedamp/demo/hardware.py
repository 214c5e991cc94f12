"""What the demo's hardware computes natively in half precision, and what that means for AMP.

Mixed precision is only faster where the hardware does half-precision arithmetic: Tensor
Cores on a GPU (fp16 from compute capability 7.0, bf16 from 8.0), AVX512-BF16 / AMX on a CPU
(AVX512-FP16 / AMX-FP16 for fp16). Elsewhere the half types are converted to fp32 around
fp32 arithmetic, and on a CPU with AVX2 only, bf16 convolutions fall back to code paths many
times slower than fp32. :func:`detect` gathers what torch (and the CPU's flags) report;
:func:`describe_cpu` and :func:`describe_cuda` turn those facts into a :class:`Hardware`
note, and :func:`advice` explains a measured speedup with it.
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Hardware", "detect", "describe_cpu", "describe_cuda", "advice"]

# The seed experiment's speedup of AMP over fp32 (ResNet-50 on FashionMNIST, on a GPU).
SEED_SPEEDUP = 2.36

# CPU flags (Linux /proc/cpuinfo) that mean native arithmetic in a half type, by type.
_NATIVE_FLAGS = {
    "bf16": {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16", "bf16": "Arm BF16"},
    "fp16": {"avx512_fp16": "AVX512-FP16", "amx_fp16": "AMX-FP16", "asimdhp": "Arm FP16"},
}
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) that still let it use those instructions: the names
# oneDNN gives the ISAs from AVX512_CORE_BF16 (bf16) / AVX512_CORE_FP16 (fp16) upwards.
_ONEDNN_CAPS_KEEPING = {
    "bf16": ("BF16", "FP16", "AMX", "AVX10", "ALL", "DEFAULT"),
    "fp16": ("FP16", "AVX10", "ALL", "DEFAULT"),
}


@dataclass(frozen=True)
class Hardware:
    """What one device computes natively: ``native`` maps ``"bf16"`` / ``"fp16"`` to whether
    its matmuls and convolutions run in that type in hardware, ``reasons`` says why or why not
    for each, and ``facts`` are the reports the verdicts rest on (for the demo's header).

    >>> describe_cuda("A100", (8, 0)).native
    {'bf16': True, 'fp16': True}
    """

    device_type: str
    name: str
    native: dict[str, bool]
    reasons: dict[str, str]
    facts: tuple[str, ...]

    def summary(self) -> str:
        """One line for the demo's header."""
        verdicts = "; ".join(f"{kind} {'native' if ok else 'NOT native'} ({self.reasons[kind]})"
                             for kind, ok in self.native.items())
        return f"{self.name} [{', '.join(self.facts)}]: {verdicts}"


def describe_cuda(name: str, capability: tuple[int, int]) -> Hardware:
    """A GPU of compute ``capability``: fp16 Tensor Cores from 7.0, bf16 ones from 8.0.

    >>> describe_cuda("T4", (7, 5)).reasons["bf16"]
    'no bf16 Tensor Cores before compute capability 8.0'
    """
    firsts = {"bf16": (8, 0), "fp16": (7, 0)}
    native = {kind: capability >= first for kind, first in firsts.items()}
    reasons = {kind: f"{kind} Tensor Cores" if native[kind]
               else f"no {kind} Tensor Cores before compute capability {first[0]}.{first[1]}"
               for kind, first in firsts.items()}
    return Hardware("cuda", name, native, reasons, (f"compute capability {capability[0]}.{capability[1]}",))


def describe_cpu(
    name: str,
    flags: set[str],
    torch_capability: str | None,
    onednn_supports: dict[str, bool | None],
    onednn_cap: str | None,
) -> Hardware:
    """A CPU from its ``flags`` (``/proc/cpuinfo``), the ISA torch's own kernels use
    (``torch.backends.cpu.get_cpu_capability()``), whether oneDNN (which runs torch's CPU
    convolutions and matmuls) supports each half type (None: torch does not say) and the
    ``ONEDNN_MAX_CPU_ISA`` cap, if any.

    >>> cpu = describe_cpu("EPYC", {"avx2", "fma"}, "AVX2", {"bf16": False, "fp16": False}, None)
    >>> cpu.native, cpu.reasons["bf16"]
    ({'bf16': False, 'fp16': False}, 'no AVX512-BF16, AMX-BF16 or Arm BF16 instructions')
    """
    native = {}
    reasons = {}
    for kind, known in _NATIVE_FLAGS.items():
        instructions = [label for flag, label in known.items() if flag in flags]
        capped = onednn_cap is not None and not any(key in onednn_cap.upper()
                                                    for key in _ONEDNN_CAPS_KEEPING[kind])
        if not instructions:
            labels = list(known.values())
            reasons[kind] = f"no {', '.join(labels[:-1])} or {labels[-1]} instructions"
        elif capped:
            reasons[kind] = f"{', '.join(instructions)}, but oneDNN is capped at {onednn_cap}"
        elif onednn_supports.get(kind) is False:
            reasons[kind] = f"{', '.join(instructions)}, but oneDNN reports no {kind} support"
        else:
            reasons[kind] = ", ".join(instructions)
        native[kind] = bool(instructions) and onednn_supports.get(kind) is not False and not capped
    facts = [f"torch CPU kernels {torch_capability or 'unknown'}"]
    if onednn_cap is not None:
        facts.append(f"ONEDNN_MAX_CPU_ISA={onednn_cap}")
    return Hardware("cpu", name, native, reasons, tuple(facts))


def _guarded(call: Callable[[], object]) -> object | None:
    # Private torch APIs come and go between versions: a missing one means "torch does not say".
    with contextlib.suppress(AttributeError, RuntimeError):
        return call()
    return None


def _cpu_flags_and_name() -> tuple[set[str], str]:
    flags: set[str] = set()
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("flags", "Features") and not flags:  # x86 / Arm
                flags = set(value.split())
            elif key == "model name" and value.strip():
                name = value.strip()
    return flags, name


def detect(device: torch.device) -> Hardware:
    """What ``device`` computes natively in bf16 and fp16 (see the module docstring)."""
    if device.type == "cuda":
        return describe_cuda(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
    flags, name = _cpu_flags_and_name()
    # Older torch reports AMX itself (every CPU with AMX tiles has AMX-BF16): trust it where
    # /proc/cpuinfo is missing.
    if _guarded(lambda: torch._C._cpu._is_amx_tile_supported()):
        flags.add("amx_bf16")
    onednn_supports = {
        "bf16": _guarded(lambda: bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())),
        "fp16": _guarded(lambda: bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())),
    }
    capability = _guarded(lambda: torch.backends.cpu.get_cpu_capability())
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return describe_cpu(name, flags, None if capability is None else str(capability), onednn_supports, cap)


def advice(hardware: Hardware, dtype: str, speedup: float | None, mode: str = "AMP") -> list[str]:
    """Sentences explaining what AMP in ``dtype`` ("bf16" or "fp16") can do on ``hardware``,
    and the ``speedup`` over fp32 that ``mode`` measured (None when fp32 did not run).

    >>> advice(describe_cuda("A100", (8, 0)), "bf16", 2.1)[0]
    'This GPU computes bf16 natively (bf16 Tensor Cores): AMP ran 2.10x as fast as fp32 here.'
    """
    device = "GPU" if hardware.device_type == "cuda" else "CPU"
    if hardware.native[dtype]:
        line = f"This {device} computes {dtype} natively ({hardware.reasons[dtype]})"
        if speedup is None:
            return [line + "."]
        lines = [f"{line}: {mode} ran {speedup:.2f}x as fast as fp32 here."]
        if speedup < 1.0:
            lines.append("The faster arithmetic did not pay off in this run: the casts to and from "
                         f"{dtype}, memory traffic and per-op overhead outweighed it (narrow layers and "
                         "small batches leave it little to do).")
        return lines
    line = (f"This {device} has no native {dtype} arithmetic ({hardware.reasons[dtype]}): its {dtype} "
            "matmuls and convolutions convert to fp32 and back on slower code paths")
    if speedup is None:
        lines = [line + "."]
    elif speedup < 1.0:
        lines = [f"{line}, so AMP is slower here: {mode} ran at {speedup:.2f}x the speed of fp32."]
    else:
        lines = [f"{line}; {mode} still ran {speedup:.2f}x as fast as fp32 here."]
    if device == "CPU":
        lines.append(f"That is this CPU, not mixed precision: on a GPU with Tensor Cores (fp16 from "
                     f"compute capability 7.0, bf16 from 8.0) AMP does its matmuls and convolutions "
                     f"in half precision (the seed experiment: {SEED_SPEEDUP}x on ResNet-50), and "
                     "CPUs with AVX512-BF16 or AMX run bf16 natively.")
    elif hardware.native["fp16"]:
        lines.append("This GPU has fp16 Tensor Cores: run the AMP modes in fp16 (--dtype fp16).")
    return lines
