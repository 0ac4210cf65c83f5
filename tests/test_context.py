"""PackedContext: the worked example, validation, pytree behaviour, host-side memo, compile."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from fcp.context import PackedContext
from fcp.layout import doc_ids_from_seq_lens, document_starts

DOCS = torch.tensor([[1, 1, 1, 1, 2, 3, 3, 3, 3, 3, 0, 0]])


def _ctx(rank, size=4, doc_ids=DOCS):
    return PackedContext(doc_ids, group=object() if size > 1 else None, cp_size=size,
                         cp_rank=rank)


def test_worked_example_from_the_docstring():
    locals_ = [[1, 1, 1], [1, 2, 3], [3, 3, 3], [3, 0, 0]]
    for rank, expect in enumerate(locals_):
        ctx = _ctx(rank)
        assert ctx.seq_start == 3 * rank and ctx.local_seq_len == 3 and ctx.cp_enabled
        assert ctx.local_doc_ids.tolist() == [expect]
        assert ctx.local_valid.tolist() == [[d != 0 for d in expect]]
    ctx = _ctx(1)
    dev, cpu = ctx.row_cu_seqlens(0)
    assert cpu.tolist() == [0, 4, 5, 10, 12] and dev.tolist() == cpu.tolist()
    assert ctx.local_cu_seqlens(0).tolist() == [0, 1, 2, 3]
    assert ctx.local_position_ids.tolist() == [[3, 0, 0]]


def test_single_process_context_needs_only_the_map():
    ctx = PackedContext(DOCS)
    assert not ctx.cp_enabled and ctx.cp_size == 1 and ctx.seq_start == 0
    assert ctx.local_seq_len == 12 and torch.equal(ctx.local_doc_ids, DOCS)
    assert ctx.global_seq_len == 12 and ctx.batch_size == 1 and ctx.interval == (0, 12)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(doc_ids=torch.ones(3, dtype=torch.long)), "batch, sequence"),
        (dict(doc_ids=torch.ones(1, 4)), "int64"),
        (dict(doc_ids=DOCS, cp_size=5, group=object()), "not divisible"),
        (dict(doc_ids=DOCS, cp_size=2), "needs a process group"),
        (dict(doc_ids=DOCS, cp_size=2, cp_rank=2, group=object()), "cp_rank=2"),
        (dict(doc_ids=DOCS, cp_size=2, group=object(), seq_start=3), "seq_start=3"),
        (dict(doc_ids=DOCS, cp_size=2, group=object(), local_seq_len=5), "local_seq_len=5"),
        (dict(doc_ids=DOCS, original_seq_len=13), "original_seq_len=13"),
        (dict(doc_ids=DOCS, cp_size=0), "cp_size"),
    ],
)
def test_rejects_inconsistent_metadata(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PackedContext(**kwargs)


def test_row_lookup_is_validated_and_memoised():
    ctx = PackedContext(DOCS)
    first = ctx.row_cu_seqlens(0)
    assert ctx.row_cu_seqlens(0) is first  # memo: repeated layers pay once per batch
    with pytest.raises(ValueError, match="row=1"):
        ctx.row_cu_seqlens(1)


def test_is_a_frozen_pytree_with_one_leaf():
    ctx = _ctx(2)
    leaves, spec = pytree.tree_flatten(ctx)
    assert len(leaves) == 1 and leaves[0] is ctx.doc_ids
    again = pytree.tree_unflatten([leaves[0] + 0], spec)
    assert isinstance(again, PackedContext)
    assert (again.cp_rank, again.cp_size, again.seq_start, again.local_seq_len) == (2, 4, 6, 3)
    with pytest.raises(Exception):
        ctx.cp_rank = 1  # frozen


def test_shard_slices_and_pads_differentiably():
    ctx = PackedContext(DOCS, original_seq_len=10)
    x = torch.randn(1, 10, 2, requires_grad=True)
    y = ctx.shard(x)
    assert y.shape == (1, 12, 2) and torch.equal(y[:, :10], x.detach())
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    with pytest.raises(ValueError, match="neither"):
        ctx.shard(torch.randn(1, 11, 2))


def test_model_side_metadata_compiles_once_across_50_packings():
    """Local doc ids, positions and masks trace with fullgraph=True and never recompile."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    def metadata(ctx):
        return ctx.local_position_ids, ctx.local_valid, document_starts(ctx.local_doc_ids)

    compiled = torch.compile(metadata, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    torch._dynamo.reset()
    for _ in range(50):
        lens = torch.randint(0, 9, (2, 6), generator=gen)
        lens = torch.where(lens.cumsum(1) > 32, torch.full_like(lens, -1000), lens)
        ctx = PackedContext(doc_ids_from_seq_lens(lens, 32), group=object(), cp_size=4, cp_rank=2)
        for got, want in zip(compiled(ctx), metadata(ctx)):
            assert torch.equal(got, want)
    assert counter.frame_count == 1
    ops = [str(n.target) for n in counter.graphs[0].graph.nodes
           if n.op in ("call_function", "call_method")]
    assert not [o for o in ops if o in ("aten._local_scalar_dense.default", "aten.nonzero.default")
                or o in ("item", "tolist", "cpu", "nonzero")]


@pytest.mark.parametrize(
    "rows, match",
    [
        ([[1, 1, 2, 2, 1, 1]], r"doc_ids\[0, 4\] = 1 follows 2"),  # a reused id
        ([[1, 1, 3, 3]], r"doc_ids\[0, 2\] = 3 follows 1"),  # a skipped id
        ([[1, 1, -1, -1]], r"doc_ids\[0, 2\] = -1 is negative"),  # collides with OUTSIDE_DOC_ID
        ([[1, 0, 2, 2]], r"doc_ids\[0, 2\] = 2 follows pad"),  # padding in the middle
        ([[2, 2, 3, 3]], r"doc_ids\[0, 0\] = 2 starts the row"),
    ],
)
def test_rejects_maps_that_validate_doc_ids_rejects(rows, match):
    """Every operator then agrees on one reading of the map: there is only the valid form."""
    with pytest.raises(ValueError, match=match):
        PackedContext(torch.tensor(rows))
    with pytest.raises(ValueError, match=match):
        PackedContext(torch.tensor(rows * 2), group=object(), cp_size=2, cp_rank=1)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(cp_size=True), TypeError, "cp_size must be an int, got True"),
        (dict(cp_rank=0.0), TypeError, "cp_rank must be an int"),
        (dict(original_seq_len=2.5), TypeError, "original_seq_len must be an int, got 2.5"),
        (dict(seq_start=True), TypeError, "seq_start must be an int, got True"),
    ],
)
def test_static_fields_are_ints_not_bools_or_floats(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        PackedContext(DOCS, **kwargs)


def test_meta_map_is_rejected_eagerly():
    with pytest.raises(ValueError, match="meta"):
        PackedContext(torch.ones(1, 4, dtype=torch.long, device="meta"))


def test_rebuilding_from_traced_leaves_does_not_revalidate():
    """Pytree unflattening under FakeTensorMode (what AOT tracing does) runs the static checks
    only: reading fake values would fail, so this would raise if validation ran."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ctx = _ctx(1)
    leaves, spec = pytree.tree_flatten(ctx)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(leaves[0])
        again = pytree.tree_unflatten([fake], spec)
    assert again.cp_rank == 1 and again.local_seq_len == 3


def test_dataclasses_replace_over_all_fields_works():
    """FSDP2's mixed-precision input cast rebuilds dataclasses in model kwargs with
    ``dataclasses.replace(obj, **{every field})``: the memo must not be a field."""
    import dataclasses

    ctx = _ctx(1)
    ctx.row_cu_seqlens(0)
    again = dataclasses.replace(ctx, **{f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)})
    assert again == ctx and again.memo("k", lambda: 1) == 1 and "k" not in ctx._memo


# ------------------------------------------------------------------ one vocabulary, one check
_OPERATORS = {  # operator -> (module, the tensors before ctx)
    "short_conv": ("fcp.ops.conv", 3),
    "doc_causal_attention": ("fcp.ops.doc_causal", 3),
    "compressed_attention": ("fcp.ops.compressed", 3),
    "index_attention": ("fcp.ops.index_attention", 4),
    "kpool_indexer": ("fcp.ops.kpool_indexer", 5),
    "qsa_indexer": ("fcp.ops.qsa_indexer", 6),
}


@pytest.mark.parametrize("name", sorted(_OPERATORS))
def test_operators_take_ctx_after_their_tensors_and_check_it_once(name):
    import ast
    import importlib
    import inspect
    import textwrap

    from fcp.checks import ArgumentTypeError

    module, n_tensors = _OPERATORS[name]
    op = getattr(importlib.import_module(module), name)
    params = list(inspect.signature(op).parameters.values())
    assert params[n_tensors].name == "ctx", [p.name for p in params]
    assert params[n_tensors].annotation in ("PackedContext", PackedContext)
    # the dispatcher's one context check (PackedContext validated itself when it was built)
    tree = ast.parse(textwrap.dedent(inspect.getsource(op)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "check_context"]  # fmt: skip
    assert len(calls) == 1, name
    with pytest.raises(ArgumentTypeError, match=rf"^{name}: ctx must be a PackedContext"):
        op(*[torch.zeros(1)] * n_tensors, object(), **(
            {"topk": 4, "kpool": 4} if name == "kpool_indexer" else
            {"budget": 4, "ratio": 4} if name == "qsa_indexer" else {}))
