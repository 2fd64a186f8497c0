"""benchmarks/perplexity.py (issue 39, must-show 2): its arithmetic against hand-computed cases, the corpus split, the
merge into the quantization results file, and the whole --quick run on the CPU (a tiny model trained for seconds,
then the bf16, FP8-weight, FP8-KV and AWQ engines), so that nothing but the numbers is new on the device."""

from __future__ import annotations

import json
import math
import zlib

import pytest

from benchmarks import perplexity as ppl


def test_windows_are_non_overlapping_and_spread_over_the_stream():
    stream = list(range(20))
    assert ppl.windows(stream, 4, 10) == [stream[i : i + 4] for i in range(0, 20, 4)]  # all 5: fewer than asked
    assert ppl.windows(stream, 4, 2) == [[0, 1, 2, 3], [8, 9, 10, 11]]  # windows 0 and 2 of 5
    assert ppl.windows(stream, 6, 9) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]]
    with pytest.raises(ValueError):
        ppl.windows(stream, 1, 3)


def test_perplexity_weighs_every_token_alike_not_every_window():
    # window 1 scores p = 1/2 and 1/4, window 2 scores p = 1/2: nll = (ln 2 + ln 4 + ln 2) / 3 = 4/3 ln 2
    lps = [[math.log(0.5), math.log(0.25)], [math.log(0.5)]]
    assert ppl.perplexity(lps) == pytest.approx(2 ** (4 / 3))  # 2.520; the windows' mean ppl would be 2.414
    assert ppl.perplexity([[0.0, 0.0]]) == 1.0
    with pytest.raises(ValueError):
        ppl.perplexity([[], []])


def test_greedy_agreement_counts_tokens_before_the_first_divergence():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    got = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]  # equal; diverges at 2 (the 8 after it does not count); at 0
    assert ppl.agreement(ref, got) == {"prefix": round((1 + 0.5 + 0) / 3, 4), "full": round(1 / 3, 4)}
    assert ppl.agreement(ref, [[1, 2], [5, 6, 7, 8], [9, 9, 9, 9]])["prefix"] == round((0.5 + 1 + 1) / 3, 4)
    with pytest.raises(ValueError):
        ppl.agreement(ref, ref[:2])


def test_prompt_logprobs_are_read_as_the_prompt_tokens_own():
    from engine.outputs import Logprob, RequestOutput

    out = RequestOutput("r", None, [7, 8, 9])
    out.prompt_logprobs = [None, {8: Logprob(-1.5, rank=2), 3: Logprob(-0.5, rank=1)}, {9: Logprob(-0.25, rank=1)}]
    assert ppl.prompt_token_logprobs(out) == [-1.5, -0.25]
    out.prompt_logprobs = None
    with pytest.raises(RuntimeError):
        ppl.prompt_token_logprobs(out)


def test_greedy_prompts_start_half_a_stride_in():
    assert ppl.greedy_prompts(list(range(40)), 4, 3) == [[5, 6, 7], [15, 16, 17], [25, 26, 27], [35, 36, 37]]
    assert ppl.greedy_prompts(list(range(10)), 4, 8) == [[1, 2, 3, 4, 5, 6, 7, 8]]  # only the first fits


def test_the_learning_rate_warms_up_then_decays_to_its_floor():
    cfg = ppl.TrainConfig(lr=1e-3, warmup_fraction=0.1, min_lr_fraction=0.1)
    assert ppl.lr_at(cfg, 0.05) == pytest.approx(5e-4)
    assert ppl.lr_at(cfg, 0.1) == pytest.approx(1e-3)
    assert ppl.lr_at(cfg, 0.55) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half-way through the cosine
    assert ppl.lr_at(cfg, 1.0) == pytest.approx(1e-4) and ppl.lr_at(cfg, 1.3) == pytest.approx(1e-4)


def test_the_split_is_by_file_and_by_path(tmp_path):
    names = [f"m{i}.py" for i in range(40)]
    for n in names:
        (tmp_path / n).write_text(f"x = {n!r}\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "pkg.py").write_text("installed = True\n")
    train, held = ppl.split_corpus([tmp_path])
    want_held = {f"x = {n!r}\n" for n in names if zlib.crc32(n.encode()) % ppl.HELDOUT_EVERY == 0}
    assert set(held) == want_held and len(train) + len(held) == 40
    assert not any("installed" in t for t in train + held)


def test_ratios_and_the_merge_into_the_quantization_file(tmp_path):
    result = {"ppl_bf16": 4.0, "ppl_fp8": 4.02, "ppl_fp8_kv": 4.01, "greedy_agreement": {"fp8": {"prefix": 0.9}}}
    result.update(ppl.ratios(result))
    assert result["ppl_ratio_fp8"] == 1.005 and result["ppl_ratio_fp8_kv"] == 1.0025 and result["ppl_ratio_awq"] is None
    quant = tmp_path / "quantization-h100-2026-01-01.json"
    quant.write_text(json.dumps({"fp8_throughput_ratio": 1.4, "ppl_ratio_fp8": None, "ppl_ratio_awq": None}))
    source = tmp_path / "perplexity-h100-2026-01-01.json"
    source.write_text(json.dumps(result))
    assert ppl.main(["--merge", str(quant), "--from", str(source)]) == 0
    merged = json.loads(quant.read_text())
    assert merged["fp8_throughput_ratio"] == 1.4 and merged["ppl_ratio_fp8"] == 1.005
    assert merged["ppl_ratio_awq"] is None and merged["perplexity"]["source"] == source.name
    assert merged["perplexity"]["greedy_agreement"] == {"fp8": {"prefix": 0.9}}


@pytest.mark.slow
def test_the_quick_run_trains_scores_and_merges(tmp_path):
    """The CPU dry run end to end: a tokenizer and a tiny Llama trained on stdlib sources, its AWQ checkpoint, the
    four engines' perplexities and greedy agreement, the engine's bf16 perplexity equal to transformers' own."""
    quant = tmp_path / "quantization-cpu.json"
    quant.write_text(json.dumps({"awq_throughput_ratio": 0.8, "ppl_ratio_awq": None}))
    argv = ["--quick", "--train-seconds", "2", "--out", str(tmp_path), "--merge", str(quant)]
    assert ppl.main(argv) == 0
    (path,) = tmp_path.glob("perplexity-cpu-*.json")
    result = json.loads(path.read_text())
    print({k: v for k, v in result.items() if k.startswith("ppl_")})
    assert result["training"]["steps"] > 1 and result["training"]["tokens_seen"] > 0
    assert 1 < result["ppl_bf16"] < result["model"]["vocab_size"] * 2  # a perplexity, on held-out text
    assert abs(result["ppl_engine_over_transformers"] - 1) < 1e-3  # the engine scores as transformers does
    for name in ("fp8", "fp8_kv", "awq"):
        assert 0.8 < result[f"ppl_ratio_{name}"] < 1.25  # a barely trained model: the real targets need the GPU run
        assert set(result["greedy_agreement"][name]) == {"prefix", "full"}
    assert result["engines"]["awq"]["weights_by_dtype"].keys() == {"int32", "float32"}
    assert result["engines"]["fp8_kv"]["kv_dtype"] == "float8_e4m3fn"
    assert {"data", "train", "checkpoints", "transformers", "engine_bf16", "engine_awq"} <= set(result["seconds"])
    merged = json.loads(quant.read_text())
    assert merged["awq_throughput_ratio"] == 0.8 and merged["ppl_ratio_awq"] == result["ppl_ratio_awq"]
