"""One process of a (possibly multi-process) run on simulated CPU devices, for tests/test_distributed.py:

    python -m tests.multidevice.multihost_worker CKPT OUT.npz --local-devices 4 --meshes 1x8,2x4 \\
        [--coordinator HOST:PORT --num-processes N --process-id I]

For each ``data x model`` mesh of ``--meshes`` in turn (one process start-up and one checkpoint read
amortised over all of them), on one mesh over every process's devices:

* loads the checkpoint straight into its shards (each process reads only its own devices' slices);
* generates greedily with the engine, keeping the logits of every step, with the prefill in chunks
  small enough that the MSA layers run context parallel over the page-split cache (counted);
* probes the prompt (the MSA block selections);
* trains 2 steps (sparse mode, data parallel over the mesh's ``data`` axis), saves the state with
  orbax (every process writes its shards) and reads the saved weights back.

Process 0 writes OUT.npz with ``MESH/KEY`` entries: generated ids, step logits, selections, the
context-parallel prefill calls, the 2 losses, every saved weight (``MESH/w/PATH``), and each process's
loaded bytes (the distinct slices its devices hold) next to the whole model's bytes. ``--meshes 1x1``:
the plain one-device path, no mesh.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import jax

if __name__ == "__main__":
    _n = int(sys.argv[sys.argv.index("--local-devices") + 1])
    jax.config.update("jax_num_cpu_devices", _n)
    jax.config.update("jax_cpu_enable_async_dispatch", False)

import numpy as np  # noqa: E402
import optax  # noqa: E402

import m3jax  # noqa: E402
from m3jax import cli, distributed, sharding, train  # noqa: E402
from m3jax.engine import Engine, SamplingParams  # noqa: E402
from m3jax.generate import mesh_shape  # noqa: E402
from m3jax.msa import parallel  # noqa: E402
from m3jax.probe import probe  # noqa: E402

PROMPT = [5, 17, 3, 44, 9, 21, 60, 2, 33, 12, 7, 80, 15]
# Prefill chunks of 8 queries against the 32-key window: context parallel by the traffic rule of
# m3jax.msa.parallel.prefill_context_parallel (the window's keys outweigh the chunk's queries).
PREFILL_CHUNK = 8
TRAIN_STEPS = 2
TRAIN_BATCH = np.random.default_rng(4).integers(0, 90, (2, 17))  # 2 rows: they split over data = 2


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--local-devices", type=int, required=True)
    ap.add_argument("--meshes", type=lambda s: [mesh_shape(x) for x in s.split(",")], required=True)
    ap.add_argument("--max-new-tokens", type=int, default=3)
    ap.add_argument("--train", action="store_true", help="also train 2 steps and save them with orbax")
    ap.add_argument("--quiet", action="store_true")
    cli.add_distributed_arguments(ap)
    args = ap.parse_args(argv)
    distributed.initialize(args)
    print("joined", flush=True)  # tests/test_distributed.py waits for it before killing a process
    out = {}
    for data, model in args.meshes:
        name = f"{data}x{model}"
        mesh = None if data * model == 1 else sharding.make_mesh(data * model, data=data)
        out.update({f"{name}/{k}": v for k, v in run_mesh(args, mesh, name).items()})
    if distributed.is_voice():
        np.savez(args.out, **out)


def run_mesh(args, mesh, name: str) -> dict:
    """Everything compared on one mesh (None: one device); every process returns the same values."""
    m = m3jax.load_pretrained(args.checkpoint, dtype="float32", attention_impl="reference", progress=False, mesh=mesh)
    engine = Engine(m.params, m.config, batch=1, capacity=32, prefill_chunk=PREFILL_CHUNK, mesh=mesh,
                    decode_steps_per_call=2)
    with _context_parallel_prefills() as seen:
        r = engine.generate([PROMPT], max_new_tokens=args.max_new_tokens, sampling=SamplingParams(temperature=0.0),
                            keep_logits=True)
    ids = r.generated[0]
    # probe (the notebooks' API) on the same mesh: every process gets the whole result
    pr = probe(m, np.asarray([PROMPT]), query_chunk=16, share_compilation=True)
    sel = np.stack([pr.layers[i].block_indices for i in sorted(pr.layers) if pr.layers[i].block_indices is not None])
    distributed.check_same(f"generated ids on {name}", ids)
    # This process's distinct slices (its devices may hold copies of one replicated slice).
    mine = sum(s.data.nbytes for leaf in jax.tree.leaves(m.params)
               for s in {str(s.index): s for s in leaf.addressable_shards}.values())
    res = {"ids": np.asarray(ids), "logits": np.stack(r.step_logits), "selections": sel,
           "context_parallel_prefills": seen["prefill"], "loaded_bytes": np.asarray(_gather_ints(mine)),
           "model_bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(m.params))}
    if args.train:
        res.update(train_steps(m, mesh, Path(args.out).with_suffix(f".{name}")))
    return res


def optimizer():
    """Plain AdamW at a fixed rate: train.make_optimizer's warm-up starts at rate 0, and 2 steps would
    compare one update only."""
    return optax.adamw(1e-2)


def train_steps(m, mesh, work: Path) -> dict:
    """TRAIN_STEPS steps of m3jax.train's step from the loaded weights, saved with orbax (a
    multi-process save: each process writes its shards) and restored: the losses and saved weights."""
    tx = optimizer()
    state = train.init_state(m.params, tx)
    step = train.make_train_step(m.config, tx, "sparse", mesh=mesh)
    losses = []
    for _ in range(TRAIN_STEPS):
        state, metrics = step(state, {"tokens": TRAIN_BATCH})
        losses.append(float(metrics["loss"]))
    mngr = train.checkpoint_manager(work.absolute())
    train.save_state(mngr, state)
    saved = train.restore_state(mngr, state)
    weights = {f"w/{jax.tree_util.keystr(path)}": distributed.to_host(x)
               for path, x in jax.tree_util.tree_leaves_with_path(saved.params)}
    return {"losses": np.asarray(losses), **weights}


class _context_parallel_prefills:
    """Counts, as the engine is traced, the MSA prefill chunks that run context parallel over the mesh."""

    def __enter__(self):
        self.seen, self.saved = collections.Counter(), parallel.context_parallel

        def counted(local, *a, **k):
            if local.scores is not None and local.keys is parallel.local_window:
                self.seen["prefill"] += 1
            return self.saved(local, *a, **k)

        parallel.context_parallel = counted
        return self.seen

    def __exit__(self, *exc):
        parallel.context_parallel = self.saved


def _gather_ints(x: int) -> list[int]:
    """Every process's ``x`` (one collective over the processes)."""
    if jax.process_count() == 1:
        return [x]
    from jax.experimental import multihost_utils

    return [int(v) for v in multihost_utils.process_allgather(np.int64(x))]


if __name__ == "__main__":
    main()
