"""The Blackwell decode kernels (tcgen05 MMAs into TMEM, m3jax/pallas/decode/blackwell.py) in GPU
interpret mode: test_decode.py's checks, with the kernels built for sm_100a.

jax 0.11.2's interpret mode models tcgen05_mma, TMEM and the tensor-core barriers, so these check the
kernels' semantics; it does not check tcgen05's shape, layout and TMEM rules, which lowering for
sm_100a does (test_lowering.py). Index scoring: block 64 runs one 64-row MMA tile per page
(test_decode's cases), 192 three 64-row tiles, 256 two 128-row tiles. Attention: test_decode's own
bodies (whole decode steps, sub-page K/V tiles), the query rows padded to one 128-row tile. The fused
decode selection has no Blackwell port: its fallback (scoring kernel, then top-k kernel) runs
test_decode_select's check.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.pallas import _backend
from m3jax.pallas import decode as D
from m3jax.pallas.tolerances import TOL
from tests.pallas import test_decode
from tests.pallas.test_decode import check_scores, make_case


@pytest.fixture(autouse=True)
def _blackwell(monkeypatch):
    calls = []
    for name in ("decode_index_scores", "decode_index_score_rows", "sparse_decode_attention"):
        kernel = getattr(D._blackwell, name)
        monkeypatch.setattr(D._blackwell, name, lambda *a, _k=kernel, **kw: calls.append(1) or _k(*a, **kw))
        # the Hopper ones must not run
        monkeypatch.setattr(D._hopper, name, lambda *a, _n=name, **kw: pytest.fail(f"Hopper {_n} ran"))
    _backend.reset_interpret_state()
    with _backend.interpret_as(_backend.BLACKWELL):
        yield
    assert calls, "no Blackwell kernel ran"
    assert not _backend.interpret_races_found()


@pytest.mark.parametrize("q_len,dtype,splits", [(1, jnp.float32, 2), (4, jnp.bfloat16, 1)])
def test_decode_step_as_test_decode(q_len, dtype, splits):
    # test_decode.test_decode_step: index scores, top-k and the sparse attention of one step (Q = 1:
    # fewer visible blocks than top-k, fp32 as bf16 pieces; Q = 4: a query at position -1, bf16).
    # Machine: any: the Blackwell (sm_100a) variant in interpret mode, on a CPU and on a GPU alike
    test_decode.test_decode_step(q_len, dtype, splits, None, "smem")


def test_attention_sub_page_tiles_as_test_decode():
    # pages of 128 keys as two 64-key pipeline steps, fp32
    # Machine: any: the Blackwell (sm_100a) variant in interpret mode, on a CPU and on a GPU alike
    test_decode.test_attention_sub_page_tiles()


@pytest.mark.parametrize("ik_dtype", [None, jnp.float8_e4m3fn])
def test_decode_scores_as_test_decode(ik_dtype):
    # test_decode.test_decode_step's scoring half at Q=4: a first query at position -1, a length that
    # is not a multiple of the block, shuffled page tables (fp32 runs in the block-192 cases below);
    # index-key pages in bf16 and fp8 (converted in SMEM for the MMA).
    # Machine: any: the Blackwell (sm_100a) variant in interpret mode, on a CPU and on a GPU alike
    _, iq, _, _, ikp, pt, sl = make_case([3, 150, 256], 4, jnp.bfloat16, seed=4, ik_dtype=ik_dtype)
    check_scores(iq, ikp, pt, sl, splits=1)


@pytest.mark.parametrize("bs,dtype,ik_dtype", [(192, jnp.float32, None), (256, jnp.bfloat16, None),
                                               (192, jnp.float32, jnp.float8_e4m3fn)])
def test_several_mma_tiles_per_page(bs, dtype, ik_dtype):
    # Machine: any: the Blackwell (sm_100a) variant in interpret mode, on a CPU and on a GPU alike
    _, iq, _, _, ikp, pt, sl = make_case([bs + 37, 2 * bs], 2, dtype, seed=bs, bs=bs, ik_dtype=ik_dtype)
    got = np.asarray(D.decode_index_scores(iq, ikp, pt, sl, block_size=bs, config=D.DecodeScoreConfig(num_splits=2)))
    ref = np.asarray(D.decode_index_scores(iq, ikp, pt, sl, block_size=bs, implementation="reference"))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], **TOL[("index_scores", jnp.dtype(dtype).name)])


def test_fused_selection_falls_back_as_test_decode_select(monkeypatch):
    # decode_select_blocks has no tcgen05 port: on Blackwell it runs the scoring kernel, then the top-k
    # kernel, and selects what test_decode_select's reference selects (integer inputs: ids in order).
    # Machine: any: the Blackwell (sm_100a) variant in interpret mode, on a CPU and on a GPU alike
    from tests.pallas import test_decode_select

    monkeypatch.setattr(D._hopper, "decode_select_blocks", lambda *a, **kw: pytest.fail("Hopper fused selection ran"))
    test_decode_select.test_decode_select_blocks([100, 700], 1, jnp.bfloat16, jnp.float8_e4m3fn, 3, "bfloat16", True,
                                                 "smem")
