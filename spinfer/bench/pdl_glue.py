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
dtype, the norm in fp32. The attention step (forty-second session) is one kernel where the other
glues run three (index_copy_ into the cache, SDPA, and a mask made once a step): softmax in fp32,
the probabilities rounded to fp16 for the product with V, as flash attention does.
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

    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, c_ptr, pos_ptr, o_ptr, stride_q, stride_k, stride_v, batch,
                                 max_len, scale, GROUP: tl.constexpr, KV_HEADS: tl.constexpr, HD: tl.constexpr,
                                 BLOCK_G: tl.constexpr, BLOCK_L: tl.constexpr, PDL: tl.constexpr):
        # One program per (sequence, KV head): the GROUP query heads that share the KV head, padded
        # to BLOCK_G rows (tl.dot's least tile; the padding rows are zeros and never stored).
        b, h = tl.program_id(0), tl.program_id(1)
        if PDL:
            tl.extra.cuda.gdc_wait()  # q, k and v are the projection's output
            # o_proj's blocks may start their weight copies (triggering after the stores instead
            # measured the same, H100, batches 1 and 16)
            tl.extra.cuda.gdc_launch_dependents()
        pos = tl.load(pos_ptr).to(tl.int32)
        d = tl.arange(0, HD)
        g = tl.arange(0, BLOCK_G)
        heads = h * GROUP + g
        k_new = tl.load(k_ptr + b * stride_k + h * HD + d)
        v_new = tl.load(v_ptr + b * stride_v + h * HD + d)
        k_cache = c_ptr + (b * KV_HEADS + h) * max_len * HD
        v_cache = c_ptr + ((batch + b) * KV_HEADS + h) * max_len * HD
        in_cache = (d < HD) & (pos >= 0) & (pos < max_len)  # (d < HD: the scalar test as a row mask)
        tl.store(k_cache + pos * HD + d, k_new, mask=in_cache)
        tl.store(v_cache + pos * HD + d, v_new, mask=in_cache)
        q = tl.load(q_ptr + b * stride_q + heads[:, None] * HD + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
        # Position pos from the registers (its cache slot is this program's own store); the earlier
        # positions from the cache, BLOCK_L at a time, with the running max and sum (online softmax).
        m_i = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
        l_i = tl.full([BLOCK_G], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_G, HD], tl.float32) + v_new.to(tl.float32)[None, :]
        n_seen = tl.minimum(pos, max_len)
        for start in range(0, max_len, BLOCK_L):  # the whole cache, masked past pos (as SDPA's mask does)
            offs = start + tl.arange(0, BLOCK_L)
            seen = offs < n_seen
            kt = tl.load(k_cache + offs[:, None] * HD + d[None, :], mask=seen[:, None], other=0.0)
            s = tl.where(seen[None, :], tl.dot(q, tl.trans(kt)) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(v_cache + offs[:, None] * HD + d[None, :], mask=seen[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
        out = (acc / l_i[:, None]).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + b * (GROUP * KV_HEADS * HD) + heads[:, None] * HD + d[None, :], out, mask=(g < GROUP)[:, None])


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


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, pos: torch.Tensor,
                     *, out=None, pdl: bool = True):
    """One decode step's attention in one kernel: k and v [B, 1, kv_heads * hd] written into
    kv_cache [2, B, kv_heads, L, hd] at pos (a 1-element long tensor on the GPU), then grouped-query
    softmax(q k^T / sqrt(hd)) v of q [B, 1, heads * hd] over the positions <= pos, fp32 inside.
    q, k and v may be row-strided views of one projection's output. Returns [B, 1, heads * hd]
    (out: that buffer, contiguous, which tests poison). pdl=False leaves out the launch attribute
    and the grid-dependency instructions (for Triton's interpreter). Replaces e2e's torch SDPA,
    its index_copy_ and its mask: three kernels a layer, one of them before a step's layers."""
    b, hd = q.shape[0], kv_cache.shape[-1]
    if kv_cache.dim() != 5 or kv_cache.shape[:2] != (2, b) or not kv_cache.is_contiguous():
        raise ValueError(f"decode_attention: kv_cache must be a contiguous [2, {b}, kv_heads, L, hd], got "
                         f"{tuple(kv_cache.shape)}")
    kv_heads, max_len = kv_cache.shape[2], kv_cache.shape[3]
    qr, kr, vr = _rows(q), _rows(k), _rows(v)
    if (q.shape[1] != 1 or qr.shape[0] != b or qr.shape[1] % (kv_heads * hd) or kr.shape != (b, kv_heads * hd)
            or vr.shape != kr.shape):
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not "
                         f"match one token of a {tuple(kv_cache.shape)} cache")
    if len({t.dtype for t in (q, k, v, kv_cache)}) != 1 or pos.numel() != 1 or pos.device != q.device:
        raise ValueError(f"decode_attention: q, k, v and the cache must share a dtype (got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}, {kv_cache.dtype}) and pos be one position on their device (got "
                         f"{tuple(pos.shape)} on {pos.device})")
    if hd < 16 or hd & (hd - 1):
        raise ValueError(f"decode_attention: head dim {hd} must be a power of two >= 16")
    group = qr.shape[1] // (kv_heads * hd)
    out = torch.empty(b, 1, qr.shape[1], dtype=q.dtype, device=q.device) if out is None else out
    _decode_attention_kernel[(b, kv_heads)](qr, kr, vr, kv_cache, pos, out, qr.stride(0), kr.stride(0), vr.stride(0),
                                            b, max_len, hd ** -0.5, GROUP=group, KV_HEADS=kv_heads, HD=hd,
                                            BLOCK_G=max(16, triton.next_power_of_2(group)),
                                            BLOCK_L=min(128, max(16, triton.next_power_of_2(max_len))), PDL=pdl,
                                            num_warps=4, launch_pdl=pdl)
    return out


# e2e.py's glue functions by name -> these kernels (its _glue dispatches on the name)
KERNELS = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "silu_mul": silu_mul,
           "decode_attention": decode_attention}
