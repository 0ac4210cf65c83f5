"""Run functions on real gloo process groups held by persistent rank processes.

Multi-rank tests (and Hypothesis properties with many examples) need real
process groups, but spawning fresh processes costs seconds per test.  A
:class:`RankPool` starts ``max_world_size`` CPU processes once, joins them in a
gloo group, and then runs one *job* after another on ranks ``0..world_size-1``
(ranks ``>= world_size`` stay idle).  Each rank returns its result, or its
exception, to the caller; every wait is bounded, so a bad example fails, it
never hangs the suite.

This module imports nothing from ``fcp`` and can be used by any project.

Worked example (pytest, using the session fixture ``rank_pool`` from the repo's
``conftest.py``)::

    # tests/test_allgather.py
    import torch
    import torch.distributed._functional_collectives as funcol
    from hypothesis import given, settings, strategies as st

    def gather_rank(env, n):              # module level: pickled by reference
        x = torch.full((n,), float(env.rank))
        return funcol.wait_tensor(funcol.all_gather_tensor(x, 0, env.group))

    @settings(deadline=None, max_examples=50)
    @given(world_size=st.integers(1, 4), n=st.integers(1, 5))
    def test_gather(rank_pool, world_size, n):
        outs = rank_pool.run(gather_rank, world_size, n)   # one entry per rank
        expected = torch.arange(world_size).repeat_interleave(n).float()
        for out in outs:
            torch.testing.assert_close(out, expected)

Outside pytest::

    with RankPool(max_world_size=2) as pool:
        print(pool.run(gather_rank, 2, 3))

Rules for jobs
--------------
* ``fn`` must be importable by module path (a module-level function; no
  lambdas or closures).  The parent's ``sys.path`` is sent with each job, so
  functions in pytest test modules work (pytest's default ``prepend`` import
  mode puts test directories on ``sys.path``; ``--import-mode=importlib`` does
  not, put worker functions in an importable helper module then).  In a script,
  guard the entry point with ``if __name__ == "__main__":`` (spawn re-imports
  the main module).
* ``fn`` is called as ``fn(env, *args, **kwargs)`` with a :class:`RankEnv`.
  Use ``env.group`` (the process group of exactly the job's ranks) or
  ``env.mesh()``, never the default group: idle ranks do not take part.
* Arguments and results travel as ``torch.save`` bytes: tensors may be nested
  anywhere in picklable data and come back as detached CPU tensors.  Return
  ``dtensor.to_local()`` / ``full_tensor()`` rather than a DTensor.
* Prefer returning data and asserting in the test process: ``assert`` inside a
  worker is not rewritten by pytest (use ``torch.testing.assert_close`` there).
* Worker processes persist between jobs: module globals and torch.compile
  caches survive.  Call ``torch._dynamo.reset()`` inside ``fn`` when an
  example must compile from scratch.  Workers are daemonic (they cannot start
  ``multiprocessing`` children); ``TORCHINDUCTOR_COMPILE_THREADS`` defaults to
  1 in workers for that reason.
* With Hypothesis, use ``@settings(deadline=None)``: a failing example resets
  the groups (~0.1-1 s) and a hang waits for the collective timeout.  The
  first job from a test module also imports that module (and pytest,
  Hypothesis) in every worker: ~1-2 s once.
* ``timeout`` bounds each collective wait, and a rank waiting in a collective
  also waits for its peers' compilation: give compile-heavy jobs a generous
  ``timeout`` (start-up and group rebuilds use ``start_timeout / 2``).

Failure handling
----------------
* A rank raising makes :meth:`RankPool.run` raise :class:`RankError` naming
  every failing rank (type, message, traceback excerpt), or, with
  ``return_exceptions=True``, returns the exceptions in the result list.
* A collective that some rank skipped times out after ``timeout`` seconds (the
  gloo timeout) on the waiting ranks and is reported the same way; the message
  lists how many collectives each rank issued on each group.
* After any failing job all ranks rebuild their process groups (fresh store,
  fresh connections: ~0.1-1 s, no process restart), so half-done collectives
  cannot leak into the next job.
* If ranks do not answer within ``job_timeout`` or a rank process dies, all
  workers are killed, :class:`RankTimeout` is raised, and the next ``run``
  starts a fresh pool (a few seconds).
* If every rank returns normally but ranks issued different numbers of
  collectives on a group (a program that would hang or mix up data in a real
  run), :class:`CollectiveMismatch` is raised (``check_collectives=False`` to
  allow it).
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
import weakref
from datetime import timedelta
from multiprocessing.connection import wait as _wait_any
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveMismatch",
    "RankEnv",
    "RankError",
    "RankPool",
    "RankTimeout",
    "RemoteError",
    "run_on_ranks",
]

# Extra seconds granted beyond a gloo timeout for a rank to notice and report.
_MARGIN_S = 10.0
# Lines of remote traceback kept per rank in RankError messages.
_TB_LINES = 14


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class RankError(RuntimeError):
    """One or more ranks of a job failed.

    ``exceptions`` maps rank -> exception (the original class when it could be
    pickled, else :class:`RemoteError`); each carries ``rank`` and
    ``remote_traceback`` attributes.
    """

    def __init__(self, message: str, exceptions: dict[int, BaseException] | None = None):
        super().__init__(message)
        self.exceptions: dict[int, BaseException] = dict(exceptions or {})


class RankTimeout(RankError):
    """Some ranks did not answer within ``job_timeout`` or their process died.

    ``ranks`` lists the ranks that did not answer.  The pool's processes were
    killed; the next :meth:`RankPool.run` starts fresh ones.
    """

    def __init__(
        self,
        message: str,
        ranks: list[int] | None = None,
        exceptions: dict[int, BaseException] | None = None,
    ):
        super().__init__(message, exceptions)
        self.ranks: list[int] = list(ranks or [])


class CollectiveMismatch(RankError):
    """All ranks returned, but they issued different numbers of collectives.

    ``results`` holds the per-rank results that were returned.
    """

    def __init__(self, message: str, results: list | None = None):
        super().__init__(message)
        self.results = results


class RemoteError(Exception):
    """Stand-in for a rank's exception whose class could not be pickled."""

    def __init__(self, type_name: str, message: str, remote_traceback: str = "", rank: int = -1):
        super().__init__(type_name, message, remote_traceback, rank)
        self.type_name = type_name
        self.message = message
        self.remote_traceback = remote_traceback
        self.rank = rank

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"


class _RemoteTraceback(Exception):
    """Carries a rank's formatted traceback as an exception ``__cause__``."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n" + self.tb


# --------------------------------------------------------------------------
# What a job sees
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RankEnv:
    """Per-rank context passed as the first argument of a job function.

    ``group`` is a gloo process group of exactly ranks ``0..world_size-1``
    (the job's ranks), usable with ``torch.distributed`` and funcol.
    """

    rank: int
    world_size: int
    group: Any  # torch.distributed.ProcessGroup

    def mesh(self, dim_name: str | None = None):
        """A 1-D CPU ``DeviceMesh`` over ``group`` (optionally named)."""
        from torch.distributed.device_mesh import DeviceMesh

        names = (dim_name,) if dim_name is not None else None
        return DeviceMesh.from_group(self.group, "cpu", mesh_dim_names=names)


# --------------------------------------------------------------------------
# Serialisation helpers
# --------------------------------------------------------------------------


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    # detach: non-leaf tensors requiring grad refuse to pickle; clone: a view
    # would otherwise ship its whole storage; cpu: results always land on CPU.
    return t.detach().to("cpu", copy=True)


def _to_plain(obj: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: _plain_tensor(x) if isinstance(x, torch.Tensor) else x, obj)


def _pack_exception(exc: BaseException) -> bytes:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not lose the report
        message = f"<unprintable {type(exc).__name__}>"
    blob = None
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt
    except Exception:  # noqa: BLE001
        blob = None
    info = {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": message,
        "traceback": tb,
        "pickled": blob,
    }
    return pickle.dumps(info)


def _unpack_exception(payload: bytes, rank: int) -> BaseException:
    info = pickle.loads(payload)
    exc: BaseException | None = None
    if info["pickled"] is not None:
        try:
            exc = pickle.loads(info["pickled"])
        except Exception:  # noqa: BLE001
            exc = None
    if not isinstance(exc, BaseException):
        exc = RemoteError(info["type"], info["message"], info["traceback"], rank)
    try:
        exc.rank = rank  # type: ignore[attr-defined]
        exc.remote_traceback = info["traceback"]  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - exceptions with __slots__
        pass
    exc.__cause__ = _RemoteTraceback(info["traceback"])
    return exc


def _type_name(exc: BaseException) -> str:
    if isinstance(exc, RemoteError):
        return exc.type_name
    t = type(exc)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _tb_excerpt(exc: BaseException) -> str:
    """The remote traceback without the pool's own frame, head and tail if long."""
    tb = getattr(exc, "remote_traceback", "") or ""
    lines = tb.rstrip().splitlines()
    for i, line in enumerate(lines):  # drop "Traceback ..." + the run_job frame
        if line.strip().startswith("result = fn(env, *args, **kwargs)"):
            j = i + 1
            while j < len(lines) and set(lines[j].strip()) <= {"^", "~"} and lines[j].strip():
                j += 1
            lines = lines[j:]
            break
    if len(lines) > _TB_LINES:
        head = _TB_LINES // 2
        lines = lines[:head] + ["..."] + lines[-(_TB_LINES - head) :]
    return "\n".join("    " + line for line in lines)


def _fn_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# --------------------------------------------------------------------------
# Worker process
# --------------------------------------------------------------------------


class _Worker:
    """State of one rank process: its groups and the job loop."""

    def __init__(self, rank: int, max_world_size: int, store_dir: str, timeout_s: float, setup_timeout_s: float):
        self.rank = rank
        self.max_world_size = max_world_size
        self.store_dir = store_dir
        self.timeout = timedelta(seconds=timeout_s)
        # Rendezvous (init, new_group, warm-up) gets a generous bound of its
        # own: on a loaded machine peers reach it seconds apart, and a short
        # gloo timeout there makes a rank give up and close its listener.
        self.setup_timeout = timedelta(seconds=max(timeout_s, setup_timeout_s))
        self.groups: dict[int, Any] = {}
        self.sys_path: list[str] | None = None

    # process groups ---------------------------------------------------------

    def init_groups(self, generation: int, warm_up: bool = False) -> None:
        path = os.path.join(self.store_dir, f"store.{generation}")
        dist.init_process_group(
            "gloo",
            init_method=f"file://{path}",
            rank=self.rank,
            world_size=self.max_world_size,
            timeout=self.setup_timeout,
        )
        # Every rank must create every sub-group, in the same order.
        self.groups = {
            n: dist.new_group(ranks=list(range(n)), timeout=self.setup_timeout)
            for n in range(1, self.max_world_size + 1)
        }
        if warm_up:
            self.warm_up()
        self._set_timeout(self.timeout)

    def reset_groups(self, generation: int) -> None:
        self.groups = {}
        dist.destroy_process_group()
        self.init_groups(generation)

    def _member_groups(self) -> dict[Any, Any]:
        out: dict[Any, Any] = {"world": dist.distributed_c10d._get_default_group()}
        for n, g in self.groups.items():
            if self.rank < n:
                out[n] = g
        return out

    def _seq_numbers(self) -> dict[Any, int]:
        out = {}
        for key, g in self._member_groups().items():
            try:
                out[key] = int(g._get_sequence_number_for_group())
            except Exception:  # noqa: BLE001 - private API; counting is best effort
                pass
        return out

    def _set_timeout(self, td: timedelta) -> None:
        for g in self._member_groups().values():
            try:
                g.set_timeout(td)
            except Exception:  # noqa: BLE001
                pass

    def warm_up(self) -> None:
        import torch.distributed._functional_collectives as funcol

        g = self.groups[self.max_world_size]
        x = torch.ones(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, g))
        if out.numel() != self.max_world_size:
            raise RuntimeError(f"funcol warm-up gathered {out.numel()} elements")

    # jobs ------------------------------------------------------------------------

    def _sync_sys_path(self, sys_path: list[str]) -> None:
        if sys_path != self.sys_path:
            sys.path[:] = sys_path
            importlib.invalidate_caches()
            self.sys_path = list(sys_path)

    def run_job(self, sys_path: list[str], timeout_s: float, world_size: int, job: bytes) -> tuple:
        t0 = time.perf_counter()
        self._sync_sys_path(sys_path)
        before = self._seq_numbers()
        custom_timeout = timeout_s != self.timeout.total_seconds()
        if custom_timeout:
            self._set_timeout(timedelta(seconds=timeout_s))
        try:
            fn, args, kwargs = _loads(job)
            env = RankEnv(self.rank, world_size, self.groups[world_size])
            result = fn(env, *args, **kwargs)
            try:
                payload = _dumps(_to_plain(result))
            except Exception as e:  # noqa: BLE001
                raise TypeError(
                    f"rank {self.rank}: result of type {type(result).__name__} cannot be serialised "
                    f"with torch.save ({type(e).__name__}: {e}); return tensors / plain data"
                ) from e
            ok = True
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
            ok = False
            payload = _pack_exception(e)
        finally:
            if custom_timeout:
                self._set_timeout(self.timeout)
        after = self._seq_numbers()
        counts = {k: after[k] - before.get(k, 0) for k in after}
        return ("result", ok, payload, counts, time.perf_counter() - t0)


def _worker_main(
    rank: int,
    max_world_size: int,
    store_dir: str,
    timeout_s: float,
    setup_timeout_s: float,
    conn,
    parent_pid: int,
    warmup,
):
    """Entry point of a rank process (spawned)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    torch.set_num_threads(1)
    worker = _Worker(rank, max_world_size, store_dir, timeout_s, setup_timeout_s)
    try:
        t0 = time.perf_counter()
        worker.init_groups(0, warm_up=True)
        if warmup is not None:
            worker._set_timeout(worker.setup_timeout)
            warmup(RankEnv(rank, max_world_size, worker.groups[max_world_size]))
            worker._set_timeout(worker.timeout)
        conn.send(("ready", os.getpid(), time.perf_counter() - t0))
    except BaseException as e:  # noqa: BLE001
        try:
            conn.send(("start_error", _pack_exception(e)))
        finally:
            _hard_exit(1)
    while True:
        try:
            if not conn.poll(0.5):
                if os.getppid() != parent_pid:  # parent died: reparented
                    break
                continue
            msg = conn.recv()
        except (EOFError, OSError):  # parent closed its end / died
            break
        kind = msg[0]
        try:
            if kind == "job":
                conn.send(worker.run_job(*msg[1:]))
            elif kind == "reset":
                try:
                    worker.reset_groups(msg[1])
                    conn.send(("reset_ok",))
                except BaseException as e:  # noqa: BLE001
                    conn.send(("reset_error", _pack_exception(e)))
            else:  # "stop" or unknown
                break
        except (EOFError, OSError, BrokenPipeError):
            break
    _hard_exit(0)


def _hard_exit(code: int) -> None:
    # Skip interpreter teardown: destructors of half-broken gloo groups and
    # compile worker pools can block; the parent owns all cleanup.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------


def _shutdown(procs: list, conns: list, store_dir: str, graceful: bool) -> None:
    """Stop worker processes (bounded: ~2 s graceful, then SIGKILL)."""
    if graceful:
        for c in conns:
            try:
                c.send(("stop",))
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + 2.0
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(2.0)
    for c in conns:
        try:
            c.close()
        except Exception:  # noqa: BLE001
            pass
    shutil.rmtree(store_dir, ignore_errors=True)


class RankPool:
    """Persistent gloo rank processes that run job functions on 1..max_world_size ranks.

    Args:
        max_world_size: number of rank processes (largest ``world_size`` a job may use).
        timeout: gloo timeout in seconds: bound on every collective wait.  A
            collective that some rank never joins fails after this long.
        job_timeout: bound on a whole job (compilation included).  Past it the
            workers are killed and :class:`RankTimeout` is raised.
        start_timeout: bound on starting the pool (spawn, torch import, funcol warm-up).
        warmup: optional module-level ``fn(env)`` run on all ranks after start
            (e.g. to import heavy modules once); ``env.world_size == max_world_size``.

    Processes start lazily on the first :meth:`run` (or explicitly with
    :meth:`start`).  Use as a context manager or call :meth:`close`.
    Not reentrant: concurrent ``run`` calls from threads are serialised.

    Attributes (read-only, for diagnostics): ``start_seconds`` (duration of the
    last start), ``starts`` (process starts so far), ``resets`` (group rebuilds
    after failing jobs).
    """

    def __init__(
        self,
        max_world_size: int = 4,
        timeout: float = 20.0,
        *,
        job_timeout: float = 300.0,
        start_timeout: float = 180.0,
        warmup: Callable[[RankEnv], None] | None = None,
    ):
        if max_world_size < 1:
            raise ValueError(f"max_world_size must be >= 1, got {max_world_size}")
        if timeout <= 0 or job_timeout <= 0 or start_timeout <= 0:
            raise ValueError("timeouts must be positive")
        self.max_world_size = int(max_world_size)
        self.timeout = float(timeout)
        self.job_timeout = float(job_timeout)
        self.start_timeout = float(start_timeout)
        self.warmup = warmup
        self.start_seconds: float | None = None
        self.starts = 0
        self.resets = 0
        self._lock = threading.RLock()
        self._procs: list | None = None
        self._conns: list | None = None
        self._store_dir: str | None = None
        self._generation = 0
        self._finalizer: weakref.finalize | None = None
        self._closed = False

    # lifecycle ---------------------------------------------------------------

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._procs else "idle")
        return f"RankPool(max_world_size={self.max_world_size}, timeout={self.timeout}, {state})"

    @property
    def started(self) -> bool:
        return self._procs is not None

    def start(self) -> None:
        """Start the rank processes now (no-op when running)."""
        with self._lock:
            self._ensure_started()

    def close(self) -> None:
        """Stop all rank processes.  Bounded (a few seconds at most); idempotent."""
        with self._lock:
            self._closed = True
            self._discard(graceful=True)

    def _discard(self, graceful: bool) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._procs is not None:
            procs, conns, store_dir = self._procs, self._conns, self._store_dir
            self._procs = self._conns = self._store_dir = None
            _shutdown(procs, conns, store_dir, graceful)

    def _alive(self) -> bool:
        return self._procs is not None and all(p.is_alive() for p in self._procs)

    def _ensure_started(self) -> None:
        if self._closed:
            raise RuntimeError("RankPool is closed")
        if self._procs is not None:
            if self._alive():
                return
            self._discard(graceful=False)  # a worker died between jobs
        t0 = time.perf_counter()
        ctx = multiprocessing.get_context("spawn")
        store_dir = tempfile.mkdtemp(prefix="fcp-rankpool-")
        procs, conns = [], []
        try:
            for r in range(self.max_world_size):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                p = ctx.Process(
                    target=_worker_main,
                    args=(
                        r,
                        self.max_world_size,
                        store_dir,
                        self.timeout,
                        self.start_timeout / 2,
                        child_conn,
                        os.getpid(),
                        self.warmup,
                    ),
                    name=f"fcp-rank{r}",
                    daemon=True,
                )
                p.start()
                child_conn.close()
                procs.append(p)
                conns.append(parent_conn)
            self._generation = 0
            ready = self._collect(procs, conns, range(self.max_world_size), self.start_timeout)
        except BaseException:
            _shutdown(procs, conns, store_dir, graceful=False)
            raise
        failed = {r: m for r, m in ready.replies.items() if m[0] != "ready"}
        if failed or ready.pending:
            _shutdown(procs, conns, store_dir, graceful=False)
            lines = [f"RankPool failed to start ({self.max_world_size} ranks):"]
            excs = {}
            for r, m in sorted(failed.items()):
                excs[r] = _unpack_exception(m[1], r)
                lines.append(f"--- rank {r}: {_type_name(excs[r])}: {excs[r]}\n{_tb_excerpt(excs[r])}")
            for r in ready.pending:
                if r in ready.dead:
                    lines.append(f"--- rank {r}: died (exit code {ready.dead[r]})")
                else:
                    lines.append(f"--- rank {r}: no answer in {self.start_timeout:g}s")
            raise RankError("\n".join(lines), excs)
        self._procs, self._conns, self._store_dir = procs, conns, store_dir
        self._finalizer = weakref.finalize(self, _shutdown, procs, conns, store_dir, False)
        self.start_seconds = time.perf_counter() - t0
        self.starts += 1

    class _Collected:
        def __init__(self):
            self.replies: dict[int, tuple] = {}
            self.pending: list[int] = []
            self.dead: dict[int, int | None] = {}

    def _collect(self, procs, conns, ranks, timeout: float) -> RankPool._Collected:
        """Wait for one message from each of ``ranks``; stop early if one dies."""
        out = RankPool._Collected()
        pending = set(ranks)
        by_conn = {id(conns[r]): r for r in pending}
        by_sentinel = {procs[r].sentinel: r for r in pending}
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
            for obj in _wait_any(waitables, timeout=remaining):
                if isinstance(obj, int):
                    r = by_sentinel[obj]
                    if r in pending and not conns[r].poll(0):
                        procs[r].join(0.1)
                        out.dead[r] = procs[r].exitcode
                    continue
                r = by_conn[id(obj)]
                if r not in pending:
                    continue
                try:
                    out.replies[r] = obj.recv()
                    pending.discard(r)
                except (EOFError, OSError):
                    procs[r].join(0.5)
                    out.dead[r] = procs[r].exitcode
            if out.dead or any(str(m[0]).endswith("_error") for m in out.replies.values()):
                break  # a rank died or failed to set up: the others may wait forever
        out.pending = sorted(pending)
        return out

    def _reset_groups(self, timeout: float) -> bool:
        """Rebuild all process groups on all ranks; kill the pool if that fails."""
        self._generation += 1
        try:
            for c in self._conns:
                c.send(("reset", self._generation))
            bound = max(timeout, self.timeout, self.start_timeout / 2) + _MARGIN_S
            got = self._collect(self._procs, self._conns, range(self.max_world_size), bound)
            ok = not got.pending and all(m[0] == "reset_ok" for m in got.replies.values())
        except (OSError, EOFError):
            ok = False
        if ok:
            self.resets += 1
        else:
            self._discard(graceful=False)
        return ok

    # jobs ----------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        /,
        *args: Any,
        return_exceptions: bool = False,
        timeout: float | None = None,
        job_timeout: float | None = None,
        check_collectives: bool = True,
        **kwargs: Any,
    ) -> list:
        """Run ``fn(env, *args, **kwargs)`` on ranks ``0..world_size-1``; return per-rank results.

        Args:
            fn: module-level function taking a :class:`RankEnv` first.
            world_size: number of ranks (1..max_world_size).
            return_exceptions: put each failing rank's exception in the result
                list instead of raising :class:`RankError`.
            timeout: gloo timeout for this job (default: the pool's ``timeout``).
            job_timeout: bound on the whole job (default: the pool's
                ``job_timeout``, raised to at least ``timeout`` + 10 s so that
                collective timeouts are reported as rank errors first).
            check_collectives: raise :class:`CollectiveMismatch` when all ranks
                returned but issued different numbers of collectives on a group.

        Raises:
            RankError: a rank raised (lists every failing rank).
            RankTimeout: a rank did not answer in time or its process died.
            CollectiveMismatch: see ``check_collectives``.
            TypeError: ``fn`` or the arguments cannot be pickled.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        if not 1 <= world_size <= self.max_world_size:
            raise ValueError(f"world_size must be in 1..{self.max_world_size}, got {world_size}")
        timeout = self.timeout if timeout is None else float(timeout)
        if job_timeout is None:  # leave time for gloo timeouts to be reported
            job_timeout = max(self.job_timeout, timeout + _MARGIN_S)
        job_timeout = float(job_timeout)
        try:
            job = _dumps((fn, args, kwargs))
        except Exception as e:  # noqa: BLE001
            raise TypeError(
                f"cannot send job {_fn_name(fn)} to the ranks: {type(e).__name__}: {e} "
                "(fn must be a module-level function; args/kwargs must be picklable)"
            ) from e
        with self._lock:
            self._ensure_started()
            try:
                return self._run_locked(fn, world_size, job, timeout, job_timeout, return_exceptions, check_collectives)
            except RankError:
                raise
            except BaseException:
                # Interrupted mid-job (KeyboardInterrupt, pytest-timeout, ...):
                # workers may be busy; never reuse them.
                self._discard(graceful=False)
                raise

    def _run_locked(self, fn, world_size, job, timeout, job_timeout, return_exceptions, check_collectives) -> list:
        sys_path = list(sys.path)
        for r in range(world_size):
            self._conns[r].send(("job", sys_path, timeout, world_size, job))
        got = self._collect(self._procs, self._conns, range(world_size), job_timeout)
        name = _fn_name(fn)

        excs: dict[int, BaseException] = {}
        results: list = [None] * world_size
        counts: dict[int, dict] = {}
        for r, msg in sorted(got.replies.items()):
            _, ok, payload, counts[r], _elapsed = msg
            if ok:
                try:
                    results[r] = _loads(payload)
                except Exception as e:  # noqa: BLE001
                    e.rank = r  # type: ignore[attr-defined]
                    e.remote_traceback = traceback.format_exc()  # type: ignore[attr-defined]
                    excs[r] = e
            else:
                excs[r] = _unpack_exception(payload, r)

        if got.pending:
            self._discard(graceful=False)
            lines = [
                f"{name} on {world_size} ranks: rank(s) {got.pending} did not answer; "
                "pool killed (restarts on next run)"
            ]
            for r in got.pending:
                if r in got.dead:
                    lines.append(f"--- rank {r}: process died (exit code {got.dead[r]})")
                else:
                    lines.append(f"--- rank {r}: no answer within job_timeout={job_timeout:g}s")
            lines += self._describe_failures(excs)
            raise RankTimeout("\n".join(lines), got.pending, excs)

        mismatch = self._count_mismatch(world_size, counts)
        if excs or (mismatch and check_collectives):
            self._reset_groups(timeout)
        if excs:
            if return_exceptions:
                for r, e in excs.items():
                    results[r] = e
                return results
            ok_ranks = [r for r in range(world_size) if r not in excs]
            lines = [f"{len(excs)} of {world_size} ranks raised in {name}:"]
            lines += self._describe_failures(excs)
            if ok_ranks:
                lines.append(f"rank(s) {ok_ranks} returned normally.")
            if any("imed out" in str(e) for e in excs.values()):
                lines.append(
                    f"hint: a collective timed out (timeout={timeout:g}s): some rank skipped it or issued another one."
                )
            if mismatch:
                lines.append(mismatch)
            first = excs[min(excs)]
            raise RankError("\n".join(lines), excs) from first
        if mismatch and check_collectives:
            raise CollectiveMismatch(f"all {world_size} ranks of {name} returned, but {mismatch}", results)
        return results

    @staticmethod
    def _describe_failures(excs: dict[int, BaseException]) -> list[str]:
        return [f"--- rank {r}: {_type_name(e)}: {e}\n{_tb_excerpt(e)}" for r, e in sorted(excs.items())]

    def _count_mismatch(self, world_size: int, counts: dict[int, dict]) -> str:
        """Describe groups on which the job's ranks issued different numbers of collectives."""
        problems = []
        keys = sorted({k for c in counts.values() for k in c}, key=str)
        for key in keys:
            size = self.max_world_size if key == "world" else key
            per_rank = {}
            for r in range(size):
                if r >= world_size:
                    per_rank[r] = 0  # idle ranks issue nothing
                elif r in counts and key in counts[r]:
                    per_rank[r] = counts[r][key]
            if len(set(per_rank.values())) > 1:
                label = "the default group" if key == "world" else f"the {key}-rank group"
                desc = ", ".join(f"rank {r}: {n}" for r, n in per_rank.items())
                problems.append(f"collectives issued on {label}: {desc}")
        return "; ".join(problems)


def run_on_ranks(fn: Callable[..., Any], world_size: int, /, *args: Any, timeout: float = 20.0, **kwargs: Any) -> list:
    """One-off: start a pool of ``world_size`` ranks, run ``fn`` once, close it.

    Costs a pool start (seconds) per call; tests should share a
    :class:`RankPool` (the ``rank_pool`` fixture) instead.
    """
    with RankPool(max_world_size=world_size, timeout=timeout) as pool:
        return pool.run(fn, world_size, *args, **kwargs)
