"""One timed generate of the throughput benchmark's workload, for A/B runs between two checkouts.

    PYTHONPATH=<checkout> python <this file> --label after

Imports the engine from whatever PYTHONPATH names first, so the same file times an older commit (git
archive it into a directory) against the working tree, each in a fresh process, alternating.  Run it
from outside benchmarks/ (copy it to /tmp): run as a script, its own directory comes first on sys.path,
and benchmarks/kernels.py would shadow the kernels package.  The timed loop is this file's own, so
that only the engine differs between the two sides.  Prints one JSON line: label, tok/s, seconds.
Llama-3-8B shape, bf16, random weights, 256 prompts x 512 in x 256 out, greedy, no EOS, CUDA graphs on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", required=True)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    args = p.parse_args(argv)
    from benchmarks.memory import LLAMA3_8B, model_dir
    from engine import LLM, SamplingParams

    engine_args = dict(
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=256,
        max_model_len=-(-(args.input_len + args.output_len) // 256) * 256,
        max_num_on_the_fly_batches=2,
        swap_space=0,
        load_format="dummy",
    )
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, LLAMA3_8B["vocab_size"], (args.num_prompts, args.input_len), generator=g).tolist()
    # Its own timed loop, the same for every tree (the engine is what differs between A and B, never the
    # harness): one shared SamplingParams, a warm-up of 32 prompts, one timed generate.
    t = time.perf_counter()
    llm = LLM(model_dir(quick=False), **engine_args)
    cold = time.perf_counter() - t
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:32]], params, use_tqdm=False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
    line = {
        "label": args.label,
        "gpu": torch.cuda.get_device_name(),
        "tok_s": round(args.num_prompts * args.output_len / elapsed, 1),
        "generate_s": round(elapsed, 3),
        "cold_start_s": round(cold, 1),
    }
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
