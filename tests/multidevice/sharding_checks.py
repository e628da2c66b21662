"""Multi-device checks of m3jax.sharding, run in their own process (the device count must be set
before JAX initialises): ``python -m tests.multidevice.sharding_checks OUT.json [--devices 8]``.

tests/test_sharding.py launches this once and asserts on the JSON it writes: {check: {ok, detail}}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import traceback

import jax

if __name__ == "__main__":
    _n = int(sys.argv[sys.argv.index("--devices") + 1]) if "--devices" in sys.argv else 8
    jax.config.update("jax_num_cpu_devices", _n)

import numpy as np  # noqa: E402

import m3jax  # noqa: E402
from m3jax import msa  # noqa: E402
from m3jax import sharding as sh  # noqa: E402
from m3jax.model import sharded_forward  # noqa: E402
from m3jax.msa import parallel  # noqa: E402
from m3jax.engine import Engine, SamplingParams  # noqa: E402
from tests.conftest import rel_l2, tiny_config  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
TOL = 1e-5
TOL_BF16 = 2e-2

# "divisible": every head / expert / vocab / width count divides 8. "replicated": tiny_config's
# 4 q heads, 2 KV heads, 6 experts and vocab 97 do not (replicated on 8; no expert parallelism).
# "mixed": experts split (EP on) while 2 KV heads are replicated on 4 / 8 devices.
CONFIGS = {
    "divisible": dict(num_attention_heads=16, num_key_value_heads=8, index_n_heads=8, num_local_experts=16,
                      vocab_size=96),
    "replicated": dict(),
    # MXFP8 needs every input width a multiple of 32
    "divisible_mxfp8": dict(num_attention_heads=16, num_key_value_heads=8, index_n_heads=8, num_local_experts=16,
                            vocab_size=96, intermediate_size=32, dense_intermediate_size=64, shared_intermediate_size=32),
    "mixed": dict(num_attention_heads=8, num_key_value_heads=2, index_n_heads=2, num_local_experts=8, vocab_size=96),
}


# Two layers cover every kind (dense attention + dense MLP, MSA + MoE) and halve compile time.
TWO_LAYERS = dict(num_hidden_layers=2, layer_types=("full_attention", "minimax_m3_sparse"), mlp_layer_types=("dense", "sparse"))


def cfg_of(name):
    return tiny_config(**TWO_LAYERS, **CONFIGS[name])


def check_forward(name, sizes, jit_shardings=True):
    cfg = cfg_of(name)
    model = m3jax.init_random(cfg, seed=0)
    ids = np.random.default_rng(0).integers(0, 80, (2, 19))  # below the image / video placeholder ids
    ref = np.asarray(m3jax.forward(model, ids).logits)
    out = {}
    for n in sizes:
        mesh = sh.make_mesh(n)
        sharded = m3jax.init_random(cfg, seed=0, mesh=mesh)
        got = m3jax.forward(sharded, ids).logits
        out[f"n{n}_api"] = rel_l2(got, ref)
        if jit_shardings:  # the same through one jax.jit with in/out shardings from the rules
            got2, _ = sharded_forward(sharded.params, ids, cfg, mesh)
            out[f"n{n}_jit_shardings"] = rel_l2(got2, ref)
        out[f"n{n}_replicated_axes"] = sh.validate_rules(cfg, mesh)
    ok = all(v <= TOL for k, v in out.items() if not k.endswith("_axes"))
    return ok, out


def check_engine(name, n=8):
    cfg = cfg_of(name)
    model = m3jax.init_random(cfg, seed=1)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.text.vocab_size, k).tolist() for k in (13, 7)]
    kw = dict(batch=2, capacity=32, prefill_chunk=8)
    ref = Engine(model.params, cfg, **kw).generate(prompts, max_new_tokens=8, sampling=GREEDY, keep_logits=True)
    mesh = sh.make_mesh(n)
    e = Engine(model.params, cfg, mesh=mesh, **kw)
    res = e.generate(prompts, max_new_tokens=8, sampling=GREEDY, keep_logits=True)
    err = rel_l2(np.stack(res.step_logits), np.stack(ref.step_logits))
    cache_spec = str(e.cache.layers[0].k.sharding.spec)
    ok = res.generated == ref.generated and err <= TOL and "model" in cache_spec
    return ok, {"tokens_equal": res.generated == ref.generated, "logits_rel_l2": err, "cache_spec": cache_spec,
                "page_table_row0": np.asarray(e.cache.page_table)[0].tolist()}


def check_loading(n=8):
    out, ok = {}, True
    with tempfile.TemporaryDirectory() as d:
        for name, quant in (("divisible", False), ("divisible_mxfp8", True), ("replicated", False)):
            cfg = cfg_of(name)
            model = m3jax.init_random(cfg, seed=2)
            path = f"{d}/{name}_{quant}"
            m3jax.save_pretrained(model, path, max_shard_bytes=20_000, quantize_mxfp8_weights=quant)
            ref = m3jax.load_pretrained(path, dtype="float32", progress=False)
            mesh = sh.make_mesh(n)
            log: dict = {}
            got = sh.load_sharded(path, ref.config, mesh, dtype="float32", read_log=log)
            diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                       for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref.params)))
            same_spec = all(a.sharding.spec == s.spec for a, s in zip(
                jax.tree.leaves(got), jax.tree.leaves(sh.param_shardings(ref.config, mesh))))
            experts = {k: v for k, v in log.items() if ".experts." in k}
            expert_reads = sorted(set(experts.values()))
            # every expert tensor is read once: by the one device holding it when split (make_array_from_callback
            # calls the reader once per distinct shard index)
            local_ok = expert_reads == [1]  # split: one device reads each expert; replicated: read once, broadcast
            n_files = len(list(__import__("pathlib").Path(path).glob("*.safetensors")))
            key = name
            out[key] = {"max_abs_diff": diff, "same_sharding": same_spec, "expert_reads": expert_reads,
                        "files": n_files}
            ok &= diff == 0.0 and same_spec and local_ok and n_files > 1
        # resident bytes per device vs the plan's arithmetic (fp32 params)
        for name in ("divisible", "replicated"):
            cfg = cfg_of(name)
            mesh = sh.make_mesh(n)
            model = m3jax.init_random(cfg, seed=0, mesh=mesh)
            res = sh.resident_bytes(model.params)
            planned = sh.planned_param_bytes(cfg, mesh, 4)
            worst = max(abs(b - planned) / planned for b in res.values())
            out[f"resident_{name}"] = {"planned": planned, "min": min(res.values()), "max": max(res.values()),
                                       "devices": len(res), "worst_rel_dev": worst}
            ok &= worst <= 0.10 and len(res) == n
    return ok, out


def check_context_parallel(n=8):
    rng = np.random.default_rng(4)
    b, s, c, nh, kh, h, hx, bs, topk = 1, 128, 24, 4, 2, 8, 8, 4, 5
    q = rng.normal(size=(b, c, nh, h)).astype(np.float32)
    iq = rng.normal(size=(b, c, kh, hx)).astype(np.float32)
    k = rng.normal(size=(b, s, kh, h)).astype(np.float32)
    v = rng.normal(size=(b, s, kh, h)).astype(np.float32)
    ik = rng.normal(size=(b, s, hx)).astype(np.float32)
    q_pos = np.sort(rng.choice(s, c, replace=False))[None].astype(np.int32)
    ref_sel = msa.select_blocks(msa.block_scores(iq, ik, q_pos, bs), q_pos, block_size=bs, topk=topk)
    ref = msa.sparse_attention(q, k, v, ref_sel, q_pos, bs)
    mesh = sh.make_mesh(n)
    split = lambda x: parallel.split_context(x, n, bs)  # noqa: E731
    out, sel = parallel.context_parallel_msa(q, iq, split(k), split(v), split(ik), q_pos, mesh, block_size=bs, topk=topk)
    err = rel_l2(out, ref)
    same = bool(np.array_equal(np.asarray(sel), np.asarray(ref_sel)))
    # head-parallel wrapper around an unmodified attention kernel (the jnp reference here)
    kern = lambda q_, k_, v_, b_, p_: msa.sparse_attention(q_, k_, v_, b_, p_, bs)  # noqa: E731
    hp = parallel.head_parallel(kern, sh.make_mesh(2))(q, k, v, ref_sel, q_pos)  # 4 q / 2 KV heads over 2
    hp4 = parallel.head_parallel(kern, sh.make_mesh(4))(q, k, v, ref_sel, q_pos)  # KV replicated, 1 q head each
    errs = {"cp_rel_l2": err, "cp_selection_equal": same, "head_parallel_2": rel_l2(hp, ref),
            "head_parallel_4": rel_l2(hp4, ref)}
    return err <= TOL and same and errs["head_parallel_2"] <= TOL and errs["head_parallel_4"] <= TOL, errs


@contextlib.contextmanager
def _multidevice_interpret():
    """GPU interpret mode with n devices running at once (CPU only). JAX 0.11.2's Mosaic GPU interpreter
    keeps one global simulated memory for all devices: the end-of-kernel check that no barrier is left
    allocated looks at every device's barriers (a device that finishes first sees another one's live
    barriers and fails), and the race detector mixes the devices' vector clocks (false races within one
    warpgroup). Both are switched off here; kernel semantics are unchanged (the interpreter still runs
    every warpgroup, barrier and copy). Single-device kernel tests keep both checks on."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from m3jax.pallas import _backend

    saved = gpu_callbacks._assert_no_barriers_allocated, _backend.interpret_params
    gpu_callbacks._assert_no_barriers_allocated = lambda token: token
    _backend.interpret_params = lambda detect_races=True: plgpu.InterpretGPUParams(detect_races=False)
    jax.clear_caches()
    try:
        yield
    finally:
        gpu_callbacks._assert_no_barriers_allocated, _backend.interpret_params = saved
        jax.clear_caches()


def _pallas_config(**kw):
    # The smallest model the kernels take with M3's head layouts: 32 q heads / 2 KV heads (G = 16), head
    # dims 64, blocks of 64. On 2 devices the KV heads split (one group each); on 4 each device holds 8 q
    # heads of one group and that group's KV / index head, as M3's 64 / 4 heads do on 8 (two devices a
    # group). On 8 (4 heads per device) the kernels do not fit: the replicated fallback.
    base = dict(hidden_size=64, num_attention_heads=32, num_key_value_heads=2, head_dim=64, rotary_dim=32,
                index_n_heads=2, index_head_dim=64, index_block_size=64, index_topk_blocks=2, vocab_size=96,
                **TWO_LAYERS)
    return tiny_config(**(base | kw))


def check_pallas_mesh(sizes=(1, 2, 4)):
    """attention_impl="pallas" under meshes of 1, 2, 4 devices (interpret mode): the MSA kernels in
    shard_map with heads split (parallel.msa_pallas_sharded) equal the single-device kernels."""
    import warnings

    import jax.numpy as jnp

    from m3jax.msa.kernels import prefill as _msa_pallas

    out, ok = {}, True
    t_len = 130  # 3 blocks of 64 > top-2: the selection matters
    with _multidevice_interpret():
        # 1. the kernels alone on identical inputs: fp32 and the identical selection; then a layout the
        # kernels cannot take per device (8 q heads / 1 KV head on 2: G' = 4) runs replicated, with a warning
        rng = np.random.default_rng(5)
        for name, nh, kh, meshes in (("split", 32, 2, (2, 4)), ("fallback", 8, 1, (2,))):
            t = _pallas_config(num_attention_heads=nh, num_key_value_heads=kh, index_n_heads=kh).text
            x = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in
                 ((1, t_len, nh, 64), (1, t_len, kh, 64), (1, t_len, kh, 64), (1, t_len, kh, 64), (1, t_len, 64))]
            qp = jnp.arange(t_len, dtype=jnp.int32)[None]
            o0, s0 = _msa_pallas(*x, qp, t)
            for n in meshes:
                mesh, t0 = sh.make_mesh(n), time.perf_counter()
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    fn = jax.jit(lambda *a, mesh=mesh, t=t: parallel.msa_pallas_sharded(_msa_pallas, *a, t, mesh=mesh))
                    o, s = fn(*x, qp)
                r = {"rel_l2": rel_l2(o, o0), "selection_equal": bool(np.array_equal(s, s0)),
                     "split_reason": parallel.msa_pallas_split_reason(t, n),
                     "warned": any("replicated" in str(m.message) for m in w),
                     "seconds": round(time.perf_counter() - t0, 1)}
                out[f"kernels_{name}_n{n}"] = r
                ok &= r["rel_l2"] <= TOL and r["selection_equal"] and (r["split_reason"] is None) == (name == "split")
                ok &= r["warned"] == (name == "fallback")
        # 2. the model forward (params sharded by the rules, jit under the mesh) against one device and the reference
        cfg = _pallas_config()
        ids = np.random.default_rng(1).integers(0, 80, (1, t_len))
        ref = m3jax.forward(m3jax.init_random(cfg, seed=4), ids, return_block_indices=True)
        pcfg = cfg.replace(attention_impl="pallas")
        single = m3jax.forward(m3jax.init_random(pcfg, seed=4), ids, return_block_indices=True)
        out["single_vs_reference"] = rel_l2(single.logits, ref.logits)
        out["model_n8_split_reason"] = parallel.msa_pallas_split_reason(cfg, 8)
        for n in sizes:
            t0 = time.perf_counter()
            got = m3jax.forward(m3jax.init_random(pcfg, seed=4, mesh=sh.make_mesh(n)), ids, return_block_indices=True)
            r = {"vs_single": rel_l2(got.logits, single.logits), "vs_reference": rel_l2(got.logits, ref.logits),
                 "selection_equal": bool(np.array_equal(got.block_indices[1], single.block_indices[1])),
                 "seconds": round(time.perf_counter() - t0, 1)}
            out[f"model_n{n}"] = r
            # the attention kernel multiplies in bf16: q/k/v that differ by fp32 rounding between layouts
            # (XLA partitions the projections) round to different bf16 values: bf16 tolerance for the model
            ok &= r["vs_single"] <= TOL_BF16 and r["vs_reference"] <= TOL_BF16 and r["selection_equal"]
    return ok and out["single_vs_reference"] <= TOL_BF16, out


def check_pallas_cuda_lowering():
    """The sharded MSA kernels at M3's shapes, and a whole sharded model forward with attention_impl="pallas",
    lower for CUDA on this CPU host: abstract meshes of 1-8 devices, kernels forced out of interpret mode
    (real Mosaic GPU custom calls inside shard_map, no interpreter callbacks)."""
    import re

    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, AxisType, NamedSharding

    from m3jax.config import preset
    from m3jax.model import multimodal_forward
    from m3jax.msa.kernels import prefill as _msa_pallas
    from m3jax.params import ParamSpec, param_specs
    from m3jax.pallas import _backend
    from m3jax.pallas.sparse_attention import kernel as sa_kernel

    t = preset("minimax_m3").text
    S = jax.ShapeDtypeStruct
    c = 256
    args = (S((1, c, 64, 128), jnp.bfloat16), S((1, c, 4, 128), jnp.bfloat16), S((1, c, 4, 128), jnp.bfloat16),
            S((1, c, 4, 128), jnp.bfloat16), S((1, c, 128), jnp.bfloat16), S((1, c), jnp.int32))
    mcfg = _pallas_config(num_attention_heads=64, num_key_value_heads=4, index_n_heads=4, num_local_experts=8)
    mcfg = mcfg.replace(attention_impl="pallas")
    ids = S((1, c), jnp.int32)

    def abstract_params(amesh):
        return jax.tree.map(lambda ps, spec: S(ps.shape, jnp.dtype(ps.resolve_dtype("float32")),
                                               sharding=NamedSharding(amesh, spec)),
                            param_specs(mcfg), sh.param_partition_specs(mcfg, amesh),
                            is_leaf=lambda x: isinstance(x, ParamSpec))

    out = {}
    saved = _backend.on_gpu, sa_kernel.on_gpu
    _backend.on_gpu = sa_kernel.on_gpu = lambda: True
    jax.clear_caches()
    try:
        for n in (1, 2, 4, 8):
            amesh = AbstractMesh((1, n), sh.MESH_AXES, axis_types=(AxisType.Auto,) * 2)
            with jax.sharding.use_abstract_mesh(amesh):
                txt = jax.jit(lambda *a: parallel.msa_pallas_sharded(_msa_pallas, *a, t)).trace(*args).lower(
                    lowering_platforms=("cuda",)).as_text()
            out[f"n{n}"] = {"mosaic_gpu_calls": txt.count("@mosaic_gpu_v2"),
                            "shard_map": "sdy.manual_computation" in txt,
                            "callbacks": len(re.findall(r"callback", txt))}
            if n > 1:  # the whole sharded model forward (MSA + MoE shard_maps), params placed by the rules
                with jax.sharding.use_abstract_mesh(amesh):
                    txt = jax.jit(lambda p, i: multimodal_forward(p, i, None, None, mcfg, None, None)).trace(
                        abstract_params(amesh), ids).lower(lowering_platforms=("cuda",)).as_text()
                out[f"model_n{n}"] = {"mosaic_gpu_calls": txt.count("@mosaic_gpu_v2"),
                                      "shard_map": "sdy.manual_computation" in txt,
                                      "callbacks": len(re.findall(r"callback", txt))}
    finally:
        _backend.on_gpu, sa_kernel.on_gpu = saved
        jax.clear_caches()
    # a shard_map over a 1-device axis is inlined: no manual computation left to see for n = 1
    ok = all(r["mosaic_gpu_calls"] >= 2 and (r["shard_map"] or k == "n1") and r["callbacks"] == 0
             for k, r in out.items())
    return ok, out


CHECKS = {
    "forward_divisible": lambda: check_forward("divisible", (8,)),
    "forward_replicated": lambda: check_forward("replicated", (8,), jit_shardings=False),
    "forward_mixed_4": lambda: check_forward("mixed", (4,), jit_shardings=False),
    "engine_divisible": lambda: check_engine("divisible"),
    "engine_replicated": lambda: check_engine("replicated"),
    "loading": check_loading,
    "context_parallel": check_context_parallel,
    "pallas_mesh": check_pallas_mesh,
    "pallas_cuda_lowering": check_pallas_cuda_lowering,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    assert len(jax.devices()) == args.devices, jax.devices()
    results = {}
    for name, fn in CHECKS.items():
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception:  # report, keep going
            ok, detail = False, traceback.format_exc()
        results[name] = {"ok": bool(ok), "detail": detail, "seconds": round(time.perf_counter() - t0, 1)}
        print(name, results[name], flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
