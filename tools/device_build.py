"""The fusedamp build carried to a GPU machine: made on a CPU host by prepare_device_build.sh for
the GPU machine's Python, torch and CUDA archs, installed by gpu_check.sh only when all three and
the sources it was built from match what the GPU machine has (else gpu_check.sh builds there). The
library travels xz-compressed (``_C.*.so.xz``: every CPU ISA and two CUDA archs strip to ~70 MiB,
and compress ~8x, which keeps what is copied to the GPU machine small); a plain ``_C.*.so`` is
accepted too.

    python -m tools.device_build manifest --folder .device_build --archs "8.0;9.0a"
    python -m tools.device_build install --folder .device_build --archs "8.0;9.0a"
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import lzma
import os
import platform
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the extension is compiled from: a change to any of these makes a carried build stale.
SOURCES = ("csrc", "setup.py", "fusedamp/_cuda_archs.py")
MANIFEST = "manifest.json"


def source_digest(root: str = ROOT) -> str:
    """sha256 over the path and bytes of every file the build compiles from, in path order."""
    paths = []
    for source in SOURCES:
        full = os.path.join(root, source)
        if os.path.isdir(full):
            for folder, _, files in os.walk(full):
                paths += [os.path.relpath(os.path.join(folder, name), root) for name in files]
        elif os.path.exists(full):
            paths.append(source)
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.encode() + b"\0")
        with open(os.path.join(root, path), "rb") as f:
            digest.update(f.read() + b"\0")
    return digest.hexdigest()


def environment(archs: str, root: str = ROOT) -> dict[str, str]:
    """What a build must have been made for to run here: Python major.minor, torch, archs, sources."""
    import torch

    return {
        "python": ".".join(platform.python_version_tuple()[:2]),
        "torch": torch.__version__,
        "cuda_archs": archs,
        "sources": source_digest(root),
    }


def write_manifest(folder: str, archs: str, root: str = ROOT) -> dict[str, str]:
    manifest = environment(archs, root)
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
    return manifest


def mismatch(folder: str, archs: str, root: str = ROOT) -> str | None:
    """Why the build in `folder` cannot be used here, or None when it can."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        return f"no carried build ({path} does not exist)"
    with open(path) as f:
        carried = json.load(f)
    if not libraries(folder):
        return f"{folder} holds no _C.*.so or _C.*.so.xz"
    here = environment(archs, root)
    for key, value in here.items():
        if carried.get(key) != value:
            return f"the carried build is for {key} {carried.get(key)!r}, this machine has {value!r}"
    return None


def libraries(folder: str) -> list[str]:
    return glob.glob(os.path.join(folder, "_C.*.so")) + glob.glob(os.path.join(folder, "_C.*.so.xz"))


def install(folder: str, archs: str, root: str = ROOT) -> str | None:
    """Copies (or decompresses) the carried _C and its _build_meta.py into root/fusedamp when they
    match; returns the mismatch otherwise (and copies nothing)."""
    reason = mismatch(folder, archs, root)
    if reason is not None:
        return reason
    package = os.path.join(root, "fusedamp")
    for path in libraries(folder):
        target = os.path.join(package, os.path.basename(path).removesuffix(".xz"))
        if path.endswith(".xz"):
            with lzma.open(path) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out)
            os.chmod(target, 0o755)
        else:
            shutil.copy2(path, target)
    shutil.copy2(os.path.join(folder, "_build_meta.py"), os.path.join(package, "_build_meta.py"))
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.device_build", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("action", choices=("manifest", "check", "install"))
    parser.add_argument("--folder", required=True, help="the carried build's folder")
    parser.add_argument("--archs", required=True, help="TORCH_CUDA_ARCH_LIST of the build")
    parser.add_argument("--root", default=ROOT, help="the sources' checkout (default: this one)")
    args = parser.parse_args(argv)
    if args.action == "manifest":
        print(json.dumps(write_manifest(args.folder, args.archs, args.root)))
        return 0
    action = mismatch if args.action == "check" else install
    reason = action(args.folder, args.archs, args.root)
    if reason is not None:
        print(reason)
        return 1
    print(
        f"device_build: the build in {args.folder} matches"
        + (" and is installed" if args.action == "install" else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
