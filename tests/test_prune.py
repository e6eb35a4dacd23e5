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
