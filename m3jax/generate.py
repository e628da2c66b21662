"""Generate text with MiniMax-M3: ``python -m m3jax.generate``.

    python -m m3jax.generate                                   # built-in default: the trained m3-small
    python -m m3jax.generate --checkpoint DIR --prompt "..."   # HF checkpoint with tokenizer.json
    python -m m3jax.generate --ctx 32768 --fill                # pad the prompt with a haystack to the context
    python -m m3jax.generate --checkpoint DIR --image a.png --prompt "What is in the picture?"
    python -m m3jax.generate --checkpoint DIR --video clip.mp4 --prompt "What happens?"
    python -m m3jax.generate --checkpoint DIR --prompt-ids 1,2,3 --max-new-tokens 32 --temperature 0 \\
        --output-json out.json                                  # exact greedy ids in out.json

Caches are sized for ``--ctx`` tokens; the limit is the config's max_position_embeddings unless
``--allow-beyond-max-position`` is given. Before allocating, a memory plan (weights, KV + index
cache, activations) is checked against the device; a run that would not fit is refused with the
numbers and the largest ``--ctx`` that fits.

Devices: every visible device by default (``--devices N`` uses the first N; ``--mesh DxM`` a data x
model split). On more than one the weights load straight into their shards (each device reads only
its slice of the files), the KV + index cache is split by pages over the model axis, and the memory
plan is the per-device one of ``python -m m3jax.plan`` (the same function) against each device's
memory; one device is the plain single-device path. docs/SHARDING.md has the layout.

Media (``--image`` / ``--video``, repeatable): each file goes where the prompt has ``]<]image[>[`` /
``]<]video[>[``, or, if the prompt has no placeholder, the placeholders are put before the prompt
text (images first). Preprocessing, frame sampling and the token layout are those of
:mod:`m3jax.processing`; the vision tokens replace the placeholder rows of the prompt embeddings.
Without a tokenizer (random presets) the start/end markers are spelled as bytes (a note is printed;
see ``m3jax.processing.media_token_ids``).

Weights run in the checkpoint's own dtype (``--dtype auto``: config.json's ``dtype`` / ``torch_dtype``,
as transformers' ``dtype="auto"``); random ``--config`` presets run in bfloat16. ``--weights mxfp8``
keeps an MXFP8 checkpoint's quantised weights fp8 + scales on the device (``load_pretrained(...,
weights="mxfp8")``; random presets are drawn so), and the memory plan counts them at 1 + 1/32 bytes.

Decode runs ``--decode-steps-per-call`` steps (default 8) in one compiled call: the host reads and
streams the tokens of one call while the device runs the next; a stop token ends the text at once,
and the steps computed past it are discarded.

Compiled executables go to JAX's persistent compilation cache in ``$M3JAX_CACHE_DIR`` or
``~/.cache/m3jax/jax_cache``, and the engine's programs (each prefill window, decode) are also kept
exported (StableHLO with the Mosaic GPU kernels) in its ``aot/`` folder (:mod:`m3jax.aot`), so a
second run of the same command neither traces nor lowers the model, and XLA finds the executables it
compiled. ``--no-compile-cache`` turns both off; the report's ``compile_cache`` counts the hits of
each (``aot``: programs read back / exported and written / not cacheable: interpret-mode kernels, and
cuDNN attention under a mesh).

Bad arguments, checkpoints and configs end in one ``error:`` line and exit status 2 (``--debug`` or
``M3JAX_DEBUG=1`` for the traceback). Prompt and output paths are checked before anything is loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import m3jax
from m3jax import aot, cli, distributed, processing, sharding
from m3jax.atomic import atomic_write
from m3jax import plan as device_planner
from m3jax.checkpoint import checkpoint_dtype
from m3jax.config import describe_presets, load_config, preset
from m3jax.engine import DECODE_STEPS_PER_CALL, Engine, SamplingParams
from m3jax.memory import GiB, device_memory, max_fitting_ctx, plan
from m3jax.model import check_kernels_ahead, scatter_media
from m3jax.msa import layer as msa_layer
from m3jax.pallas import verdicts
from m3jax.params import init_random, init_random_on_device
from m3jax.tokenizer import ByteTokenizer, load_tokenizer
from m3jax.vision import encode_media

# The built-in default: m3-small, trained by scripts/build_m3_small.sh and shipped in the package.
DEFAULT_CHECKPOINT = Path(__file__).parent / "assets" / "m3-small"
DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main(argv=None):\n"
HAYSTACK = (
    "The grass is green and the sky is blue. A river runs past the old mill, and the miller counts "
    "his sacks of flour twice a day. "
)


def mesh_shape(text: str) -> tuple[int, int]:
    """argparse type of ``--mesh DxM``: (data, model), both positive."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected DATAxMODEL with positive integers, e.g. 1x8 or 2x4, got {text!r}")
    return int(parts[0]), int(parts[1])


def parse_args(argv=None):
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", type=Path,
                     help="HF checkpoint directory (config.json + safetensors); default: the built-in trained "
                          "m3-small (m3jax/assets/m3-small) unless --config is given")
    src.add_argument("--config", help=f"preset with random weights instead of the default checkpoint: {describe_presets()}")
    ap.add_argument("--ctx", type=cli.positive_int, default=4096,
                    help="context capacity in tokens (caches are sized for it)")
    prompt = ap.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None)
    # Read while parsing (into the same place as --prompt): a missing or non-UTF-8 file is named before any work.
    prompt.add_argument("--prompt-file", dest="prompt", type=cli.utf8_file, metavar="FILE", help="UTF-8 text file")
    prompt.add_argument("--prompt-ids", type=cli.token_ids, help="comma-separated token ids (no template, no tokenizer)")
    ap.add_argument("--raw", action="store_true", help="do not apply the checkpoint's chat template")
    ap.add_argument("--image", action="append", type=Path, default=[], metavar="FILE",
                    help="image file (repeatable); goes at a ']<]image[>[' in the prompt, else before the prompt")
    ap.add_argument("--video", action="append", type=Path, default=[], metavar="FILE",
                    help="video file decoded with PyAV (repeatable); goes at a ']<]video[>[' in the prompt, "
                         "else before the prompt")
    ap.add_argument("--video-fps", type=cli.positive_float, default=None,
                    help=f"frames sampled per second of video (default {processing.VIDEO_FPS}, "
                         f"{processing.VIDEO_MIN_FRAMES}-{processing.VIDEO_MAX_FRAMES} frames)")
    ap.add_argument("--fill", action="store_true", help="prepend a synthetic haystack up to the context")
    ap.add_argument("--max-new-tokens", type=cli.nonnegative_int, default=32, help="0 = prefill only")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help=">= 0; 0 = greedy (so is one so small that logits / T overflows: the T -> 0 limit)")
    ap.add_argument("--top-p", type=float, default=0.95, help="nucleus mass in (0, 1]; 1 = no cut")
    ap.add_argument("--top-k", type=int, default=40,
                    help=">= 1: sample among the k most likely tokens (k >= the vocabulary size: all of them)")
    ap.add_argument("--seed", type=cli.seed, default=0)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="auto (default): the checkpoint's dtype from its config.json (dtype / torch_dtype; float16 "
                         "runs as float32); bfloat16 for random --config presets")
    ap.add_argument("--weights", default="dequantize", choices=["dequantize", "mxfp8"],
                    help="MXFP8 checkpoint weights: dequantize on load (default) or keep them fp8 + scales on the "
                         "device (about half the bytes, the memory plan counts them so; their speed against bf16 in "
                         "benchmarks/RESULTS.md#moe-decode-mxfp8 and #mxfp8-prefill-gemms); random presets: drawn "
                         "as MXFP8")
    ap.add_argument("--prefill-chunk", type=cli.positive_int, default=2048,
                    help="tokens per prefill chunk (one compiled shape per key window; larger chunks amortise "
                         "the per-chunk weight reads and compile fewer windows, smaller ones need less memory)")
    ap.add_argument("--no-prefill-buckets", action="store_true",
                    help="pad a prompt's last chunk to the whole --prefill-chunk (by default a last chunk that starts "
                         "its own key window, as a one-chunk prompt's does, runs at the smallest MSA block size times a "
                         "power of two that holds it: a short prompt prefills what it is)")
    ap.add_argument("--decode-steps-per-call", type=cli.positive_int, default=DECODE_STEPS_PER_CALL, metavar="N",
                    help="decode steps one compiled call runs (tokens stream N at a time; the host's per-call cost "
                         "is paid once per N tokens; 1 = a call per token)")
    ap.add_argument("--attention-impl", default="auto", choices=["auto", "reference", "dense_mask", "pallas"])
    ap.add_argument("--config-override", type=cli.parse_overrides, default={}, metavar="K=V,...",
                    help=cli.CONFIG_OVERRIDE_HELP)
    ap.add_argument("--devices", type=cli.positive_int, default=None,
                    help="devices to run on, the first N visible (default: all of them, or D*M with --mesh); "
                         "1 = the plain single-device path")
    ap.add_argument("--mesh", type=mesh_shape, metavar="DxM", default=None,
                    help="data x model mesh over the devices (default 1 x devices: weights, experts, heads and "
                         "cache pages split over all of them; data > 1 holds replicas)")
    ap.add_argument("--output-json", type=cli.writable_file, metavar="FILE",
                    help="write the report here (its folder must exist; checked before the run)")
    ap.add_argument("--allow-beyond-max-position", action="store_true",
                    help="run past the config's max_position_embeddings (RoPE extrapolation: quality unknown)")
    ap.add_argument("--quiet", action="store_true", help="no streaming text, no progress bars")
    ap.add_argument("--byte-tokenizer", action="store_true",
                    help="run a checkpoint whose tokenizer files lack tokenizer.json on byte-level ids (refused "
                         "otherwise: its text would be garbage)")
    ap.add_argument("--allow-nonfinite-weights", action="store_true",
                    help="load a checkpoint holding NaN or infinite weights (refused otherwise, naming them), "
                         "to study a broken model")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help="do not use JAX's persistent compilation cache nor the exported-program cache in its aot/ "
                         "folder (default: both on, in $M3JAX_CACHE_DIR or ~/.cache/m3jax/jax_cache)")
    cli.add_distributed_arguments(ap)
    cli.add_debug_flag(ap)
    args = ap.parse_args(argv)
    try:
        args.sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
    except ValueError as e:  # SamplingParams checks the values once, naming its fields; the user typed flags
        ap.error(str(e).replace("temperature", "--temperature").replace("top_p", "--top-p").replace("top_k", "--top-k"))
    return args


def _peak_memory(devices) -> dict:
    """Peak bytes of each of this process's devices used (the largest in ``peak_device_memory_bytes``);
    host RSS on the CPU."""
    devices = [d for d in devices if d.process_index == jax.process_index()]
    stats = [d.memory_stats() if hasattr(d, "memory_stats") else None for d in devices]
    if all(s and "peak_bytes_in_use" in s for s in stats):
        per = {str(d): int(s["peak_bytes_in_use"]) for d, s in zip(devices, stats)}
        kind = devices[0].device_kind
    else:  # the CPU backend's (simulated) devices share the process
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        per, kind = {str(d): rss for d in devices}, "host RSS (CPU backend, one process for all devices)"
    return {"peak_device_memory_bytes": max(per.values()), "peak_memory_per_device": per, "memory_kind": kind}


def select_devices(args) -> tuple[list, int]:
    """(the devices to run on, the data-axis size) from ``--devices`` / ``--mesh``; all visible by default."""
    visible = jax.devices()  # every process's devices when the job has several
    data, model = args.mesh if args.mesh else (1, None)
    n = args.devices or (data * model if model else len(visible))
    if n > len(visible):
        raise SystemExit(f"--devices {n} / --mesh: {n} devices asked for, {len(visible)} visible "
                         f"({visible[0].platform})")
    if jax.process_count() > 1 and n != len(visible):
        raise SystemExit(f"--devices {n} / --mesh: a job of {jax.process_count()} processes runs on all their "
                         f"{len(visible)} devices")
    if model is not None and data * model != n:
        raise SystemExit(f"--mesh {data}x{model} is {data * model} devices, but --devices {n}")
    if n % data:
        raise SystemExit(f"--mesh data {data} does not divide {n} devices")
    return visible[:n], data


def _plan_kwargs(*, devices: int, data: int, budget_bytes: float, chunk: int, dtype: str, platform: str) -> dict:
    return dict(devices=devices, data=data, hbm_gb=budget_bytes / device_planner.GB, chunk=chunk, dtype=dtype,
                kv_dtype_bytes=4 if dtype == "float32" else 2, workspace=0.0 if platform == "cpu" else None)


def device_plan(cfg, *, ctx: int, devices: int, data: int = 1, budget_bytes: float, chunk: int, dtype: str,
                platform: str = "gpu") -> dict:
    """The per-device memory plan of a run on ``devices`` devices with ``budget_bytes`` each: exactly
    ``python -m m3jax.plan``'s :func:`m3jax.plan.plan` (weights by the sharding rules, cache pages
    split, one prefill chunk's transients, workspace), the cache in the weights' dtype. The CPU
    backend's devices have no CUDA / NCCL workspace. When it does not fit, ``max_ctx`` is the largest
    context that does (:func:`m3jax.plan.max_ctx`)."""
    kw = _plan_kwargs(devices=devices, data=data, budget_bytes=budget_bytes, chunk=chunk, dtype=dtype, platform=platform)
    r = device_planner.plan(cfg, ctx=ctx, **kw)
    if not r["fits"]:
        r["max_ctx"] = device_planner.max_ctx(cfg, upper=ctx, **kw)
    return r


def _accelerator(devices) -> bool:
    """Whether the devices are accelerators, whose plan counts the CUDA / NCCL workspace (CPU devices: none)."""
    return devices[0].platform != "cpu"


def _check_memory(cfg, args, dtype: str, devices: list, data: int) -> dict:
    """Refuse, before anything is allocated, a run whose plan does not fit; returns the plan's numbers."""
    n, n_visible = len(devices), len(jax.devices())
    more = f"more devices (--devices N; {n_visible} visible)" if n_visible > n else "more devices"
    dtype_bytes = 2 if dtype == "bfloat16" else 4
    half = "" if dtype == "bfloat16" else "; --dtype bfloat16 halves weights and caches"
    if n == 1:
        mem = plan(cfg, batch=1, capacity=args.ctx, chunk=args.prefill_chunk, dtype_bytes=dtype_bytes, weights=args.weights)
        if not mem.fits:
            best = max_fitting_ctx(cfg, batch=1, chunk=args.prefill_chunk, dtype_bytes=dtype_bytes, weights_loaded=False,
                                   weights=args.weights)
            hint = f"--ctx {best} fits on 1 device" if best else f"no --ctx fits; use a smaller --prefill-chunk or {more}"
            raise SystemExit(f"refusing to run: {mem.describe()}. {hint}{half}")
        return {"devices": 1, "weights_bytes": mem.weights, "cache_bytes": mem.cache,
                "activation_bytes": mem.activations, "total_bytes": mem.total, "budget_bytes": mem.available,
                "text": mem.describe()}
    # This process's devices (the others' are not addressable here; every host runs the same check).
    budget, where = device_memory([d for d in devices if d.process_index == jax.process_index()])
    budget = float("inf") if budget is None else budget
    # (the plan's "mxfp8": MXFP8 weights + BF16 rest; an fp32 run is planned with fp32 weights, an upper bound)
    plan_dtype = "mxfp8" if args.weights == "mxfp8" and dtype == "bfloat16" else dtype
    r = device_plan(cfg, ctx=args.ctx, devices=n, data=data, budget_bytes=budget, chunk=args.prefill_chunk,
                    dtype=plan_dtype, platform="gpu" if _accelerator(devices) else "cpu")
    gb = device_planner.GB
    hint = ""
    if not r["fits"]:
        best = r["max_ctx"]
        hint = (f"--ctx {best} fits on {n} devices" if best else
                f"no --ctx fits on {n} devices; use a smaller --prefill-chunk or {more}")
    text = (f"per device needs {r['total'] / gb:.2f} GB (weights {r['weights'] / gb:.2f}, KV cache "
            f"{r['kv_cache'] / gb:.2f}, index cache {r['index_cache'] / gb:.2f}, activations ~{r['activations'] / gb:.2f}, "
            f"workspace {r['workspace'] / gb:.2f}); budget of each of the {n} devices: {budget / gb:.2f} GB ({where})")
    if not r["fits"]:
        raise SystemExit(f"refusing to run: {text}. {hint}{half}")
    return {"text": text, "devices": n, "weights_bytes": r["weights"], "cache_bytes": r["kv_cache"] + r["index_cache"],
            "activation_bytes": r["activations"], "workspace_bytes": r["workspace"], "total_bytes": r["total"],
            "budget_bytes": budget}


_encode_media_jit = jax.jit(encode_media, static_argnames=("grid_thw", "cfg"))


def _prepare_media(args, cfg, tok):
    """Load and preprocess --image / --video files: (marker ids, images dict or None, videos dict or None)."""
    if args.prompt_ids:
        raise SystemExit("--image/--video need a text prompt (--prompt or --prompt-file), not --prompt-ids")
    if cfg.vision is None:
        raise SystemExit("--image/--video given but the model config has no vision_config")
    try:
        token_ids = processing.media_token_ids(tok, cfg.image_token_id, cfg.video_token_id)
    except ValueError as e:
        raise SystemExit(f"cannot encode media prompts: {e}") from None
    if token_ids.fallback:
        print(f"note: {token_ids.describe()}", file=sys.stderr)
    try:
        image_kw, video_kw = processing.processor_settings(args.checkpoint)
    except ValueError as e:
        raise SystemExit(f"cannot read the checkpoint's processor settings: {e}") from None
    v = cfg.vision
    geometry = dict(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size, merge_size=v.spatial_merge_size)
    frame_limits = {k: video_kw[k] for k in ("min_pixels", "max_pixels") if k in video_kw}
    sampling = {k: video_kw[k] for k in ("fps", "min_frames", "max_frames", "total_pixels") if k in video_kw}
    if args.video_fps is not None:
        sampling["fps"] = args.video_fps
    try:
        images = processing.preprocess_images(args.image, **image_kw, **geometry) if args.image else None
        clips = [processing.load_video(p, **sampling, **frame_limits, factor=v.patch_size * v.spatial_merge_size,
                                       temporal_patch_size=v.temporal_patch_size) for p in args.video]
        segments = {k: video_kw[k] for k in ("segment_max_frames",) if k in video_kw}
        videos = processing.preprocess_video(clips, do_resize=False, **frame_limits, **segments,
                                             **geometry) if clips else None
    except processing.MediaError as e:
        raise SystemExit(f"bad media: {e}") from None
    return token_ids, images, videos


def _media_prompt_embeds(params, cfg, ids, images, videos):
    """Prompt embeddings [T, D] with the vision tokens scattered over the placeholder rows.

    Images and videos go through the vision tower in one call (each grid row is its own attention
    segment, so this equals encoding them separately) and one compile per prompt's media shapes."""
    parts = [(data[pix], data[grid_key], token)
             for data, pix, grid_key, token in ((images, "pixel_values", "image_grid_thw", cfg.image_token_id),
                                                (videos, "pixel_values_videos", "video_grid_thw", cfg.video_token_id))
             if data is not None]
    grid = tuple(tuple(int(x) for x in row) for _, g, _ in parts for row in g)
    pixels = jnp.asarray(np.concatenate([p for p, _, _ in parts]), jnp.float32)
    _, tokens = _encode_media_jit(pixels, grid, params, cfg)
    arr = jnp.asarray(ids, jnp.int32)
    embeds = params["text"]["embed"][arr]
    start = 0
    for _, g, token in parts:
        n_tokens = int(np.prod(np.asarray(g), axis=1).sum()) // cfg.vision.spatial_merge_size**2
        n = int(np.sum(np.asarray(ids) == token))
        if n != n_tokens:
            raise SystemExit(f"prompt holds {n} placeholder ids {token} but the media give {n_tokens} tokens")
        embeds = scatter_media(embeds, arr, token, tokens[start:start + n_tokens])
        start += n_tokens
    return embeds


def compile_cache_dir() -> Path:
    """Where the CLI keeps compiled executables: $M3JAX_CACHE_DIR, else ~/.cache/m3jax/jax_cache
    (under $XDG_CACHE_HOME when that is set)."""
    if os.environ.get("M3JAX_CACHE_DIR"):
        return Path(os.environ["M3JAX_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "m3jax" / "jax_cache"


_CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
                 "/jax/compilation_cache/cache_hits": "hits"}


@contextlib.contextmanager
def persistent_compile_cache(path: Path | None):
    """JAX's persistent compilation cache in ``path`` while the block runs (None: left as it is), and
    the previous settings back afterwards (``main`` is also called in-process, by tests and
    benchmarks). Every executable is written, however small or fast to compile: JAX's default
    minimum compile time would skip the decode step and the small windows. A hit skips XLA's compile
    only; tracing and lowering still run. cuDNN attention is a ``custom_partitioning`` op that puts a Python pointer
    in the key when lowered for several devices; it is left out of the key so that a sharded run
    hits too (the op's partitioning depends only on what the key keeps). Yields {"dir", "hits",
    "misses"}, counted from JAX's monitoring events while the block runs."""
    stats = {"dir": None if path is None else str(path), "hits": 0, "misses": 0}
    if path is None:
        yield stats
        return
    from jax.experimental.compilation_cache import compilation_cache as cc

    settings = {"jax_compilation_cache_dir": str(path), "jax_persistent_cache_min_compile_time_secs": 0.0,
                "jax_persistent_cache_min_entry_size_bytes": -1,
                "jax_remove_custom_partitioning_ptr_from_cache_key": True}
    before = {name: getattr(jax.config, name) for name in settings}
    counts = {"requests": 0, "hits": 0}

    def count(event, **_):
        if event in _CACHE_EVENTS:
            counts[_CACHE_EVENTS[event]] += 1

    for name, value in settings.items():
        jax.config.update(name, value)
    cc.reset_cache()  # a cache JAX already found off in this process would stay off
    jax.monitoring.register_event_listener(count)
    try:
        yield stats
    finally:
        jax.monitoring.unregister_event_listener(count)
        stats.update(hits=counts["hits"], misses=counts["requests"] - counts["hits"])
        for name, value in before.items():
            jax.config.update(name, value)
        cc.reset_cache()


def main(argv=None) -> dict:
    args = parse_args(argv)
    inputs = {"--checkpoint": args.checkpoint or (None if args.config else DEFAULT_CHECKPOINT),
              "--prompt-file": getattr(args.prompt, "path", None)}
    inputs.update({f"--image {p}": p for p in args.image})
    inputs.update({f"--video {p}": p for p in args.video})
    cli.refuse_overwriting_inputs(args.output_json, "--output-json", inputs)
    distributed.initialize(args)  # several processes: join the job; only process 0 prints and writes
    try:  # read by the self-check and the engine's warmup; a bad value is the user's, refused before anything loads
        aot.compile_threads()
        aot.stage_processes()
        verdicts.canary_workers()
        verdicts.deadline_s()
    except ValueError as e:
        raise cli.UsageError(str(e)) from None
    cache_dir = None if args.no_compile_cache else compile_cache_dir()
    with (persistent_compile_cache(cache_dir) as cache_stats,
          aot.disk_cache(None if cache_dir is None else cache_dir / "aot") as aot_stats):
        report = _generate(args)
    report["compile_cache"] = {**cache_stats, "aot": aot_stats}
    if not args.quiet and cache_stats["dir"]:
        print(f"compile cache {cache_stats['dir']}: {cache_stats['hits']} hits, {cache_stats['misses']} compiled "
              f"and written; exported programs: {aot_stats['hits']} read, {aot_stats['misses']} written, "
              f"{aot_stats['uncached']} not cacheable", file=sys.stderr)
    # Every process must have computed the same tokens (they ran the same program on one mesh).
    report["generated_ids_sha256"] = distributed.check_same("generated ids", report["generated_ids"])
    report["processes"] = jax.process_count()
    if args.output_json and distributed.is_voice():
        atomic_write(args.output_json, json.dumps(report, indent=2))
    return report


def _generate(args) -> dict:
    if args.checkpoint is None and args.config is None:
        args.checkpoint = DEFAULT_CHECKPOINT
    cfg = cli.apply_overrides(load_config(args.checkpoint) if args.checkpoint else preset(args.config),
                              args.config_override)
    if args.allow_beyond_max_position:
        cfg = cfg.replace_text(max_position_embeddings=max(args.ctx, cfg.text.max_position_embeddings))
    elif args.ctx > cfg.text.max_position_embeddings:
        raise SystemExit(
            f"--ctx {args.ctx} exceeds the model's max_position_embeddings={cfg.text.max_position_embeddings}; "
            "pass --allow-beyond-max-position to run anyway"
        )
    dtype = args.dtype
    if dtype == "auto":  # the checkpoint's own dtype, as transformers' dtype="auto"; random presets bfloat16
        dtype = checkpoint_dtype(args.checkpoint) if args.checkpoint else "bfloat16"
    devices, data = select_devices(args)
    memory_plan = _check_memory(cfg, args, dtype, devices, data)
    mesh = sharding.make_mesh(len(devices), data=data, devices=devices) if len(devices) > 1 else None

    try:
        tok = load_tokenizer(args.checkpoint, cfg.text.vocab_size, args.byte_tokenizer)
    except ValueError as e:  # a tokenizer file that does not load (named), or none and a vocabulary too small for bytes
        raise SystemExit(f"cannot load a tokenizer for {args.checkpoint or args.config}: {e}") from None
    media = _prepare_media(args, cfg, tok) if (args.image or args.video) else None
    # The prompt is built before the weights load: its mistakes cost nothing.
    if args.prompt_ids:
        ids = list(args.prompt_ids)
    else:
        text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
        if media:
            text = processing.insert_placeholders(text, len(args.image), len(args.video))
        if not args.raw and getattr(tok, "chat_template", None):
            try:
                text = tok.apply_chat_template(text)
            except ValueError as e:  # the checkpoint's template does not parse or render (the message names it)
                raise SystemExit(f"{e}; --raw skips the chat template") from None
        if media:
            try:
                ids = processing.expand_prompt(text, *media, merge_size=cfg.vision.spatial_merge_size,
                                               temporal_patch_size=cfg.vision.temporal_patch_size)
            except processing.MediaError as e:
                raise SystemExit(f"bad media: {e}") from None
        else:
            ids = tok.encode(text)
    if any(not 0 <= i < cfg.text.vocab_size for i in ids):
        raise SystemExit(f"prompt ids must be in [0, {cfg.text.vocab_size})")
    if args.fill:
        room = args.ctx - args.max_new_tokens - len(ids)
        hay = tok.encode(HAYSTACK)
        ids = (hay * (room // len(hay) + 1))[: max(room, 0)] + ids
    if not ids:
        raise SystemExit("empty prompt")
    if len(ids) + args.max_new_tokens > args.ctx:
        raise SystemExit(f"prompt ({len(ids)} tokens) + --max-new-tokens {args.max_new_tokens} exceed --ctx {args.ctx}")

    # The self-check of every kernel this run can take: the canaries without a verdict (a first run on this
    # GPU, driver, JAX or kernel source) run in a background batch of workers beside the load and the
    # compile, which presume they pass; the engine's warmup confirms them before it keeps or runs a program.
    checking = check_kernels_ahead(cfg.replace(attention_impl=args.attention_impl), wait=False)
    unresolved = cfg
    cfg = cfg.replace(attention_impl=msa_layer.resolve_attention_impl(args.attention_impl, cfg, dtype))

    t0 = time.perf_counter()
    if args.checkpoint:
        # With a mesh each device reads only its shard of the files (a progress bar per file).
        # cfg, its attention_impl resolved above, is the model's as it is: nothing is resolved twice.
        model = m3jax.load_pretrained(args.checkpoint, dtype=dtype, config=cfg, progress=not args.quiet, mesh=mesh,
                                      weights=args.weights, allow_nonfinite=args.allow_nonfinite_weights)
    elif memory_plan["weights_bytes"] * len(devices) > GiB or args.weights == "mxfp8":
        # Real-width presets: host numpy would draw tens of GB in float64 first; draw on the devices, each
        # leaf straight into its shards under a mesh.
        def draw():
            return init_random_on_device(cfg, seed=args.seed, dtype=jnp.dtype(dtype), weights=args.weights)

        params = draw() if mesh is None else jax.jit(
            draw, out_shardings=sharding.param_shardings(cfg, mesh, weights=args.weights))()
        model = m3jax.M3Model(cfg, params, mesh)
    else:
        # m3jax.init_random's draw, without resolving the resolved attention_impl again
        params = init_random(cfg, seed=args.seed, dtype=jnp.dtype(dtype))
        model = m3jax.M3Model(cfg, params if mesh is None else sharding.shard_params(params, cfg, mesh), mesh)
    jax.block_until_ready(model.params)
    load_s = time.perf_counter() - t0

    prompt_embeds = [_media_prompt_embeds(model.params, cfg, ids, *media[1:])] if media else None
    def warm_engine(cfg, confirm=None):
        engine = Engine(model.params, cfg, batch=1, capacity=args.ctx, prefill_chunk=args.prefill_chunk, mesh=mesh,
                        decode_steps_per_call=args.decode_steps_per_call, prefill_buckets=not args.no_prefill_buckets)
        return engine, engine.warmup(sampling=args.sampling, prompt_lens=[len(ids)], confirm=confirm)

    retraced = None
    try:
        engine, compile_s = warm_engine(cfg, checking.confirm)
    except verdicts.CanaryFailed as e:
        retraced = [v.canary for v in e.failed]
    if retraced is not None:  # past the except clause: its traceback no longer holds the first engine's cache
        # A kernel failed its canary after the programs were traced presuming it passed: nothing of them
        # was kept. The choices read the verdicts now (the failing kernel is not used, with a warning).
        cfg = unresolved.replace(attention_impl=msa_layer.resolve_attention_impl(args.attention_impl, unresolved,
                                                                                 dtype))
        engine, compile_s = warm_engine(cfg)
    ran = {v.canary: v.seconds for v in checking.wait()}
    canaries_run = len(ran)
    eos = cfg.text.eos_token_id
    eos_ids = () if isinstance(tok, ByteTokenizer) else (tuple(eos) if isinstance(eos, tuple) else (eos,))

    bar = None
    if not args.quiet:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), desc="prefill", unit="tok", unit_scale=True, file=sys.stderr)
    streamed: list[int] = []
    shown = ""

    def on_token(row, token):
        nonlocal shown
        if bar is not None and bar.n >= bar.total:
            bar.close()
        streamed.append(token)
        if not args.quiet:
            text = tok.decode(streamed)
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text

    result = engine.generate(
        [ids], prompt_embeds=prompt_embeds, max_new_tokens=args.max_new_tokens, sampling=args.sampling, seed=args.seed,
        eos_ids=eos_ids,
        on_token=on_token, on_prefill_progress=(bar.update if bar is not None else None),
    )
    if not args.quiet:
        sys.stdout.write("\n")
    gen = result.generated[0]
    t = result.timings
    steps = max(t["decode_steps"], 1)
    report = {
        "prompt_len": len(ids),
        "generated_ids": gen,
        "text": tok.decode(gen),
        "tokenizer": tok.name,
        "config": args.checkpoint.as_posix() if args.checkpoint else args.config,
        "ctx": args.ctx,
        "dtype": dtype,
        "attention_impl": cfg.attention_impl,
        "devices": [str(d) for d in devices],
        "mesh": None if mesh is None else dict(mesh.shape),
        "timings": {
            "selfcheck_s": checking.seconds,  # the canaries' batch, beside the load and the compile
            "selfcheck_wait_s": checking.wait_s,  # what the compile then waited for it
            "selfcheck_canaries_run": canaries_run,
            "selfcheck_canary_s": ran,  # each canary's own time in its worker, compilation included
            "selfcheck_failed_retraced": retraced,  # canaries that failed after the programs presumed them
            "load_s": load_s,
            "compile_s": compile_s,
            **engine.warmup_split,
            "ttft_s": t["ttft_s"],
            "prefill_tok_per_s": t["prefill_tokens"] / t["ttft_s"],
            "decode_ms_per_token": 1e3 * t["decode_s"] / steps,
            "decode_steps": t["decode_steps"],
            "decode_steps_per_call": args.decode_steps_per_call,
        },
        "memory_plan": memory_plan.pop("text"),
        "memory_plan_per_device": memory_plan,
        **({"media": {
            "images": [str(p) for p in args.image],
            "image_grid_thw": media[1]["image_grid_thw"].tolist() if media[1] else [],
            "videos": [str(p) for p in args.video],
            "video_grid_thw": media[2]["video_grid_thw"].tolist() if media[2] else [],
            "video_timestamps_s": [None if fps is None else (np.asarray(ix) / fps).round(3).tolist()
                                   for fps, ix in (media[2]["video_metadata"] if media[2] else [])],
            "media_tokens": media[0].describe(),
        }} if media else {}),
        **_peak_memory(devices),
    }
    if not args.quiet:
        tm = report["timings"]
        checked = (f", self-check of {canaries_run} canaries {checking.seconds:.1f}s beside the load and compile, "
                   f"{checking.wait_s:.1f}s of it waited for") if canaries_run else ""
        print(f"[{len(ids)} prompt tokens, {len(gen)} generated] load {tm['load_s']:.2f}s, TTFT {tm['ttft_s']:.2f}s "
              f"({tm['prefill_tok_per_s']:.0f} tok/s prefill; compile {tm['compile_s']:.1f}s before"
              f"{checked}), decode "
              f"{tm['decode_ms_per_token']:.1f} ms/token; peak memory {report['peak_device_memory_bytes'] / 2**30:.2f} GiB "
              f"({report['memory_kind']}); attention_impl: {cfg.attention_impl}", file=sys.stderr)
        if mesh is not None:
            print(f"{len(devices)} devices, mesh {dict(mesh.shape)}; peak memory per device (GiB): "
                  + ", ".join(f"{d} {b / 2**30:.2f}" for d, b in report["peak_memory_per_device"].items()),
                  file=sys.stderr)
    return report


if __name__ == "__main__":
    cli.run(main)
