"""Greedy decoding through a stack of Llama-shaped decoder layers, dense fp16 against the same
stack sparsified (50%, 70%, magnitude; "sparseNN" with policy "auto", "spmmNN" with every
layer forced to TCA-BME) and quantized to 4-bit g128 ("w4"; "w8" and "w2" likewise, "w2g64" with
groups of 64). A "+tuned" variant ("sparse50+tuned", "w4+tuned") first measures each layer's
split-K factor at the batch (spinfer.tuning).

Each layer: RMSNorm, attention (32 query heads, 8 KV heads, head dim 128, a static KV cache
and grouped-query SDPA over it), RMSNorm, SwiGLU MLP (hidden 4096, intermediate 14336); random weights, no
download. One decode step for a batch (1, 8, 16 sequences) is captured in a CUDA graph and
replayed; tokens per second = batch * steps / time. With --prefill, one prompt of each length
(batch 1, causal attention over it, also a replayed CUDA graph) goes through the same stacks: prompt tokens per
second, where the linear layers see N = the prompt length. Attention, norms and everything else are
the same module instances in every variant; only the nn.Linear layers are replaced.

    spinfer bench e2e [--layers 4] [--batches 1,8,16] [--steps 64] [--fused] [--prefill 512,2048] [--eager-norms]
    python benchmarks/bench_e2e.py ...      (same)
    spinfer bench e2e --tiny --device cpu   (a small smoke run of the same code, no graphs)
"""

from __future__ import annotations

import argparse
import copy
import re
import statistics
import sys
import time
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

import spinfer
from spinfer.nn import SparseLinear
from spinfer.timing import median_time


def rms_norm(x, weight):
    return F.rms_norm(x, (x.shape[-1],), weight, 1e-5)


# On CUDA the norms run as one generated kernel (torch.compile of rms_norm): torch's own kernel
# takes 6.3 us for one 4096-wide row on H100, 56 us of a 4-layer dense step of ~810 at batch 1
# (profile, docs/benchmarks.md). Serving engines fuse their norms too; every variant runs the same
# norm, so only the shared part of a step shrinks. --eager-norms keeps torch's kernel.
_COMPILED = {"on": True, "fn": None}


def _rms_norm_cuda(x, weight):
    if _COMPILED["fn"] is None:  # the first call compiles; without a working Triton, torch's kernel
        try:
            compiled = torch.compile(rms_norm, dynamic=False)
            y = compiled(x, weight)
        except Exception as e:  # noqa: BLE001 (any compiler failure: the benchmark goes on eagerly)
            print(f"bench e2e: torch.compile of RMSNorm failed ({type(e).__name__}); torch's kernel instead",
                  file=sys.stderr)
            _COMPILED["on"] = False
            return rms_norm(x, weight)
        _COMPILED["fn"] = compiled
        return y
    return _COMPILED["fn"](x, weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if x.is_cuda and _COMPILED["on"]:
            return _rms_norm_cuda(x, self.weight)
        return rms_norm(x, self.weight)


class DecoderLayer(nn.Module):
    """Llama decoder layer for one-token steps against a static KV cache. fused: q, k and v in
    one [hidden + 2 * kv_heads * head_dim, hidden] projection and gate and up in one
    [2 * inter, hidden] (as serving engines store them): 4 linear launches a layer instead of 7."""

    def __init__(self, hidden, inter, heads, kv_heads, max_len, batch, fused=False):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, hidden // heads
        self.fused = fused
        kvd = kv_heads * self.hd
        if fused:
            self.qkv_proj = nn.Linear(hidden, hidden + 2 * kvd, bias=False)
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, hidden, bias=False)
            self.k_proj = nn.Linear(hidden, kvd, bias=False)
            self.v_proj = nn.Linear(hidden, kvd, bias=False)
            self.gate_proj = nn.Linear(hidden, inter, bias=False)
            self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        self.register_buffer("k_cache", torch.zeros(batch, kv_heads, max_len, self.hd))
        self.register_buffer("v_cache", torch.zeros(batch, kv_heads, max_len, self.hd))

    def _qkv(self, h):  # h [B, T, H] -> q [B, heads, T, hd], k and v [B, kv_heads, T, hd]
        b, t = h.shape[:2]
        if self.fused:
            kvd = self.kv_heads * self.hd
            q, k, v = self.qkv_proj(h).split([self.heads * self.hd, kvd, kvd], dim=-1)
        else:
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        return (q.reshape(b, t, self.heads, self.hd).transpose(1, 2),
                k.reshape(b, t, self.kv_heads, self.hd).transpose(1, 2),
                v.reshape(b, t, self.kv_heads, self.hd).transpose(1, 2))

    def _rest(self, x, a):  # the attention output a [B, heads, T, hd] -> o_proj, residual, MLP
        b, t = x.shape[:2]
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        h = self.norm2(x)
        if self.fused:
            gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(h), self.up_proj(h)
        return x + self.down_proj(F.silu(gate) * up)

    def forward(self, x, pos, mask):
        """x [B, 1, H]; pos: 1-element long tensor; mask [1, 1, 1, L]: True or 0.0 where a cache
        position is attended (Stack passes an additive mask in x's dtype, made once a step)."""
        q, k, v = self._qkv(self.norm1(x))
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        # Grouped-query attention straight on the cache (enable_gqa), not on a copy of it with each
        # KV head repeated for its query heads: that copy was two extra kernels a layer.
        a = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        return self._rest(x, a)

    def prefill(self, x):  # x [B, T, H]: a prompt; causal attention over it, its keys and values cached
        q, k, v = self._qkv(self.norm1(x))
        t = x.shape[1]
        self.k_cache[:, :, :t].copy_(k)
        self.v_cache[:, :, :t].copy_(v)
        return self._rest(x, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


class Stack(nn.Module):
    def __init__(self, layers, hidden, inter, heads, kv_heads, max_len, batch, fused=False):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(hidden, inter, heads, kv_heads, max_len, batch, fused)
                                    for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.max_len = max_len

    def forward(self, x, pos):
        # Additive, in x's dtype: attention takes it as is (a boolean mask was converted to one
        # in every layer, two fill kernels each).
        past = torch.arange(self.max_len, device=x.device) > pos
        mask = torch.zeros(1, 1, 1, self.max_len, device=x.device, dtype=x.dtype).masked_fill(past, float("-inf"))
        for layer in self.layers:
            x = layer(x, pos, mask)
        return self.norm(x)

    def prefill(self, x):
        for layer in self.layers:
            x = layer.prefill(x)
        return self.norm(x)


def linear_bytes(model) -> int:
    total = 0
    for mod in model.modules():
        if isinstance(mod, SparseLinear):
            total += mod.memory_bytes()
        elif isinstance(mod, nn.Linear):
            total += mod.weight.numel() * mod.weight.element_size()
    return total


def formats(model, n: int) -> str:
    """Stored format and the kernel chosen at n tokens, counted over the wrapped layers."""
    c = Counter()
    for mod in model.modules():
        if isinstance(mod, SparseLinear):
            c[f"{mod.format}->{mod.choose(n)}"] += 1
    return ", ".join(f"{v} {k}" for k, v in sorted(c.items())) or "dense nn.Linear"


def tune_splits(model, n: int) -> None:
    """Each wrapped layer's split-K factor at n tokens, measured (spinfer.tuning, in memory)."""
    for mod in model.modules():
        if isinstance(mod, SparseLinear) and next(mod.buffers()).device.type == "cuda":
            w = mod.weight_object()
            if isinstance(w, spinfer.TCABME):
                spinfer.tuning.tune_spmm(w, [n], reps=10, save=False)
            elif isinstance(w, spinfer.LowBitWeight):
                spinfer.tuning.tune_lowbit(w, [n], reps=10, save=False)


def decode_rate(model, batch, hidden, steps, device, graphs: bool, reps: int = 3) -> float:
    """Tokens per second of `steps` greedy steps (the step's output feeds the next step): on a GPU
    the median of `reps` timed runs, after 8 untimed replays of the captured step (the benchmarks'
    method: warm-up, then a median). A caveat (thirty-ninth session, docs/benchmarks.md): in one
    process, every variant measured after a sparse one reads lower (4-bit 2.61x before, 2.45x
    after; dense itself 2.5% slower), with or without the warm-up, the L2 hints or an emptied
    allocator cache; benchmarks/ab_e2e.py, which interleaves all graphs in rounds, does not."""
    x = torch.randn(batch, 1, hidden, device=device, dtype=torch.float16)
    pos = torch.zeros(1, dtype=torch.long, device=device)

    def step():
        y = model(x, pos)
        x.copy_(y)
        pos.add_(1)

    with torch.no_grad():
        for _ in range(3):  # warm up: kernels built, policy choices made and cached
            step()
        if device.type == "cuda" and graphs:
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            run = g.replay
        else:
            run = step
        pos.zero_()
        if device.type == "cuda":
            for _ in range(8):
                run()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            runs = []
            for _ in range(reps):
                pos.zero_()
                torch.cuda.synchronize()
                start.record()
                for _ in range(steps):
                    run()
                end.record()
                end.synchronize()
                runs.append(start.elapsed_time(end) / 1e3)
            seconds = statistics.median(runs)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                run()
            seconds = time.perf_counter() - t0
    return batch * steps / seconds


def prefill_rate(model, tokens, hidden, device, graphs: bool, reps: int = 20) -> float:
    """Prompt tokens per second of one prefill of `tokens` tokens (batch 1; median of `reps`). On
    CUDA the prefill is captured in a CUDA graph and replayed, as the decode step is: eager, host
    launch gaps showed in the 512-token times (dense 155-268k tokens/s over four runs of one
    lease)."""
    x = torch.randn(1, tokens, hidden, device=device, dtype=torch.float16)
    with torch.no_grad():
        for _ in range(2):  # warm up: kernels built, policy choices made and cached
            model.prefill(x)
        run = lambda: model.prefill(x)  # noqa: E731
        if device.type == "cuda" and graphs:
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                model.prefill(x)
            run = g.replay
        # The stack's weights are far larger than L2, so no flush; the warm-up ran above.
        seconds = median_time(run, device, reps=reps, warmup=0, flush_l2=False, max_seconds=None)
    return tokens / seconds


def build_variant(base, name, batch):
    """A copy of `base` with its nn.Linear layers replaced as the variant says (dense: base)."""
    if name == "dense":
        return base
    model = copy.deepcopy(base)
    kind, tuned = (name[: -len("+tuned")], True) if name.endswith("+tuned") else (name, False)
    if kind.startswith("sparse"):  # policy "auto": the cost model stores each layer
        spinfer.sparsify(model, int(kind[6:]) / 100, method="magnitude", progress=False)
    elif kind.startswith("spmm"):  # every layer TCA-BME and SpMM at every N, whatever the cost model says
        spinfer.sparsify(model, int(kind[4:]) / 100, method="magnitude", policy="sparse", progress=False)
    elif re.fullmatch(r"w[248](g\d+)?", kind):  # every layer low-bit, group 128 or gG, no pruning
        quant, _, group = kind.partition("g")
        spinfer.sparsify(model, 0.0, method="magnitude", quant=quant, group_size=int(group or 128), policy="lowbit",
                         progress=False)
    else:
        raise ValueError(f"unknown variant {name!r}")
    if tuned:
        tune_splits(model, batch)
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="spinfer bench e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batches", default="1,8,16", help="decode batches ('' for none)")
    p.add_argument("--prefill", default="", help="prompt lengths, e.g. 512,2048: prompt tokens/s (batch 1)")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--variants", default="dense,sparse50,sparse70,spmm50,spmm70,w4")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="hidden 256, MLP 512, 8/2 heads: a smoke run")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--eager-norms", action="store_true", help="torch's RMSNorm kernel instead of a compiled one")
    p.add_argument("--fused", action="store_true",
                   help="q/k/v and gate/up as one projection each, in every variant (dense too)")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_e2e: needs a CUDA GPU (or --device cpu --tiny)", file=sys.stderr)
        return 2
    hidden, inter, heads, kv = (256, 512, 8, 2) if a.tiny else (4096, 14336, 32, 8)
    batches = [int(v) for v in a.batches.split(",")] if a.batches else []
    prompts = [int(v) for v in a.prefill.split(",")] if a.prefill else []
    variants = a.variants.split(",")
    _COMPILED["on"] = not a.eager_norms
    dtype = torch.float16
    if device.type == "cuda":
        spinfer.build.load_extension()
        print(f"device {torch.cuda.get_device_name(device)}; torch {torch.__version__}")
    print(f"{a.layers} decoder layers, hidden {hidden}, MLP {inter}, {heads}/{kv} heads, {a.steps} greedy steps, "
          f"{'CUDA graphs' if device.type == 'cuda' and not a.no_graphs else 'eager'}"
          f"{', fused qkv and gate_up projections' if a.fused else ''}"
          f"{', compiled RMSNorm' if device.type == 'cuda' and not a.eager_norms else ''}")
    print(f"{'variant':<15} {'batch':>5} {'tokens/s':>10} {'x dense':>8} {'weights MiB':>11}  formats")
    torch.manual_seed(0)

    def run(base, label, n, rate_of):
        """Every variant of `base` (n tokens per linear call), one table row each, ratio to dense."""
        dense_rate = None
        for name in variants:
            model = build_variant(base, name, n)
            rate = rate_of(model)
            dense_rate = rate if name == "dense" else dense_rate
            ratio = rate / dense_rate if dense_rate else float("nan")
            print(f"{name:<15} {label:>5} {rate:>10.1f} {ratio:>8.2f} {linear_bytes(model) / 2**20:>11.1f}  "
                  f"{formats(model, n)}", flush=True)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()

    for batch in batches:
        run(Stack(a.layers, hidden, inter, heads, kv, a.steps + 8, batch, a.fused).to(device, dtype), str(batch), batch,
            lambda m: decode_rate(m, batch, hidden, a.steps, device, graphs=not a.no_graphs))
    for tokens in prompts:
        # A prompt through the same stack, batch 1: the linear layers see N = tokens, where the
        # layers run decode + cuBLAS (or the fused kernels, for "spmmNN" and below fused_max_n).
        run(Stack(a.layers, hidden, inter, heads, kv, tokens, 1, a.fused).to(device, dtype), f"p{tokens}", tokens,
            lambda m: prefill_rate(m, tokens, hidden, device, graphs=not a.no_graphs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
