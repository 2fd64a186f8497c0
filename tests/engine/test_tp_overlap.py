"""Two micro-batches whose all-reduces overlap the other's GEMMs (engine/model/overlap.py), in one process.

The model is rank 0 of a two-rank Llama whose "other rank" holds the same shard, so the sum over the ranks
doubles a partial output.  The overlapped forward's sums are deferred: the doubling happens only at `wait()`,
so a half that read its partial output before waiting for the sum (or never waited) would differ from the
plain forward.  Biases everywhere (q/k/v, o_proj, MLP) check that each is added once, after the sum.  The
engine-level check over real gloo processes is in tests/engine/test_tensor_parallel.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.core.plan import NewSeq, SamplingSpec, SeqStep, StepPlan
from engine.distributed.executor import check_overlap_supported
from engine.model.llama import LlamaForCausalLM
from engine.model.overlap import overlaps, set_overlap_tokens, split_point
from engine.parallel.group import Reduction, TPGroup
from engine.runner.model_runner import ModelRunner


class _Deferred(Reduction):
    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.tensor.mul_(2)
            self.work = None
        return self.tensor


@dataclass(frozen=True)
class TwinRanks(TPGroup):
    """Rank 0 of two ranks that hold the same shard: a sum over the ranks doubles."""

    calls: list[str] = field(default_factory=list, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("all_reduce")
        return x.mul_(2)

    def start_all_reduce(self, x: torch.Tensor) -> Reduction:
        self.calls.append("start")
        return _Deferred(x, work=True)


def _model(tp: TPGroup) -> LlamaForCausalLM:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attention_bias=True,  # q/k/v and o_proj biases
        mlp_bias=True,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, "LlamaForCausalLM", 128, torch.device("cpu"), tp=tp)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return model.eval()


def _plans() -> list[StepPlan]:
    """A step of fresh prompts (21, 9 and 1 tokens), then a mixed step: two decodes and a 6-token chunk that
    reads the first step's KV."""
    greedy = SamplingSpec(temperature=0.0)
    first = StepPlan(num_batched_tokens=31)
    for i, (n, blocks) in enumerate([(21, [0, 1]), (9, [2]), (1, [3])]):
        first.new_seqs.append(NewSeq(f"s{i}", greedy))
        first.seqs.append(SeqStep(f"s{i}", 0, n, list(range(5 + i, 5 + i + n)), table_blocks=blocks))
    second = StepPlan(num_batched_tokens=8)
    second.seqs = [
        SeqStep("s0", 21, 1, [40], table_start=2),
        SeqStep("s1", 9, 6, [41, 42, 43, 44, 45, 46], table_start=1),
        SeqStep("s2", 1, 1, [47], table_start=1),
    ]
    return [first, second]


def _run(model: LlamaForCausalLM) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    runner = ModelRunner(model, 8, 16, torch.float32, torch.device("cpu"), 0, max_model_len=128)
    hidden = []
    for plan in _plans():
        runner.update_state(plan)
        hidden.append(runner.forward_hidden(runner.prepare(plan)).clone())
    return hidden, [c.clone() for c in runner.kv_caches]


def test_two_micro_batches_give_the_plain_forwards_hidden_states_and_kv():
    tp = TwinRanks(0, 2)
    model = _model(tp)
    layers = len(model.model.layers)
    assert model.overlap_tokens == 0  # off unless asked for
    plain_hidden, plain_kv = _run(model)
    assert tp.calls == ["all_reduce"] * (1 + 2 * layers) * 2 and model.overlapped_steps == 0
    tp.calls.clear()
    set_overlap_tokens(model, 8)  # both steps (31 and 8 tokens) split
    split_hidden, split_kv = _run(model)
    print(f"\nreductions per overlapped forward: {len(tp.calls) // 2} started, none waited for inline")
    assert tp.calls == ["start"] * (2 + 4 * layers) * 2 and model.overlapped_steps == 2
    for got, want in zip(split_hidden + split_kv, plain_hidden + plain_kv):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    tp.calls.clear()
    set_overlap_tokens(model, 9)  # the 8-token step no longer splits
    _run(model)
    assert model.overlapped_steps == 3 and tp.calls.count("all_reduce") == 1 + 2 * layers


def test_which_steps_split_and_where():
    x = torch.zeros(1)
    assert not overlaps(0, 4096, x)  # off
    assert not overlaps(2048, 2047, x) and overlaps(2048, 2048, x)
    assert not overlaps(2, 1, x)  # one row cannot split
    assert split_point(4096) == 2048 and split_point(1000) == 496  # a multiple of 16
    assert split_point(31) == 15 and split_point(2) == 1  # too few rows to align: half, never an empty half
    for n in range(2, 300):
        assert 0 < split_point(n) < n


def test_the_switch_is_refused_where_it_cannot_work():
    model = _model(TwinRanks(0, 2))
    for bad in (-1, 1):
        with pytest.raises(ValueError, match="0 \\(off\\) or >= 2"):
            set_overlap_tokens(model, bad)
    one_rank = _model(TPGroup())
    set_overlap_tokens(one_rank, 64)
    assert one_rank.overlap_tokens == 0  # nothing to overlap on one rank
    with pytest.raises(ConfigError, match="needs --tensor-parallel-size 2 or more"):
        EngineConfig(tensor_parallel_overlap_tokens=2048)
    with pytest.raises(ConfigError, match="0 \\(off\\) or >= 2"):
        EngineConfig(tensor_parallel_size=2, tensor_parallel_overlap_tokens=1)
    config = EngineConfig(tensor_parallel_size=2, tensor_parallel_overlap_tokens=2048)
    check_overlap_supported(config, SimpleNamespace(architecture="Qwen2ForCausalLM"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="OPTForCausalLM does not split"):
        check_overlap_supported(config, SimpleNamespace(architecture="OPTForCausalLM"))  # type: ignore[arg-type]


def test_a_packed_row_parallel_layer_replaces_its_partial_product(monkeypatch):
    """CPU packing (engine/model/cpu_packing.py) on a tensor-parallel rank swaps the layer's partial product and
    keeps its forward (the sum, then the bias), which the overlapped forward takes apart.  The packed product is
    stubbed: this CPU may have no oneDNN bf16 (tests/engine/test_cpu_packing.py checks the real one); the stub has
    no few-row panel copy, so that copy is turned off here (tests/kernels/test_cpu_linear.py checks it)."""
    import torch.nn.functional as F

    from engine.model import cpu_packing
    from engine.model.layers.linear import RowLinear

    class Stub:
        def __init__(self, weight, bias):
            self.packed, self.bias = weight.detach().clone(), bias

        def __call__(self, x):
            return F.linear(x, self.packed, self.bias)

    monkeypatch.setattr(cpu_packing, "packing_available", lambda dtype: True)
    monkeypatch.setattr(cpu_packing, "_PackedProduct", Stub)
    monkeypatch.setenv("PAGEKEEPER_CPU_DECODE_WEIGHTS", "off")
    tp = TwinRanks(0, 2)
    layer = RowLinear(8, 6, bias=True, tp=tp)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(3, 4)
    want = 2 * F.linear(x, layer.weight) + layer.bias  # the two twin ranks' sum, then the bias once
    with torch.no_grad():
        assert cpu_packing.pack_linears(layer) == 1
        assert "partial" in vars(layer) and "forward" not in vars(layer)
        torch.testing.assert_close(layer(x), want)
        torch.testing.assert_close(layer.finish(tp.start_all_reduce(layer.partial(x)).wait()), want)
