"""Media preprocessing, frame sampling, prompt expansion and the --image/--video CLI (m3jax.processing).

Oracle tests read tests/fixtures/processor/, written by tests/oracle/make_processor_fixtures.py with
transformers' MiniMax-M3 image/video processors (the media they saw are stored there too). The other
tests make their own media (PIL images, PyAV videos) in tmp dirs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import m3jax
from m3jax import generate
from m3jax import processing as P
from m3jax.engine import Engine, SamplingParams
from m3jax.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from tests.conftest import FIXTURES, assert_close

PROCESSOR = FIXTURES / "processor"
PIXEL_ATOL = 1e-2  # after normalisation; one uint8 level is ~0.015
CTX, CHUNK = 256, 64  # engine shape shared by the end-to-end and CLI tests (compiled once)


@pytest.fixture(scope="module")
def processor_dir() -> Path:
    if not (PROCESSOR / "processor.npz").exists() or not (PROCESSOR / "e2e" / "fixture.npz").exists():
        pytest.fail(
            f"processor fixtures not found under {PROCESSOR}; generate them with `bash tests/run_tests.sh` "
            "(builds the vision oracle venv) or `<oracle-vision-venv>/bin/python "
            "tests/oracle/make_processor_fixtures.py --out tests/fixtures/processor`"
        )
    return PROCESSOR


# ------------------------------------------------------------------------------------------------
# test media


def write_png(path: Path, height: int, width: int, mode: str = "RGB", seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "L": 1, "RGBA": 4}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode).save(path)
    return path


def write_mp4(path: Path, frames: int, fps: int = 10, height: int = 64, width: int = 96) -> Path:
    """Lossless H.264 clip whose frame i is flat grey 8*i (so decoded frames identify themselves)."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps, options={"qp": "0", "preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 8 * i % 256, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_tokenizer(directory: Path, tokens=(P.IMAGE_PLACEHOLDER, P.VIDEO_PLACEHOLDER, P.VISION_START,
                                              P.VISION_END)) -> Path:
    """A word-level ``tokenizer.json`` ("[unk]" 0, "a" 1) with ``tokens`` added as special tokens 2, 3, ..."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[unk]": 0, "a": 1}, unk_token="[unk]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True) for s in tokens])
    tok.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def per_item_rows(grid: np.ndarray) -> list[slice]:
    sizes = np.prod(grid, axis=1)
    ends = np.cumsum(sizes)
    return [slice(int(e - s), int(e)) for s, e in zip(sizes, ends)]


# ------------------------------------------------------------------------------------------------
# parity with transformers' processors


@pytest.mark.oracle
def test_images_match_transformers(processor_dir):
    fx = np.load(processor_dir / "processor.npz")
    names = json.loads((processor_dir / "media.json").read_text())["images"]
    paths = [processor_dir / "media" / f"{n}.png" for n in names]
    got = P.preprocess_images(paths)
    np.testing.assert_array_equal(got["image_grid_thw"], fx["image_grid_thw"])
    assert got["pixel_values"].shape == fx["pixel_values"].shape and got["pixel_values"].dtype == np.float32
    sizes = [Image.open(p).size for p in paths]
    for name, rows, (w, h) in zip(names, per_item_rows(fx["image_grid_thw"]), sizes):
        diff = float(np.abs(got["pixel_values"][rows] - fx["pixel_values"][rows]).max())
        print(f"image {name} {w}x{h}: max |diff| {diff:.2e}")
        assert diff <= PIXEL_ATOL, name
    # what the set covers: several aspect ratios, one over the pixel cap, one below the minimum
    assert len({round(w / h, 2) for w, h in sizes}) >= 3
    assert any(w * h > P.IMAGE_MAX_PIXELS for w, h in sizes)
    assert any(w * h < P.IMAGE_MIN_PIXELS for w, h in sizes)
    assert (np.prod(fx["image_grid_thw"], axis=1) * 14 * 14 <= P.IMAGE_MAX_PIXELS).all()


@pytest.mark.oracle
def test_videos_match_transformers(processor_dir):
    fx = np.load(processor_dir / "processor.npz")
    names = json.loads((processor_dir / "media.json").read_text())["videos"]
    frames = [np.load(processor_dir / "media" / f"{n}.npy") for n in names]
    got = P.preprocess_video(frames, names=names)
    np.testing.assert_array_equal(got["video_grid_thw"], fx["video_grid_thw"])
    assert got["num_chunks_per_video"] == fx["num_chunks_per_video"].tolist()
    assert max(got["num_chunks_per_video"]) > 1  # one video is split into attention segments
    assert (got["video_grid_thw"][:, 0] <= P.SEGMENT_MAX_FRAMES).all()
    chunk_ends = np.cumsum([0, *got["num_chunks_per_video"]])
    rows = per_item_rows(fx["video_grid_thw"])
    for i, name in enumerate(names):
        sl = slice(rows[chunk_ends[i]].start, rows[chunk_ends[i + 1] - 1].stop)
        diff = float(np.abs(got["pixel_values_videos"][sl] - fx["pixel_values_videos"][sl]).max())
        print(f"video {name} {frames[i].shape}: grid {fx['video_grid_thw'][chunk_ends[i]:chunk_ends[i + 1]].tolist()}, "
              f"max |diff| {diff:.2e}")
        assert diff <= PIXEL_ATOL, name


def _e2e(processor_dir):
    d = processor_dir / "e2e"
    fx = np.load(d / "fixture.npz")
    meta = json.loads((d / "prompt.json").read_text())
    return d, fx, meta


@pytest.mark.oracle
def test_preprocessing_to_generation_matches_transformers(processor_dir):
    """Tokenizer + processing + expansion + vision tokens scattered into the prompt embeddings + engine
    (the CLI's path), against MiniMaxM3VLProcessor + the model's greedy continuation."""
    d, fx, meta = _e2e(processor_dir)
    model = m3jax.load_pretrained(d, dtype="float32", progress=False)
    cfg = model.config
    tok = load_tokenizer(d, cfg.text.vocab_size)
    ids = P.media_token_ids(tok, cfg.image_token_id, cfg.video_token_id)
    assert not ids.fallback
    images = P.preprocess_images([d / f for f in meta["images"]])
    m = meta["video_metadata"]
    videos = P.preprocess_video(P.VideoClip(np.load(d / meta["video"]), m["fps"], np.array(m["frames_indices"])))
    input_ids = P.expand_prompt(meta["prompt"], ids, images, videos)
    assert input_ids == fx["input_ids"][0].tolist()
    assert len(fx["video_grid_thw"]) > 1  # the video arrives as several attention segments
    for key, src in (("pixel_values", images), ("pixel_values_videos", videos)):
        assert np.abs(src[key] - fx[key]).max() <= PIXEL_ATOL, key
    # One engine shape for this test and the CLI tests below (--ctx / --prefill-chunk): one compile.
    embeds = generate._media_prompt_embeds(model.params, cfg, input_ids, images, videos)
    engine = Engine(model.params, cfg, batch=1, capacity=CTX, prefill_chunk=CHUNK)
    res = engine.generate(prompt_embeds=[embeds], max_new_tokens=4, sampling=SamplingParams(0.0), keep_logits=True)
    assert res.generated[0] == fx["greedy_ids"][0].tolist()
    steps = np.stack(res.step_logits, axis=1)  # end of prefill (last prompt position), then 3 decode steps
    assert_close(steps, fx["greedy_logits"], "float32", "logits after a prompt with preprocessed image + video")


@pytest.mark.oracle
def test_cli_image_on_random_checkpoint_matches_oracle_greedy(processor_dir, tmp_path):
    d, fx, meta = _e2e(processor_dir)
    out = tmp_path / "out.json"
    generate.main(["--checkpoint", str(d), "--image", str(d / meta["cli_image"]), "--prompt", meta["cli_prompt"],
                   "--max-new-tokens", "4", "--temperature", "0", "--dtype", "float32", "--ctx", str(CTX),
                   "--prefill-chunk", str(CHUNK), "--output-json", str(out), "--quiet"])
    report = json.loads(out.read_text())
    assert report["prompt_len"] == fx["cli_input_ids"].shape[1]
    assert report["generated_ids"] == fx["cli_greedy_ids"][0].tolist()
    assert report["media"]["image_grid_thw"] == [[1, 4, 6]]


@pytest.mark.oracle
def test_cli_video_and_image_on_checkpoint(processor_dir, tmp_path):
    """--video end to end: PyAV decode, fps sampling, timestamps, segments; prompt length as expanded."""
    d, _, meta = _e2e(processor_dir)
    clip = write_mp4(tmp_path / "clip.mp4", frames=30, fps=10)
    out = tmp_path / "out.json"
    prompt = "First ]<]video[>[ then ]<]image[>[."
    report = generate.main(["--checkpoint", str(d), "--video", str(clip), "--image", str(d / meta["cli_image"]),
                            "--prompt", prompt, "--max-new-tokens", "2", "--temperature", "0", "--dtype", "float32",
                            "--ctx", str(CTX), "--prefill-chunk", str(CHUNK), "--output-json", str(out), "--quiet"])
    media = report["media"]
    assert media["video_timestamps_s"] == [[0.0, 1.0, 1.9, 2.9]]  # 3 s at 1 fps -> min_frames 4: 0, 10, 19, 29
    assert media["video_grid_thw"] == [[2, 4, 6]]  # 4 frames of 64x96 -> 56x84
    tok = load_tokenizer(d, 512)
    ids = P.media_token_ids(tok, 256, 257)
    expected = P.expand_prompt(prompt, ids, P.preprocess_images([d / meta["cli_image"]]),
                               P.preprocess_video(P.load_video(clip), do_resize=False))
    assert report["prompt_len"] == len(expected)
    assert len(report["generated_ids"]) == 2


# ------------------------------------------------------------------------------------------------
# geometry, resize, segments


def test_smart_resize_rules():
    assert P.smart_resize(70, 90) == (56, 84)  # 70/28 = 2.5 rounds half to even
    assert P.smart_resize(168, 224) == (168, 224)
    h, w = P.smart_resize(640, 1000)  # over the cap: scaled down, floored to the grid
    assert h * w <= P.IMAGE_MAX_PIXELS and h % 28 == 0 and w % 28 == 0
    h, w = P.smart_resize(30, 40)  # under the minimum: scaled up, ceiled
    assert h * w >= P.IMAGE_MIN_PIXELS
    with pytest.raises(ValueError, match="aspect ratio"):
        P.smart_resize(10, 3000)


def test_array_and_pil_inputs_agree():
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (45, 130, 3), dtype=np.uint8)
    gray = rng.integers(0, 256, (60, 61), dtype=np.uint8)
    a = P.preprocess_images([rgb, gray])
    b = P.preprocess_images([Image.fromarray(rgb), Image.fromarray(gray, "L")])
    np.testing.assert_array_equal(a["pixel_values"], b["pixel_values"])
    np.testing.assert_array_equal(a["image_grid_thw"], [[1, 4, 10], [1, 4, 4]])  # 45x130 -> 56x140, 60x61 -> 56x56
    assert a["pixel_values"].shape == (40 + 16, 1176)
    # an image already on the grid is not resampled: the patch values are the normalised pixels
    on_grid = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)  # 56x56 of flat 14x14 patches
    pv = P.preprocess_images(np.repeat(np.repeat(on_grid, 14, 0), 14, 1))["pixel_values"]
    first = (on_grid[0, 0].astype(np.float32) / 255 - np.array(P.IMAGE_MEAN)) / np.array(P.IMAGE_STD)
    np.testing.assert_allclose(pv[0].reshape(3, 2, 14, 14)[:, :, 0, 0], np.repeat(first[:, None], 2, 1), atol=1e-5)


def test_resize_keeps_flat_images_flat_and_identity():
    flat = np.full((2, 37, 53, 3), 77, np.uint8)
    assert (P.resize_uint8(flat, 56, 28) == 77).all() and (P.resize_uint8(flat, 112, 140) == 77).all()
    x = np.random.default_rng(2).integers(0, 256, (28, 28, 3), dtype=np.uint8)
    assert P.resize_uint8(x, 28, 28) is x


def test_video_segments_and_padding():
    frames = np.random.default_rng(3).integers(0, 256, (17, 56, 56, 3), dtype=np.uint8)
    out = P.preprocess_video(frames)
    assert out["video_grid_thw"].tolist() == [[4, 4, 4], [4, 4, 4], [1, 4, 4]]  # 17 frames -> 9 temporal patches
    assert out["num_chunks_per_video"] == [3]
    whole = P.preprocess_video(frames, segment_max_frames=None)
    assert whole["video_grid_thw"].tolist() == [[9, 4, 4]]
    np.testing.assert_array_equal(whole["pixel_values_videos"], out["pixel_values_videos"])
    # the odd last frame is paired with itself: both temporal halves of the last patch rows are equal
    last = out["pixel_values_videos"][-16:].reshape(16, 3, 2, 14 * 14)
    np.testing.assert_array_equal(last[:, :, 0], last[:, :, 1])
    with pytest.raises(P.MediaError, match="not multiples of 28"):
        P.preprocess_video(frames[:, :50], do_resize=False)


# ------------------------------------------------------------------------------------------------
# frame sampling and decoding


def test_sample_frame_indices_rule():
    assert P.sample_frame_indices(30, 10.0).tolist() == [0, 10, 19, 29]  # 3 s at 1 fps -> min 4 frames
    assert P.sample_frame_indices(300, 30.0).tolist() == [0, 33, 66, 100, 133, 166, 199, 233, 266, 299]
    assert len(P.sample_frame_indices(100_000, 25.0)) == P.VIDEO_MAX_FRAMES  # 4000 s capped at 768
    assert len(P.sample_frame_indices(250, 25.0, fps=2.0)) == 20
    assert P.sample_frame_indices(99, 10.0, fps=0.5, min_frames=5).tolist() == [0, 25, 49, 74, 98]
    assert P.sample_frame_indices(3, 30.0).tolist() == [0, 1, 2]  # shorter than min_frames: every frame
    assert P.sample_frame_indices(1, None).tolist() == [0]


def test_video_frame_size_respects_the_budgets():
    h, w = P.video_frame_size(1080, 1920, 8)  # few frames: the per-frame cap
    assert h * w <= P.VIDEO_MAX_PIXELS and h % 28 == 0 and w % 28 == 0
    h, w = P.video_frame_size(1080, 1920, 768)  # many frames: the clip's total budget
    assert h * w * 768 / 2 <= P.VIDEO_TOTAL_PIXELS
    assert P.video_frame_size(20, 20, 768) == (56, 56)  # never below min_pixels


def test_load_video_samples_decodes_and_resizes(tmp_path):
    path = write_mp4(tmp_path / "clip.mp4", frames=30, fps=10)
    clip = P.load_video(path)
    assert clip.frames_indices.tolist() == [0, 10, 19, 29] and clip.fps == 10.0 and clip.total_frames == 30
    assert clip.frames.shape == (4, 56, 84, 3)  # 64x96 -> smart_resize -> 56x84
    np.testing.assert_allclose(clip.frames.mean(axis=(1, 2, 3)), 8 * clip.frames_indices, atol=2)
    np.testing.assert_allclose(clip.timestamps, [0.0, 1.0, 1.9, 2.9])
    dense = P.load_video(path, fps=4.0)
    assert dense.frames_indices.tolist() == [0, 3, 5, 8, 11, 13, 16, 18, 21, 24, 26, 29]  # 3 s at 4 fps
    out = P.preprocess_video(dense, do_resize=False)
    assert out["video_grid_thw"].tolist() == [[4, 4, 6], [2, 4, 6]] and out["video_names"] == [str(path)]


# ------------------------------------------------------------------------------------------------
# prompt expansion


def test_expansion_layout_with_byte_fallback():
    ids = P.media_token_ids(ByteTokenizer(512), 500, 501)
    assert ids.fallback and "spelled as UTF-8 bytes" in ids.describe()
    assert list(ids.start) == list(P.VISION_START.encode())
    images = {"image_grid_thw": np.array([[1, 4, 6]]), "image_names": ["a.png"]}
    videos = {"video_grid_thw": np.array([[4, 2, 2], [1, 2, 2]]), "num_chunks_per_video": [2],
              "video_metadata": [(2.0, np.arange(10) * 3)], "video_names": ["v.mp4"]}
    text = P.insert_placeholders("hi", 1, 1)
    assert text == P.IMAGE_PLACEHOLDER + P.VIDEO_PLACEHOLDER + "hi"
    got = P.expand_prompt(text, ids, images, videos)
    start, end = list(ids.start), list(ids.end)
    want = start + [500] * 6 + end
    for i in range(5):  # 5 temporal patches over 2 segments, 1 token each; t_i = indices[2i] / fps
        want += list(f"]<]{3 * 2 * i / 2.0:.1f} seconds[>[".encode()) + start + [501] + end
    assert got == want + list(b"hi")
    without_meta = dict(videos, video_metadata=[(None, None)])
    assert P.expand_prompt(P.VIDEO_PLACEHOLDER, ids, None, without_meta) == (start + [501] + end) * 5
    with pytest.raises(ValueError, match=r"\[256, 512\)"):
        P.media_token_ids(ByteTokenizer(512), 65, 501)


def test_media_ids_come_from_the_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models

    write_tokenizer(tmp_path)
    hf = HFTokenizer(tmp_path)
    ids = P.media_token_ids(hf, 2, 3)
    assert (ids.image, ids.video, ids.start, ids.end, ids.fallback) == (2, 3, (4,), (5,), False)
    with pytest.raises(ValueError, match="image_token_index is 500"):
        P.media_token_ids(hf, 500, 3)
    bare = Tokenizer(models.WordLevel({"[unk]": 0}, unk_token="[unk]"))
    bare.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="has no token"):
        P.media_token_ids(HFTokenizer(tmp_path), 2, 3)


def test_bad_tokenizer_files_name_the_file(tmp_path):
    import jinja2

    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json: not a valid tokenizers file") as e:
        load_tokenizer(tmp_path, 512)
    assert e.value.__cause__ is not None  # the tokenizers library's own message stays chained
    write_tokenizer(tmp_path, tokens=("<s>",))
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: invalid JSON"):
        load_tokenizer(tmp_path, 512)
    cfg.write_text('["<s>"]')
    with pytest.raises(ValueError, match="tokenizer_config.json: expected a JSON object, got list"):
        load_tokenizer(tmp_path, 512)

    # a working template renders; a template that fails while rendering names where it came from
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    cfg.write_text(json.dumps({"bos_token": "<s>", "chat_template": template}))
    assert load_tokenizer(tmp_path, 512).apply_chat_template("a b") == "<s>[user] a b"
    cfg.write_text(json.dumps({"chat_template": "{{ raise_exception('only system prompts') }}"}))
    with pytest.raises(ValueError, match=r"tokenizer_config.json \(chat_template\): applying the chat template"):
        load_tokenizer(tmp_path, 512).apply_chat_template("a")
    # several named templates (transformers' list form): "default" is the chat template
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": template}]
    cfg.write_text(json.dumps({"bos_token": "<s>", "chat_template": named}))
    assert load_tokenizer(tmp_path, 512).apply_chat_template("a b") == "<s>[user] a b"
    cfg.write_text(json.dumps({"chat_template": named[:1]}))
    with pytest.raises(ValueError, match=r"\(chat_template\): no template named 'default' among \['tool_use'\]"):
        load_tokenizer(tmp_path, 512)
    cfg.write_text(json.dumps({"chat_template": 7}))
    with pytest.raises(ValueError, match=r"\(chat_template\): expected a string or a list .* got int"):
        load_tokenizer(tmp_path, 512)
    # chat_template.jinja takes precedence; a syntax error names the file and line
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}\n{% if %}\n")
    tok = load_tokenizer(tmp_path, 512)  # the template is only compiled when applied (--raw never does)
    with pytest.raises(ValueError, match=r"chat_template.jinja: invalid chat template \(line 2: ") as e:
        tok.apply_chat_template("a")
    assert isinstance(e.value.__cause__, jinja2.TemplateSyntaxError)
    (tmp_path / "chat_template.jinja").write_bytes(b"{{ bos_token }}\xff\xfe")
    with pytest.raises(ValueError, match="chat_template.jinja: not UTF-8 text"):
        load_tokenizer(tmp_path, 512)


def test_more_or_fewer_media_than_placeholders():
    ids = P.media_token_ids(ByteTokenizer(512), 500, 501)
    images = {"image_grid_thw": np.array([[1, 2, 2], [1, 2, 2]]), "image_names": ["cat.png", "dog.png"]}
    with pytest.raises(P.MediaError, match="no place for: dog.png"):
        P.expand_prompt(P.IMAGE_PLACEHOLDER + "x", ids, images)
    with pytest.raises(P.MediaError, match="3 image placeholder"):
        P.expand_prompt(P.IMAGE_PLACEHOLDER * 3, ids, images)
    with pytest.raises(P.MediaError, match="video placeholder"):
        P.expand_prompt(P.VIDEO_PLACEHOLDER, ids, images=None, videos=None)


# ------------------------------------------------------------------------------------------------
# bad media


def test_bad_media_errors_name_the_file(tmp_path):
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"definitely not an image")
    with pytest.raises(P.MediaError, match="junk.png.*not a readable image"):
        P.preprocess_images([junk])
    good = write_png(tmp_path / "good.png", 40, 60)
    cut = tmp_path / "cut.png"
    cut.write_bytes(good.read_bytes()[:200])
    with pytest.raises(P.MediaError, match="cut.png.*corrupt"):
        P.load_image(cut)
    with pytest.raises(P.MediaError, match="missing.png.*not found"):
        P.load_image(tmp_path / "missing.png")
    with pytest.raises(P.MediaError, match="image #1: zero-size"):
        P.preprocess_images([np.zeros((4, 4, 3), np.uint8), np.zeros((0, 7, 3), np.uint8)])
    with pytest.raises(P.MediaError, match="empty.png: zero-size"):
        P.preprocess_images([Image.new("RGB", (0, 5))], names=["empty.png"])
    with pytest.raises(P.MediaError, match="thin.png: aspect ratio"):
        P.preprocess_images([np.zeros((2, 500, 3), np.uint8)], names=["thin.png"])

    text = tmp_path / "notes.mp4"
    text.write_text("plain text, not a video\n" * 20)
    with pytest.raises(P.MediaError, match="notes.mp4: cannot open as a video"):
        P.load_video(text)
    clip = write_mp4(tmp_path / "clip.mp4", frames=6)
    data = bytearray(clip.read_bytes())
    at = data.find(b"mdat")
    size = int.from_bytes(data[at - 4:at], "big")
    data[at + 4:at - 4 + size] = bytes(size - 8)  # keep the index, zero every coded frame
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(bytes(data))
    with pytest.raises(P.MediaError, match="broken.mp4: no decodable video frames"):
        P.load_video(broken)
    audio = tmp_path / "tone.wav"
    _write_wav(audio)
    with pytest.raises(P.MediaError, match="tone.wav: no video stream"):
        P.load_video(audio)
    with pytest.raises(P.MediaError, match="video #0: video has no frames"):
        P.preprocess_video(np.zeros((0, 28, 28, 3), np.uint8))

    # the CLI refuses before loading any weights, naming the file (a random preset: the shipped
    # text-only default's tokenizer has no media markers, which is refused first, see below)
    tiny = ["--config", "m3_tiny", "--quiet"]
    with pytest.raises(SystemExit, match="junk.png"):
        generate.main(["--image", str(junk), *tiny])
    with pytest.raises(SystemExit, match="broken.mp4"):
        generate.main(["--video", str(broken), *tiny])
    with pytest.raises(SystemExit, match="no place for: .*good.png"):
        generate.main(["--image", str(good), "--image", str(good), "--prompt", "one ]<]image[>[ only", *tiny])
    with pytest.raises(SystemExit, match=r"tokenizer .*m3-small/tokenizer.json has no token '\]<\]image\[>\['"):
        generate.main(["--image", str(good), "--quiet"])


def test_folder_given_as_media(tmp_path):
    shots = tmp_path / "shots"
    shots.mkdir()
    write_png(shots / "a.png", 40, 60)
    with pytest.raises(P.MediaError, match="shots: is a folder, not an image file"):
        P.preprocess_images([shots])
    with pytest.raises(P.MediaError, match="shots: is a folder, not a video file"):
        P.load_video(shots)
    with pytest.raises(P.MediaError, match="nothing.png: image file not found"):
        P.load_image(shots / "nothing.png")
    tiny = ["--config", "m3_tiny", "--quiet"]
    for flag, what in (("--image", "image"), ("--video", "video")):
        with pytest.raises(SystemExit, match=f"shots: is a folder, not an? {what} file"):
            generate.main([flag, str(shots), *tiny])


def _write_wav(path: Path) -> None:
    import wave

    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes((np.sin(np.arange(800) / 5) * 3000).astype(np.int16).tobytes())


def test_processor_settings_from_checkpoint(tmp_path):
    assert P.processor_settings(None) == ({}, {})
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": [672, 672], "max_pixels": 200704}))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 6272, "longest_edge": 100352}, "fps": 2, "max_frames": 64, "do_resize": True}))
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"vision_segment_max_frames": 2}}))
    image, video = P.processor_settings(tmp_path)
    assert image == {"max_pixels": 200704}  # a list-valued size is ignored, as transformers does
    assert video == {"min_pixels": 6272, "max_pixels": 100352, "fps": 2, "max_frames": 64, "segment_max_frames": 2}
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: invalid JSON"):
        P.processor_settings(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": [2]}))
    with pytest.raises(ValueError, match="config.json: vision_config must be a JSON object, got list"):
        P.processor_settings(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "preprocessor_config.json").write_text("[672, 672]")
    with pytest.raises(ValueError, match="preprocessor_config.json: expected a JSON object, got list"):
        P.processor_settings(tmp_path)
    (tmp_path / "preprocessor_config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="preprocessor_config.json: invalid JSON"):
        P.processor_settings(tmp_path)


@pytest.mark.parametrize("name, content, message", [
    ("preprocessor_config.json", {"max_pixels": 0}, "max_pixels must be a positive integer, got 0"),
    ("preprocessor_config.json", {"size": {"shortest_edge": -5}}, "size.shortest_edge must be a positive integer"),
    ("preprocessor_config.json", {"max_pixels": "big"}, "max_pixels must be a positive integer, got 'big'"),
    ("preprocessor_config.json", {"min_pixels": 500_000}, "min_pixels 500000 exceeds max_pixels 451584"),
    ("video_preprocessor_config.json", {"fps": -1}, "fps must be a positive number, got -1"),
    ("video_preprocessor_config.json", {"min_frames": 50, "max_frames": 0}, "max_frames must be a positive integer"),
    ("video_preprocessor_config.json", {"min_frames": 50, "max_frames": 10}, "min_frames 50 exceeds max_frames 10"),
    ("video_preprocessor_config.json", {"max_frames": True}, "max_frames must be a positive integer, got True"),
    ("video_preprocessor_config.json", {"vision_segment_max_frames": 0}, "vision_segment_max_frames must be a"),
    ("config.json", {"vision_config": {"vision_segment_max_frames": -2}}, "vision_segment_max_frames must be a"),
])
def test_processor_settings_reject_bad_values(tmp_path, name, content, message):
    (tmp_path / name).write_text(json.dumps(content))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / name}: {message}")):
        P.processor_settings(tmp_path)


def test_processor_settings_null_means_unset(tmp_path):
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"max_pixels": None, "min_pixels": 6272, "fps": 0.5, "max_frames": None}))
    assert P.processor_settings(tmp_path) == ({}, {"min_pixels": 6272, "fps": 0.5})


def test_bad_settings_as_arguments_name_the_setting(tmp_path):
    rgb = np.random.default_rng(4).integers(0, 256, (45, 130, 3), dtype=np.uint8)
    frames = np.random.default_rng(5).integers(0, 256, (3, 56, 56, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="smart_resize: max_pixels must be a positive integer, got 0"):
        P.smart_resize(70, 90, max_pixels=0)
    with pytest.raises(ValueError, match="smart_resize: factor must be a positive integer, got 0"):
        P.smart_resize(70, 90, factor=0)
    with pytest.raises(ValueError, match="preprocess_images: patch_size must be a positive integer, got 0"):
        P.preprocess_images(rgb, patch_size=0)
    with pytest.raises(ValueError, match="preprocess_images: min_pixels 1000000 exceeds max_pixels 451584"):
        P.preprocess_images(rgb, min_pixels=1_000_000)
    with pytest.raises(ValueError, match="preprocess_video: merge_size must be a positive integer, got -2"):
        P.preprocess_video(frames, merge_size=-2)
    with pytest.raises(ValueError, match="sample_frame_indices: max_frames must be a positive integer, got 0"):
        P.sample_frame_indices(30, 10.0, min_frames=50, max_frames=0)
    with pytest.raises(ValueError, match="sample_frame_indices: min_frames 50 exceeds max_frames 10"):
        P.sample_frame_indices(30, 10.0, min_frames=50, max_frames=10)
    with pytest.raises(ValueError, match="sample_frame_indices: fps must be a positive number, got nan"):
        P.sample_frame_indices(30, 10.0, fps=float("nan"))
    with pytest.raises(ValueError, match="video_frame_size: total_pixels must be a positive integer, got 0"):
        P.video_frame_size(1080, 1920, 8, total_pixels=0)
    clip = write_mp4(tmp_path / "clip.mp4", frames=6)
    with pytest.raises(ValueError, match="load_video: max_frames must be a positive integer, got 0") as e:
        P.load_video(clip, max_frames=0)
    assert not isinstance(e.value, P.MediaError)  # the caller's setting, not the file, is at fault
    # numpy integers are integers
    assert P.smart_resize(70, 90, max_pixels=np.int64(P.IMAGE_MAX_PIXELS)) == (56, 84)
