"""Structured outputs on checkpoints whose EOS ids lie past the tokenizer's vocabulary (an embedding padded beyond
it).  The grammar engine only knows the tokenizer's tokens: an EOS id outside them is left out of the grammar's
end, and a model with no EOS id inside them refuses structured-output requests with a reason naming what to fix,
while its plain requests keep working.  Before, llguidance raised "EOS token ID … out of range" inside the request
(seen on an H100 benchmark checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.sampling_params import SamplingParamsError
from tests.checkpoints import make_checkpoint


def _with_eos(root: Path, name: str, eos: list[int]) -> Path:
    out = make_checkpoint("llama", root / name, extra_vocab=64)  # 64 embedding rows past the tokenizer's
    config = json.loads((out / "config.json").read_text())
    config["eos_token_id"] = eos
    (out / "config.json").write_text(json.dumps(config))
    return out


def _tokenizer_size(llm: LLM) -> int:
    return len(llm.llm_engine.tokenizer)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("grammar-eos")


def test_an_eos_id_past_the_tokenizer_is_left_out_of_the_grammar(root: Path) -> None:
    probe = LLM(str(make_checkpoint("llama", root / "probe")), max_model_len=128)
    inside = 2
    outside = _tokenizer_size(probe) + 10
    llm = LLM(str(_with_eos(root, "mixed", [inside, outside])), max_model_len=128)
    params = SamplingParams(
        temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    out = llm.generate(["Answer:"], params, use_tqdm=False)[0].outputs[0]
    print(repr(out.text), out.finish_reason)
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_a_model_with_no_eos_inside_the_tokenizer_refuses_structured_outputs_with_the_reason(root: Path) -> None:
    probe = LLM(str(make_checkpoint("llama", root / "probe2")), max_model_len=128)
    outside = _tokenizer_size(probe) + 10
    llm = LLM(str(_with_eos(root, "outside", [outside])), max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    with pytest.raises(SamplingParamsError) as e:
        llm.generate(["Count:"], params, use_tqdm=False)
    print(e.value)
    assert e.value.param == "structured_outputs"
    assert f"EOS token ids [{outside}]" in str(e.value) and "eos_token_id" in str(e.value)
    plain = llm.generate(["Count:"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert len(plain.outputs[0].token_ids) == 8  # the model still serves everything else
