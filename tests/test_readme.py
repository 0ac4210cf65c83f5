"""The README's Python blocks run, each with the names its prose says exist.

Every ```python block of README.md is found by the section it stands in; a new block without a
runner here fails :func:`test_every_python_block_has_a_runner`, so the README cannot grow an
example that does not run. The python blocks of ``docs/`` run in ``tests/test_docs.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

import fcp
from tests import _readme_rank_fns as fns

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> dict[str, str]:
    """``{section heading: code}`` of the README's python blocks (one per section)."""
    text = README.read_text()
    blocks = {}
    for m in re.finditer(r"```python\n(.*?)```", text, flags=re.S):
        heading = re.findall(r"^## (.*)$", text[: m.start()], flags=re.M)[-1]
        assert heading not in blocks, f"two python blocks under '## {heading}'"
        blocks[heading] = m.group(1)
    return blocks


def small_batch() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(1, 100, (1, 14), generator=gen),
            "labels": torch.randint(1, 100, (1, 14), generator=gen),
            "cu_seqlens": torch.tensor([0, 5, 12])}  # fmt: skip


def run(code: str, **names) -> dict:
    scope = dict(names)
    exec(compile(code, "README.md", "exec"), scope)
    return scope


def test_every_python_block_has_a_runner():
    assert set(python_blocks()) == set(RUNNERS), sorted(python_blocks())


def run_transformers(code):
    from fcp.integrations.hf import SUPPORTED
    from tests.support.hf_reference import QWEN3_NEXT_TINY, build

    model = build("qwen3_next", QWEN3_NEXT_TINY)
    out = run(code, fcp=fcp, model=model, cp_mesh=None,
              batch={"input_ids": small_batch()["input_ids"], "seq_lens": torch.tensor([[5, 7]])})
    assert out["model"] is model
    assert {type(m).__mro__[1] for m in model.modules()} & set(SUPPORTED.values())
    assert out["out"].last_hidden_state.shape == (1, 14, QWEN3_NEXT_TINY["hidden_size"])


RUNNERS = {
    "transformers models": run_transformers,
    "Training on a data x context mesh": None,  # on 4 gloo ranks: the test below
}


def test_transformers_models():
    run_transformers(python_blocks()["transformers models"])


def test_training_on_a_data_x_context_mesh(rank_pool):
    """The recipe on a transformers model, dp 2 x cp 2: every rank reports the loss one process
    computes on the whole global batch, over its real next-token targets, and the step trains."""
    from fcp.integrations.hf import enable_packed_cp
    from tests._causal_lm_rank_fns import causal_lm

    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 128, (4, 24), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone(),
             "seq_lens": torch.tensor([[9, 11], [5, -1000], [24, -1000], [3, 12]])}
    results = rank_pool.run(fns.training_block, 4, python_blocks()["Training on a data x context mesh"],
                            batch, timeout=120)  # fmt: skip
    values, tokens, frozen = zip(*results)
    local, ctx = fcp.shard_batch(None, batch)
    one = float(enable_packed_cp(causal_lm())(**local, cp_context=ctx).loss.detach())
    assert all(abs(v - one) <= 1e-5 * one for v in values)  # the global mean on every rank
    assert tokens[0] == 8 + 10 + 4 + 23 + 2 + 11  # each document's next-token targets only
    assert all(f == [] for f in frozen)  # AdamW moved every parameter


def test_readme_is_short_and_its_links_resolve():
    """The README stays an entry page (under 150 lines), its list of families sits between the
    markers the family registry fills, and every relative link points at a file of the
    repository."""
    text = README.read_text()
    assert len(text.splitlines()) < 150, len(text.splitlines())
    assert text.count("<!-- families:begin -->") == text.count("<!-- families:end -->") == 1
    listed = text.split("<!-- families:begin -->")[1].split("<!-- families:end -->")[0]
    assert re.match(r"\d+ families: ", listed.strip()), listed[:200]
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (README.parent / target).is_file(), target
