"""Every engine flag, defined once: its default, its type and range, and its CLI spelling.

The offline API (`LLM(**kwargs)`), the server's argument parser and the TOML config file all read
this one dataclass, so a flag can never mean two things in two places.  Server-only flags (host,
port, api key) live with the server; everything that changes what the engine computes or how much
memory it takes lives here.  Its checks are the one strict schema of engine/schema.py, built from
these annotations (`annotated_types` ranges, `Literal` choices) and `check_combinations`: every way
in (constructor, flags, config file) runs that schema and nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

# Ranges the schema (engine/schema.py) reads; annotated_types, not pydantic, so that importing the settings stays
# light in processes that only unpickle them (a core, a tensor-parallel rank).
from annotated_types import Ge, Interval

DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings (the seed's `--dtype half`)
KV_CACHE_FP8 = "float8_e4m3fn"  # what --kv-cache-dtype fp8 / fp8_e4m3 store (vLLM's spelling; e4m3)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MODEL_NAME = "pagekeeper-default"  # the embedded model's served name, also accepted as --model
# Engine flags the supervisor sets for one start; no config-file key (engine/server/config_file.py refuses them there).
INTERNAL_FIELDS = ("weights_keeper", "standby_after", "standby_spare")


class ConfigError(ValueError):
    """A setting the user can fix; the message names the flag and what to change it to."""


def _flag(help_text: str, **extra: Any) -> dict[str, Any]:
    return {"help": help_text, **extra}


@dataclass
class EngineConfig:
    """The engine's settings.  Field names are the flag names with dashes turned into underscores."""

    model: str | None = field(
        default=None,
        metadata=_flag(
            "A local HF checkpoint directory, or a Hugging Face Hub id (org/name: the snapshot in the HF cache, "
            "downloaded first when the Hub is reachable); empty means the embedded default model."
        ),
    )
    tokenizer: str | None = field(default=None, metadata=_flag("Tokenizer directory if it differs from --model."))
    served_model_name: str | None = field(
        default=None,
        metadata=_flag("Model name reported by the API and in metric labels (default: the model directory's name)."),
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16", "half", "float"] = field(
        default="auto",
        metadata=_flag(
            "Weight and activation dtype; auto follows the checkpoint (float16 for AWQ); half = float16, "
            "float = float32."
        ),
    )
    device: str = field(default="auto", metadata=_flag("cpu, cuda, cuda:N, or auto (cuda when available)."))
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = field(
        default="auto",
        metadata=_flag(
            "KV cache storage: auto (the model's dtype) or fp8 / fp8_e4m3 (float8_e4m3fn with one power-of-two "
            "scale per layer, K/V and KV head, calibrated at start-up: half the bytes per token).",
            hint="fp8_e5m2 is not supported: e4m3 keeps one more mantissa bit",
        ),
    )
    quantization: Literal["fp8", "awq"] | None = field(
        default=None,
        metadata=_flag(
            "Weight quantization: fp8 (FP8 weights with per-channel scales, quantized at load from a 16-bit "
            "checkpoint, or an FP8 checkpoint) or awq (an AutoAWQ GEMM int4 checkpoint). Default: what the "
            "checkpoint's quantization_config says, else none.",
            hint="GPTQ, bitsandbytes and other methods are not supported",
        ),
    )
    seed: int = field(default=0, metadata=_flag("Seed for requests that do not bring their own."))
    max_model_len: Annotated[int, Ge(1)] | None = field(
        default=None,
        metadata=_flag("Longest prompt + output in tokens (default: the checkpoint's max_position_embeddings)."),
    )
    block_size: Literal[8, 16, 32] = field(default=16, metadata=_flag("Tokens per KV block."))
    gpu_memory_utilization: Annotated[float, Interval(gt=0, le=1)] = field(
        default=0.9, metadata=_flag("Fraction of GPU memory the engine may use in total (0, 1].")
    )
    kv_cache_memory_bytes: Annotated[int, Ge(1)] | None = field(
        default=None,
        metadata=_flag(
            "Exact KV cache size in bytes (per tensor-parallel rank); overrides the profiled budget "
            "(and the CPU default)."
        ),
    )
    cpu_kv_cache_fraction: Annotated[float, Interval(gt=0, lt=1)] = field(
        default=0.1,
        metadata=_flag("On CPU without --kv-cache-memory-bytes: fraction of available RAM for the KV cache."),
    )
    swap_space: Annotated[float, Ge(0)] = field(
        default=4.0, metadata=_flag("GiB of pinned CPU memory for swapped-out KV blocks.")
    )
    preemption_mode: Literal["swap", "recompute"] | None = field(
        default=None,
        metadata=_flag(
            "How to preempt when KV blocks run out (default: swap when --swap-space > 0 on CUDA, else recompute)."
        ),
    )
    max_num_seqs: Annotated[int, Ge(1)] = field(
        default=256, metadata=_flag("Most sequences in one step (the batch size cap).")
    )
    max_num_batched_tokens: Annotated[int, Ge(1)] | None = field(
        default=None,
        metadata=_flag(
            f"Most tokens in one step (default {DEFAULT_MAX_NUM_BATCHED_TOKENS} with chunked prefill, "
            "else max(max_model_len, that))."
        ),
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=_flag("Split long prompts into chunks that share steps with decodes.")
    )
    enable_prefix_caching: bool = field(default=False, metadata=_flag("Reuse KV blocks of identical prompt prefixes."))
    enforce_eager: bool = field(default=False, metadata=_flag("Never capture CUDA graphs."))
    load_format: Literal["auto", "dummy"] = field(
        default="auto",
        metadata=_flag(
            "auto reads the checkpoint's safetensors; dummy fills random weights (benchmarks, no download)."
        ),
    )
    trust_remote_code: bool = field(
        default=False, metadata=_flag("Passed to transformers when reading the config and tokenizer.")
    )
    generation_config: str = field(
        default="auto",
        metadata=_flag(
            "auto: the checkpoint's generation_config.json gives requests that do not set them their default "
            "temperature, top_p, top_k, min_p, repetition_penalty and max_tokens (as vLLM); vllm: ignore it; "
            "or a directory holding the generation_config.json to use."
        ),
    )
    max_num_on_the_fly_batches: Annotated[int, Ge(1)] | None = field(
        default=None,
        metadata=_flag(
            "Steps queued on the device at once: 1 is synchronous; 2 schedules and queues step k+1 "
            "before step k's tokens are read (async scheduling), then accepts and detokenizes step k "
            "while the device computes k+1. Deeper is treated as 2. Default: 2 on a GPU; 1 on the CPU, "
            "where the host computes each step itself, so a queued step only delays every token by one step."
        ),
    )
    tensor_parallel_size: Annotated[int, Ge(1)] = field(
        default=1,
        metadata=_flag(
            "Ranks to shard the model over (one process and one GPU each, cuda:0..N-1 of "
            "CUDA_VISIBLE_DEVICES; on CPU, N processes over gloo)."
        ),
    )
    tensor_parallel_overlap_tokens: Annotated[int, Ge(0)] = field(
        default=0,
        metadata=_flag(
            "With --tensor-parallel-size > 1: steps of at least this many tokens run as two micro-batches, each "
            "one's all-reduces overlapping the other's matrix products (Llama family; never inside a CUDA graph, "
            "so on a GPU only steps above 1,024 tokens split). 0: off."
        ),
    )
    fragmentation_buffer_factor: Annotated[float, Ge(0)] = field(
        default=2.0,
        metadata=_flag("KV budget keeps max(150 MiB, factor x profiled allocator fragmentation) in reserve."),
    )
    # Set by the supervisor, not in the config file (INTERNAL_FIELDS): they describe one start, not the deployment.
    weights_keeper: str | None = field(
        default=None,
        metadata=_flag(
            "Take the weights from the keeper serving this unix socket (engine/keeper/); if it cannot give them, "
            "load the checkpoint as usual."
        ),
    )
    standby_after: Annotated[int, Ge(1)] | None = field(
        default=None,
        metadata=_flag(
            "Get ready (imports, weights from the keeper) but take no more device memory until process PID "
            "(the engine this one replaces) has exited."
        ),
    )
    standby_spare: bool = field(
        default=False,
        metadata=_flag("With --standby-after: a spare kept ready for whenever PID exits, so wait without a limit."),
    )

    def __post_init__(self) -> None:
        from engine.schema import check_settings  # pydantic, imported by the processes that build settings only

        check_settings(self)
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)  # type: ignore[assignment]

    @staticmethod
    def check_combinations(config: Any) -> None:
        """What one field's type and range cannot say, in flag terms (a config file's error is told in its keys by
        engine/server/config_file.py): engine/schema.py runs it after every field has passed."""
        if config.tensor_parallel_overlap_tokens == 1:
            raise ConfigError("--tensor-parallel-overlap-tokens must be 0 (off) or >= 2, got 1")
        if config.tensor_parallel_overlap_tokens and config.tensor_parallel_size == 1:
            raise ConfigError(
                "--tensor-parallel-overlap-tokens overlaps the all-reduces of tensor-parallel ranks: it needs "
                "--tensor-parallel-size 2 or more; leave it out with one rank"
            )
        if config.standby_spare and config.standby_after is None:
            raise ConfigError("--standby-spare describes a standby: it needs --standby-after PID")

    def resolve(
        self,
        model_max_len: int,
        sliding_window: int | None = None,
        *,
        model_dtype: str = "float32",
        device: str | None = None,
    ) -> ResolvedConfig:
        """These settings with the checkpoint's limits and the values derived from them filled in, once, as a frozen
        value (ConfigError when a limit cannot work with the checkpoint): max_model_len (default: the model's, capped
        at its sliding window, whose attention is not implemented), max_num_batched_tokens and max_num_seqs; the KV
        cache's storage dtype (`model_dtype`, the weights' as loaded, unless --kv-cache-dtype fp8), the preemption
        mode and the swap space in bytes for `device` (default: the one these settings pick)."""
        limit = model_max_len
        if sliding_window is not None and sliding_window < limit:
            # Attention over a window shorter than the context is not implemented: cap the context
            # at the window so that full attention is exact.
            limit = sliding_window
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len > limit:
            why = "its sliding window" if limit == sliding_window else "max_position_embeddings"
            raise ConfigError(
                f"--max-model-len {max_model_len} exceeds the model's limit of {limit} tokens "
                f"({why}); use --max-model-len {limit} or less"
            )
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = (
                DEFAULT_MAX_NUM_BATCHED_TOKENS
                if self.enable_chunked_prefill
                else max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
            )
        if not self.enable_chunked_prefill and batched < max_model_len:
            raise ConfigError(
                f"--max-num-batched-tokens ({batched}) is smaller than --max-model-len "
                f"({max_model_len}) with chunked prefill off, so a long prompt could never be scheduled; "
                "raise --max-num-batched-tokens, lower --max-model-len, or --enable-chunked-prefill"
            )
        device = device or self.resolved_device()
        preemption = self.preemption_mode or (
            "swap" if self.swap_space > 0 and device.startswith("cuda") else "recompute"
        )
        return ResolvedConfig(
            self,
            max_model_len,
            batched,
            min(self.max_num_seqs, batched),  # every scheduled sequence takes at least one token of the step's budget
            kv_dtype=KV_CACHE_FP8 if self.kv_cache_fp8 else model_dtype,
            preemption_mode=preemption,
            swap_space_bytes=int(self.swap_space * 2**30) if preemption == "swap" else 0,
        )

    def pipeline_depth(self, device_type: str) -> int:
        """Steps in flight: --max-num-on-the-fly-batches capped at 2, or by device when left out: on a CPU the overlap
        buys no throughput and delays the first token (docs/decisions/pipeline-depth.md)."""
        if self.max_num_on_the_fly_batches is None:
            return 2 if device_type == "cuda" else 1
        return min(self.max_num_on_the_fly_batches, 2)

    def resolved_device(self) -> str:
        """'cuda' when asked for or when auto finds a GPU, else 'cpu'."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def kv_cache_fp8(self) -> bool:
        """--kv-cache-dtype asks for FP8 (fp8 or fp8_e4m3), before any checkpoint is known (what hardware it needs,
        `opsctl doctor`); once it is, the cache's dtype is `ResolvedConfig.kv_dtype`."""
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    def model_path(self) -> str:
        """The checkpoint directory, the embedded default when none was given (or its served name)."""
        if self.model and self.model != DEFAULT_MODEL_NAME:
            from engine.hub import hub_snapshot, is_hub_id

            return hub_snapshot(self.model) if is_hub_id(self.model) else os.path.expanduser(self.model)
        from engine.default_model import DEFAULT_MODEL_DIR

        return str(DEFAULT_MODEL_DIR)

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if not self.model or self.model == DEFAULT_MODEL_NAME:
            return DEFAULT_MODEL_NAME
        from engine.hub import is_hub_id

        if is_hub_id(self.model):
            return self.model  # the Hub id, as vLLM serves it
        return os.path.basename(os.path.normpath(self.model_path()))

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, naming any unknown one instead of a TypeError deep inside."""
        unknown = sorted(set(kwargs) - cls.field_names())
        if unknown:
            raise ConfigError(
                f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(cls.field_names()))}"
            )
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup, defaults: bool = True) -> None:
        """One `--flag-name` per field, vLLM-style (booleans also accept --no-flag-name)."""
        add_flags(cls, parser, defaults)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{name: getattr(args, name) for name in cls.field_names() if hasattr(args, name)})


def add_flags(
    cls: type, parser: argparse.ArgumentParser | argparse._ArgumentGroup, defaults: bool = True, bools: Any = None
) -> None:
    """A settings dataclass's fields as flags (`--flag-name`, help from the field's metadata), typed from its
    annotations.  Nothing is refused here: a value outside a field's choices or range reaches the schema, whose one
    line names the flag (argparse's own refusal is a usage block).  `defaults=False` leaves a flag not given out of
    the namespace, so that a caller can tell it from a config file's value.  `bools`: the action of a boolean
    field (default: `--x` / `--no-x`)."""
    hints = get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        kwargs: dict[str, Any] = {
            "help": meta.get("help"),
            "default": f.default if defaults else argparse.SUPPRESS,
            "dest": f.name,
        }
        kind, choices = _plain_type(hints[f.name])
        if kind is bool:
            kwargs["action"] = bools or argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            if choices:
                kwargs["metavar"] = "{" + ",".join(str(c) for c in choices) + "}"
        if "metavar" in meta:
            kwargs["metavar"] = meta["metavar"]
        parser.add_argument(flag, **kwargs)


def _plain_type(hint: Any) -> tuple[type, tuple[Any, ...]]:
    """The Python type a flag's text converts to, and the choices of a Literal (int | None -> int)."""
    while get_origin(hint) is Annotated:
        hint = get_args(hint)[0]
    args = [a for a in get_args(hint) if a is not type(None)]
    if get_origin(hint) is Literal:
        return type(args[0]), tuple(args)
    if args:  # X | None
        return _plain_type(args[0])
    return (hint if hint in (bool, int, float) else str), ()


@dataclass(frozen=True)
class ResolvedConfig:
    """An engine's settings once its checkpoint is known (`EngineConfig.resolve`): every limit filled in, fixed
    for the engine's life.  It is built once, after the checkpoint's config is read, and everything from there on
    takes it: no component derives a limit or a value of its own again (the KV cache's dtype, the preemption mode,
    the swap space's bytes) or checks that one is set.  Every other setting reads through to the EngineConfig it was
    resolved from (`settings`), which is left as it was given."""

    settings: EngineConfig
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_dtype: str  # the KV cache's storage dtype, a torch dtype's name: float8_e4m3fn or the model's
    preemption_mode: Literal["swap", "recompute"]  # --preemption-mode, or the device's default
    swap_space_bytes: int  # pinned host memory for swapped-out blocks (0: preempted sequences are recomputed)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "settings":  # not yet set while unpickling
            raise AttributeError(name)
        return getattr(self.settings, name)

    def engine_config(self) -> EngineConfig:
        """The settings with the resolved limits written in (for a process that resolves them again)."""
        return dataclasses.replace(
            self.settings,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
        )
