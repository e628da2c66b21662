"""Generate PyTorch reference fixtures for the m3jax MiniMax-M3 implementation.

The oracle is Hugging Face transformers' ``MiniMaxM3SparseForConditionalGeneration``
(pinned in tests/oracle/requirements.txt). For each named configuration this script
builds a tiny float32 model with fixed-seed random weights, saves it with
``save_pretrained`` (which writes the official checkpoint tensor names, e.g.
``language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight``), reloads it,
checks that the reload is exact, and runs an eager forward pass of the RELOADED model:

    OUT/<name>/config.json, *.safetensors [, model.safetensors.index.json]
    OUT/<name>/fixture.npz
        input_ids               int64   [B, T]
        logits                  float32 [B, T, V]
        block_indices_<layer>   int64   [B, index_n_heads, T, topk]  (sparse-attention layers)
        pixel_values, image_grid_thw, vision_hidden_image, image_features           (if images)
        pixel_values_videos, video_grid_thw, vision_hidden_video, video_features    (if videos)

The ``mxfp8`` checkpoint is rewritten with MXFP8 weights (float8_e4m3fn values plus a
uint8 biased power-of-two exponent per row and 32-input block, ``*.weight_scale_inv``);
its fixture comes from the dequantised weights.

CI runs this in the oracle venv to (re)generate tests/fixtures/ (git-ignored); the JAX
test suite then loads every OUT/<name> checkpoint through m3jax and compares its outputs
with fixture.npz, so the JAX side never needs torch.

    python tests/oracle/make_fixtures.py --out tests/fixtures [--only text_mixed image]
"""

import argparse
import json
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf_m3
from transformers.utils import logging as hf_logging

FULL, SPARSE = "full_attention", "minimax_m3_sparse"
DENSE, MOE = "dense", "sparse"
VOCAB = 512
TEXT_ID_LIMIT = 400  # random text tokens are drawn from [0, TEXT_ID_LIMIT)
PLACEHOLDER = {"image": 500, "video": 501}
HEAD_DIM = 16

VISION = dict(
    hidden_size=40,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 20: the 3-D RoPE rotates 18 of the 20 channels
    intermediate_size=80,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_channels=3,
    rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
)
PATCH_DIM = VISION["num_channels"] * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
MERGE = VISION["spatial_merge_size"]

MX_BLOCK = 32
FP8_MAX = 448.0
MXFP8_CONFIG = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, MX_BLOCK]}
# Official-name linear weights stored as MXFP8; embeddings, lm_head, router gate, norms, vision
# tower and projector stay in float32.
MXFP8_WEIGHT = re.compile(
    r"^language_model\.model\.layers\.\d+\.("
    r"self_attn\.(q|k|v|o|index_q|index_k)_proj"
    r"|mlp\.(gate|up|down)_proj"
    r"|block_sparse_moe\.shared_experts\.(gate|up|down)_proj"
    r"|block_sparse_moe\.experts\.\d+\.w[123]"
    r")\.weight$"
)


def text_config(
    *,
    layer_types,
    mlp_layer_types,
    num_attention_heads,
    num_key_value_heads,
    num_local_experts,
    index_head_dim,
    index_block_size,
    index_topk_blocks,
    rope_theta,
    head_dim=HEAD_DIM,
    hidden_size=64,
    intermediate_size=32,
    dense_intermediate_size=96,
    shared_intermediate_size=32,
    **overrides,
):
    """Text config kwargs with partial RoPE (half of each head rotated) as in the real model."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        mlp_layer_types=mlp_layer_types,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        dense_intermediate_size=dense_intermediate_size,
        shared_intermediate_size=shared_intermediate_size,
        num_local_experts=num_local_experts,
        num_experts_per_tok=4,
        index_n_heads=num_key_value_heads,
        index_head_dim=index_head_dim,
        index_block_size=index_block_size,
        index_topk_blocks=index_topk_blocks,
        index_local_blocks=1,
        # transformers takes the rotated width from partial_rotary_factor and ignores rotary_dim.
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": 0.5},
        rotary_dim=head_dim // 2,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )


def text_inputs(batch: int, length: int) -> Callable[[torch.Generator], dict]:
    def make(gen: torch.Generator) -> dict:
        return {"input_ids": torch.randint(0, TEXT_ID_LIMIT, (batch, length), generator=gen)}

    return make


def prompt_inputs(layout: list) -> Callable[[torch.Generator], dict]:
    """Batch-1 prompt from segments ("text", n_tokens) | ("image" | "video", [(t, h, w), ...]).

    A media segment becomes one contiguous run of placeholder ids, t*h*w/MERGE**2 per grid
    row, and contributes its grid rows and random-normal patch rows to the vision inputs.
    """

    def make(gen: torch.Generator) -> dict:
        ids, grids = [], {"image": [], "video": []}
        for kind, arg in layout:
            if kind == "text":
                ids.append(torch.randint(0, TEXT_ID_LIMIT, (arg,), generator=gen))
            else:
                n_tokens = sum(t * h * w for t, h, w in arg) // MERGE**2
                ids.append(torch.full((n_tokens,), PLACEHOLDER[kind], dtype=torch.long))
                grids[kind].extend(arg)
        inputs = {"input_ids": torch.cat(ids)[None]}
        for kind, pixel_key, grid_key in (
            ("image", "pixel_values", "image_grid_thw"),
            ("video", "pixel_values_videos", "video_grid_thw"),
        ):
            if grids[kind]:
                grid = torch.tensor(grids[kind], dtype=torch.long)
                inputs[pixel_key] = torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=gen)
                inputs[grid_key] = grid
        return inputs

    return make


@dataclass(frozen=True)
class FixtureSpec:
    name: str
    # Seeds are picked so that no router or indexer top-k choice is a near-tie (the k-th and
    # (k+1)-th scores differ by >= 1e-3): a float32 reimplementation that sums in another order
    # then selects the same experts and key blocks. Re-check that when changing a spec.
    seed: int
    text: dict
    make_inputs: Callable[[torch.Generator], dict]
    max_shard_size: str = "1GB"
    mxfp8: bool = False
    # Greedy continuation by one full forward per step (the decoding reference: transformers'
    # generate() disagreed with its own forward on M3), stored as greedy_ids / greedy_logits.
    greedy_tokens: int = 0


SMALL_VL_TEXT = dict(
    layer_types=[FULL, SPARSE],
    mlp_layer_types=[DENSE, MOE],
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    index_head_dim=16,
    index_block_size=8,
    index_topk_blocks=2,
)

# The smallest shapes of the Mosaic GPU MSA kernels' fast path (head dims 64, block 64), two MSA
# layers so that a selection error would feed the next layer; 200 tokens = 4 blocks > top-2. G = 8
# and G = 2 query heads per KV head (tests/pallas/test_model_pallas.py, interpret mode in CI).
KERNEL_TEXT = dict(
    layer_types=[SPARSE, FULL, SPARSE],
    mlp_layer_types=[DENSE, MOE, DENSE],
    num_local_experts=4,
    head_dim=64,
    index_head_dim=64,
    index_block_size=64,
    index_topk_blocks=2,
    rope_theta=1e4,
)

SPECS = [
    FixtureSpec(
        name="text_mixed",
        seed=3,
        text=text_config(
            layer_types=[SPARSE, FULL, SPARSE, SPARSE],
            mlp_layer_types=[DENSE, MOE, DENSE, MOE],
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=8,
            index_head_dim=16,
            index_block_size=8,
            index_topk_blocks=4,
            rope_theta=5e6,
        ),
        make_inputs=text_inputs(batch=2, length=77),  # 10 key blocks > top-k 4
        max_shard_size="200KB",  # several shards + model.safetensors.index.json
        greedy_tokens=32,
    ),
    FixtureSpec(
        name="text_wide_block",
        seed=2,
        text=text_config(
            layer_types=[FULL, SPARSE, SPARSE],
            mlp_layer_types=[MOE, MOE, MOE],
            num_attention_heads=8,
            num_key_value_heads=4,
            num_local_experts=6,
            index_head_dim=32,
            index_block_size=16,
            index_topk_blocks=3,
            rope_theta=1e4,
            # Non-default values so that ignoring them in config.json shows up: a limit of 2
            # actually clamps the SwiGLU gate/up activations of these small random weights.
            routed_scaling_factor=1.5,
            swiglu_limit=2.0,
        ),
        make_inputs=text_inputs(batch=1, length=130),
        greedy_tokens=34,
    ),
    # Held out from the parity suite (tests/test_fp32_fallbacks.py): hidden and expert widths of 96, which
    # the grouped-GEMM kernel refuses (K must be a multiple of its 64-wide K tile), so on the GPU every
    # MoE matmul takes the ragged_dot fallback, and fp32 must stay fp32 there.
    FixtureSpec(
        name="wide_96",
        seed=4,
        text=text_config(
            layer_types=[FULL, SPARSE, SPARSE],
            mlp_layer_types=[DENSE, MOE, MOE],
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=6,
            index_head_dim=16,
            index_block_size=8,
            index_topk_blocks=3,
            rope_theta=1e4,
            hidden_size=96,
            intermediate_size=96,
            dense_intermediate_size=96,
        ),
        make_inputs=text_inputs(batch=1, length=96),
    ),
    FixtureSpec(
        name="image",
        seed=5,
        text=text_config(**SMALL_VL_TEXT, rope_theta=5e6),
        make_inputs=prompt_inputs(
            [("text", 4), ("image", [(1, 4, 6)]), ("text", 18), ("image", [(1, 2, 2)]), ("text", 11)]
        ),
    ),
    FixtureSpec(
        name="video",
        seed=9,
        text=text_config(**SMALL_VL_TEXT, rope_theta=1e4),
        # One video split by the processor into two attention segments (<= 4 temporal patches
        # each), then one image in the same prompt.
        make_inputs=prompt_inputs(
            [("text", 3), ("video", [(4, 4, 4), (2, 4, 4)]), ("text", 5), ("image", [(1, 2, 4)]), ("text", 6)]
        ),
    ),
    FixtureSpec(
        name="mxfp8",
        seed=3,
        text=text_config(
            layer_types=[FULL, SPARSE, SPARSE],
            mlp_layer_types=[DENSE, MOE, MOE],  # one dense MLP so its projections are quantised too
            num_attention_heads=8,
            num_key_value_heads=4,
            num_local_experts=6,
            index_head_dim=32,
            index_block_size=16,
            index_topk_blocks=3,
            rope_theta=5e6,
            dense_intermediate_size=64,
        ),
        make_inputs=text_inputs(batch=1, length=130),
        mxfp8=True,
    ),
    FixtureSpec(
        name="kernel_g8",
        seed=1,
        text=text_config(**KERNEL_TEXT, num_attention_heads=16, num_key_value_heads=2),
        make_inputs=text_inputs(batch=1, length=200),
    ),
    FixtureSpec(
        name="kernel_g2",
        seed=1,
        text=text_config(**KERNEL_TEXT, num_attention_heads=4, num_key_value_heads=2),
        make_inputs=text_inputs(batch=1, length=200),
    ),
]


@torch.no_grad()
def randomize_(model: nn.Module) -> None:
    """Overwrite every parameter and persistent buffer with non-trivial random values.

    Init-style weights (std 0.02, zero norms and router biases) leave a tiny model nearly
    linear and hide bugs, so norms, router biases and projections all get sizeable noise.
    """
    touched = set()

    def normal_(tensor: torch.Tensor, mean: float, std: float) -> None:
        tensor.normal_(mean, std)
        touched.add(id(tensor))

    for module in model.modules():
        if isinstance(module, hf_m3.MiniMaxM3VLRMSNorm):  # Gemma-style: scales by 1 + weight
            normal_(module.weight, 0.0, 0.3)
        elif isinstance(module, nn.LayerNorm):
            normal_(module.weight, 1.0, 0.2)
            normal_(module.bias, 0.0, 0.2)
        elif isinstance(module, hf_m3.MiniMaxM3VLTopKRouter):
            normal_(module.weight, 0.0, 0.1)
            normal_(module.e_score_correction_bias, 0.0, 0.3)
        elif isinstance(module, hf_m3.MiniMaxM3VLExperts):
            normal_(module.gate_up_proj, 0.0, 0.1)
            normal_(module.down_proj, 0.0, 0.1)
        elif isinstance(module, (nn.Linear, nn.Embedding, nn.Conv3d)):
            normal_(module.weight, 0.0, 0.1)
            if getattr(module, "bias", None) is not None:
                normal_(module.bias, 0.0, 0.1)

    missed = [name for name, t in model.state_dict(keep_vars=True).items() if id(t) not in touched]
    assert not missed, f"not randomised: {missed}"


@torch.no_grad()
def spread_block_scales_(model: MiniMaxM3SparseForConditionalGeneration) -> None:
    """Vary magnitudes per (row, 32-input block) so MXFP8 exponents differ across rows and blocks.

    Every decoder-layer weight keeps its input dimension last (also the merged expert and
    gate_up tensors), so its blocks are exactly the MXFP8 blocks of the official weights. Each
    block is scaled by 2**k, k in [-2, 2], and the first block of row 0 is zeroed so the
    all-zero case (exponent -127, scale_inv 0) is covered as well.
    """
    for param in model.model.language_model.layers.parameters():
        if param.ndim < 2:
            continue
        blocks = param.view(*param.shape[:-1], -1, MX_BLOCK)
        exponents = torch.randint(-2, 3, blocks.shape[:-1])
        blocks.mul_(torch.ldexp(torch.ones(exponents.shape), exponents)[..., None])
        blocks[..., 0, 0, :] = 0.0


def build_model(spec: FixtureSpec) -> MiniMaxM3SparseForConditionalGeneration:
    torch.manual_seed(spec.seed)
    config = MiniMaxM3VLConfig(
        text_config=spec.text,
        vision_config=VISION,
        image_token_index=PLACEHOLDER["image"],
        video_token_index=PLACEHOLDER["video"],
        projector_hidden_size=48,
    )
    model = MiniMaxM3SparseForConditionalGeneration._from_config(config, attn_implementation="eager")
    randomize_(model)
    if spec.mxfp8:
        spread_block_scales_(model)
    return model.eval()


def load_model(path: Path) -> MiniMaxM3SparseForConditionalGeneration:
    model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    )
    return model.eval()


@torch.no_grad()
def check_roundtrip(model: nn.Module, reloaded: nn.Module, inputs: dict) -> None:
    """The reloaded checkpoint must reproduce every tensor (buffers included) and the logits."""
    original, loaded = model.state_dict(), reloaded.state_dict()
    assert original.keys() == loaded.keys(), original.keys() ^ loaded.keys()
    changed = [name for name, t in original.items() if not torch.equal(t, loaded[name])]
    assert not changed, f"changed by save/load: {changed}"
    assert torch.equal(model(**inputs).logits, reloaded(**inputs).logits)


def mxfp8_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float32 -> (float8_e4m3fn [out, in], uint8 [out, in/32] exponent + 127).

    Each row's 32-input block gets e = ceil(log2(amax / 448)) so W / 2**e fits e4m3.
    """
    rows, cols = weight.shape
    blocks = weight.reshape(rows, cols // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(-1)
    mantissa, exponent = torch.frexp(amax / FP8_MAX)  # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    exp = torch.where(mantissa == 0.5, exponent - 1, exponent)  # exact ceil(log2(x))
    exp = torch.where(amax == 0, -127, exp).clamp(-127, 127)
    values = (blocks / torch.ldexp(torch.ones_like(amax), exp)[..., None]).to(torch.float8_e4m3fn)
    values = values.reshape(rows, cols)
    scale_inv = (exp + 127).to(torch.uint8)

    # e4m3 keeps 3 mantissa bits (half-ulp 2**-4 relative) down to 2**-6, then steps of 2**-9.
    error = (mxfp8_dequantize(values, scale_inv) - weight).abs().reshape(blocks.shape)
    bound = torch.maximum(blocks.abs() * 2.0**-4, torch.ldexp(torch.full_like(blocks, 2.0**-10), exp[..., None]))
    assert bool((error <= bound * (1 + 1e-6)).all()), "MXFP8 rounding error out of bounds"
    return values, scale_inv


def mxfp8_dequantize(values: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    rows, cols = values.shape
    scale = torch.ldexp(torch.ones(scale_inv.shape), scale_inv.long() - 127)
    blocks = values.float().reshape(rows, cols // MX_BLOCK, MX_BLOCK) * scale[..., None]
    return blocks.reshape(rows, cols)


def quantize_checkpoint(path: Path) -> int:
    """Rewrite the single-file checkpoint at `path` in MXFP8; returns the number of quantised weights."""
    tensors = load_file(path / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if MXFP8_WEIGHT.match(name):
            out[name], out[name.removesuffix(".weight") + ".weight_scale_inv"] = mxfp8_quantize(tensor)
        else:
            out[name] = tensor
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = MXFP8_CONFIG
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return len(out) - len(tensors)


def load_dequantized(path: Path) -> MiniMaxM3SparseForConditionalGeneration:
    """Load the MXFP8 checkpoint at `path` as float32 by dequantising it from disk."""
    tensors = load_file(path / "model.safetensors")
    dequantized = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale_name = name.removesuffix(".weight") + ".weight_scale_inv"
        dequantized[name] = mxfp8_dequantize(tensor, tensors[scale_name]) if scale_name in tensors else tensor
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    with tempfile.TemporaryDirectory() as tmp:
        save_file(dequantized, Path(tmp) / "model.safetensors", metadata={"format": "pt"})
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        return load_model(Path(tmp))


@torch.no_grad()
def reference_outputs(model: MiniMaxM3SparseForConditionalGeneration, inputs: dict) -> dict:
    """Logits, per-sparse-layer indexer block selections and vision intermediates."""
    layers = model.model.language_model.layers
    sparse_layers = [i for i, kind in enumerate(model.config.text_config.layer_types) if kind == SPARSE]
    block_indices = {}
    hooks = [
        layers[i].self_attn.indexer.register_forward_hook(
            lambda module, args, output, i=i: block_indices.__setitem__(i, output)
        )
        for i in sparse_layers
    ]
    try:
        logits = model(**inputs).logits
    finally:
        for hook in hooks:
            hook.remove()

    result = dict(inputs, logits=logits)
    result.update({f"block_indices_{i}": block_indices[i] for i in sparse_layers})
    for kind, pixel_key, grid_key in (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    ):
        if pixel_key in inputs:
            features = getattr(model.model, f"get_{kind}_features")(
                inputs[pixel_key], inputs[grid_key], return_dict=True
            )
            result[f"vision_hidden_{kind}"] = features.last_hidden_state.squeeze(0)
            result[f"{kind}_features"] = torch.cat(features.pooler_output)
    return result


@torch.no_grad()
def greedy_by_full_forward(model: MiniMaxM3SparseForConditionalGeneration, input_ids: torch.Tensor, steps: int) -> dict:
    """Greedy decoding where every step re-runs the whole sequence (no cache)."""
    ids = input_ids
    step_logits = []
    for _ in range(steps):
        last = model(input_ids=ids).logits[:, -1]
        step_logits.append(last)
        ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=1)
    return {"greedy_ids": ids[:, input_ids.shape[1] :], "greedy_logits": torch.stack(step_logits, dim=1)}


def check_block_indices(indices: torch.Tensor, block_size: int) -> None:
    """Kernel contract for [B, H, T, K] selections of a prompt at positions 0..T-1:
    the query's own block first, distinct valid blocks left-packed, -1 right-padding."""
    topk = indices.shape[-1]
    q_block = torch.arange(indices.shape[2]) // block_size
    valid = indices >= 0
    n_valid = valid.sum(-1)
    assert bool((n_valid == (q_block + 1).clamp(max=topk)).all())
    assert torch.equal(valid, torch.arange(topk) < n_valid[..., None])
    assert bool((indices[..., 0] == q_block).all())
    assert bool((indices <= q_block[:, None]).all())
    ordered = indices.sort(-1).values
    assert bool(((ordered[..., 1:] != ordered[..., :-1]) | (ordered[..., :-1] < 0)).all())


def make_fixture(spec: FixtureSpec, out_dir: Path) -> str:
    path = out_dir / spec.name
    shutil.rmtree(path, ignore_errors=True)
    model = build_model(spec)
    inputs = spec.make_inputs(torch.Generator().manual_seed(spec.seed))
    model.save_pretrained(path, max_shard_size=spec.max_shard_size)
    reloaded = load_model(path)
    check_roundtrip(model, reloaded, inputs)

    notes = []
    if spec.mxfp8:
        notes.append(f"mxfp8 weights {quantize_checkpoint(path)}")
        reloaded = load_dequantized(path)
    outputs = reference_outputs(reloaded, inputs)
    if spec.greedy_tokens:
        outputs.update(greedy_by_full_forward(reloaded, inputs["input_ids"], spec.greedy_tokens))
        notes.append(f"greedy {spec.greedy_tokens} tokens")
    if spec.mxfp8:
        with torch.no_grad():
            exact = model(**inputs).logits
        rel = (outputs["logits"] - exact).norm() / exact.norm()
        notes.append(f"logits rel-diff vs unquantised {rel:.3f} (informational)")

    block_size = reloaded.config.text_config.index_block_size
    sparse_layers = [k.removeprefix("block_indices_") for k in outputs if k.startswith("block_indices_")]
    for layer in sparse_layers:
        check_block_indices(outputs[f"block_indices_{layer}"], block_size)
    np.savez(
        path / "fixture.npz",
        **{k: v.numpy().astype(np.float32 if v.is_floating_point() else np.int64) for k, v in outputs.items()},
    )
    return ", ".join(
        [
            f"input_ids {tuple(outputs['input_ids'].shape)}",
            f"{len(list(path.glob('*.safetensors')))} shard(s)",
            f"sparse layers [{','.join(sparse_layers)}]",
            *[k for k in ("image_features", "video_features") if k in outputs],
            *notes,
        ]
    )


def main() -> None:
    names = [spec.name for spec in SPECS]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write <name>/ fixtures into")
    parser.add_argument("--only", nargs="+", choices=names, metavar="NAME", help=f"subset of: {' '.join(names)}")
    args = parser.parse_args()

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    args.out.mkdir(parents=True, exist_ok=True)
    total = time.perf_counter()
    for spec in SPECS:
        if args.only and spec.name not in args.only:
            continue
        start = time.perf_counter()
        summary = make_fixture(spec, args.out)
        print(f"{spec.name:<16} {time.perf_counter() - start:6.2f}s  {summary}", flush=True)
    print(f"{'total':<16} {time.perf_counter() - total:6.2f}s  -> {args.out}")


if __name__ == "__main__":
    main()
