"""Media preprocessing and prompt expansion for MiniMax-M3 (docs/ARCHITECTURE.md §3.6, §3.7).

Images and video frames become the flat patch matrices the vision tower takes, laid out exactly as
transformers' ``MiniMaxM3VLImageProcessor`` / ``MiniMaxM3VLVideoProcessor`` lay them out, and the
prompt's image / video placeholders are expanded into the token runs the model expects.

Images (:func:`preprocess_images`): PIL images, file paths or uint8 arrays [H, W, 3] (also [H, W]
grayscale and [H, W, 4] RGBA) -> RGB (transparency composited on white with PIL, as transformers does
for PIL images) -> ``smart_resize`` to multiples of 28 with 3,136 <= H*W <= 451,584 -> bicubic
resize -> (x/255 - mean) / std with the OpenAI-CLIP constants -> each image repeated to 2 frames ->
``pixel_values`` [N, 1176] float32 + ``image_grid_thw`` [n, 3].

Videos (:func:`preprocess_video`): uint8 frames [T, H, W, 3], used as given (no sampling) -> the same
resize per frame with the video pixel limits (3,136 .. 602,112 per frame) -> normalise -> frame count
padded to even by repeating the last frame -> patches. ``video_grid_thw`` has one row per attention
segment of at most ``segment_max_frames`` (4) temporal patches, as transformers' video processor
emits it, and ``num_chunks_per_video`` says how many rows belong to each video.

Video files (:func:`load_video`): decoded with PyAV; frames sampled at ``fps`` (default 1.0) per second
of video, 4..768 frames (all frames of a shorter clip), uniformly over the whole clip (rule in
:func:`sample_frame_indices`), and resized while decoding to a size that respects both the per-frame
cap and the total pixel budget of the clip (:func:`video_frame_size`).

Resize. transformers resizes uint8 tensors with torchvision (``antialias=True``, bicubic), which on
CPU runs PyTorch's separable anti-aliased uint8 kernel: Keys cubic (a = -0.5) with the filter support
widened by the downscale factor (the PIL algorithm), weights normalised per output pixel in float64,
then quantised to int16 with a precision chosen from the largest weight, integer accumulation,
rounding by adding half an LSB, an arithmetic shift and saturation to uint8 -- horizontal pass first,
then vertical, with a uint8 intermediate. PIL's own bicubic is the same filter but quantises the
weights to 22 fractional bits and does not land on the same values: measured against torchvision
0.29 on noise images, PIL (13.0) differs by 1 to 21 grey levels on 0.4% to 31% of the pixels,
depending on the sizes. One level is 1/255/std = 0.015 after normalisation, above the 1e-2 parity
target, so :func:`resize_uint8` re-implements the int16 arithmetic in numpy; it reproduces
torchvision's CPU output bit for bit (torchvision's GPU path resizes in float and can differ).

Prompt expansion (:func:`expand_prompt`), following transformers' ``MiniMaxM3VLProcessor``:

* image -> ``start + image_token * (t*h*w / 4) + end``
* video -> for each temporal patch i: ``]<]{s:.1f} seconds[>[`` (only when the clip's source fps and
  sampled frame indices are known; s = frames_indices[2i] / fps), then ``start + video_token *
  (h*w / 4) + end``.

The marker ids come from the checkpoint's tokenizer (``]<]image[>[``, ``]<]video[>[``,
``]<]start of image[>[``, ``]<]end of image[>[``); the placeholder ids must equal the config's
``image_token_index`` / ``video_token_index``. **Fallback without a tokenizer** (random presets, which
use the byte-level fallback tokenizer): the placeholders take the config's ``image_token_index`` /
``video_token_index`` (which must lie above the 256 byte ids), and the start/end markers and
timestamps, which have no ids in a byte vocabulary, are spelled out as the UTF-8 bytes of their
strings -- what a byte-level tokenizer makes of that text. The sequence keeps the real layout (marker,
placeholder run, marker; a timestamp before each temporal patch), but each marker is a run of ~20
byte ids instead of one special token, so prompt lengths differ from a real checkpoint's; see
:func:`media_token_ids`. The CLI prints a note when it uses this fallback.

Bad media raise :class:`MediaError` (a ``ValueError``) naming the file; unusable settings (sizes,
pixel and frame limits, fps) raise ``ValueError`` naming the setting and the function or file it came from.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from m3jax.config import read_json_object

IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
MAX_ASPECT_RATIO = 200
IMAGE_MIN_PIXELS = 4 * 28 * 28  # 3,136
IMAGE_MAX_PIXELS = 451_584  # 672 * 672
VIDEO_MIN_PIXELS = 4 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28  # 602,112 per frame
VIDEO_TOTAL_PIXELS = int(64000 * 28 * 28 * 0.9)  # pixel budget of a whole sampled clip (~64k tokens)
VIDEO_MAX_VOLUME = 301_056_000  # hard cap on H * W * frames after resizing
VIDEO_FPS = 1.0
VIDEO_MIN_FRAMES = 4
VIDEO_MAX_FRAMES = 768
SEGMENT_MAX_FRAMES = 4  # temporal patches per vision attention segment (vision_segment_max_frames)

IMAGE_PLACEHOLDER = "]<]image[>["
VIDEO_PLACEHOLDER = "]<]video[>["
VISION_START = "]<]start of image[>["
VISION_END = "]<]end of image[>["


class MediaError(ValueError):
    """An image or video that cannot be used; the message names the file (or the input's index)."""


def _label(name: str | None, kind: str, index: int | None = None) -> str:
    if name:
        return str(name)
    return f"{kind} #{index}" if index is not None else kind


def _check_settings(where: str, **values) -> None:
    """Raise ValueError naming ``where`` and the setting unless every given value is usable: ``fps`` a
    positive finite number, every other one a positive integer (None: not set), min_* <= max_*.

    A zero or negative size / limit would otherwise fail far away (a ZeroDivisionError in
    :func:`smart_resize`) or be used silently (min_frames above max_frames)."""
    for key, v in values.items():
        if v is None:
            continue
        if key == "fps":
            ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        else:  # segment_max_frames 0, like None, keeps a video whole (_segments)
            least = 0 if key == "segment_max_frames" else 1
            ok = isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= least
        if not ok:
            want = ("a positive number" if key == "fps" else
                    "an integer >= 0" if key == "segment_max_frames" else "a positive integer")
            raise ValueError(f"{where}: {key} must be {want}, got {v!r}")
    for lo, hi in (("min_pixels", "max_pixels"), ("min_frames", "max_frames")):
        if values.get(lo) is not None and values.get(hi) is not None and values[lo] > values[hi]:
            raise ValueError(f"{where}: {lo} {values[lo]} exceeds {hi} {values[hi]}")


# --------------------------------------------------------------------------------------------------
# Geometry


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = IMAGE_MIN_PIXELS,
                 max_pixels: int = IMAGE_MAX_PIXELS) -> tuple[int, int]:
    """Target (height, width): multiples of ``factor``, area in [min_pixels, max_pixels], aspect kept.

    Each side is rounded to the nearest multiple (Python's round: halves go to even, as transformers
    does); an area above ``max_pixels`` is scaled down by sqrt(area / max_pixels) and floored, an area
    below ``min_pixels`` scaled up and ceiled.
    """
    _check_settings("smart_resize", factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    if height <= 0 or width <= 0:
        raise ValueError(f"zero-size image ({height}x{width})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.1f} exceeds {MAX_ASPECT_RATIO}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * grow / factor) * factor
        w = math.ceil(width * grow / factor) * factor
    return h, w


# --------------------------------------------------------------------------------------------------
# Resize: torchvision's anti-aliased bicubic on uint8, bit for bit


def _keys_cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _int16_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Source indices [out, K], int16-quantised weights [out, K] and their fractional bits."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0  # bicubic half-width 2, widened when shrinking
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    taps = int(math.ceil(support)) * 2 + 1
    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    first = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
    count = np.clip(np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - first, 0, taps)
    j = np.arange(taps)
    w = _keys_cubic((j[None, :] + first[:, None] - center[:, None] + 0.5) * inv)
    w = np.where(j[None, :] < count[:, None], w, 0.0)
    total = np.zeros(out_size)
    for k in range(taps):  # left-to-right sum, like the reference loop
        total = total + w[:, k]
    w = np.divide(w, total[:, None], out=np.zeros_like(w), where=total[:, None] != 0)
    w_max = float(w.max())
    bits = 0
    while bits < 22 and int(0.5 + w_max * (1 << (bits + 1))) < (1 << 15):
        bits += 1
    scaled = w * (1 << bits)
    wq = np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5)).astype(np.int32)
    index = np.minimum(first[:, None] + j[None, :], in_size - 1)
    return index, wq, bits


def _resize_axis(x: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    in_size = x.shape[axis]
    index, wq, bits = _int16_taps(in_size, out_size)
    shape = [1] * x.ndim
    shape[axis] = out_size
    acc = np.full(x.shape[:axis] + (out_size,) + x.shape[axis + 1:], 1 << (bits - 1), np.int32)
    for k in range(index.shape[1]):
        if not wq[:, k].any():
            continue
        acc += np.take(x, index[:, k], axis=axis).astype(np.int32) * wq[:, k].reshape(shape)
    return np.clip(acc >> bits, 0, 255).astype(np.uint8)


def resize_uint8(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize uint8 [..., H, W, C] to [..., height, width, C] exactly as torchvision does on CPU
    (``resize(..., BICUBIC, antialias=True)`` on a uint8 tensor); see the module docstring."""
    if pixels.dtype != np.uint8:
        raise TypeError(f"resize_uint8 takes uint8 pixels, got {pixels.dtype}")
    out = pixels
    if out.shape[-2] != width:
        out = _resize_axis(out, width, axis=out.ndim - 2)
    if out.shape[-3] != height:
        out = _resize_axis(out, height, axis=out.ndim - 3)
    return out


# --------------------------------------------------------------------------------------------------
# Pixels -> patches


def _normalize(pixels: np.ndarray) -> np.ndarray:
    """uint8 [..., H, W, 3] -> float32 [..., 3, H, W], (x - 255 mean) / (255 std) in float32 (the fused
    rescale + normalise of transformers, which folds 1/255 into the constants)."""
    mean = np.asarray(IMAGE_MEAN, np.float32) * np.float32(255.0)
    std = np.asarray(IMAGE_STD, np.float32) * np.float32(255.0)
    x = (pixels.astype(np.float32) - mean) / std
    return np.moveaxis(x, -1, -3)


def patchify(frames: np.ndarray, patch_size: int = PATCH_SIZE, temporal_patch_size: int = TEMPORAL_PATCH_SIZE,
             merge_size: int = MERGE_SIZE) -> tuple[np.ndarray, tuple[int, int, int]]:
    """float [T, C, H, W] -> ([t*h*w, C*Tp*P*P], (t, h, w)).

    T is padded to a multiple of Tp by repeating the last frame. Rows run over (t, h/m, w/m, m, m):
    every m*m consecutive rows form one merge window; a row holds (C, Tp, P, P).
    """
    if pad := -frames.shape[0] % temporal_patch_size:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)], axis=0)
    n, c, height, width = frames.shape
    t, h, w = n // temporal_patch_size, height // patch_size, width // patch_size
    x = frames.reshape(t, temporal_patch_size, c, h // merge_size, merge_size, patch_size,
                       w // merge_size, merge_size, patch_size)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(t * h * w, c * temporal_patch_size * patch_size * patch_size)), (t, h, w)


def _rgb_array(image: Any, label: str) -> np.ndarray:
    """PIL image or array -> uint8 [H, W, 3]. Transparency is composited on white (as transformers does)."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        Image = None
    if Image is not None and isinstance(image, Image.Image):
        if image.width == 0 or image.height == 0:
            raise MediaError(f"{label}: zero-size image ({image.width}x{image.height})")
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = Image.alpha_composite(white, rgba)
        return np.asarray(image.convert("RGB"))
    arr = np.asarray(image)
    if arr.dtype != np.uint8:
        raise MediaError(f"{label}: images must be uint8 arrays (0..255), got {arr.dtype}")
    if arr.ndim == 3 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[-1] not in (3, 4)):
        raise MediaError(f"{label}: expected an [H, W], [H, W, 3] or [H, W, 4] image, got shape {arr.shape}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise MediaError(f"{label}: zero-size image ({arr.shape[1]}x{arr.shape[0]})")
    if arr.ndim == 2:
        return np.repeat(arr[..., None], 3, axis=-1)
    if arr.shape[-1] == 4:
        return _rgb_array(Image.fromarray(arr, "RGBA"), label)
    return arr


def _target_size(height: int, width: int, label: str, factor: int, min_pixels: int, max_pixels: int):
    try:
        return smart_resize(height, width, factor, min_pixels, max_pixels)
    except ValueError as e:
        raise MediaError(f"{label}: {e}") from None


def load_image(path: str | Path):
    """Open an image file with PIL (fully decoded); errors name the file."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if path.is_dir():
        raise MediaError(f"{path}: is a folder, not an image file")
    if not path.is_file():
        raise MediaError(f"{path}: image file not found")
    try:
        with Image.open(path) as im:
            im.load()
            image = im.copy()
    except UnidentifiedImageError:
        raise MediaError(f"{path}: not a readable image (unsupported format or corrupt file)") from None
    except Image.DecompressionBombError as e:
        raise MediaError(f"{path}: {e}") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise MediaError(f"{path}: corrupt image data ({e})") from None
    if image.width == 0 or image.height == 0:
        raise MediaError(f"{path}: zero-size image ({image.width}x{image.height})")
    return image


def preprocess_images(images, *, min_pixels: int = IMAGE_MIN_PIXELS, max_pixels: int = IMAGE_MAX_PIXELS,
                      patch_size: int = PATCH_SIZE, temporal_patch_size: int = TEMPORAL_PATCH_SIZE,
                      merge_size: int = MERGE_SIZE, names: Sequence[str] | None = None) -> dict:
    """Images (PIL, uint8 arrays, or file paths; one or a list) -> ``pixel_values`` float32
    [N, C*Tp*P*P], ``image_grid_thw`` int64 [n, 3] (t = 1), ``image_names``."""
    if not isinstance(images, (list, tuple)):
        images = [images]
    if not images:
        raise MediaError("no images given")
    _check_settings("preprocess_images", min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch_size,
                   temporal_patch_size=temporal_patch_size, merge_size=merge_size)
    factor = patch_size * merge_size
    rows, grids, labels = [], [], []
    for i, image in enumerate(images):
        if isinstance(image, (str, Path)):
            label = str(image)
            image = load_image(image)
        else:
            label = _label(names[i] if names else None, "image", i)
        rgb = _rgb_array(image, label)
        h, w = _target_size(rgb.shape[0], rgb.shape[1], label, factor, min_pixels, max_pixels)
        frame = _normalize(resize_uint8(rgb, h, w))
        patches, grid = patchify(np.repeat(frame[None], temporal_patch_size, axis=0), patch_size,
                                 temporal_patch_size, merge_size)
        rows.append(patches)
        grids.append(grid)
        labels.append(label)
    return {
        "pixel_values": np.concatenate(rows, axis=0),
        "image_grid_thw": np.asarray(grids, np.int64),
        "image_names": labels,
    }


# --------------------------------------------------------------------------------------------------
# Videos


@dataclasses.dataclass
class VideoClip:
    """Sampled frames of one video and where they came from (for the prompt's timestamps)."""

    frames: np.ndarray  # uint8 [T, H, W, 3]
    fps: float | None = None  # frame rate of the source video
    frames_indices: np.ndarray | None = None  # source frame index of each frame
    name: str | None = None
    total_frames: int | None = None  # frames in the source video

    @property
    def timestamps(self) -> np.ndarray | None:
        """Seconds into the source video of each frame, when known."""
        if self.fps is None or self.frames_indices is None:
            return None
        return np.asarray(self.frames_indices, np.float64) / self.fps


def _segments(t: int, h: int, w: int, segment_max_frames: int | None) -> list[list[int]]:
    size = t if not segment_max_frames else segment_max_frames
    return [[min(size, t - start), h, w] for start in range(0, t, size)]


def preprocess_video(videos, *, min_pixels: int = VIDEO_MIN_PIXELS, max_pixels: int = VIDEO_MAX_PIXELS,
                     max_volume: int | None = VIDEO_MAX_VOLUME, segment_max_frames: int | None = SEGMENT_MAX_FRAMES,
                     do_resize: bool = True, patch_size: int = PATCH_SIZE,
                     temporal_patch_size: int = TEMPORAL_PATCH_SIZE, merge_size: int = MERGE_SIZE,
                     names: Sequence[str] | None = None) -> dict:
    """Videos (uint8 [T, H, W, 3] arrays or :class:`VideoClip`; one or a list), frames used as given.

    Returns ``pixel_values_videos`` float32 [N, C*Tp*P*P]; ``video_grid_thw`` int64 with one row per
    attention segment (at most ``segment_max_frames`` temporal patches; None or 0 keeps a video whole);
    ``num_chunks_per_video`` (rows per video); ``video_metadata`` [(fps, frames_indices)] per video
    for the timestamps; ``video_names``. With ``do_resize=False`` the frames must already have sides
    that are multiples of patch_size * merge_size (what :func:`load_video` returns).
    """
    if isinstance(videos, (np.ndarray, VideoClip)):
        videos = [videos]
    if not videos:
        raise MediaError("no videos given")
    _check_settings("preprocess_video", min_pixels=min_pixels, max_pixels=max_pixels, max_volume=max_volume,
                   segment_max_frames=segment_max_frames, patch_size=patch_size,
                   temporal_patch_size=temporal_patch_size, merge_size=merge_size)
    factor = patch_size * merge_size
    rows, grids, chunks, metadata, labels = [], [], [], [], []
    for i, video in enumerate(videos):
        clip = video if isinstance(video, VideoClip) else VideoClip(np.asarray(video))
        label = clip.name or _label(names[i] if names else None, "video", i)
        frames = np.asarray(clip.frames)
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise MediaError(f"{label}: video frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
        if frames.shape[0] == 0:
            raise MediaError(f"{label}: video has no frames")
        if frames.shape[1] == 0 or frames.shape[2] == 0:
            raise MediaError(f"{label}: zero-size video frames ({frames.shape[2]}x{frames.shape[1]})")
        h, w = frames.shape[1:3]
        if do_resize:
            h, w = _target_size(h, w, label, factor, min_pixels, max_pixels)
        elif h % factor or w % factor:
            raise MediaError(f"{label}: frames of {w}x{h} are not multiples of {factor}; pass do_resize=True")
        if max_volume is not None and h * w * frames.shape[0] > max_volume:
            raise MediaError(f"{label}: {frames.shape[0]} frames of {w}x{h} exceed the video pixel volume cap "
                             f"{max_volume} (width * height * frames); sample fewer or smaller frames")
        patches, (t, gh, gw) = patchify(_normalize(resize_uint8(frames, h, w)), patch_size, temporal_patch_size,
                                        merge_size)
        segs = _segments(t, gh, gw, segment_max_frames)
        rows.append(patches)
        grids.extend(segs)
        chunks.append(len(segs))
        metadata.append((clip.fps, None if clip.frames_indices is None else np.asarray(clip.frames_indices)))
        labels.append(label)
    return {
        "pixel_values_videos": np.concatenate(rows, axis=0),
        "video_grid_thw": np.asarray(grids, np.int64),
        "num_chunks_per_video": chunks,
        "video_metadata": metadata,
        "video_names": labels,
    }


def sample_frame_indices(total_frames: int, video_fps: float | None, *, fps: float = VIDEO_FPS,
                         min_frames: int = VIDEO_MIN_FRAMES, max_frames: int = VIDEO_MAX_FRAMES) -> np.ndarray:
    """Source frame indices to keep (the rule is ours; the official sampler is not published:
    docs/ARCHITECTURE.md §8, O4).

    n = floor(duration * fps) with duration = total_frames / video_fps, clamped to
    [min_frames, max_frames], and never more than the video has (a clip shorter than min_frames keeps
    every frame). The n indices spread uniformly over the whole clip, first and last frame included:
    floor(linspace(0, total_frames - 1, n) + 0.5). An odd n is fine: preprocessing pairs the last
    frame with itself, as transformers does. An unknown source rate counts every frame as 1/fps s.
    """
    if total_frames <= 0:
        raise ValueError("video has no frames")
    _check_settings("sample_frame_indices", fps=fps, min_frames=min_frames, max_frames=max_frames)
    samples = total_frames * fps / video_fps if video_fps else float(total_frames)
    n = max(1, min(max(math.floor(samples + 1e-9), min_frames), max_frames, total_frames))
    return np.floor(np.linspace(0, total_frames - 1, n) + 0.5).astype(np.int64)


def video_frame_size(height: int, width: int, n_frames: int, *, min_pixels: int = VIDEO_MIN_PIXELS,
                     max_pixels: int = VIDEO_MAX_PIXELS, total_pixels: int = VIDEO_TOTAL_PIXELS,
                     factor: int = PATCH_SIZE * MERGE_SIZE,
                     temporal_patch_size: int = TEMPORAL_PATCH_SIZE) -> tuple[int, int]:
    """Frame size for a clip of ``n_frames`` sampled frames: the per-frame cap is
    min(max_pixels, total_pixels * Tp / padded_frames), i.e. the whole clip stays within
    ``total_pixels`` per temporal patch pair (~57.6k vision tokens), but never below ``min_pixels``."""
    _check_settings("video_frame_size", min_pixels=min_pixels, max_pixels=max_pixels, total_pixels=total_pixels,
                   temporal_patch_size=temporal_patch_size)
    padded = -(-n_frames // temporal_patch_size) * temporal_patch_size
    cap = max(min_pixels, min(max_pixels, int(total_pixels * temporal_patch_size / padded)))
    return smart_resize(height, width, factor, min_pixels, cap)


def _open_video(path: Path):
    import av

    if path.is_dir():
        raise MediaError(f"{path}: is a folder, not a video file")
    if not path.is_file():
        raise MediaError(f"{path}: video file not found")
    try:
        container = av.open(str(path))
    except (av.FFmpegError, OSError, ValueError) as e:
        raise MediaError(f"{path}: cannot open as a video (unsupported format or corrupt file: {e})") from None
    if not container.streams.video:
        container.close()
        raise MediaError(f"{path}: no video stream in the file (unsupported format?)")
    return container


def _decode(path: Path, wanted: set[int] | None, on_frame: Callable[[int, Any], None]) -> int:
    """Decode every frame of the first video stream in order; returns how many decoded."""
    import av

    container = _open_video(path)
    count = 0
    try:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in container.decode(stream):
            if wanted is None or count in wanted:
                on_frame(count, frame)
            count += 1
    except av.FFmpegError as e:
        if count == 0:
            raise MediaError(f"{path}: no decodable video frames ({e})") from None
        raise MediaError(f"{path}: corrupt video data after frame {count} ({e})") from None
    finally:
        container.close()
    return count


def load_video(path: str | Path, *, fps: float = VIDEO_FPS, min_frames: int = VIDEO_MIN_FRAMES,
               max_frames: int = VIDEO_MAX_FRAMES, min_pixels: int = VIDEO_MIN_PIXELS,
               max_pixels: int = VIDEO_MAX_PIXELS, total_pixels: int = VIDEO_TOTAL_PIXELS,
               factor: int = PATCH_SIZE * MERGE_SIZE, temporal_patch_size: int = TEMPORAL_PATCH_SIZE) -> VideoClip:
    """Decode a video file with PyAV, sample frames (:func:`sample_frame_indices`) and resize them while
    decoding to :func:`video_frame_size` (bicubic, as :func:`resize_uint8`). Errors name the file."""
    # settings first: a bad one is the caller's mistake, not the file's, and must not cost a decode
    _check_settings("load_video", fps=fps, min_frames=min_frames, max_frames=max_frames, min_pixels=min_pixels,
                   max_pixels=max_pixels, total_pixels=total_pixels, factor=factor,
                   temporal_patch_size=temporal_patch_size)
    path = Path(path)
    container = _open_video(path)
    stream = container.streams.video[0]
    declared = int(stream.frames or 0)
    rate = stream.average_rate or stream.guessed_rate
    source_fps = float(rate) if rate else None
    container.close()
    if declared <= 0:  # container does not state a frame count: count by decoding
        declared = _decode(path, set(), lambda i, f: None)
    if declared <= 0:
        raise MediaError(f"{path}: no decodable video frames")

    def sample(total):
        return sample_frame_indices(total, source_fps, fps=fps, min_frames=min_frames, max_frames=max_frames)

    def grab(indices):
        frames: dict[int, np.ndarray] = {}
        size: list[tuple[int, int]] = []

        def keep(i, frame):
            rgb = frame.to_ndarray(format="rgb24")
            if not size:
                try:
                    size.append(video_frame_size(rgb.shape[0], rgb.shape[1], len(indices), min_pixels=min_pixels,
                                                 max_pixels=max_pixels, total_pixels=total_pixels, factor=factor,
                                                 temporal_patch_size=temporal_patch_size))
                except ValueError as e:
                    raise MediaError(f"{path}: {e}") from None
            frames[i] = resize_uint8(rgb, *size[0])

        total = _decode(path, set(indices.tolist()), keep)
        return frames, total

    indices = sample(declared)
    frames, total = grab(indices)
    if total == 0:
        raise MediaError(f"{path}: no decodable video frames")
    if total != declared:  # the container's frame count was wrong: resample over what decodes
        resampled = sample(total)
        if not np.array_equal(resampled, indices):
            indices = resampled
            frames, total = grab(indices)
    return VideoClip(np.stack([frames[i] for i in indices.tolist()]), source_fps, indices, str(path), total)


# --------------------------------------------------------------------------------------------------
# Prompt expansion


@dataclasses.dataclass(frozen=True)
class MediaTokenIds:
    """How media appear in the token sequence: placeholder ids and the id runs of the markers."""

    image: int
    video: int
    start: tuple[int, ...]
    end: tuple[int, ...]
    encode: Callable[[str], list[int]]  # text -> ids (also spells the video timestamps)
    fallback: bool  # True: no tokenizer; markers and timestamps spelled as bytes

    def describe(self) -> str:
        if not self.fallback:
            return (f"media tokens from the tokenizer: image {self.image}, video {self.video}, "
                    f"start {list(self.start)}, end {list(self.end)}")
        return (f"no tokenizer: image/video placeholders use the config ids {self.image}/{self.video}; the "
                f"'{VISION_START}' / '{VISION_END}' markers and the timestamps are spelled as UTF-8 bytes "
                "(byte-level fallback), not as the checkpoint's special tokens")


def media_token_ids(tokenizer, image_token_id: int, video_token_id: int) -> MediaTokenIds:
    """Marker ids for a tokenizer and the config's placeholder ids.

    * A ``tokenizer.json`` tokenizer (:class:`m3jax.tokenizer.HFTokenizer`, or anything with
      ``token_to_id``): the four marker strings must be single tokens, and the image / video ids must
      equal the config's ``image_token_index`` / ``video_token_index``.
    * The byte-level fallback tokenizer (random presets): the placeholders are the config ids (they
      must lie outside the byte range 0..255) and the start/end markers are the bytes of their text.
    """
    lookup = getattr(getattr(tokenizer, "tok", tokenizer), "token_to_id", None)
    if lookup is None:  # byte-level fallback
        vocab = getattr(tokenizer, "vocab_size", None)
        for what, i in (("image_token_index", image_token_id), ("video_token_index", video_token_id)):
            if i < 256 or (vocab is not None and i >= vocab):
                raise ValueError(f"config {what}={i}: with the byte-level fallback tokenizer the placeholder ids "
                                 f"must lie in [256, {vocab}) so they differ from every byte id")
        spell = lambda s: list(s.encode("utf-8"))  # noqa: E731
        return MediaTokenIds(image_token_id, video_token_id, tuple(spell(VISION_START)), tuple(spell(VISION_END)),
                             spell, fallback=True)
    name = getattr(tokenizer, "name", type(tokenizer).__name__)
    ids = {}
    for s in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, VISION_START, VISION_END):
        ids[s] = lookup(s)
        if ids[s] is None:
            raise ValueError(f"tokenizer {name} has no token {s!r}; it cannot encode image/video prompts")
    for s, want, key in ((IMAGE_PLACEHOLDER, image_token_id, "image_token_index"),
                         (VIDEO_PLACEHOLDER, video_token_id, "video_token_index")):
        if ids[s] != want:
            raise ValueError(f"tokenizer {name} maps {s!r} to {ids[s]} but the config's {key} is {want}")
    return MediaTokenIds(ids[IMAGE_PLACEHOLDER], ids[VIDEO_PLACEHOLDER], (ids[VISION_START],), (ids[VISION_END],),
                         tokenizer.encode, fallback=False)


def insert_placeholders(text: str, n_images: int, n_videos: int) -> str:
    """Prefix one placeholder per image, then per video, unless the text already places them itself."""
    if IMAGE_PLACEHOLDER in text or VIDEO_PLACEHOLDER in text:
        return text
    return IMAGE_PLACEHOLDER * n_images + VIDEO_PLACEHOLDER * n_videos + text


def _check_counts(kind: str, placeholders: int, names: list[str]) -> None:
    if len(names) > placeholders:
        extra = ", ".join(names[placeholders:])
        raise MediaError(f"{len(names)} {kind}(s) given but the prompt has {placeholders} {kind} placeholder(s) "
                         f"('{IMAGE_PLACEHOLDER if kind == 'image' else VIDEO_PLACEHOLDER}'); no place for: {extra}")
    if len(names) < placeholders:
        raise MediaError(f"the prompt has {placeholders} {kind} placeholder(s) but only {len(names)} {kind}(s) given")


def expand_prompt(text: str, ids: MediaTokenIds, images: dict | None = None, videos: dict | None = None, *,
                  merge_size: int = MERGE_SIZE, temporal_patch_size: int = TEMPORAL_PATCH_SIZE) -> list[int]:
    """Token ids of ``text`` with every placeholder string replaced by its media's token run.

    ``images`` / ``videos`` are the dicts of :func:`preprocess_images` / :func:`preprocess_video`;
    the k-th image placeholder takes the k-th image, likewise for videos.
    """
    pieces = re.split(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})", text)
    image_grid = [] if images is None else np.asarray(images["image_grid_thw"]).tolist()
    image_names = [] if images is None else list(images.get("image_names") or
                                                  [f"image #{i}" for i in range(len(image_grid))])
    video_rows, video_names, video_meta = [], [], []
    if videos is not None:
        grid = np.asarray(videos["video_grid_thw"]).tolist()
        chunks = videos.get("num_chunks_per_video") or [len(grid)]
        starts = np.concatenate([[0], np.cumsum(chunks)]).astype(int)
        video_rows = [grid[a:b] for a, b in zip(starts[:-1], starts[1:])]
        video_names = list(videos.get("video_names") or [f"video #{i}" for i in range(len(video_rows))])
        video_meta = list(videos.get("video_metadata") or [(None, None)] * len(video_rows))
    _check_counts("image", pieces.count(IMAGE_PLACEHOLDER), image_names)
    _check_counts("video", pieces.count(VIDEO_PLACEHOLDER), video_names)

    out: list[int] = []
    n_image = n_video = 0
    merge = merge_size**2
    for piece in pieces:
        if piece == IMAGE_PLACEHOLDER:
            t, h, w = image_grid[n_image]
            out += [*ids.start, *[ids.image] * (t * h * w // merge), *ids.end]
            n_image += 1
        elif piece == VIDEO_PLACEHOLDER:
            rows = video_rows[n_video]
            fps, indices = video_meta[n_video]
            per_frame = rows[0][1] * rows[0][2] // merge
            for i in range(sum(r[0] for r in rows)):
                if fps is not None and indices is not None and len(indices):
                    seconds = indices[min(i * temporal_patch_size, len(indices) - 1)] / fps
                    out += ids.encode(f"]<]{seconds:.1f} seconds[>[")
                out += [*ids.start, *[ids.video] * per_frame, *ids.end]
            n_video += 1
        elif piece:
            out += ids.encode(piece)
    return out


# --------------------------------------------------------------------------------------------------
# Checkpoint processor settings


def processor_settings(checkpoint: str | Path | None) -> tuple[dict, dict]:
    """(image kwargs, video kwargs) overriding the defaults from a checkpoint's
    ``preprocessor_config.json`` / ``video_preprocessor_config.json`` / ``config.json`` when present.

    Read: ``min_pixels`` / ``max_pixels`` (or a ``size`` dict with ``shortest_edge`` / ``longest_edge``,
    as transformers reads it; a list-valued ``size`` is ignored, as transformers ignores the official
    file's [672, 672]); for videos also ``total_pixels``, ``fps``, ``min_frames``, ``max_frames`` and
    ``vision_segment_max_frames`` (also from ``config.json``'s ``vision_config``). A value that is set
    but unusable (see :func:`_check_settings`, also against the defaults it combines with) raises
    ValueError naming the file and the field.
    """
    image, video = {}, {}
    if checkpoint is None:
        return image, video
    d = Path(checkpoint)

    def read(name):
        f = d / name
        return read_json_object(f) if f.exists() else {}

    def take(name, dst, key, value, field=None):
        """dst[key] = value when the file sets it, after checking it under the file's own field name."""
        if value is not None:
            _check_settings(str(d / name), **{field or key: value})
            dst[key] = value

    def pixels(name, src, dst):
        size = src.get("size")
        if isinstance(size, dict):
            take(name, dst, "min_pixels", size.get("shortest_edge"), "size.shortest_edge")
            take(name, dst, "max_pixels", size.get("longest_edge"), "size.longest_edge")
        for key in ("min_pixels", "max_pixels"):
            take(name, dst, key, src.get(key))

    image_name, video_name = "preprocessor_config.json", "video_preprocessor_config.json"
    pixels(image_name, read(image_name), image)
    vsrc = read(video_name)
    pixels(video_name, vsrc, video)
    for key in ("total_pixels", "fps", "min_frames", "max_frames"):
        take(video_name, video, key, vsrc.get(key))
    # a file may set one bound only: it must still fit the default it is used with
    _check_settings(str(d / image_name), **{"min_pixels": IMAGE_MIN_PIXELS, "max_pixels": IMAGE_MAX_PIXELS, **image})
    _check_settings(str(d / video_name), **{"min_pixels": VIDEO_MIN_PIXELS, "max_pixels": VIDEO_MAX_PIXELS,
                                            "min_frames": VIDEO_MIN_FRAMES, "max_frames": VIDEO_MAX_FRAMES, **video})
    vision = read("config.json").get("vision_config")
    if vision is not None and not isinstance(vision, dict):
        raise ValueError(f"{d / 'config.json'}: vision_config must be a JSON object, got {type(vision).__name__}")
    seg_name, seg = "config.json", (vision or {}).get("vision_segment_max_frames")
    if vsrc.get("vision_segment_max_frames") is not None:
        seg_name, seg = video_name, vsrc["vision_segment_max_frames"]
    take(seg_name, video, "segment_max_frames", seg, "vision_segment_max_frames")
    return image, video
