"""Self-check of the Mosaic GPU kernels on a GPU we have never run on.

Every kernel of :mod:`m3jax.pallas` has a canary here: a tiny case run through the kernel and through
the jnp reference beside it (``m3jax/pallas/<op>/reference.py``), compared at the kernel's tolerance
(docs/MSA.md §4.3). A verdict is keyed by (kernel, device kind and compute capability, JAX version,
hash of the kernel's source files and of its canary): the first time the model asks for a kernel on a key with no
verdict (:func:`kernel_failure`, called where the model chooses kernels: ``m3jax.msa.kernels.
unsupported_reason`` and ``m3jax.moe.resolve_moe_impl``), the canary runs; a kernel that fails is not
used, with a warning naming it and the error. Verdicts are kept as JSON in
``$M3JAX_CACHE_DIR/selfcheck.json`` (default ``~/.cache/m3jax/selfcheck.json``), so a new JAX, a new
GPU or an edited kernel runs its canary again and nothing else does.

Off the GPU the model's kernels run only in interpret mode, for tests, so :func:`kernel_failure`
asks nothing there; ``python -m m3jax.selfcheck`` on a CPU runs the canaries in interpret mode.

``python -m m3jax.selfcheck [--json FILE] [--force] [--kernels a,b]`` runs every canary (cached
verdicts are reused unless ``--force``) and prints kernel, target, verdict, max error and time; it
exits with 1 when a kernel fails (2: a bad argument).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.atomic import atomic_write
from m3jax.pallas import _backend
from m3jax.pallas.tolerances import TOL

_PKG = Path(__file__).resolve().parent
# Hashed into every verdict's key with the kernel's own files: the backend layer, the shared kernel
# helpers, the tolerance table, the maths the references compute, and this file (the canary cases).
_SHARED = (_PKG / "pallas" / "_backend.py", _PKG / "pallas" / "_common.py", _PKG / "pallas" / "tolerances.py",
           _PKG / "msa" / "reference.py", Path(__file__).resolve())

# Canary tolerances: |got - ref| <= tol + tol * |ref| element-wise; None = exact. The bf16 rows of the
# kernel tests' table (m3jax/pallas/tolerances.py, docs/MSA.md §4.3): attention canaries use bf16 inputs
# (the model's dtype). The grouped GEMM's inputs are small integers, so its fp32 sums are exact and both
# sides round them to bf16 identically: any difference is a kernel error, the 1e-2 only absorbs a
# different (valid) rounding of the output.
TOLERANCES: dict[str, float | None] = {
    "index_scores": TOL[("index_scores", "bfloat16")]["atol"],
    "index_topk_fused": None,
    "topk_blockmajor": None,
    "topk_rowsplit": None,
    "sparse_attention_kv_major": TOL[("attention", "bfloat16")]["atol"],
    "sparse_attention_query_major": TOL[("attention", "bfloat16")]["atol"],
    "decode_index_scores": TOL[("index_scores", "bfloat16")]["atol"],
    "sparse_decode_attention": TOL[("decode_attention", "bfloat16")]["atol"],
    "grouped_matmul": 1e-2,
}


@dataclasses.dataclass(frozen=True)
class Canary:
    """``run() -> (got, ref)``: the kernel's and the reference's outputs on one tiny case."""

    name: str
    run: Callable[[], tuple[jax.Array, jax.Array]]
    sources: tuple[Path, ...]  # files whose contents key the verdict (with _SHARED)
    tol: float | None


@dataclasses.dataclass
class Verdict:
    kernel: str
    target: str  # sm_90a / sm_100a / interpret
    device: str
    passed: bool
    max_error: float | None  # max |got - ref| (floats) or the number of differing entries (ids)
    seconds: float  # canary wall time, compilation included
    error: str | None = None
    cached: bool = False


# ---- the canaries -----------------------------------------------------------------------------------


def _normal(rng, shape, dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)


def _ints(rng, shape, lo=-3, hi=3, dtype=jnp.bfloat16):
    """Small integers: products and sums are exact in fp32 whatever the accumulation order, so scores
    have exact ties but no near-ties (a kernel and the reference must then pick the same blocks)."""
    return jnp.asarray(rng.integers(lo, hi + 1, shape).astype(np.float32)).astype(dtype)


def _index_inputs(rng, integer=False):
    # 2 index heads, Hx 64, block 16; a block-aligned prefix of 64 then 24 queries (S = 88, ragged).
    b, t, hi, hx, s, bs, prefix = 1, 24, 2, 64, 88, 16, 64
    make = _ints if integer else _normal
    iq, ik = make(rng, (b, t, hi, hx)), make(rng, (b, s, hx))
    q_pos = (prefix + jnp.arange(t, dtype=jnp.int32))[None]
    return iq, ik, q_pos, bs


def _index_scores():
    from m3jax.pallas import index_scores as I

    iq, ik, q_pos, bs = _index_inputs(np.random.default_rng(0))
    return (I.index_block_scores(iq, ik, q_pos, block_size=bs),
            I.index_block_scores(iq, ik, q_pos, block_size=bs, implementation="reference"))


def _index_topk_fused():
    from m3jax.pallas import index_scores as I

    iq, ik, q_pos, bs = _index_inputs(np.random.default_rng(1), integer=True)
    kw = {"block_size": bs, "topk": 3, "local_blocks": 1, "init_blocks": 1}
    return (I.index_select_blocks(iq, ik, q_pos, config=I.IndexScoreConfig(fused_topk=True), **kw),
            I.index_select_blocks(iq, ik, q_pos, implementation="reference", **kw))


def _topk_scores(rng, b, hi, t, nb, bs, q_pos):
    """fp32 integer scores in [-2, 2] (ties) with -inf past each query's own block, as block_scores."""
    s = rng.integers(-2, 3, (b, hi, t, nb)).astype(np.float32)
    visible = np.arange(nb) <= (np.asarray(q_pos) // bs)[:, None, :, None]
    return jnp.asarray(np.where(visible, s, -np.inf).astype(np.float32))


def _topk(implementation, b, t, nb, bs, q_pos, topk):
    from m3jax.pallas import topk as K

    scores = _topk_scores(np.random.default_rng(2), b, 2, t, nb, bs, q_pos)
    kw = {"block_size": bs, "topk": topk, "local_blocks": 2, "init_blocks": 1}
    return (K.select_blocks(scores, q_pos, implementation=implementation, **kw),
            K.select_blocks(scores, q_pos, implementation="reference", **kw))


def _topk_blockmajor():
    t, bs = 40, 16
    return _topk("pallas_blockmajor", 1, t, 45, bs, (640 + jnp.arange(t, dtype=jnp.int32))[None], 4)


def _topk_rowsplit():
    # 300 blocks: not a multiple of the 128 threads; the second row sees fewer blocks than top-k.
    return _topk("pallas_rowsplit", 2, 1, 300, 4, jnp.array([[1199], [9]], jnp.int32), 8)


def _sparse_attention(implementation):
    from m3jax.msa import reference as msa
    from m3jax.pallas.sparse_attention import sparse_attention

    # N 16 query heads on K 2 KV heads (G 8), H 64, block 64; a prefix of 64, 10 queries, top-3.
    rng = np.random.default_rng(3)
    n, k, h, bs, t, prefix = 16, 2, 64, 64, 10, 64
    s = prefix + t
    q, kk, v = _normal(rng, (1, t, n, h)), _normal(rng, (1, s, k, h)), _normal(rng, (1, s, k, h))
    q_pos = (prefix + jnp.arange(t, dtype=jnp.int32))[None]
    scores = msa.block_scores(_normal(rng, (1, t, k, 16), jnp.float32), _normal(rng, (1, s, 16), jnp.float32),
                              q_pos, bs)
    sel = msa.select_blocks(scores, q_pos, block_size=bs, topk=3)
    args = (q, kk, v, sel, q_pos)
    return (sparse_attention(*args, block_size=bs, implementation=implementation),
            sparse_attention(*args, block_size=bs, implementation="reference"))


def _decode_case(rng, seq_lens, bs=64, kh=2, n=16, h=64, hx=64, q_len=1):
    """Paged decode inputs: a shuffled page table over num_pages = B * max_pages + 2 pages."""
    seq_lens = np.asarray(seq_lens, np.int32)
    b = len(seq_lens)
    max_pages = int(-(-seq_lens.max() // bs))
    num_pages = b * max_pages + 2
    pt = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    return {"q": _normal(rng, (b, q_len, n, h)), "iq": _normal(rng, (b, q_len, kh, hx)),
            "k": _normal(rng, (num_pages, bs, kh, h)), "v": _normal(rng, (num_pages, bs, kh, h)),
            "ik": _normal(rng, (num_pages, bs, hx)), "pt": jnp.asarray(pt), "sl": jnp.asarray(seq_lens), "bs": bs}


def _decode_index_scores():
    from m3jax.pallas import decode as D

    c = _decode_case(np.random.default_rng(4), [100, 200])
    # bf16 and fp8 e4m3 index-key pages (an fp8 index cache: the kernel converts its pages in SMEM)
    pages = (c["ik"], c["ik"].astype(jnp.float8_e4m3fn))
    runs = [[D.decode_index_scores(c["iq"], ik, c["pt"], c["sl"], block_size=c["bs"], implementation=impl)
             for ik in pages] for impl in ("pallas", "reference")]
    return jnp.stack(runs[0]), jnp.stack(runs[1])


def _sparse_decode_attention():
    from m3jax.msa import reference as msa
    from m3jax.pallas import decode as D

    c = _decode_case(np.random.default_rng(5), [100, 200])
    bs = c["bs"]
    q_pos = D.query_positions(c["sl"], 1)
    scores = D.decode_index_scores(c["iq"], c["ik"], c["pt"], c["sl"], block_size=bs, implementation="reference")
    sel = msa.select_blocks(scores, q_pos, block_size=bs, topk=2)
    args = (c["q"], c["k"], c["v"], c["pt"], sel, c["sl"])
    return (D.sparse_decode_attention(*args, block_size=bs),
            D.sparse_decode_attention(*args, block_size=bs, implementation="reference"))


def _grouped_matmul():
    from m3jax.pallas.grouped_matmul import GroupedMatmulConfig, grouped_matmul, grouped_matmul_mxfp8, layer_config

    # 6 experts, empty groups, rows past sum(group_sizes); K = 128, N = 256. The bf16 kernel and the MXFP8
    # variant (weights="mxfp8"; the same ints as fp8, E8M0 scales 2^-1..2^1: exact products), each with
    # the default tiles and with the MoE layer's prefill config (385 rows > 64 per expert: on Hopper the
    # warp-specialised schedule, so its verdict also covers what the model runs for prefill), and the MXFP8
    # variant on 5 decode rows with the layer's decode config (the gemv schedule, split over K, as for a
    # decode step's routed experts and the shared expert).
    rng = np.random.default_rng(6)
    m, k, n, g = 385, 128, 256, 6
    lhs, rhs = _ints(rng, (m, k)), _ints(rng, (g, k, n))
    gs = jnp.asarray([0, 130, 0, 0, 170, 60], jnp.int32)
    fp8, scales = rhs.astype(jnp.float8_e4m3fn), jnp.asarray(rng.integers(126, 129, (g, k // 32, n)), jnp.uint8)
    def run(mx, **kw):
        return grouped_matmul_mxfp8(lhs, fp8, scales, gs, **kw) if mx else grouped_matmul(lhs, rhs, gs, **kw)

    got, ref = [], []
    for mx in (False, True):
        want = run(mx, implementation="reference")
        for config in dict.fromkeys([GroupedMatmulConfig(), layer_config(m, k, n, g, k // 32 if mx else None)]):
            got.append(run(mx, config=config))
            ref.append(want)
    dec, dec_gs = lhs[:5], jnp.asarray([0, 2, 0, 0, 3, 0], jnp.int32)
    got.append(grouped_matmul_mxfp8(dec, fp8, scales, dec_gs, config=layer_config(5, k, n, g, k // 32)))
    ref.append(grouped_matmul_mxfp8(dec, fp8, scales, dec_gs, implementation="reference"))
    return jnp.concatenate([x.ravel() for x in got]), jnp.concatenate([x.ravel() for x in ref])


def _dirs(*ops: str) -> tuple[Path, ...]:
    return tuple(sorted(p for op in ops for p in (_PKG / "pallas" / op).glob("*.py")))


CANARIES: dict[str, Canary] = {
    c.name: c for c in (
        Canary("index_scores", _index_scores, _dirs("index_scores", "topk"), TOLERANCES["index_scores"]),
        Canary("index_topk_fused", _index_topk_fused, _dirs("index_scores", "topk"), TOLERANCES["index_topk_fused"]),
        Canary("topk_blockmajor", _topk_blockmajor, _dirs("topk"), TOLERANCES["topk_blockmajor"]),
        Canary("topk_rowsplit", _topk_rowsplit, _dirs("topk"), TOLERANCES["topk_rowsplit"]),
        Canary("sparse_attention_kv_major", lambda: _sparse_attention("kv_major"), _dirs("sparse_attention"),
               TOLERANCES["sparse_attention_kv_major"]),
        Canary("sparse_attention_query_major", lambda: _sparse_attention("query_major"), _dirs("sparse_attention"),
               TOLERANCES["sparse_attention_query_major"]),
        Canary("decode_index_scores", _decode_index_scores, _dirs("decode"), TOLERANCES["decode_index_scores"]),
        Canary("sparse_decode_attention", _sparse_decode_attention, _dirs("decode"),
               TOLERANCES["sparse_decode_attention"]),
        Canary("grouped_matmul", _grouped_matmul, _dirs("grouped_matmul"), TOLERANCES["grouped_matmul"]),
    )
}

# What the model runs (m3jax.msa.kernels): prefill = index scores + block-major top-k + KV-major
# attention; in-place decode = decode index scores + either top-k kernel + sparse decode attention.
MSA_PREFILL_KERNELS = ("index_scores", "topk_blockmajor", "sparse_attention_kv_major")
MSA_DECODE_KERNELS = ("decode_index_scores", "topk_rowsplit", "topk_blockmajor", "sparse_decode_attention")


# ---- comparison -------------------------------------------------------------------------------------


def compare(got, ref, tol: float | None) -> tuple[bool, float, str | None]:
    """(passed, max error, why not). Float outputs: -inf where the reference is -inf, finite values
    within ``tol``; ids (``tol`` None): equal entries (max error = how many differ)."""
    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return False, float("inf"), f"output {got.dtype}{list(got.shape)} != reference {ref.dtype}{list(ref.shape)}"
    if tol is None:
        bad = int((got != ref).sum())
        return bad == 0, float(bad), None if bad == 0 else f"{bad} of {ref.size} entries differ"
    g, r = got.astype(np.float64), ref.astype(np.float64)
    if not np.array_equal(np.isneginf(g), np.isneginf(r)):
        return False, float("inf"), "-inf entries differ from the reference"
    fin = np.isfinite(r)
    if not np.isfinite(g[fin]).all():
        return False, float("inf"), "non-finite output where the reference is finite"
    diff = np.abs(g[fin] - r[fin])
    err = float(diff.max()) if diff.size else 0.0
    ok = bool((diff <= tol + tol * np.abs(r[fin])).all())
    return ok, err, None if ok else f"max |error| {err:.3g} over atol = rtol = {tol:g}"


# ---- keys and the cache -----------------------------------------------------------------------------


def device_key() -> dict:
    """Where a verdict holds: the GPU's kind and compute capability, or interpret mode off-GPU."""
    if jax.default_backend() == "gpu":  # the real backend (tests stand in for a GPU by patching this function)
        d = jax.devices()[0]
        cc = str(getattr(d, "compute_capability", "?"))
        return {"device": f"{d.device_kind} (sm_{cc.replace('.', '')})", "target": _backend.current_target().name}
    return {"device": f"{jax.devices()[0].device_kind} interpret", "target": "interpret"}


_SOURCE_HASHES: dict[str, str] = {}  # per canary; the model asks at every kernel call it traces


def source_hash(canary: Canary) -> str:
    """Hash of the kernel's source files (read once per process: the files a process imported do not
    change under it)."""
    if canary.name not in _SOURCE_HASHES:
        h = hashlib.sha256()
        for p in (*_SHARED, *canary.sources):
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
        _SOURCE_HASHES[canary.name] = h.hexdigest()[:16]
    return _SOURCE_HASHES[canary.name]


def cache_path() -> Path:
    root = os.environ.get("M3JAX_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "m3jax") / "selfcheck.json"


def _key(canary: Canary, dev: dict) -> str:
    return f"{canary.name}|{dev['device']}|{dev['target']}|jax {jax.__version__}|{source_hash(canary)}"


def _load() -> dict:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):  # absent or unreadable: every canary runs again
        return {}
    verdicts = data.get("verdicts") if isinstance(data, dict) else None
    if not isinstance(verdicts, dict):  # malformed: the canaries run again and the file is rebuilt
        warnings.warn(f"m3jax self-check: {cache_path()} is not a verdict cache (no \"verdicts\" object); "
                      "ignoring it, it is rebuilt", RuntimeWarning, stacklevel=3)
        return {}
    return verdicts


def _verdict(key: str, entry) -> Verdict | None:
    """The cached verdict of ``entry``, or None (with a warning) when it is malformed: rerun then."""
    fields = {f.name for f in dataclasses.fields(Verdict)}
    try:
        if not isinstance(entry, dict) or not isinstance(entry.get("passed"), bool):
            raise TypeError("no boolean 'passed'")
        return Verdict(**{k: v for k, v in entry.items() if k in fields and k != "cached"}, cached=True)
    except TypeError as e:
        warnings.warn(f"m3jax self-check: ignoring the malformed cached verdict of {key.split('|')[0]} in "
                      f"{cache_path()} ({e}); its canary runs again", RuntimeWarning, stacklevel=3)
        return None


def _save(key: str, verdict: Verdict) -> None:
    path = cache_path()
    entries = _load()  # re-read: another process may have added verdicts since
    entries[key] = {k: v for k, v in dataclasses.asdict(verdict).items() if k != "cached"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump({"verdicts": entries}, f, indent=1, sort_keys=True)
        os.replace(f.name, path)
    except OSError as e:  # a read-only home still runs; the canary just runs again next time
        warnings.warn(f"m3jax self-check: cannot write {path}: {e}", RuntimeWarning, stacklevel=3)


# ---- running ----------------------------------------------------------------------------------------

_MEMO: dict[str, Verdict] = {}  # this process's verdicts (the cache file is read once per key)


def run_canary(canary: Canary, dev: dict) -> Verdict:
    interpret = dev["target"] == "interpret"
    t0 = time.perf_counter()
    try:
        if interpret:
            _backend.reset_interpret_state()
        # In a thread of its own: JAX's trace state is per thread, so the canary runs eagerly also when
        # the model asks from inside a jit trace (jax.ensure_compile_time_eval breaks interpret mode).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            got, ref = pool.submit(lambda: jax.block_until_ready(canary.run())).result()
        passed, err, why = compare(got, ref, canary.tol)
        if interpret and _backend.interpret_races_found():
            passed, why = False, "the interpret-mode race detector fired"
    except Exception as e:  # noqa: BLE001  (a kernel that does not compile or launch here fails its canary)
        passed, err, why = False, None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        if interpret:
            _backend.reset_interpret_state()
    return Verdict(canary.name, dev["target"], dev["device"], passed, err, round(time.perf_counter() - t0, 3), why)


def check(name: str, *, force: bool = False, dev: dict | None = None) -> Verdict:
    """The kernel's verdict on this device: cached for its key, else its canary run now (and cached)."""
    canary = CANARIES[name]
    dev = dev or device_key()
    key = _key(canary, dev)
    if not force:
        if key in _MEMO:
            return _MEMO[key]
        entry = _load().get(key)
        cached = None if entry is None else _verdict(key, entry)
        if cached is not None:
            _MEMO[key] = cached
            return cached
    verdict = run_canary(canary, dev)
    _MEMO[key] = verdict
    _save(key, verdict)
    return verdict


_WARNED: set[str] = set()


def kernel_failure(*names: str) -> str | None:
    """Why one of these kernels must not be used on this GPU (its canary failed), or None.

    Off the GPU nothing is checked (the kernels run only in interpret mode, for tests). A failing kernel
    is named in a warning once per process.
    """
    dev = device_key()
    if dev["target"] == "interpret":
        return None
    for name in names:
        v = check(name, dev=dev)
        if not v.passed:
            reason = f"the {name} kernel failed its self-check on {v.device} ({v.error})"
            if name not in _WARNED:
                _WARNED.add(name)
                warnings.warn(f"m3jax: {reason}; it is not used (the reference path runs instead where the "
                              "choice is automatic). `python -m m3jax.selfcheck --force` reruns the check.",
                              RuntimeWarning, stacklevel=2)
            return reason
    return None


# ---- CLI --------------------------------------------------------------------------------------------


def _table(verdicts: list[Verdict]) -> str:
    rows = [("kernel", "target", "verdict", "max error", "time")]
    for v in verdicts:
        err = "-" if v.max_error is None else f"{v.max_error:.3g}"
        t = f"{v.seconds:.1f} s" + (" (cached)" if v.cached else "")
        rows.append((v.kernel, v.target, "pass" if v.passed else "FAIL", err, t))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for v in verdicts:
        if v.error:
            lines.append(f"{v.kernel}: {v.error}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from m3jax import cli

    ap = cli.ArgumentParser(prog="python -m m3jax.selfcheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=cli.writable_file, help="also write the verdicts to this JSON file")
    ap.add_argument("--force", action="store_true", help="rerun every canary, ignoring cached verdicts")
    ap.add_argument("--kernels", help=f"comma-separated subset of: {', '.join(CANARIES)}")
    args = ap.parse_args(argv)
    names = args.kernels.split(",") if args.kernels else list(CANARIES)
    unknown = [n for n in names if n not in CANARIES]
    if unknown:
        ap.error(f"unknown kernels {unknown}; choose from {list(CANARIES)}")
    dev = device_key()
    print(f"m3jax self-check on {dev['device']}, jax {jax.__version__}, cache {cache_path()}", flush=True)
    verdicts = [check(n, force=args.force, dev=dev) for n in names]
    print(_table(verdicts))
    if args.json:
        out = {"device": dev["device"], "jax": jax.__version__,
               "verdicts": [dataclasses.asdict(v) for v in verdicts]}
        atomic_write(args.json, json.dumps(out, indent=1))
    return 0 if all(v.passed for v in verdicts) else 1


if __name__ == "__main__":
    from m3jax import cli

    cli.run(main)
