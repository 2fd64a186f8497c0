"""Bringing the runner up: load the weights, profile a worst-case step, size the KV cache, capture graphs.

This is the runner's business because every figure in it is about the device: the step that is
profiled is built as a plain plan and run on a throwaway runner, so the engine core only receives
the finished runner and the block counts the scheduler needs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator

import structlog
import torch
from torch import nn

from engine.config import ConfigError, ResolvedConfig
from engine.core.plan import NewSeq, SamplingSpec, SeqStep, StepPlan
from engine.keeper.client import kept_model
from engine.lifecycle import STANDBY_LIMIT_S, standby_until_exit
from engine.logs import startup_detail
from engine.memory.budget import (
    KVPlan,
    Profile,
    device_baseline,
    plan_kv_cache,
    profile_graph_memory,
    profile_step,
    set_allocator_defaults,
)
from engine.model.cpu_packing import pack_linears, panel_bytes, product_kind
from engine.model.interface import CausalLM
from engine.model.layers.attention import PagedAttention
from engine.model.loader import ModelInfo, load_model
from engine.parallel.group import SINGLE, TPGroup
from engine.runner import kernel_loads
from engine.runner.cuda_graphs import capture_sizes
from engine.runner.deferred import one_unit
from engine.runner.kernel_loads import watch_kernel_loads
from engine.runner.kv_scales import calibrate_kv_scales, kv_cache_dtype
from engine.runner.model_runner import ModelRunner, kv_bytes_per_block, kv_cache_shape
from engine.runner.probe_cache import ProbeCache
from engine.runner.release import released_while_standing_by
from engine.runner.sampler import sample_on_device
from engine.runner.swap_space import SwapSpace

log = structlog.get_logger("pagekeeper.engine")


@dataclass
class StartedRunner:
    runner: ModelRunner
    model: CausalLM
    kv_plan: KVPlan
    preemption_mode: str  # "swap" or "recompute", resolved for the device
    num_cpu_blocks: int  # swap space in blocks (0: preempted sequences are recomputed)
    graph_capture_seconds: float  # captured before serving (0 when deferred: see runner.deferred)
    phases: dict[str, float] = field(default_factory=dict)  # seconds per start-up phase, in order
    weights_source: str = "checkpoint"  # "keeper" (engine/keeper/), "checkpoint" or "dummy"


class Phases:
    """Seconds spent in each start-up phase (logged with engine_ready and kept for benchmarks)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._mark = time.monotonic()

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._mark, 3)
        self._mark = now


def start_runner(
    config: ResolvedConfig,
    model_info: ModelInfo,
    device: torch.device,
    tp: TPGroup = SINGLE,
    agree: Callable[[KVPlan], int] | None = None,
    defer: bool = False,
) -> StartedRunner:
    """Load the model (this rank's shard) and build a runner whose KV cache fills the budget `config`
    allows.  With tensor parallelism every rank profiles its own budget and `agree` turns this
    rank's plan into the block count all ranks use (the smallest).

    The weights come from the keeper when one serves them (engine/keeper/), else from the checkpoint.  With
    `config.standby_after` nothing that takes device memory beyond them happens before that process (the engine
    this one replaces) has exited.  `defer`: leave graph capture and warm-ups to `runner.deferred`, to be run
    after serving starts (the server); otherwise they run here."""
    phases = Phases()
    cuda = device.type == "cuda"
    swap: SwapSpace | None = None
    if cuda:
        check_gpu_kernel_env()
        set_allocator_defaults()
        watch_kernel_loads()  # a variant compiled or loaded later names itself (engine/runner/kernel_loads.py)
        torch.cuda.init()
        phases.mark("cuda_init")
    else:
        prepare_cpu_kernels()
        phases.mark("cpu_kernels")
    kept = kept_model(config, model_info, config.max_model_len, device, tp)
    if config.weights_keeper and tp.is_parallel and not everywhere(tp, kept is not None, device):
        # One path for every rank: a rank that loads its own weights waits for the old engine first, and the others
        # must not meanwhile wait for it in a warm-up's collective (a TP=4 spare once hung so, blocking a restart).
        if kept is not None:
            log.warning(
                "engine_weights_from",
                source="checkpoint",
                rank=tp.rank,
                reason="another rank cannot use the kept weights: every rank loads its own",
            )
        kept = None
    if config.standby_after is not None and kept is None:
        standby_until_exit(config.standby_after)  # loading needs the memory the old engine holds
        phases.mark("standby")
    if kept is not None:
        model, source, shared_bytes = kept.model, "keeper", kept.device_bytes
        phases.mark("weights")
        if config.standby_after is not None:
            swap = start_swap_space(config, model_info, model, device)  # host memory: pinned while the old one serves
            if cuda:
                warm_kernels(config, model_info, model, device)  # while the old engine still serves
                phases.mark("kernels")
            waits: dict[str, float] = {}
            with released_while_standing_by(device):
                standby_until_exit(config.standby_after, None if config.standby_spare else STANDBY_LIMIT_S, waits)
            phases.mark("standby")
            # what ended the standby: the old engine's release or its exit, and how long its other processes took
            log.info("standby_ended", predecessor=config.standby_after, **waits)
        baseline = device_baseline(device, shared_bytes) if cuda else None
    else:
        baseline = device_baseline(device) if cuda else None
        model = load_model(model_info, config.max_model_len, device, config.load_format, tp)
        source, shared_bytes = "dummy" if config.load_format == "dummy" else "checkpoint", 0
        phases.mark("weights")
    if cuda and "kernels" not in phases.seconds:
        warm_kernels(config, model_info, model, device)
        phases.mark("kernels")
    kv_dtype = kv_cache_dtype(config)
    if kv_dtype != model_info.dtype:
        calibrate_kv_scales(config, model, int(model_info.hf_config.vocab_size), model_info.dtype, device)
        phases.mark("kv_scales")
    per_block = kv_bytes_per_block(model, config.block_size, kv_dtype)
    # a keeper's shared weights, plus what this process derived from them at load (weight_tensors' buffers)
    derived = sum(b.numel() * b.element_size() for b in weight_tensors(model, parameters=False))
    owned = sum(p.numel() * p.element_size() for p in weight_tensors(model))
    weights = shared_bytes + derived if shared_bytes else owned
    by_dtype = weights_by_dtype(model)  # before the CPU packing below replaces weights by opaque ones
    if not cuda:
        # packed or widened products (engine/model/cpu_packing.py says why); a keeper's weights stay shared
        packed, product = pack_linears(model, weights_shared=source == "keeper"), product_kind(model_info.dtype)
        decode_copy = panel_bytes(model)  # the few-row products' second copy: memory this process holds too
        weights += decode_copy
        if packed:
            startup_detail(
                log,
                "cpu_linears_packed",
                layers=packed,
                dtype=str(model_info.dtype).removeprefix("torch."),
                product=product,
                decode_copy_mib=round(decode_copy / 2**20, 1),
            )
        elif source == "keeper" and product == "packed":
            startup_detail(log, "cpu_linears_plain", reason="the keeper's weights are shared: packing would copy them")
    profile = None
    probes = ProbeCache(
        config,
        _config_dict(model_info.hf_config),
        str(model_info.dtype).removeprefix("torch."),
        config.kv_dtype,
        device,
        tp.rank,
    )
    if cuda:
        profile = cached_profile(probes, tp, weights, config.enforce_eager)
        if profile is None:
            if swap is not None:
                swap.tensors()  # the profile captures a graph: no pinned allocation may run meanwhile
            step = partial(dummy_step, config, model_info, model, device)
            profile = profile_step(device, weights, step, kept_bytes=shared_bytes)
            if not config.enforce_eager:
                profile.graph_bytes = graph_pool_bytes(config, model_info, model, device)
            probes.put("profile", profile.cacheable())
        phases.mark("profile")
    kv_plan = plan_kv_cache(
        config,
        per_block,
        device,
        baseline,
        profile,
        kv_dtype=config.kv_dtype,
        weights_by_dtype=by_dtype,
    )
    kv_plan.weights_bytes = weights  # this rank's shard (also on CPU, where nothing is profiled)
    if agree is not None:
        kv_plan.agreed_blocks = agree(kv_plan)
    preemption_mode = config.preemption_mode
    num_cpu_blocks = swap_blocks(config, per_block)
    if preemption_mode == "swap" and num_cpu_blocks == 0:
        log.warning(
            "swap_space_too_small",
            swap_space_gib=config.swap_space,
            bytes_per_block=per_block,
            effect="preempted requests are recomputed",
        )
    if cuda:
        remember_dense_probe(probes, model, model_info.dtype, device)
    runner = ModelRunner(
        model,
        kv_plan.usable_blocks,
        config.block_size,
        model_info.dtype,
        device,
        config.seed,
        num_cpu_blocks,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        kv_dtype=kv_dtype,
        swap=swap,
    )
    phases.mark("kv_cache")
    capture_seconds = 0.0
    if cuda:
        plan_deferred_work(runner, config, tp, probes)
        if not defer:
            capture_seconds = runner.deferred.run_all()
            phases.mark("graphs_and_warmup")
        kernel_loads.serving.set()  # from here a kernel load holds a step (or a deferred unit)
    return StartedRunner(
        runner, model, kv_plan, preemption_mode, num_cpu_blocks, capture_seconds, phases.seconds, source
    )


def swap_blocks(config: ResolvedConfig, per_block: int) -> int:
    """The swap space in blocks (0: preempted sequences are recomputed)."""
    return config.swap_space_bytes // per_block


def start_swap_space(config: ResolvedConfig, model_info: ModelInfo, model: CausalLM, device: torch.device) -> SwapSpace:
    """Begin allocating the swap space now (engine/runner/swap_space.py: why as early as its size is known)."""
    kv_dtype = kv_cache_dtype(config)
    blocks = swap_blocks(config, kv_bytes_per_block(model, config.block_size, kv_dtype))
    layers = model.num_layers if blocks else 0
    return SwapSpace(kv_cache_shape(model, blocks, config.block_size, device), kv_dtype, layers, device.type == "cuda")


def remember_dense_probe(probes: ProbeCache, model: CausalLM, dtype: torch.dtype, device: torch.device) -> None:
    """Whether cuDNN can take this model's fresh chunks: an earlier start's answer, else probed now (the profiled
    step already did on a miss) and kept for the next start.  The probe's first cuDNN call loads the library,
    about 2 s that a restart's gap would otherwise pay; the plans themselves are made after serving starts."""
    from kernels.dense_prefill import cudnn_refusal, remember_cudnn_refusal

    attn = next((m for m in model.modules() if isinstance(m, PagedAttention)), None)
    if attn is None or dtype not in (torch.float16, torch.bfloat16):
        return
    shape = (dtype, attn.num_heads, attn.num_kv_heads, attn.head_dim, str(device))
    found = probes.get("cudnn_refusal")
    if isinstance(found, dict) and "why" in found:
        remember_cudnn_refusal(*shape, found["why"])
    else:
        probes.put("cudnn_refusal", {"why": cudnn_refusal(*shape)})


def _config_dict(hf_config: Any) -> dict[str, Any]:
    to_dict = getattr(hf_config, "to_dict", None)
    return dict(to_dict()) if to_dict is not None else dict(vars(hf_config))


def everywhere(tp: TPGroup, flag: bool, device: torch.device | None = None) -> bool:
    """`flag` on every rank (an all-reduce of the device's): ranks that skip different start-up collectives hang."""
    if not tp.is_parallel:
        return flag
    on = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([1.0 if flag else 0.0], device=on)  # NCCL reduces device tensors, gloo host ones
    return bool(tp.all_reduce(t).item() == tp.size)


def cached_profile(probes: ProbeCache, tp: TPGroup, weights: int, eager: bool) -> Profile | None:
    """The profiled step's figures from an earlier start with the same key (every rank must have them)."""
    found = probes.get("profile")
    profile = Profile.from_cached(found, weights) if isinstance(found, dict) else None
    if profile is not None and not eager and not profile.graph_bytes:
        profile = None  # measured with --enforce-eager: no graph pool figure
    return profile if everywhere(tp, profile is not None) else None


def plan_deferred_work(runner: ModelRunner, config: ResolvedConfig, tp: TPGroup, probes: ProbeCache) -> None:
    """Queue the GPU start-up work that serving does not need: the decode graphs, the LM head's row counts, the
    piecewise graphs (in the decode graphs' pool), the dense prefill plans, a cold start's swap space, and the
    mixed-step warm-up (only while no request holds KV blocks: it writes blocks)."""
    work = runner.deferred
    # A CUDA graph capture forbids, in any thread of the process, host allocations that may synchronize the device
    # (cudaHostAlloc among them): a standby start's swap space is pinned on a thread of its own, so capture waits
    # until that thread is done (here: the core's `ready` gate; a tensor-parallel worker, which runs the unit when
    # rank 0 says, waits in the unit itself).  A cold start's is pinned by the `swap_space` job on this thread.
    swap_ready = runner.swap_space_ready
    if not config.enforce_eager:  # first: each graph makes the decode steps of its size about 3x faster at once
        decode = _after_swap(runner, runner.decode_graph_steps(config.max_num_seqs))
        work.add("decode_graphs", decode, ready=swap_ready, speeds_up_steps=True)
    work.add("lm_head_rows", runner.warm_lm_head_steps())
    if not config.enforce_eager:
        found = probes.get("piece_buckets")
        buckets = [int(b) for b in found] if isinstance(found, list) and found else None
        if not everywhere(tp, buckets is not None):
            buckets = None

        def chosen() -> None:
            pieces = runner.pieces
            if pieces is None:
                return
            if buckets is None:
                probes.put("piece_buckets", pieces.buckets)
            startup_detail(
                log,
                "piece_buckets_chosen",
                buckets=pieces.buckets,
                cached=buckets is not None,
                layer_ms={n: round(t, 4) for n, t in (pieces.costs or {}).items()},
            )

        pieces = _after_swap(runner, runner.piece_graph_steps(config.max_num_batched_tokens, buckets, tp))
        work.add("piece_graphs", pieces, on_done=chosen, ready=swap_ready)
    work.add("dense_prefill_plans", runner.warm_dense_prefill_steps(config.max_num_batched_tokens))
    work.add("swap_space", runner.swap.allocation_steps())  # a cold start's: one layer per unit, on this thread
    work.add("mixed_steps", one_unit(lambda: _warm_mixed(runner, config)), needs_idle=True)


def _after_swap(runner: ModelRunner, units: Iterator[None]) -> Iterator[None]:
    started = time.monotonic()
    if runner.swap.background:
        runner.swap.tensors()  # blocks until the thread has pinned the swap space (never during a capture)
    waited = time.monotonic() - started
    if waited > 0.05:
        log.info("deferred_waited_for_swap_space", seconds=round(waited, 3))
    yield from units


def _warm_mixed(runner: ModelRunner, config: ResolvedConfig) -> None:
    started = time.monotonic()
    steps = warm_mixed_steps(runner, config)
    startup_detail(log, "mixed_steps_warmed", steps=steps, seconds=round(time.monotonic() - started, 3))


def warm_mixed_steps(runner: ModelRunner, config: ResolvedConfig) -> int:
    """Run the shapes of mixed steps (decodes batched with chunks that extend a cached context) once, now.

    Neither the profiled step (fresh prompts only) nor the decode graphs launch the attention kernels as a mixed
    step does, and the first launch of a kernel variant compiles it: on an H100 with an empty Triton cache the
    first mixed steps of a long-tailed run stalled 1.1 s (decode kernel, step 2) and 1.4 s (prefill kernel's
    small-grid tiles, step 15), and a few hundred ms with a warm one (benchmarks/step_phases.py records the
    variants met during a run).  Two steps cover them: few decodes (split contexts) with one short chunk (the
    small grid), and many decodes (no split) with chunks whose 128-row tiles fill the GPU; each runs through
    the path real steps take (piecewise graphs or eager).  The KV they write lands in blocks no request holds
    yet, and is overwritten before any request reads it.  Returns the number of steps run."""
    bs, budget, longest = config.block_size, config.max_num_batched_tokens, config.max_model_len
    # (decodes, their context, chunks, the chunks' context): a long decode context splits (few decodes), a batch
    # of decodes that fills the GPU does not; 3 x 300 rows of 128-row tiles fill it, one 40-row chunk does not
    many, chunk_context = min(config.max_num_seqs - 3, 96), min(4 * bs, longest // 4)
    chunk = min(300, longest - chunk_context, (budget - many) // 3)  # as long as the limits allow, up to 300
    shapes = [
        (2, min(1024, longest - 1), [min(40, budget // 4)], chunk_context),
        (many, chunk_context, [chunk] * 3, chunk_context),
    ]
    steps = 0
    greedy = SamplingSpec(temperature=0.0)
    for num_decodes, decode_context, chunks, chunk_context in shapes:
        chunks = [c for c in chunks if 0 < c and chunk_context + c <= longest]
        lengths = [(decode_context, 1)] * num_decodes + [(chunk_context, c) for c in chunks]
        need = sum(-(-(start + n) // bs) for start, n in lengths)
        if num_decodes < 1 or not chunks or num_decodes + sum(chunks) > budget or need > runner.num_blocks:
            continue
        plan = StepPlan(num_batched_tokens=num_decodes + sum(chunks))
        next_block = 0
        for i, (start, n) in enumerate(lengths):
            blocks = -(-(start + n) // bs)
            sid = f"warm-{steps}-{i}"
            plan.new_seqs.append(NewSeq(sid, greedy))
            table = list(range(next_block, next_block + blocks))
            ids = [(7 * j + i) % 97 for j in range(n)]
            plan.seqs.append(SeqStep(sid, start, n, ids, table_blocks=table, sample_ids=[sid]))
            next_block += blocks
        runner.execute(plan)
        runner.update_state(StepPlan(finished=[s.seq_id for s in plan.seqs]))
        steps += 1
    return steps


def check_gpu_kernel_env() -> None:
    """A misspelt PAGEKEEPER_PDL stops the start with one line rather than failing the first decode step."""
    from kernels import pdl

    try:
        pdl.mode()
    except ValueError as e:
        raise ConfigError(str(e)) from e


def prepare_cpu_kernels() -> None:
    """Build or load the CPU attention extension now, at start-up, rather than inside the first step: a build's
    seconds belong to start-up, and PAGEKEEPER_CPU_KERNELS=require (or a misspelt value) must stop the start with one
    line, not fail a request later."""
    from kernels import cpu_ext, cpu_linear

    try:
        cpu_ext.unavailable_reason()
        cpu_linear.mode()
    except (ValueError, cpu_ext.CpuKernelsUnavailable) as e:
        raise ConfigError(str(e)) from e


def named_weight_tensors(model: nn.Module, parameters: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the parameters, and of the buffers a layer derives from them at load to keep as its weight
    (AWQ's tensor-core layout, `awq_tc_*`, which replaces the checkpoint's qweight on the GPU:
    engine/model/quant/awq.py): what the weights hold on the device."""
    if parameters:
        yield from model.named_parameters()
    for name, b in model.named_buffers():
        if name.rsplit(".", 1)[-1].startswith("awq_tc_"):
            yield name, b


def weight_tensors(model: nn.Module, parameters: bool = True) -> Iterator[torch.Tensor]:
    """named_weight_tensors' tensors."""
    for _, t in named_weight_tensors(model, parameters):
        yield t


def weights_by_dtype(model: nn.Module) -> dict[str, int]:
    """This rank's weight bytes per storage dtype (int32 for AWQ's packed int4, float8_e4m3fn, ...)."""
    out: dict[str, int] = {}
    for p in weight_tensors(model):
        name = str(p.dtype).removeprefix("torch.")
        out[name] = out.get(name, 0) + p.numel() * p.element_size()
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def throwaway_runner(
    config: ResolvedConfig, model_info: ModelInfo, model: CausalLM, device: torch.device, num_blocks: int
) -> ModelRunner:
    """A runner over a KV cache of `num_blocks` blocks that start-up measures or warms with, then drops."""
    return ModelRunner(
        model,
        num_blocks,
        config.block_size,
        model_info.dtype,
        device,
        config.seed,
        max_num_seqs=config.max_num_seqs,
        kv_dtype=kv_cache_dtype(config),
    )


def dummy_step(config: ResolvedConfig, model_info: ModelInfo, model: CausalLM, device: torch.device) -> None:
    """The largest step the scheduler can build (max_num_batched_tokens over as many sequences as
    max_model_len requires), on a throwaway KV cache: what start-up profiling measures."""
    bs = config.block_size
    lengths: list[int] = []
    left = config.max_num_batched_tokens
    while left > 0 and len(lengths) < config.max_num_seqs:
        lengths.append(min(left, config.max_model_len))
        left -= lengths[-1]
    vocab = int(model_info.hf_config.vocab_size)
    plan = StepPlan(num_batched_tokens=sum(lengths))
    next_block = 0
    greedy = SamplingSpec(temperature=0.0)
    for i, n in enumerate(lengths):
        k = -(-n // bs)
        sid = f"profile-{i}"
        plan.new_seqs.append(NewSeq(sid, greedy))
        ids = [(7 * j) % vocab for j in range(n)]
        plan.seqs.append(
            SeqStep(sid, 0, n, ids, table_blocks=list(range(next_block, next_block + k)), sample_ids=[sid])
        )
        next_block += k
    runner = throwaway_runner(config, model_info, model, device, next_block)
    runner.rows.reserve()  # the per-sequence rows of penalties and logit_bias, at full capacity
    runner.execute(plan)
    sample_worst_case(runner, config.max_num_seqs, vocab, model_info.dtype)
    del runner


def warm_kernels(config: ResolvedConfig, model_info: ModelInfo, model: CausalLM, device: torch.device) -> None:
    """Small steps on a throwaway cache of a few blocks, so that what the first steps of a process pay once is paid
    here: cuBLAS's handle and the GEMM kernels of each decode batch size and of each row count the LM head meets
    (about 2 s on an H100 host, which a restart's first requests waited for), the Triton kernels' loads from their
    disk cache, and at tensor parallelism NCCL's communicators.  Small on purpose: an engine standing by may take
    little device memory (the old engine still holds it): one block per sequence, at most 64 sequences."""
    bs = config.block_size
    n = min(2 * bs - 1, (config.max_model_len or 2 * bs) - 1)
    vocab = int(model_info.hf_config.vocab_size)
    sizes = [size for size in capture_sizes(config.max_num_seqs) if size <= 64]
    runner = throwaway_runner(config, model_info, model, device, max(2, sizes[-1] if sizes else 1))
    greedy = SamplingSpec(temperature=0.0)
    ids = [(7 * j + 3) % vocab for j in range(n)]
    prompt = StepPlan(num_batched_tokens=n, new_seqs=[NewSeq("warm", greedy)])
    prompt.seqs.append(SeqStep("warm", 0, n, ids, table_blocks=[0, 1], sample_ids=["warm"]))
    runner.execute(prompt)
    runner.update_state(StepPlan(finished=["warm"]))
    for size in sizes:  # decode steps of each batch size a graph will be captured for (one token of context)
        step = StepPlan(num_batched_tokens=size)
        for i in range(size):
            sid = f"warm-{size}-{i}"
            step.new_seqs.append(NewSeq(sid, greedy))
            step.seqs.append(SeqStep(sid, 0, 1, [(11 * i + 5) % vocab], table_blocks=[i], sample_ids=[sid]))
        runner.execute(step)
        runner.update_state(StepPlan(finished=[s.seq_id for s in step.seqs]))
    runner.warm_lm_head()
    del runner
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sample_worst_case(runner: ModelRunner, num_seqs: int, vocab: int, dtype: torch.dtype) -> None:
    """Sample a full decode batch with every sampling feature on (the sampler's temporaries are
    several [max_num_seqs, vocab] float32 tensors, more than a prefill step's few sampled rows need)."""
    spec = SamplingSpec(
        temperature=1.0,
        top_p=0.9,
        top_k=50,
        logprobs=20,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
        min_p=0.05,
        min_tokens=1,
        min_tokens_stop_ids=(0,),
        logit_bias=((0, 1.0),),
    )
    ids = [f"profile-sample-{i}" for i in range(num_seqs)]
    runner.update_state(StepPlan(new_seqs=[NewSeq(sid, spec, 1, [0]) for sid in ids]))
    logits = torch.randn(num_seqs, vocab, dtype=dtype, device=runner.device)
    batch = runner._sampling_batch(ids, [0] * num_seqs)
    sample_on_device(logits, batch, runner.generator).to_host()


def _capture_largest_graphs(runner: ModelRunner, max_num_seqs: int, max_tokens: int) -> None:
    runner.capture_decode_graphs(max_num_seqs, only_largest=True)
    runner.capture_piece_graphs(max_tokens, only_largest=True)


def graph_pool_bytes(config: ResolvedConfig, model_info: ModelInfo, model: CausalLM, device: torch.device) -> int:
    """Memory the graphs keep: the largest decode graph and the largest bucket of the piecewise graphs
    (engine/runner/piecewise.py) captured once in their shared pool over a throwaway cache of one sequence
    (the pool's size does not depend on the cache's; the other graphs reuse its blocks), with the piecewise
    graphs' fixed buffers."""
    max_tokens = config.max_num_batched_tokens
    blocks = -(-config.max_model_len // config.block_size)
    runner = ModelRunner(
        model,
        blocks,
        config.block_size,
        model_info.dtype,
        device,
        config.seed,
        max_model_len=config.max_model_len,
        kv_dtype=kv_cache_dtype(config),
    )
    used = profile_graph_memory(device, partial(_capture_largest_graphs, runner, config.max_num_seqs, max_tokens))
    del runner
    torch.cuda.empty_cache()
    return used
