"""fp32 means fp32 on every path, the fallbacks included (the precision contract, layers.matmul_precision).

``wide_96`` is a held-out oracle checkpoint (tests/oracle/make_fixtures.py, not in the parity suite's
list) whose hidden and expert widths of 96 the grouped-GEMM kernel refuses, so ``moe_impl="auto"``
runs every MoE matmul through ``jax.lax.ragged_dot`` on every backend. Its logits must match transformers
at the fp32 tolerance, and every dot of the fp32 model (forward, prefill chunk, decode loop, and the MoE
and MLP traced outside the model's precision scope) must ask for HIGHEST: XLA runs a dot without it as
TF32 on NVIDIA GPUs, so the jaxpr check holds there too although this test runs on the CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import m3jax
from m3jax import engine as eng
from m3jax.cache import init_cache
from m3jax.model import forward_jit
from m3jax.moe import dense_mlp, moe_sorted
from m3jax.pallas.grouped_matmul import layer_config, unsupported_reason
from tests.conftest import FIXTURES, assert_close, same_sets

HELD_OUT = "wide_96"
DOTS = ("dot_general", "ragged_dot_general")


@pytest.fixture(scope="module")
def wide_96():
    path = FIXTURES / HELD_OUT
    if not (path / "fixture.npz").exists():
        pytest.fail(f"oracle fixture {HELD_OUT} not found under {FIXTURES}; generate it with "
                    f"`<oracle-venv>/bin/python tests/oracle/make_fixtures.py --out {FIXTURES} --only {HELD_OUT}`")
    return path, np.load(path / "fixture.npz"), m3jax.load_pretrained(path, dtype="float32", progress=False)


def _dots(jaxpr, found):
    """Every dot_general / ragged_dot_general of ``jaxpr`` and its sub-jaxprs (loops, conds, jits)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in DOTS:
            found.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jcore.ClosedJaxpr):
                    _dots(sub.jaxpr, found)
                elif isinstance(sub, jcore.Jaxpr):
                    _dots(sub, found)
    return found


def _assert_fp32_dots_highest(closed, what: str) -> None:
    dots = [e for e in _dots(closed.jaxpr, []) if any(v.aval.dtype == jnp.float32 for v in e.invars[:2])]
    assert any(e.primitive.name == "ragged_dot_general" for e in dots), f"{what}: no ragged_dot traced"
    low = [(e.primitive.name, [v.aval.shape for v in e.invars[:2]], e.params.get("precision")) for e in dots
           if e.params.get("precision") != (jax.lax.Precision.HIGHEST,) * 2]
    assert not low, f"{what}: fp32 dots without precision HIGHEST (TF32 on NVIDIA GPUs): {low}"


@pytest.mark.oracle
def test_kernel_refuses_the_held_out_widths(wide_96):
    """The fixture does what it is for: every expert GEMM shape is one the grouped-GEMM kernel refuses."""
    _, fx, model = wide_96
    t = model.config.text
    rows = fx["input_ids"].size * t.num_experts_per_tok
    for k, n in ((t.hidden_size, t.intermediate_size), (t.intermediate_size, t.hidden_size)):
        reason = unsupported_reason(rows, k, n, t.num_local_experts, layer_config(rows, k, n, t.num_local_experts, None, 1))
        assert reason is not None, f"the kernel takes [{rows}, {k}] x [{t.num_local_experts}, {k}, {n}]"


@pytest.mark.oracle
@pytest.mark.parametrize("impl", ["reference", "dense_mask"])
def test_held_out_fp32_matches_transformers_through_the_fallback(wide_96, impl):
    path, fx, _ = wide_96
    model = m3jax.load_pretrained(path, dtype="float32", attention_impl=impl, progress=False)
    assert model.config.moe_impl == "auto"
    out = m3jax.forward(model, fx["input_ids"], return_block_indices=True)
    assert_close(out.logits, fx["logits"], "float32", f"{HELD_OUT} logits ({impl})")
    assert sorted(out.block_indices) == [i for i in range(model.config.text.num_hidden_layers)
                                         if model.config.text.is_sparse_attention(i)]
    for layer, got in out.block_indices.items():
        assert same_sets(np.asarray(got), fx[f"block_indices_{layer}"]) == 0, f"layer {layer}: selections differ"


@pytest.mark.oracle
def test_fp32_paths_request_highest_precision(wide_96):
    _, fx, model = wide_96
    params, cfg = model.params, model.config
    ids = jnp.asarray(fx["input_ids"], jnp.int32)
    _assert_fp32_dots_highest(jax.make_jaxpr(lambda p, i: forward_jit(p, i, None, None, cfg, (), ()))(params, ids),
                              "forward")

    # The MoE block and the dense MLP outside decoder_layer's precision scope: their own precision= holds.
    lp = next(lp for i, lp in enumerate(params["text"]["layers"]) if cfg.text.is_moe(i))
    x = jax.ShapeDtypeStruct((ids.shape[1], cfg.text.hidden_size), jnp.float32)
    _assert_fp32_dots_highest(jax.make_jaxpr(lambda p, x: moe_sorted(x, p, cfg.text, cfg.moe_impl))(lp["moe"], x),
                              "moe_sorted outside the scope")
    mlp = jax.make_jaxpr(lambda p, x: dense_mlp(x, p, cfg.text, "auto"))(lp["moe"]["shared"], x)
    assert not [e for e in _dots(mlp.jaxpr, []) if e.params.get("precision") != (jax.lax.Precision.HIGHEST,) * 2]

    # The engine's programs: a prefill chunk and the decode loop.
    cache = init_cache(cfg, 1, 64, jnp.float32)
    embeds = jax.ShapeDtypeStruct((1, 16, cfg.text.hidden_size), jnp.float32)
    prefill = jax.make_jaxpr(lambda p, c, e: eng.prefill_chunk(p, c, e, 0, 0, 15, cfg=cfg, key_pages=8))
    _assert_fp32_dots_highest(prefill(params, cache, embeds), "prefill chunk")
    i32 = jnp.zeros((1,), jnp.int32)
    decode = jax.make_jaxpr(lambda p, c, t, k: eng.decode_steps(p, c, t, t, k, cfg=cfg, sampling=eng.SamplingParams(),
                                                                steps=2, with_logits=False))
    _assert_fp32_dots_highest(decode(params, cache, i32, jnp.zeros((2,), jnp.uint32)), "decode loop")
