"""fagen.testing on the CPU: the fp8 cases' descale factors and the dequantized values the reference compares with,
and a tolerance for every dtype. (The property suite itself runs kernels: the *_gpu test files.)"""
import dataclasses

import numpy as np
import pytest

from fagen.spec import DTYPES, Spec
from fagen.testing import TOLERANCES, Case, _dequantized, fp8_descales, make_inputs

torch = pytest.importorskip("torch")

CASE = Case(batch=2, heads=4, seq_q=5, seq_k=7, layout="bnhd", data_seed=3, seed=0, offset=0, kv_heads=2)


def test_every_dtype_has_a_tolerance():
    assert set(TOLERANCES) == set(DTYPES) and TOLERANCES["fp8_e4m3"] == 2.0**-4


def test_fp8_inputs_are_e4m3_and_descales_are_per_tensor_or_per_sequence_and_kv_head():
    spec = Spec(head_dim=64, dtype="fp8_e4m3")
    q, k, v = make_inputs(spec, CASE, device="cpu")
    assert q.dtype == k.dtype == v.dtype == torch.float8_e4m3fn
    assert q.shape == (2, 4, 5, 64) and k.shape == (2, 2, 7, 64) and q.float().abs().sum() > 0
    seen = {name: set() for name in ("q_descale", "k_descale", "v_descale")}
    for data_seed in range(40):
        case = dataclasses.replace(CASE, data_seed=data_seed)
        descales = fp8_descales(case, 2, 2, "cpu")
        for name, t in descales.items():
            seen[name].add(tuple(t.shape))
        assert all(((t >= 0.5) & (t <= 2.0)).all() and t.dtype == torch.float32 for t in descales.values())
        again = fp8_descales(case, 2, 2, "cpu")
        assert all(torch.equal(descales[name], again[name]) for name in descales)   # replayable from the case
    # across cases each factor comes in both of FlashAttention-3's forms
    assert seen == {name: {(1,), (2, 2)} for name in seen}


def test_dequantized_padded_values_take_each_query_heads_kv_head_factor():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 4, 5, 8)), rng.standard_normal((2, 2, 7, 8)), rng.standard_normal((2, 2, 7, 8))
    descales = {"q_descale": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "k_descale": torch.tensor([0.5]),
                "v_descale": torch.tensor([[5.0, 6.0], [7.0, 8.0]])}
    dq, dk, dv = _dequantized((q, k, v), descales, heads=4)
    # query heads 0, 1 read K/V head 0; 2, 3 head 1 (grouped heads)
    assert np.array_equal(dq[1, 3], 4.0 * q[1, 3]) and np.array_equal(dq[0, 1], 1.0 * q[0, 1])
    assert np.array_equal(dk, 0.5 * k) and np.array_equal(dv[1, 0], 7.0 * v[1, 0])


def test_dequantized_packed_rows_take_their_sequences_factor_and_spare_rows_one():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((6, 2, 8))          # rows 0-2: sequence 0, 3-4: sequence 1, 5: no sequence
    kv = rng.standard_normal((4, 1, 8))
    descales = {"q_descale": torch.tensor([[2.0], [3.0]]), "k_descale": torch.tensor([[5.0], [7.0]]),
                "v_descale": torch.tensor([1.5])}
    rows_q, rows_k = np.array([0, 0, 0, 1, 1, 2]), np.array([0, 1, 1, 1])
    dq, dk, dv = _dequantized((q, kv, kv), descales, heads=2, row_sequence=(rows_q, rows_k, rows_k))
    assert np.array_equal(dq[:3], 2.0 * q[:3]) and np.array_equal(dq[3:5], 3.0 * q[3:5])
    assert np.array_equal(dq[5], q[5])
    assert np.array_equal(dk[0], 5.0 * kv[0]) and np.array_equal(dk[1:], 7.0 * kv[1:]) and np.array_equal(dv, 1.5 * kv)
