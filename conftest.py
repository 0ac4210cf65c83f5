"""Shared pytest configuration for ``tests/`` and ``property_tests/``.

* ``rank_pool``: a session-wide :class:`tests.support.rank_pool.RankPool` of 4 gloo rank
  processes (started when first requested, ~5 s); see ``fcp/testing.py``.
* ``hf_references``: transformers' per-document outputs and gradients for every family and
  variant of :mod:`tests.support.hf_families`, from one subprocess per session.
* ``@pytest.mark.gpu`` tests are skipped cleanly when CUDA is unavailable.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.rank_pool import RankPool

# Gloo timeout for every collective wait in pool jobs.  A job whose ranks
# disagree on collectives fails after this long.  It is generous because a
# rank waiting in a collective also waits for its peers' torch.compile (4
# ranks compiling on 2 shared cores skew by many seconds); pass ``timeout=``
# to ``rank_pool.run`` for a shorter bound in tests that provoke hangs.
RANK_POOL_TIMEOUT_S = 60.0


@pytest.fixture(scope="session")
def rank_pool():
    """Persistent 4-rank gloo pool: ``rank_pool.run(fn, world_size, *args)``."""
    with RankPool(max_world_size=4, timeout=RANK_POOL_TIMEOUT_S) as pool:
        pool.start()  # pay the start-up here, not inside the first (Hypothesis) example
        yield pool


@pytest.fixture(scope="session")
def hf_references():
    from tests.support import hf_families

    return hf_families.references()


def pytest_configure(config):
    # Also declared in pyproject.toml; repeated so the hook works without it.
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped cleanly without one")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
