"""How a transformers token mixer becomes an fcp mixer, and the guard that keeps it on the CP path.

**Replacement by class swap** (the mechanism of FSDP2's ``fully_shard``). :func:`replace` keeps
the module object and sets its class to ``Packed<HFClass>``, a subclass of the mixer's fcp class
(an *adapter*, see :mod:`fcp.integrations.hf.mixers`) and of the transformers class::

    Packed<HFClass>  ->  adapter -> mixer kind -> FcpMixer  ->  HFClass -> nn.Module

Nothing is copied and nothing falls through: the module keeps its own parameters, buffers,
submodules and attributes (the same objects, so optimizers, state-dict keys, checkpoints and
FSDP2 stay valid), and every transformers method comes by ordinary inheritance.
:meth:`FcpMixer.forward` given a ``cp_context`` runs the fcp path (``fcp_forward``); without
one it calls ``super().forward``, transformers' own code. One class is made per (adapter,
transformers class) and reused (:func:`packed_class`), so all layers of a kind share one type and
a compiled mixer is not recompiled per layer.

The class adds methods only (``forward``, ``__call__``, ``__reduce_ex__`` and names starting
with ``fcp_``); the instance gains one attribute, ``fcp_expected_by`` (below).

**The guard** (:class:`ContextScope`). If a decoder layer stops forwarding ``cp_context``
through its ``**kwargs``, its mixer would silently run transformers' non-CP code on a packed
(and, under CP, sharded) batch. :func:`enable_packed_cp <fcp.integrations.hf.enable_packed_cp>`
therefore registers on the model it is given, and on every ``PreTrainedModel`` inside it that
holds replaced mixers, a forward pre-hook and an always-called forward hook. While a forward
given a ``cp_context`` runs, every replaced mixer of that model holds its qualified name in
``fcp_expected_by`` (a stack, so nested models and exceptions leave it as it was), and a mixer
called without a context meanwhile raises a ``ValueError`` naming itself and its decoder layer.
The same pre-hook rejects a KV cache: ``use_cache=True`` or a ``cache`` / ``past_key_values``
together with a ``cp_context`` raise (fcp runs full packed sequences; an omitted ``use_cache``
becomes ``False``). It also rejects image and video inputs (``pixel_values``, ``image_grid_thw``,
... of Qwen3.5's ``*ForConditionalGeneration``, by keyword or position): transformers would run
the vision encoder on them, scatter its embeddings into the text and give those tokens 3-D mRoPE
positions, none of which fcp shards yet; text-only calls of such a wrapper run on fcp.

**Unreplaced mixers** (:class:`UnreplacedGuard`). A module that mixes tokens and is not an fcp
mixer (:mod:`.coverage` finds them) would run its non-CP code on the packed, sharded batch;
``enable_packed_cp`` refuses such a model unless ``allow_unreplaced=True``, and then gives each
one a forward pre-hook that the same scopes mark: called while a forward given a ``cp_context``
runs, the module raises a ``ValueError`` naming itself. The mark lives in the hook; the module's
class and attributes are untouched.

The check runs in :meth:`FcpMixer.__call__`, outside a mixer compiled with
``mixer.compile(...)`` (which compiles ``_call_impl``): a compiled mixer never guards on the mark
and does not recompile when it changes.

**The context is checked once, where it enters.** A forward given a ``cp_context`` checks it
(its type, no KV cache, text only) in the scope's pre-hook; the mixers it reaches, marked by
that scope, take it as checked. A mixer called with a context outside an enabled model's forward
(an attention layer used on its own) is its own entry point and checks it in its ``__call__``.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn

from fcp.context import PackedContext, check_context

__all__ = ["MULTIMODAL_INPUTS", "ContextScope", "FcpMixer", "NoMasks", "UnreplacedGuard",
           "fcp_class", "packed_class", "positional_parameters", "replace"]

#: A model forward's image / video arguments, refused with a ``cp_context``: under CP a vision
#: tower would see every rank's image while the rank holds a shard of its placeholder tokens, and
#: their mRoPE positions (3-D, not document-local) would be dropped.
MULTIMODAL_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw",
                     "mm_encoder_outputs")  # fmt: skip


class NoMasks(dict):
    """transformers' per-layer-type mask mapping, empty: every layer type gets ``None``. Given as
    ``attention_mask`` under a ``cp_context``, it keeps a model from building masks that fcp's
    mixers never read (transformers' text models take a ready mapping as it is)."""

    #: transformers' recurrent models ask a mask for its rank (``create_recurrent_attention_mask``
    #: keeps only a 2-D one): no rank of 2, so none is made
    ndim = 0

    def __missing__(self, key):
        return None

    def values(self):
        # DeepSeek-V4 reads a ready mapping's first value as "the" mask (next(iter(values())));
        # one None, which fcp's mixers never read
        return [None]


class FcpMixer(nn.Module):
    """Base of every fcp mixer class. Never instantiated: :func:`replace` swaps a transformers
    module's class to ``packed_class(adapter, type(module))``.

    A mixer kind subclasses it and defines ``fcp_forward(hidden_states, ctx, **kwargs)``: the
    packed-document, contiguous-CP computation, returning what the transformers ``forward``
    returns (a tensor, or a tuple). ``fcp_check(module)`` (a classmethod) rejects, before the
    swap, a configuration the kind cannot compute. These two and each kind's own steps are
    stated as protocols in :mod:`fcp.integrations.hf.mixers.protocols`.
    """

    #: Qualified names (one per enclosing forward given a ``cp_context``) under which this mixer
    #: is expected to receive one; empty outside such forwards. The only instance attribute fcp
    #: adds (set by :func:`replace`, pushed and popped by :class:`ContextScope`).
    fcp_expected_by: tuple[str, ...] = ()

    @classmethod
    def fcp_check(cls, module: nn.Module) -> None:
        """Raise ``NotImplementedError`` if ``module``'s configuration is outside this mixer."""

    def fcp_forward(self, hidden_states, ctx: PackedContext, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} defines no fcp_forward")

    def __call__(self, *args, **kwargs):
        ctx = kwargs.get("cp_context")
        if self.fcp_expected_by:  # inside a forward whose scope checked the context it was given
            if ctx is None:
                name = self.fcp_expected_by[0] or type(self).__name__  # "": enabled on its own
                layer = name.rpartition(".")[0] or "its caller"
                raise ValueError(
                    f"{name} ({type(self).__name__}) was called without `cp_context` inside a "
                    f"forward that was given one: its decoder layer ({layer}) did not forward "
                    "`cp_context` (transformers passes it down through `**kwargs`), and running "
                    "the mixer would silently take the non-CP path"
                )
        elif ctx is not None and ContextScope.of(self) is None:
            # called directly, outside any enabled model: the context enters here (a mixer with
            # a scope of its own checks it in that scope's pre-hook)
            _check_entry(ctx, kwargs, f"{type(self).__name__}.forward")
        return super().__call__(*args, **kwargs)

    def forward(self, *args, cp_context=None, **kwargs):
        if cp_context is None:
            return super().forward(*args, **kwargs)  # transformers' own code, untouched
        # cp_context was checked where it entered (module doc): __call__ or a scope's pre-hook
        fn = f"{type(self).__name__}.forward"
        if not args:
            args = (kwargs.pop("hidden_states"),)
        if len(args) > 1:
            raise TypeError(f"{fn}: with cp_context, pass everything but hidden_states by keyword")
        return self.fcp_forward(args[0], cp_context, **kwargs)

    def __reduce_ex__(self, protocol):
        # a class made at run time cannot be pickled by name: pickle (and deepcopy) rebuild it
        # from its two bases, which can
        adapter, hf_class = type(self).__bases__
        return (_new_packed, (adapter, hf_class), self.__getstate__())


@functools.cache
def packed_class(adapter: type[FcpMixer], hf_class: type[nn.Module]) -> type[nn.Module]:
    """The class ``Packed<HFClass>`` with bases ``(adapter, hf_class)``, made once per pair."""
    name = f"Packed{hf_class.__name__}"
    doc = f"transformers' ``{hf_class.__name__}`` on fcp (:class:`{adapter.__qualname__}`)."
    return type(name, (adapter, hf_class), {"__doc__": doc, "__module__": adapter.__module__})


def fcp_class(mixer: FcpMixer) -> type[FcpMixer]:
    """The fcp class (a mixer kind or a model's adapter) that ``mixer`` runs on."""
    return type(mixer).__bases__[0]


def _new_packed(adapter: type[FcpMixer], hf_class: type[nn.Module]) -> nn.Module:
    cls = packed_class(adapter, hf_class)
    return cls.__new__(cls)


def _cache_argument(kwargs: dict) -> str | None:
    """The KV-cache argument among ``kwargs`` (``use_cache=True``, a cache object), if any."""
    if kwargs.get("use_cache"):
        return "use_cache=True"
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            return name
    return None


def _check_entry(ctx, kwargs: dict, fn: str) -> None:
    """The one check of a context where it enters: a :class:`PackedContext`, and no KV cache
    among the call's ``kwargs`` (fcp runs full packed sequences)."""
    check_context(ctx, fn=fn, name="cp_context")
    found = _cache_argument(kwargs)
    if found is not None:
        raise ValueError(f"{fn}: fcp runs without a KV cache (full packed sequences); got "
                         f"{found} with cp_context (pass use_cache=False)")  # fmt: skip


def _multimodal_argument(arguments: dict) -> str | None:
    return next((name for name in MULTIMODAL_INPUTS if arguments.get(name) is not None), None)


def _check_text_only(arguments: dict, fn: str) -> None:
    found = _multimodal_argument(arguments)
    if found is not None:
        raise ValueError(f"{fn}: image and video inputs are not supported with cp_context yet "
                         f"(got {found}); fcp runs packed text tokens only")  # fmt: skip


def positional_parameters(model: nn.Module) -> tuple[str, ...]:
    """The names of ``model.forward``'s positional parameters, to find an argument a hook is
    handed by position."""
    params = inspect.signature(model.forward).parameters.values()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def replace(module: nn.Module, adapter: type[FcpMixer]) -> None:
    """Turn ``module`` (a transformers mixer that passed ``adapter.fcp_check``) into an fcp mixer
    in place (see the module doc)."""
    module.__class__ = packed_class(adapter, type(module))
    module.fcp_expected_by = ()


class UnreplacedGuard:
    """The forward pre-hook of a token mixer that fcp does not replace, left in a model by
    ``enable_packed_cp(model, allow_unreplaced=True)`` (:mod:`.coverage` finds them): while a
    forward given a ``cp_context`` runs, the model's :class:`ContextScope` holds the module's
    qualified name in :attr:`expected_by`, and calling the module then raises a ``ValueError``
    naming it. Outside such forwards the module runs as it is.

    The mark lives in the hook object, not on the transformers module; one guard per module
    (:meth:`attach` is idempotent).
    """

    def __init__(self):
        #: as :attr:`FcpMixer.fcp_expected_by`: one name per enclosing forward given a context
        self.expected_by: tuple[str, ...] = ()

    @staticmethod
    def of(module: nn.Module) -> UnreplacedGuard | None:
        """``module``'s guard, if it has one."""
        hooks = module._forward_pre_hooks.values()
        return next((h for h in hooks if isinstance(h, UnreplacedGuard)), None)

    @staticmethod
    def attach(module: nn.Module) -> UnreplacedGuard:
        """``module``'s guard, registered first if it has none."""
        guard = UnreplacedGuard.of(module)
        if guard is None:
            guard = UnreplacedGuard()
            module.register_forward_pre_hook(guard)
        return guard

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if self.expected_by:
            name = self.expected_by[0] or type(module).__name__
            raise ValueError(
                f"{name} ({type(module).__name__}) mixes tokens along the sequence and is not an "
                "fcp mixer (enable_packed_cp(..., allow_unreplaced=True) left it as it is): "
                "called inside a forward given a `cp_context`, it would run its non-CP code on "
                "the packed, sharded batch, across documents and blind to the other ranks' tokens"
            )


class _Names(tuple):
    """A stack of qualified names (``fcp_expected_by``, ``UnreplacedGuard.expected_by``).

    A subclass, not a plain tuple, because Dynamo takes a plain tuple of strings for a constant
    and guards its value: every decoder layer's mixer holds its own name, so layers compiled one
    by one (:func:`fcp.integrations.hf.compile_layers`) would each compile a graph of their own.
    A subclass's truthiness is guarded by its type and length only."""


class ContextScope:
    """The guard of one model: its forward pre-hook :meth:`enter` and always-called forward hook
    :meth:`exit` mark ``mixers`` (``(qualified name, mixer)`` pairs) as expecting a context, and
    ``guards`` (``(qualified name, UnreplacedGuard)`` pairs, the token mixers left unreplaced) as
    refusing to run, while a forward given a ``cp_context`` runs (see the module doc).

    ``default_no_cache``: the model's ``forward`` takes ``use_cache``, which then defaults to
    ``False`` under a context (transformers' ``config.use_cache`` would build a cache).
    ``positional``: the names of its positional parameters, to find image inputs passed by
    position.
    """

    def __init__(self, mixers: list[tuple[str, FcpMixer]], default_no_cache: bool,
                 positional: tuple[str, ...],
                 guards: list[tuple[str, UnreplacedGuard]] = ()):  # fmt: skip
        self.mixers = mixers
        self.guards = list(guards)
        self.default_no_cache = default_no_cache
        self.positional = positional

    @staticmethod
    def register(model: nn.Module, mixers: list[tuple[str, FcpMixer]],
                 guards: list[tuple[str, UnreplacedGuard]] = ()) -> None:  # fmt: skip
        """Register ``model``'s scope, or update the mixers and guards of the one it has
        (idempotent)."""
        scope = ContextScope.of(model)
        if scope is not None:
            scope.mixers = mixers
            scope.guards = list(guards)
            return
        params = inspect.signature(model.forward).parameters
        scope = ContextScope(mixers, "use_cache" in params, positional_parameters(model), guards)
        # a model that holds the decoder layers builds transformers' masks itself: under a
        # context it gets the mapping "no mask" instead (fcp's mixers take the documents from
        # the context; an eager causal mask alone is [batch, 1, seq, seq], 16 GiB at 64k tokens)
        scope.no_masks = "attention_mask" in params and isinstance(
            getattr(model, "layers", None), nn.ModuleList)
        model.register_forward_pre_hook(scope.enter, with_kwargs=True)
        model.register_forward_hook(scope.exit, with_kwargs=True, always_call=True)

    @staticmethod
    def of(model: nn.Module) -> ContextScope | None:
        """``model``'s scope, if it has one."""
        hooks = model._forward_pre_hooks.values()
        return next((h.__self__ for h in hooks
                     if isinstance(getattr(h, "__self__", None), ContextScope)), None)  # fmt: skip

    no_masks = False

    def without_masks(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with the attention mask replaced by :class:`NoMasks`."""
        if "attention_mask" in self.positional[: len(args)]:
            i = self.positional.index("attention_mask")
            args = (*args[:i], NoMasks(), *args[i + 1 :])
        else:
            kwargs = dict(kwargs, attention_mask=NoMasks())
        return args, kwargs

    def arguments(self, args: tuple, kwargs: dict) -> dict:
        """The forward's arguments by name, positional ones included."""
        return {**dict(zip(self.positional, args)), **kwargs}

    def enter(self, model: nn.Module, args: tuple, kwargs: dict):
        ctx = kwargs.get("cp_context")
        if ctx is None:
            return None
        fn = f"{type(model).__name__}.forward"
        _check_entry(ctx, kwargs, fn)  # the context's one check on its way into the model
        _check_text_only(self.arguments(args, kwargs), fn)
        if self.default_no_cache and "use_cache" not in kwargs:
            kwargs = dict(kwargs, use_cache=False)
        if self.no_masks:
            args, kwargs = self.without_masks(args, kwargs)
        for name, mixer in self.mixers:
            mixer.fcp_expected_by = _Names((*mixer.fcp_expected_by, name))
        for name, guard in self.guards:
            guard.expected_by = _Names((*guard.expected_by, name))
        return args, kwargs

    def exit(self, model: nn.Module, args: tuple, kwargs: dict, output):
        # an enter that raised marked nothing, and sees the same arguments here
        if (isinstance(kwargs.get("cp_context"), PackedContext) and _cache_argument(kwargs) is None
                and _multimodal_argument(self.arguments(args, kwargs)) is None):  # fmt: skip
            for _, mixer in self.mixers:
                mixer.fcp_expected_by = _Names(mixer.fcp_expected_by[:-1])
            for _, guard in self.guards:
                guard.expected_by = _Names(guard.expected_by[:-1])
        return None
