"""Greedy decoding through a stack of Llama-shaped decoder layers, dense fp16 (or --dtype bf16,
every variant's activations and weights in it) against the same stack sparsified (50%, 70%, magnitude; "sparseNN" with policy "auto", "spmmNN" with every
layer forced to TCA-BME) and quantized to 4-bit g128 ("w4"; "w8" and "w2" likewise, "w2g64" with
groups of 64). A "+tuned" variant ("sparse50+tuned", "w4+tuned") first measures each layer's
split-K factor at the batch (spinfer.tuning).

Each layer: RMSNorm, attention (32 query heads, 8 KV heads, head dim 128, a static KV cache
and grouped-query SDPA over it; with the pdl glue one Triton kernel that also writes the cache),
RMSNorm, SwiGLU MLP (hidden 4096, intermediate 14336); random weights, no download. One decode
step for a batch (1, 8, 16 sequences) is captured in a CUDA graph and replayed; tokens per second = batch * steps / time. With --prefill, one prompt of each length
(batch 1, causal attention over it, also a replayed CUDA graph) goes through the same stacks: prompt
tokens per second, where the linear layers see N = the prompt length. Attention, norms and
everything else are the same in every variant (copies of one stack); only the nn.Linear layers
are replaced. The glue between the linear layers runs as fused kernels on CUDA (--glue): Triton
kernels that let the next layer kernel launch early on sm_90+, compiled ones elsewhere.
Every variant is built and captured first, then all are timed in shuffled rounds (median).

    spinfer bench e2e [--layers 4] [--batches 1,8,16] [--steps 64] [--fused] [--prefill 512,2048] [--glue fused|pdl|norms|eager] [--rounds 5] [--dtype bf16]
    python benchmarks/bench_e2e.py ...      (same)
    spinfer bench e2e --tiny --device cpu   (a small smoke run of the same code, no graphs)
"""

from __future__ import annotations

import argparse
import copy
import re
import statistics
import sys
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

import spinfer
from spinfer.bench import pdl_glue
from spinfer.nn import SparseLinear
from spinfer.timing import rounds_of


def rms_norm(x, weight):
    return F.rms_norm(x, (x.shape[-1],), weight, 1e-5)


def add_rms_norm(x, r, weight):
    """The residual sum x + r and its RMSNorm: one kernel when compiled (serving engines fuse the
    two the same way)."""
    s = x + r
    return s, rms_norm(s, weight)


def silu_mul(gate, up):
    """SwiGLU's product: one kernel when compiled."""
    return F.silu(gate) * up


def decode_attention(q, k, v, kv_cache, pos):
    """One decode step's attention, the pdl glue's reference (its kernel does the same in one
    launch): the step's keys and values k, v [B, 1, kv_heads * hd] written into kv_cache
    [2, B, kv_heads, L, hd] at pos, then grouped-query SDPA of q [B, 1, heads * hd] over the cache
    positions <= pos. q, k and v may be row-strided views of one projection's output. Returns
    [B, 1, heads * hd], ready for o_proj."""
    b, kvh, hd = q.shape[0], kv_cache.shape[2], kv_cache.shape[-1]
    for i, new in enumerate((k, v)):
        kv_cache[i].index_copy_(2, pos, new.reshape(b, 1, kvh, hd).transpose(1, 2).to(kv_cache.dtype))
    positions = torch.arange(kv_cache.shape[3], device=q.device)
    a = F.scaled_dot_product_attention(q.reshape(b, 1, -1, hd).transpose(1, 2), kv_cache[0], kv_cache[1],
                                       attn_mask=additive_mask(positions, pos, q), enable_gqa=True)
    return a.transpose(1, 2).reshape(b, 1, -1)


def additive_mask(positions, pos, like):
    """[1, 1, 1, L] in like's dtype: 0 where a cache position is attended (<= pos), -inf past it.
    Attention takes it as is (a boolean mask was converted to an additive one in every layer)."""
    return torch.where(positions > pos, float("-inf"), 0.0).to(like.dtype).view(1, 1, 1, -1)


# The step's glue on CUDA. "fused" (this module's default): each function above is one
# torch.compile'd kernel.
# torch's own RMSNorm kernel took 6.3 us for one 4096-wide row on H100, and the residual adds,
# SiLU, product and mask a kernel each (~1.4 us plus a ~0.45 us launch gap in a graph); serving
# engines fuse them too, and every variant runs the same glue, so only the shared part of a step
# shrinks (docs/benchmarks.md). "norms": only RMSNorm compiled, the rest torch's kernels (the
# nineteenth to thirty-ninth sessions' glue, but for the one KV-cache write and the mask's
# kernels). "eager": torch's kernels throughout. "pdl" (the command's default where it runs, sm_90+):
# the norms, the SwiGLU product and the attention step (cache write included, no mask) as Triton
# kernels that let the next kernel launch before they end, so a layer kernel's weight copies
# overlap them (pdl_glue.py). The CPU always runs the functions eagerly.
_GLUE = {"mode": "fused"}
GLUES = ("pdl", "fused", "norms", "eager")
_COMPILED: dict = {}  # function name -> its compiled form


def _glue(fn, *args):
    """fn(*args): compiled on CUDA where the glue mode says so, else torch's kernels."""
    mode = _GLUE["mode"]
    if not args[0].is_cuda or mode == "eager" or (mode == "norms" and fn is not rms_norm):
        return fn(*args)
    if mode == "pdl" and fn.__name__ in pdl_glue.KERNELS:
        return pdl_glue.KERNELS[fn.__name__](*args)
    return _compiled_call(fn, *args)


def _attention_kernel() -> bool:
    """Whether the step's attention is decode_attention (the pdl glue's kernel on CUDA) rather than
    index_copy_ and SDPA under a mask made once a step. benchmarks/ab_e2e.py's "pdl-sdpa" glue
    takes the kernel out of pdl_glue.KERNELS to measure the PDL glue without it."""
    return _GLUE["mode"] == "pdl" and "decode_attention" in pdl_glue.KERNELS


def _compiled_call(fn, *args):
    """fn(*args) through torch.compile (compiled on the first call, a graph per shape); if the
    compiler fails (no Triton), torch's kernels from then on, said once."""
    compiled = _COMPILED.get(fn.__name__)
    if compiled is None:
        try:
            compiled = torch.compile(fn, dynamic=False)
            out = compiled(*args)
        except Exception as e:  # noqa: BLE001 (any compiler failure: the benchmark goes on eagerly)
            print(f"bench e2e: torch.compile of {fn.__name__} failed ({type(e).__name__}); torch's kernels instead",
                  file=sys.stderr)
            _GLUE["mode"] = "eager"
            return fn(*args)
        _COMPILED[fn.__name__] = compiled
        return out
    return compiled(*args)


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return _glue(rms_norm, x, self.weight)

    def add_forward(self, x, r):
        """(x + r, its norm); r None: (x, norm(x))."""
        if r is None:
            return x, self(x)
        if _GLUE["mode"] in ("fused", "pdl"):
            return _glue(add_rms_norm, x, r, self.weight)
        s = x + r
        return s, self(s)


class DecoderLayer(nn.Module):
    """Llama decoder layer for one-token steps against a static KV cache. fused: q, k and v in
    one [hidden + 2 * kv_heads * head_dim, hidden] projection and gate and up in one
    [2 * inter, hidden] (as serving engines store them): 4 linear launches a layer instead of 7.
    The keys and values share one cache buffer [2, B, kv_heads, L, head_dim], so with the fused
    projection one index_copy_ writes both."""

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
        self.register_buffer("kv_cache", torch.zeros(2, batch, kv_heads, max_len, self.hd))

    @property
    def k_cache(self):
        return self.kv_cache[0]

    @property
    def v_cache(self):
        return self.kv_cache[1]

    def _qkv(self, h):
        """h [B, T, H] -> q [B, heads, T, hd] and kv: keys and values [B, kv_heads, T, hd], as one
        [2, B, kv_heads, T, hd] view of the fused projection's output, or a (k, v) pair."""
        b, t = h.shape[:2]
        if self.fused:
            qkv = self.qkv_proj(h)
            q = qkv[..., : self.heads * self.hd]
            kv = qkv[..., self.heads * self.hd:].view(b, t, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        else:
            q = self.q_proj(h)
            kv = tuple(p(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        return q.reshape(b, t, self.heads, self.hd).transpose(1, 2), kv

    def _qkv_rows(self, h):
        """h [B, T, H] -> q [B, T, heads * hd], k and v [B, T, kv_heads * hd]: views of the fused
        projection's output, or the three projections' outputs."""
        if not self.fused:
            return self.q_proj(h), self.k_proj(h), self.v_proj(h)
        qkv = self.qkv_proj(h)
        dq, dkv = self.heads * self.hd, self.kv_heads * self.hd
        return qkv[..., :dq], qkv[..., dq:dq + dkv], qkv[..., dq + dkv:]

    def _mlp(self, x, a):
        """The attention output a [B, T, heads * hd] -> (x + o_proj(a), the MLP's output): the MLP's
        residual add is left to the next norm's kernel (Stack)."""
        x, h = self.norm2.add_forward(x, self.o_proj(a))
        if self.fused:
            m = _glue(silu_mul, *self.gate_up_proj(h).chunk(2, dim=-1))
        else:
            m = _glue(silu_mul, self.gate_proj(h), self.up_proj(h))
        return x, self.down_proj(m)

    def _rest(self, x, a):  # the layer's output from its attention output a [B, heads, T, hd]
        x, m = self._mlp(x, a.transpose(1, 2).reshape(*x.shape[:2], -1))
        return x + m

    def step(self, x, pending, pos, mask):
        """One decode step, x [B, 1, H] with the previous layer's MLP output `pending` not yet added
        (None: nothing pending) -> (x, this layer's MLP output: the next layer's pending). pos:
        1-element long tensor; mask [1, 1, 1, L]: True or 0.0 where a cache position is attended
        (unused with the pdl glue, whose attention step reads pos)."""
        x, h = self.norm1.add_forward(x, pending)
        if _attention_kernel():  # cache write and attention in one kernel on CUDA
            return self._mlp(x, _glue(decode_attention, *self._qkv_rows(h), self.kv_cache, pos))
        q, kv = self._qkv(h)
        if isinstance(kv, torch.Tensor):
            self.kv_cache.index_copy_(3, pos, kv)
        else:
            self.k_cache.index_copy_(2, pos, kv[0])
            self.v_cache.index_copy_(2, pos, kv[1])
        # Grouped-query attention straight on the cache (enable_gqa), not on a copy of it with each
        # KV head repeated for its query heads: that copy was two extra kernels a layer.
        a = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        return self._mlp(x, a.transpose(1, 2).reshape(*x.shape[:2], -1))

    def forward(self, x, pos, mask):
        x, m = self.step(x, None, pos, mask)
        return x + m

    def prefill(self, x):  # x [B, T, H]: a prompt; causal attention over it, its keys and values cached
        q, kv = self._qkv(self.norm1(x))
        t = x.shape[1]
        if isinstance(kv, torch.Tensor):
            self.kv_cache[:, :, :, :t].copy_(kv)
        else:
            for i, src in enumerate(kv):
                self.kv_cache[i, :, :, :t].copy_(src)
        a = F.scaled_dot_product_attention(q, kv[0], kv[1], is_causal=True, enable_gqa=True)
        return self._rest(x, a)


class Stack(nn.Module):
    def __init__(self, layers, hidden, inter, heads, kv_heads, max_len, batch, fused=False):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(hidden, inter, heads, kv_heads, max_len, batch, fused)
                                    for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.max_len = max_len
        self.register_buffer("positions", torch.arange(max_len), persistent=False)

    def forward(self, x, pos):
        # made once a step; the pdl glue's attention kernel masks by pos itself
        mask = None if _attention_kernel() else _glue(additive_mask, self.positions, pos, x)
        pending = None  # each layer's MLP output is added inside the next norm's kernel
        for layer in self.layers:
            x, pending = layer.step(x, pending, pos, mask)
        return self.norm.add_forward(x, pending)[1]

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


# From the fourth CUDA-graph capture in a process on (any capture, even of nothing, on any
# stream), the kernels of every graph launch further apart, graphs captured before as much as
# after: on the H100 (driver 580.159, torch 2.11) the idle gap before each kernel of a dense
# decode step went from ~0.1 to ~0.45 us, 1365 -> 1320 tokens/s (docs/benchmarks.md, fortieth
# session). A serving engine captures a graph per batch size and runs in the later state. The
# benchmark puts its process there before it times anything, so that no figure depends on how
# many graphs were captured before it (the first three variants of a run were timed in the fast
# state and the rest in the slow one until then).
SETTLE_CAPTURES = 4


def settle_graph_launches(device) -> None:
    """SETTLE_CAPTURES throwaway captures of one tiny kernel (see above)."""
    t = torch.zeros(1, device=device)
    for _ in range(SETTLE_CAPTURES):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            t.add_(1)
    torch.cuda.synchronize(device)


def capture(model, x, pos, keep_graph=False):
    """The decode step (its output feeds the next step: x, pos += 1) as a CUDA graph, after a
    warm-up that builds the kernels and makes and caches the policy's choices."""
    def step():
        x.copy_(model(x, pos))
        pos.add_(1)

    with torch.no_grad():
        for _ in range(3):
            step()
        pos.zero_()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph(keep_graph=keep_graph)
        with torch.cuda.graph(g):
            step()
    return g


def decode_runner(model, batch, hidden, steps, device, graphs: bool):
    """A callable that runs `steps` greedy decode steps of `model` from position 0 (on CUDA, by
    replaying the step's graph) and the tokens it makes."""
    x = torch.randn(batch, 1, hidden, device=device, dtype=model.norm.weight.dtype)
    pos = torch.zeros(1, dtype=torch.long, device=device)
    if device.type == "cuda" and graphs:
        one = capture(model, x, pos).replay
    else:
        def one():
            with torch.no_grad():
                x.copy_(model(x, pos))
                pos.add_(1)

    def run():
        pos.zero_()
        for _ in range(steps):
            one()

    return run, batch * steps


def prefill_runner(model, tokens, hidden, device, graphs: bool):
    """A callable that runs one prefill of `tokens` prompt tokens (batch 1; on CUDA a replayed
    graph, as the decode step is: eager, host launch gaps showed in the 512-token times, dense
    155-268k tokens/s over four runs of one lease) and the tokens it takes."""
    x = torch.randn(1, tokens, hidden, device=device, dtype=model.norm.weight.dtype)
    with torch.no_grad():
        for _ in range(2):  # warm up: kernels built, policy choices made and cached
            model.prefill(x)
        if device.type == "cuda" and graphs:
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                model.prefill(x)
            return g.replay, tokens

    def run():
        with torch.no_grad():
            model.prefill(x)

    return run, tokens


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
    p.add_argument("--glue", choices=GLUES, default=None,
                   help="the step's norms, residual adds, SwiGLU product and mask on CUDA: Triton kernels that let "
                        "the next layer launch early (pdl; the default with Triton on sm_90+), fused compiled kernels "
                        "(fused; the default elsewhere), only the norms compiled, or torch's kernels")
    p.add_argument("--eager-norms", action="store_const", dest="glue", const="eager", help="same as --glue eager")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds over every variant, interleaved (the first in list order, the rest shuffled)")
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="of the activations and dense weights")
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
    pdl = device.type == "cuda" and torch.cuda.is_available() and pdl_glue.available(device)
    if a.glue is None:
        a.glue = "pdl" if pdl else "fused"
    elif a.glue == "pdl" and device.type == "cuda" and not pdl:
        print("bench_e2e: --glue pdl needs Triton and compute capability 9.0+; fused glue instead", file=sys.stderr)
        a.glue = "fused"
    _GLUE["mode"] = a.glue
    dtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    graphs = device.type == "cuda" and not a.no_graphs
    if device.type == "cuda":
        spinfer.build.load_extension()
        print(f"device {torch.cuda.get_device_name(device)}; torch {torch.__version__}")
    if graphs:
        settle_graph_launches(device)
    print(f"{a.layers} decoder layers, hidden {hidden}, MLP {inter}, {heads}/{kv} heads, {a.steps} greedy steps, "
          f"{a.dtype}, {'CUDA graphs' if graphs else 'eager'}{', fused qkv and gate_up projections' if a.fused else ''}"
          f"{f', {a.glue} glue' if device.type == 'cuda' else ''}; median of {a.rounds} interleaved rounds")
    print(f"{'variant':<15} {'batch':>5} {'tokens/s':>10} {'x dense':>8} {'weights MiB':>11}  formats")
    torch.manual_seed(0)

    def run(base, label, n, runner):
        """Every variant of `base` (n tokens per linear call), built and captured first, then timed
        in interleaved rounds; one table row each, ratio to dense."""
        models = {name: build_variant(base, name, n) for name in variants}
        runs, tokens = {}, {}
        for name, model in models.items():
            runs[name], tokens[name] = runner(model)
        # Interleaved rounds, each call after one untimed one (its weights in flight, the previous
        # variant's out of L2; the stacks' weights are far larger than L2, so no flush): every
        # variant is timed in the same state of the machine (see SETTLE_CAPTURES).
        rounds = rounds_of(runs, device, rounds=a.rounds, shuffle=True, reps=1, warmup=1, flush_l2=False,
                           max_seconds=None)
        seconds = {name: statistics.median(ts) for name, ts in rounds.items()}
        dense_rate = tokens["dense"] / seconds["dense"] if "dense" in seconds else None
        for name, model in models.items():
            rate = tokens[name] / seconds[name]
            ratio = rate / dense_rate if dense_rate else float("nan")
            print(f"{name:<15} {label:>5} {rate:>10.1f} {ratio:>8.2f} {linear_bytes(model) / 2**20:>11.1f}  "
                  f"{formats(model, n)}", flush=True)
        del models, runs
        if device.type == "cuda":
            torch.cuda.empty_cache()

    for batch in batches:
        run(Stack(a.layers, hidden, inter, heads, kv, a.steps + 8, batch, a.fused).to(device, dtype), str(batch), batch,
            lambda m: decode_runner(m, batch, hidden, a.steps, device, graphs))
    for tokens in prompts:
        # A prompt through the same stack, batch 1: the linear layers see N = tokens, where the
        # layers run decode + cuBLAS (or the fused kernels, for "spmmNN" and below fused_max_n).
        run(Stack(a.layers, hidden, inter, heads, kv, tokens, 1, a.fused).to(device, dtype), f"p{tokens}", tokens,
            lambda m: prefill_runner(m, tokens, hidden, device, graphs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
