"""Reference fixtures for m3jax.processing from transformers' MiniMax-M3 processors.

Runs in the vision oracle venv (tests/oracle/requirements-vision.txt: torch + torchvision, which
transformers' image/video processors need). Everything it feeds the processors is generated here
from fixed seeds and written next to the outputs, so the pytest side reads the very same pixels:

    OUT/media/<name>.png            images (lossless), opened with PIL on both sides
    OUT/media/<name>.npy            video frames, uint8 [T, H, W, 3]
    OUT/processor.npz               one batched call per kind over all the media above:
        pixel_values, image_grid_thw                                  (MiniMaxM3VLImageProcessor)
        pixel_values_videos, video_grid_thw, num_chunks_per_video     (MiniMaxM3VLVideoProcessor)
    OUT/media.json                  the media names in call order
    OUT/e2e/                        a tiny random MiniMax-M3 checkpoint (save_pretrained) whose
                                    tokenizer.json holds the four media marker tokens, plus
        prompt.json                 prompt text, media files and video metadata (fps, frame indices)
        fixture.npz                 MiniMaxM3VLProcessor outputs (input_ids, pixel values, grids),
                                    the model's fp32 logits on them and its greedy continuation
                                    (greedy_ids / greedy_logits, one full forward per step); cli_*:
                                    a prompt with one image and its greedy continuation

    python tests/oracle/make_processor_fixtures.py --out tests/fixtures/processor
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.minimax_m3_vl import (
    MiniMaxM3VLImageProcessor,
    MiniMaxM3VLProcessor,
    MiniMaxM3VLVideoProcessor,
)
from transformers.utils import logging as hf_logging
from transformers.video_utils import VideoMetadata

sys.path.insert(0, str(Path(__file__).parent))
import make_fixtures as mf  # noqa: E402  (the model oracle's tiny configs and weight randomiser)

MARKERS = ["]<]image[>[", "]<]video[>[", "]<]start of image[>[", "]<]end of image[>["]

# name, height, width, PIL mode. Covers wide / tall aspect ratios, grayscale, transparency, an image
# below min_pixels (scaled up), one above max_pixels (scaled down to the cap) and one already on the
# 28-pixel grid (not resized).
IMAGES = [
    ("wide", 120, 300, "RGB"),
    ("tall_gray", 260, 90, "L"),
    ("over_cap", 640, 1000, "RGB"),
    ("tiny_rgba", 30, 40, "RGBA"),
    ("on_grid", 168, 224, "RGB"),
]
# name, frames, height, width. "long" has 9 temporal patches -> attention segments of 4, 4, 1;
# "short" has an odd frame count (last frame repeated) and a side that rounds half to even;
# "over_cap" frames are above the per-frame pixel cap.
VIDEOS = [
    ("short", 5, 70, 90),
    ("long", 18, 100, 150),
    ("over_cap", 2, 700, 1000),
]


def make_pixels(rng: np.random.Generator, frames: int, height: int, width: int, channels: int = 3) -> np.ndarray:
    """Smooth moving gradients plus noise and a few hard edges: uint8 [frames, H, W, C]."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    out = []
    for f in range(frames):
        phase = rng.uniform(0, 2 * np.pi, channels)
        base = np.stack(
            [127 + 100 * np.sin(x / (7 + 5 * c) + y / (11 + 3 * c) + phase[c] + 0.4 * f) for c in range(channels)], -1
        )
        base[(x // 9 + y // 13 + f) % 5 == 0] = 255 * rng.integers(0, 2)
        noise = rng.normal(0, 25, base.shape)
        out.append(np.clip(base + noise, 0, 255).astype(np.uint8))
    return np.stack(out)


def write_media(out: Path, rng: np.random.Generator) -> dict:
    media = out / "media"
    media.mkdir(parents=True)
    images = {}
    for name, h, w, mode in IMAGES:
        pixels = make_pixels(rng, 1, h, w, {"RGB": 3, "L": 1, "RGBA": 4}[mode])[0]
        if mode == "RGBA":
            pixels[..., 3] = np.linspace(0, 255, w, dtype=np.uint8)[None, :]  # a full alpha ramp
        image = Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode)
        image.save(media / f"{name}.png")
        images[name] = Image.open(media / f"{name}.png")
    videos = {}
    for name, t, h, w in VIDEOS:
        videos[name] = make_pixels(rng, t, h, w)
        np.save(media / f"{name}.npy", videos[name])
    return {"images": images, "videos": videos}


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges (ids 0..255 = bytes) plus the media markers as ids 256..259."""
    b2u = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in MARKERS])
    assert [tok.token_to_id(s) for s in MARKERS] == [256, 257, 258, 259]
    return tok


def build_e2e_model(seed: int) -> MiniMaxM3SparseForConditionalGeneration:
    torch.manual_seed(seed)
    # One MSA + MoE decoder layer and one vision layer: the processing pipeline is under test here
    # (the model's layers are covered by make_fixtures.py), and a small graph keeps the JAX compile short.
    text = dict(mf.SMALL_VL_TEXT, layer_types=[mf.SPARSE], mlp_layer_types=[mf.MOE])
    config = MiniMaxM3VLConfig(
        text_config=mf.text_config(**text, rope_theta=5e6),
        vision_config=dict(mf.VISION, num_hidden_layers=1),
        image_token_index=256,
        video_token_index=257,
        projector_hidden_size=48,
    )
    model = MiniMaxM3SparseForConditionalGeneration._from_config(config, attn_implementation="eager")
    mf.randomize_(model)
    return model.eval()


@torch.no_grad()
def greedy_by_full_forward(model, inputs: dict, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy continuation, one full forward (media included) per step: (ids [B, steps], logits [B, steps, V])."""
    ids, step_logits = inputs["input_ids"], []
    for _ in range(steps):
        last = model(**dict(inputs, input_ids=ids)).logits[:, -1]
        step_logits.append(last)
        ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=1)
    return ids[:, inputs["input_ids"].shape[1]:], torch.stack(step_logits, dim=1)


@torch.no_grad()
def make_e2e(out: Path, rng: np.random.Generator, seed: int) -> str:
    path = out / "e2e"
    model = build_e2e_model(seed)
    model.save_pretrained(path)
    model = mf.load_model(path)
    tok = byte_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    processor = MiniMaxM3VLProcessor(
        image_processor=MiniMaxM3VLImageProcessor(),
        tokenizer=PreTrainedTokenizerFast(tokenizer_object=tok),
        video_processor=MiniMaxM3VLVideoProcessor(),
    )

    files = {"a": (50, 80), "b": (90, 40)}
    for name, (h, w) in files.items():
        Image.fromarray(make_pixels(rng, 1, h, w)[0]).save(path / f"{name}.png")
    frames = make_pixels(rng, 10, 60, 100)
    np.save(path / "clip.npy", frames)
    metadata = {"fps": 2.5, "total_num_frames": 41, "frames_indices": [0, 4, 9, 13, 18, 22, 27, 31, 36, 40]}
    prompt = "Compare ]<]image[>[ with the clip ]<]video[>[ and with ]<]image[>[ please."
    inputs = processor(
        text=[prompt],
        images=[Image.open(path / "a.png"), Image.open(path / "b.png")],
        videos=[frames],
        video_metadata=[VideoMetadata(**metadata)],
        do_resize=True,  # the processor's video default is do_resize=False (frames pre-sized)
        return_tensors="pt",
    )
    keys = ["input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"]
    feed = {k: inputs[k] for k in keys}
    logits = model(**feed).logits
    greedy = greedy_by_full_forward(model, feed, steps=4)

    # CLI contract: prompt "<image placeholder>Describe it." with image a, no chat template.
    cli = processor(text=["]<]image[>[Describe it."], images=[Image.open(path / "a.png")], return_tensors="pt")
    cli_greedy = greedy_by_full_forward(model, {k: cli[k] for k in ("input_ids", "pixel_values", "image_grid_thw")}, 4)

    (path / "prompt.json").write_text(json.dumps(
        {"prompt": prompt, "images": ["a.png", "b.png"], "video": "clip.npy", "video_metadata": metadata,
         "cli_prompt": "Describe it.", "cli_image": "a.png"}, indent=2))
    arrays = {k: v.numpy() for k, v in feed.items()}
    arrays.update(logits=logits.numpy(), greedy_ids=greedy[0].numpy(), greedy_logits=greedy[1].numpy(),
                  cli_input_ids=cli["input_ids"].numpy(), cli_greedy_ids=cli_greedy[0].numpy())
    np.savez(path / "fixture.npz", **arrays)
    return f"e2e input_ids {tuple(feed['input_ids'].shape)}, video grid {feed['video_grid_thw'].tolist()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    # Seed 7: no router / indexer near-ties in the e2e model (m3jax reproduces its greedy logits to ~5e-7).
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    start = time.perf_counter()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    rng = np.random.default_rng(args.seed)
    media = write_media(args.out, rng)

    images = MiniMaxM3VLImageProcessor()(images=list(media["images"].values()), return_tensors="pt")
    videos = MiniMaxM3VLVideoProcessor()(videos=list(media["videos"].values()), return_tensors="pt")
    np.savez(
        args.out / "processor.npz",
        pixel_values=images["pixel_values"].numpy(),
        image_grid_thw=images["image_grid_thw"].numpy(),
        pixel_values_videos=videos["pixel_values_videos"].numpy(),
        video_grid_thw=videos["video_grid_thw"].numpy(),
        num_chunks_per_video=np.asarray(videos["num_chunks_per_video"]),
    )
    (args.out / "media.json").write_text(json.dumps({"images": list(media["images"]), "videos": list(media["videos"])}))
    print(f"images {images['image_grid_thw'].tolist()}")
    print(f"videos {videos['video_grid_thw'].tolist()} chunks {videos['num_chunks_per_video']}")
    print(make_e2e(args.out, rng, args.seed))
    print(f"total {time.perf_counter() - start:.1f}s -> {args.out}")


if __name__ == "__main__":
    main()
