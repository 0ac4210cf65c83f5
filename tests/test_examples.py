"""The example models, their data and the demo's training loop, on real gloo groups.

* every model (transformers' GLM-5.3-Flash on fcp and the two home-made ones) trained for 3 steps
  with CP 2 and 4 (FSDP2 over the CP ranks) ends with the parameters of the same training in one
  process;
* the demo loop as ``make demo`` runs it (AdamW, token mixers compiled with fullgraph, rank 0
  checks), on transformers' GLM-5.3-Flash with CP 2: no recompilation over changing packings, no
  graph break, losses equal to one process step by step; and with data parallel 2 x CP 2;
* ``--model qwen4_exp`` (transformers' Qwen4-Exp): the same loop, a few steps on CP 2, its report
  and plot;
* the data module packs real standard-library text into valid documents.
"""

from __future__ import annotations

import sysconfig

import pytest
import torch

import fcp
from examples.data import IGNORE_INDEX, PackedDocuments, decode, stdlib_source_files
from examples.comm_accounting import CommBytes
from examples.demo import DemoOptions, train
from examples.models import MODELS, build_model
from tests import _example_rank_fns as fns

POOL_TIMEOUT_S = 240.0  # ranks compiling side by side on 2 shared cores


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (a tensor-wide relative error)."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


ALL_MODELS = ("glm5-hf", "qwen4_exp", *sorted(MODELS))


def _eager_opts(model: str, cp: int = 1, **kw) -> dict:
    # SGD: parameter updates are linear in the gradients, so the comparison measures the CP
    # gradients themselves (Adam's per-element normalisation magnifies float32 rounding of
    # near-zero gradient entries; the AdamW demo loop is compared by its losses below).
    base = dict(model=model, steps=3, seq_len=128, batch_size=2, dp=1, cp=cp, compile=False,
                reference=False, twin=False, progress=False, optimizer="sgd", lr=0.05,
                count_bytes=False)  # fmt: skip
    base.update(kw)
    return base


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
def test_packed_documents_are_valid_real_text():
    seq_len = 256
    data = PackedDocuments(seq_len, batch_size=2, seed=3)
    batches = data.batches(6)
    assert all(torch.equal(a["input_ids"], b["input_ids"])
               for a, b in zip(batches, PackedDocuments(seq_len, 2, seed=3).batches(6)))
    other_seed = PackedDocuments(seq_len, 2, seed=4).batches(1)[0]
    assert not torch.equal(batches[0]["input_ids"], other_seed["input_ids"])

    openings = []
    for path in stdlib_source_files():
        with open(path, "rb") as f:
            openings.append(f.read(seq_len))
    stdlib = sysconfig.get_paths()["stdlib"]
    assert all(str(p).startswith(stdlib) for p in stdlib_source_files()[:5])
    n_docs = set()
    for batch in batches:
        ids, labels, seq_lens = batch["input_ids"], batch["shift_labels"], batch["seq_lens"]
        assert ids.shape == labels.shape == (2, seq_len) and ids.dtype == torch.long
        assert int(ids.min()) >= 0 and int(ids.max()) <= 255
        doc_ids = fcp.doc_ids_from_seq_lens(seq_lens, seq_len)
        fcp.validate_doc_ids(doc_ids)
        n_docs.add(tuple((seq_lens >= 0).sum(1).tolist()))
        for row in range(2):
            lens = seq_lens[row][seq_lens[row] >= 0]
            # lengths -> doc ids -> lengths round trip (the pad tail is its own last segment)
            seg = fcp.segment_cu_seqlens(doc_ids[row]).diff()
            pad = seq_len - int(lens.sum())
            assert seg.tolist() == lens.tolist() + ([pad] if pad else [])
            assert int(fcp.lengths_from_doc_ids(doc_ids[row : row + 1])) == int(lens.sum())
            pos = 0
            for length in lens.tolist():
                doc = ids[row, pos : pos + length]
                text = bytes(doc.tolist())
                assert any(o.startswith(text) for o in openings), decode(doc)[:80]
                assert torch.equal(labels[row, pos : pos + length - 1], doc[1:])
                assert int(labels[row, pos + length - 1]) == IGNORE_INDEX
                pos += length
            assert bool((ids[row, pos:] == 0).all())  # pad tail
            assert bool((labels[row, pos:] == IGNORE_INDEX).all())
    assert len(n_docs) > 1, "packings should differ from batch to batch"

    one = PackedDocuments(seq_len, batch_size=1, seed=0).batches(1)[0]
    assert torch.equal(fcp.doc_ids_from_cu_seqlens(one["cu_seqlens"], seq_len),
                       fcp.doc_ids_from_seq_lens(one["seq_lens"], seq_len))
    local, ctx = fcp.shard_batch(None, one, pad_multiple=4)
    assert torch.equal(local["input_ids"][:, :seq_len], one["input_ids"])
    assert ctx.global_seq_len % 4 == 0


# ---------------------------------------------------------------------------------------------
# models: CP == no CP after optimizer steps
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def no_cp_runs():
    """Per model: the no-CP run, and each parameter's tolerance: 1e-5, or twice what float32
    rounding alone does to that parameter in the same no-CP run (measured against float64)
    where that is more. Qwen4-Exp's PLE gate takes a signed square root, whose gradient
    magnifies rounding: its PLE norm weights move by 6.7e-5 between float32 and float64."""
    runs = {}
    for name in ALL_MODELS:
        ref = train(None, DemoOptions(**_eager_opts(name)))
        exact = dict(train(None, DemoOptions(**_eager_opts(name, dtype="float64")))["model"]
                     .named_parameters())  # fmt: skip
        tol = {k: max(1e-5, 2 * _rel_diff(p.detach().double(), exact[k].detach()))
               for k, p in ref["model"].named_parameters()}  # fmt: skip
        runs[name] = ref, tol
    return runs


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", ALL_MODELS)
def test_model_cp_matches_no_cp_after_3_steps(rank_pool, no_cp_runs, name, cp):
    ref, tol = no_cp_runs[name]
    outs = rank_pool.run(fns.train_on_ranks, cp, _eager_opts(name, cp), timeout=POOL_TIMEOUT_S)
    ref_params = dict(ref["model"].named_parameters())
    for rank, out in enumerate(outs):
        for step, (r, r0) in enumerate(zip(out["records"], ref["records"])):
            assert abs(r["loss_cp"] - r0["loss_cp"]) <= 1e-5 * abs(r0["loss_cp"]), (rank, step)
        assert out["params"].keys() == ref_params.keys()
        for pname, p in out["params"].items():
            err = _rel_diff(p, ref_params[pname].detach())
            assert err < tol[pname], f"rank {rank}: {pname} differs from no-CP by {err:.2e}"
    # every rank takes the same optimizer step
    for out in outs[1:]:
        for pname, p in out["params"].items():
            torch.testing.assert_close(p, outs[0]["params"][pname], rtol=0, atol=0)


def test_models_run_single_process_and_count_bytes():
    # fcp.PackedContext alone is a valid single-process context; no collective runs without CP.
    batch = PackedDocuments(64, batch_size=1).batches(1)[0]
    for name in MODELS:
        model = build_model(name, layers=("kda", "sparse" if name == "glm5" else "compressed"))
        local, ctx = fcp.shard_batch(None, batch, pad_multiple=model.pad_multiple)
        with CommBytes(0, 1) as comm:
            logits = model(local["input_ids"], ctx)
        assert logits.shape == (1, ctx.global_seq_len, 256) and comm.calls == 0
        assert bool(torch.isfinite(logits).all())


# ---------------------------------------------------------------------------------------------
# the demo's loop, compiled, CP 2
# ---------------------------------------------------------------------------------------------
# The demo's loop as `make demo` runs it (AdamW, token mixers compiled, rank 0 checks), on
# transformers' GLM-5.3-Flash over 2 ranks with shorter rows.
COMPILED = dict(model="glm5-hf", steps=4, seq_len=128, batch_size=1, dp=1, cp=2, compile=True,
                backend="aot_eager", reference=True, reference_every=1, twin=True,
                progress=False)  # fmt: skip


@pytest.fixture(scope="module")
def compiled_cp2(rank_pool):
    return rank_pool.run(fns.train_on_ranks, 2, COMPILED, True, timeout=POOL_TIMEOUT_S)


def test_compiled_cp_trains_over_new_packings_without_recompiles(compiled_cp2):
    batches = PackedDocuments(COMPILED["seq_len"], 1).batches(COMPILED["steps"])
    packings = [b["seq_lens"] for b in batches]
    assert len({tuple(p.flatten().tolist()) for p in packings}) == COMPILED["steps"]
    for out in compiled_cp2:
        s = out["summary"]
        # one graph per kind of token mixer (the KDA layers share theirs), none after step 1
        assert s["graphs_compiled"] == 2 and s["recompiles"] == 0, s
        # Dynamo's own counters agree: no graph break, as many AOT compilations as graphs
        assert s["graph_breaks"] == 0 and s["aot_compiles"] == s["graphs_compiled"], s
        assert [r["graphs"] for r in out["records"]] == [2] * COMPILED["steps"]
        sent = {r["op_bytes"] for r in out["records"]}  # static shapes: the same every step
        assert len(sent) == 1 and sent.pop() > 0


def test_demo_loop_cp_and_no_cp_losses_agree(compiled_cp2):
    recs = compiled_cp2[0]["records"]
    assert len(recs) == COMPILED["steps"]
    for r in recs:
        assert r["rel_diff"] < 1e-5, r  # same weights, one process
        assert r["twin_rel_diff"] < 1e-5, r  # independent single-process run, own AdamW
    assert recs[-1]["loss_cp"] < recs[0]["loss_cp"]  # it learns
    for other in compiled_cp2[1:]:  # the CP loss is the same global value on every rank
        assert [r["loss_cp"] for r in other["records"]] == [r["loss_cp"] for r in recs]


@pytest.mark.slow
def test_demo_data_parallel_2_by_context_parallel_2(rank_pool):
    """``examples/demo.py --dp 2 --cp 2``'s loop: FSDP2 over the (2, 2) mesh, two rows per step
    dealt to the two replicas; every step equals one process (same weights and the twin)."""
    opts = dict(model="glm5-hf", steps=3, seq_len=64, batch_size=1, dp=2, cp=2, compile=False,
                reference=True, reference_every=1, twin=True, progress=False)  # fmt: skip
    outs = rank_pool.run(fns.train_on_ranks, 4, opts, timeout=POOL_TIMEOUT_S)
    recs = outs[0]["records"]
    for r in recs:
        assert r["rel_diff"] < 1e-5 and r["twin_rel_diff"] < 1e-5, r
    for other in outs[1:]:
        assert [r["loss_cp"] for r in other["records"]] == [r["loss_cp"] for r in recs]
    assert outs[0]["summary"]["dp"] == 2 and outs[0]["summary"]["cp"] == 2


# `examples/demo.py --model qwen4_exp`'s loop: transformers' Qwen4-Exp (Gated DeltaNet, PLE, QSA
# attention, MoE), its mixers compiled, 3 short steps on CP 2, rank 0's checks and the report.
QWEN4 = dict(COMPILED, model="qwen4_exp", steps=3, seq_len=64)


def test_demo_qwen4_exp_trains_like_one_process(rank_pool, tmp_path):
    from examples.demo import write_report

    outs = rank_pool.run(fns.train_on_ranks, 2, QWEN4, True, timeout=POOL_TIMEOUT_S)
    recs, s = outs[0]["records"], outs[0]["summary"]
    for r in recs:
        assert r["rel_diff"] < 1e-5 and r["twin_rel_diff"] < 1e-5, r
    assert recs[-1]["loss_cp"] < recs[0]["loss_cp"]
    assert [r["loss_cp"] for r in outs[1]["records"]] == [r["loss_cp"] for r in recs]
    assert s["layers"] == ["ple", "gdn", "gdn", "qsa", "ple", "gdn"], s["layers"]
    # one graph per mixer kind (the two PLE layers' hashed tables differ in size), no recompile
    assert s["graphs_compiled"] == 4 and s["recompiles"] == 0 and s["graph_breaks"] == 0, s
    report = write_report(outs[0], DemoOptions(**QWEN4), tmp_path, wall_s=1.0)
    assert "qwen4_exp" in report.read_text() and (tmp_path / "curves.png").stat().st_size > 0


def test_demo_report_without_matplotlib_skips_the_plot(tmp_path, monkeypatch, capsys):
    """A finished training without matplotlib still writes its report (and the demo its final
    parity line): the plot is skipped with a note, an earlier run's plot removed."""
    import sys

    from examples.demo import write_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    (tmp_path / "curves.png").write_bytes(b"an earlier run's plot")
    recs = [{"step": s, "loss_cp": 5.0 - s, "loss_ref": 5.0 - s, "rel_diff": 0.0,
             "time_cp_s": 1.0, "tokens": 64, "tokens_per_s": 64.0, "op_bytes": None,
             "collectives": None, "fsdp_bytes": 0, "graphs": 1} for s in (1, 2)]  # fmt: skip
    summary = {"model": "glm5-hf", "layers": ["kda"], "params": 1, "dp": 1, "cp": 2,
               "graphs_compiled": 1, "recompiles": 0, "graph_breaks": 0}  # fmt: skip
    report = write_report({"records": recs, "summary": summary}, DemoOptions(), tmp_path, 1.0)
    assert "no plot: matplotlib is not installed" in report.read_text()
    assert not (tmp_path / "curves.png").exists() and (tmp_path / "steps.csv").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out
