"""The grouped GEMM's Blackwell path (tcgen05 MMAs into TMEM) in GPU interpret mode: cases of
test_grouped_matmul.py with the kernel built for sm_100a.

jax 0.11.2's interpret mode models tcgen05_mma, TMEM and the tensor-core barriers (it also refuses a
barrier arrived on twice without a wait between); it does not check tcgen05's shape and layout rules,
which lowering for sm_100a does (test_lowering.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from m3jax.pallas import _backend
from m3jax.pallas.grouped_matmul import GroupedMatmulConfig, unsupported_reason
from tests.pallas.test_grouped_matmul import PATTERNS, _check, _check_mxfp8, _inputs, _mxfp8_weights


@pytest.fixture(autouse=True)
def _blackwell():
    _backend.reset_interpret_state()
    with _backend.interpret_as(_backend.BLACKWELL):
        yield


def test_groups_straddling_tiles():
    # 64-row tiles (a 64-row MMA), two K steps with the one-step-delayed buffer release
    # Machine: any: the Blackwell (sm_100a) variant in interpret mode, on a CPU and on a GPU alike
    m, sizes = PATTERNS["group_larger_than_tile"]
    _check(*_inputs(m, 128, 128, sizes, jnp.bfloat16))


def test_128_row_tiles_three_stages_fp32_out():
    # Machine: any: the Blackwell (sm_100a) variant in interpret mode, on a CPU and on a GPU alike
    lhs, rhs, gs = _inputs(200, 192, 256, [5, 70, 0, 60, 40], jnp.bfloat16, seed=1)
    _check(lhs, rhs, gs, cfg=GroupedMatmulConfig(block_m=128, block_n=128, max_concurrent_steps=3),
           out_dtype=jnp.float32)


def test_single_k_step():
    # Machine: any: the Blackwell (sm_100a) variant in interpret mode, on a CPU and on a GPU alike
    _check(*_inputs(40, 64, 128, [10, 25], jnp.bfloat16, seed=2))


def test_64_row_tiles_need_128_columns():
    # Machine: any: the Blackwell (sm_100a) variant in interpret mode, on a CPU and on a GPU alike
    assert "block_n=64" in unsupported_reason(256, 128, 256, 2, GroupedMatmulConfig(block_m=64, block_n=64))


def test_mxfp8_weights():
    # the fp8 tiles dequantised into the two bf16 buffers the tcgen05 MMAs read (freed by the same
    # one-step-delayed barrier wait as the pipeline's buffers)
    # Machine: any: the Blackwell (sm_100a) variant in interpret mode, on a CPU and on a GPU alike
    m, sizes = PATTERNS["group_larger_than_tile"]
    lhs, _, gs = _inputs(m, 128, 128, sizes, jnp.bfloat16)
    _check_mxfp8(lhs, *_mxfp8_weights(len(sizes), 128, 128), gs)


def test_mxfp8_decode_takes_the_gemv():
    # MXFP8 decode rows on a B200 run the gemv schedule as on Hopper (no MMA in it; its K split from the
    # target's 148 SMs), through the config the MoE layer picks
    # Machine: any: the Blackwell (sm_100a) variant in interpret mode, on a CPU and on a GPU alike
    from m3jax.pallas.grouped_matmul import layer_config

    lhs, _, gs = _inputs(7, 256, 256, [2, 0, 4, 1], jnp.bfloat16, seed=5)
    cfg = layer_config(7, 256, 256, 4, 8)
    assert cfg.schedule == "gemv"
    _check_mxfp8(lhs, *_mxfp8_weights(4, 256, 256, seed=6), gs, cfg=cfg)
