"""m3jax: MiniMax-M3 (MSA sparse attention, MoE, vision tower) in JAX, exact against transformers."""

from m3jax.api import ForwardOutput, M3Model, forward, init_random, load_pretrained, save_pretrained
from m3jax.atomic import FolderBusyError
from m3jax.checkpoint import CheckpointChanged, NonFiniteError
from m3jax.config import M3Config, TextConfig, UnsupportedConfigError, VisionConfig, load_config, preset
from m3jax.safetensors_io import CheckpointError

__all__ = [
    # Models and inference
    "M3Model",
    "ForwardOutput",
    "load_pretrained",
    "init_random",
    "forward",
    "save_pretrained",
    # Configuration
    "M3Config",
    "TextConfig",
    "VisionConfig",
    "load_config",
    "preset",
    # Errors
    "UnsupportedConfigError",
    "CheckpointError",
    "CheckpointChanged",
    "NonFiniteError",
    "FolderBusyError",
]
