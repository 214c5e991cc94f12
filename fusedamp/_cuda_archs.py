"""The CUDA archs a build targets and the GEMM kernels they give it. Standard library only:
setup.py loads this file by path, before fusedamp._C exists.

The wgmma GEMM kernel needs the arch-specific target 9.0a: built for plain 9.0 (what torch picks
for a visible Hopper GPU) it compiles empty. So whenever 9.0 is a target, 9.0a is added, as
torch's own build adds it for its Hopper-only kernels. At run time the gemm checks which code the
device loaded and warns once if it is not the wgmma one.
"""

from __future__ import annotations

import re

# The archs built when TORCH_CUDA_ARCH_LIST is unset and no GPU is visible: HMMA everywhere from
# Ampere on, wgmma on Hopper.
DEFAULT_ARCHS = "8.0;9.0a"

# TORCH_CUDA_ARCH_LIST's named groups, expanded as torch.utils.cpp_extension expands them
# (combined names first, so that "Ampere+Tegra" is not read as "Ampere").
NAMED_ARCHS = {
    "Kepler+Tesla": "3.7",
    "Kepler": "3.5+PTX",
    "Maxwell+Tegra": "5.3",
    "Maxwell": "5.0;5.2+PTX",
    "Pascal": "6.0;6.1+PTX",
    "Volta+Tegra": "7.2",
    "Volta": "7.0+PTX",
    "Turing": "7.5+PTX",
    "Ampere+Tegra": "8.7",
    "Ampere": "8.0;8.6+PTX",
    "Ada": "8.9+PTX",
    "Hopper": "9.0+PTX",
    "Blackwell+Tegra": "11.0",
    "Blackwell": "10.0;10.3;12.0;12.1+PTX",
    "Rubin": "10.7+PTX",
}

ARCH = re.compile(r"^(\d+)\.(\d+)(a|f)?(\+PTX)?$")


def split_arch_list(arch_list: str) -> list[str]:
    """The entries of a TORCH_CUDA_ARCH_LIST value (';' or ' ' separated), names expanded."""
    text = arch_list.replace(" ", ";")
    for name, archs in NAMED_ARCHS.items():
        text = text.replace(name, archs)
    return [arch for arch in text.split(";") if arch]


def detected_archs(capabilities: list[tuple[int, int]], torch_archs: list[str]) -> list[str]:
    """The archs torch builds for when TORCH_CUDA_ARCH_LIST is unset: each visible GPU's compute
    capability, capped at the newest sm_XY in ``torch_archs`` (torch.cuda.get_arch_list()),
    sorted, the last with +PTX."""
    supported = [int(re.sub(r"\D", "", arch.split("_")[1])) for arch in torch_archs if "sm_" in arch]
    newest = max(((sm // 10, sm % 10) for sm in supported), default=None)
    archs: list[str] = []
    for capability in capabilities:
        major, minor = min(capability, newest) if newest else capability
        if f"{major}.{minor}" not in archs:
            archs.append(f"{major}.{minor}")
    archs.sort()
    archs[-1] += "+PTX"
    return archs


def add_wgmma_arch(archs: list[str]) -> tuple[list[str], bool]:
    """``archs`` with 9.0a appended when they target 9.0 without it; and whether it was added."""
    bases = {arch.removesuffix("+PTX") for arch in archs}
    if "9.0" in bases and "9.0a" not in bases:
        return [*archs, "9.0a"], True
    return archs, False


def resolve_archs(
    requested: str | None, capabilities: list[tuple[int, int]], torch_archs: list[str]
) -> tuple[str, str | None]:
    """The TORCH_CUDA_ARCH_LIST to build with, from the requested one (unset, empty or "native":
    the visible GPUs', else DEFAULT_ARCHS), with 9.0a added where 9.0 is targeted; and a line
    for the build log when 9.0a was added, else None."""
    if requested and requested.strip() not in ("", "native"):
        archs = split_arch_list(requested)
        source = f"TORCH_CUDA_ARCH_LIST={requested!r}"
    elif capabilities:
        archs = detected_archs(capabilities, torch_archs)
        source = f"the visible GPUs ({';'.join(archs)})"
    else:
        archs = split_arch_list(DEFAULT_ARCHS)
        source = "the default"
    archs, added = add_wgmma_arch(archs)
    note = (
        f"fusedamp: {source} targets arch 9.0, for which the wgmma GEMM kernel compiles empty; "
        "added 9.0a so that this build has it on Hopper GPUs"
        if added
        else None
    )
    return ";".join(archs), note


# The oldest arch each CUDA major version still compiles for: CUDA 13 dropped Maxwell, Pascal and
# Volta (sm_50 to sm_72); Turing (7.5) is its oldest target.
OLDEST_ARCH = {12: (5, 0), 13: (7, 5)}


def oldest_arch(cuda_major: int) -> tuple[int, int]:
    """The oldest (major, minor) arch a CUDA ``cuda_major`` toolkit compiles for (a CUDA newer than
    OLDEST_ARCH knows: the newest one's; an older one: no limit)."""
    known = [major for major in OLDEST_ARCH if major <= cuda_major]
    return OLDEST_ARCH[max(known)] if known else (0, 0)


def archs_too_old(arch_list: str, cuda_major: int) -> list[str]:
    """The entries of ``arch_list`` that a CUDA ``cuda_major`` toolkit cannot compile for."""
    oldest = oldest_arch(cuda_major)
    too_old = []
    for arch in split_arch_list(arch_list):
        m = ARCH.match(arch)
        if m and (int(m.group(1)), int(m.group(2))) < oldest:
            too_old.append(arch)
    return too_old


def gemm_kernels(arch_list: str) -> list[str]:
    """The GEMM kernels that have code in a build for ``arch_list``: "mma_sync" for any arch from
    8.0 on (SASS or PTX), "wgmma" for 9.0a. The ATen reference path is always there, and is what
    runs on GPUs below sm_80: code for 7.5 holds the mma.sync kernel with an empty body."""
    kernels = []
    parsed = [ARCH.match(arch) for arch in split_arch_list(arch_list)]
    if any(m and int(m.group(1)) >= 8 for m in parsed):
        kernels.append("mma_sync")
    if any(m and m.group(1, 2, 3) == ("9", "0", "a") for m in parsed):
        kernels.append("wgmma")
    return kernels
