"""The CPU implementation of spinfer::spmm against a float64 reference, its op
registration (schema, fake implementation, torch.compile), and its input checks."""

import pytest
import torch

import spinfer
from spinfer.format import TCABME
from tests.conftest import rel_err
from tests.test_tca_bme import random_sparse

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m, k, n", [(64, 64, 1), (4097, 1000, 7), (100, 300, 33), (1, 1, 1)])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.999])
def test_matches_float64(m, k, n, sparsity, dtype):
    w = random_sparse((m, k), sparsity, dtype)
    x = torch.randn(n, k).to(dtype)
    b = torch.randn(m).to(dtype)
    enc = TCABME.from_dense(w)
    y = spinfer.spmm(x, enc, b)
    ref = x.double() @ w.double().t() + b.double()
    assert y.dtype == dtype and y.shape == (n, m)
    assert rel_err(y, ref) <= TOL[dtype]


def test_leading_batch_dims_and_empty_batch():
    w = random_sparse((48, 80), 0.5, torch.float16)
    enc = TCABME.from_dense(w)
    x = torch.randn(2, 3, 80).half()
    y = spinfer.spmm(x, enc)
    assert y.shape == (2, 3, 48)
    assert rel_err(y, x.double() @ w.double().t()) <= 2e-3
    assert spinfer.spmm(torch.randn(0, 80).half(), enc).shape == (0, 48)
    # a non-contiguous x is copied, not misread
    xt = torch.randn(80, 5).half().t()
    assert rel_err(spinfer.spmm(xt, enc), xt.double() @ w.double().t()) <= 2e-3


def test_opcheck_schema_and_fake():
    w = random_sparse((70, 90), 0.5, torch.float16)
    enc = TCABME.from_dense(w)
    x = torch.randn(5, 90).half()
    args = (x, enc.bitmap, enc.values, enc.gtile_offset, 70, 90, 64, 64, enc.max_run, None)
    torch.library.opcheck(torch.ops.spinfer.spmm.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.spinfer.spmm.default, (*args, 0, enc.row_offset),
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph():
    w = random_sparse((70, 90), 0.5, torch.float16)
    enc = TCABME.from_dense(w)
    b = torch.randn(70).half()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x):
        return spinfer.spmm(x, enc, b) * 2

    x = torch.randn(4, 90).half()
    assert rel_err(f(x), 2 * (x.double() @ w.double().t() + b.double())) <= 2e-3


@pytest.fixture
def enc():
    return TCABME.from_dense(random_sparse((40, 50), 0.5, torch.float16))


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda e: (torch.randn(3, 49).half(), e, None), ValueError, r"\[\.\.\., 50\]"),
        (lambda e: (torch.randn(3, 50), e, None), TypeError, "float32"),
        (lambda e: (torch.randn(3, 50).bfloat16(), e, None), TypeError, "bfloat16"),
        (lambda e: (torch.randn(3, 50).half(), e, torch.randn(41).half()), ValueError, "bias"),
        (lambda e: (torch.randn(3, 50).half(), e, torch.randn(40)), TypeError, "bias"),
        (lambda e: (torch.randn(3, 50).half(), e.to_dense(), None), TypeError, "TCABME"),
        (lambda e: (torch.tensor(1.0).half(), e, None), ValueError, "shape"),
        (lambda e: (torch.randn(3, 50).half().to("meta"), e, None), ValueError, "meta"),
    ],
)
def test_bad_input(enc, make, error, words):
    with pytest.raises(error, match=words):
        spinfer.spmm(*make(enc))


def test_op_called_directly_validates_arrays(enc):
    off = enc.gtile_offset.clone()
    off[1] += 8
    x = torch.randn(2, 50).half()
    with pytest.raises(ValueError, match="gtile_offset|GroupTile"):
        torch.ops.spinfer.spmm(x, enc.bitmap, enc.values, off, 40, 50, 64, 64, 4096)


def test_op_checks_the_row_table_it_is_given(enc):
    """The row table is optional; one of the wrong dtype or shape is refused, as on CUDA."""
    x = torch.randn(2, 50).half()
    args = (x, enc.bitmap, enc.values, enc.gtile_offset, 40, 50, 64, 64, enc.max_run, None, 0)
    assert torch.equal(torch.ops.spinfer.spmm(*args, enc.row_offset), torch.ops.spinfer.spmm(*args))
    with pytest.raises(TypeError, match="row_offset"):
        torch.ops.spinfer.spmm(*args, enc.row_offset.int())
    with pytest.raises(ValueError, match="row_offset"):
        torch.ops.spinfer.spmm(*args, enc.row_offset.reshape(-1))


def test_op_refuses_a_max_run_below_the_longest_run(enc):
    x = torch.randn(2, 50).half()
    with pytest.raises(ValueError, match="max_run"):
        torch.ops.spinfer.spmm(x, enc.bitmap, enc.values, enc.gtile_offset, 40, 50, 64, 64, enc.max_run - 8)


def test_max_run_is_the_longest_group_tile_run():
    w = torch.zeros(64, 192, dtype=torch.float16)
    w[:, 64:128] = 1.0  # one dense GroupTile between two empty ones
    enc = TCABME.from_dense(w)
    assert enc.max_run == 4096
    assert TCABME.from_state_dict(enc.state_dict()).max_run == 4096


def test_spmm_out_on_cpu_writes_the_reference():
    w = torch.randn(64, 128).half().masked_fill(torch.rand(64, 128) < 0.5, 0)
    enc = TCABME.from_dense(w)
    x = torch.randn(3, 128).half()
    out = torch.full((3, 64), float("nan")).half()
    torch.ops.spinfer.spmm_out(x, enc.bitmap, enc.values, enc.gtile_offset, 64, 128, 64, 64, enc.max_run, None,
                               out=out)
    assert rel_err(out, x.double() @ w.double().t()) <= 2e-3
