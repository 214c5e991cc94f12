"""FusedAdamW / FusedSGD steps against torch.optim (foreach, fused) and DeepSpeedCPUAdam for
fp32 params, and against the O2 master-weight recipes for fp16/bf16 params, as fractions of the
copy and in-place stream bandwidth.

Run from the repository root: python -m benchmarks.bench_optim [--device cpu] [--json PATH]

Each step is timed plain and "scaled", as a GradScaler drives it (grad_scale and found_inf
set; torch's foreach path unscales the grads first, as torch.amp.GradScaler does for it). A
scaled fusedamp step either writes the unscaled grads back (the default) or not
(write_unscaled_grads=False). Effective GB/s counts the bytes the job needs:
AdamW reads p, g, m, v and writes p, m, v (28 B/param for fp32, and for half params with an
fp32 master: g 2 + master 4 + m + v in, master + m + v + param 2 out); SGD with momentum
needs 20 B/param; a grad write-back adds the grad's bytes. The O2 recipe moves more bytes for
the same job (copy the half grads to fp32, fused step on the fp32 masters, copy them back): per
tensor, as a user writes it, and on flat buffers (one copy and one fused step over all params,
as Apex and Megatron keep them); DeepSpeedCPUAdam's recipe is the per-tensor one with its step.
DeepSpeedCPUAdam is an optional peer: its rows appear when ``deepspeed`` is importable.

The coded modes (low-memory state) are AdamW rows of their own: int8 (8-bit block codes) or bf16
moments, for fp32 params, bf16 params with fp32 / remainder masters, and stochastically rounded
bf16 params without a master. Their bytes per param (CODED_JOB_BYTES) count 1 byte per int8
moment element read and written (the scales add 1/64 of a byte); each row also reports the bytes
per param the state holds at rest ("B/param at rest": param + grad + every state tensor, measured
from the tensors), and for fp32 params bitsandbytes' and torchao's AdamW8bit are optional peers
(rows when ``bitsandbytes`` / ``torchao`` are importable).

On CPU every peer is timed at each thread count of ``--threads`` (default: 1 and all).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import (
    benchmark_args,
    copy_peer,
    environment,
    format_table,
    gigabytes_per_second,
    round_ratio_range,
    stable_medians,
    thread_counts,
    time_round_robin,
    write_json,
)
from fusedamp.optim import FusedAdamW, FusedSGD

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TENSORS = 200
DEFAULT_ELEMENTS = {"cpu": 16 << 20, "cuda": 64 << 20}  # on a GPU an fp32 AdamW step then moves 1.9 GB
# Bytes per param of each job without the grad write-back (see the module docstring).
JOB_BYTES = {"adamw": 28, "sgd": 20}
OPTIONS = {"adamw": {"lr": 1e-3}, "sgd": {"lr": 1e-3, "momentum": 0.9}}
TORCH_CLASSES = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
FUSED_CLASSES = {"adamw": FusedAdamW, "sgd": FusedSGD}
# The speed targets on a 2-core CPU with all threads: fusedamp over its peer.
TARGETS = {
    ("adamw", "fp32"): {"torch fused": 1.35, "deepspeed": 1.2},
    ("adamw", "half"): {"torch O2 recipe, flat": 1.4, "torch O2 recipe": 2.0},
    ("sgd", "fp32"): {"torch fused": 1.2},
    ("sgd", "half"): {"torch O2 recipe": 1.5},
}
# The coded rows: bytes a param moves (read + written), and the targets over peers.
CODED_JOB_BYTES = {
    ("fp32", "fusedamp int8 moments"): 16,  # p 4+4, g 4, m 1+1, v 1+1
    ("fp32", "fusedamp bf16 moments"): 20,
    ("bf16", "fusedamp int8 moments"): 18,  # g 2, p 2+2 (edited-param check), master 4+4, m 2, v 2
    ("bf16", "fusedamp remainder int8"): 14,  # g 2, p 2+2, remainder 2+2, m 2, v 2
    ("bf16", "fusedamp stochastic int8"): 10,  # g 2, p 2+2, m 2, v 2
    ("bf16", "fusedamp stochastic bf16 moments"): 14,
}
CODED_MODES = {
    "fusedamp int8 moments": {"moments": "int8"},
    "fusedamp bf16 moments": {"moments": "bf16"},
    "fusedamp remainder int8": {"moments": "int8", "master_weights": "remainder"},
    "fusedamp stochastic int8": {"moments": "int8", "master_weights": "stochastic"},
    "fusedamp stochastic bf16 moments": {"moments": "bf16", "master_weights": "stochastic"},
}
CODED_TARGETS = {
    ("fp32", "fusedamp int8 moments"): {
        "fusedamp": 1.5, "torch fused": 1.5, "bitsandbytes AdamW8bit": 20.0, "torchao AdamW8bit": 20.0,
    },
    ("bf16", "fusedamp remainder int8"): {"fusedamp": 1.6, "torch O2 recipe, flat": 2.0},
}
# At rest: int8 moments <= 2.1 B/param for both moments; whole-state bounds per mode.
AT_REST_TARGETS = {
    ("bf16", "fusedamp stochastic int8"): 6.1,
    ("bf16", "fusedamp remainder int8"): 8.1,
}
STREAM_TARGET = 0.85  # of the in-place stream ceiling, every fused row
THREAD_SCALING = 1.3  # all threads over one, where the in-place stream scales that much
COPY, STREAM = "copy", "stream a.add_(x, alpha)"


def param_sizes(total: int, count: int, seed: int = 0) -> list[int]:
    """``count`` odd sizes spread log-uniformly over three decades (a few large matrices, many
    small ones, as in a model), adding up to about ``total``."""
    rng = random.Random(seed)
    weights = [10 ** rng.uniform(0.0, 3.0) for _ in range(count)]
    scale = total / sum(weights)
    return [max(int(w * scale), 1) | 1 for w in weights]


class Steps:
    """One dtype's params and grads, shared by all its peers (each keeps its own state)."""

    def __init__(self, sizes: list[int], dtype: torch.dtype, device: str) -> None:
        self.device = device
        self.params = [torch.randn(n, device=device).to(dtype).requires_grad_() for n in sizes]
        for param in self.params:
            param.grad = torch.randn(param.shape, device=device).to(dtype)
        self.grads = [p.grad for p in self.params]
        # A scale of 1 keeps every grad as it is, while each scaled step still multiplies by it.
        self.scale = torch.ones((), device=device)
        self.found_inf = torch.zeros((), device=device)
        self.coded: dict[str, torch.optim.Optimizer] = {}  # the coded rows' optimizers, by peer

    def eight_bit_peers(self) -> dict[str, Callable[[], object]]:
        """bitsandbytes' and torchao's AdamW8bit on the fp32 params, where importable."""
        peers: dict[str, Callable[[], object]] = {}
        try:
            import bitsandbytes

            opt = bitsandbytes.optim.AdamW8bit(self.params, **OPTIONS["adamw"])
            self.coded["bitsandbytes AdamW8bit"] = opt
            peers["bitsandbytes AdamW8bit"] = opt.step
        except (ImportError, RuntimeError):
            pass
        try:
            from torchao.optim import AdamW8bit

            opt = AdamW8bit(self.params, **OPTIONS["adamw"])
            self.coded["torchao AdamW8bit"] = opt
            peers["torchao AdamW8bit"] = opt.step
        except (ImportError, RuntimeError):
            pass
        return peers

    def bytes_at_rest(self, opt: torch.optim.Optimizer) -> float:
        """Param + grad + every state tensor of ``opt``, per param, measured from the tensors."""
        total = sum(p.numel() * p.element_size() * 2 for p in self.params)
        for state in opt.state.values():
            for value in state.values():
                if not isinstance(value, torch.Tensor):
                    continue
                if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
                    # torchao's quantized states: a tensor subclass over its codes and scales.
                    names, _ = value.__tensor_flatten__()
                    total += sum(getattr(value, n).numel() * getattr(value, n).element_size() for n in names)
                else:
                    total += value.numel() * value.element_size()
        return total / sum(p.numel() for p in self.params)

    def scaled(self, opt: torch.optim.Optimizer) -> Callable[[], None]:
        """opt.step() as a GradScaler with a fused-capable optimizer runs it."""

        def step() -> None:
            opt.grad_scale, opt.found_inf = self.scale, self.found_inf
            opt.step()
            del opt.grad_scale, opt.found_inf

        return step

    def fusedamp(self, kind: str, **options: Any) -> torch.optim.Optimizer:
        return FUSED_CLASSES[kind](self.params, **OPTIONS[kind], **options)

    def torch_peers(self, kind: str) -> dict[str, Callable[[], object]]:
        torch_cls = TORCH_CLASSES[kind]
        foreach = torch_cls(self.params, **OPTIONS[kind], foreach=True)
        fused = torch_cls(self.params, **OPTIONS[kind], fused=True)
        inv_scale = self.scale.double().reciprocal().float()

        def foreach_scaled() -> None:
            torch._amp_foreach_non_finite_check_and_unscale_(self.grads, self.found_inf, inv_scale)
            foreach.step()

        return {
            "torch foreach": foreach.step,
            "torch fused": fused.step,
            "torch foreach, scaled": foreach_scaled,
            "torch fused, scaled": self.scaled(fused),
        }

    def o2_recipe(self, kind: str) -> dict[str, Callable[[], object]]:
        """PyTorch's way to master weights: fp32 copies of params and grads, fused step on those."""
        masters = [p.detach().float().requires_grad_() for p in self.params]
        for master in masters:
            master.grad = torch.empty_like(master)
        master_grads = [m.grad for m in masters]
        half_params = [p.detach() for p in self.params]
        opt = TORCH_CLASSES[kind](masters, **OPTIONS[kind], fused=True)

        def recipe(step: Callable[[], object]) -> Callable[[], None]:
            def run() -> None:
                torch._foreach_copy_(master_grads, self.grads)
                step()
                torch._foreach_copy_(half_params, masters)

            return run

        return {"torch O2 recipe": recipe(opt.step), "torch O2 recipe, scaled": recipe(self.scaled(opt))}

    def flat_o2_recipe(self, kind: str) -> dict[str, Callable[[], object]]:
        """The O2 recipe on flat buffers: the half params and grads live in one buffer each (as
        a framework that flattens them keeps them), so each copy and the step are one kernel."""
        flat_params = torch.cat([p.detach().reshape(-1) for p in self.params])
        flat_grads = torch.cat([g.reshape(-1) for g in self.grads])
        master = flat_params.float().requires_grad_()
        master.grad = torch.empty_like(master)
        opt = TORCH_CLASSES[kind]([master], **OPTIONS[kind], fused=True)

        def run() -> None:
            master.grad.copy_(flat_grads)
            opt.step()
            flat_params.copy_(master)

        return {"torch O2 recipe, flat": run}

    def deepspeed(self, kind: str, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
        """DeepSpeedCPUAdam (AdamW mode): on the fp32 params, or its O2 recipe for half ones."""
        if kind != "adamw" or torch.device(self.device).type != "cpu":
            return {}
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except ImportError:
            return {}
        options = {"lr": OPTIONS[kind]["lr"], "weight_decay": 1e-2, "adamw_mode": True}
        if dtype == torch.float32:
            return {"deepspeed": DeepSpeedCPUAdam(self.params, **options).step}
        masters = [p.detach().float().requires_grad_() for p in self.params]
        for master in masters:
            master.grad = torch.empty_like(master)
        master_grads = [m.grad for m in masters]
        opt = DeepSpeedCPUAdam(masters, **options)
        half_params = [p.detach() for p in self.params]

        def run() -> None:
            torch._foreach_copy_(master_grads, self.grads)
            opt.step()
            torch._foreach_copy_(half_params, masters)

        return {"deepspeed O2 recipe": run}


def peers_for(kind: str, dtype: torch.dtype, steps: Steps) -> dict[str, Callable[[], object]]:
    ours = steps.fusedamp(kind)
    no_write = steps.fusedamp(kind, write_unscaled_grads=False)
    peers: dict[str, Callable[[], object]] = {
        "fusedamp": ours.step,
        "fusedamp, scaled": steps.scaled(ours),
        "fusedamp, scaled, no grad write": steps.scaled(no_write),
    }
    if dtype == torch.bfloat16:
        peers["fusedamp remainder"] = steps.fusedamp(kind, master_weights="remainder").step
    dtype_name = next(name for name, d in DTYPES.items() if d == dtype)
    if kind == "adamw":
        for name, options in CODED_MODES.items():
            if (dtype_name, name) in CODED_JOB_BYTES:
                steps.coded[name] = steps.fusedamp(kind, **options)
                peers[name] = steps.coded[name].step
        if dtype == torch.float32:
            peers.update(steps.eight_bit_peers())
    if dtype == torch.float32:
        peers.update(steps.torch_peers(kind))
    else:
        peers.update(steps.o2_recipe(kind))
        peers.update(steps.flat_o2_recipe(kind))
    peers.update(steps.deepspeed(kind, dtype))
    return peers


def stream_peer(numel: int, device: str) -> tuple[Callable[[], object], int]:
    """The in-place streaming ceiling a fused update can reach: a.add_(x, alpha) reads two fp32
    tensors and writes one."""
    a = torch.ones(numel, device=device)
    x = torch.zeros(numel, device=device)  # a keeps its values; every element is still read and written
    return (lambda: a.add_(x, alpha=0.5)), 3 * numel * 4


def job_bytes(kind: str, peer: str, dtype: torch.dtype, numel: int) -> int:
    dtype_name = next(name for name, d in DTYPES.items() if d == dtype)
    if (dtype_name, peer) in CODED_JOB_BYTES:
        return numel * CODED_JOB_BYTES[(dtype_name, peer)]
    writes_grads = "scaled" in peer and "no grad write" not in peer
    return numel * (JOB_BYTES[kind] + (dtype.itemsize if writes_grads else 0))


def reference_peer(peer: str, dtype: torch.dtype) -> dict[str, str]:
    """The peers a fusedamp row is compared with (plain with plain, scaled with scaled)."""
    if "scaled" in peer:
        names = ["torch fused", "torch foreach"] if dtype == torch.float32 else ["torch O2 recipe"]
        return {name: name + ", scaled" for name in names}
    if dtype == torch.float32:
        names = ["torch fused", "torch foreach", "deepspeed"]
    else:
        names = ["torch O2 recipe", "torch O2 recipe, flat", "deepspeed O2 recipe"]
    if peer in CODED_MODES:
        names = ["fusedamp", *names, "bitsandbytes AdamW8bit", "torchao AdamW8bit"]
    return {name: name for name in names}


def measure(
    kind: str, dtype_name: str, sizes: list[int], device: str, rounds: int, threads: int
) -> list[dict[str, Any]]:
    """Every peer of one optimizer and dtype, timed in turns with the copy and stream
    yardsticks, as rows."""
    dtype = DTYPES[dtype_name]
    numel = sum(sizes)
    steps = Steps(sizes, dtype, device)
    peers = peers_for(kind, dtype, steps)
    # The yardsticks take turns with the steps: these hosts switch between memory speeds within
    # minutes, and a ceiling measured apart from the steps could come from the other speed.
    peers[COPY], copy_bytes = copy_peer(numel * 4, device)
    peers[STREAM], stream_bytes = stream_peer(numel, device)
    samples = time_round_robin(peers, device, rounds)
    seconds, kept = stable_medians(samples)
    copy_rate = gigabytes_per_second(copy_bytes, seconds.pop(COPY))
    stream_rate = gigabytes_per_second(stream_bytes, seconds.pop(STREAM))
    case = dtype_name if torch.device(device).type != "cpu" else f"{dtype_name}, {threads} threads"
    rows = []
    for peer, step_seconds in seconds.items():
        rate = gigabytes_per_second(job_bytes(kind, peer, dtype, numel), step_seconds)
        row = {
            "optimizer": kind,
            "dtype": dtype_name,
            "threads": threads,
            "peer": peer,
            "ms/step": step_seconds * 1e3,
            "GB/s": rate,
            "% copy": 100 * rate / copy_rate,
            "% stream": 100 * rate / stream_rate,
            "fewest samples kept": kept,
            "copy GB/s": copy_rate,
            "stream GB/s": stream_rate,
            # The keys python -m benchmarks groups and compares by.
            "bench": kind,
            "case": case,
            "impl": peer,
            "device": device,
            "time_ms": step_seconds * 1e3,
            "gbps": rate,
            "ceiling_gbps": copy_rate,
        }
        if peer in steps.coded:
            row["B/param at rest"] = steps.bytes_at_rest(steps.coded[peer])
            if peer in CODED_MODES:
                opt = steps.coded[peer]
                row["moment B/param"] = (opt.state_bytes()["moments"] + opt.state_bytes()["scales"]) / numel
        if peer.startswith("fusedamp"):
            row["speedup"] = {
                name: seconds[timed] / step_seconds
                for name, timed in reference_peer(peer, dtype).items()
                if timed in seconds
            }
            # Per round, peer time / fusedamp time: the 10th-90th percentile over clean rounds.
            row["speedup per round"] = {}
            for name, timed in reference_peer(peer, dtype).items():
                spread = round_ratio_range(samples, timed, peer) if timed in samples else None
                if spread:
                    row["speedup per round"][name] = f"{spread[0]:.2f}-{spread[1]:.2f}"
            row["vs peers"] = ", ".join(
                f"{v:.2f}x {k} ({row['speedup per round'].get(k, 'n/a')})" for k, v in row["speedup"].items()
            )
        rows.append(row)
    print(f"{kind} {dtype_name}, {threads} threads: done (every peer kept >= {kept}/{rounds} samples)",
          flush=True)
    return rows


def main() -> None:
    args = benchmark_args(__doc__.splitlines()[0])
    device = args.device
    sizes = param_sizes(DEFAULT_ELEMENTS[torch.device(device).type], TENSORS)
    rows: list[dict[str, Any]] = []
    for threads in thread_counts(args.threads, device):
        torch.set_num_threads(threads)
        for kind in ("adamw", "sgd"):
            for dtype_name in DTYPES:
                rows += measure(kind, dtype_name, sizes, device, args.rounds, threads)

    columns = [
        "optimizer", "dtype", "threads", "peer", "ms/step", "GB/s", "% copy", "% stream", "B/param at rest",
        "vs peers",
    ]
    print(f"\n{sum(sizes) / 1e6:.1f}M params in {len(sizes)} tensors on {device}; copy and stream "
          "bandwidth timed in turns with each group's steps; GB/s = the job's bytes (module "
          "docstring) / time\n")
    print(format_table(rows, columns))
    checks = target_checks(rows)
    for line in checks:
        print(line)
    write_json(args.json, {
        "environment": environment(device),
        "params": sum(sizes),
        "tensors": len(sizes),
        "rows": rows,
        "targets": checks,
    })


def target_checks(rows: list[dict[str, Any]]) -> list[str]:
    """The fusedamp rows at the most threads against the speed targets: speedups over the named
    peers (plain steps; bf16 remainder too), the fraction of the in-place stream ceiling, and
    the speedup over one thread."""
    most = max(row["threads"] for row in rows)
    single_thread = {(r["optimizer"], r["dtype"], r["peer"]): r for r in rows if r["threads"] == 1}
    lines = []
    for row in rows:
        if row["threads"] != most or not row["peer"].startswith("fusedamp"):
            continue
        label = f"{row['optimizer']} {row['dtype']} [{row['peer']}], {most} threads"
        for name, target in CODED_TARGETS.get((row["dtype"], row["peer"]), {}).items():
            if name in row["speedup"]:
                speedup = row["speedup"][name]
                verdict = "met" if speedup >= target else "MISSED"
                lines.append(f"target {label}: {speedup:.2f}x {name} (>= {target}x): {verdict}")
        if "int8" in row["peer"] and "moment B/param" in row:
            verdict = "met" if row["moment B/param"] <= 2.1 else "MISSED"
            moments = row["moment B/param"]
            lines.append(f"target {label}: moments at rest {moments:.3f} B/param (<= 2.1): {verdict}")
        bound = AT_REST_TARGETS.get((row["dtype"], row["peer"]))
        if bound is not None:
            at_rest = row["B/param at rest"]
            verdict = "met" if at_rest <= bound else "MISSED"
            lines.append(f"target {label}: {at_rest:.2f} B/param at rest in all (<= {bound}): {verdict}")
        if row["peer"] in ("fusedamp", "fusedamp remainder"):
            precision = "fp32" if row["dtype"] == "fp32" else "half"
            for name, target in TARGETS[(row["optimizer"], precision)].items():
                if name in row["speedup"]:
                    speedup = row["speedup"][name]
                    verdict = "met" if speedup >= target else "MISSED"
                    lines.append(f"target {label}: {speedup:.2f}x {name} (>= {target}x): {verdict}")
        stream = row["% stream"] / 100
        verdict = "met" if stream >= STREAM_TARGET else "MISSED"
        lines.append(
            f"target {label}: {stream:.0%} of the stream ceiling (>= {STREAM_TARGET:.0%}): {verdict}"
        )
        one = single_thread.get((row["optimizer"], row["dtype"], row["peer"]))
        if one is not None and most > 1:
            lines.append(f"target {label}: {thread_scaling_verdict(one, row)}")
    return lines


def thread_scaling_verdict(one: dict[str, Any], most: dict[str, Any]) -> str:
    """The scaling target: all threads >= THREAD_SCALING x one thread, where the in-place
    stream measured next to each row scales that much itself (else the machine cannot)."""
    speedup = one["ms/step"] / most["ms/step"]
    stream_scaling = most["stream GB/s"] / one["stream GB/s"]
    text = f"{speedup:.2f}x faster than 1 thread (stream ceiling {stream_scaling:.2f}x)"
    if stream_scaling < THREAD_SCALING:
        return f"{text}: n/a, the stream scales less than {THREAD_SCALING}x"
    return f"{text} (>= {THREAD_SCALING}x): {'met' if speedup >= THREAD_SCALING else 'MISSED'}"


if __name__ == "__main__":
    main()
