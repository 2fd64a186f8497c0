"""One timed generate of the throughput benchmark's workload, for A/B runs between two checkouts.

    PYTHONPATH=<checkout> python <this file> --label after

Imports the engine and benchmarks.throughput from whatever PYTHONPATH names first, so the same
file times an older commit (git archive it into a directory) against the working tree, each in a
fresh process, alternating.  Prints one JSON line: label, tok/s, seconds.  Llama-3-8B shape, bf16,
random weights, 256 prompts x 512 in x 256 out, greedy, no EOS, CUDA graphs on.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", required=True)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    args = p.parse_args(argv)
    from benchmarks.memory import LLAMA3_8B, model_dir
    from benchmarks.throughput import prompts_for, run_pagekeeper

    engine_args = dict(
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=256,
        max_model_len=-(-(args.input_len + args.output_len) // 256) * 256,
        max_num_on_the_fly_batches=2,
        swap_space=0,
        load_format="dummy",
    )
    prompts = prompts_for(args.num_prompts, args.input_len, LLAMA3_8B["vocab_size"], seed=0)
    if "work" in inspect.signature(run_pagekeeper).parameters:  # this tree's: (prompt, output length) pairs
        work = [(p, args.output_len) for p in prompts]
        _, cold, elapsed, _ = run_pagekeeper(model_dir(quick=False), engine_args, work)
    else:  # an older checkout's
        _, cold, elapsed = run_pagekeeper(model_dir(quick=False), engine_args, prompts, args.output_len)
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
