"""The decode step's glue as Triton kernels that let the next kernel launch early (programmatic
dependent launch, sm_90+): `spinfer bench e2e --glue pdl`, the default on such GPUs.

The SMBD and low-bit kernels are launched with programmatic stream serialization (launch.cuh):
their blocks issue the copies of their first stages' weights, which no earlier kernel writes, and
only then wait (griddepcontrol.wait) for the previous kernel's output, x. That overlap only
happens if the previous kernel lets them launch before it ends (griddepcontrol.launch_dependents);
torch's and torch.compile's kernels never do, so each layer launch started its weight stream only
after the glue kernel before it had finished (docs/kernels.md, tenth session). These kernels are
launched with the same attribute, wait for their inputs (gdc_wait) and then trigger their
dependents, before their own work. Every variant runs the same glue kernels; a kernel launched
without the attribute (cuBLAS, through torch) still waits for them to finish as usual.

Why after the wait, not first thing (H100, docs/benchmarks.md, forty-first session): with the
trigger before the wait the sparse stacks lost 4-9% at batch 8 and 16 (the next layer may then
start while the layer before this kernel is still in its split-K epilogue); after it they gain or
tie at every batch.

Same arithmetic as the compiled glue of e2e.py: the residual sum rounded to the activations'
dtype, the norm in fp32.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the benchmark uses the compiled or eager glue
    triton = None


def available(device) -> bool:
    """Triton present and a GPU with programmatic dependent launch (compute capability 9.0+)."""
    device = torch.device(device)
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, d, eps, HAS_R: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        tl.extra.cuda.gdc_wait()  # x and r are earlier kernels' outputs
        tl.extra.cuda.gdc_launch_dependents()  # the next layer's blocks may start their weight copies
        cols = tl.arange(0, BLOCK)
        m = cols < d
        x = tl.load(x_ptr + row * d + cols, mask=m, other=0.0)
        if HAS_R:
            r = tl.load(r_ptr + row * d + cols, mask=m, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(s_ptr + row * d + cols, x, mask=m)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / d + eps)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * d + cols, (xf * rstd * w).to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, stride_g, stride_u, BLOCK: tl.constexpr):
        row, blk = tl.program_id(0), tl.program_id(1)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        m = cols < n
        g = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n + cols, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last] without a copy (a view with unit stride along the last dimension)."""
    v = t.reshape(-1, t.shape[-1])
    if v.stride(-1) != 1 or v.data_ptr() != t.data_ptr():
        raise ValueError("pdl glue: the rows must be strided views with contiguous last dimension")
    return v


def add_rms_norm(x: torch.Tensor, r, weight: torch.Tensor, eps: float = 1e-5, *, out=None):
    """(x + r, RMSNorm(x + r) * weight); r None: (x, RMSNorm(x) * weight). One kernel. out: the
    (sum, norm) buffers to write, contiguous, x's shape and dtype (tests poison them)."""
    d = x.shape[-1]
    x2 = x.contiguous().view(-1, d)
    if out is None:
        y = torch.empty_like(x2)
        s = torch.empty_like(x2) if r is not None else x2
    else:
        s, y = (t.view(-1, d) for t in out)
        s = s if r is not None else x2
    r2 = r.contiguous().view(-1, d) if r is not None else x2
    _add_rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, s, y, d, eps, HAS_R=r is not None,
                                         BLOCK=triton.next_power_of_2(d), num_warps=8 if d >= 2048 else 4,
                                         launch_pdl=True)
    return s.view(x.shape), y.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor):
    return add_rms_norm(x, None, weight)[1]


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, out=None):
    """SiLU(gate) * up, one kernel; gate and up may be views of one projection's output. out: a
    contiguous buffer of gate's shape and dtype to write (tests poison it)."""
    g, u = _rows(gate), _rows(up)
    n = g.shape[1]
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device) if out is None else out.view(g.shape)
    block = 1024
    _silu_mul_kernel[(g.shape[0], triton.cdiv(n, block))](g, u, out, n, g.stride(0), u.stride(0), BLOCK=block,
                                                         num_warps=4, launch_pdl=True)
    return out.view(gate.shape)


# e2e.py's glue functions by name -> these kernels (its _glue dispatches on the name)
KERNELS = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "silu_mul": silu_mul}
