"""Regional compilation of a transformers model: one graph per decoder-layer kind, not per layer.

``torch.compile(model)`` traces every decoder layer of the model into one graph: its compile time
grows with the depth (a tiny 3-layer GLM-5.3-Flash took 81 s under ``aot_eager``).
:func:`compile_layers` compiles each decoder layer on its own instead (``layer.compile``).
Dynamo caches compiled graphs per code object and guards them on the module's structure, not its
identity (parameters are graph inputs), so every layer of one kind runs the graph the first one
compiled; a model compiles once per *kind* (e.g. GLM-5.3-Flash: KDA + dense MLP, KDA + MoE,
indexed MLA + MoE), whatever its depth. Embeddings, the final norm and the head stay eager (a few
per-token ops)::

    model = fcp.integrations.hf.enable_packed_cp(model)
    model = fcp.integrations.hf.compile_layers(model, fullgraph=True, dynamic=False)
    out = model(input_ids=local["input_ids"], cp_context=ctx)

**The recompile limit.** All of a model's layer kinds, and every shape each is specialised for,
are cache entries of *one* frame: transformers wraps every decoder layer class's ``forward`` in
the same function (``GradientCheckpointingLayer``), so even different layer classes share it.
Dynamo keeps ``torch._dynamo.config.recompile_limit`` (8) entries per frame and runs the layers
beyond it eagerly, with a warning only. A layer kind takes one entry per row length it is compiled
for (``dynamic=False``: one per distinct length; the default: a static one, then a dynamic one),
so keep ``kinds x lengths`` within the limit: pad rows to a few lengths
(:func:`fcp.shard_batch`'s ``pad_to``) or raise the limit for your run, without changing it for
the whole process::

    with torch._dynamo.config.patch(recompile_limit=32):
        trainer.train()

:func:`compile_layers` itself raises if the kinds alone exceed the limit.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["compile_layers", "decoder_layers", "layer_kinds"]

#: attributes that number a layer (every layer holds its own value): left out of a layer's kind.
#: A layer whose forward reads one compiles a graph per layer; such a model gains nothing here.
_INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number"})


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``[(qualified name, layer)]`` of ``model``'s repeated decoder layers, in module order.

    The layers are the items of the outermost ``nn.ModuleList`` s (those not inside another
    ``ModuleList``) whose items are all transformers decoder layers (``GradientCheckpointingLayer``,
    the base class of every transformers decoder layer: a vision-language model's vision blocks
    count too); without any, the longest outermost ``ModuleList`` of ``nn.Module`` s with
    parameters (the layers of a model not written with transformers). Raises ``ValueError``
    naming ``model``'s class if it holds no ``ModuleList``.
    """
    lists = _outermost_module_lists(model)
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # fcp does not depend on transformers: the generic rule alone
        GradientCheckpointingLayer = None
    if GradientCheckpointingLayer is not None:
        hf = [(name, ml) for name, ml in lists
              if all(isinstance(m, GradientCheckpointingLayer) for m in ml)]  # fmt: skip
        if hf:
            return [(_join(name, str(i)), m) for name, ml in hf for i, m in enumerate(ml)]
    lists = [(name, ml) for name, ml in lists
             if all(next(m.parameters(), None) is not None for m in ml)]  # fmt: skip
    if not lists:
        raise ValueError(
            f"compile_layers: {type(model).__name__} holds no nn.ModuleList of decoder layers "
            "(transformers models keep them in one, e.g. model.layers); pass the layers "
            "(layers=...), or compile the model or its modules yourself"
        )
    name, ml = max(lists, key=lambda item: len(item[1]))  # the first of the longest
    return [(_join(name, str(i)), m) for i, m in enumerate(ml)]


def layer_kinds(layers: Iterable[nn.Module]) -> list[list[int]]:
    """The kinds of ``layers``: lists of indices into ``layers`` (in order of first appearance)
    whose layers have the same structure: the same module classes at the same names, parameters
    and buffers of the same names, shapes, dtypes and ``requires_grad``, and the same plain
    attribute values (numbers, strings, booleans, ``None`` and tuples of them, e.g.
    ``block_type="linear_attention"``, a sliding window), except layer numbers
    (``layer_idx``, ...).

    Layers of one kind trace to the same graph under Dynamo, so this is a lower bound on the
    graphs :func:`compile_layers` compiles per input shape: a forward that reads something else
    that differs (a layer number, a non-plain attribute) compiles more.
    """
    kinds: dict[tuple, list[int]] = {}
    for i, layer in enumerate(layers):
        kinds.setdefault(_structure(layer), []).append(i)
    return list(kinds.values())


def compile_layers(model: nn.Module, *, layers: Iterable[nn.Module] | None = None,
                   **compile_kwargs) -> nn.Module:  # fmt: skip
    """Compile each of ``model``'s decoder layers on its own, in place; return ``model``.

    Each layer gets ``layer.compile(**compile_kwargs)`` (``nn.Module.compile``, torch's own
    in-place API: the layer stays the same object, so parameters, state-dict keys, optimizers
    and FSDP wrapping are untouched), so layers of one kind share one graph (the module doc).
    ``compile_kwargs`` are :func:`torch.compile`'s (``backend``, ``fullgraph``, ``dynamic``,
    ``mode``, ``options``). ``layers``: the modules to compile, by default
    :func:`decoder_layers` of ``model``. Call it after
    :func:`~fcp.integrations.hf.enable_packed_cp` (the compiled layers then trace fcp's mixers).
    ``nn.Module.compile`` compiles a layer's whole call, its forward hooks included (FSDP2's
    ``fully_shard`` hooks too, whichever comes first; not exercised by fcp's tests).

    Raises ``ValueError`` if ``model`` holds no decoder layers (naming its class), and if the
    layers' kinds (:func:`layer_kinds`) outnumber ``torch._dynamo.config.recompile_limit``:
    Dynamo would run the layers of the kinds beyond it eagerly (the module doc says how to raise
    the limit for a run).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_layers: model must be an nn.Module, got {type(model).__name__}")
    if layers is None:
        named = decoder_layers(model)
    else:
        named = [(f"layers[{i}]", m) for i, m in enumerate(layers)]
        bad = [f"{n} ({type(m).__name__})" for n, m in named if not isinstance(m, nn.Module)]
        if not named or bad:
            raise ValueError(f"compile_layers: layers must be a non-empty iterable of "
                             f"nn.Modules; got {bad or 'none'}")  # fmt: skip
    kinds = layer_kinds(m for _, m in named)
    limit = torch._dynamo.config.recompile_limit
    if len(kinds) > limit:
        listed = "; ".join(f"{type(named[k[0]][1]).__name__} x {len(k)} (first: {named[k[0]][0]})"
                           for k in kinds)  # fmt: skip
        raise ValueError(
            f"compile_layers: {type(model).__name__} has {len(kinds)} kinds of decoder layers "
            f"({listed}), more than torch._dynamo.config.recompile_limit={limit} graphs of one "
            "frame: the layers of the kinds beyond it would run eagerly. Raise the limit for "
            f"the run, e.g. `with torch._dynamo.config.patch(recompile_limit={2 * len(kinds)}):` "
            "around compile_layers and training (one entry per kind and row length)"
        )
    for _, layer in named:
        layer.compile(**compile_kwargs)
    return model


def _outermost_module_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    found: list[tuple[str, nn.ModuleList]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        if isinstance(module, nn.ModuleList):
            if len(module):
                found.append((prefix, module))
            return  # lists inside a list (a layer's experts) are not the model's layers
        for name, child in module.named_children():
            visit(_join(prefix, name), child)

    visit("", model)
    return found


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _plain(value) -> bool:
    # exact types: Dynamo guards these by value (a subclass, e.g. core's name stacks, it does not)
    return type(value) in (type(None), bool, int, float, str) or (
        type(value) is tuple and all(_plain(v) for v in value))


def _structure(layer: nn.Module) -> tuple:
    """What Dynamo's guards see of ``layer``: classes, tensor metadata, plain attributes."""
    parts = []
    for name, module in layer.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(module).items()
                             if not k.startswith("_") and k not in _INDEX_ATTRIBUTES
                             and _plain(v)))  # fmt: skip
        tensors = tuple((k, tuple(t.shape), t.dtype, t.requires_grad)
                        for k, t in [*module._parameters.items(), *module._buffers.items()]
                        if t is not None)  # fmt: skip
        parts.append((name, type(module), attrs, tensors))
    return tuple(parts)
