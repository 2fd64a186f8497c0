"""Must-show 3: echo + logprobs (lm-eval's loglikelihood request) and prompt_logprobs through the
official openai client equal transformers' logprobs on the same checkpoint (float32, CPU) to 1e-4."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from engine.default_model import DEFAULT_MODEL_DIR

MODEL = "pagekeeper-default"
PROMPTS = ["Errors should never pass silently.", "Now is better than never. Although never is"]


@pytest.fixture(scope="module")
def client(shared_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(shared_server):
    """transformers' log-softmax over each prompt, tokenized by the server."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR)).float().eval()
    out = {}
    with torch.inference_mode():
        for text in PROMPTS:
            ids = httpx.post(shared_server.url + "/tokenize", json={"prompt": text}).json()["tokens"]
            out[text] = (ids, torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1))
    return out


def test_echo_with_logprobs_scores_the_prompt_like_transformers(client, reference):
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=1, temperature=0, echo=True, logprobs=1)
    worst, scored = 0.0, 0
    for choice, text in zip(r.choices, PROMPTS):
        ids, ref = reference[text]
        lp = choice.logprobs
        assert choice.text.startswith(text)
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for pos in range(1, len(ids)):
            worst = max(worst, abs(lp.token_logprobs[pos] - ref[pos - 1, ids[pos]].item()))
            scored += 1
        # the generated token (greedy) is scored by the last prompt position
        assert abs(lp.token_logprobs[-1] - ref[-1].max().item()) < 1e-4
    print(f"echo+logprobs: {scored} prompt tokens, max |logprob - transformers| = {worst:.2e}")
    assert worst < 1e-4


def test_prompt_logprobs_field_on_both_endpoints(client, reference):
    text = PROMPTS[1]
    ids, ref = reference[text]
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=2, extra_body={"prompt_logprobs": 2})
    entries = r.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        entry = entries[pos]
        assert abs(entry[str(ids[pos])]["logprob"] - ref[pos - 1, ids[pos]].item()) < 1e-4
        top = ref[pos - 1].topk(2)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert abs(entry[str(t)]["logprob"] - v) < 1e-4 and entry[str(t)]["rank"] == rank
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    chat_entries = chat.model_extra["prompt_logprobs"]
    print(f"completions: {len(entries)} prompt positions scored; chat: {len(chat_entries)}")
    assert chat_entries[0] is None and all(len(e) == 1 for e in chat_entries[1:])
