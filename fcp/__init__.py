"""fcp: torch.compile-native contiguous context parallelism for packed-document training.

Layers, bottom up (a module imports only its own layer or lower ones; the table is
``tests/test_architecture.py``'s, which checks it):

0. :mod:`fcp.checks`, :mod:`fcp.layout`, :mod:`fcp.groups`, :mod:`fcp.pytree`, :mod:`fcp.scan` -
   the argument vocabulary, document ids / boundaries / positions and their validation, CP group
   resolution, the pytree helper, and affine state maps composed by a log-depth scan;
1. :mod:`fcp.context` - :class:`PackedContext` (the replicated map, this rank's interval, the
   band);
2. :mod:`fcp.comm` - funcol collectives: sequence gather, backward anchor, left halo, state chain,
   pieces of the sequence sent to the ranks that compute them (query balancing);
3. :mod:`fcp.shard`, :mod:`fcp.loss` - :func:`shard_batch` and its inverse
   :func:`gather_sequence`; exact loss normalisation across data and context parallelism;
4. :mod:`fcp.ops` and :mod:`fcp.ops.kit` - the operators' package and what they share;
5. ``fcp.ops.<operator>`` - one folder per operator (short conv, KDA, gated linear attention,
   attention, indexers, ...), with its reference; never another operator's folder;
6. :mod:`fcp.models` (the NeMo seed adapters: GLM-5.3-Flash, Qwen3.8-Flash-Next) and
   :mod:`fcp.integrations` (transformers models on fcp: :mod:`fcp.integrations.hf`);
7. :mod:`fcp` itself - the public namespace below.

``fcp.loss`` is imported with ``fcp``; ``fcp.integrations`` and ``fcp.models`` on first use
(``fcp.integrations.hf.enable_packed_cp`` works right after ``import fcp``). The documentation
site (``make docs``) has the guides and the API reference.
"""

import importlib

from fcp.layout import PAD_DOC_ID, doc_ids_from_cu_seqlens, doc_ids_from_seq_lens, document_starts
from fcp.layout import lengths_from_doc_ids, packed_boundaries_from_seq_lens
from fcp.layout import position_ids_from_doc_ids, segment_cu_seqlens, validate_doc_ids
from fcp.layout import validate_right_tail_mask
from fcp.groups import GroupInfo, GroupLike, resolve_group
from fcp.context import PackedContext
from fcp.comm import all_gather_backward_anchor, all_gather_group, all_gather_sequence, left_halo
from fcp.comm import send_pieces, state_chain
from fcp.shard import gather_sequence, shard_batch
from fcp.ops.compressed import compressed_attention
from fcp.ops.doc_causal import doc_causal_attention
from fcp.ops.elementwise_scan import elementwise_scan
from fcp.ops.conv import short_conv
from fcp.ops.gla import gla
from fcp.ops.index_attention import index_attention
from fcp.ops.kda import kda
from fcp.ops.kpool_indexer import kpool_indexer
from fcp.ops.latent_attention import latent_attention
from fcp.ops.mlstm import mlstm_stabilizer
from fcp.ops.pooled_attention import gated_pools, pool_select, pooled_window_attention
from fcp.ops.qsa_indexer import qsa_indexer
from fcp.ops.relative_attention import relative_attention
from fcp.ops.sliding_window import sliding_window_attention
from fcp.ops.token_history import token_history
from fcp.ops.token_lags import token_lags
from fcp.ops.wkv import wkv
from fcp.ops.token_indexer import token_indexer
from fcp import loss

__all__ = [
    "PAD_DOC_ID",
    "GroupInfo",
    "GroupLike",
    "PackedContext",
    "all_gather_backward_anchor",
    "all_gather_group",
    "all_gather_sequence",
    "compressed_attention",
    "doc_causal_attention",
    "doc_ids_from_cu_seqlens",
    "doc_ids_from_seq_lens",
    "document_starts",
    "elementwise_scan",
    "gated_pools",
    "gather_sequence",
    "gla",
    "index_attention",
    "kda",
    "kpool_indexer",
    "latent_attention",
    "left_halo",
    "send_pieces",
    "loss",
    "mlstm_stabilizer",
    "lengths_from_doc_ids",
    "packed_boundaries_from_seq_lens",
    "pool_select",
    "pooled_window_attention",
    "position_ids_from_doc_ids",
    "qsa_indexer",
    "relative_attention",
    "resolve_group",
    "segment_cu_seqlens",
    "shard_batch",
    "short_conv",
    "sliding_window_attention",
    "state_chain",
    "token_history",
    "token_indexer",
    "token_lags",
    "validate_doc_ids",
    "validate_right_tail_mask",
    "wkv",
]


def __getattr__(name: str):
    # the upper layers load on first use: ``import fcp`` stays the core's import
    if name == "integrations":
        importlib.import_module("fcp.integrations.hf")  # no transformers import: cheap
        return importlib.import_module("fcp.integrations")
    if name == "models":
        return importlib.import_module("fcp.models")
    raise AttributeError(f"module 'fcp' has no attribute {name!r}")
