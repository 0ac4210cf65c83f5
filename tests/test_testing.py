"""Tests of tests.support.rank_pool.RankPool on real gloo process groups.

Job functions live at module level in this file: workers import this module by
name (pytest puts ``tests/`` on ``sys.path`` and the pool forwards it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.rank_pool import CollectiveMismatch, RankError, RankPool, RankTimeout, RemoteError


# ---------------------------------------------------------------------------
# job functions (run on the ranks)
# ---------------------------------------------------------------------------


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group))


def whoami(env):
    return {"rank": env.rank, "world_size": env.world_size, "group_size": dist.get_world_size(env.group),
            "group_rank": dist.get_rank(env.group), "pid": os.getpid()}


def gather_rank_rows(env, n: int):
    x = torch.full((n, 2), float(env.rank))
    return _gather(x, env.group)


def echo(env, obj, scale=1):
    """Return the received object plus rank-dependent tensors of several dtypes."""
    return {
        "echo": obj,
        "bf16": torch.arange(4, dtype=torch.bfloat16) * scale + env.rank,
        "i64": torch.tensor([2**40 + env.rank, -1], dtype=torch.int64),
        "nested": [(env.rank, torch.ones(2, 3)[:, 1])],  # a strided view
        "grad": torch.ones(2, requires_grad=True) * 2,  # non-leaf requiring grad
    }


def fail_on_rank(env, bad_rank: int):
    if env.rank == bad_rank:
        raise ValueError(f"bad value on rank {env.rank}")
    return env.rank


def fail_everywhere_early(env):
    raise KeyError(f"early {env.rank}")


class OddError(Exception):
    """Pickles, but cannot be rebuilt (two required init args)."""

    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


def raise_odd(env):
    raise OddError("odd", env.rank)


def skip_collective_on_rank0(env):
    if env.rank == 0:
        return "skipped"  # the others wait in the all_gather
    return _gather(torch.ones(1), env.group)


def extra_async_collective_on_rank0(env):
    if env.rank == 0:
        dist.all_reduce(torch.ones(1), group=env.group, async_op=True)  # never matched, never waited
    return env.rank


def compiled_gather(env, n: int):
    def f(x):
        y = funcol.all_gather_tensor(x * 2, 0, env.group)
        return funcol.wait_tensor(y) + 1

    torch._dynamo.reset()
    x = torch.arange(n, dtype=torch.float32) + 10 * env.rank
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    return got, f(x)


def mesh_gather(env):
    mesh = env.mesh("cp")
    x = torch.tensor([env.rank])
    out = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, mesh))
    return mesh.size(), mesh.mesh_dim_names, out


def noop(env):
    return env.rank


def die_on_rank1(env):
    if env.rank == 1:
        os._exit(3)
    return env.rank


def sleep_forever(env):
    time.sleep(3600)


# ---------------------------------------------------------------------------
# tests on the session pool
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rank_and_world_size(rank_pool, world_size):
    out = rank_pool.run(whoami, world_size)
    assert len(out) == world_size
    for r, info in enumerate(out):
        assert info["rank"] == r
        assert info["world_size"] == world_size
        assert info["group_size"] == world_size
        assert info["group_rank"] == r
    assert len({info["pid"] for info in out}) == world_size  # distinct processes


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_funcol_all_gather_on_subgroup(rank_pool, world_size):
    out = rank_pool.run(gather_rank_rows, world_size, 3)
    expected = torch.arange(world_size, dtype=torch.float32).repeat_interleave(3)[:, None].expand(-1, 2)
    for got in out:
        torch.testing.assert_close(got, expected)


def test_tensors_round_trip(rank_pool):
    arg = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).to(torch.bfloat16),
           "i64": torch.tensor([2**50, -7]), "tuple": (1, "a", None)}
    out = rank_pool.run(echo, 2, arg, scale=3)
    for r, res in enumerate(out):
        for key, t in arg.items():
            if isinstance(t, torch.Tensor):
                got = res["echo"][key]
                assert got.dtype == t.dtype and got.shape == t.shape
                assert torch.equal(got, t)
            else:
                assert res["echo"][key] == t
        assert res["bf16"].dtype == torch.bfloat16
        assert torch.equal(res["bf16"], torch.arange(4, dtype=torch.bfloat16) * 3 + r)
        assert res["i64"].dtype == torch.int64 and res["i64"].tolist() == [2**40 + r, -1]
        rank, view = res["nested"][0]
        assert rank == r and view.shape == (2,) and view.untyped_storage().nbytes() == 2 * 4
        assert not res["grad"].requires_grad and res["grad"].tolist() == [2.0, 2.0]


def test_exception_on_one_rank_is_reported_and_pool_recovers(rank_pool):
    starts = rank_pool.starts
    with pytest.raises(RankError) as info:
        rank_pool.run(fail_on_rank, 4, 2)
    err = info.value
    assert not isinstance(err, RankTimeout)
    assert list(err.exceptions) == [2]
    assert isinstance(err.exceptions[2], ValueError)
    assert "rank 2: ValueError: bad value on rank 2" in str(err)
    assert "fail_on_rank" in str(err)  # traceback excerpt names the function
    assert isinstance(err.__cause__, ValueError)
    # the next job runs on the same processes, with working groups
    assert rank_pool.run(gather_rank_rows, 4, 1)[3].tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]
    assert rank_pool.starts == starts


def test_return_exceptions(rank_pool):
    out = rank_pool.run(fail_on_rank, 3, 1, return_exceptions=True)
    assert out[0] == 0 and out[2] == 2
    assert type(out[1]) is ValueError and str(out[1]) == "bad value on rank 1"
    assert out[1].rank == 1 and "fail_on_rank" in out[1].remote_traceback

    out = rank_pool.run(fail_everywhere_early, 2, return_exceptions=True)
    assert [type(e) for e in out] == [KeyError, KeyError]
    assert [e.args[0] for e in out] == ["early 0", "early 1"]


def test_unrebuildable_exception_becomes_remote_error(rank_pool):
    out = rank_pool.run(raise_odd, 2, return_exceptions=True)
    for r, e in enumerate(out):
        assert isinstance(e, RemoteError)
        assert e.type_name.endswith("OddError") and e.message == f"odd/{r}" and e.rank == r
    with pytest.raises(RankError, match=r"OddError: odd/0"):
        rank_pool.run(raise_odd, 2)


def test_hang_is_reported_within_bounded_time(rank_pool):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        rank_pool.run(skip_collective_on_rank0, 3, timeout=3)
    elapsed = time.monotonic() - t0
    assert elapsed < 15, elapsed
    err = info.value
    assert sorted(err.exceptions) == [1, 2]  # the waiting ranks time out
    msg = str(err)
    assert "rank(s) [0] returned normally" in msg
    assert "rank 0: 0, rank 1: 1, rank 2: 1" in msg  # collective counts point at rank 0
    # next example works again
    assert [t.tolist() for t in rank_pool.run(gather_rank_rows, 3, 1)][0] == [[0, 0], [1, 1], [2, 2]]


def test_unmatched_async_collective_is_a_mismatch(rank_pool):
    with pytest.raises(CollectiveMismatch, match="rank 0: 1, rank 1: 0"):
        rank_pool.run(extra_async_collective_on_rank0, 2, timeout=3)
    assert rank_pool.run(gather_rank_rows, 2, 1)[1].tolist() == [[0, 0], [1, 1]]


def test_torch_compile_funcol_in_worker(rank_pool):
    out = rank_pool.run(compiled_gather, 2, 3)
    expected = torch.tensor([1.0, 3, 5, 21, 23, 25])  # x * 2 + 1, x = arange(3) + 10 * rank, ranks 0, 1
    for compiled, eager in out:
        torch.testing.assert_close(compiled, eager)
        torch.testing.assert_close(compiled, expected)


def test_mesh_from_group(rank_pool):
    for size, names, out in rank_pool.run(mesh_gather, 3):
        assert size == 3 and names == ("cp",) and out.tolist() == [0, 1, 2]


def test_unpicklable_job_fails_in_parent(rank_pool):
    with pytest.raises(TypeError, match="module-level function"):
        rank_pool.run(lambda env: 0, 2)
    with pytest.raises(ValueError):
        rank_pool.run(noop, 5)


@settings(deadline=None, max_examples=25, derandomize=True)
@given(world_size=st.integers(1, 4), n=st.integers(0, 4), fail=st.booleans())
def test_property_many_examples(rank_pool, world_size, n, fail):
    if fail:
        out = rank_pool.run(fail_on_rank, world_size, world_size - 1, return_exceptions=True)
        assert isinstance(out[-1], ValueError)
        assert out[:-1] == list(range(world_size - 1))
    else:
        out = rank_pool.run(gather_rank_rows, world_size, n)
        assert all(o.shape == (world_size * n, 2) for o in out)


def test_report_latency(rank_pool, capsys):
    """Not a check: prints pool start time and per-example latency."""
    lines = [f"rank pool start: {rank_pool.start_seconds:.2f} s (4 ranks)"]
    for ws in (1, 2, 4):
        rank_pool.run(noop, ws)
        reps = 20
        t0 = time.perf_counter()
        for _ in range(reps):
            rank_pool.run(noop, ws)
        trivial = (time.perf_counter() - t0) / reps * 1e3
        t0 = time.perf_counter()
        for _ in range(reps):
            rank_pool.run(gather_rank_rows, ws, 2)
        gather = (time.perf_counter() - t0) / reps * 1e3
        lines.append(f"world_size={ws}: trivial {trivial:.1f} ms, all_gather {gather:.1f} ms per example")
    t0 = time.perf_counter()
    rank_pool.run(fail_on_rank, 4, 0, return_exceptions=True)
    lines.append(f"failing 4-rank example (incl. group reset): {(time.perf_counter() - t0) * 1e3:.0f} ms")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


# ---------------------------------------------------------------------------
# process-level failures (own small pools: these kill workers)
# ---------------------------------------------------------------------------


def test_dead_rank_and_job_timeout_then_recovery_and_close():
    pool = RankPool(max_world_size=2, timeout=5)
    try:
        with pytest.raises(RankTimeout) as info:
            pool.run(die_on_rank1, 2)
        assert info.value.ranks == [1] or 1 in info.value.ranks
        assert "exit code 3" in str(info.value)
        assert pool.run(noop, 2) == [0, 1]
        assert pool.starts == 2

        t0 = time.monotonic()
        with pytest.raises(RankTimeout, match="did not answer") as info:
            pool.run(sleep_forever, 1, job_timeout=2)
        assert time.monotonic() - t0 < 10
        assert info.value.ranks == [0]
        assert pool.run(noop, 2) == [0, 1]
        procs = list(pool._procs)
    finally:
        t0 = time.monotonic()
        pool.close()
        assert time.monotonic() - t0 < 8
    assert not any(p.is_alive() for p in procs)
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(noop, 1)


def test_workers_exit_when_parent_dies(tmp_path):
    script = textwrap.dedent(
        """
        import os, sys
        from tests.support.rank_pool import RankPool
        pool = RankPool(max_world_size=2, timeout=5)
        pool.start()
        print(" ".join(str(p.pid) for p in pool._procs), flush=True)
        os._exit(0)  # no cleanup at all
        """
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2

    def alive(pid):  # a zombie (exited, not yet reaped) counts as dead
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
        except OSError:  # no /proc: fall back to signal 0
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            return True

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)
