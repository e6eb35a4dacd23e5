import pytest
import torch

from spinfer.prune import magnitude_mask, magnitude_prune


@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.999])
@pytest.mark.parametrize("per_row", [False, True])
def test_exact_count_and_smallest_dropped(sparsity, per_row):
    w = torch.randn(64, 200).half()
    keep = magnitude_mask(w, sparsity, per_row=per_row)
    if per_row:
        assert bool((keep.sum(1) == 200 - round(sparsity * 200)).all())
    else:
        assert int(keep.sum()) == w.numel() - round(sparsity * w.numel())
    # every dropped magnitude is <= every kept one (per row with per_row)
    groups = [(w.abs()[r], keep[r]) for r in range(64)] if per_row else [(w.abs(), keep)]
    for a, k in groups:
        if k.any() and (~k).any():
            assert a[~k].max() <= a[k].min()


def test_ties_in_fp16_are_counted_exactly():
    w = torch.full((10, 10), 0.5, dtype=torch.float16)
    assert int(magnitude_mask(w, 0.37).sum()) == 63


def test_pruned_entries_are_positive_zero():
    w = -torch.rand(32, 32).half() - 0.1
    p = magnitude_prune(w, 0.5)
    zeros = p == 0
    assert int(zeros.sum()) == 512
    assert bool((p.view(torch.int16)[zeros] == 0).all())  # not -0.0


@pytest.mark.parametrize("s, error", [(1.0, ValueError), (-0.1, ValueError), ("half", TypeError)])
def test_bad_sparsity(s, error):
    with pytest.raises(error, match="sparsity"):
        magnitude_prune(torch.randn(4, 4), s)


def test_bad_weight():
    with pytest.raises(ValueError, match="2-D"):
        magnitude_prune(torch.randn(4), 0.5)


def reference_mask(w: torch.Tensor, sparsity: float, per_row: bool) -> torch.Tensor:
    """The definition: drop the round(s * n) smallest |w|, ties in position order (a stable sort)."""
    score = w.abs().float()
    if per_row:
        drop = round(sparsity * w.shape[1])
        keep = torch.ones_like(score, dtype=torch.bool)
        keep.scatter_(1, torch.argsort(score, dim=1, stable=True)[:, :drop], False)
        return keep
    drop = round(sparsity * w.numel())
    keep = torch.ones(w.numel(), dtype=torch.bool)
    keep[torch.argsort(score.reshape(-1), stable=True)[:drop]] = False
    return keep.reshape(w.shape)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sparsity", [0.1, 0.5, 0.7, 0.999])
def test_mask_is_the_stable_sort_definition(per_row, dtype, sparsity):
    # coarse values: thousands of ties at every magnitude, zeros of both signs, and subnormals
    w = (torch.randn(97, 301) * 8).round().to(dtype) / 8
    w[0, :5] = torch.tensor([0.0, -0.0, 1e-6, -1e-6, 3.0]).to(dtype)
    w[5] = 0.25  # a row of ties
    assert torch.equal(magnitude_mask(w, sparsity, per_row=per_row), reference_mask(w, sparsity, per_row))


def test_mask_over_scores_spread_across_the_float_range():
    # keys whose high halves differ and whose low halves decide: the radix select's two levels
    w = torch.exp(torch.randn(200, 300) * 20)
    w[w > 1e30] = 1e30
    w.view(-1)[::7] = w.view(-1)[3]  # ties in the middle of the range
    for sparsity in (0.01, 0.33, 0.5, 0.9):
        assert torch.equal(magnitude_mask(w, sparsity), reference_mask(w, sparsity, False))
