"""Offloaded training on one GPU, on models that need offload: GPT-2 small (124M params) at 8 x 1024
tokens, and a 7B decoder (Llama 2 7B's shapes, bf16 params) whose fp32 AdamW state would not fit
beside its params and activations, trained with the optimizer state and step on the host.
Run from the repository root (not timed on a GPU yet: an estimated 5 to 8 minutes on an H200 with
16 host cores, most of it the 7B rows; the JSON is written after each row):

    python -m benchmarks.bench_offload_loop [--models gpt2,llama-7b] [--steps 8] [--json PATH]
    python -m benchmarks.bench_offload_loop --dry-run   # tiny models, any device: the logic only

Rows per model: fusedamp's ``offload="cpu"`` stepping the params in the optimizer's order, in the
order their grads land (the default), and with the one-step delayed update (``offload_delay=1``,
no warm-up); torchao's ``CPUOffloadOptimizer`` (torch's fused CPU AdamW per param); the same
optimizer on the GPU where it fits (a row that runs out of memory says so). Each row trains
``--steps`` timed steps (forward, backward, ``step()``, ``zero_grad()``) after 3 warm-up steps,
timed from a synchronized GPU to a synchronized GPU, rows one after the other on the same model:

- ``time_ms``: per training step; ``fwd_bwd_ms`` the same without an optimizer; ``exposed_ms`` the
  difference.
- On the GPU's timeline (CUDA events around each part of each timed step): ``forward_ms``,
  ``backward_ms``, ``step_ms`` (from the end of backward to the end of ``zero_grad()``: what the
  GPU waits for the step, or the step's kernels on the GPU).
- On the host (timed inside the optimizers): ``hooks_ms``, fusedamp's backward hooks and their
  bucket copies; ``cpu_step_ms``, the CPU's optimizer steps (fusedamp's buckets, torchao's
  per-param optimizers), on whichever thread runs them.
- From a profiler trace of 2 more steps: ``d2h_ms``/``h2d_ms``, the time of the copies between
  GPU and host per step (on the copy engines: it overlaps the rest or not).
- ``host_bytes_per_param`` (offloaded state and buffers, measured from the tensors) and
  ``gpu_peak_bytes_per_param`` (peak allocated while the row trained: params, grads,
  activations, GPU state).

Then one verdict per target (``targets``). Needs a CUDA GPU (exits 77 otherwise) unless ``--dry-run``;
torchao rows when ``torchao`` is importable.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fusedamp
from benchmarks.common import environment, format_table, synchronize, write_json

ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
LOWMEM = {"master_weights": "remainder", "moments": "int8"}
WARMUP_STEPS = 3
PROFILED_STEPS = 2
PLAIN = "fusedamp offloaded, params' order"
ARRIVAL, DELAYED = "fusedamp offloaded", "fusedamp offloaded, delayed"
TORCHAO, ON_GPU = "torchao CPUOffloadOptimizer", "fusedamp on the GPU (no offload)"
FP32_ON_GPU = "fusedamp on the GPU, fp32 master + moments (no offload)"


def causal_attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal self-attention of packed (batch, seq, 3 * width) queries, keys and values."""
    batch, seq, width = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
    q, k, v = (t.view(batch, seq, heads, -1).transpose(1, 2) for t in qkv.split(width, dim=2))
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attended.transpose(1, 2).reshape(batch, seq, width)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(causal_attention(self.attn(self.ln_1(x)), self.heads))
        return x + self.out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2 small's shapes (124M params, the output layer tied to the token embedding)."""

    def __init__(self, vocab: int = 50257, positions: int = 1024, width: int = 768, layers: int = 12) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(positions, width)
        self.blocks = nn.ModuleList(Block(width, width // 64) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return next_token_loss(F.linear(self.ln_f(x), self.wte.weight), tokens)


class LlamaBlock(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int, **factory: Any) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(width, **factory), nn.RMSNorm(width, **factory)
        self.qkv = nn.Linear(width, 3 * width, bias=False, **factory)
        self.proj = nn.Linear(width, width, bias=False, **factory)
        self.gate_up = nn.Linear(width, 2 * hidden, bias=False, **factory)
        self.down = nn.Linear(hidden, width, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(causal_attention(self.qkv(self.attn_norm(x)), self.heads))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=2)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    """Llama 2 7B's shapes (6.74B params; no rotary embedding, which changes no timing that
    matters here), made on ``device`` in ``dtype`` directly."""

    def __init__(self, vocab: int = 32000, width: int = 4096, layers: int = 32, heads: int = 32,
                 hidden: int = 11008, **factory: Any) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, **factory)
        self.blocks = nn.ModuleList(LlamaBlock(width, heads, hidden, **factory) for _ in range(layers))
        self.norm = nn.RMSNorm(width, **factory)
        self.head = nn.Linear(width, vocab, bias=False, **factory)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return next_token_loss(self.head(self.norm(x)), tokens)


@dataclass
class Case:
    """One model and precision, and the optimizers its rows train it with."""

    name: str
    make_model: Callable[[str], nn.Module]  # on the given device, in the case's dtype
    vocab: int
    batch: int
    seq: int
    autocast: bool  # fp32 params under bf16 autocast
    makers: dict[str, Callable[[list[nn.Parameter]], Any]] = field(default_factory=dict)


def fusedamp_offloaded(order: str, **options: Any) -> Callable[[list[nn.Parameter]], Any]:
    """An offloaded FusedAdamW: ``order`` "params" (the optimizer's), "arrival" or "delayed"."""

    def make(params: list[nn.Parameter]) -> Any:
        delay = {"offload_delay": 1, "offload_delay_warmup": 0} if order == "delayed" else {}
        opt = fusedamp.FusedAdamW(params, offload="cpu", **delay, **ADAMW, **options)
        opt._executor.arrival_order = order != "params"  # a benchmark's switch, not an option
        return opt

    return make


def torchao_offload() -> Callable[[list[nn.Parameter]], Any] | None:
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        print("torchao is not installed: no CPUOffloadOptimizer rows")
        return None
    return lambda params: CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True, **ADAMW)


def cases(models: list[str], device: str, dry_run: bool) -> list[Case]:
    """The cases of ``models`` ("gpt2", "llama-7b"); tiny shapes with ``dry_run``."""
    torchao = torchao_offload() if device == "cuda" else None
    gpu_memory = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else 0
    found: list[Case] = []
    if "gpt2" in models:
        gpt2_shapes = {"vocab": 97, "positions": 16, "width": 64, "layers": 2} if dry_run else {}
        batch, seq = (2, 16) if dry_run else (8, 1024)
        vocab = gpt2_shapes.get("vocab", 50257)
        fp32 = Case("GPT-2 124M, fp32 params, bf16 autocast", lambda d: GPT2(**gpt2_shapes).to(d), vocab,
                    batch, seq, autocast=True)
        fp32.makers = {
            PLAIN: fusedamp_offloaded("params"), ARRIVAL: fusedamp_offloaded("arrival"),
            DELAYED: fusedamp_offloaded("delayed"),
            "fusedamp offloaded, step_in_backward": lambda p: fusedamp.FusedAdamW(
                p, offload="cpu", step_in_backward=True, **ADAMW),
            ON_GPU: lambda p: fusedamp.FusedAdamW(p, **ADAMW),
            "torch fused on the GPU (no offload)": lambda p: torch.optim.AdamW(p, fused=True, **ADAMW),
        }
        lowmem = Case("GPT-2 124M, bf16 params, remainder + int8",
                      lambda d: GPT2(**gpt2_shapes).to(d, torch.bfloat16), vocab, batch, seq, autocast=False)
        lowmem.makers = {
            ARRIVAL: fusedamp_offloaded("arrival", **LOWMEM),
            DELAYED: fusedamp_offloaded("delayed", **LOWMEM),
            ON_GPU: lambda p: fusedamp.FusedAdamW(p, **LOWMEM, **ADAMW),
        }
        if torchao is not None:
            fp32.makers[TORCHAO] = torchao
            lowmem.makers[f"{TORCHAO} (bf16 AdamW, no master)"] = torchao
        found += [fp32, lowmem]
    if "llama-7b" in models:
        llama_shapes = {"vocab": 97, "width": 64, "layers": 2, "heads": 4, "hidden": 160} if dry_run else {}
        # 4 x 2048 tokens: about 50 GB of activations, which leave room for the GPU rows on an H200.
        batch, seq = (2, 16) if dry_run else (4 if gpu_memory > 120 << 30 else 2, 2048)
        llama = Case("Llama 7B, bf16 params, remainder + int8",
                     lambda d: Llama(**llama_shapes, device=d, dtype=torch.bfloat16),
                     llama_shapes.get("vocab", 32000), batch, seq, autocast=False)
        llama.makers = {
            PLAIN: fusedamp_offloaded("params", **LOWMEM), ARRIVAL: fusedamp_offloaded("arrival", **LOWMEM),
            DELAYED: fusedamp_offloaded("delayed", **LOWMEM),
            ON_GPU: lambda p: fusedamp.FusedAdamW(p, **LOWMEM, **ADAMW),
            FP32_ON_GPU: lambda p: fusedamp.FusedAdamW(p, **ADAMW),
        }
        if torchao is not None:  # last: torch keeps its page-locked blocks cached after the row
            llama.makers[f"{TORCHAO} (bf16 AdamW, no master)"] = torchao
        found.append(llama)
    return found


class Timers:
    """Host seconds spent in the offloaded optimizers' hooks and CPU steps, timed by wrapping the
    methods they run through (any thread)."""

    def __init__(self) -> None:
        self.seconds = {"hooks": 0.0, "cpu step": 0.0}

    def wrap(self, owner: Any, method: str, kind: str) -> None:
        inner = getattr(owner, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - start

        setattr(owner, method, timed)

    def reset(self) -> None:
        for kind in self.seconds:
            self.seconds[kind] = 0.0

    def watch(self, opt: Any) -> dict[str, bool]:
        """Wraps what ``opt`` runs on the host; returns which kinds it times for this optimizer."""
        executor = getattr(opt, "_executor", None)
        if executor is not None and hasattr(executor, "backward"):  # fusedamp, offloaded
            self.wrap(executor.backward, "on_grad", "hooks")  # with the copies of full buckets
            self.wrap(executor.backward, "_end_of_backward", "hooks")  # the copies of the rest
            self.wrap(opt, "_run_bucket", "cpu step")
            return {"hooks": True, "cpu step": True}
        for inner in getattr(opt, "optim_dict", {}).values():  # torchao's per-param optimizers
            self.wrap(inner, "step", "cpu step")
        return {"hooks": False, "cpu step": hasattr(opt, "optim_dict")}


class Loop:
    """A model, its tokens and an optimizer (None: forward and backward only)."""

    def __init__(self, model: nn.Module, tokens: torch.Tensor, autocast: bool, opt: Any) -> None:
        self.model, self.tokens, self.autocast, self.opt = model, tokens, autocast, opt
        self.device = tokens.device.type
        self.events: list[list[Any]] = []  # per step: CUDA events before forward, backward, step, after

    def mark(self, marks: list[Any]) -> None:
        if self.device == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append(event)
        else:
            marks.append(time.perf_counter())

    def train(self, record: bool = False) -> None:
        marks: list[Any] = []
        self.mark(marks)
        with torch.autocast(self.device, torch.bfloat16, enabled=self.autocast):
            loss = self.model(self.tokens)
        self.mark(marks)
        loss.backward()
        self.mark(marks)
        if self.opt is None:
            self.model.zero_grad(set_to_none=True)
        else:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.mark(marks)
        if record:
            self.events.append(marks)

    def parts_ms(self) -> dict[str, float]:
        """Median forward, backward and step of the recorded steps (GPU timeline on a GPU)."""
        def span(a: Any, b: Any) -> float:
            return a.elapsed_time(b) if self.device == "cuda" else (b - a) * 1e3

        return {name: statistics.median(span(m[i], m[i + 1]) for m in self.events)
                for i, name in enumerate(("forward_ms", "backward_ms", "step_ms"))}


def copies_per_step(loop: Loop, steps: int) -> dict[str, float | None]:
    """ms of the copies GPU -> host and host -> GPU per step, from a profiler trace."""
    if loop.device != "cuda":
        return {"d2h_ms": None, "h2d_ms": None}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            loop.train()
        synchronize("cuda")
    totals: dict[str, float | None] = {"d2h_ms": 0.0, "h2d_ms": 0.0}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = "d2h_ms" if "DtoH" in event.name else "h2d_ms" if "HtoD" in event.name else None
        if kind is not None:
            totals[kind] += event.time_range.elapsed_us() / 1e3 / steps
    return totals


def host_bytes(opt: Any) -> int | None:
    """Bytes an offloaded optimizer holds on the host (None: it holds nothing there)."""
    if hasattr(opt, "param_d2h_map"):  # torchao: host params and grads, its optimizers' state
        total = sum(2 * host.numel() * host.element_size() for host in opt.param_d2h_map.values())
        for inner in opt.optim_dict.values():
            for state in inner.state.values():
                total += sum(v.numel() * v.element_size() for v in state.values()
                             if isinstance(v, torch.Tensor) and v.device.type == "cpu")
        return total
    if isinstance(opt, fusedamp.optim.FusedAdamW):
        return opt.state_bytes().get("host")
    return None


def release(model: nn.Module) -> None:
    """Frees what a dropped optimizer left on the model: grads, and torchao's hooks (it keeps no
    handles; fusedamp's go with its optimizer), which hold the optimizer and its host memory."""
    model.zero_grad(set_to_none=True)
    for param in model.parameters():
        hooks = getattr(param, "_post_accumulate_grad_hooks", None)
        if hooks:
            hooks.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed_steps(loop: Loop, steps: int, timers: Timers | None = None) -> float:
    """Seconds per training step over ``steps`` recorded steps, after the warm-up (``timers``
    count from its end)."""
    for _ in range(WARMUP_STEPS):
        loop.train()
    synchronize(loop.device)
    if timers is not None:
        timers.reset()
    start = time.perf_counter()
    for _ in range(steps):
        loop.train(record=True)
    synchronize(loop.device)
    return (time.perf_counter() - start) / steps


def measure(
    case: Case, device: str, steps: int, done: Callable[[list[dict[str, Any]]], None] = lambda rows: None
) -> list[dict[str, Any]]:
    """The rows of one case, one optimizer after the other on the same model; ``done`` gets the
    rows so far after each one (a run stopped by its time limit keeps the rows it finished)."""
    torch.manual_seed(0)
    model = case.make_model(device)
    params = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, case.vocab, (case.batch, case.seq), device=device)
    baseline = Loop(model, tokens, case.autocast, None)
    fwd_bwd = timed_steps(baseline, steps)
    rows = [{"bench": "offload-loop", "case": case.name, "impl": "forward + backward", "device": device,
             "params": params, "time_ms": fwd_bwd * 1e3, **baseline.parts_ms()}]
    done(rows)
    for impl, make in case.makers.items():
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        row: dict[str, Any] = {"bench": "offload-loop", "case": case.name, "impl": impl, "device": device,
                               "params": params}
        try:
            loop = Loop(model, tokens, case.autocast, make(list(model.parameters())))
            timers = Timers()
            timed = timers.watch(loop.opt)
            seconds = timed_steps(loop, steps, timers)
            work = dict(timers.seconds)
            row.update(copies_per_step(loop, PROFILED_STEPS))
            held = host_bytes(loop.opt)
            row.update({
                "fits": True, "time_ms": seconds * 1e3, "fwd_bwd_ms": fwd_bwd * 1e3,
                "exposed_ms": (seconds - fwd_bwd) * 1e3, **loop.parts_ms(),
                "hooks_ms": work["hooks"] * 1e3 / steps if timed["hooks"] else None,
                "cpu_step_ms": work["cpu step"] * 1e3 / steps if timed["cpu step"] else None,
                "host_bytes_per_param": None if held is None else held / params,
                "gpu_peak_bytes_per_param": (
                    torch.cuda.max_memory_allocated() / params if device == "cuda" else None
                ),
            })
        except torch.cuda.OutOfMemoryError as error:
            row.update({"fits": False, "error": str(error).splitlines()[0]})
        finally:
            loop = timers = None  # the optimizer with them
            release(model)
        print(f"{case.name}, {impl}: " + (f"{row['time_ms']:.1f} ms" if row.get("fits") else "out of memory"),
              flush=True)
        rows.append(row)
        done(rows)
    return rows


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The targets, from the rows that have what each needs."""
    by = {(row["case"], row["impl"]): row for row in rows if row.get("fits", True)}
    lines = []

    def ratio(case: str, a: str, b: str) -> float | None:
        if (case, a) not in by or (case, b) not in by:
            return None
        return by[(case, a)]["time_ms"] / by[(case, b)]["time_ms"]

    def line(label: str, value: float | None, bound: str, met: bool | None) -> None:
        if value is not None:
            lines.append(f"target {label}: {value:.2f} ({bound}): {'met' if met else 'NOT met'}")

    gpt2 = "GPT-2 124M, fp32 params, bf16 autocast"
    delayed = ratio(gpt2, DELAYED, ON_GPU)
    line("GPT-2 delayed / GPU-only step", delayed, "<= 1.25", delayed is not None and delayed <= 1.25)
    undelayed = ratio(gpt2, ARRIVAL, ON_GPU)
    line("GPT-2 offloaded / GPU-only step", undelayed, "<= 1.6", undelayed is not None and undelayed <= 1.6)
    torchao = ratio(gpt2, TORCHAO, ARRIVAL)
    line("GPT-2 torchao / fusedamp offloaded step", torchao, ">= 1.5", torchao is not None and torchao >= 1.5)
    for case in {row["case"] for row in rows}:
        baseline, offloaded = by.get((case, "forward + backward")), by.get((case, ARRIVAL))
        if baseline and offloaded:
            value = offloaded["backward_ms"] / baseline["backward_ms"]
            line(f"{case}: backward offloaded / without", value, "<= 1.05", value <= 1.05)
    llama = "Llama 7B, bf16 params, remainder + int8"
    if (llama, DELAYED) in by:
        row = by[(llama, DELAYED)]
        held = row["host_bytes_per_param"]
        line("Llama 7B host bytes per param", held, "<= 8.1", held <= 8.1)
        bound = max(row["fwd_bwd_ms"], row["cpu_step_ms"])
        value = row["time_ms"] / bound
        line("Llama 7B delayed step / max(forward + backward, CPU step)", value, "<= 1.1", value <= 1.1)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama-7b", help="comma-separated: gpt2, llama-7b")
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per row")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dry-run", action="store_true", help="tiny models, 2 steps, on any device")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if args.device != "cuda" and not args.dry_run:
        print("bench_offload_loop trains on a GPU with the optimizer on the host: it needs CUDA "
              "(or --dry-run)")
        raise SystemExit(77)
    steps = 2 if args.dry_run else args.steps
    rows: list[dict[str, Any]] = []
    environment_ = environment(args.device)

    def targets(finished: list[dict[str, Any]]) -> list[str]:
        # A dry run's tiny models say nothing about the targets: its verdicts only show the logic.
        lines = verdicts(finished)
        return [f"dry run, not a measurement: {line}" for line in lines] if args.dry_run else lines

    def save(before: list[dict[str, Any]], case_rows: list[dict[str, Any]]) -> None:
        """Writes the rows of the cases done ``before`` and those of the current case so far."""
        finished = before + case_rows
        write_json(args.json, {"environment": environment_, "threads": torch.get_num_threads(),
                               "steps": steps, "rows": finished, "targets": targets(finished)})

    for case in cases(args.models.split(","), args.device, args.dry_run):
        rows += measure(case, args.device, steps, done=functools.partial(save, list(rows)))
    print(format_table(rows, ["case", "impl", "time_ms", "exposed_ms", "forward_ms", "backward_ms", "step_ms",
                              "hooks_ms", "cpu_step_ms", "d2h_ms", "h2d_ms", "host_bytes_per_param",
                              "gpu_peak_bytes_per_param"]))
    print("\n".join(targets(rows)))


if __name__ == "__main__":
    main()
