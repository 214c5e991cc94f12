"""The CPU step of optimizer offload (FSDP2's CPUOffloadPolicy, ZeRO-Offload): a model's worth of
tensors, GPT-2 small (124M params in its 148 tensors), stepped on the CPU by fusedamp against
DeepSpeedCPUAdam and torch's fused CPU optimizers, with what bounds each step.

Run from the repository root: python -m benchmarks.bench_offload [--threads 1,2] [--json PATH]
(default threads: 1, 2 and all of torch's, so that an offloaded step can be read against the
host's cores; each row also gives its speedup over the same step at one thread).

Peers, each timed in turns with the others in one process (round-robin, warmed up, medians):

- AdamW on fp32 params, grads and moments (28 B of memory traffic per param: p, g, m, v read; p,
  m, v written): DeepSpeedCPUAdam (``adamw_mode=True``; its job in ZeRO-Offload: fp32 master +
  fp32 moments, fp32 grads; a row when ``deepspeed`` is installed, its CPUAdam is compiled by
  ninja on first use), ``torch.optim.AdamW(fused=True)`` and ``fusedamp.FusedAdamW``.
- fusedamp's low-memory modes of the same step, bf16 params and grads with int8 moments and the
  fp32 master kept as a bf16 remainder (14 B per param moved) or no master, stochastic rounding
  (10 B). No peer keeps state at that precision: their ratios to the fp32 rows compare different
  jobs, and the table says so.
- SGD with momentum on fp32 (20 B per param): ``torch.optim.SGD(fused=True)`` and ``FusedSGD``.

Every row gives ms per million params, GB/s of the bytes its job moves, and host bytes per param
at rest (param + grad + state, measured from the tensors). The bound of each step: its bytes at
the copy and the in-place stream (``a.add_(x)``) rates measured in the same rounds (what memory
allows; an in-place step can pass the copy rate, which pays a write-allocate read), and its time
per param with its data in L2 (the slope of its step time between 4k and 32k elements at one
thread: what its instructions cost; at 2 threads, half of it). Each
fusedamp row gets a verdict line against each same-precision peer; behind one, it splits the gap
into what is there in L2 already (instructions) and what only memory adds (memory access).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

import fusedamp
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

MODEL = "GPT-2"
DEEPSPEED, TORCH_FUSED, FUSEDAMP = "deepspeed", "torch fused", "fusedamp"
REMAINDER_INT8, STOCHASTIC_INT8 = "fusedamp bf16 remainder int8", "fusedamp bf16 stochastic int8"
COPY, STREAM = "copy", "stream a.add_(x, alpha)"
# Bytes of memory traffic per param of each job (benchmarks/bench_optim.py counts them alike).
JOB_BYTES = {
    ("adamw", DEEPSPEED): 28,
    ("adamw", TORCH_FUSED): 28,
    ("adamw", FUSEDAMP): 28,
    ("adamw", REMAINDER_INT8): 14,  # g 2, p 2 + 2, remainder 2 + 2, m 1 + 1, v 1 + 1
    ("adamw", STOCHASTIC_INT8): 10,  # g 2, p 2 + 2, m 1 + 1, v 1 + 1
    ("sgd", TORCH_FUSED): 20,
    ("sgd", FUSEDAMP): 20,
}
# The peers each fusedamp row is compared with at the same precision.
SAME_PRECISION = {("adamw", FUSEDAMP): [DEEPSPEED, TORCH_FUSED], ("sgd", FUSEDAMP): [TORCH_FUSED]}
ADAMW = {"lr": 1e-3, "weight_decay": 1e-2}
SGD = {"lr": 1e-3, "momentum": 0.9}
# Two sizes in L2 (AdamW's four fp32 streams of 32k elements take 512 KB; Zen 4 has 1 MB per
# core): the time per param is the slope between them, which leaves each step's host cost out.
L2_SIZES = (4_096, 32_768)
L2_STEPS = 100  # steps per sample


def gpt2_shapes(vocab: int = 50257, positions: int = 1024, width: int = 768, layers: int = 12) -> list[tuple]:
    """The parameter shapes of GPT-2 (Hugging Face's Conv1D layout, lm_head tied to wte)."""
    block = [
        (width,), (width,),  # ln_1
        (width, 3 * width), (3 * width,),  # attn.c_attn
        (width, width), (width,),  # attn.c_proj
        (width,), (width,),  # ln_2
        (width, 4 * width), (4 * width,),  # mlp.c_fc
        (4 * width, width), (width,),  # mlp.c_proj
    ]
    return [(vocab, width), (positions, width), *block * layers, (width,), (width,)]


def make_params(shapes: list[tuple], dtype: torch.dtype, seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        param = torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.02).to(dtype))
        param.grad = (torch.randn(shape, generator=generator) * 1e-3).to(dtype)
        params.append(param)
    return params


def deepspeed_adam(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer | None:
    """DeepSpeedCPUAdam in AdamW mode, or None when deepspeed is not installed."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        return None
    return DeepSpeedCPUAdam(params, adamw_mode=True, **ADAMW)


def optimizers(kind: str, fp32: list, bf16: list, deepspeed: bool) -> dict[str, torch.optim.Optimizer]:
    """The peers of ``kind`` on shared params (each keeps its own state); DeepSpeedCPUAdam if
    ``deepspeed`` and installed."""
    if kind == "sgd":
        return {
            TORCH_FUSED: torch.optim.SGD(fp32, fused=True, **SGD),
            FUSEDAMP: fusedamp.FusedSGD(fp32, **SGD),
        }
    peers: dict[str, torch.optim.Optimizer] = {}
    ds = deepspeed_adam(fp32) if deepspeed else None
    if ds is not None:
        peers[DEEPSPEED] = ds
    peers[TORCH_FUSED] = torch.optim.AdamW(fp32, fused=True, **ADAMW)
    peers[FUSEDAMP] = fusedamp.FusedAdamW(fp32, **ADAMW)
    if bf16:
        for name, masters in ((REMAINDER_INT8, "remainder"), (STOCHASTIC_INT8, "stochastic")):
            peers[name] = fusedamp.FusedAdamW(bf16, moments="int8", master_weights=masters, **ADAMW)
    return peers


def host_bytes(opt: torch.optim.Optimizer) -> float:
    """Param + grad + every state tensor per param, measured from the tensors."""
    params = [p for group in opt.param_groups for p in group["params"]]
    total = sum(p.numel() * p.element_size() + p.grad.numel() * p.grad.element_size() for p in params)
    for state in opt.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total / sum(p.numel() for p in params)


def repeated(opt: torch.optim.Optimizer, steps: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(steps):
            opt.step()

    return run


def in_l2_ns(kind: str, rounds: int, deepspeed: bool) -> dict[str, float | None]:
    """Each peer's time per param of a step with its data in L2 at one thread: what its
    instructions cost. One thread: tensors this small are not worth waking a second (fusedamp runs
    them inline, the peers split them), which would time the wake-up instead."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _in_l2_ns(kind, rounds, deepspeed)
    finally:
        torch.set_num_threads(threads)


def _in_l2_ns(kind: str, rounds: int, deepspeed: bool) -> dict[str, float | None]:
    # Both sizes of every peer take turns in the same rounds, so that both see the same load.
    calls, names = {}, []
    for numel in L2_SIZES:
        shape = [(numel,)]
        fp32, bf16 = make_params(shape, torch.float32, 1), make_params(shape, torch.bfloat16, 2)
        peers = optimizers(kind, fp32, bf16, deepspeed)
        names = list(peers)
        calls.update({f"{name}, {numel}": repeated(opt, L2_STEPS) for name, opt in peers.items()})
    medians, _ = stable_medians(time_round_robin(calls, "cpu", rounds))
    small, large = L2_SIZES
    slopes = {
        name: (medians[f"{name}, {large}"] - medians[f"{name}, {small}"]) / L2_STEPS / (large - small) * 1e9
        for name in names
    }
    # A slope at or below 0 says that other load moved one size's samples more than the work did.
    return {name: slope if slope > 0 else None for name, slope in slopes.items()}


def stream_peer(numel: int) -> tuple[Callable[[], object], int]:
    a, x = torch.ones(numel), torch.zeros(numel)
    return (lambda: a.add_(x, alpha=0.5)), 3 * numel * 4


def measure(
    kind: str, shapes: list[tuple], threads: int, rounds: int, deepspeed: bool
) -> list[dict[str, Any]]:
    """Every peer of ``kind`` on the model's tensors, in turns with the copy and stream yardsticks,
    as rows; and each peer's in-L2 time."""
    numel = sum(torch.Size(shape).numel() for shape in shapes)
    fp32 = make_params(shapes, torch.float32, 0)
    bf16 = make_params(shapes, torch.bfloat16, 0) if kind == "adamw" else []
    peers = optimizers(kind, fp32, bf16, deepspeed)
    calls: dict[str, Callable[[], object]] = {name: opt.step for name, opt in peers.items()}
    calls[COPY], copy_bytes = copy_peer(numel * 4, "cpu")
    calls[STREAM], stream_bytes = stream_peer(numel)
    samples = time_round_robin(calls, "cpu", rounds)
    seconds, kept = stable_medians(samples)
    copy_rate = gigabytes_per_second(copy_bytes, seconds[COPY])
    stream_rate = gigabytes_per_second(stream_bytes, seconds[STREAM])
    l2 = in_l2_ns(kind, rounds, deepspeed)
    case = f"{MODEL} {numel / 1e6:.0f}M params, {threads} threads"
    rows = []
    for name, opt in peers.items():
        step = seconds[name]
        moved = JOB_BYTES[(kind, name)] * numel
        row = {
            "bench": f"offload {kind}",
            "case": case,
            "impl": name,
            "device": "cpu",
            "threads": threads,
            "params": numel,
            "time_ms": step * 1e3,
            "ms per Mparam": step * 1e3 / (numel / 1e6),
            "gbps": gigabytes_per_second(moved, step),
            "ceiling_gbps": copy_rate,
            "stream GB/s": stream_rate,
            "job B/param": JOB_BYTES[(kind, name)],
            "host B/param": host_bytes(opt),
            "from memory ns": step / numel * 1e9,
            "copy bound ns": moved / copy_rate / numel,
            "stream bound ns": moved / stream_rate / numel,
            # The instructions of one thread, shared by every thread (None: not measurable in this run).
            "in L2 ns": None if l2[name] is None else l2[name] / threads,
            "fewest samples kept": kept,
        }
        row["% copy"] = 100 * row["copy bound ns"] / row["from memory ns"]
        row["% stream"] = 100 * row["stream bound ns"] / row["from memory ns"]
        same = [peer for peer in SAME_PRECISION.get((kind, name), []) if peer in peers]
        coded = name in (REMAINDER_INT8, STOCHASTIC_INT8)
        other = [peer for peer in (FUSEDAMP, DEEPSPEED, TORCH_FUSED) if coded and peer in peers]
        for key, compared in (("speedup", same), ("speedup, other precision", other)):
            if compared:
                row[key] = {peer: seconds[peer] / step for peer in compared}
                row[f"{key} per round"] = {peer: spread(samples, peer, name) for peer in compared}
        for peer, ratio in row.get("speedup", {}).items():
            row[f"vs {peer}"] = ratio
        rows.append(row)
    print(f"offload {kind}, {threads} threads: done (every peer kept >= {kept}/{rounds} samples)", flush=True)
    return rows


def spread(samples: dict[str, list[float]], peer: str, name: str) -> str:
    """The 10th-90th percentile of the per-round ratios peer time / ``name``'s time."""
    found = round_ratio_range(samples, peer, name)
    return "n/a" if found is None else f"{found[0]:.2f}-{found[1]:.2f}"


def findings(rows: list[dict[str, Any]]) -> list[str]:
    """For each fusedamp row against a same-precision peer: its time per param from memory and the
    peer's, its bytes at the copy and in-place stream rates, and both in-L2 times. Behind the
    peer, the gap splits into what is there in L2 already (its instructions) and what only
    memory adds (its memory access: the same bytes moved slower)."""
    lines = []
    by_key = {(row["bench"], row["threads"], row["impl"]): row for row in rows}
    for row in rows:
        for peer, ratio in row.get("speedup", {}).items():
            label = f"{row['bench']} {row['impl']}, {row['threads']} threads"
            other = by_key[(row["bench"], row["threads"], peer)]
            own_l2, peer_l2 = row["in L2 ns"], other["in L2 ns"]
            in_l2 = "n/a" if own_l2 is None or peer_l2 is None else f"{own_l2:.3f} ns vs {peer_l2:.3f}"
            text = (
                f"{label}: {ratio:.2f}x {peer} ({row['speedup per round'][peer]}); per param from memory "
                f"{row['from memory ns']:.3f} ns vs {other['from memory ns']:.3f}; its bytes at the copy / "
                f"in-place stream rates {row['copy bound ns']:.3f} / {row['stream bound ns']:.3f} ns "
                f"({row['% copy']:.0f}% / {row['% stream']:.0f}% of them reached, the peer "
                f"{other['% copy']:.0f}% / {other['% stream']:.0f}%); in L2 {in_l2}"
            )
            gap = row["from memory ns"] - other["from memory ns"]
            if ratio >= 1.0:
                lines.append(f"{text}: ahead")
            elif own_l2 is None or peer_l2 is None:
                lines.append(f"{text}: behind by {gap:.3f} ns per param (in L2 not measurable in this run)")
            else:
                share = min(max(own_l2 - peer_l2, 0.0), gap) / gap
                lines.append(
                    f"{text}: behind by {gap:.3f} ns per param, {share:.0%} of it there in L2 (its "
                    f"instructions), {1 - share:.0%} only from memory (its memory access)"
                )
    return lines


def scaling(rows: list[dict[str, Any]]) -> list[str]:
    """Each peer's step at every thread count against the same step at one thread (adds the ratio
    to the rows as "x over 1 thread")."""
    single = {(row["bench"], row["impl"]): row["time_ms"] for row in rows if row["threads"] == 1}
    lines = []
    for row in rows:
        base = single.get((row["bench"], row["impl"]))
        if base is None or row["threads"] == 1:
            continue
        row["x over 1 thread"] = base / row["time_ms"]
        lines.append(
            f"scaling {row['bench']} {row['impl']}: {row['threads']} threads {row['time_ms']:.1f} ms, "
            f"{row['x over 1 thread']:.2f}x one thread's {base:.1f} ms ({row['gbps']:.1f} GB/s of its bytes, "
            f"{row['% copy']:.0f}% of the copy rate at {row['threads']} threads)"
        )
    return lines


def model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 blocks (default: 12, 124M params)")
    parser.add_argument("--vocab", type=int, default=50257, help="rows of wte (default: 50257)")
    parser.add_argument(
        "--no-deepspeed", action="store_true",
        help="leave DeepSpeedCPUAdam out (its CPUAdam compiles for minutes on first use)",
    )


def main() -> None:
    args = benchmark_args(__doc__.splitlines()[0], model_options)
    if torch.device(args.device).type != "cpu":
        print("bench_offload measures the CPU step of optimizer offload: run it on the CPU")
        raise SystemExit(77)
    shapes = gpt2_shapes(vocab=args.vocab, layers=args.layers)
    rows: list[dict[str, Any]] = []
    counts = thread_counts(args.threads, "cpu") if args.threads else sorted({1, 2, torch.get_num_threads()})
    for threads in counts:
        torch.set_num_threads(threads)
        for kind in ("adamw", "sgd"):
            rows += measure(kind, shapes, threads, args.rounds, not args.no_deepspeed)
    print(f"\n{MODEL} ({sum(torch.Size(s).numel() for s in shapes) / 1e6:.1f}M params in {len(shapes)} "
          "tensors) stepped on the CPU; GB/s = the job's bytes / time; bound: its bytes at the copy "
          "bandwidth measured in the same rounds, and its time in L2\n")
    columns = ["bench", "threads", "impl", "time_ms", "ms per Mparam", "gbps", "% copy", "% stream",
               "host B/param", "in L2 ns", "from memory ns", "stream bound ns"]
    print(format_table(rows, columns))
    lines = findings(rows)
    scaled = scaling(rows)
    for line in scaled:
        print(line)
    for line in lines:
        print(line)
    write_json(args.json, {
        "benchmark": "offload", "environment": environment("cpu"), "model": MODEL, "layers": args.layers,
        "vocab": args.vocab, "shapes": shapes, "rows": rows, "targets": lines,
        "scaling": scaled,
    })


if __name__ == "__main__":
    main()
