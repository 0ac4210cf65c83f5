"""Contiguous batch sharding: one token interval per CP rank, one replicated document map.

:func:`shard_batch` runs eagerly, once per batch, on the replicated full batch. It validates and
resolves everything host-side (a bad batch raises the same ``ValueError`` / ``TypeError`` on
every rank that holds it), checks that every CP rank holds the same batch (:class:`BatchAgreement`:
one small exchange), pads, slices, and returns this rank's local batch and ``PackedContext`` for
the compiled model. :func:`gather_sequence` is the inverse.

Documents. The document map is read from every key that describes documents, in the formats of
NeMo, flash-attention and transformers' ``DataCollatorWithFlattening``; when several are given
they must describe the same documents, else a ``ValueError`` names two of them and the first
``(row, token)`` where they differ (no source silently wins):

* ``doc_ids`` ``[batch, seq]`` (1, 2, ... per row, 0 on the pad tail); ``cu_seqlens`` /
  ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32 or int64 cumulative lengths of one row, tokens
  from the last entry on are padding); ``seq_lens`` ``[batch, documents]`` (``-1000`` marks
  unused slots): documents and the pad tail.
* ``position_ids`` ``[batch, seq]``: a document starts wherever ``position_ids[t] !=
  position_ids[t - 1] + 1``, whatever they restart at (transformers' ``position_ids_start``);
  ``seq_idx`` ``[batch, seq]`` (the document index of each token): a document starts where it
  changes. Neither says where padding is; their values on a pad tail that another key describes
  are free. Next to another source, positions must restart exactly at its document starts:
  one ``arange`` over a row of several documents is refused (naming both keys), because a
  document then reads positions it never has alone; drop ``position_ids`` and they are derived,
  restarting at every document.
* ``attention_mask`` / ``padding_mask``: binary right-tail masks, True/1 on real tokens (no
  document starts): with no other source, one document per row.
* ``max_length_q`` / ``max_length_k`` (ints or one-element tensors) must be the longest
  document's length; ``seq_lens_padded`` and ``max_seqlen`` (NeMo's virtual layout) are read by
  no one.

Every one of these keys is consumed (the context carries the layout); the local batch keeps
``position_ids`` (sharded, as given, else derived from the map) and the masks. A tensor of the
row's ``[batch, seq]`` shape under a key :func:`shard_batch` does not know would reach every
rank unsharded: it is refused (``ValueError`` naming it) unless ``extra_token_keys`` lists it.

Labels follow transformers: ``labels`` are **unshifted** (the target of token ``t`` is
``labels[t + 1]``), ``shift_labels`` are the next-token targets, aligned with the tokens.
Shifting inside a CP shard would lose the target of each shard's last token (it sits on the next
rank), so :func:`shard_batch` builds ``shift_labels`` from ``labels`` over the whole row before
sharding: ``labels[t + 1]`` when token ``t + 1`` is in the same document as ``t``, else
:data:`IGNORE_INDEX` (each document's last token; a document never predicts the next one's first
token). The local batch carries ``shift_labels`` and never ``labels``. ``shift_labels`` given
are sharded as given; given with ``labels``, the two must agree.

Padding never trains: every token outside a document (doc id 0: the pad tail of a
``cu_seqlens`` / ``seq_lens`` / mask row and the CP padding added here) gets the target
``IGNORE_INDEX`` and loss mask 0, so :func:`fcp.loss.loss_token_count` of ``shift_labels``
counts real targets only.

Ranks must agree: a data-loader bug that hands one CP rank another batch would otherwise corrupt
every operator's output silently (same length) or fail inside a collective on some ranks only
(different lengths). Before anything depends on it, the ranks exchange one fixed-size summary
(rows, length, padded length, a 128-bit hash of the document map, whether the rank accepted its
batch) through the process group's store; if they differ, every rank raises the same
``ValueError`` naming the ranks and what differs (for maps, after one all-gather, the first
differing position). A rank that rejects its batch still joins the exchange, so the others raise
instead of waiting in a collective; a rank that never joins (it passed ``cp_mesh=None`` or
another group, or skipped the batch) makes the waiting ones raise a ``RuntimeError`` naming it
after ``join_timeout`` seconds.

Worked example (2 ranks, ``pad_multiple=1``)::

    batch = {"input_ids": [[5, 6, 7, 8, 9]], "labels": [[5, 6, 7, 8, 9]],
             "cu_seqlens": [0, 2, 5]}
    padded to 6:  input_ids    [[5, 6, 7, 8, 9, 0]]
    doc_ids                    [[1, 1, 2, 2, 2, 0]]
    shift_labels               [[6, -100, 8, 9, -100, -100]]   (built before sharding)
    rank 0 local: input_ids [[5, 6, 7]], position_ids [[0, 1, 0]], shift_labels [[6, -100, 8]]
    rank 1 local: input_ids [[8, 9, 0]], position_ids [[1, 2, 0]], shift_labels [[9, -100, -100]]

Rank 0's last token (7) keeps its target 8, which lives on rank 1.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fcp.checks import check_bool, check_float, check_instance, check_int, check_tensor
from fcp.comm import all_gather_group, all_gather_sequence
from fcp.context import PackedContext
from fcp.groups import GroupInfo, GroupLike, resolve_group
from fcp.layout import (
    PAD_DOC_ID,
    doc_ids_from_cu_seqlens,
    doc_ids_from_position_ids,
    doc_ids_from_seq_idx,
    doc_ids_from_seq_lens,
    document_starts,
    longest_document,
    position_ids_from_doc_ids,
    shift_labels_from_labels,
    validate_doc_ids,
    validate_right_tail_mask,
)

__all__ = [
    "BatchAgreement",
    "IGNORE_INDEX",
    "INTEGER_STREAMS",
    "JOIN_TIMEOUT_S",
    "PACKING_KEYS",
    "TOKEN_KEYS",
    "check_stream",
    "shard_batch",
    "gather_sequence",
    "global_doc_ids_from_batch",
    "normalize_batch_axis",
    "pad_sequence_dim",
    "padded_length",
]

IGNORE_INDEX = -100
#: Token-aligned streams sharded along the sequence axis, with their pad values by meaning.
#: ``None``: filled from ``padding_token_id``. Position ids pad with 0: pad tokens are never
#: visible to real ones, and 0 keeps rotary tables in range. ``labels`` are validated and turned
#: into ``shift_labels``, never sharded themselves.
TOKEN_KEYS: dict[str, Any] = {
    "input_ids": None,
    "inputs_embeds": 0.0,
    "labels": IGNORE_INDEX,
    "shift_labels": IGNORE_INDEX,
    "position_ids": 0,
    "loss_mask": 0,
    "attention_mask": False,
    "padding_mask": False,
    "token_type_ids": 0,
}
#: Keys that describe documents, consumed into the document map (the context carries the layout
#: afterwards). ``position_ids`` describe documents too, but stay: the model reads them.
PACKING_KEYS = ("doc_ids", "cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "seq_lens", "seq_idx",
                "seq_lens_padded", "max_seqlen", "max_length_q", "max_length_k")
_MASK_KEYS = ("attention_mask", "padding_mask")
#: Sources of documents and their pad tail, in the order the message of a disagreement names them.
_MAP_SOURCES = ("doc_ids", "cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "seq_lens")
#: Sources of document starts only (no pad tail).
_START_SOURCES = ("position_ids", "seq_idx")
_CU_SOURCES = ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")
_MAX_LENGTH_KEYS = ("max_length_q", "max_length_k")

#: Token streams holding integers (ids, targets, positions, document indices).
INTEGER_STREAMS = ("input_ids", "labels", "shift_labels", "position_ids", "token_type_ids",
                   "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k")  # fmt: skip

#: Default ``join_timeout`` (seconds) of :class:`BatchAgreement` and :func:`shard_batch`: longer
#: than the skew that rank-specific work between two steps causes (one rank writing a checkpoint
#: or logging, start-up), much shorter than the collective timeouts a rank that never joins would
#: otherwise cost (10 min on NCCL, 30 min on gloo by default).
JOIN_TIMEOUT_S = 300.0


def check_stream(key: str, t: Any, *, fn: str = "") -> torch.Tensor:
    """A token stream or packing tensor: a real (not meta) tensor of its kind (host-side)."""
    kind = "int" if key in INTEGER_STREAMS else "float" if key == "inputs_embeds" else None
    return check_tensor(t, key, kind=kind, values=True, fn=fn)


def pad_sequence_dim(tensor: torch.Tensor, pad_len: int, value: float | int | bool, dim: int = 1):
    """Right-pad ``tensor`` along ``dim`` by ``pad_len`` entries of ``value`` (new tensor)."""
    if pad_len < 0:
        raise ValueError(f"pad_len must be >= 0, got {pad_len}")
    if pad_len == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = pad_len
    fill = torch.full(shape, value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, fill], dim=dim)


def normalize_batch_axis(batch: Mapping[str, Any]) -> dict[str, Any]:
    """Return a new batch whose token streams have a leading batch axis.

    THD collaters give ``[sequence]`` rows (``[sequence, hidden]`` for ``inputs_embeds``); they
    become ``[1, sequence]`` (``[1, sequence, hidden]``), ``seq_idx`` too. ``seq_lens`` keeps its
    own layout.
    """
    primary = "input_ids" if batch.get("input_ids") is not None else "inputs_embeds"
    ref = batch.get(primary)
    flat = isinstance(ref, torch.Tensor) and ref.dim() == (1 if primary == "input_ids" else 2)
    out = dict(batch)
    if not flat:
        return out
    for key in (*TOKEN_KEYS, "seq_idx"):
        t = out.get(key)
        if isinstance(t, torch.Tensor):
            expect_flat = 2 if key == "inputs_embeds" else 1
            if t.dim() == expect_flat:
                out[key] = t.unsqueeze(0)
    return out


def global_doc_ids_from_batch(batch: Mapping[str, Any], seq_len: int) -> torch.Tensor:
    """Resolve the int64 ``[batch, seq_len]`` document map before packing metadata is dropped.

    Reads every source the module docstring lists (``doc_ids``, ``cu_seqlens``,
    ``cu_seq_lens_q`` / ``_k``, ``seq_lens``, ``position_ids``, ``seq_idx``, a right-tail
    ``attention_mask`` / ``padding_mask``) and checks that they describe the same documents
    (``ValueError`` naming two keys and the first ``(row, token)`` where they differ) and that
    ``max_length_q`` / ``max_length_k`` are the longest document's length. Without any source:
    one document per row covering it all. ``seq_lens_padded`` is virtual-layout metadata and
    never used for physical offsets.
    """
    primary = batch.get("input_ids")
    if primary is None:
        primary = batch["inputs_embeds"]
    n_rows, device = primary.shape[0], primary.device
    mask = _mask_of(batch, primary)
    maps: dict[str, torch.Tensor] = {}
    for key in _MAP_SOURCES:
        if batch.get(key) is not None:
            maps[key] = _source_map(key, batch[key], n_rows, seq_len).to(device, torch.long)
    # Start-only sources take their pad tail from the first full source, else from the mask.
    valid = maps[next(iter(maps))] != PAD_DOC_ID if maps else mask
    for key in _START_SOURCES:
        if batch.get(key) is not None:
            m = _source_map(key, batch[key], n_rows, seq_len).to(device)
            maps[key] = m if valid is None else m.masked_fill(~valid.to(device), PAD_DOC_ID)
    if maps:
        ref = next(iter(maps))
        doc_ids = maps[ref]
        for key, m in maps.items():
            if key != ref and not torch.equal(m, doc_ids):
                raise ValueError(_disagreement(ref, doc_ids, key, m, m != doc_ids))
        if mask is not None and not torch.equal(mask.to(device), doc_ids != PAD_DOC_ID):
            key = next(k for k in _MASK_KEYS if batch.get(k) is not None)
            mask = mask.to(device)
            raise ValueError(_disagreement(ref, doc_ids, key, mask.long(),
                                           mask != (doc_ids != PAD_DOC_ID)))  # fmt: skip
    elif mask is not None:
        ref, doc_ids = next(k for k in _MASK_KEYS if batch.get(k) is not None), mask.long()
    else:
        ref, doc_ids = None, torch.ones(n_rows, seq_len, dtype=torch.long, device=device)
    _check_max_lengths(batch, doc_ids, ref)
    return doc_ids


def _source_map(key: str, value: Any, n_rows: int, seq_len: int) -> torch.Tensor:
    """The ``[n_rows, seq_len]`` document map that one source describes (validated)."""
    t = check_stream(key, value, fn="shard_batch")
    if key == "doc_ids":
        t = t.unsqueeze(0) if t.dim() == 1 else t
        if tuple(t.shape) != (n_rows, seq_len):
            raise ValueError(f"doc_ids has shape {tuple(t.shape)}, expected {(n_rows, seq_len)}")
        validate_doc_ids(t)
        return t
    if key in _CU_SOURCES:
        if n_rows != 1:
            raise ValueError(
                f"{key} describes one packed row, but the batch has {n_rows} rows; "
                "use seq_lens [batch, documents] for packed batches with several rows"
            )
        return doc_ids_from_cu_seqlens(t, seq_len, name=key)
    if key == "seq_lens":
        rows = 1 if t.dim() == 1 else t.shape[0]
        if rows != n_rows:
            raise ValueError(
                f"seq_lens has {rows} rows but input has batch {n_rows} "
                f"(seq_lens shape {tuple(t.shape)})"
            )
        return doc_ids_from_seq_lens(t, seq_len)
    if tuple(t.shape) != (n_rows, seq_len):
        raise ValueError(
            f"shard_batch: {key} has shape {tuple(t.shape)}; to describe documents it must be "
            f"[batch={n_rows}, sequence={seq_len}] like the tokens"
        )
    return doc_ids_from_position_ids(t) if key == "position_ids" else doc_ids_from_seq_idx(t)


def _token_role(doc_ids: torch.Tensor, row: int, token: int) -> str:
    if int(doc_ids[row, token]) == PAD_DOC_ID:
        return "puts it in the padding"
    if bool(document_starts(doc_ids[row : row + 1, : token + 1])[0, token]):
        return "starts a document there"
    return "continues the document of the token before"


def _disagreement(ref: str, ref_map: torch.Tensor, key: str, key_map: torch.Tensor,
                  differs: torch.Tensor) -> str:
    """The message for two sources that differ (``differs``: where): both keys and the first
    differing token.

    Two maps that agree before a token can differ there only in whether it starts a document or
    is padding, so naming each map's role for that token says what differs."""
    row, token = (int(i) for i in differs.nonzero()[0])
    if key in _MASK_KEYS:
        theirs = "marks it as padding" if int(key_map[row, token]) == 0 else "marks it as valid"
    else:
        theirs = _token_role(key_map, row, token)
    hint = ""
    if key == "position_ids":
        hint = ("; position_ids must restart exactly where documents start (drop them and "
                "shard_batch derives positions that restart at every document)")  # fmt: skip
    return (
        f"shard_batch: {key} disagrees with {ref} about the documents at row {row}, token "
        f"{token}: {ref} {_token_role(ref_map, row, token)}, {key} {theirs}; every key that "
        f"describes documents must describe the same ones{hint}"
    )


def _check_max_lengths(batch: Mapping[str, Any], doc_ids: torch.Tensor, ref: str | None) -> None:
    keys = [k for k in _MAX_LENGTH_KEYS if batch.get(k) is not None]
    if not keys:
        return
    longest = longest_document(doc_ids)
    for key in keys:
        value = batch[key]
        if isinstance(value, torch.Tensor):
            check_stream(key, value, fn="shard_batch")
            if value.numel() != 1 or value.is_floating_point() or value.dtype == torch.bool:
                raise ValueError(f"shard_batch: {key} must be an int or a one-element integer "
                                 f"tensor, got a {value.dtype} tensor of shape "
                                 f"{tuple(value.shape)}")  # fmt: skip
            value = int(value.reshape(()))
        value = check_int(value, key, fn="shard_batch")
        if value != longest:
            source = f"the documents of {ref}" if ref is not None else "one document per row"
            raise ValueError(
                f"shard_batch: {key}={value} is not the length of the longest document: "
                f"{source} give {longest} tokens"
            )


def _mask_of(batch: Mapping[str, Any], primary: torch.Tensor) -> torch.Tensor | None:
    masks = [k for k in _MASK_KEYS if batch.get(k) is not None]
    if not masks:
        return None
    like = primary if primary.dim() == 2 else primary[..., 0]
    normalised = []
    for key in masks:
        m = batch[key]
        if m.dim() != 2 or (m.dtype != torch.bool and bool(((m != 0) & (m != 1)).any())):
            raise ValueError(
                f"{key} with shape {tuple(m.shape)} and dtype {m.dtype} is a packed or "
                "block attention mask, which contiguous CP does not support; pass packing "
                "metadata (cu_seqlens / seq_lens) and an optional binary right-tail mask"
            )
        normalised.append(validate_right_tail_mask(m, like=like, name=key))
    if len(normalised) == 2 and not torch.equal(normalised[0], normalised[1]):
        raise ValueError("attention_mask and padding_mask are both given and disagree")
    return normalised[0]


class BatchAgreement:
    """Every CP rank joins exactly one fixed-size exchange per batch; disagreement raises.

    Use as a context manager around a sharder's validation, and call :meth:`check` with the
    validated map before anything depends on it::

        with BatchAgreement(cp_mesh, "my_sharder") as agreement:
            doc_ids = validate(batch)                # may raise on this rank
            agreement.check(doc_ids, seq_len)        # raises on every rank if ranks differ
        ... # collectives may follow: every rank holds the same layout

    A rank whose validation raises joins the exchange on the way out (as "rejected") and its own
    error propagates; the ranks that accepted their batch then raise a ``ValueError`` naming it.

    The exchange goes through the process group's store (the rendezvous store every
    ``torch.distributed`` group has, whatever its backend): each rank writes its 48-byte summary
    under a key of this round (a per-rank round counter on the store keeps rounds apart) and
    waits at most ``join_timeout`` seconds for the others'. A rank that never joins (it passed
    ``cp_mesh=None`` or another group, or skipped the batch) makes the waiting ranks raise a
    ``RuntimeError`` naming it; rounds are then out of step on that group, which is not fit for
    training any more. Five small store requests per rank and batch (no collective, no device
    synchronisation; on a ``TCPStore`` the requests of every rank of the job go to one server).
    Only when the maps differ, one all-gather of the maps on the group locates the first
    differing position. ``enabled=False``, ``None``, a one-rank group or a ``fake`` one: no
    exchange (the caller guarantees agreement). Eager only.

    Args:
        cp_mesh: the CP group, a :data:`~fcp.groups.GroupLike` (``None``, ``ProcessGroup``,
            1-D ``DeviceMesh`` or ``GroupInfo``).
        fn: the sharder's name, for messages.
        enabled: whether to exchange at all.
        join_timeout: seconds to wait for the other ranks (:data:`JOIN_TIMEOUT_S` by default).
    """

    def __init__(self, cp_mesh: GroupLike, fn: str, *, enabled: bool = True,
                 join_timeout: float = JOIN_TIMEOUT_S) -> None:  # fmt: skip
        self.info: GroupInfo = resolve_group(cp_mesh, name="cp_mesh", fn=fn)
        self.fn = fn
        enabled = check_bool(enabled, "check_agreement", fn=fn)
        self.join_timeout = check_float(join_timeout, "join_timeout", fn=fn, positive=True)
        group = self.info.group
        self._pending = enabled and group is not None and str(dist.get_backend(group)) != "fake"

    def __enter__(self) -> "BatchAgreement":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._pending and isinstance(exc, Exception):
            self._pending = False
            try:
                self._gather(None)  # "rejected"; the exception propagates
            except RuntimeError as absent:  # this rank's own error still says what to fix
                if hasattr(exc, "add_note"):  # Python >= 3.11
                    exc.add_note(str(absent))
        return False

    def check(self, doc_ids: torch.Tensor, original_seq_len: int) -> None:
        """Raise ``ValueError`` on every rank unless all hold this ``[batch, padded]`` map and
        ``original_seq_len`` (and all accepted their batch); ``RuntimeError`` when some rank does
        not join within ``join_timeout``."""
        if not self._pending:
            return
        self._pending = False
        rows = self._gather(_summary(doc_ids, original_seq_len))
        rejected = [r for r, row in enumerate(rows) if row[0]]
        if rejected:
            raise ValueError(
                f"{self.fn}: CP rank(s) {rejected} rejected their batch (their own error says "
                "why) while this rank accepted its own; every CP rank must hold the same full "
                "batch"
            )
        shapes = [tuple(row[1:4]) for row in rows]
        if len(set(shapes)) > 1:
            listed = ", ".join(f"rank {r}: {b} row(s) x {n} tokens (padded to {p})"
                               for r, (b, n, p) in enumerate(shapes))  # fmt: skip
            raise ValueError(
                f"{self.fn}: CP ranks hold batches of different lengths ({listed}); every CP "
                "rank must hold the same full batch"
            )
        if len({tuple(row[4:]) for row in rows}) > 1:
            raise ValueError(f"{self.fn}: {_first_difference(doc_ids, self.info)}")

    def _gather(self, summary: list[int] | None) -> list[list[int]]:
        row = [1, 0, 0, 0, 0, 0] if summary is None else [0, *summary]
        store = _store_of(self.info.group)
        return _store_exchange(store, self.info, row, self.join_timeout, self.fn)


_STORE_PREFIX = "fcp/batch_agreement"


def _store_of(group: Any):
    """The group's rendezvous store, which ``torch.distributed`` prefixes per group (so the
    same keys on two groups never meet)."""
    return dist.distributed_c10d._get_process_group_store(group)


def _store_exchange(store, info: GroupInfo, row: list[int], timeout: float,
                    fn: str) -> list[list[int]]:  # fmt: skip
    """Every rank's ``row`` (6 int64), exchanged through ``store``; ``RuntimeError`` naming the
    ranks that did not write theirs within ``timeout`` seconds."""
    # Ranks run the same sequence of exchanges, so each rank's own count names the round; the
    # count lives on the store, which outlives any Python object of a training loop.
    n = store.add(f"{_STORE_PREFIX}/round/{info.rank}", 1)
    keys = [f"{_STORE_PREFIX}/{n}/{r}" for r in range(info.size)]
    store.set(keys[info.rank], struct.pack("<6q", *row))
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError as err:  # the store's timeout (DistStoreError is one)
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if missing:
            ranks = [dist.get_global_rank(info.group, r) for r in missing]
            raise RuntimeError(
                f"{fn}: CP rank(s) {missing} (global rank(s) {ranks}) did not join the batch "
                f"agreement within join_timeout={timeout:g} s while CP rank {info.rank} waited: "
                f"every CP rank must call {fn} with the same CP group for every batch (a rank "
                "that passes cp_mesh=None or another group, or skips the batch, leaves the "
                "others waiting); this group's exchanges are out of step now"
            ) from err
    values = store.multi_get(keys)
    if n > 1:
        # Every rank has written its key of round n, which it does only after reading all of
        # round n - 1: nobody reads this rank's round n - 1 key any more.
        store.delete_key(f"{_STORE_PREFIX}/{n - 1}/{info.rank}")
    return [list(struct.unpack("<6q", v)) for v in values]


def _summary(doc_ids: torch.Tensor, original_seq_len: int) -> list[int]:
    """``[rows, original length, padded length, hash_lo, hash_hi]`` of a validated map."""
    host = doc_ids.detach().cpu().contiguous().numpy()
    digest = hashlib.sha1(memoryview(host).cast("B"), usedforsecurity=False).digest()
    halves = [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in (0, 8)]
    return [doc_ids.shape[0], original_seq_len, doc_ids.shape[1], *halves]


def _first_difference(doc_ids: torch.Tensor, info: GroupInfo) -> str:
    """The failure path's second exchange: every rank's map, and where the first one differs."""
    mine = doc_ids.unsqueeze(0).to(_exchange_device(info.group))
    maps = all_gather_group(mine, info, dim=0, differentiable=False, validate=False).cpu()
    differs = (maps != maps[:1]).flatten(1)  # [ranks, batch * padded]
    ranks = [r for r in range(info.size) if bool(differs[r].any())]
    first = min(ranks, key=lambda r: int(differs[r].int().argmax()))
    flat = int(differs[first].int().argmax())
    row, pos = divmod(flat, doc_ids.shape[1])
    return (
        f"CP ranks hold different document maps at the same length: rank {first}'s differs "
        f"from rank 0's first at row {row}, token {pos} (doc id {int(maps[first, row, pos])} "
        f"vs {int(maps[0, row, pos])}; ranks {ranks} differ from rank 0); every CP rank must "
        "hold the same full batch"
    )


def _exchange_device(group: Any) -> torch.device:
    """The device of the exchange, whatever device the batch is on: CPU for gloo (and fake)
    groups, the current accelerator otherwise (NCCL and the like)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or backend == "fake" or not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.accelerator.current_accelerator()


def shard_batch(
    cp_mesh: GroupLike,
    batch: Mapping[str, Any],
    *,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    pad_multiple: int = 1,
    pad_to: int | str | None = None,
    shard_primary: bool = True,
    extra_token_keys: tuple[str, ...] = (),
    ignore_padding: bool = True,
    check_agreement: bool = True,
    join_timeout: float = JOIN_TIMEOUT_S,
) -> tuple[dict[str, Any], PackedContext]:
    """Validate, pad and contiguously shard a (packed) batch for this CP rank.

    Args:
        cp_mesh: the CP group, a :data:`~fcp.groups.GroupLike`: 1-D ``DeviceMesh``,
            ``ProcessGroup``, ``GroupInfo`` or ``None`` (no CP).
        batch: full-sequence batch, identical on every CP rank, never mutated. Token streams
            ``[batch, sequence]`` (``[sequence]`` rows from THD collaters are accepted):
            exactly one of ``input_ids`` (integer) / ``inputs_embeds`` (float
            ``[batch, sequence, hidden]``); optional ``labels`` (integer, unshifted: the target
            of token ``t`` is ``labels[t + 1]``, transformers' convention) and / or
            ``shift_labels`` (integer next-token targets, aligned with the tokens),
            ``position_ids``, ``loss_mask`` (sharded as given: align it with
            ``shift_labels``), ``attention_mask`` / ``padding_mask`` (binary, right-tail,
            True/1 = valid token), ``token_type_ids``; keys that describe documents (the module
            docstring: ``doc_ids``, ``cu_seqlens``, ``cu_seq_lens_q`` / ``_k``,
            ``max_length_q`` / ``_k``, ``seq_lens`` (+ ignored ``seq_lens_padded`` /
            ``max_seqlen``), ``seq_idx``, ``position_ids``), which must agree. Other entries
            pass through unchanged, except tensors of the tokens' ``[batch, sequence]`` shape
            (they would reach every rank unsharded: list them in ``extra_token_keys``).
        loss_mask: optional ``[batch, sequence]`` loss mask, sharded into ``local["loss_mask"]``
            (overrides ``batch["loss_mask"]``).
        padding_token_id: input id appended for CP divisibility (an int).
        pad_multiple: every rank's local length is a multiple of this (e.g. 4 for a ratio-4
            compressed attention).
        pad_to: buckets the padded global length, so that a compiled model sees few distinct
            lengths (see "Row lengths" below). ``None`` (default): the smallest multiple of
            ``m = cp_size * pad_multiple``; an int ``n``: the smallest multiple of
            ``lcm(n, m)``; ``"pow2"``: the smallest ``m * 2**j`` (a power of two when ``m``
            is one), at most twice the row.
        shard_primary: ``False`` keeps ``input_ids`` / ``inputs_embeds`` full length (padded)
            so the model can splice features into the full sequence first and then apply the
            differentiable ``context.shard(embeds)``; every other stream is still sharded.
        extra_token_keys: further ``[batch, sequence, ...]`` keys to shard (padded with 0).
        ignore_padding: ``True`` (default): padding never trains: the ``shift_labels`` of every
            token outside a document (doc id 0, the batch's own pad tail included) become
            :data:`IGNORE_INDEX` and its ``loss_mask`` 0. ``False`` keeps the given values on
            the pad tail (only the CP padding added here is ignored).
        check_agreement: ``True`` (default): before anything depends on it, every CP rank checks
            that all hold the same rows, length and document map (:class:`BatchAgreement`: one
            exchange of 48 bytes per rank through the group's store). ``False`` for callers
            that guarantee it.
        join_timeout: how long (seconds) this rank waits for the other CP ranks at that check
            before it raises a ``RuntimeError`` naming the ranks that never came
            (:data:`JOIN_TIMEOUT_S`, 5 min, by default).

    Returns:
        ``(local_batch, context)``: a **new** dict with this rank's slices (the keys that
        describe documents removed, their layout lives in ``context``; ``labels`` replaced by
        ``shift_labels``; ``position_ids`` added from the document map when absent: positions
        restart at every document) and this rank's :class:`~fcp.context.PackedContext`.

    Raises:
        TypeError / ValueError naming the offending key or argument and its value (the same on
        every rank holding the same batch): among them keys that describe different documents,
        ``labels`` and ``shift_labels`` that disagree, an unknown ``[batch, sequence]`` tensor;
        ``ValueError`` on every rank when the CP ranks hold different batches (naming the ranks
        and the lengths or the first differing position) or some of them rejected theirs;
        ``RuntimeError`` when some CP rank does not join the check within ``join_timeout``. A
        batch of zero rows is rejected.

    Padding (by meaning): input ids ``padding_token_id``, embeddings 0, targets -100, loss mask
    0, validity masks False, position ids 0, doc id 0.

    Row lengths: a compiled model specialises on the local length the first time; the second
    length it sees recompiles it once with a dynamic sequence dimension, and every later
    length reuses that graph (fcp's operators do not branch on the length; tested over 4
    lengths). Bucketing with ``pad_to`` keeps the static graphs instead: with ``pad_to=1024``
    every row of up to 1024 tokens shares one graph, with ``"pow2"`` a row length ``n`` gets
    one of ``log2(n)`` graphs, at the price of computing the padding (at most 2x the tokens).

    Example (one process; documents ``[0, 1]`` and ``[2, 3]``, then a pad tail)::

        >>> batch = {"input_ids": torch.arange(6)[None], "labels": torch.arange(6)[None],
        ...          "cu_seqlens": torch.tensor([0, 2, 4])}
        >>> local, ctx = shard_batch(None, batch)
        >>> local["shift_labels"].tolist(), "labels" in local
        ([[1, -100, 3, -100, -100, -100]], False)
    """
    with BatchAgreement(cp_mesh, "shard_batch", enabled=check_agreement,
                        join_timeout=join_timeout) as agreement:  # fmt: skip
        check_instance(batch, Mapping, "batch", fn="shard_batch")
        check_bool(ignore_padding, "ignore_padding", fn="shard_batch")
        work, keys, doc_ids = _validated(batch, loss_mask, padding_token_id, pad_multiple,
                                         pad_to, shard_primary, extra_token_keys,
                                         ignore_padding, agreement.info.size)  # fmt: skip
        seq_len = work[keys.primary].shape[1]
        agreement.check(doc_ids, seq_len)
    info = agreement.info
    pad = doc_ids.shape[1] - seq_len
    context = PackedContext(
        doc_ids=doc_ids,
        group=info.group,
        cp_size=info.size,
        cp_rank=info.rank,
        original_seq_len=seq_len,
    )

    local: dict[str, Any] = {k: v for k, v in work.items() if k not in PACKING_KEYS}
    if local.get("position_ids") is None:
        local["position_ids"] = position_ids_from_doc_ids(doc_ids)[:, :seq_len]
    outside = doc_ids[:, :seq_len] == PAD_DOC_ID  # tokens in no document: never trained
    for key, fill in keys.fills.items():
        t = local.get(key)
        if not isinstance(t, torch.Tensor):
            continue
        if fill is None:
            fill = keys.padding_token_id
        if ignore_padding and key in ("shift_labels", "loss_mask"):
            t = t.masked_fill(outside.to(t.device), fill)
        t = pad_sequence_dim(t, pad, fill)
        keep_full = key == keys.primary and not shard_primary
        local[key] = t if keep_full else context.shard(t, dim=1)
    return local, context


class _Keys(NamedTuple):
    primary: str  # "input_ids" or "inputs_embeds"
    fills: dict[str, Any]  # token stream -> pad value (None: padding_token_id)
    padding_token_id: int


def _validated(batch, loss_mask, padding_token_id, pad_multiple, pad_to, shard_primary,
               extra_token_keys, ignore_padding: bool,
               cp_size: int) -> tuple[dict[str, Any], _Keys, torch.Tensor]:  # fmt: skip
    """``(work, keys, doc_ids)``: the batch with a batch axis, ``loss_mask`` and
    ``shift_labels`` in place (``labels`` gone), its token streams, and the validated document
    map padded for ``cp_size`` ranks."""
    pad_multiple = check_int(pad_multiple, "pad_multiple", 1, fn="shard_batch")
    if pad_to is not None and not (isinstance(pad_to, str) and pad_to == "pow2"):
        if isinstance(pad_to, str):
            raise ValueError(f"shard_batch: pad_to={pad_to!r} is not one of None, a positive "
                             "int or 'pow2'")
        check_int(pad_to, "pad_to", 1, fn="shard_batch")
    padding_token_id = check_int(padding_token_id, "padding_token_id", -(2**63), fn="shard_batch")
    check_bool(shard_primary, "shard_primary", fn="shard_batch")
    check_instance(extra_token_keys, (tuple, list), "extra_token_keys", fn="shard_batch")
    has_ids = batch.get("input_ids") is not None
    has_embeds = batch.get("inputs_embeds") is not None
    if has_ids == has_embeds:
        raise ValueError(
            "shard_batch: batch must contain exactly one of input_ids / inputs_embeds, got "
            + ("both" if has_ids else "neither")
        )
    token_keys = dict(TOKEN_KEYS)
    token_keys.update({k: 0 for k in extra_token_keys})
    if loss_mask is not None:
        check_stream("loss_mask", loss_mask, fn="shard_batch")
    for key in token_keys:
        if batch.get(key) is not None:
            check_stream(key, batch[key], fn="shard_batch")
    work = normalize_batch_axis(batch)
    if loss_mask is not None:
        work["loss_mask"] = loss_mask.unsqueeze(0) if loss_mask.dim() == 1 else loss_mask
    primary_key = "input_ids" if has_ids else "inputs_embeds"
    primary = work[primary_key]
    if primary_key == "input_ids" and primary.dim() != 2:
        raise ValueError(
            f"input_ids must be an integer [batch, sequence] tensor, got shape "
            f"{tuple(primary.shape)} dtype {primary.dtype}"
        )
    if primary_key == "inputs_embeds" and primary.dim() != 3:
        raise ValueError(
            f"inputs_embeds must be [batch, sequence, hidden], got {tuple(primary.shape)}"
        )
    n_rows, seq_len = primary.shape[:2]
    if n_rows == 0:
        raise ValueError(f"{primary_key} has batch size 0 (shape {tuple(primary.shape)})")
    for key in token_keys:
        t = work.get(key)
        if isinstance(t, torch.Tensor) and tuple(t.shape[:2]) != (n_rows, seq_len):
            raise ValueError(
                f"{key} has shape {tuple(t.shape)}, expected [batch={n_rows}, "
                f"sequence={seq_len}, ...] like {primary_key}"
            )
    flat = batch[primary_key].dim() < primary.dim()
    for key, t in work.items():
        if key in token_keys or key in PACKING_KEYS or not isinstance(t, torch.Tensor):
            continue
        if tuple(t.shape[:2]) == (n_rows, seq_len) or (flat and tuple(t.shape[:1]) == (seq_len,)):
            raise ValueError(
                f"shard_batch: {key} is a tensor of shape {tuple(t.shape)}, laid out like the "
                f"tokens ({primary_key} {tuple(batch[primary_key].shape)}), but not a key "
                f"shard_batch knows: it would reach every CP rank whole, not this rank's tokens; "
                f"pass extra_token_keys=({key!r},) to shard it (padded with 0), or take it out "
                "of the batch"
            )

    doc_ids = global_doc_ids_from_batch(work, seq_len)
    if work.get("labels") is not None:
        _shift_labels_into(work, doc_ids, ignore_padding)
    padded_len = padded_length(seq_len, cp_size * pad_multiple, pad_to)
    doc_ids = pad_sequence_dim(doc_ids, padded_len - seq_len, PAD_DOC_ID)
    return work, _Keys(primary_key, token_keys, padding_token_id), doc_ids


def _shift_labels_into(work: dict[str, Any], doc_ids: torch.Tensor, ignore_padding: bool) -> None:
    """Replace ``work["labels"]`` (unshifted) by the row's next-token ``shift_labels``; given
    ``shift_labels`` must be the same targets (wherever they train: on real tokens only when
    ``ignore_padding``)."""
    labels = work.pop("labels")
    doc_ids = doc_ids.to(labels.device)
    built = shift_labels_from_labels(labels, doc_ids, IGNORE_INDEX)
    given = work.get("shift_labels")
    if given is None:
        work["shift_labels"] = built
        return
    differs = built != given.to(built.device)
    if ignore_padding:
        differs &= doc_ids != PAD_DOC_ID
    if bool(differs.any()):
        row, t = (int(i) for i in differs.nonzero()[0])
        seq_len = labels.shape[1]
        if int(built[row, t]) != IGNORE_INDEX:
            why = f"labels[{row}, {t + 1}]"
        elif t + 1 == seq_len:
            why = "-100: the row's last token predicts nothing"
        else:
            why = "-100: the next token is in another document"
        raise ValueError(
            f"shard_batch: labels and shift_labels disagree at row {row}, token {t}: "
            f"shift_labels[{row}, {t}] = {int(given[row, t])}, but the next-token target of the "
            f"unshifted labels is {int(built[row, t])} ({why}); pass one of them"
        )


def padded_length(seq_len: int, multiple: int, pad_to: int | str | None = None) -> int:
    """The global length :func:`shard_batch` pads a row of ``seq_len`` tokens to, for a
    ``multiple`` of ``cp_size * pad_multiple`` (at least one multiple, also for an empty row).

    >>> [padded_length(n, 4) for n in (0, 5, 8)]
    [4, 8, 8]
    >>> [padded_length(n, 4, 6) for n in (5, 13)], [padded_length(n, 4, "pow2") for n in (5, 33)]
    ([12, 24], [8, 64])
    """
    if pad_to == "pow2":
        padded = multiple
        while padded < seq_len:
            padded *= 2
        return padded
    if pad_to is not None:
        multiple = math.lcm(multiple, pad_to)
    return max(1, -(-seq_len // multiple)) * multiple


def gather_sequence(
    local: torch.Tensor, ctx: PackedContext, dim: int = 1, *, unpad: bool = True
) -> torch.Tensor:
    """Inverse of sharding: this rank's ``[batch, local_seq, ...]`` slice back to the full row.

    ``ctx`` is the rank's :class:`~fcp.context.PackedContext` from :func:`shard_batch`.
    Gradients flow back to the owning ranks (reduce-scatter). ``unpad=True`` drops the CP padding
    (returns ``original_seq_len`` positions along ``dim``).
    """
    full = all_gather_sequence(local, ctx, dim=dim)
    if unpad and ctx.original_seq_len is not None:
        full = full.narrow(dim, 0, ctx.original_seq_len)
    return full
