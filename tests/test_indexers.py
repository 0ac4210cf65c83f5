"""What both indexers must do: GLM-5.3-Flash's DSA k-pool indexer (:mod:`fcp.ops.kpool_indexer`,
``"kpool"``) and Qwen3.8-Flash-Next's QSA selection (:mod:`fcp.ops.qsa_indexer`, ``"qsa"``), each
test parametrised by the indexer.

* the ids equal the float64 per-query reference's (``reference.py``), row layout and width
  included, on every row but those whose order a near tie in float rounding decides (counted,
  exempt, under 5%);
* CP on real gloo ranks selects the same ids as one process, bitwise, with pools / compressed
  blocks straddling rank boundaries and a local length shorter than one (3 < 4);
* per rank CP moves only the reduced keys of the other ranks and a halo of ``stride - 1``
  tokens (counted bytes);
* one ``fullgraph`` compilation serves every packing, without host syncs, giving the eager ids.

Each indexer's own semantics (ties, the slot table, transformers / NeMo, argument errors):
``tests/test_kpool_indexer.py`` and ``tests/test_qsa_indexer.py``.
"""

from __future__ import annotations

import pytest
import torch

from fcp.context import PackedContext
from tests import _attention_rank_fns as fns
from tests._attention_rank_fns import one_thread  # noqa: F401 (autouse fixture)
from tests.support.inputs import index_inputs
from tests.support.packing import packing, random_packings

#: per indexer: the option sets checked against the reference ...
OPTIONS = {
    "kpool": [dict(topk=8, kpool=4), dict(topk=4, kpool=4),
              dict(topk=8, kpool=4, select_tail=False), dict(topk=6, kpool=2),
              dict(topk=3, kpool=1), dict(topk=9, kpool=3)],
    "qsa": [dict(budget=8, ratio=4), dict(budget=4, ratio=2), dict(budget=12, ratio=3),
            dict(budget=3, ratio=1)],
}  # fmt: skip
#: ... on these packings, ``(seq, *rows of document lengths)``
PACKINGS = {
    "kpool": {"one_doc": (40, [40]), "pad_tail": (40, [13, 3, 19]),
              "tiny_docs": (24, [1, 2, 1, 3, 1, 5, 4, 6]), "two_rows": (32, [17, 15], [2, 9, 21])},
    "qsa": {"one_doc": (48, [48]), "pad_tail": (48, [21, 3, 19]),
            "tiny_docs": (24, [1, 2, 1, 3, 1, 5, 4, 6]), "two_rows": (40, [27, 13], [2, 9, 29])},
}  # fmt: skip


def row_width(name: str, kw: dict) -> int:
    """Ids per query: the selection, then (k-pool: unless ``select_tail=False``) the tail."""
    if name == "qsa":
        return kw["budget"] + kw["ratio"] - 1
    return kw["topk"] + (kw["kpool"] - 1 if kw.get("select_tail", True) else 0)


#: per indexer: its options, and the channels of its halo (kpool: index_k and gate_logits;
#: qsa: index_k and the RoPE tables cos, sin) for index_dim 8
INDEXERS = {
    "kpool": (dict(topk=8, kpool=4), 2 * 8),
    "qsa": (dict(budget=8, ratio=4), 8 + fns.ROTARY),
}


@pytest.mark.parametrize(
    "name,kw,layout",
    [pytest.param(name, kw, layout, id=f"{name}-{pack}-{kw}") for name in OPTIONS
     for pack, layout in PACKINGS[name].items() for kw in OPTIONS[name]],
)  # fmt: skip
def test_matches_reference(name, kw, layout):
    doc_ids = packing(*layout)
    seed = {"kpool": 3, "qsa": 4}[name]
    inputs = index_inputs(seed, *doc_ids.shape, index_heads=3, kpool=kw.get("kpool", 4))
    got = fns.single_process(name, inputs, doc_ids, kw, None)["out"]
    want, near, _ = fns.reference_ids(name, inputs, doc_ids, kw)
    assert got.shape == want.shape == (*doc_ids.shape, row_width(name, kw))
    assert got.dtype == torch.int64
    differs = (got != want).any(-1)
    assert not (differs & ~near).any(), (differs & ~near).nonzero().tolist()
    assert near.float().mean() < 0.05, "too many near-tie rows for a meaningful test"


@pytest.mark.parametrize(
    "name,world_size,local,first,seed",
    [("kpool", 2, 10, 2, 9), ("kpool", 4, 3, 2, 9), ("kpool", 4, 8, 2, 9),
     ("qsa", 2, 14, 3, 10), ("qsa", 4, 3, 3, 10), ("qsa", 4, 8, 3, 10)],
)  # fmt: skip
def test_cp_equals_single_process_bitwise(rank_pool, name, world_size, local, first, seed):
    seq = world_size * local
    doc_ids = packing(seq, [first, seq - first - 3], [seq])
    inputs = index_inputs(seed, 2, seq)
    kw = INDEXERS[name][0]
    fns.check_cp(rank_pool, name, world_size, inputs, doc_ids, kw, None, tol=None)  # bitwise


@pytest.mark.parametrize("name", list(INDEXERS))
def test_cp_moves_reduced_keys_and_a_halo_only(rank_pool, name):
    """3 ranks x 10 tokens, 2 rows, index_dim 8, fp32: per rank ``ceil(10 / 4) = 3`` pooled /
    compressed keys from each of the 2 other ranks (all-gather), and the ``4 - 1`` tokens
    before its interval (halo; not rank 0)."""
    kw, halo_channels = INDEXERS[name]
    batch, local, di, stride = 2, 10, 8, 4
    doc_ids = packing(3 * local, [7, 23], [30])
    inputs = index_inputs(1, batch, 3 * local, index_dim=di)
    got = rank_pool.run(fns.cp_bytes_rank, 3, name, inputs, doc_ids, kw)
    keys = 2 * batch * 3 * di * 4
    halo = (stride - 1) * batch * halo_channels * 4
    assert got == [keys, keys + halo, keys + halo]


@pytest.mark.parametrize(
    "name,kw,seed", [("kpool", dict(topk=4, kpool=4), 3), ("qsa", dict(budget=4, ratio=2), 4)]
)
def test_compile_no_recompile(name, kw, seed):
    frames, forbidden, worst, graphs = fns.compile_packings(
        name, index_inputs(2, 2, 16), random_packings(6, 2, 16, seed=seed), kw, None, PackedContext
    )
    assert frames == 1 and graphs >= 1 and forbidden == [] and worst == 0.0, (frames, forbidden)
