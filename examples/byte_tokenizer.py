"""A character-level tokenizer of printable ASCII for the examples (no download): ids are the
characters' codes, ``0`` pads, ``1`` ends a sequence, ``2`` stands for anything else.

    >>> tok = byte_tokenizer()
    >>> tok("def f():")["input_ids"]
    [100, 101, 102, 32, 102, 40, 41, 58]
    >>> len(tok), tok.pad_token_id, tok.eos_token_id
    (128, 0, 1)
"""

from __future__ import annotations


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` with a vocabulary of 128 (ASCII codes; tab and newline
    included)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({chr(i): i for i in (9, 10, *range(32, 127))})
    vocab["<del>"] = 127
    vocab.update({f"<c{i}>": i for i in range(3, 32) if i not in (9, 10)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")  # fmt: skip
