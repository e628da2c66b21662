"""The model as Flax NNX modules: the same parameter arrays and the same functions as :mod:`m3jax.model`.

Not a second model. Each module holds its part of the :mod:`m3jax.params` tree as ``nnx.Param`` s of
the same names, shapes and dtypes, with the declared logical axes as ``out_sharding`` metadata (an
:class:`~m3jax.layers.MXFP8Weight` is an :class:`MXFP8` module of two Params, ``values`` and
``scales``), so ``nnx.state(module)`` has the paths of the functional tree. A module's call hands its
arrays to the functions the engine, the probe and training run (``model.decoder_layer``,
``vision.encode_media``, ``model.lm_head``): kernels, caches and sharding are shared, not copied, and
:func:`from_model` / :func:`to_model` move between the two fronts without copying a buffer.

Surgery. An :class:`MSA` module's ``rule`` names its layer's block-selection rule (one registered
with :func:`m3jax.msa.layer.register_selection_rule`): a subclass that sets it (or ``swap(..., MSA,
rule=name)``) changes that layer's selection in the module forward, and :func:`to_model` writes it
into the config (``TextConfig.msa_selection_rules``), so the engine (``m3jax.engine.Engine``),
``m3jax.probe`` and training run it too. A subclass that overrides ``__call__`` of an attention module
(:class:`MSA`, :class:`FullAttention`) or of an MLP module (:class:`DenseMLP`, :class:`MoE`) runs
through ``decoder_layer``'s ``attend`` / ``mlp`` hook: the module forward and :func:`generate` only
(the functional model has no place for Python code of a module). A layer of the stock calls runs the
functional path exactly. Each layer sows (``nnx.Intermediate``) its MSA block selections as
``selections`` and its MoE routing (expert ids) as ``routing``. :func:`param_group` gives the Flax
filter of a training parameter group (:func:`m3jax.params.param_labels`) for an ``nnx.Optimizer``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax.api import M3Model
from m3jax.config import STOCK_SELECTION_RULE, M3Config
from m3jax.layers import MXFP8Weight, rope_angles, rms_norm
from m3jax.model import attention, check_input_ids, decoder_layer, index_branch, lm_head, scatter_media
from m3jax.moe import dense_mlp, linear, moe_sorted, route
from m3jax.msa import layer as msa_layer
from m3jax.params import ParamSpec, param_labels, param_specs
from m3jax.vision import Grid, encode_media, vision_tower


def _param(x: jax.Array, spec: ParamSpec, path: str) -> nnx.Param:
    if tuple(x.shape) != tuple(spec.shape):
        raise ValueError(f"parameter {path}: shape {tuple(x.shape)}, the config declares {tuple(spec.shape)}")
    # eager_sharding off: the array keeps the placement it has (a sharded model is already placed by the
    # rules of m3jax.sharding; the logical axes are metadata, not a request to move it).
    return nnx.Param(x, out_sharding=spec.axes, eager_sharding=False)


class MXFP8(nnx.Module):
    """An :class:`~m3jax.layers.MXFP8Weight`: fp8 ``values`` and uint8 E8M0 ``scales``, both with the
    weight's logical axes."""

    def __init__(self, w: MXFP8Weight, spec: ParamSpec, path: str):
        w.group_axis  # noqa: B018  (a ValueError naming both shapes when the scales do not fit the values)
        self.values = _param(w.values, spec, f"{path}.values")
        self.scales = nnx.Param(w.scales, out_sharding=spec.axes, eager_sharding=False)

    def weight(self) -> MXFP8Weight:
        return MXFP8Weight(self.values[...], self.scales[...])


class Group(nnx.Module):
    """A dict of the parameter tree as attributes of the same names: arrays as ``nnx.Param``, MXFP8
    weights as :class:`MXFP8`, dicts as child modules (the class :meth:`_child` names),
    lists as ``nnx.List``. :meth:`tree` gives the dict back, holding the same arrays."""

    def _child(self, name: str) -> type:
        """The module class of the child (or list items) ``name``."""
        return Group

    def __init__(self, tree: dict, specs: dict, path: str):
        if not isinstance(tree, dict) or set(tree) != set(specs):
            got = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
            raise ValueError(f"parameters {path or '<root>'}: keys {got}, the config declares {sorted(specs)}")
        self._keys = tuple(tree)
        self._path = path
        for name, x in tree.items():
            setattr(self, name, self._node(name, x, specs[name], f"{path}.{name}" if path else name))

    def _node(self, name: str, x, spec, path: str):
        if isinstance(spec, dict):
            return self._child(name)(x, spec, path)
        if isinstance(spec, list):
            _check_list(x, spec, path)
            return nnx.List([self._child(name)(xi, si, f"{path}[{i}]")
                             for i, (xi, si) in enumerate(zip(x, spec))])
        if isinstance(x, MXFP8Weight):
            return MXFP8(x, spec, path)
        return _param(x, spec, path)

    def tree(self) -> dict:
        """The parameter dict of this module as :mod:`m3jax.model` takes it (the Params' own arrays)."""
        return {name: _value(getattr(self, name)) for name in self._keys}

    def specs(self) -> dict:
        """The :class:`~m3jax.params.ParamSpec` dict of this module's Params (shapes and logical axes)."""
        return {name: _spec(getattr(self, name)) for name in self._keys}


def _spec(node):
    if isinstance(node, nnx.Param):
        return ParamSpec(tuple(node.shape), tuple(node.get_metadata()["out_sharding"]))
    if isinstance(node, MXFP8):
        return _spec(node.values)
    if isinstance(node, nnx.List):
        return [_spec(n) for n in node]
    return node.specs()


def swap(module: Group, cls: type, *args, **kwargs) -> Group:
    """A ``cls`` module (a subclass of ``type(module)``) over ``module``'s arrays, no copy:
    ``m.text.layers[5].attn = swap(m.text.layers[5].attn, MyMSA)``. ``args`` / ``kwargs`` go to
    ``cls``'s constructor after the parameters."""
    if not issubclass(cls, type(module)):
        raise TypeError(f"swap: {cls.__name__} is not a subclass of {type(module).__name__}")
    return cls(module.tree(), module.specs(), module._path, *args, **kwargs)


def _check_list(x, spec: list, path: str) -> None:
    if not isinstance(x, (list, tuple)) or len(x) != len(spec):
        got = f"{len(x)} items" if isinstance(x, (list, tuple)) else type(x).__name__
        raise ValueError(f"parameters {path}: {got}, the config declares a list of {len(spec)}")


def _value(node):
    if isinstance(node, nnx.Param):
        return node[...]
    if isinstance(node, MXFP8):
        return node.weight()
    if isinstance(node, nnx.List):
        return [_value(n) for n in node]
    return node.tree()


class IndexBranch(Group):
    """MSA index projections ``wq [D, Hi, Hx]``, ``wk [D, Hx]`` and their norms."""

    def __call__(self, x: jax.Array, angles: jax.Array, cfg: M3Config) -> tuple[jax.Array, jax.Array]:
        """x [B, T, D] (normed) -> index queries [B, T, Hi, Hx], index keys [B, T, Hx]."""
        return index_branch(x, self.tree(), angles, cfg.text, cfg.moe_impl)


def _attention_call(self, x, lp: dict, angles, q_pos, cfg: M3Config, layer: int):
    """The layer's attention block as the model runs it (:func:`m3jax.model.attention`, no cache):
    x [B, T, D] (normed) -> (out [B, T, D], block ids int32 [B, K, T, topk] or None)."""
    out, aux, _ = attention(x, lp, angles, q_pos, cfg, layer)
    return out, aux


class FullAttention(Group):
    """Attention weights (``wq, wk, wv, wo, q_norm, k_norm``) of a full-attention layer. Its call has the
    signature of ``decoder_layer``'s ``attend`` hook; a subclass that overrides it replaces the layer's
    attention (no cache: a forward pass over the whole sequence)."""

    __call__ = _attention_call


class MSA(Group):
    """Attention weights of an MSA layer (the index branch is the layer's :class:`IndexBranch`).

    ``rule`` names the layer's block-selection rule, a rule of
    :func:`m3jax.msa.layer.register_selection_rule` (the stock top-k by default, or the one the
    model's config names for the layer): a subclass sets it, or ``swap(attn, MSA, rule=name)``. The
    layer runs the model's own MSA with that rule (:func:`m3jax.msa.layer.layer_variant`), caches
    included, and :func:`to_model` carries it to the engine and the probe. Overriding ``__call__``
    replaces the attention itself (``decoder_layer``'s hook, no cache)."""

    rule: str = STOCK_SELECTION_RULE
    __call__ = _attention_call

    def __init__(self, tree: dict, specs: dict, path: str, rule: str | None = None):
        if rule is not None:
            self.rule = rule
        super().__init__(tree, specs, path)


class DenseMLP(Group):
    """SwiGLU-OAI MLP ``gate, up [D, F]``, ``down [F, D]`` (a dense layer's, or the MoE's shared expert)."""

    def __call__(self, y: jax.Array, cfg: M3Config) -> jax.Array:
        return dense_mlp(y, self.tree(), cfg.text, cfg.moe_impl)


class MoE(Group):
    """Router (fp32 ``router [D, E]``, ``router_bias [E]``), experts ``gate, up [E, D, Fe]``,
    ``down [E, Fe, D]`` and the ``shared`` expert (:class:`DenseMLP`)."""

    def _child(self, name: str) -> type:
        return DenseMLP if name == "shared" else Group

    def route(self, y: jax.Array, cfg: M3Config) -> jax.Array:
        """Expert ids int32 [B, T, k] of y [B, T, D] (normed)."""
        return route(y.reshape(-1, y.shape[-1]), self.tree(), cfg.text)[0].reshape(*y.shape[:2], -1)

    def __call__(self, y: jax.Array, cfg: M3Config) -> jax.Array:
        b, n, d = y.shape
        return moe_sorted(y.reshape(b * n, d), self.tree(), cfg.text, impl=cfg.moe_impl).reshape(b, n, d)


def _replaced(module, stock) -> bool:
    """Whether ``module``'s call is another than ``stock`` (its class's own): a hook then runs it."""
    return type(module).__call__ is not stock


def _with_rule(cfg: M3Config, layer: int, rule: str) -> M3Config:
    """``cfg`` with ``layer``'s selection rule set to ``rule``."""
    if msa_layer.selection_rule(cfg.text, layer) == rule:
        return cfg
    rules = dict(cfg.text.msa_selection_rules)
    rules[layer] = rule
    return cfg.replace_text(msa_selection_rules=tuple(rules.items()))


class DecoderLayer(Group):
    """One decoder layer: ``input_norm``, ``post_attn_norm``, ``attn`` (:class:`MSA` or
    :class:`FullAttention`), ``index`` (:class:`IndexBranch`, MSA layers) and ``mlp`` (:class:`DenseMLP`)
    or ``moe`` (:class:`MoE`)."""

    def __init__(self, tree: dict, specs: dict, path: str, cfg: M3Config, layer: int):
        self.layer = layer
        self.sparse = cfg.text.is_sparse_attention(layer)
        self._rule = msa_layer.selection_rule(cfg.text, layer)  # read while ``attn`` is built
        super().__init__(tree, specs, path)

    def _node(self, name: str, x, spec, path: str):
        if name == "attn" and self.sparse:
            return MSA(x, spec, path, rule=self._rule)
        return super()._node(name, x, spec, path)

    def _child(self, name: str) -> type:
        if name == "attn":
            return MSA if self.sparse else FullAttention
        return {"index": IndexBranch, "mlp": DenseMLP, "moe": MoE}.get(name, Group)

    def __call__(self, h, angles, q_pos, cfg: M3Config, kv=None, page_table=None):
        """h [B, T, D] -> (h, kv) through :func:`m3jax.model.decoder_layer`, with the selection rule of
        this layer's :class:`MSA` module; sows ``selections`` (MSA layers: int32 [B, K, T, k]) and
        ``routing`` (MoE layers: int32 [B, T, experts per token])."""
        if self.sparse:
            cfg = _with_rule(cfg, self.layer, self.attn.rule)
        attend = self.attn if _replaced(self.attn, _attention_call) else None
        moe = getattr(self, "moe", None)
        block = moe if moe is not None else self.mlp
        stock = (MoE if moe is not None else DenseMLP).__call__
        mlp = (lambda y, lp, cfg_, layer: block(y, cfg_)) if _replaced(block, stock) else None
        if (attend is not None or mlp is not None) and kv is not None:
            raise ValueError(f"layer {self.layer}: a replaced module call runs without a cache (decoder_layer's "
                             "attend / mlp hooks)")
        observe = None if moe is None else (lambda y: moe.route(y, cfg))
        h, aux, kv = decoder_layer(h, self.tree(), angles, q_pos, cfg, self.layer, kv, page_table, attend, observe,
                                   mlp)
        if moe is not None:
            aux, routing = aux
            self.sow(nnx.Intermediate, "routing", routing)
        if aux is not None:
            self.sow(nnx.Intermediate, "selections", aux)
        return h, kv


class TextDecoder(Group):
    """``embed [V, D]``, ``lm_head [D, V]``, ``final_norm [D]`` and the ``layers`` (:class:`DecoderLayer`)."""

    def __init__(self, tree: dict, specs: dict, path: str, cfg: M3Config):
        self.config = cfg  # read while the layers are built (which are MSA layers)
        super().__init__(tree, specs, path)

    def _node(self, name: str, x, spec, path: str):
        if name != "layers":
            return super()._node(name, x, spec, path)
        _check_list(x, spec, path)
        return nnx.List([DecoderLayer(xi, si, f"{path}[{i}]", self.config, i)
                         for i, (xi, si) in enumerate(zip(x, spec))])

    def __call__(self, embeds: jax.Array, positions: jax.Array, cfg: M3Config, cache=None, page_table=None):
        """embeds [B, T, D] at positions [B, T] -> (fp32 logits [B, T, V], cache): the layer loop of
        :func:`m3jax.model.text_hidden`, through this module's layers."""
        t = cfg.text
        angles = rope_angles(positions, t.rotary_dim, t.rope_theta)
        h, new_layers = embeds, []
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                h, kv = layer(h, angles, positions, cfg, None if cache is None else cache.layers[i], page_table)
            new_layers.append(kv)
        if cache is not None:
            cache = type(cache)(new_layers, cache.page_table)
        h = rms_norm(h, self.final_norm[...], t.rms_norm_eps)
        return lm_head({"text": {"lm_head": self.lm_head[...]}}, h), cache


class VisionTower(Group):
    """The ViT: ``patch_embed`` (fp32), ``pre_ln`` and its ``layers``."""

    def __call__(self, pixel_values: jax.Array, grid: Grid, cfg: M3Config) -> jax.Array:
        """[N, C*Tp*P*P] -> last hidden state [N, Dv] (:func:`m3jax.vision.vision_tower`)."""
        return vision_tower(pixel_values, grid, self.tree(), cfg.vision)


class Projector(Group):
    """A two-layer GELU MLP ``w1, b1, w2, b2``: the per-patch ``projector`` or the 2x2 ``merger``
    (:func:`m3jax.vision.project_and_merge` runs both)."""


class M3(nnx.Module):
    """MiniMax-M3: ``text`` (:class:`TextDecoder`) and, with a vision config, ``vision``
    (:class:`VisionTower`), ``projector`` and ``merger`` (:class:`Projector`). Built by
    :func:`from_model`; ``config`` and ``mesh`` are the model's (the layers' selection rules live in their
    :class:`MSA` modules: :func:`config_of` gives the config that names them)."""

    def __init__(self, params: dict, config: M3Config, mesh=None):
        specs = param_specs(config)
        if not isinstance(params, dict) or set(params) != set(specs):
            got = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ValueError(f"parameters: top-level keys {got}, the config declares {sorted(specs)}")
        self.config = config
        self.mesh = mesh
        self.text = TextDecoder(params["text"], specs["text"], "text", config)
        if config.vision is not None:
            self.vision = VisionTower(params["vision"], specs["vision"], "vision")
            self.projector = Projector(params["projector"], specs["projector"], "projector")
            self.merger = Projector(params["merger"], specs["merger"], "merger")

    def tree(self) -> dict:
        """The parameter tree of :mod:`m3jax.params` (the Params' own arrays)."""
        names = ("text",) if self.config.vision is None else ("text", "vision", "projector", "merger")
        return {name: getattr(self, name).tree() for name in names}

    def __call__(self, input_ids: jax.Array, pixel_values=None, image_grid: Grid | None = None,
                 pixel_values_videos=None, video_grid: Grid | None = None) -> jax.Array:
        """input_ids int [B, T] (+ media as :func:`m3jax.model.multimodal_forward`) -> fp32 logits [B, T, V];
        selections and routing are sown. Positions 0..T-1 for every token (M3 has no M-RoPE)."""
        cfg = self.config
        embeds = self.text.embed[...][input_ids]
        for pixels, grid, token in ((pixel_values, image_grid, cfg.image_token_id),
                                    (pixel_values_videos, video_grid, cfg.video_token_id)):
            if pixels is not None:
                params = {name: getattr(self, name).tree() for name in ("vision", "projector", "merger")}
                embeds = scatter_media(embeds, input_ids, token, encode_media(pixels, grid, params, cfg)[1])
        b, n = input_ids.shape
        positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
        return self.text(embeds, positions, cfg)[0]


def from_model(model: M3Model | dict, config: M3Config | None = None) -> M3:
    """An :class:`M3` over the arrays of ``model`` (an :class:`~m3jax.M3Model`, or a parameter tree and
    its ``config``): no array is copied. ValueError naming the parameter whose keys or shape differ
    from the config's declaration."""
    if isinstance(model, M3Model):
        if config is not None and config != model.config:
            raise ValueError("from_model: config given with an M3Model that holds another config")
        return M3(model.params, model.config, model.mesh)
    if config is None:
        raise ValueError("from_model: a parameter tree needs its config")
    return M3(model, config)


def config_of(module: M3) -> M3Config:
    """``module``'s config with the selection rules of its :class:`MSA` modules
    (``TextConfig.msa_selection_rules``): the config the functional model runs the module's layers with."""
    rules = tuple((i, layer.attn.rule) for i, layer in enumerate(module.text.layers) if layer.sparse)
    return module.config.replace_text(msa_selection_rules=rules)


def to_model(module: M3) -> M3Model:
    """The :class:`~m3jax.M3Model` of ``module``'s arrays (no copy), mesh and :func:`config_of` config, for
    :func:`m3jax.forward`, the engine and the probe: swapped MSA selection rules travel; a module whose
    call is replaced (``decoder_layer``'s ``attend`` / ``mlp`` hooks) does not, and those paths run
    the layer's stock call there."""
    return M3Model(config_of(module), module.tree(), module.mesh)


def apply(module: M3, input_ids, pixel_values=None, image_grid: Grid | None = None, pixel_values_videos=None,
          video_grid: Grid | None = None) -> tuple[jax.Array, nnx.State]:
    """``module(input_ids, ...)`` under one ``jax.jit``: (fp32 logits [B, T, V], the sown intermediates).

    The parameters go in as ``nnx.split`` gives them and nothing is written back (``nnx.jit`` by default
    writes every Variable back from the program's outputs: a new buffer for each weight per call).
    ``nnx.jit(..., graph_updates=False)`` does the same."""
    graphdef, state = nnx.split(module)
    return _apply(graphdef, state, jnp.asarray(input_ids, jnp.int32), pixel_values, image_grid, pixel_values_videos,
                  video_grid)


@functools.partial(jax.jit, static_argnames=("graphdef", "image_grid", "video_grid"))
def _apply(graphdef, state, input_ids, pixel_values, image_grid, pixel_values_videos, video_grid):
    return nnx.capture(nnx.merge(graphdef, state), nnx.Intermediate)(input_ids, pixel_values, image_grid,
                                                                    pixel_values_videos, video_grid)


def generate(module: M3, input_ids, max_new_tokens: int) -> np.ndarray:
    """Greedy continuation of ``input_ids`` (int [B, T]) through the module, replaced layers included:
    int32 [B, max_new_tokens].

    No cache: each step runs the whole forward over one [B, T + max_new_tokens] buffer (one compiled
    program), which is exact because every part of the model is causal per token (attention and MSA
    selection see positions up to the query's, the MoE routes each token alone), so the slots after a
    position do not change its logits. For research on small models; the engine
    (``m3jax.engine.Engine`` over ``to_model(module)``) serves the model with its paged caches,
    selection rules included, but not replaced module calls."""
    ids = check_input_ids(input_ids, module.config.text)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: need at least 1")
    b, t = ids.shape
    buf = np.zeros((b, t + max_new_tokens), np.int32)
    buf[:, :t] = ids
    graphdef, state = nnx.split(module)
    return np.asarray(_greedy(graphdef, state, jnp.asarray(buf), t))[:, t:]


@functools.partial(jax.jit, static_argnames=("graphdef", "start"))
def _greedy(graphdef, state, buf, start):
    def step(pos, buf):
        logits, _ = nnx.capture(nnx.merge(graphdef, state), nnx.Intermediate)(buf)
        nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, pos - 1, axis=1, keepdims=False), axis=-1)
        return jax.lax.dynamic_update_index_in_dim(buf, nxt.astype(buf.dtype), pos, axis=1)

    return jax.lax.fori_loop(start, buf.shape[1], step, buf)


def selections(intermediates: nnx.State) -> dict[int, jax.Array]:
    """``{layer: int32 [B, K, T, k]}`` from the intermediates ``nnx.capture(module, nnx.Intermediate)`` (or
    :func:`apply`) returned."""
    return _sown(intermediates, "selections")


def routing(intermediates: nnx.State) -> dict[int, jax.Array]:
    """``{layer: int32 [B, T, experts per token]}`` (MoE layers) from captured intermediates."""
    return _sown(intermediates, "routing")


def _sown(intermediates: nnx.State, name: str) -> dict[int, jax.Array]:
    layers = nnx.to_pure_dict(intermediates).get("text", {}).get("layers", {})
    return {int(i): v[name][-1] for i, v in sorted(layers.items()) if name in v}


def param_group(*groups: str) -> Any:
    """A Flax filter of the ``nnx.Param`` s in ``m3jax.train``'s parameter groups (``"main"``, ``"index"``,
    ``"frozen"``: :func:`m3jax.params.param_labels` decides each path), e.g.
    ``nnx.Optimizer(m, tx, wrt=param_group("index"))`` trains the indexer alone."""
    unknown = set(groups) - {"main", "index", "frozen"}
    if unknown:
        raise ValueError(f"param_group: unknown group(s) {sorted(unknown)}; choose main, index, frozen")

    def in_group(path, x) -> bool:
        if not isinstance(x, nnx.Param):
            return False
        tree = 0  # the path as a one-leaf tree, labelled by train's own rule
        for key in reversed(path):
            tree = {key: tree}
        return jax.tree.leaves(param_labels(tree))[0] in groups

    return in_group
