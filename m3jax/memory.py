"""Memory planner for generation: weights + caches + activations against what the device has.

The largest transients of a prefill chunk are the gathered cache views of its key window (at most
the capacity), and per attention path: the reference's index scores of one query sub-chunk against
the window, its key-blocked dense attention and the gathered selected K/V blocks; the kernels path's
block-major index scores of the whole chunk and the KV-major staging of partial outputs (the
full-attention layers' cuDNN parts, a copy of a piece of the prefix at a time merged in fp32, take less).
"""

from __future__ import annotations

import dataclasses
import os

import jax

from m3jax.cache import cache_bytes
from m3jax.config import M3Config
from m3jax.msa import layer as msa_layer
from m3jax.params import param_specs, ParamSpec

GiB = 1 << 30


@dataclasses.dataclass
class MemoryPlan:
    weights: int
    cache: int
    activations: int
    available: int | None
    device: str

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.activations

    @property
    def fits(self) -> bool:
        return self.available is None or self.total <= self.available

    def describe(self) -> str:
        avail = "unknown" if self.available is None else f"{self.available / GiB:.2f} GiB"
        return (
            f"needs {self.total / GiB:.2f} GiB (weights {self.weights / GiB:.2f}, KV+index cache "
            f"{self.cache / GiB:.2f}, activations ~{self.activations / GiB:.2f}); available on {self.device}: {avail}"
        )


def weight_bytes(cfg: M3Config, dtype_bytes: int, weights: str = "dequantize") -> int:
    """Bytes of the parameters; ``weights="mxfp8"``: as ``load_pretrained(..., weights="mxfp8")`` holds
    them (fp8 values and uint8 scales one byte each)."""
    total = 0
    for s in jax.tree.leaves(param_specs(cfg, weights), is_leaf=lambda x: isinstance(x, ParamSpec)):
        n = 1
        for d in s.shape:
            n *= d
        total += n * (4 if s.dtype == "float32" else 1 if s.dtype in ("float8_e4m3fn", "uint8") else dtype_bytes)
    return total


def activation_bytes(cfg: M3Config, batch: int, capacity: int, chunk: int, dtype_bytes: int) -> int:
    t = cfg.text
    c, ca = chunk, min(cfg.attention_chunk, chunk)
    n, k, h = t.num_attention_heads, t.num_key_value_heads, t.head_dim
    hidden = 8 * c * max(t.hidden_size, n * h) * 4
    moe = 3 * c * t.num_experts_per_tok * max(t.intermediate_size, t.hidden_size) * 4
    mlp = 3 * c * t.dense_intermediate_size * 4
    views = batch * capacity * (2 * k * h + t.index_head_dim) * dtype_bytes  # one layer's window, every sequence
    logits = batch * t.vocab_size * 4 * 2
    variant = msa_layer.variant(cfg)
    if variant.whole_chunk:
        # block-major fp32 index scores of the whole chunk (+ the top-k kernel's copy), the KV-major
        # per-(query, slot) partial outputs and LSEs
        nb = -(-capacity // t.index_block_size)
        attn = 2 * c * t.index_n_heads * nb * 4 + c * t.index_topk_blocks * n * (h * dtype_bytes + 4)
    else:
        scores = 2 * ca * t.index_n_heads * capacity * 4
        gathered = 2 * ca * k * t.index_topk_blocks * t.index_block_size * h * 4
        # dense_mask: [sub-chunk, S] logits per head; reference: key blocks of 1024 (causal_attention)
        dense = 2 * ca * n * (capacity if variant.dense == "dense_mask" else min(1024, capacity)) * 4
        attn = max(scores + gathered, dense)
    return hidden + moe + mlp + views + attn + logits


def device_memory(devices=None) -> tuple[int | None, str]:
    """(bytes usable on each device, description) for ``devices`` (default: the first visible one): the
    least free of them; for the CPU backend the host RAM, shared by the (simulated) devices."""
    devices = list(devices) if devices is not None else jax.devices()[:1]
    free = []
    for dev in devices:
        stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
        if not (stats and "bytes_limit" in stats):
            break
        free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    else:
        dev = devices[0]
        return min(free), f"{dev.device_kind} ({dev.platform})" + (f", each of {len(devices)}" if len(devices) > 1 else "")
    share = f" / {len(devices)} devices" if len(devices) > 1 else ""
    ram = host_available_bytes()
    if ram is None:
        return None, "host"
    return int(ram * 0.9) // len(devices), f"host RAM{share} (CPU backend)"


def _meminfo_kib(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == key:
                    return int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _stat_sum(path: str, keys: tuple[str, ...]) -> int:
    total = 0
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name in keys:
                    total += int(value)
    except (OSError, ValueError):
        return 0
    return total


def _own_cgroup_dirs(mount: str, proc_cgroup: str, v1: bool) -> list[str]:
    """This process's cgroup folder under ``mount`` (its line in /proc/self/cgroup: ``0::/path`` for v2,
    ``N:memory:/path`` for v1's memory controller), then the mount itself (a container's own cgroup
    where it has a namespace of its own)."""
    dirs = []
    try:
        with open(proc_cgroup) as f:
            for line in f:
                _, controllers, path = line.strip().split(":", 2)
                if (("memory" in controllers.split(",")) if v1 else controllers == "") and path != "/":
                    dirs.append(os.path.join(mount, path.lstrip("/")))
    except (OSError, ValueError):
        pass
    return dirs + [mount]


def host_available_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup",
                         proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Bytes a new allocation can get on this host: the kernel's MemAvailable (free pages plus the page
    cache it can drop; free pages alone read near zero on a machine that has read many files), lowered to
    the room left under this process's cgroup limit (v2, else v1), where the group's file cache, which the
    kernel reclaims before refusing, counts as room. ``None`` where neither is known."""
    kib = _meminfo_kib(meminfo, "MemAvailable")
    if kib is not None:
        avail = kib * 1024
    else:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            avail = None
    v2 = [(os.path.join(d, "memory.max"), os.path.join(d, "memory.current"), os.path.join(d, "memory.stat"),
           ("active_file", "inactive_file")) for d in _own_cgroup_dirs(cgroup, proc_cgroup, v1=False)]
    v1 = [(os.path.join(d, "memory.limit_in_bytes"), os.path.join(d, "memory.usage_in_bytes"),
           os.path.join(d, "memory.stat"), ("total_active_file", "total_inactive_file"))
          for d in _own_cgroup_dirs(os.path.join(cgroup, "memory"), proc_cgroup, v1=True)]
    for limit_file, usage_file, stat_file, cache in v2 + v1:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is None or usage is None or limit >= 1 << 60:  # v1 writes a huge number for no limit
            continue
        room = max(0, limit - usage + _stat_sum(stat_file, cache))
        avail = room if avail is None else min(avail, room)
        break
    return avail


def plan(cfg: M3Config, *, batch: int, capacity: int, chunk: int, dtype_bytes: int, weights_loaded: bool = False,
         weights: str = "dequantize") -> MemoryPlan:
    available, device = device_memory()
    w = 0 if weights_loaded else weight_bytes(cfg, dtype_bytes, weights)
    return MemoryPlan(w, cache_bytes(cfg, batch, capacity, dtype_bytes),
                      activation_bytes(cfg, batch, capacity, chunk, dtype_bytes), available, device)


def max_fitting_ctx(cfg: M3Config, *, batch: int, chunk: int, dtype_bytes: int, weights_loaded: bool,
                    weights: str = "dequantize") -> int:
    """Largest capacity (multiple of the block) that fits, or 0."""
    bs = cfg.text.index_block_size
    lo, hi = 0, cfg.text.max_position_embeddings // bs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan(cfg, batch=batch, capacity=mid * bs, chunk=chunk, dtype_bytes=dtype_bytes, weights_loaded=weights_loaded,
                weights=weights).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo * bs
