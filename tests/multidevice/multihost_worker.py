"""One process of a (possibly multi-process) run on simulated CPU devices, for tests/test_distributed.py:

    python -m tests.multidevice.multihost_worker CKPT OUT.npz --local-devices 2 --mesh 1x4 \\
        [--coordinator HOST:PORT --num-processes N --process-id I]

Loads the checkpoint straight into its shards on one mesh over every process's devices (each process
reads only its own devices' slices) and generates greedily with the engine, keeping the logits of
every step, then probes the prompt (MSA block selections). Process 0 writes OUT.npz: generated ids, step logits, and each process's loaded bytes
(the distinct slices its devices hold) next to the whole model's bytes. ``--mesh 1x1``: the plain one-device
path, no mesh.
"""

from __future__ import annotations

import argparse
import sys

import jax

if __name__ == "__main__":
    _n = int(sys.argv[sys.argv.index("--local-devices") + 1])
    jax.config.update("jax_num_cpu_devices", _n)
    jax.config.update("jax_cpu_enable_async_dispatch", False)

import numpy as np  # noqa: E402

import m3jax  # noqa: E402
from m3jax import cli, distributed, sharding  # noqa: E402
from m3jax.engine import Engine, SamplingParams  # noqa: E402
from m3jax.generate import mesh_shape  # noqa: E402
from m3jax.probe import probe  # noqa: E402

PROMPT = [5, 17, 3, 44, 9, 21, 60, 2, 33, 12, 7, 80, 15]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--local-devices", type=int, required=True)
    ap.add_argument("--mesh", type=mesh_shape, required=True)
    ap.add_argument("--max-new-tokens", type=int, default=3)
    ap.add_argument("--quiet", action="store_true")
    cli.add_distributed_arguments(ap)
    args = ap.parse_args(argv)
    distributed.initialize(args)
    print("joined", flush=True)  # tests/test_distributed.py waits for it before killing a process
    data, model = args.mesh
    mesh = None if data * model == 1 else sharding.make_mesh(data * model, data=data)
    m = m3jax.load_pretrained(args.checkpoint, dtype="float32", attention_impl="reference", progress=False, mesh=mesh)
    engine = Engine(m.params, m.config, batch=1, capacity=32, prefill_chunk=16, mesh=mesh, decode_steps_per_call=2)
    r = engine.generate([PROMPT], max_new_tokens=args.max_new_tokens, sampling=SamplingParams(temperature=0.0),
                        keep_logits=True)
    ids = r.generated[0]
    # probe (the notebooks' API) on the same mesh: every process gets the whole result
    pr = probe(m, np.asarray([PROMPT]), query_chunk=16, share_compilation=True)
    sel = np.stack([pr.layers[i].block_indices for i in sorted(pr.layers) if pr.layers[i].block_indices is not None])
    distributed.check_same("generated ids", ids)
    # This process's distinct slices (its devices may hold copies of one replicated slice).
    mine = sum(s.data.nbytes for leaf in jax.tree.leaves(m.params)
               for s in {str(s.index): s for s in leaf.addressable_shards}.values())
    whole = sum(leaf.nbytes for leaf in jax.tree.leaves(m.params))
    loaded = _gather_ints(mine)
    if distributed.is_voice():
        np.savez(args.out, ids=np.asarray(ids), logits=np.stack(r.step_logits), selections=sel, loaded_bytes=np.asarray(loaded),
                 model_bytes=whole)


def _gather_ints(x: int) -> list[int]:
    """Every process's ``x`` (one collective over the processes)."""
    if jax.process_count() == 1:
        return [x]
    from jax.experimental import multihost_utils

    return [int(v) for v in multihost_utils.process_allgather(np.int64(x))]


if __name__ == "__main__":
    main()
