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

Media (``--image`` / ``--video``, repeatable): each file goes where the prompt has ``]<]image[>[`` /
``]<]video[>[``, or, if the prompt has no placeholder, the placeholders are put before the prompt
text (images first). Preprocessing, frame sampling and the token layout are those of
:mod:`m3jax.processing`; the vision tokens replace the placeholder rows of the prompt embeddings.
Without a tokenizer (random presets) the start/end markers are spelled as bytes (a note is printed;
see ``m3jax.processing.media_token_ids``).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import m3jax
from m3jax import processing
from m3jax.config import load_config, preset, preset_names
from m3jax.engine import Engine, SamplingParams
from m3jax.memory import GiB, max_fitting_ctx, plan
from m3jax.model import scatter_media
from m3jax.params import init_random_on_device
from m3jax.tokenizer import ByteTokenizer, load_tokenizer
from m3jax.vision import encode_media

# The built-in default: m3-small, trained by scripts/build_m3_small.sh and shipped in the package.
DEFAULT_CHECKPOINT = Path(__file__).parent / "assets" / "m3-small"
DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main(argv=None):\n"
HAYSTACK = (
    "The grass is green and the sky is blue. A river runs past the old mill, and the miller counts "
    "his sacks of flour twice a day. "
)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", type=Path,
                     help="HF checkpoint directory (config.json + safetensors); default: the built-in trained "
                          "m3-small (m3jax/assets/m3-small) unless --config is given")
    src.add_argument("--config", help=f"preset with random weights instead of the default checkpoint: {preset_names()}")
    ap.add_argument("--ctx", type=int, default=4096, help="context capacity in tokens (caches are sized for it)")
    prompt = ap.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None)
    prompt.add_argument("--prompt-file", type=Path)
    prompt.add_argument("--prompt-ids", help="comma-separated token ids (no template, no tokenizer)")
    ap.add_argument("--raw", action="store_true", help="do not apply the checkpoint's chat template")
    ap.add_argument("--image", action="append", type=Path, default=[], metavar="FILE",
                    help="image file (repeatable); goes at a ']<]image[>[' in the prompt, else before the prompt")
    ap.add_argument("--video", action="append", type=Path, default=[], metavar="FILE",
                    help="video file decoded with PyAV (repeatable); goes at a ']<]video[>[' in the prompt, "
                         "else before the prompt")
    ap.add_argument("--video-fps", type=float, default=None,
                    help=f"frames sampled per second of video (default {processing.VIDEO_FPS}, "
                         f"{processing.VIDEO_MIN_FRAMES}-{processing.VIDEO_MAX_FRAMES} frames)")
    ap.add_argument("--fill", action="store_true", help="prepend a synthetic haystack up to the context")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prefill-chunk", type=int, default=2048,
                    help="tokens per prefill chunk (one compiled shape per key window; larger chunks amortise "
                         "the per-chunk weight reads and compile fewer windows, smaller ones need less memory)")
    ap.add_argument("--attention-impl", default="auto", choices=["auto", "reference", "dense_mask", "pallas"])
    ap.add_argument("--output-json", type=Path)
    ap.add_argument("--allow-beyond-max-position", action="store_true",
                    help="run past the config's max_position_embeddings (RoPE extrapolation: quality unknown)")
    ap.add_argument("--quiet", action="store_true", help="no streaming text, no progress bars")
    return ap.parse_args(argv)


def _peak_memory() -> dict:
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and "peak_bytes_in_use" in stats:
        return {"peak_device_memory_bytes": int(stats["peak_bytes_in_use"]), "memory_kind": dev.device_kind}
    return {"peak_device_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "memory_kind": "host RSS (CPU backend)"}


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
    if args.video_fps is not None and not args.video_fps > 0:
        raise SystemExit(f"--video-fps must be positive, got {args.video_fps}")
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


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.checkpoint is None and args.config is None:
        args.checkpoint = DEFAULT_CHECKPOINT
    cfg = load_config(args.checkpoint) if args.checkpoint else preset(args.config)
    cfg = cfg.replace(attention_impl=m3jax.api.resolve_attention_impl(args.attention_impl, cfg))
    if args.allow_beyond_max_position:
        cfg = cfg.replace_text(max_position_embeddings=max(args.ctx, cfg.text.max_position_embeddings))
    elif args.ctx > cfg.text.max_position_embeddings:
        raise SystemExit(
            f"--ctx {args.ctx} exceeds the model's max_position_embeddings={cfg.text.max_position_embeddings}; "
            "pass --allow-beyond-max-position to run anyway"
        )
    dtype_bytes = 2 if args.dtype == "bfloat16" else 4
    mem = plan(cfg, batch=1, capacity=args.ctx, chunk=args.prefill_chunk, dtype_bytes=dtype_bytes)
    if not mem.fits:
        best = max_fitting_ctx(cfg, batch=1, chunk=args.prefill_chunk, dtype_bytes=dtype_bytes, weights_loaded=False)
        hint = f"--ctx {best} fits" if best else "no --ctx fits; use a smaller --prefill-chunk or more devices"
        raise SystemExit(f"refusing to run: {mem.describe()}. {hint}"
                         + ("" if args.dtype == "bfloat16" else "; --dtype bfloat16 halves weights and caches"))

    tok = load_tokenizer(args.checkpoint, cfg.text.vocab_size)
    media = _prepare_media(args, cfg, tok) if (args.image or args.video) else None

    t0 = time.perf_counter()
    if args.checkpoint:
        model = m3jax.load_pretrained(args.checkpoint, dtype=args.dtype, attention_impl=cfg.attention_impl,
                                      progress=not args.quiet)
        model = m3jax.M3Model(cfg, model.params)
    elif mem.weights > GiB:
        # Real-width presets: host numpy would draw tens of GB in float64 first; draw on the device.
        model = m3jax.M3Model(cfg, init_random_on_device(cfg, seed=args.seed, dtype=jnp.dtype(args.dtype)))
    else:
        model = m3jax.init_random(cfg, seed=args.seed, dtype=args.dtype)
    jax.block_until_ready(model.params)
    load_s = time.perf_counter() - t0

    if args.prompt_ids:
        ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    else:
        text = args.prompt_file.read_text() if args.prompt_file else (args.prompt if args.prompt is not None else DEFAULT_PROMPT)
        if media:
            text = processing.insert_placeholders(text, len(args.image), len(args.video))
        if not args.raw and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(text)
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

    prompt_embeds = [_media_prompt_embeds(model.params, cfg, ids, *media[1:])] if media else None
    engine = Engine(model.params, cfg, batch=1, capacity=args.ctx, prefill_chunk=args.prefill_chunk)
    compile_s = engine.warmup(len(ids))
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
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
        [ids], prompt_embeds=prompt_embeds, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
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
        "attention_impl": cfg.attention_impl,
        "devices": [str(d) for d in jax.devices()],
        "timings": {
            "load_s": load_s,
            "compile_s": compile_s,
            "ttft_s": t["ttft_s"],
            "prefill_tok_per_s": t["prefill_tokens"] / t["ttft_s"],
            "decode_ms_per_token": 1e3 * t["decode_s"] / steps,
            "decode_steps": t["decode_steps"],
        },
        "memory_plan": mem.describe(),
        **({"media": {
            "images": [str(p) for p in args.image],
            "image_grid_thw": media[1]["image_grid_thw"].tolist() if media[1] else [],
            "videos": [str(p) for p in args.video],
            "video_grid_thw": media[2]["video_grid_thw"].tolist() if media[2] else [],
            "video_timestamps_s": [None if fps is None else (np.asarray(ix) / fps).round(3).tolist()
                                   for fps, ix in (media[2]["video_metadata"] if media[2] else [])],
            "media_tokens": media[0].describe(),
        }} if media else {}),
        **_peak_memory(),
    }
    if not args.quiet:
        tm = report["timings"]
        print(f"[{len(ids)} prompt tokens, {len(gen)} generated] load {tm['load_s']:.2f}s, TTFT {tm['ttft_s']:.2f}s "
              f"({tm['prefill_tok_per_s']:.0f} tok/s prefill; compile {tm['compile_s']:.1f}s before), decode "
              f"{tm['decode_ms_per_token']:.1f} ms/token; peak memory {report['peak_device_memory_bytes'] / 2**30:.2f} GiB "
              f"({report['memory_kind']})", file=sys.stderr)
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
