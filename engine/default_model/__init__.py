"""The embedded default checkpoint: a tiny Llama that has memorised the Zen of Python.

It lets `LLM()` and `opsctl start` work on a fresh machine with no downloads, and its greedy output
is a regression check for the whole path (tokenizer, loader, paged attention, sampler, detokenizer).
`make_default_model.py` beside this file regenerates it deterministically.
"""

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent
