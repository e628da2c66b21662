"""Bad input at the kernels' public entry points: a ValueError naming the entry point, the array and the
dimension, raised before any kernel runs. Left to the kernels, these shapes gave NaN heads (a
``block_idx`` with fewer KV heads than ``k``), silently wrong scores (mismatched head dims or batches),
or a crash inside the interpreter."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from m3jax.layers import MXFP8Weight
from m3jax.pallas import decode, index_scores, sparse_attention, topk
from m3jax.pallas._common import check_dims
from m3jax.pallas.grouped_matmul import grouped_matmul, grouped_matmul_mxfp8

BF = jnp.bfloat16


def _ones(*shape, dtype=BF):
    return jnp.ones(shape, dtype)


Q_POS = jnp.arange(56, 64, dtype=jnp.int32)[None]  # [B=1, T=8]
IQ = _ones(1, 8, 2, 64)  # [B, T, Hi, Hx]
Q = _ones(1, 8, 16, 64)  # [B, T, N, H]
KV = _ones(1, 64, 2, 64)  # [B, S, K, H]
QD = _ones(1, 1, 8, 64)  # decode q [B, Q, N, H]
PAGES = _ones(4, 64, 2, 64)  # [pages, block_size, K, H]
PAGE_TABLE = jnp.zeros((1, 4), jnp.int32)
SEQ_LENS = jnp.array([100], jnp.int32)


def _decode_attention(impl, block_idx, page_table=PAGE_TABLE, block_size=64):
    """sparse_decode_attention on QD and PAGES with one of its other operands or the block size changed."""
    return decode.sparse_decode_attention(QD, PAGES, PAGES, page_table, block_idx, SEQ_LENS, block_size=block_size,
                                          implementation=impl)


CASES = {
    "index scores: Hx differs": (
        lambda impl: index_scores.index_block_scores(IQ, _ones(1, 64, 128), Q_POS, block_size=16, implementation=impl),
        r"index_block_scores: ik has Hx=128"),
    "index scores: batch differs": (
        lambda impl: index_scores.index_block_scores(_ones(2, 8, 2, 64), _ones(1, 64, 64), jnp.tile(Q_POS, (2, 1)),
                                                     block_size=16, implementation=impl),
        r"ik has B=1 .* but iq has B=2"),
    "index select: q_pos length": (
        lambda impl: index_scores.index_select_blocks(IQ, _ones(1, 64, 64), Q_POS[:, :4], block_size=16, topk=2,
                                                      implementation=impl),
        r"index_select_blocks: q_pos has T=4"),
    "top-k: topk 0": (
        lambda impl: topk.select_blocks(_ones(1, 2, 8, 4, dtype=jnp.float32), Q_POS, block_size=16, topk=0,
                                        implementation=impl),
        r"select_blocks: topk must be >= 1"),
    "top-k: scores rank": (
        lambda impl: topk.select_blocks(_ones(2, 8, 4, dtype=jnp.float32), Q_POS, block_size=16, topk=2,
                                        implementation=impl),
        r"scores must be \[B, Hi, T, nb\]"),
    "sparse attention: block_idx KV heads": (
        lambda impl: sparse_attention.sparse_attention(Q, KV, KV, jnp.zeros((1, 1, 8, 2), jnp.int32), Q_POS,
                                                       block_size=16, implementation=impl),
        r"block_idx has K=1 .* but k has K=2"),
    "sparse attention: v shorter than k": (
        lambda impl: sparse_attention.sparse_attention(Q, KV, KV[:, :32], jnp.zeros((1, 2, 8, 2), jnp.int32), Q_POS,
                                                       block_size=16, implementation=impl),
        r"v has S=32"),
    "sparse attention: heads not a multiple": (
        lambda impl: sparse_attention.sparse_attention(_ones(1, 8, 15, 64), KV, KV, jnp.zeros((1, 2, 8, 2), jnp.int32),
                                                       Q_POS, block_size=16, implementation=impl),
        r"N=15 must be a multiple of the KV heads K=2"),
    "decode attention: block_idx Q": (
        lambda impl: _decode_attention(impl, jnp.zeros((1, 2, 2, 1), jnp.int32)),
        r"sparse_decode_attention: block_idx has Q=2"),
    "decode attention: page_table batch": (
        lambda impl: _decode_attention(impl, jnp.zeros((1, 2, 1, 1), jnp.int32),
                                       page_table=jnp.zeros((2, 4), jnp.int32)),
        r"page_table has B=2"),
    "decode attention: page size": (
        lambda impl: _decode_attention(impl, jnp.zeros((1, 2, 1, 1), jnp.int32), block_size=128),
        r"k_pages holds pages of 64 tokens .* block_size=128"),
    "decode index scores: seq_lens batch": (
        lambda impl: decode.decode_index_scores(_ones(1, 1, 2, 64), _ones(4, 64, 64), PAGE_TABLE, jnp.array([1, 2]),
                                                block_size=64, implementation=impl),
        r"decode_index_scores: seq_lens has B=2"),
    "decode selection: seq_lens batch": (
        lambda impl: decode.decode_select_blocks(_ones(1, 1, 2, 64), _ones(4, 64, 64), PAGE_TABLE, jnp.array([1, 2]),
                                                 block_size=64, topk=2, implementation=impl),
        r"decode_select_blocks: seq_lens has B=2"),
    "decode selection: page size": (
        lambda impl: decode.decode_select_blocks(_ones(1, 1, 2, 64), _ones(4, 64, 64), PAGE_TABLE, SEQ_LENS,
                                                 block_size=128, topk=2, implementation=impl),
        r"decode_select_blocks: ik_pages holds pages of 64 tokens .* block_size=128"),
}


@pytest.mark.parametrize("implementation", ["pallas", "reference"])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_shapes_raise_naming_the_array(case, implementation):
    # Machine: any: argument / config checks, no kernel runs
    call, message = CASES[case]
    with pytest.raises(ValueError, match=message):
        call(implementation)


def test_index_kernel_block_size():
    # Machine: any: argument / config checks, no kernel runs
    with pytest.raises(ValueError, match="block_size 12 must be a positive multiple of 8"):
        index_scores.index_block_scores(IQ, _ones(1, 64, 64), Q_POS, block_size=12)


def test_grouped_matmul_ranks():
    # Machine: any: argument / config checks, no kernel runs
    with pytest.raises(ValueError, match=r"grouped_matmul: lhs must be \[M, K\], got shape \(64,\)"):
        grouped_matmul(_ones(64), _ones(2, 64, 64), jnp.array([32, 32], jnp.int32))
    values, scales = jnp.ones((2, 64, 256), jnp.float8_e4m3fn), jnp.ones((2, 2, 256), jnp.uint8)
    with pytest.raises(ValueError,
                       match=r"grouped_matmul_mxfp8: scales must be \[G, K_groups, N\], got shape \(2, 256\)"):
        grouped_matmul_mxfp8(_ones(8, 64), values, scales[:, 0], jnp.array([4, 4], jnp.int32))


@pytest.mark.parametrize("scales_shape", [(4, 64), (4, 3), (4, 2, 64)])
def test_mxfp8_weight_group_axis(scales_shape):
    # Machine: any: argument / config checks, no kernel runs
    w = MXFP8Weight(jnp.ones((4, 64), jnp.float8_e4m3fn), jnp.ones(scales_shape, jnp.uint8))
    with pytest.raises(ValueError, match=r"MXFP8Weight: scales .* must be the values' shape \(4, 64\)"):
        _ = w.group_axis


def test_mxfp8_weight_group_axis_found():
    # Machine: any: argument / config checks, no kernel runs
    assert MXFP8Weight(jnp.ones((3, 64, 8)), jnp.ones((3, 2, 8))).group_axis == 1


def test_check_dims_returns_sizes():
    # Machine: any: argument / config checks, no kernel runs
    assert check_dims("f", a=(_ones(2, 3), "B T"), b=(_ones(2), "B")) == {"B": 2, "T": 3}
    with pytest.raises(ValueError, match=r"f: b must be \[B\], got shape \(2, 1\)"):
        check_dims("f", a=(_ones(2, 3), "B T"), b=(_ones(2, 1), "B"))


def test_decode_score_config_fp8_convert():
    # Machine: any: a config check, nothing runs
    with pytest.raises(ValueError, match="fp8_convert='register' must be 'smem' or 'registers'"):
        decode.DecodeScoreConfig(fp8_convert="register")
