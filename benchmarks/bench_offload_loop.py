"""An offloaded training loop on one GPU: GPT-2 small (124M params) trained with its optimizer on
the host, fusedamp's ``offload="cpu"`` against torchao's ``CPUOffloadOptimizer`` and against the
same optimizer without offload, with how much of the CPU step hides behind backward.
Run from the repository root: python -m benchmarks.bench_offload_loop [--steps 8] [--json PATH]

Each row is one training step (forward, backward, ``step()``, ``zero_grad()``) on a batch of
``--batch`` x ``--seq`` tokens, timed from a synchronized GPU to a synchronized GPU, the
optimizers taking turns (round-robin, warmed up, medians). Cases:
- fp32 params under bf16 autocast, AdamW with fp32 moments: fusedamp offloaded, torchao's
  CPUOffloadOptimizer (torch's fused CPU AdamW per param), and fusedamp and torch's fused AdamW
  on the GPU (no offload): the same job, so the same bits of state.
- bf16 params with a remainder (exact fp32 master) and int8 moments, fusedamp offloaded and on the
  GPU; torchao's CPUOffloadOptimizer on the bf16 params is the nearest peer, a different job
  (bf16 AdamW without a master, 8 host bytes per param).
- the fp32 job with ``step_in_backward=True``: each param stepped on the host as its grad lands.
Per row: ``step_alone_ms``, the optimizer's ``step()`` alone after a synchronized backward (no
overlap possible); ``exposed_ms``, the training step minus forward + backward without an
optimizer (``fwd_bwd_ms``, the same model and dtypes); ``hidden``, the share of the CPU step that
the loop hides (1 - exposed / step alone); host bytes per param, measured from the tensors.
Needs a CUDA GPU (exits 77 otherwise); torchao rows when ``torchao`` is importable.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import fusedamp
from benchmarks.common import (
    benchmark_args,
    environment,
    format_table,
    synchronize,
    time_round_robin,
    write_json,
)

ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
FP32_CASE = "GPT-2 124M, fp32 params, bf16 autocast"
LOWMEM_CASE = "GPT-2 124M, bf16 params, remainder + int8"
SIB_CASE = "GPT-2 124M, fp32 params, step_in_backward"


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.fc, self.out = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT2(torch.nn.Module):
    """GPT-2 small's shapes (124M params, the output layer tied to the token embedding)."""

    def __init__(self, vocab: int = 50257, positions: int = 1024, width: int = 768, layers: int = 12) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, width), torch.nn.Embedding(positions, width)
        self.blocks = torch.nn.ModuleList(Block(width, width // 64) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())


def host_bytes_torchao(opt: Any) -> float:
    """torchao's host copies of the params and grads and its per-param optimizers' state."""
    total = params = 0
    for host in opt.param_d2h_map.values():
        params += host.numel()
        total += 2 * host.numel() * host.element_size()
    for inner in opt.optim_dict.values():
        for state in inner.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values()
                         if isinstance(v, torch.Tensor) and v.device.type == "cpu")
    return total / max(params, 1)


class Loop:
    """One model + optimizer: ``train()`` is a whole training step, ``backward()`` and ``step()``
    its parts (for the step timed alone)."""

    def __init__(self, model: torch.nn.Module, make_opt: Callable[[list], Any] | None,
                 tokens: torch.Tensor, autocast: bool) -> None:
        self.model, self.tokens, self.autocast = model, tokens, autocast
        self.opt = make_opt(list(model.parameters())) if make_opt is not None else None

    def backward(self) -> None:
        with torch.autocast(self.tokens.device.type, torch.bfloat16, enabled=self.autocast):
            loss = self.model(self.tokens)
        loss.backward()

    def step(self) -> None:
        if self.opt is None:
            self.model.zero_grad(set_to_none=True)
            return
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def train(self) -> None:
        self.backward()
        self.step()


def step_alone(loop: Loop, steps: int) -> float:
    """Median seconds of ``step()`` after a synchronized backward."""
    device = loop.tokens.device.type
    times = []
    for _ in range(steps):
        loop.backward()
        synchronize(device)
        start = time.perf_counter()
        loop.step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torchao_offload() -> Callable[[list], Any] | None:
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        print("torchao is not installed: no CPUOffloadOptimizer rows")
        return None
    return lambda params: CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True, **ADAMW)


def cases(device: str) -> dict[str, tuple[torch.dtype, dict[str, Callable[[list], Any]]]]:
    """Per case: the params' dtype and the optimizers (torchao's on CUDA only)."""
    fp32 = {
        "fusedamp": lambda p: fusedamp.FusedAdamW(p, offload="cpu", **ADAMW),
        "fusedamp on the GPU (no offload)": lambda p: fusedamp.FusedAdamW(p, **ADAMW),
        "torch fused on the GPU (no offload)": lambda p: torch.optim.AdamW(p, fused=True, **ADAMW),
    }
    lowmem_options = {"master_weights": "remainder", "moments": "int8", **ADAMW}
    lowmem = {
        "fusedamp": lambda p: fusedamp.FusedAdamW(p, offload="cpu", **lowmem_options),
        "fusedamp on the GPU (no offload)": lambda p: fusedamp.FusedAdamW(p, **lowmem_options),
    }
    torchao = torchao_offload() if device == "cuda" else None
    if torchao is not None:
        fp32["torchao CPUOffloadOptimizer"] = torchao
        lowmem["torchao CPUOffloadOptimizer (bf16 AdamW, no master)"] = torchao
    sib = {"fusedamp": lambda p: fusedamp.FusedAdamW(p, offload="cpu", step_in_backward=True, **ADAMW)}
    return {FP32_CASE: (torch.float32, fp32), LOWMEM_CASE: (torch.bfloat16, lowmem),
            SIB_CASE: (torch.float32, sib)}


def host_bytes(opt: Any) -> float | None:
    """Host bytes per param of an offloaded optimizer (None: it keeps nothing on the host)."""
    if hasattr(opt, "param_d2h_map"):
        return host_bytes_torchao(opt)
    host = opt.state_bytes().get("host") if isinstance(opt, fusedamp.optim.FusedAdamW) else None
    if not host:
        return None
    return host / sum(p.numel() for group in opt.param_groups for p in group["params"])


def measure(case: str, dtype: torch.dtype, makers: dict, args: argparse.Namespace,
            model: Callable[[], torch.nn.Module] = GPT2) -> list[dict[str, Any]]:
    """The rows of one case; ``args`` needs device, batch, seq and steps."""
    torch.manual_seed(0)
    base = model().to(args.device, dtype)
    tokens = torch.randint(0, base.wte.num_embeddings, (args.batch, args.seq), device=args.device)
    autocast = dtype == torch.float32
    loops = {name: Loop(copy.deepcopy(base), make, tokens, autocast) for name, make in makers.items()}
    loops["forward + backward"] = Loop(copy.deepcopy(base), None, tokens, autocast)
    samples = time_round_robin({name: loop.train for name, loop in loops.items()}, args.device,
                               rounds=args.steps, warmup=3)
    medians = {name: statistics.median(times) for name, times in samples.items()}
    fwd_bwd = medians.pop("forward + backward")
    rows = []
    for name, seconds in medians.items():
        loop = loops[name]
        alone = step_alone(loop, max(3, args.steps // 2))
        exposed = seconds - fwd_bwd
        rows.append({
            "bench": "offload-loop", "case": case, "impl": name, "device": args.device,
            "time_ms": seconds * 1e3, "fwd_bwd_ms": fwd_bwd * 1e3, "step_alone_ms": alone * 1e3,
            "exposed_ms": exposed * 1e3, "hidden": 1.0 - exposed / alone if alone > 0 else None,
            "host_bytes_per_param": host_bytes(loop.opt),
        })
    return rows


def more_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per optimizer")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)


def main() -> None:
    args = benchmark_args(__doc__.splitlines()[0], more_options)
    if torch.device(args.device).type != "cuda":
        print("bench_offload_loop trains on a GPU with the optimizer on the host: it needs CUDA")
        raise SystemExit(77)
    rows = []
    for case, (dtype, makers) in cases("cuda").items():
        rows += measure(case, dtype, makers, args)
    print(format_table(rows, ["case", "impl", "time_ms", "fwd_bwd_ms", "step_alone_ms", "exposed_ms",
                              "hidden", "host_bytes_per_param"]))
    write_json(args.json, {"environment": environment("cuda"), "batch": args.batch, "seq": args.seq,
                           "threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
