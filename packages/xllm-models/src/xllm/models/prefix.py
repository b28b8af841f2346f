"""Truncated views of a decoder model (``--speculative self``: xllm.core.spec.selfspec).

A view is a second module object of the model's class whose ``model.layers`` are the model's first
``num_layers`` decoder layers and whose config says ``num_layers``: it runs those layers, then the
model's final norm and LM head. Every submodule (so every weight tensor, and every packed copy the
layers made of them) is the model's own; only the two module objects and their child tables are
new. Attention layer ``i`` of the view writes KV layer ``i`` of the view's cache, as in the model.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TypeVar

from torch import nn

M = TypeVar("M", bound=nn.Module)


def _shallow(module: M) -> M:
    """A new module object sharing ``module``'s attributes and children, with tables of its own
    (so replacing a child of the copy leaves ``module`` as it was)."""
    view = copy.copy(module)
    view._modules = dict(module._modules)
    view._parameters = dict(module._parameters)
    view._buffers = dict(module._buffers)
    return view


def layer_prefix_view(model: M, num_layers: int) -> M:
    """The view of ``model``'s first ``num_layers`` layers (``model`` has ``cfg`` with
    ``num_layers``, and ``model.layers``/``embed_tokens``/``norm`` under ``model.model``)."""
    total = len(model.model.layers)
    if not 1 <= num_layers <= total:
        raise ValueError(f"a layer prefix needs 1..{total} layers, got {num_layers}")
    inner = _shallow(model.model)
    inner.layers = nn.ModuleList(list(model.model.layers)[:num_layers])
    view = _shallow(model)
    view.model = inner
    view.cfg = dataclasses.replace(model.cfg, num_layers=num_layers)
    return view
