"""transformers' Mamba2 hybrids (Nemotron-H, Granite 4.0-H, Falcon-H1, Bamba) and LFM2 / LFM2-MoE
on fcp: configuration variants that take other branches of the adapters.

Every family's per-document parity, replacement contract, ``*ForCausalLM`` wrapper and compiled
mixers are in ``tests/test_hf_families.py``. Here the variants of
:data:`tests.support.hf_families.VARIANTS` (Falcon-H1 without its gated norm, Granite 4.0-H
without RoPE) meet the same contract on two ranks, with the same reference subprocess and
tolerances: outputs to 1e-5; every parameter's gradient summed over the CP ranks to 1e-5 relative
to the larger of its own largest entry and a tenth of the model's largest.
"""

from __future__ import annotations

import pytest

from tests import _hf_rank_fns as fns
from tests.support.hf_families import VARIANTS


@pytest.mark.parametrize("case", sorted(VARIANTS))
def test_configuration_variants_on_two_ranks(rank_pool, hf_references, case):
    family, config = VARIANTS[case]
    rows = [[7, 2], [5, 0, 4]]
    fns.check(hf_references[case], rows, fns.run(rank_pool, hf_references[case], family, config,
                                                 2, rows, 40))  # fmt: skip


@pytest.mark.parametrize("case", sorted(VARIANTS))
def test_without_a_context_the_original_code_runs(hf_references, case):
    assert hf_references[case]["no_context_max_diff"] == 0.0
