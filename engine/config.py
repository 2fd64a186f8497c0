"""Every engine flag, defined once: its default, its validation and its CLI spelling.

The offline API (`LLM(**kwargs)`), the server's argument parser and the TOML config file all read
this one dataclass, so a flag can never mean two things in two places.  Server-only flags (host,
port, api key) live with the server; everything that changes what the engine computes or how much
memory it takes lives here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

BLOCK_SIZES = (8, 16, 32)
DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings (the seed's `--dtype half`)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's spelling; fp8 means float8_e4m3fn
QUANTIZATIONS = ("fp8", "awq")
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
    dtype: str = field(
        default="auto",
        metadata=_flag(
            "Weight and activation dtype; auto follows the checkpoint (float16 for AWQ); half = float16, "
            "float = float32.",
            choices=DTYPES + tuple(DTYPE_ALIASES),
        ),
    )
    device: str = field(default="auto", metadata=_flag("cpu, cuda, cuda:N, or auto (cuda when available)."))
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = field(
        default="auto",
        metadata=_flag(
            "KV cache storage: auto (the model's dtype) or fp8 / fp8_e4m3 (float8_e4m3fn with one power-of-two "
            "scale per layer, K/V and KV head, calibrated at start-up: half the bytes per token)."
        ),
    )
    quantization: Literal["fp8", "awq"] | None = field(
        default=None,
        metadata=_flag(
            "Weight quantization: fp8 (FP8 weights with per-channel scales, quantized at load from a 16-bit "
            "checkpoint, or an FP8 checkpoint) or awq (an AutoAWQ GEMM int4 checkpoint). Default: what the "
            "checkpoint's quantization_config says, else none."
        ),
    )
    seed: int = field(default=0, metadata=_flag("Seed for requests that do not bring their own."))
    max_model_len: int | None = field(
        default=None,
        metadata=_flag("Longest prompt + output in tokens (default: the checkpoint's max_position_embeddings)."),
    )
    block_size: int = field(default=16, metadata=_flag("Tokens per KV block.", choices=BLOCK_SIZES))
    gpu_memory_utilization: float = field(
        default=0.9, metadata=_flag("Fraction of GPU memory the engine may use in total (0, 1].")
    )
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata=_flag(
            "Exact KV cache size in bytes (per tensor-parallel rank); overrides the profiled budget "
            "(and the CPU default)."
        ),
    )
    cpu_kv_cache_fraction: float = field(
        default=0.1,
        metadata=_flag("On CPU without --kv-cache-memory-bytes: fraction of available RAM for the KV cache."),
    )
    swap_space: float = field(default=4.0, metadata=_flag("GiB of pinned CPU memory for swapped-out KV blocks."))
    preemption_mode: Literal["swap", "recompute"] | None = field(
        default=None,
        metadata=_flag(
            "How to preempt when KV blocks run out (default: swap when --swap-space > 0 on CUDA, else recompute).",
            choices=("swap", "recompute"),
        ),
    )
    max_num_seqs: int = field(default=256, metadata=_flag("Most sequences in one step (the batch size cap)."))
    max_num_batched_tokens: int | None = field(
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
    load_format: str = field(
        default="auto",
        metadata=_flag(
            "auto reads the checkpoint's safetensors; dummy fills random weights (benchmarks, no download).",
            choices=("auto", "dummy"),
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
    max_num_on_the_fly_batches: int | None = field(
        default=None,
        metadata=_flag(
            "Steps queued on the device at once: 1 is synchronous; 2 schedules and queues step k+1 "
            "before step k's tokens are read (async scheduling), then accepts and detokenizes step k "
            "while the device computes k+1. Deeper is treated as 2. Default: 2 on a GPU; 1 on the CPU, "
            "where the host computes each step itself, so a queued step only delays every token by one step."
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=_flag(
            "Ranks to shard the model over (one process and one GPU each, cuda:0..N-1 of "
            "CUDA_VISIBLE_DEVICES; on CPU, N processes over gloo)."
        ),
    )
    tensor_parallel_overlap_tokens: int = field(
        default=0,
        metadata=_flag(
            "With --tensor-parallel-size > 1: steps of at least this many tokens run as two micro-batches, each "
            "one's all-reduces overlapping the other's matrix products (Llama family; never inside a CUDA graph, "
            "so on a GPU only steps above 1,024 tokens split). 0: off."
        ),
    )
    fragmentation_buffer_factor: float = field(
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
    standby_after: int | None = field(
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
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        self.validate()

    def validate(self) -> None:
        """Reject settings that can never work, naming the flag; called on construction."""
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(f"--block-size must be one of {BLOCK_SIZES}, got {self.block_size}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
                + (
                    " (fp8_e5m2 is not supported: e4m3 keeps one more mantissa bit)"
                    if "e5m2" in str(self.kv_cache_dtype)
                    else ""
                )
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r} "
                "(GPTQ, bitsandbytes and other methods are not supported)"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0.0 < self.cpu_kv_cache_fraction < 1.0:
            raise ConfigError(f"--cpu-kv-cache-fraction must be in (0, 1), got {self.cpu_kv_cache_fraction}")
        _positive("--max-num-seqs", self.max_num_seqs)
        if self.max_num_on_the_fly_batches is not None:
            _positive("--max-num-on-the-fly-batches", self.max_num_on_the_fly_batches)
        _positive("--tensor-parallel-size", self.tensor_parallel_size)
        if self.tensor_parallel_overlap_tokens < 0 or self.tensor_parallel_overlap_tokens == 1:
            raise ConfigError(
                f"--tensor-parallel-overlap-tokens must be 0 (off) or >= 2, got {self.tensor_parallel_overlap_tokens}"
            )
        if self.tensor_parallel_overlap_tokens and self.tensor_parallel_size == 1:
            raise ConfigError(
                "--tensor-parallel-overlap-tokens overlaps the all-reduces of tensor-parallel ranks: it needs "
                "--tensor-parallel-size 2 or more; leave it out with one rank"
            )
        if self.max_model_len is not None:
            _positive("--max-model-len", self.max_model_len)
        if self.max_num_batched_tokens is not None:
            _positive("--max-num-batched-tokens", self.max_num_batched_tokens)
        if self.kv_cache_memory_bytes is not None:
            _positive("--kv-cache-memory-bytes", self.kv_cache_memory_bytes)
        if self.swap_space < 0:
            raise ConfigError(f"--swap-space must be >= 0 GiB, got {self.swap_space}")
        if self.fragmentation_buffer_factor < 0:
            raise ConfigError(f"--fragmentation-buffer-factor must be >= 0, got {self.fragmentation_buffer_factor}")
        if self.standby_after is not None:
            _positive("--standby-after", self.standby_after)
        elif self.standby_spare:
            raise ConfigError("--standby-spare describes a standby: it needs --standby-after PID")
        if self.preemption_mode not in (None, "swap", "recompute"):
            raise ConfigError(f"--preemption-mode must be swap or recompute, got {self.preemption_mode!r}")

    def resolve(self, model_max_len: int, sliding_window: int | None = None) -> ResolvedConfig:
        """These settings with the checkpoint's limits filled in, once, as a frozen value (ConfigError when a
        limit cannot work with the checkpoint): max_model_len (default: the model's, capped at its sliding window,
        whose attention is not implemented), max_num_batched_tokens and max_num_seqs."""
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
        # Every scheduled sequence takes at least one token of the step's budget.
        return ResolvedConfig(self, max_model_len, batched, min(self.max_num_seqs, batched))

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
        """The KV cache is stored in float8_e4m3fn (--kv-cache-dtype fp8 or fp8_e4m3)."""
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    def resolved_preemption_mode(self, device: str) -> str:
        if self.preemption_mode is not None:
            return self.preemption_mode
        return "swap" if self.swap_space > 0 and device.startswith("cuda") else "recompute"

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
    def add_cli_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        """Add one `--flag-name` per field, vLLM-style (booleans also accept --no-flag-name)."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            meta = dict(f.metadata)
            kwargs: dict[str, Any] = {"help": meta.get("help"), "default": f.default, "dest": f.name}
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
            if f.type in ("bool", bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = _cli_type(f)
            parser.add_argument(flag, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{name: getattr(args, name) for name in cls.field_names() if hasattr(args, name)})


def _positive(flag: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{flag} must be >= 1, got {value}")


def _cli_type(f: dataclasses.Field) -> Any:
    text = str(f.type)
    if "float" in text:
        return float
    if "int" in text:
        return int
    return str


@dataclass(frozen=True)
class ResolvedConfig:
    """An engine's settings once its checkpoint is known (`EngineConfig.resolve`): every limit filled in, fixed
    for the engine's life.  It is built once, after the checkpoint's config is read, and everything from there on
    takes it: no component derives a limit again or checks that one is set.  Every other setting reads through to
    the EngineConfig it was resolved from (`settings`), which is left as it was given."""

    settings: EngineConfig
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int

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
