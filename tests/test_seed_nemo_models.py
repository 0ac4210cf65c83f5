"""The real client: NeMo AutoModel 0.7.0's own GLM-5.3-Flash and Qwen3.8-Flash-Next model code runs
with fcp's cp modules substituted for NeMo's and gives the same logits and gradients, single
process and on 2 gloo ranks (``tests/support/nemo_models.py`` says what runs where and why).

NeMo's model code runs in a fresh 2-rank pool, never in the pytest process: it imports
transformers, and Qwen's gated-delta layers need FLA blocked to take their CPU fallbacks. Qwen runs
first (FLA blocked), GLM last (its CP planning imports FLA).
"""

from __future__ import annotations

import pytest

pytest.importorskip("nemo_automodel")
pytest.importorskip("transformers")

from tests.support import nemo_models  # noqa: E402
from tests.support.rank_pool import RankPool  # noqa: E402

#: fcp's CP result versus the non-CP forward of the same weights (fp32 reduction order).
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def results():
    out = {}
    with RankPool(max_world_size=2, timeout=120.0, job_timeout=400.0) as pool:
        pool.start()
        out["qwen"] = pool.run(nemo_models.qwen_single_job, 1)[0]
        for rank_result in pool.run(nemo_models.qwen_cp_job, 2):
            _merge(out["qwen"], rank_result)
        out["glm"] = {}
        for rank_result in pool.run(nemo_models.glm_job, 2):  # last: lets FLA be imported
            _merge(out["glm"], rank_result)
    return out


def _merge(into: dict, rank_result: dict) -> None:
    """Worst case over ranks of ``(diff, scale)``."""
    for key, (diff, scale) in rank_result.items():
        old = into.get(key, (0.0, 0.0))
        into[key] = (max(old[0], diff), max(old[1], scale))


def test_glm_single_process_matches_nemo(results):
    """Through the sharder and through the model's own context building (indexed mask,
    cu_seqlens)."""
    for key in ("single/sharder", "single/attention_mask", "single/cu_seqlens"):
        assert results["glm"][key][0] == 0.0, (key, results["glm"][key])


def test_glm_cp_matches_nemo_like_with_like(results):
    """KDA + DSA on 2 ranks: NeMo's CPU KDA ignores the CP context (each rank's shard runs as one
    sequence), in both runs alike; fcp's cp module changes nothing in that."""
    assert results["glm"]["cp/kda+dsa/nemo-vs-fcp"][0] == 0.0


def test_glm_dsa_cp_matches_nemo_and_the_non_cp_forward(results):
    assert results["glm"]["cp/dsa+dsa/nemo-vs-fcp"][0] == 0.0
    diff, scale = results["glm"]["cp/dsa+dsa/fcp-vs-non-cp"]
    assert diff <= REL_TOL * scale, (diff, scale)


def test_qwen_single_process_matches_nemo(results):
    """GDN + QSA + PLE through the sharder; a packed non-CP forward from ``seq_lens``."""
    for key in ("single/sharder", "single/seq_lens"):
        assert results["qwen"][key][0] == 0.0, (key, results["qwen"][key])


@pytest.mark.parametrize("case", ["unpacked", "cu_seqlens", "seq_lens"])
def test_qwen_cp_matches_nemo_and_the_non_cp_forward(results, case):
    assert results["qwen"][f"cp/{case}/nemo-vs-fcp"][0] == 0.0
    diff, scale = results["qwen"][f"cp/{case}/fcp-vs-non-cp"]
    assert diff <= REL_TOL * scale, (diff, scale)
