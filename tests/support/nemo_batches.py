"""Hypothesis strategies: batches for NeMo's GLM-5.3 and Qwen3.8 sharders, valid and invalid.

Each strategy draws ``(case, kwargs)``: ``case`` is ``None`` for a valid input, else the key of
the stricter-error bullet (``"pad-tail"``, ...) that the adapter's module docstring must list
when fcp rejects an input NeMo accepts; ``kwargs`` are the sharder's arguments except the mesh.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

SENTINEL = -1000


@st.composite
def doc_lengths(draw, seq_len: int, zero: bool = False, fill: bool = False) -> list[int]:
    """Document lengths summing to ``seq_len`` (``fill``) or at most ``seq_len``."""
    lengths, left = [], seq_len
    while left > 0 and len(lengths) < 5:
        n = draw(st.integers(0 if zero else 1, left))
        lengths.append(n)
        left -= n
        if not fill and draw(st.integers(0, 3)) == 0:
            break
    if fill and left:
        lengths.append(left)
    return lengths


def _runs(lengths: list[int], seq_len: int, ids: list[int]) -> list[int]:
    row = [i for n, i in zip(lengths, ids) for _ in range(n)]
    return row + [0] * (seq_len - len(row))


def _seq_lens_tensor(rows: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [SENTINEL] * (width - len(r)) for r in rows])


def _mask_dtype(draw, mask: torch.Tensor) -> torch.Tensor:
    return mask.to(draw(st.sampled_from([torch.bool, torch.int64, torch.float32])))


# ---------------------------------------------------------------------------------- GLM-5.3
GLM_SOURCES = ("none", "padding_mask", "attention_binary", "attention_indexed", "packed_seq_ids",
               "seq_lens", "seq_lens_padded", "cu_seqlens")  # fmt: skip
GLM_INVALID = ("pad-tail", "rows", "seq-lens", "cu-seqlens", "non-tensor", "mask-dims",
               "seq-lens-padded-none", "dtype")  # fmt: skip


def _position_ids(draw, batch: dict, rows: int, seq_len: int, other: str) -> None:
    """Sets ``batch["position_ids"]`` as a sharder may be given it: absent, random ``[rows,
    seq_len]``, one row ``[1, seq_len]`` for all, or ``other``: ``"none"`` (the key holds
    None) or ``"mrope"`` (``[3, rows, seq_len]``, one row per rotary section)."""
    form = draw(st.sampled_from(["absent", "full", "one-row", other]))
    if form == "full":
        batch["position_ids"] = torch.randint(0, seq_len, (rows, seq_len))
    elif form == "one-row":
        batch["position_ids"] = torch.arange(seq_len).unsqueeze(0)
    elif form == "none":
        batch["position_ids"] = None
    elif form == "mrope":
        batch["position_ids"] = torch.randint(0, seq_len, (3, rows, seq_len))


@st.composite
def glm_batches(draw, invalid: bool = False, max_rows: int = 3, max_len: int = 10):
    """``(case, kwargs)``: ``batch``, ``loss_mask``, ``padding_token_id``, ``shard_primary``."""
    case = draw(st.sampled_from(GLM_INVALID)) if invalid else None
    source = draw(st.sampled_from(GLM_SOURCES))
    one_row = source == "cu_seqlens" or case == "cu-seqlens" or draw(st.integers(0, 3)) == 0
    rows = 1 if one_row else draw(st.integers(1, max_rows))
    seq_len = draw(st.integers(2 if invalid else 1, max_len))
    ids = torch.randint(1, 50, (rows, seq_len), generator=torch.Generator().manual_seed(seq_len))
    ids = ids.to(draw(st.sampled_from([torch.int64, torch.int32])))
    batch: dict = {"input_ids": ids}
    zero = source in ("seq_lens", "seq_lens_padded", "cu_seqlens")
    layouts = [draw(doc_lengths(seq_len, zero=zero)) for _ in range(rows)]
    if source == "padding_mask":
        pad = torch.tensor([[0] * sum(l) + [1] * (seq_len - sum(l)) for l in layouts])
        batch["padding_mask"] = pad.bool() if draw(st.booleans()) else pad
    elif source == "attention_binary":
        batch["attention_mask"] = _mask_dtype(draw, torch.tensor(
            [[1] * sum(l) + [0] * (seq_len - sum(l)) for l in layouts]))  # fmt: skip
    elif source in ("attention_indexed", "packed_seq_ids"):
        def ids_for(lengths):  # consecutive, gapped or repeated ids: documents are runs
            style = draw(st.sampled_from(["consecutive", "gapped", "repeated"]))
            out = list(range(1, len(lengths) + 1))
            if style == "gapped":
                out = [2 * i + 1 for i in range(len(lengths))]
            elif style == "repeated":
                out = [1 + i % 2 for i in range(len(lengths))]
            return out
        key = "attention_mask" if source == "attention_indexed" else "_packed_seq_ids"
        batch[key] = torch.tensor([_runs(l, seq_len, ids_for(l)) for l in layouts])
    elif source in ("seq_lens", "seq_lens_padded"):
        lens = _seq_lens_tensor(layouts)
        batch[source] = lens[0] if rows == 1 and draw(st.booleans()) else lens
        if source == "seq_lens_padded":  # seq_lens_padded wins; seq_lens may say anything
            batch["seq_lens"] = _seq_lens_tensor([draw(doc_lengths(seq_len)) for _ in range(rows)])
    elif source == "cu_seqlens":
        cu = [0]
        for n in layouts[0]:
            cu.append(cu[-1] + n)
        cu = cu + [-1] * draw(st.integers(0, 2))  # trailing fill values
        batch["cu_seqlens"] = torch.tensor(cu) if draw(st.booleans()) else torch.tensor([cu])
    # Lower-priority sources are ignored by both; a given padding_mask is kept as it is.
    masked = source in ("attention_binary", "attention_indexed", "packed_seq_ids")
    if masked and draw(st.booleans()):
        batch["seq_lens"] = _seq_lens_tensor([draw(doc_lengths(seq_len)) for _ in range(rows)])
    if source not in ("none", "padding_mask") and draw(st.booleans()):
        batch["padding_mask"] = torch.randint(0, 2, (rows, seq_len)).bool()
    if draw(st.booleans()):
        batch["labels"] = torch.randint(-100, 50, (rows, seq_len))
    _position_ids(draw, batch, rows, seq_len, "none")
    extras = draw(st.sets(st.sampled_from(["pixel_values", "max_seqlen", "qkv_format",
                                           "cu_seqlens_padded", "token_type_ids"])))  # fmt: skip
    for key in extras:
        batch[key] = {"pixel_values": torch.ones(4, 3), "max_seqlen": None, "qkv_format": "thd",
                      "cu_seqlens_padded": torch.tensor([0, seq_len]),
                      "token_type_ids": torch.zeros(rows, seq_len, dtype=torch.long)}[key]
    loss_mask = None
    if draw(st.booleans()):
        loss_mask = _mask_dtype(draw, torch.randint(0, 2, (rows, seq_len)))
    if rows == 1 and draw(st.integers(0, 3)) == 0:  # a THD row without batch axis
        for key in ("input_ids", "labels", "position_ids", "attention_mask", "padding_mask",
                    "_packed_seq_ids"):  # fmt: skip
            if isinstance(batch.get(key), torch.Tensor) and batch[key].shape == (1, seq_len):
                batch[key] = batch[key][0]
    if invalid:
        batch = _break_glm(draw, case, batch, rows, seq_len)
        if batch is None:
            return None, {}
    kwargs = {"batch": batch, "loss_mask": loss_mask,
              "padding_token_id": draw(st.integers(0, 99)), "shard_primary": draw(st.booleans())}
    return case, kwargs


def _without(batch: dict, *keys: str) -> dict:
    return {k: v for k, v in batch.items() if k not in keys}


#: GLM's document-id sources, first to last.
_GLM_SOURCE_KEYS = ("_packed_seq_ids", "attention_mask", "seq_lens_padded", "seq_lens",
                    "cu_seqlens", "padding_mask")  # fmt: skip


def _break_glm(draw, case: str, batch: dict, rows: int, seq_len: int):
    """One defect of kind ``case`` in a valid GLM batch (``None`` if it does not apply)."""
    if case in ("pad-tail", "mask-dims", "seq-lens-padded-none"):
        batch = _without(batch, *_GLM_SOURCE_KEYS)  # the defect is the only document source
    shape = (rows, seq_len) if batch["input_ids"].dim() == 2 else (seq_len,)
    higher = _GLM_SOURCE_KEYS[:3]  # sources that would hide a seq_lens defect
    if case == "pad-tail":  # left padding
        mask = torch.ones(shape, dtype=torch.long)
        mask[..., 0] = 0
        batch["attention_mask"] = mask
    elif case == "rows":
        if rows > 1 and draw(st.booleans()):
            batch = _without(batch, *_GLM_SOURCE_KEYS[:4])
            batch["cu_seqlens"] = torch.tensor([0, seq_len])
        else:
            batch["labels"] = torch.zeros(rows, seq_len + 1, dtype=torch.long)
    elif case == "seq-lens":
        batch = _without(batch, *higher)
        batch["seq_lens"] = torch.tensor([[seq_len, 1]] * rows)  # overflows
    elif case == "cu-seqlens":
        if rows != 1:
            return None
        batch = _without(batch, *_GLM_SOURCE_KEYS[:4])
        batch["cu_seqlens"] = torch.tensor([1, seq_len])
    elif case == "non-tensor":
        batch = _without(batch, *higher)
        batch["seq_lens"] = [[seq_len]] * rows
    elif case == "mask-dims":
        if batch["input_ids"].dim() == 1:
            return None
        batch["attention_mask"] = torch.ones(rows, 1, seq_len, seq_len, dtype=torch.long)
    elif case == "seq-lens-padded-none":
        batch["seq_lens_padded"] = None
        batch["seq_lens"] = torch.tensor([[seq_len]] * rows)
    elif case == "dtype":
        batch = _without(batch, *higher)
        batch["seq_lens"] = torch.tensor([[seq_len / 2]] * rows)
    return batch


# ---------------------------------------------------------------------------------- Qwen3.8
QWEN_MODES = ("plain", "attention_mask", "padding_mask", "both", "cu_seqlens", "seq_lens")
#: Invalid inputs: (case, the stricter-error key or None when NeMo raises the same kind).
QWEN_INVALID = (("zero-seq-len", None), ("cu-end", None), ("left-pad", None), ("indexed", None),
                ("unsupported-key", None), ("thd", None), ("no-labels", None),
                ("embeds", None), ("pad-multiple", None), ("packed-rows", None),
                ("packed-mask", None), ("disagree", None), ("float-cu", "cu-seqlens"),
                ("list-cu", "non-tensor"), ("labels-shape", "shapes"),
                ("two-row-seq-lens", "seq-lens"))  # fmt: skip


@st.composite
def qwen_batches(draw, invalid: bool = False, max_rows: int = 3, max_len: int = 10):
    """``(case, kwargs)``: ``batch``, ``loss_mask``, ``padding_token_id``, ``pad_multiple``."""
    name, case = draw(st.sampled_from(QWEN_INVALID)) if invalid else (None, None)
    modes = QWEN_MODES
    if name in ("packed-mask",):
        modes = ("cu_seqlens", "seq_lens")
    elif name in ("left-pad", "indexed", "thd", "disagree", "packed-rows"):
        modes = QWEN_MODES[:4]
    mode = draw(st.sampled_from(modes))
    packed = mode in ("cu_seqlens", "seq_lens")
    rows = 1 if packed else draw(st.integers(1, max_rows))
    if name == "packed-rows":
        rows = max(rows, 2)
    elif name in ("float-cu", "list-cu", "two-row-seq-lens"):
        rows = 1
    seq_len = draw(st.integers(2, max_len))
    ids = torch.randint(1, 50, (rows, seq_len), generator=torch.Generator().manual_seed(seq_len))
    batch: dict = {"input_ids": ids.to(draw(st.sampled_from([torch.int64, torch.int32])))}
    valid_len = [draw(st.integers(0, seq_len)) for _ in range(rows)]
    valid = torch.tensor([[1] * n + [0] * (seq_len - n) for n in valid_len])
    if mode in ("attention_mask", "both"):
        batch["attention_mask"] = _mask_dtype(draw, valid)
    if mode in ("padding_mask", "both"):
        pad = 1 - valid
        batch["padding_mask"] = pad.bool() if draw(st.booleans()) else pad
    if mode == "cu_seqlens":
        cu = [0]
        for n in draw(doc_lengths(seq_len, fill=True)):
            cu.append(cu[-1] + n)
        cu = torch.tensor(cu, dtype=draw(st.sampled_from([torch.int64, torch.int32])))
        batch["cu_seqlens"] = cu if draw(st.booleans()) else cu.unsqueeze(0)
    if mode == "seq_lens":
        lens = [n for n in draw(doc_lengths(seq_len)) if n] or [seq_len]
        lens = torch.tensor(lens + [SENTINEL] * draw(st.integers(0, 2)))
        batch["seq_lens"] = lens if draw(st.booleans()) else lens.unsqueeze(0)
        if draw(st.booleans()):
            batch["seq_lens_padded"] = lens.abs()  # ignored
        if draw(st.booleans()):
            batch["qkv_format"] = "thd"
    loss_mask = None
    if draw(st.integers(0, 4)):
        batch["labels"] = torch.randint(-100, 50, (rows, seq_len))
        if draw(st.booleans()):
            loss_mask = _mask_dtype(draw, torch.randint(0, 2, (rows, seq_len)))
    else:  # NeMo's protocol: the loss mask serves as labels
        loss_mask = _mask_dtype(draw, torch.randint(0, 2, (rows, seq_len)))
    _position_ids(draw, batch, rows, seq_len, "mrope")
    for key in draw(st.sets(st.sampled_from(["token_type_ids", "max_seqlen", "pixel_values"]))):
        batch[key] = {"token_type_ids": torch.zeros(rows, seq_len, dtype=torch.long),
                      "max_seqlen": None, "pixel_values": torch.ones(2, 3)}[key]  # fmt: skip
    kwargs = {"batch": batch, "loss_mask": loss_mask,
              "padding_token_id": draw(st.integers(0, 99)),
              "pad_multiple": draw(st.integers(2, 4))}  # fmt: skip
    if not invalid:
        return None, kwargs
    if not _break_qwen(draw, name, kwargs, rows, seq_len, packed):
        return None, {}
    return case, kwargs


def _break_qwen(draw, name: str, kwargs: dict, rows: int, seq_len: int, packed: bool) -> bool:
    """One defect ``name`` in a valid Qwen batch; ``False`` if it does not apply."""
    batch = kwargs["batch"]
    unpacked = ("cu_seqlens", "seq_lens", "seq_lens_padded", "qkv_format")
    if name == "zero-seq-len":
        batch.pop("cu_seqlens", None)
        batch["seq_lens"] = torch.tensor([1, 0, 1])
    elif name == "cu-end":
        batch["cu_seqlens"] = torch.tensor([0, seq_len - 1])
    elif name in ("left-pad", "indexed"):
        if packed:
            return False
        mask = torch.ones(rows, seq_len, dtype=torch.long)
        if name == "left-pad":
            mask[:, 0] = 0
        else:
            mask[:, seq_len // 2 :] = 2
        batch.pop("padding_mask", None)
        batch["attention_mask"] = mask
    elif name == "unsupported-key":
        batch[draw(st.sampled_from(["max_seqlen", "cu_seqlens_q", "indices"]))] = torch.tensor(3)
    elif name == "thd":
        if packed:
            return False
        batch["qkv_format"] = "thd"
    elif name == "no-labels":
        batch.pop("labels", None)
        kwargs["loss_mask"] = None
    elif name == "embeds":
        batch["inputs_embeds"] = torch.ones(rows, seq_len, 2)
    elif name == "pad-multiple":
        kwargs["pad_multiple"] = draw(st.sampled_from([0, 1]))
    elif name == "packed-rows":
        if rows == 1:
            return False
        batch["cu_seqlens"] = torch.tensor([0, seq_len])
    elif name == "packed-mask":
        if not packed:
            return False
        batch["attention_mask"] = torch.ones(1, seq_len, dtype=torch.long)
    elif name == "disagree":
        if packed:
            return False
        batch["attention_mask"] = torch.ones(rows, seq_len, dtype=torch.long)
        pad = torch.zeros(rows, seq_len, dtype=torch.bool)
        pad[:, -1] = True
        batch["padding_mask"] = pad
    elif name in ("float-cu", "list-cu"):
        for key in unpacked + ("attention_mask", "padding_mask"):
            batch.pop(key, None)
        if rows != 1:
            return False
        cu = [0, seq_len // 2, seq_len] if seq_len > 1 else [0, seq_len]
        batch["cu_seqlens"] = torch.tensor(cu, dtype=torch.float32) if name == "float-cu" else cu
    elif name == "labels-shape":
        batch["labels"] = torch.zeros(rows, seq_len + 1, dtype=torch.long)
    elif name == "two-row-seq-lens":
        for key in unpacked + ("attention_mask", "padding_mask"):
            batch.pop(key, None)
        if rows != 1 or seq_len < 2:
            return False
        batch["seq_lens"] = torch.tensor([[1], [seq_len - 1]])
    return True
