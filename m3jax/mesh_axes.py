"""The device mesh's axis names, a leaf every layer may import (the rules that use them are
:mod:`m3jax.sharding`'s; docs/SHARDING.md has the strategy).

One ``model`` axis carries tensor, expert and context parallelism; ``data`` splits the batch.
"""

DATA = "data"
MODEL = "model"
MESH_AXES = (DATA, MODEL)


class ShardingRuleError(ValueError):
    """A rule table that cannot shard an array (collision, unknown logical axis), or heads that do not
    split over the mesh."""
