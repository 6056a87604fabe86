"""Prefix tuning's head map (``register_peft_method(head_params=...)``): which columns of the prompt embedding
belong to which attention head, for head pruning (:mod:`fedpeft.heads.layout` holds the geometry and the maps
several methods share)."""

from __future__ import annotations

from collections.abc import Mapping

from fedpeft.heads.layout import PROMPT_EMBEDDING_SUFFIX, HeadGeometry, HeadParam, LayoutError


def prefix_head_params(spec: Mapping[str, tuple[tuple[int, ...], str]], geo: HeadGeometry) -> dict[str, HeadParam]:
    """Prefix tuning without projection: each layer's key and value prefix dims, per key/value head."""
    name = next((n for n in spec if n.endswith(PROMPT_EMBEDDING_SUFFIX)), None)
    if name is None:
        return {}
    pshape = tuple(spec[name][0])
    kv_dim = geo.kv_dim
    layers = pshape[1] // (2 * kv_dim)
    if layers * 2 * kv_dim != pshape[1]:
        raise LayoutError(f"{name}: {pshape[1]} prefix dims do not split into layers x key/value x "
                          f"{kv_dim}; prefix projection is not head-mapped (set peft.projection false)")
    prefix = "decoder.self" if geo.encoder_decoder else "self"
    units = []
    for layer in range(layers):
        mod = geo.module_index(f"{prefix}.{layer}")
        for kind in range(2):
            units += geo.rows(mod, "k", (2 * layer + kind) * kv_dim)
    return {name: HeadParam(name, pshape, 1, units)}
