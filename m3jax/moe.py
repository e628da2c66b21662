"""MoE block of MiniMax-M3 (spec §1.5): sigmoid router with a selection-only correction bias,
top-k renormalised weights, SwiGLU-OAI experts, routed scaling, one shared expert.

Two equal implementations: :func:`moe_sorted` (tokens sorted by expert + grouped matmul, the
production shape) and :func:`moe_dense_reference` (every expert on every token, masked; readable
and only viable for tiny configs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m3jax.config import TextConfig
from m3jax.layers import swiglu_oai


def dense_mlp(x: jax.Array, p: dict, cfg: TextConfig) -> jax.Array:
    """SwiGLU-OAI MLP. x: [..., D]; p: gate/up [D, F], down [F, D]."""
    act = swiglu_oai(x @ p["gate"], x @ p["up"], cfg.swiglu_alpha, cfg.swiglu_limit)
    return act.astype(x.dtype) @ p["down"]


def route(x: jax.Array, p: dict, cfg: TextConfig) -> tuple[jax.Array, jax.Array]:
    """Router. x: [T, D] -> (expert ids int32 [T, k], weights fp32 [T, k]).

    Logits and sigmoid in fp32; the correction bias only decides the choice; the weights are the
    unbiased scores of the chosen experts renormalised to sum to 1.
    """
    logits = jnp.dot(x.astype(jnp.float32), p["router"], precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    _, ids = jax.lax.top_k(scores + p["router_bias"], cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, ids, axis=-1)
    return ids.astype(jnp.int32), w / jnp.sum(w, axis=-1, keepdims=True)


def grouped_expert_mlp(xs: jax.Array, group_sizes: jax.Array, p: dict, cfg: TextConfig) -> jax.Array:
    """Expert MLPs over rows already sorted by expert. xs: [M, D]; group_sizes: int32 [E]."""
    gate = jax.lax.ragged_dot(xs, p["gate"], group_sizes)
    up = jax.lax.ragged_dot(xs, p["up"], group_sizes)
    act = swiglu_oai(gate, up, cfg.swiglu_alpha, cfg.swiglu_limit).astype(xs.dtype)
    return jax.lax.ragged_dot(act, p["down"], group_sizes)


def moe_sorted(x: jax.Array, p: dict, cfg: TextConfig) -> jax.Array:
    """MoE over x [T, D] -> [T, D]: sort (token, slot) pairs by expert, grouped matmul, weighted scatter-add."""
    t, _ = x.shape
    k, e = cfg.num_experts_per_tok, cfg.num_local_experts
    ids, w = route(x, p, cfg)
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    token = order // k
    group_sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)
    ys = grouped_expert_mlp(x[token], group_sizes, p, cfg)
    ys = ys.astype(jnp.float32) * w.reshape(-1)[order][:, None]
    routed = jnp.zeros((t, x.shape[1]), jnp.float32).at[token].add(ys)
    shared = dense_mlp(x, p["shared"], cfg)
    return (cfg.routed_scaling_factor * routed + shared.astype(jnp.float32)).astype(x.dtype)


def moe_dense_reference(x: jax.Array, p: dict, cfg: TextConfig) -> jax.Array:
    """Same maths as :func:`moe_sorted`, computing every expert for every token (tiny configs only)."""
    ids, w = route(x, p, cfg)
    combine = jnp.zeros((x.shape[0], cfg.num_local_experts), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], ids].add(w)  # [T, E]
    gate = jnp.einsum("td,edf->tef", x, p["gate"])
    up = jnp.einsum("td,edf->tef", x, p["up"])
    act = swiglu_oai(gate, up, cfg.swiglu_alpha, cfg.swiglu_limit).astype(x.dtype)
    per_expert = jnp.einsum("tef,efd->ted", act, p["down"]).astype(jnp.float32)
    routed = jnp.einsum("te,ted->td", combine, per_expert)
    shared = dense_mlp(x, p["shared"], cfg)
    return (cfg.routed_scaling_factor * routed + shared.astype(jnp.float32)).astype(x.dtype)
