"""Writes the format 3 checkpoints in this folder with spinfer as of 520849e (low-bit format 3),
for tests/test_format3.py, which loads them with the current format:

    mkdir /tmp/f3 && git archive 520849e | tar -x -C /tmp/f3
    PYTHONPATH=/tmp/f3 python tests/data/make_format3.py
"""
import os

import torch
import torch.nn as nn
from safetensors.torch import save_file

import spinfer
from spinfer.nn import SparseLinear
from spinfer.quant import LowBitWeight

HERE = os.path.dirname(os.path.abspath(__file__))
assert spinfer.quant.lowbit.FORMAT_VERSION == 3, "run this with spinfer at 520849e (see above)"
torch.manual_seed(3)
out = {}
for name, bits, g, dt in (("w4g128", 4, 128, torch.float16), ("w2g64", 2, 64, torch.bfloat16), ("w8", 8, None, torch.float16)):
    q = LowBitWeight.quantize(torch.randn(70, 256).to(dt), bits, g)
    for k, v in q.state_dict().items():
        out[f"{name}.{k}"] = v
    out[f"{name}.expected"] = q.dequantize()
hqq = LowBitWeight.from_hqq(torch.randint(0, 16, (70, 256)), torch.rand(70, 2).half() * 0.01, (torch.rand(70, 2) * 15).half(), 4, 128, (70, 256))
for k, v in hqq.state_dict().items():
    out[f"hqq.{k}"] = v
out["hqq.expected"] = hqq.dequantize()
save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(HERE, "format3-lowbit.safetensors"))
model = nn.Sequential(SparseLinear.from_linear(nn.Linear(256, 70).half(), quant="w4", policy="lowbit"))
spinfer.save(model, os.path.join(HERE, "format3-model.safetensors"))
x = torch.randn(3, 256).half()
save_file({"x": x, "y": model(x).contiguous()}, os.path.join(HERE, "format3-model-io.safetensors"))
print({k: tuple(v.shape) for k, v in out.items() if "scale_zero" in k})
