"""Regional compilation (:func:`fcp.integrations.hf.compile_layers`): one graph per decoder-layer
kind, whatever the depth, and the same loss and gradients as eager.

The graphs are counted with Dynamo's ``CompileCounterWithBackend`` over the ``eager`` backend
(Dynamo's tracing and guards are what decide sharing; AOT autograd adds nothing to it and would
cost ~30 s per graph here). The compile-time benchmark: ``benchmarks/bench_compile.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo.testing
from torch import nn

import fcp
from fcp.integrations.hf import compile_layers, decoder_layers, enable_packed_cp, layer_kinds
from tests.support.hf_reference import QWEN3_5_TINY, build


class _Layer(nn.Module):
    """A toy decoder layer whose ``kind`` (a plain attribute) selects its computation."""

    def __init__(self, kind: int, layer_idx: int):
        super().__init__()
        self.kind, self.layer_idx = kind, layer_idx
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.proj(x)) * (self.kind + 1)


class _Toy(nn.Module):
    def __init__(self, kinds: list[int]):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(_Layer(k, i) for i, k in enumerate(kinds))
        self.experts = nn.ModuleList([nn.Linear(8, 8)])  # shorter: not the layers

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("kinds", [[0, 0], [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1],
                                   [0, 1, 2] * 4])  # fmt: skip
def test_graphs_grow_with_layer_kinds_not_depth(kinds):
    torch._dynamo.reset()
    model = _Toy(kinds)
    assert [n for n, _ in decoder_layers(model)] == [f"blocks.{i}" for i in range(len(kinds))]
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    assert compile_layers(model, backend=counter, fullgraph=True) is model
    x = torch.randn(2, 8)
    got = model(x)
    assert counter.frame_count == len(set(kinds))
    model(x)  # the second step reuses every graph
    assert counter.frame_count == len(set(kinds))
    want = x @ model.embed.weight.T + model.embed.bias
    for k, block in zip(kinds, model.blocks):
        want = torch.tanh(want @ block.proj.weight.T + block.proj.bias) * (k + 1)
    torch.testing.assert_close(got, want)


def test_layer_kinds_are_structure_not_layer_numbers():
    model = _Toy([0, 1, 0, 2])
    model.blocks[3].proj = nn.Linear(8, 8, bias=False)  # kind 2 and no bias: its own kind
    assert layer_kinds(model.blocks) == [[0, 2], [1], [3]]


def test_kinds_beyond_the_recompile_limit_raise_and_the_patch_admits_them():
    model = _Toy([0, 1, 2])
    with torch._dynamo.config.patch(recompile_limit=2):
        with pytest.raises(ValueError, match=r"3 kinds of decoder layers.*recompile_limit=2"):
            compile_layers(model, backend="eager")
    with torch._dynamo.config.patch(recompile_limit=3):
        compile_layers(model, backend="eager")


def test_a_model_without_decoder_layers_is_named():
    with pytest.raises(ValueError, match="Sequential holds no nn.ModuleList"):
        compile_layers(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="non-empty iterable of nn.Modules"):
        compile_layers(_Toy([0]), layers=[])


def test_transformers_decoder_layers_compile_once_per_kind_with_eager_loss_and_grads():
    """Qwen3.5 on fcp, 4 decoder layers of 2 kinds (Gated DeltaNet and gated attention,
    alternating): 2 graphs, and a packed batch's loss and every parameter's gradient as eager."""
    config = dict(QWEN3_5_TINY, num_hidden_layers=4,
                  layer_types=["linear_attention", "full_attention"] * 2)  # fmt: skip
    eager = enable_packed_cp(build("qwen3_5", config)).train()
    model = copy.deepcopy(eager)
    assert [n for n, _ in decoder_layers(model)] == [f"layers.{i}" for i in range(4)]
    assert layer_kinds(model.layers) == [[0, 2], [1, 3]]
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    compile_layers(model, backend=counter, fullgraph=True, dynamic=False)
    gen = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(1, 128, (2, 24), generator=gen),
             "seq_lens": torch.tensor([[9, 15], [20, -1000]])}  # fmt: skip
    local, ctx = fcp.shard_batch(None, batch)
    cot = torch.randn(2, 24, config["hidden_size"], generator=gen)
    losses = []
    for m in (model, eager):
        out = m(input_ids=local["input_ids"], cp_context=ctx, use_cache=False).last_hidden_state
        loss = (out * cot).sum()
        loss.backward()
        losses.append(loss.detach())
    assert counter.frame_count == 2, counter.frame_count
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("regional", [True, False])
def test_trainer_torch_compile_compiles_the_layers(tmp_path, regional):
    """``TrainingArguments(torch_compile=True)``: the trainer compiles each decoder layer and
    turns accelerate's whole-model compile off; ``regional_compile=False`` leaves it to
    accelerate."""
    from accelerate.utils import DynamoBackend
    from transformers import DataCollatorWithFlattening

    from fcp.integrations.hf import PackedCPTrainer
    from tests._trainer_job import BATCH, arguments, dataset, tiny_model

    args = arguments(tmp_path, "c", BATCH, torch_compile=True, torch_compile_backend="eager")
    trainer = PackedCPTrainer(model=tiny_model(), args=args, train_dataset=dataset(),
                              data_collator=DataCollatorWithFlattening(), cp_size=1,
                              regional_compile=regional)  # fmt: skip
    layers = trainer.model.model.layers
    assert all((layer._compiled_call_impl is not None) == regional for layer in layers)
    accelerate_compiles = trainer.accelerator.state.dynamo_plugin.backend != DynamoBackend.NO
    assert accelerate_compiles != regional
    with pytest.raises(ValueError, match="torch_compile_backend"):
        PackedCPTrainer(model=tiny_model(), args=args, train_dataset=dataset(),
                        data_collator=DataCollatorWithFlattening(),
                        compile_options={"backend": "eager"})  # fmt: skip
    plain = arguments(tmp_path, "d", BATCH)
    with pytest.raises(ValueError, match=r"compile_options=\{'fullgraph': True\} would go unused"):
        PackedCPTrainer(model=tiny_model(), args=plain, train_dataset=dataset(),
                        data_collator=DataCollatorWithFlattening(),
                        compile_options={"fullgraph": True})  # fmt: skip
