"""The step loop: schedule, execute, record, and finish what is done.

`step()` is the engine's heartbeat: every call advances `steps`, which the server's health check
and the `vllm_engine_steps_total` metric read to tell a busy engine from a hung one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog
import torch

from engine.config import EngineConfig
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from engine.kv.kv_cache_manager import KVCacheManager
from engine.logs import configure_logging
from engine.memory.budget import (KVPlan, device_baseline, plan_kv_cache, profile_graph_memory, profile_step,
                                  set_allocator_defaults)
from engine.metrics import EngineSnapshot
from engine.model.loader import ModelInfo, inspect_model, load_model, load_tokenizer
from engine.runner.model_runner import LaunchedStep, ModelRunner, kv_bytes_per_block
from engine.sampling_params import SamplingParams

log = structlog.get_logger("pagekeeper.engine")


@dataclass
class StepStats:
    """Counters a step adds to; the metrics layer reads them once per step."""

    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    last_step_time: float = field(default_factory=time.monotonic)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        configure_logging()
        self.config = config
        self.device = torch.device(config.resolved_device())
        self.model_info: ModelInfo = inspect_model(config)
        config.resolve_limits(self.model_info.max_position_embeddings, self.model_info.sliding_window)
        self.tokenizer = load_tokenizer(config)
        started = time.monotonic()
        baseline = profile = None
        if self.device.type == "cuda":
            set_allocator_defaults()
            baseline = device_baseline(self.device)
        self.model = load_model(self.model_info, config.max_model_len, self.device, config.load_format)
        per_block = kv_bytes_per_block(self.model, config.block_size, self.model_info.dtype)
        if self.device.type == "cuda":
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            profile = profile_step(self.device, weights, self._dummy_step)
            if not config.enforce_eager:
                profile.graph_bytes = self._graph_pool_bytes()
        self.kv_plan: KVPlan = plan_kv_cache(config, per_block, self.device, baseline, profile)
        self.preemption_mode = config.resolved_preemption_mode(self.device.type)
        num_cpu_blocks = int(config.swap_space * 2**30) // per_block if self.preemption_mode == "swap" else 0
        if self.preemption_mode == "swap" and num_cpu_blocks == 0:
            log.warning("swap_space_too_small", swap_space_gib=config.swap_space, bytes_per_block=per_block,
                        effect="preempted requests are recomputed")
        self.kv = KVCacheManager(self.kv_plan.num_blocks, config.block_size, config.enable_prefix_caching,
                                 num_cpu_blocks)
        self.runner = ModelRunner(self.model, self.kv_plan.num_blocks, config.block_size,
                                  self.model_info.dtype, self.device, config.seed, num_cpu_blocks,
                                  max_model_len=config.max_model_len)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, self.preemption_mode)
        self.eos_token_ids = set(self.model_info.eos_token_ids)
        self.stats = StepStats()
        self.pipeline_depth = min(config.max_num_on_the_fly_batches, 2)
        # Tokens accepted but not yet detokenized (stop strings are checked there), in order.
        self._unprocessed: list[tuple[Request, int]] = []
        self._in_flight: LaunchedStep | None = None  # queued on the device, tokens not yet read
        self.graph_capture_seconds = 0.0
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graph_capture_seconds = self.runner.capture_decode_graphs(config.max_num_seqs)
        log.info(
            "engine_ready", model=str(self.model_info.path), architecture=self.model_info.architecture,
            dtype=str(self.model_info.dtype).removeprefix("torch."), device=str(self.device),
            max_model_len=config.max_model_len, block_size=config.block_size,
            num_blocks=self.kv_plan.num_blocks, kv_bytes=self.kv_plan.kv_bytes,
            preemption_mode=self.preemption_mode, num_cpu_blocks=num_cpu_blocks,
            prefix_caching=config.enable_prefix_caching,
            cuda_graphs=self.runner.graphs.sizes if self.runner.graphs else None,
            graph_capture_seconds=round(self.graph_capture_seconds, 3),
            pipeline_depth=self.pipeline_depth,
            load_seconds=round(time.monotonic() - started, 3),
        )
        if self.device.type == "cuda":
            log.info("memory_plan", table="\n" + self.kv_plan.table(),
                     fragmentation_buffer_bytes=self.kv_plan.fragmentation_buffer_bytes)

    # -- requests ------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.scheduler.add(req)

    def abort(self, req: Request) -> None:
        if not req.status.finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._unprocessed) or self._in_flight is not None

    def token_utilization(self) -> float:
        """Tokens with KV / token slots of the blocks running sequences hold (internal fragmentation)."""
        slots = stored = 0
        for req in self.scheduler.running:
            slots += self.kv.tokens_capacity(req.seq_id)
            stored += req.num_computed_tokens
        return stored / slots if slots else 1.0

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one iteration; returns the sequences whose output advanced or that finished.

        With `--max-num-on-the-fly-batches 2` (async scheduling) step k+1 is scheduled and queued on
        the device while step k still computes: a sequence's token from step k is counted as pending,
        and the runner feeds it to step k+1 on the device.  Only then does the host wait for step k's
        tokens, accept them (EOS, stop ids, max_tokens), and detokenize them (stop strings) while the
        device computes step k+1, so the GPU never waits for the CPU between decode steps.  A
        sequence that step k ends (EOS, a stop id or string, an abort) has computed one token too
        many in step k+1; that token is dropped.  max_tokens is known in advance, so it costs nothing.
        Outputs are the same as with depth 1, which runs schedule, launch and accept in turn.
        """
        self.stats.steps += 1
        self.stats.last_step_time = time.monotonic()
        try:
            if self.pipeline_depth == 1:
                launched = self._schedule_and_launch(None)
                if launched is not None:
                    self._accept(launched)
                return self._postprocess()
            previous = self._in_flight
            self._in_flight = self._schedule_and_launch(previous)
            if previous is not None:
                self._accept(previous)
            return self._postprocess()
        except BaseException:
            self._in_flight = None
            for req, _ in self._unprocessed:
                req.num_undetokenized = 0
            self._unprocessed.clear()
            raise

    @staticmethod
    def has_pending_output(req: Request) -> bool:
        """The request has tokens whose text (and stop-string check) the next step produces."""
        return req.num_undetokenized > 0

    def _schedule_and_launch(self, previous: LaunchedStep | None) -> LaunchedStep | None:
        """Schedule a step and queue it on the device; its progress is recorded at once (it holds
        for every later step, which the device runs after this one)."""
        plan = self.scheduler.schedule()
        if plan.empty:
            return None
        tables = [self.kv.block_table(s.request.seq_id) for s in plan.seqs]
        launched = self.runner.launch(plan, tables, previous.sample if previous is not None else None)
        self.scheduler.record_progress(plan)
        if launched is None:
            return None
        for row, req in enumerate(launched.sampled):
            if req.held_by is not None and not req.status.finished:
                self._fork(req)
            req.num_pending += 1
            req.pending_row = row
        return launched

    def _accept(self, launched: LaunchedStep) -> None:
        """Wait for the step's tokens and apply everything that decides the next schedule."""
        out = launched.sample.to_host()
        now = time.monotonic()
        cache = self.kv.prefix_caching
        for i, req in enumerate(launched.sampled):
            req.num_pending -= 1
            if req.status.finished:  # aborted or stopped while the step ran: the token is dropped
                continue
            lp = out.logprobs[i] if out.logprobs is not None else None
            top = out.top_logprobs[i] if out.top_logprobs is not None else None
            self._accept_token(req, out.token_ids[i], lp, top, now)
            if cache:
                self.scheduler.cache_known_blocks(req)

    def _postprocess(self) -> list[Request]:
        """Detokenize the accepted tokens and apply stop strings; the requests touched, in order."""
        pending, self._unprocessed = self._unprocessed, []
        touched: dict[int, Request] = {}
        for req, token in pending:
            touched[id(req)] = req
            req.num_undetokenized -= 1
            if req.detokenizer.stopped is not None or req.status == RequestStatus.FINISHED_ABORTED:
                continue
            stop_string = req.detokenizer.add_token(token)
            if stop_string is None:
                continue
            req.stop_reason = stop_string
            if req.status.finished:  # the same token also ended it by length / EOS: the stop string wins
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        return list(touched.values())

    def _dummy_step(self) -> None:
        """The largest step the scheduler can build (max_num_batched_tokens over as many sequences as
        max_model_len requires), on a throwaway KV cache: what start-up profiling measures."""
        cfg = self.config
        assert cfg.max_num_batched_tokens is not None and cfg.max_model_len is not None
        bs = cfg.block_size
        lengths, left = [], cfg.max_num_batched_tokens
        while left > 0 and len(lengths) < cfg.max_num_seqs:
            lengths.append(min(left, cfg.max_model_len))
            left -= lengths[-1]
        tables, next_block = [], 0
        for n in lengths:
            k = -(-n // bs)
            tables.append(list(range(next_block, next_block + k)))
            next_block += k
        runner = ModelRunner(self.model, next_block, bs, self.model_info.dtype, self.device, cfg.seed)
        vocab = int(self.model_info.hf_config.vocab_size)
        plan = SchedulerOutput()
        for i, n in enumerate(lengths):
            req = Request(seq_id=f"profile-{i}", parent_id="profile", index=i,
                          prompt_token_ids=[(7 * j) % vocab for j in range(n)],
                          params=SamplingParams(temperature=0, max_tokens=1), max_tokens=1, eos_token_id=None,
                          arrival_order=i, detokenizer=IncrementalDetokenizer(self.tokenizer, []))
            plan.seqs.append(ScheduledSeq(req, 0, n))
        runner.execute(plan, tables)
        del runner

    def _graph_pool_bytes(self) -> int:
        """Memory the decode graphs keep: the largest one captured once over a throwaway cache of one
        sequence (the pool's size does not depend on the cache's; the others reuse its blocks)."""
        cfg = self.config
        assert cfg.max_model_len is not None
        blocks = -(-cfg.max_model_len // cfg.block_size)
        runner = ModelRunner(self.model, blocks, cfg.block_size, self.model_info.dtype, self.device, cfg.seed,
                             max_model_len=cfg.max_model_len)
        used = profile_graph_memory(self.device,
                                    lambda: runner.capture_decode_graphs(cfg.max_num_seqs, only_largest=True))
        del runner
        torch.cuda.empty_cache()
        return used

    def _fork(self, req: Request) -> None:
        """The leader's prompt is done: the sibling shares its blocks and joins the batch."""
        leader = req.held_by
        assert leader is not None
        self.kv.fork(leader.seq_id, req.seq_id)
        req.num_computed_tokens = leader.num_computed_tokens
        req.first_scheduled_time = leader.first_scheduled_time
        leader.forks.remove(req)
        req.held_by = None
        self.scheduler.add_running(req)

    def snapshot(self) -> EngineSnapshot:
        """Plain numbers for the metrics layer, taken between steps."""
        kv, sched, stats = self.kv, self.scheduler, self.stats
        allocated = reserved = 0
        if self.device.type == "cuda":
            allocated = torch.cuda.memory_allocated(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
        return EngineSnapshot(
            running=sched.num_running, waiting=sched.num_waiting, swapped=sched.num_swapped,
            gpu_cache_usage=kv.usage(), cpu_cache_usage=kv.cpu_usage(),
            token_utilization=self.token_utilization(),
            prefix_blocks_used=kv.pool.num_cached, prefix_blocks_total=kv.num_blocks,
            prefix_hit_rate=kv.prefix_hits / kv.prefix_queries if kv.prefix_queries else 0.0,
            prefix_queries=kv.prefix_queries, prefix_hits=kv.prefix_hits,
            prompt_tokens=stats.prompt_tokens, generation_tokens=stats.generation_tokens,
            preemptions=sched.num_preemptions, steps=stats.steps,
            oldest_waiting_seconds=sched.oldest_waiting_seconds(),
            allocated_bytes=allocated, reserved_bytes=reserved,
        )

    def _accept_token(self, req: Request, token: int, logprob: float | None,
                      top: dict[int, float] | None, now: float) -> None:
        """Append a sampled token and apply the checks that need no text (stop ids, EOS, max_tokens)."""
        req.output_token_ids.append(token)
        if logprob is not None and req.params.logprobs is not None:
            req.output_logprobs.append(logprob)
            k = req.params.logprobs
            req.output_top_logprobs.append(dict(list((top or {}).items())[:k]))
        self.stats.generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
            self.stats.prompt_tokens += req.num_prompt_tokens
        self._unprocessed.append((req, token))
        req.num_undetokenized += 1
        p = req.params
        if token in p.stop_token_ids:
            req.stop_reason = token
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        elif not p.ignore_eos and token in self.eos_token_ids:
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        elif len(req.output_token_ids) >= req.max_tokens:
            self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
