"""bad_words, vLLM's definition: a word (as written, and with a leading space) never appears in the output's tokens;
a one-token word is banned outright, a longer one only its last token right after the others."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.bad_words import tokenize_bad_words
from engine.sampling_params import SamplingParamsError


@pytest.fixture(scope="module")
def llm():
    with LLM(max_num_seqs=16) as llm:
        yield llm


def _contains(ids: list[int], seq: tuple[int, ...]) -> bool:
    return any(tuple(ids[i : i + len(seq)]) == seq for i in range(len(ids) - len(seq) + 1))


def test_no_bad_word_appears_in_sampled_outputs(llm):
    prompts = ["Beautiful is", "Now is", "Errors should", "Simple is", "Flat is", "Sparse is"]
    words = ["better", "than ugly", "never", "is"]
    plain = llm.generate(prompts, SamplingParams(temperature=1.0, seed=1, max_tokens=40), use_tqdm=False)
    singles, sequences = tokenize_bad_words(llm.get_tokenizer(), words)
    assert singles and sequences, "the words must exercise both the bias and the mask"
    seen_before = sum(
        any(_contains(o.outputs[0].token_ids, s) for s in sequences) or bool(set(o.outputs[0].token_ids) & set(singles))
        for o in plain
    )
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, bad_words=words) for s in range(len(prompts))]
    outs = llm.generate(prompts * 4, params * 4, use_tqdm=False)
    for o in outs:
        ids = list(o.outputs[0].token_ids)
        assert not set(ids) & set(singles), o.outputs[0].text
        assert not any(_contains(ids, s) for s in sequences), o.outputs[0].text
    print(
        f"{len(outs)} sampled outputs, none with {words} ({len(singles)} banned tokens, {len(sequences)} sequences);"
        f" {seen_before}/{len(prompts)} unconstrained outputs had one"
    )
    assert seen_before >= 3


def test_greedy_takes_the_next_best_token_where_a_word_would_complete(llm):
    tokenizer = llm.get_tokenizer()
    plain = llm.generate(["Beautiful is"], SamplingParams(temperature=0, max_tokens=12, logprobs=3), use_tqdm=False)[0]
    ids = list(plain.outputs[0].token_ids)
    _, sequences = tokenize_bad_words(tokenizer, ["than ugly"])
    seq = next(s for s in sequences if _contains(ids, s))
    at = next(i for i in range(len(ids)) if tuple(ids[i : i + len(seq)]) == seq) + len(seq) - 1
    ranked = sorted(plain.outputs[0].logprobs[at].items(), key=lambda kv: -kv[1].logprob)
    second_best = next(t for t, _ in ranked if t != ids[at])
    got = llm.generate(
        ["Beautiful is"], SamplingParams(temperature=0, max_tokens=12, bad_words=["than ugly"]), use_tqdm=False
    )[0]
    got_ids = list(got.outputs[0].token_ids)
    print(f"{plain.outputs[0].text!r} -> {got.outputs[0].text!r} (token {ids[at]} replaced by {second_best})")
    assert got_ids[:at] == ids[:at] and got_ids[at] == second_best


def test_bad_words_apply_inside_a_structured_output(llm):
    params = [
        SamplingParams(
            temperature=1.0, seed=s, max_tokens=10, bad_words=["better"],
            structured_outputs=StructuredOutputsParams(choice=["better", "worse"]),
        )
        for s in range(8)
    ]  # fmt: skip
    outs = llm.generate(["Beautiful is"] * 8, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    print(f"choice better|worse with bad_words [better]: {texts}")
    # "better" cannot be finished: a sequence that began it ends where the two constraints leave nothing but EOS
    assert "worse" in texts and all(t == "worse" or ("better".startswith(t) and t != "better") for t in texts)
    assert {o.outputs[0].finish_reason for o in outs} == {"stop"}


def test_bad_words_that_are_not_words_are_refused():
    for value in ([""], ["  "], "never", [3]):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(bad_words=value)  # type: ignore[arg-type]
        assert e.value.param == "bad_words"


def test_constraints_that_leave_no_token_end_only_their_own_request(llm):
    """allowed_token_ids outside every token the grammar allows: the request ends ("abort"); the others in the
    same steps are untouched (raising would fail the step for all of them)."""
    contradictory = SamplingParams(
        temperature=0, max_tokens=8, allowed_token_ids=[5],
        structured_outputs=StructuredOutputsParams(choice=["better"]),
    )  # fmt: skip
    plain = SamplingParams(temperature=0, max_tokens=8)
    outs = llm.generate(["Beautiful is", "Now is", "Flat is"], [contradictory, plain, plain], use_tqdm=False)
    got = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
    print(got)
    assert got[0][1] == "abort"
    assert got[1:] == [(" better than never.", "stop"), (" better than nested.", "stop")]
