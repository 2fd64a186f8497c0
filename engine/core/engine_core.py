"""The step loop: schedule a plan, run it, accept its tokens, and emit what changed.

`step()` is the engine's heartbeat: every call advances `steps`, which the server's health check
and the `vllm:engine_steps_total` metric read to tell a busy engine from a hung one.  The core deals
in token ids only: text, stop strings and n > 1 reassembly belong to the output processor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog
import torch

from engine.config import EngineConfig, ResolvedConfig
from engine.core.admission import SequenceFactory, ValidRequest
from engine.core.deltas import SeqDelta
from engine.core.facts import CoreFacts, RecycleReport
from engine.core.first_steps import FIRST_STEPS_LOGGED, FirstSteps
from engine.core.plan import DeviceSample, StartRunner, StepPlan, StepRunner
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.gc_heap import freeze_imported_heap
from engine.kv.kv_cache_manager import KVCacheManager
from engine.logs import configure_logging, startup_detail
from engine.memory.budget import KVPlan, ranks_table
from engine.model.loader import ModelInfo, check_tensor_parallel, inspect_model
from engine.model.tokenizer_load import load_tokenizer
from engine.openmp_waits import wait_policy
from engine.stats import EngineSnapshot, GapHistogram

log = structlog.get_logger("pagekeeper.engine")


@dataclass
class StepStats:
    """Counters a step adds to; the metrics layer reads them once per step."""

    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    last_step_time: float = field(default_factory=time.monotonic)
    token_gaps: GapHistogram = field(default_factory=GapHistogram)  # inter-token latency


@dataclass
class _Launched:
    """A step queued on the device whose tokens have not been read."""

    plan: StepPlan
    sample: DeviceSample
    at: float  # time.monotonic() at its launch


# Under load, deferred start-up work (engine/runner/deferred.py) takes at most this share of the step loop: a unit
# (one graph, one bucket of piecewise graphs: a few to a few hundred milliseconds) that held it t seconds is
# followed by at least t * (1 / share - 1) of steps, and never less than DEFERRED_GAP_S.
DEFERRED_SHARE = 0.25
DEFERRED_GAP_S = 0.05
# An engine that starts under load (a restart: the queued connections arrive at once) serves this long before the
# first unit: its first steps answer the requests that waited through the restart, and a unit before them would
# lengthen the restart's gap.  Not for units that make those steps faster (the decode graphs).  Idle, units run
# at once.
DEFERRED_AFTER_LOAD_S = 3.0


class EngineCore:
    def __init__(self, config: EngineConfig, start_runner: StartRunner, defer_startup_work: bool = False) -> None:
        """`start_runner` brings the runner up (engine/distributed/executor.py, start_engine_runner)."""
        freeze_imported_heap()  # a server's imported modules, out of start-up's last collection (engine/gc_heap.py)
        configure_logging()
        started = time.monotonic()
        device = config.resolved_device()
        self.device = torch.device(device)
        self.model_info: ModelInfo = inspect_model(config)
        # every limit and derived value fixed from here on (engine/config.py: ResolvedConfig)
        self.config: ResolvedConfig = config.resolve(
            self.model_info.max_position_embeddings,
            self.model_info.sliding_window,
            model_dtype=str(self.model_info.dtype).removeprefix("torch."),
            device=device,
        )
        inspected = time.monotonic()
        self.tokenizer = load_tokenizer(config)
        tokenizer_loaded = time.monotonic()
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(self.model_info, config.tensor_parallel_size)  # before any process starts
        up, runner, self.rank_plans = start_runner(self.config, self.model_info, defer_startup_work)
        self.runner: StepRunner = runner
        self.model, self.kv_plan = up.model, up.kv_plan
        self.preemption_mode = up.preemption_mode
        self.graph_capture_seconds = up.graph_capture_seconds
        self.kv = KVCacheManager(
            self.kv_plan.usable_blocks, config.block_size, config.enable_prefix_caching, up.num_cpu_blocks
        )
        self.eos_token_ids = frozenset(self.model_info.eos_token_ids)
        self.sequences = SequenceFactory(self.tokenizer, int(self.model_info.hf_config.vocab_size), self.eos_token_ids)
        self.scheduler = Scheduler(
            self.kv,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            config.enable_chunked_prefill,
            self.preemption_mode,
            self.eos_token_ids,
        )
        self.stats = StepStats()
        self.pipeline_depth = config.pipeline_depth(self.device.type)
        self.step = self._step_pipelined if self.pipeline_depth == 2 else self._step_in_turn
        self._in_flight: _Launched | None = None  # queued on the device, tokens not yet read
        self._last_deferred = float("-inf")  # never: monotonic time starts near 0 at boot, not long ago
        self._deferred_start: float | None = None  # when deferred units may run under load (DEFERRED_AFTER_LOAD_S)
        # a server logs its first steps once (what the requests that waited through a restart waited for next)
        self.first_steps = FirstSteps(FIRST_STEPS_LOGGED if defer_startup_work else 0)
        # seconds per start-up phase: reading the checkpoint's config, the tokenizer, then the runner's (startup.py)
        self.phases = {
            "inspect_model": round(inspected - started, 3),
            "tokenizer": round(tokenizer_loaded - inspected, 3),
            **up.phases,
        }
        startup_detail(
            log,
            "engine_ready",
            model=str(self.model_info.path),
            architecture=self.model_info.architecture,
            dtype=str(self.model_info.dtype).removeprefix("torch."),
            quantization=self.model_info.quant.describe() if self.model_info.quant else None,
            kv_cache_dtype=self.kv_plan.kv_dtype,
            weights_bytes=self.kv_plan.weights_by_dtype,
            device=str(self.device),
            max_model_len=self.config.max_model_len,
            block_size=config.block_size,
            tensor_parallel_size=config.tensor_parallel_size,
            num_blocks=self.kv_plan.usable_blocks,
            kv_bytes=self.kv_plan.kv_bytes,
            preemption_mode=self.preemption_mode,
            num_cpu_blocks=up.num_cpu_blocks,
            prefix_caching=config.enable_prefix_caching,
            cuda_graphs=self.runner.graphs.sizes if self.runner.graphs else None,
            # token counts of the piecewise graphs that steps with prompt tokens replay (engine/runner/piecewise.py)
            piece_graphs=self.runner.pieces.buckets if self.runner.pieces is not None else None,
            graph_capture_seconds=round(self.graph_capture_seconds, 3),
            pipeline_depth=self.pipeline_depth,
            weights_from=up.weights_source,
            phases=self.phases,
            deferred=self.runner.deferred.pending,
            # how the CPU's intra-op threads wait between ops (engine/openmp_waits.py)
            openmp_waits=wait_policy() if self.device.type == "cpu" else None,
            load_seconds=round(time.monotonic() - tokenizer_loaded, 3),
        )
        if self.device.type == "cuda" or config.tensor_parallel_size > 1:
            startup_detail(
                log,
                "memory_plan",
                table="\n" + ranks_table(self.rank_plans),
                fragmentation_buffer_bytes=self.kv_plan.fragmentation_buffer_bytes,
            )

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (one GPU: nothing to do)."""
        self.runner.close()

    @property
    def memory_plans(self) -> list[KVPlan]:
        """Every rank's KV plan (one entry on one GPU)."""
        return self.rank_plans

    # -- requests ------------------------------------------------------------------------------

    @property
    def facts(self) -> CoreFacts:
        """What the front needs to know of this core (engine/core/facts.py)."""
        return CoreFacts(
            config=self.config,
            vocab_size=int(self.model_info.hf_config.vocab_size),
            num_blocks=self.kv.num_blocks,
            num_cpu_blocks=self.kv.num_cpu_blocks,
            eos_token_ids=self.eos_token_ids,
            fragmentation_buffer_bytes=self.kv_plan.fragmentation_buffer_bytes,
            device=str(self.device),
            phases=dict(self.phases),
        )

    def admit(
        self,
        request_id: str,
        valid: ValidRequest,
        arrival: float | None = None,
        resumed: dict[int, list[int]] | None = None,
    ) -> list[str]:
        """Queue a validated request's sequences (engine/core/admission.py); their ids."""
        seqs = self.sequences.sequences(request_id, valid, arrival, resumed)
        for seq in seqs:
            if seq.held_by is None:  # n > 1 siblings join when their leader's prompt is done
                self.scheduler.add(seq)
        return [s.seq_id for s in seqs]

    def add(self, req: Request) -> None:
        self.scheduler.add(req)

    def finish(self, seq_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> bool:
        """End a sequence now (an abort, or a stop string the output processor found); False if it
        had already ended.  A token of it still on the device is dropped when it is read."""
        req = self.scheduler.requests.get(seq_id)
        if req is None:
            return False
        if stop_reason is not None:
            req.stop_reason = stop_reason
        self.scheduler.finish(req, status)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def token_utilization(self) -> float:
        """Tokens with KV / token slots of the blocks running sequences hold (internal fragmentation)."""
        slots = stored = 0
        for req in self.scheduler.running:
            slots += self.kv.tokens_capacity(req.seq_id)
            stored += req.num_computed_tokens
        return stored / slots if slots else 1.0

    # -- the step --------------------------------------------------------------------------------

    def _step_in_turn(self) -> list[SeqDelta]:
        """One iteration with depth 1: schedule, run, and read the tokens, in turn."""
        self._tick()
        launched = self._launch(None)
        return self._accept(launched) if launched is not None else []

    def _step_pipelined(self) -> list[SeqDelta]:
        """One iteration with async scheduling (`--max-num-on-the-fly-batches 2`).

        Step k+1 is scheduled and queued on the device while step k still computes: a sequence's
        token from step k counts as pending, and the runner feeds it to step k+1 on the device.
        Only then does the host wait for step k's tokens and accept them (EOS, stop ids,
        max_tokens) while the device computes step k+1, so the GPU never waits for the CPU between
        decode steps.  A sequence that step k ends (EOS, a stop id or string, an abort) has
        computed one token too many in step k+1; that token is dropped.  max_tokens is known in
        advance, so it costs nothing.  Outputs are the same as with depth 1.
        """
        self._tick()
        previous = self._in_flight
        if self.scheduler.num_constrained:
            # A grammar's next mask needs the token before it: read each step before planning the next.
            self._in_flight = None
            deltas = self._accept(previous) if previous is not None else []
            launched = self._launch(None)
            return deltas + (self._accept(launched) if launched is not None else [])
        try:
            self._in_flight = self._launch(previous)
            return self._accept(previous) if previous is not None else []
        except BaseException:
            self._in_flight = None
            raise

    def _tick(self) -> None:
        self.stats.steps += 1
        self.stats.last_step_time = time.monotonic()

    def _launch(self, previous: _Launched | None) -> _Launched | None:
        """Schedule a step and queue it on the device (with a unit of deferred start-up work when one is due)."""
        plan = self.scheduler.schedule()
        plan.deferred_units = self._deferred_due(plan)
        if plan.empty and not plan.finished and not plan.deferred_units:
            return None
        at = time.monotonic()
        sample = self.runner.launch(plan, previous.sample if previous is not None else None)
        return _Launched(plan, sample, at) if sample is not None else None

    # -- recycling the KV pool in place ------------------------------------------------------------

    def recycle(self) -> tuple[list[SeqDelta], RecycleReport]:
        """Rebuild the KV pool and the prefix cache without a restart: the cheapest cure for a pool that stays
        full (blocks leaked by a bug, a prefix cache gone bad).  The step in flight is read first (its tokens are
        returned), every running sequence goes back to waiting and is recomputed from the tokens it has (none is
        lost; a seeded request gives the tokens it would have given), every device block becomes free, and on a
        GPU the allocator returns its cached free memory.  Between steps only (the step loop's thread)."""
        started = time.monotonic()
        deltas: list[SeqDelta] = []
        if self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            deltas = self._accept(launched)
        usage_before = self.kv.usage()
        requeued = self.scheduler.preempt_all()
        reclaimed = self.kv.rebuild()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        report = RecycleReport(
            requeued=requeued,
            reclaimed_blocks=reclaimed,
            usage_before=round(usage_before, 4),
            seconds=round(time.monotonic() - started, 4),
        )
        log.warning("kv_pool_recycled", **report.__dict__, swapped=self.scheduler.num_swapped)
        return deltas, report

    # -- deferred start-up work (engine/runner/deferred.py) ------------------------------------

    def has_deferred_work(self) -> bool:
        return self.runner.deferred.pending

    def _deferred_due(self, plan: StepPlan) -> int:
        """1 when a unit of deferred work should run before this step: at once while idle, else paced to
        DEFERRED_SHARE of the time; a unit that writes KV blocks only while none is held (the prefix cache is
        emptied first)."""
        work = self.runner.deferred
        if not work.pending or not work.next_ready:
            return 0
        idle = plan.empty and not self.scheduler.has_unfinished() and self._in_flight is None
        if work.next_needs_idle:
            if not idle or self.kv.num_held_blocks():
                return 0
            self.kv.reset_prefix_cache()
            return 1
        now = time.monotonic()
        if not idle:
            if self._deferred_start is None:
                self._deferred_start = now + DEFERRED_AFTER_LOAD_S  # the first step under load
            if now < self._deferred_start and not work.next_speeds_up_steps:
                return 0
            if now - self._last_deferred < max(DEFERRED_GAP_S, work.last_unit_seconds / DEFERRED_SHARE):
                return 0
            self._last_deferred = now  # a unit run while idle took no request's time: it delays no later unit
        return 1

    def run_deferred(self) -> None:
        """One unit of deferred work while no request runs (the server's idle loop)."""
        if self.has_unfinished():
            return
        launched = self._launch(None)
        assert launched is None  # nothing was scheduled

    def wake(self) -> None:
        """Nothing to cut short: this core's `run_deferred` runs a unit of work and never waits."""

    def finish_deferred(self) -> None:
        """Run all deferred work now (every rank runs each unit inside a launch)."""
        while self.runner.deferred.pending:
            self.runner.launch(StepPlan(deferred_units=1))

    def _accept(self, launched: _Launched) -> list[SeqDelta]:
        """Wait for the step's tokens and apply everything that decides the next schedule."""
        out = launched.sample.to_host()
        now = time.monotonic()
        self.first_steps.record(launched.plan, launched.at, now)
        deltas = self.scheduler.update(launched.plan, out, now)
        self.stats.generation_tokens += len(deltas)
        self.stats.prompt_tokens = self.scheduler.num_prompt_tokens_done
        gaps = self.scheduler.token_gaps
        if gaps:
            for previous, n in gaps.items():
                self.stats.token_gaps.add(now - previous, n)
            gaps.clear()
        return deltas

    def snapshot(self) -> EngineSnapshot:
        """Plain numbers for the metrics layer, taken between steps."""
        kv, sched, stats = self.kv, self.scheduler, self.stats
        allocated = reserved = 0
        if self.device.type == "cuda":
            allocated = torch.cuda.memory_allocated(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
        return EngineSnapshot(
            running=sched.num_running,
            waiting=sched.num_waiting,
            swapped=sched.num_swapped,
            gpu_cache_usage=kv.usage(),
            cpu_cache_usage=kv.cpu_usage(),
            token_utilization=self.token_utilization(),
            prefix_blocks_used=kv.pool.num_cached,
            prefix_blocks_total=kv.num_blocks,
            prefix_hit_rate=kv.prefix_hits / kv.prefix_queries if kv.prefix_queries else 0.0,
            prefix_queries=kv.prefix_queries,
            prefix_hits=kv.prefix_hits,
            prompt_tokens=stats.prompt_tokens,
            generation_tokens=stats.generation_tokens,
            preemptions=sched.num_preemptions,
            steps=stats.steps,
            oldest_waiting_seconds=sched.oldest_waiting_seconds(),
            allocated_bytes=allocated,
            reserved_bytes=reserved,
            token_gap_counts=tuple(stats.token_gaps.counts),
            token_gap_sum=stats.token_gaps.sum,
            startup_work_pending=self.runner.deferred.pending,
        )
