"""Unit tests of fcp.comm: the anchor's purpose, validation, bytes moved, compile and graph shape."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fcp.checks import ArgumentTypeError
from fcp.comm import (
    all_gather_backward_anchor,
    all_gather_group,
    all_gather_sequence,
    halo_plan,
    left_halo,
    state_chain,
    with_left_halo,
)
from fcp.context import PackedContext
from fcp.groups import GroupInfo
from tests.support.rank_pool import RankError
from tests import _comm_rank_fns as fns


# ------------------------------------------------------------------ CP off: identities
def test_cp_off_functions_are_identities_without_a_process_group():
    x = torch.randn(2, 5, 3, requires_grad=True)
    ctx = PackedContext(torch.ones(2, 5, dtype=torch.long))
    assert all_gather_group(x, None) is x
    assert all_gather_sequence(x, ctx) is x
    halo = left_halo(x, ctx, 3)
    assert halo.shape == (2, 3, 3) and not halo.any()
    s_in = state_chain(torch.randn(2, 4, 4), torch.randn(2, 4, 6, dtype=torch.bfloat16), ctx)
    assert s_in.dtype == torch.float32 and s_in.shape == (2, 4, 6) and not s_in.any()


def test_collectives_take_a_context_and_the_group_form_a_group():
    # one vocabulary: ctx: PackedContext right after the tensors; a raw group only in
    # all_gather_group, named apart (a wrong type is an ArgumentTypeError naming the function)
    x = torch.randn(1, 4, 2)
    ctx = PackedContext(torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ArgumentTypeError, match=r"^all_gather_sequence: ctx must be a "
                                                r"PackedContext, got None .*all_gather_group"):
        all_gather_sequence(x, None)
    for call, fn in ((lambda: left_halo(x, None, 1), "left_halo"),
                     (lambda: with_left_halo(x, None, 1), "with_left_halo"),
                     (lambda: state_chain(torch.eye(2), torch.ones(2, 3), None), "state_chain")):
        with pytest.raises(ArgumentTypeError, match=rf"^{fn}: ctx must be a PackedContext"):
            call()
    with pytest.raises(ArgumentTypeError, match=r"^all_gather_group: group must be None, a "):
        all_gather_group(x, ctx)
    assert all_gather_group(x, GroupInfo(None, 1, 0), dtype=torch.float64).dtype == torch.float64


def test_halo_plan_sends_history_tokens_to_the_next_rank_only():
    assert halo_plan(3, 4, 2) == [([0, 2, 0], [0, 0, 0]), ([0, 0, 2], [2, 0, 0]),
                                  ([0, 0, 0], [0, 2, 0])]
    # history 6 > local 4: rank 2 receives 2 tokens from rank 0 and 4 from rank 1
    plan = halo_plan(3, 4, 6)
    assert plan[2][1] == [2, 4, 0]
    assert plan[0][0] == [0, 4, 2]
    for send, recv in plan:
        assert len(send) == len(recv) == 3


def test_state_chain_rejects_mismatched_shapes():
    ctx = PackedContext(torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="K, K"):
        state_chain(torch.randn(3, 4), torch.randn(3, 2), ctx)
    with pytest.raises(ValueError, match="leading dims"):
        state_chain(torch.randn(2, 3, 3), torch.randn(5, 3, 2), ctx)


def test_anchor_is_zero_with_zero_gradient_even_for_nonfinite_values():
    g = torch.tensor([1.0, float("inf"), float("nan")], requires_grad=True)
    a = all_gather_backward_anchor(g)
    assert a.shape == () and a.item() == 0.0
    a.backward()
    assert torch.equal(g.grad, torch.zeros(3))


# ------------------------------------------------------------------ multi-rank behaviour
def test_anchor_lets_an_idle_rank_join_the_backward_collective(rank_pool):
    full = torch.randn(1, 6, 2)
    results = rank_pool.run(fns.anchor_case, 3, full, 2, True)
    # Reference: rank r != 2 has loss (r+1) * sum(full); rank 2 has 2 * sum(x_2).
    # Gradient of x_r = sum over ranks of d loss_r' / d x_r.
    for rank, (loss, grad) in enumerate(results):
        expect = torch.full_like(grad, 1.0 + 2.0)  # ranks 0 and 1 weigh every slice by 1 and 2
        if rank == 2:
            expect = expect + 2.0
            torch.testing.assert_close(loss, full[:, 4:6].sum() * 2)
        torch.testing.assert_close(grad, expect)


def test_without_the_anchor_the_idle_rank_hangs_the_backward(rank_pool):
    full = torch.randn(1, 6, 2)
    with pytest.raises(RankError):
        rank_pool.run(fns.anchor_case, 3, full, 2, False, timeout=4.0)
    # the pool recovers for the next example
    assert len(rank_pool.run(fns.anchor_case, 3, full, 2, True)) == 3


def test_gather_rejects_unequal_shards_on_every_rank(rank_pool):
    results = rank_pool.run(fns.gather_unequal, 2, return_exceptions=True)
    for err in results:
        assert isinstance(err, ValueError) and "equal shapes" in str(err)


def test_gather_not_differentiable_detaches(rank_pool):
    full = torch.arange(8).view(1, 8)
    for out, requires_grad in rank_pool.run(fns.gather_not_differentiable, 4, full):
        assert torch.equal(out, full) and not requires_grad


def test_gather_checks_compressed_fraction_statically():
    ctx = PackedContext(torch.ones(1, 8, dtype=torch.long), group=object(), cp_size=2)
    with pytest.raises(ValueError, match="whole fraction"):
        all_gather_sequence(torch.zeros(1, 3, 2), ctx, dim=1)


@pytest.mark.parametrize("history", [2, 5])
def test_halo_sends_only_history_tokens(rank_pool, history):
    local, channels, world = 8, 16, 4
    counts = rank_pool.run(fns.halo_bytes, world, local, history, channels)
    token_bytes = channels * 4
    for rank, c in enumerate(counts):
        assert c["ops"] == ["_c10d_functional.all_to_all_single.default"]
        assert c["send"] == (history * token_bytes if rank < world - 1 else 0)
        assert c["recv"] == (history * token_bytes if rank > 0 else 0)


def test_collectives_compiled_equal_eager(rank_pool):
    full = torch.randn(1, 4 * 3, 3)
    for (eager_loss, eager_grad), (comp_loss, comp_grad) in rank_pool.run(
        fns.compiled_vs_eager, 3, full, 5
    ):
        torch.testing.assert_close(comp_loss, eager_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(comp_grad, eager_grad, rtol=1e-6, atol=1e-6)


def test_widened_collectives_compiled_equal_eager(rank_pool):
    full = torch.randn(1, 4 * 2, 3).bfloat16()
    wg, wh = torch.randn(2, 1, 8, 3), torch.randn(2, 1, 3 + 4, 3)
    for eager, compiled in zip(rank_pool.run(fns.widened_fwd_bwd, 2, full, 3, wg, wh),
                               rank_pool.run(fns.widened_fwd_bwd, 2, full, 3, wg, wh, True)):
        for a, b in zip(eager, compiled):
            assert a.dtype == b.dtype
            torch.testing.assert_close(b.double(), a.double(), rtol=1e-2, atol=1e-2)


def test_widened_results_need_a_floating_dtype_and_tensor():
    ctx = PackedContext(torch.ones(1, 4, dtype=torch.long))
    x = torch.ones(1, 4, 2, dtype=torch.bfloat16)
    assert all_gather_sequence(x, ctx, dtype=torch.float32).dtype == torch.float32
    assert with_left_halo(x.double(), ctx, 2, dtype=torch.float32).dtype == torch.float64
    with pytest.raises(ValueError, match="dtype must be a floating dtype"):
        all_gather_sequence(x, ctx, dtype=torch.int64)
    with pytest.raises(TypeError, match="dtype must be a dtype"):
        with_left_halo(x, ctx, 2, dtype="float32")
    with pytest.raises(TypeError, match="tensor must be floating point"):
        all_gather_sequence(torch.ones(1, 4, dtype=torch.long), ctx, dtype=torch.float32)


# ------------------------------------------------------------------ graph shape (fake PG)
@pytest.fixture
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


SYNC_OPS = ("_local_scalar_dense", "aten.nonzero", "masked_select", "aten.item")


def _capture(fn, *args, partition_fn=None):
    """Forward and backward ATen graphs of ``fn`` compiled with fullgraph=True."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {"fw": [], "bw": []}

    def keep(kind):
        def compiler(gm, _):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    extra = {"partition_fn": partition_fn} if partition_fn is not None else {}
    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"), **extra)
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    out.sum().backward()
    return graphs


def _ops(gms):
    return [str(n.target) for gm in gms for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize(
    "name, fw_expected, bw_expected",
    [
        ("gather", {"all_gather_into_tensor": 1}, {"reduce_scatter_tensor": 1}),
        ("halo", {"all_to_all_single": 1}, {"all_to_all_single": 1}),
        ("chain", {"all_gather_into_tensor": 1}, {"reduce_scatter_tensor": 1}),
    ],
)
def test_graph_has_exactly_the_expected_collectives_and_no_sync(fake_group, name, fw_expected,
                                                                bw_expected):
    ctx = PackedContext(torch.ones(2, 32, dtype=torch.long), group=fake_group, cp_size=4,
                        cp_rank=1)
    fn = {
        "gather": lambda x: all_gather_sequence(x, ctx, dim=1),
        "halo": lambda x: left_halo(x, ctx, 3),
        "chain": lambda x: state_chain(x[0, :3, :3], x[0, :3, :], ctx),
    }[name]
    x = torch.randn(2, 8, 3, requires_grad=True)
    graphs = _capture(fn, x)
    assert len(graphs["fw"]) == 1 and len(graphs["bw"]) == 1  # one graph each: no graph break
    for kind, expected in (("fw", fw_expected), ("bw", bw_expected)):
        ops = _ops(graphs[kind])
        collectives = [o for o in ops if "_c10d_functional" in o and "wait_tensor" not in o]
        for op_name, count in expected.items():
            assert sum(op_name in o for o in collectives) == count, (kind, collectives)
        assert len(collectives) == sum(expected.values()), (kind, collectives)
        assert not [o for o in ops if any(s in o for s in SYNC_OPS)], (kind, ops)


@pytest.mark.parametrize("name", ["gather", "halo"])
def test_widened_collectives_send_bf16_forward_and_sum_fp32_backward(fake_group, name):
    ctx = PackedContext(torch.ones(2, 32, dtype=torch.long), group=fake_group, cp_size=4,
                        cp_rank=1)
    fn = {
        "gather": lambda x: all_gather_sequence(x, ctx, dtype=torch.float32),
        "halo": lambda x: with_left_halo(x, ctx, 3, dtype=torch.float32),
    }[name]
    graphs = _capture(fn, torch.randn(2, 8, 3, dtype=torch.bfloat16, requires_grad=True))
    assert len(graphs["fw"]) == 1 and len(graphs["bw"]) == 1
    for kind, dtype in (("fw", torch.bfloat16), ("bw", torch.float32)):
        sent = [n.args[0].meta["val"].dtype for gm in graphs[kind] for n in gm.graph.nodes
                if n.op == "call_function" and "_c10d_functional" in str(n.target)
                and "wait_tensor" not in str(n.target)]  # fmt: skip
        assert sent == [dtype], (kind, sent)


@pytest.mark.parametrize("rank", [0, 2])
def test_min_cut_partitioner_keeps_backward_collectives_in_backward(fake_group, rank):
    """Inductor's min-cut partitioner must not hoist a backward reduce-scatter into the forward.

    Regression: the anchor's backward used to return constant zeros, so on rank 0 (which uses
    none of the gathered blocks) the reduce-scatter depended on nothing from backward and was
    moved into the forward graph: rank 0 then issued 3 collectives and rank 1 2, a hang/abort.
    """
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    ctx = PackedContext(torch.ones(1, 32, dtype=torch.long), group=fake_group, cp_size=4,
                        cp_rank=rank)
    x = torch.randn(1, 8, 3, requires_grad=True)
    graphs = _capture(lambda t: state_chain(t[0, :3, :3], t[0, :3, :], ctx), x,
                      partition_fn=min_cut_rematerialization_partition)
    fw = [o for o in _ops(graphs["fw"]) if "_c10d_functional" in o and "wait" not in o]
    bw = [o for o in _ops(graphs["bw"]) if "_c10d_functional" in o and "wait" not in o]
    assert fw == ["_c10d_functional.all_gather_into_tensor.default"], fw
    assert bw == ["_c10d_functional.reduce_scatter_tensor.default"], bw


def test_state_chain_compiled_with_inductor_keeps_ranks_in_step(rank_pool):
    """Regression: inductor folded the anchor's constant-zero gradient and hoisted rank 0's
    backward reduce-scatter into its forward (3 collectives on rank 0, 2 on rank 1: a hang)."""
    ms = torch.randn(2, 2, 3, 3) * 0.5
    ss = torch.randn(2, 2, 3, 4)
    (out0, m0, s0), (out1, m1, s1) = rank_pool.run(fns.chain_inductor, 2, ms, ss)
    assert not out0.any()
    torch.testing.assert_close(out1, ss[0])
    torch.testing.assert_close(s0, torch.ones_like(s0))  # rank 1's output is S_0
    assert not m0.any() and not m1.any() and not s1.any()


def test_backward_anchor_gradient_is_finite_zero_even_for_a_nan_upstream_gradient():
    """One NaN in one row's upstream gradient must not reach the gathered values of any row
    through the anchor (it used to pass NaN through a sum to every row)."""
    kv = torch.randn(2, 4, requires_grad=True)
    y = torch.randn(2, 4, requires_grad=True)
    up = torch.ones(2, 4)
    up[0, 0] = float("nan")
    (y + all_gather_backward_anchor(kv)).backward(up)
    assert torch.equal(kv.grad, torch.zeros(2, 4))
