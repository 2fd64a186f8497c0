"""`python -m engine.generate PROMPT...`: complete prompts from the command line.

A thin CLI over the offline API, for trying a checkpoint or the embedded model without writing
code.  Configuration mistakes print one line and exit 2, as everywhere in pagekeeper.
"""

from __future__ import annotations

import argparse
import sys

from engine.config import ConfigError, EngineConfig
from engine.logs import LEVELS, configure_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.generate", description=__doc__)
    parser.add_argument("prompts", nargs="+", help="prompt texts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--log-level",
        choices=LEVELS,
        help="info (the default, or PAGEKEEPER_LOG_LEVEL): one line at start-up; debug: every start-up detail",
    )
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(argv)

    from engine.llm import LLM, offline_log_level
    from engine.sampling_params import SamplingParams, SamplingParamsError

    try:
        configure_logging(args.log_level or offline_log_level())
        config = EngineConfig.from_cli_args(args)
        llm = LLM(**{k: v for k, v in vars(config).items()})
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    except (ConfigError, SamplingParamsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for o in outputs:
        prompt = o.prompt or ""  # every prompt here is text
        print(f"{prompt}\033[1m{o.outputs[0].text}\033[0m" if sys.stdout.isatty() else prompt + o.outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
