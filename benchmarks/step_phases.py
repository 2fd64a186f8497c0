"""Where each engine step's time goes, host and device, by kind of step (GPU).

    python -m benchmarks.step_phases [--workload long-tailed|uniform] [--num-prompts N] [--out DIR]

Runs the throughput benchmark's workload (Llama-3-8B shape, random bf16 weights) through the offline API
once for warm-up and once measured, with the engine's own methods wrapped (nothing in the engine changes):

- host milliseconds per step in `schedule` (the scheduler's plan), `launch` (inputs, the forward's
  kernel launches or graph replay, sampling: everything queued on the device), `wait` (blocking on a step's
  sampled tokens) and `update` (the scheduler taking them);
- device milliseconds per step: CUDA events recorded on the stream just before and just after the launch,
  i.e. from the step's first queued kernel to its last.  When the host queues kernels more slowly than the
  GPU runs them, this is the launch's host time, not the kernels' time.

Steps are grouped as `decode` (one token per sequence: a CUDA graph replay), `mixed` (decodes batched with
prefill chunks: eager) and `prefill` (chunks only: eager).  The device's idle time between steps is the
wall time less the sum of the steps' device spans.  JSON: `<out>/step-phases-<gpu>-<workload>-<date>.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime as dt
import gc
import io
import json
import os
import pstats
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import step_kernels
from benchmarks.memory import LLAMA3_8B, model_dir
from benchmarks.step_roofline import ModelCost, StepShape, layer_sequential_seconds, step_work
from benchmarks.throughput import RESULTS, copy_bandwidth, long_tailed_workload, matmul_rate, params_for, prompts_for
from engine import LLM
from engine.runner import sampler as sampler_mod
from engine.runner.piecewise import MAX_GRAPH_TOKENS


def _kind(plan) -> str:
    ones = sum(1 for s in plan.seqs if s.num_tokens == 1)
    if ones == len(plan.seqs):
        return "decode"
    return "mixed" if ones else "prefill"


def _shape(plan) -> StepShape:
    return StepShape(tuple((s.start, s.num_tokens) for s in plan.seqs), sum(len(s.sample_ids) for s in plan.seqs))


class PhaseRecorder:
    """Wraps the engine core's scheduler and runner to time each step's phases (host) and span (device)."""

    def __init__(
        self,
        llm: LLM,
        profile_mixed: int = 0,
        torch_profile_mixed: int = 0,
        kernel_profile: int = 0,
        every: int = 10,
        profile_updates: bool = False,
        gc_unfrozen: bool = False,
    ) -> None:
        core = llm.llm_engine.core
        # device kernels of sampled decode and mixed steps (benchmarks/step_kernels.py): every `every`-th step of
        # each kind until `kernel_profile` of it are in
        self.kernel_left = {"decode": kernel_profile, "mixed": kernel_profile}
        self.kernel_every = max(1, every)
        self.kind_count: dict[str, int] = defaultdict(int)
        self.kernel_samples: list[dict[str, Any]] = []
        self.profiler = cProfile.Profile() if profile_mixed else None
        self.update_profiler = cProfile.Profile() if profile_updates else None
        self.gc_unfrozen = gc_unfrozen
        self.profile_left = profile_mixed
        self.torch_left = torch_profile_mixed
        # torch profiler events of the profiled mixed launches: name -> [calls, self CPU us, self device us]
        self.torch_events: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        self.steps: list[dict[str, Any]] = []
        # the measured run (mark_begin): its first device event and the collector's passes during it
        self.begin: torch.cuda.Event | None = None
        self.gc_pauses: list[tuple[int, float]] = []  # (generation, seconds)
        self.tracked_objects_at_begin = 0
        self._on_gc: Callable[[str, dict[str, int]], None] | None = None
        # host seconds before step i was launched: waiting for samples, the scheduler's update (wall and the thread's
        # CPU), collector passes
        self.host_between: dict[int, defaultdict[str, float]] = defaultdict(
            lambda: defaultdict(float, wait=0.0, update=0.0)
        )
        sched, runner = core.scheduler, core.runner
        schedule, launch, update = sched.schedule, runner.launch, sched.update
        pending: dict[str, float] = {}

        def timed_schedule():
            t = time.perf_counter()
            plan = schedule()
            pending["schedule"] = time.perf_counter() - t
            return plan

        def timed_launch(plan, previous=None):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            kind = _kind(plan) if plan.seqs else "empty"
            profiled = self.profiler is not None and self.profile_left > 0 and kind == "mixed"
            self.kind_count[kind] += 1
            kernels = self.kernel_left.get(kind, 0) > 0 and self.kind_count[kind] % self.kernel_every == 0
            t = time.perf_counter()
            start.record()
            if kernels:
                self.kernel_left[kind] -= 1
                sample = self._kernel_profiled(launch, plan, previous, kind)
            elif profiled:
                self.profile_left -= 1
                sample = self.profiler.runcall(launch, plan, previous)
            elif self.torch_left > 0 and kind == "mixed":
                self.torch_left -= 1
                sample = self._torch_profiled(launch, plan, previous)
            else:
                sample = launch(plan, previous)
            end.record()
            host = time.perf_counter() - t
            self.steps.append(
                dict(
                    shape=_shape(plan),
                    kind=kind,
                    sampled=kernels or profiled,
                    seqs=len(plan.seqs),
                    tokens=sum(s.num_tokens for s in plan.seqs),
                    schedule_ms=1e3 * pending.pop("schedule", 0.0),
                    launch_ms=1e3 * host,
                    launched_at=t,
                    events=(start, end),
                )
            )
            return sample

        def timed_update(*a, **k):
            t, cpu = time.perf_counter(), time.thread_time()
            if self.update_profiler is not None:
                out = self.update_profiler.runcall(update, *a, **k)
            else:
                out = update(*a, **k)
            between = self.host_between[len(self.steps)]
            between["update"] += time.perf_counter() - t
            # the thread's own CPU time: a wall time far above it is a wait (the GIL, the OS), not work
            between["update_cpu"] += time.thread_time() - cpu
            return out

        to_host = sampler_mod.DeviceSample.to_host

        def timed_to_host(sample_self):
            t = time.perf_counter()
            out = to_host(sample_self)
            self.host_between[len(self.steps)]["wait"] += time.perf_counter() - t
            return out

        # Triton kernel variants first met during the run (each is compiled, or loaded from the disk cache, inside
        # a step): the step it happened in and the variant.
        self.triton_variants: list[dict[str, Any]] = []
        self._unhook = _hook_triton_variants(
            lambda name, variant: self.triton_variants.append(
                dict(step=len(self.steps), kernel=name, variant=variant[:400])
            )
        )
        sched.schedule, runner.launch, sched.update = timed_schedule, timed_launch, timed_update
        sampler_mod.DeviceSample.to_host = timed_to_host  # type: ignore[method-assign]
        self._restore = lambda: setattr(sampler_mod.DeviceSample, "to_host", to_host)

    def _torch_profiled(self, launch, plan, previous):
        """One launch under torch's profiler, its events summed into `torch_events` (host-side runtime calls
        such as cudaMalloc or a synchronising copy show up by name, with the host time they took)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            sample = launch(plan, previous)
            torch.cuda.synchronize()
        for e in prof.key_averages():
            row = self.torch_events[e.key]
            row[0] += e.count
            row[1] += e.self_cpu_time_total
            row[2] += getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
        return sample

    def _kernel_profiled(self, launch, plan, previous, kind: str):
        """One launch with its device kernels traced (CUDA activity only, so the host's launches slow down as
        little as the tracer allows); the step's span is its first kernel's start to its last one's end."""
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()  # the previous step's kernels stay out of the trace
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            sample = launch(plan, previous)
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        if events:
            first = min(e.time_range.start for e in events)
            last = max(e.time_range.end for e in events)
            self.kernel_samples.append(
                dict(
                    kind=kind,
                    shape=_shape(plan),
                    span_ms=(last - first) / 1e3,
                    kernels=[(e.name, e.time_range.elapsed_us() / 1e3) for e in events],
                )
            )
        return sample

    def kernel_summary(self, cost: ModelCost, matmul: float, copy: float) -> dict[str, Any]:
        samples = []
        for s in self.kernel_samples:
            shape = s["shape"]
            work = step_work(shape, cost)
            # mixed steps past the largest piece-graph bucket run eagerly: their own kind here
            big = s["kind"] == "mixed" and shape.tokens > MAX_GRAPH_TOKENS
            samples.append(
                dict(
                    kind="mixed_eager" if big else s["kind"],
                    span_ms=s["span_ms"],
                    kernels=s["kernels"],
                    tokens=shape.tokens,
                    seqs=len(shape.seqs),
                    linear_flops=work["flops"] - work["attention_flops"],
                    weight_bytes=cost.weight_bytes,
                    kv_bytes=work["kv_bytes"],
                    bound_ms=1e3 * max(work["bytes"] / copy, work["flops"] / matmul),
                )
            )
        return step_kernels.summarise(samples, matmul, copy)

    def torch_profile_rows(self, top: int = 40) -> list[dict[str, Any]]:
        rows = sorted(self.torch_events.items(), key=lambda kv: -kv[1][1])[:top]
        return [
            dict(name=k, calls=int(c), self_cpu_ms=round(cpu / 1e3, 3), self_device_ms=round(d / 1e3, 3))
            for k, (c, cpu, d) in rows
        ]

    def close(self) -> None:
        self._restore()
        self._unhook()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def profile_text(self, top: int = 40, updates: bool = False) -> str:
        """The profiled mixed launches' (or every update's) functions by cumulative time, then by own time
        (cProfile)."""
        profiler = self.update_profiler if updates else self.profiler
        if profiler is None:
            return ""
        buf = io.StringIO()
        stats = pstats.Stats(profiler, stream=buf)
        stats.sort_stats("cumulative").print_stats(top)
        stats.sort_stats("tottime").print_stats(top)
        return buf.getvalue()

    def mark_begin(self) -> None:
        """The measured run starts now: the device's idle time before the first step counts from here, and the
        garbage collector's pauses are recorded from here (`gc.callbacks`) until `close`.

        The objects the collector tracks are counted here, before the clock starts: `generate` freezes those
        (engine/gc_heap.py).  Counting them inside the run is no option: `gc.get_freeze_count()` walks the
        permanent generation's list, 44 ms for 450,000 objects (H100 host, Python 3.12); called from the
        collector's callback it stalled every 6th decode step of a 64-sequence run and left the device idle 35 %
        of the time (2026-11-27, `--profile-updates`)."""
        self.tracked_objects_at_begin = len(gc.get_objects())
        self.begin = torch.cuda.Event(enable_timing=True)
        self.begin.record()
        started: dict[str, float] = {}

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started["t"] = time.perf_counter()
            elif "t" in started:
                seconds = time.perf_counter() - started.pop("t")
                self.gc_pauses.append((info["generation"], seconds))
                self.host_between[len(self.steps)]["gc"] += seconds

        self._on_gc = on_gc
        gc.callbacks.append(on_gc)

    def gc_summary(self) -> dict[str, Any]:
        """The collector's pauses during the measured run, by generation: the host stalls for each, and a pause
        longer than the steps queued ahead of it leaves the device idle."""
        out: dict[str, Any] = {}
        for gen in (0, 1, 2):
            times = sorted((p[1] for p in self.gc_pauses if p[0] == gen), reverse=True)
            out[f"gen{gen}"] = dict(
                count=len(times), total_ms=round(1e3 * sum(times), 1), largest_ms=[round(1e3 * t, 1) for t in times[:5]]
            )
        # what `generate` froze (engine/gc_heap.py), unless the A/B left the heap to the collector
        out["frozen_objects"] = 0 if self.gc_unfrozen else self.tracked_objects_at_begin
        return out

    def idle(self, wall_s: float) -> dict[str, Any]:
        """Where the device sat idle during the measured run: before the first step, between consecutive steps
        (summed by the kinds of the two steps; a gap next to a profiled step, which synchronises, is left out),
        and after the last one until `generate` returned."""
        torch.cuda.synchronize()
        steps = self.steps
        if not steps:
            return {}
        gaps: dict[str, list[float]] = defaultdict(list)
        top: list[tuple[float, int, str]] = []
        for i in range(1, len(steps)):
            a, b = steps[i - 1], steps[i]
            if a["sampled"] or b["sampled"]:
                continue
            ms = max(0.0, a["events"][1].elapsed_time(b["events"][0]))
            key = f"{a['kind']}->{b['kind']}"
            gaps[key].append(ms)
            top.append((ms, i, key))
        begin = self.begin
        first_ms = begin.elapsed_time(steps[0]["events"][0]) if begin is not None else None
        last_ms = begin.elapsed_time(steps[-1]["events"][1]) if begin is not None else None
        return dict(
            before_first_step_ms=None if first_ms is None else round(first_ms, 2),
            after_last_step_ms=None if last_ms is None else round(1e3 * wall_s - last_ms, 2),
            between_steps_ms={
                k: dict(count=len(v), total=round(sum(v), 2), median=round(statistics.median(v), 3))
                for k, v in sorted(gaps.items())
            },
            largest_gaps=[self._gap_detail(i, k, ms) for ms, i, k in sorted(top, reverse=True)[:12]],
        )

    def _gap_detail(self, i: int, between: str, ms: float) -> dict[str, Any]:
        """One idle gap before step i with the host's account of it: the host milliseconds from step i-1's launch
        to step i's, and what they went to (i-1's launch, the waits for samples, the scheduler's update and plan,
        collector passes).  A gap the host's time covers was host-paced; the remainder, if any, is elsewhere."""
        a, b = self.steps[i - 1], self.steps[i]
        between_host = self.host_between.get(i, {})
        return dict(
            step=i,
            between=between,
            ms=round(ms, 3),
            seqs=(a["seqs"], b["seqs"]),
            tokens=(a["tokens"], b["tokens"]),
            host_launch_to_launch_ms=round(1e3 * (b["launched_at"] - a["launched_at"]), 3),
            host_ms={
                "previous_launch": round(a["launch_ms"], 3),
                **{k: round(1e3 * v, 3) for k, v in between_host.items()},
                "schedule": round(b["schedule_ms"], 3),
            },
        )

    def summary(self, wall_s: float, ceilings: tuple[ModelCost, float, float]) -> dict[str, Any]:
        """`ceilings`: the model's costs, the matmul FLOP/s and the copy bytes/s that bound each step
        (benchmarks/step_roofline.py), so each kind of step says how close to its bound it ran."""
        torch.cuda.synchronize()
        cost, matmul, copy = ceilings
        idle = self.idle(wall_s)
        by_kind: dict[str, list[dict]] = defaultdict(list)
        # a sampled step ran under a profiler: its span holds the tracer's cost, so it stays out of the kinds' sums
        self.steps = [s for s in self.steps if not s.pop("sampled")]
        for s in self.steps:
            start, end = s.pop("events")
            s["device_ms"] = start.elapsed_time(end)
            shape = s.pop("shape")
            work = step_work(shape, cost)
            # a step with no sequence (block moves only) runs no forward: nothing to bound
            s["bound_ms"] = 1e3 * max(work["bytes"] / copy, work["flops"] / matmul) if shape.seqs else 0.0
            s["sequential_ms"] = 1e3 * layer_sequential_seconds(work, cost, matmul, copy) if shape.seqs else 0.0
            by_kind[s["kind"]].append(s)
        kinds = {}
        for kind, rows in sorted(by_kind.items()):
            agg: dict[str, Any] = dict(steps=len(rows))
            for key in ("seqs", "tokens", "schedule_ms", "launch_ms", "device_ms", "bound_ms", "sequential_ms"):
                vals = [r[key] for r in rows]
                agg[key] = dict(
                    median=round(statistics.median(vals), 3),
                    mean=round(statistics.fmean(vals), 3),
                    total=round(sum(vals), 1),
                )
            # a step whose device span is within 10 % of its launch's host time was paced by the host
            agg["host_paced_fraction"] = round(sum(r["device_ms"] < 1.1 * r["launch_ms"] for r in rows) / len(rows), 3)
            # the kind's steps at their schedule-aware bound over their device spans: where the time is lost
            spent = max(1e-9, sum(r["device_ms"] for r in rows))
            agg["bound_fraction"] = round(sum(r["bound_ms"] for r in rows) / spent, 4)
            agg["layer_sequential_fraction"] = round(sum(r["sequential_ms"] for r in rows) / spent, 4)
            kinds[kind] = agg
        device_ms = sum(s["device_ms"] for s in self.steps)
        # every step with prompt tokens, in order: where a mean far above the median comes from
        prompt_steps = [
            [
                i,
                s["kind"],
                s["seqs"],
                s["tokens"],
                round(s["launch_ms"], 2),
                round(s["device_ms"], 2),
                round(s["bound_ms"], 2),
                round(s["sequential_ms"], 2),
            ]
            for i, s in enumerate(self.steps)
            if s["kind"] in ("mixed", "prefill")
        ]
        return dict(
            wall_s=round(wall_s, 3),
            steps=len(self.steps),
            device_span_s=round(device_ms / 1e3, 3),
            idle_between_steps_fraction=round(max(0.0, 1 - device_ms / 1e3 / wall_s), 4),
            idle=idle,
            gc=self.gc_summary(),
            host_s=dict(
                schedule=round(sum(s["schedule_ms"] for s in self.steps) / 1e3, 3),
                launch=round(sum(s["launch_ms"] for s in self.steps) / 1e3, 3),
                wait=round(sum(h["wait"] for h in self.host_between.values()), 3),
                update=round(sum(h["update"] for h in self.host_between.values()), 3),
            ),
            by_kind=kinds,
            triton_variants_met=self.triton_variants,
            prompt_steps=dict(
                columns=["step", "kind", "seqs", "tokens", "launch_ms", "device_ms", "bound_ms", "sequential_ms"],
                rows=prompt_steps,
            ),
        )


def _hook_triton_variants(record: Callable[[str, str], None]) -> Callable[[], None]:
    """Call `record(kernel, variant)` whenever a Triton kernel meets a specialisation it has not run in this
    process (Triton's JIT cache hook: triton.knobs from 3.4, JITFunction.cache_hook before); returns the undo."""

    def hook(*args: Any, **kw: Any) -> None:
        fn = kw.get("fn")
        record(getattr(fn, "name", "?"), str(kw.get("repr", "")))
        return None  # a true value would tell Triton to skip the compilation

    try:
        from triton import knobs

        previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = hook
        return lambda: setattr(knobs.runtime, "jit_cache_hook", previous)
    except (ImportError, AttributeError):
        from triton.runtime.jit import JITFunction

        previous = getattr(JITFunction, "cache_hook", None)
        JITFunction.cache_hook = hook  # type: ignore[attr-defined]
        return lambda: setattr(JITFunction, "cache_hook", previous)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("uniform", "long-tailed"), default="long-tailed")
    p.add_argument("--num-prompts", type=int, help="default: 1,000 long-tailed, 256 uniform")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--no-dense", action="store_true", help="every prefill chunk on the paged kernel (A/B)")
    p.add_argument("--profile-mixed", type=int, default=0, help="cProfile the launches of this many mixed steps")
    p.add_argument(
        "--torch-profile-mixed", type=int, default=0, help="torch-profile this many mixed launches (host calls by name)"
    )
    p.add_argument(
        "--kernel-profile",
        type=int,
        default=0,
        help="trace the device kernels of this many decode and this many mixed steps (benchmarks/step_kernels.py)",
    )
    p.add_argument("--kernel-profile-every", type=int, default=10, help="trace every N-th step of each kind")
    p.add_argument("--profile-updates", action="store_true", help="cProfile every call of the scheduler's update")
    p.add_argument(
        "--gc-unfrozen", action="store_true", help="A/B: leave the start-up heap to the collector (engine/gc_heap.py)"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.kernel_profile < 0 or args.kernel_profile_every < 1:
        p.error("--kernel-profile must be 0 or more and --kernel-profile-every 1 or more")
    if not torch.cuda.is_available():
        print("benchmarks.step_phases needs a CUDA GPU", file=sys.stderr)
        return 2
    vocab = LLAMA3_8B["vocab_size"]
    if args.workload == "long-tailed":
        work = long_tailed_workload(args.num_prompts or 1000, vocab, 0, 200, 200, 2048, 1024)
        max_len = 3072
    else:
        work = [(p, 256) for p in prompts_for(args.num_prompts or 256, 512, vocab, seed=0)]
        max_len = 768
    llm = LLM(
        model_dir(quick=False),
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_len,
        max_num_on_the_fly_batches=2,
        swap_space=0,
        load_format="dummy",
    )
    if args.no_dense:
        llm.llm_engine.core.runner.dense_lengths = None
    llm.generate([{"prompt_token_ids": q} for q, _ in work[:32]], params_for(work[:32]), use_tqdm=False)
    recorder = PhaseRecorder(
        llm,
        args.profile_mixed,
        args.torch_profile_mixed,
        args.kernel_profile,
        args.kernel_profile_every,
        args.profile_updates,
        args.gc_unfrozen,
    )
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    if args.gc_unfrozen:  # A/B: the engine before engine/gc_heap.py, its start-up heap walked by every full pass
        import engine.llm

        engine.llm.frozen_heap = contextlib.nullcontext  # type: ignore[assignment]
    recorder.mark_begin()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": q} for q, _ in work], params_for(work), use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    after = torch.cuda.memory_stats()
    recorder.close()
    # the caching allocator during the measured run: a retry is a cudaMalloc that failed and was retried after
    # freeing every cached block (which synchronises the device); device allocs/frees are cudaMalloc/cudaFree
    allocator = {
        k: after.get(k, 0) - before.get(k, 0)
        for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    }
    free, total = torch.cuda.mem_get_info()
    allocator.update(reserved_bytes=torch.cuda.memory_reserved(), device_free_bytes=free, device_total_bytes=total)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    copy = copy_bandwidth(torch.device("cuda"), 2 << 30)
    matmul = matmul_rate(torch.device("cuda"), 8192, torch.bfloat16)
    name = torch.cuda.get_device_name()
    result = dict(
        gpu=name,
        date=dt.date.today().isoformat(),
        command="python -m benchmarks.step_phases " + " ".join(sys.argv[1:] if argv is None else argv),
        workload=args.workload,
        num_prompts=len(work),
        generated_tokens=generated,
        tok_s=round(generated / wall, 1),
        dense_prefill=llm.llm_engine.core.runner.dense_lengths is not None,
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        allocator=allocator,
        copy_TBps=round(copy / 1e12, 3),
        matmul_TFLOPs=round(matmul / 1e12, 1),
        **recorder.summary(wall, (ModelCost.from_config(LLAMA3_8B, 2), matmul, copy)),
    )
    if args.kernel_profile:
        result["kernels_by_kind"] = recorder.kernel_summary(ModelCost.from_config(LLAMA3_8B, 2), matmul, copy)
    if args.profile_mixed:
        result["mixed_launch_profile"] = recorder.profile_text().splitlines()
    if args.profile_updates:
        result["update_profile"] = recorder.profile_text(updates=True).splitlines()
    result["threads"] = sorted(t.name for t in threading.enumerate())
    if args.torch_profile_mixed:
        result["mixed_launch_torch_profile"] = recorder.torch_profile_rows()
    slug = name.lower().replace("nvidia ", "").replace(" ", "-").split("-80gb")[0]
    args.out.mkdir(parents=True, exist_ok=True)
    variant = (
        (f"-n{args.num_prompts}" if args.num_prompts else "")
        + ("-no-dense" if args.no_dense else "")
        + ("-gc-unfrozen" if args.gc_unfrozen else "")
    )
    path = args.out / f"step-phases-{slug}-{args.workload}{variant}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    long = (
        "by_kind",
        "prompt_steps",
        "triton_variants_met",
        "mixed_launch_torch_profile",
        "kernels_by_kind",
        "mixed_launch_profile",
        "update_profile",
    )
    print(json.dumps({k: v for k, v in result.items() if k not in long}, indent=2))
    for v in result.get("triton_variants_met", []):
        print(f"triton variant met in step {v['step']}: {v['kernel']}")
    for kind, agg in result["by_kind"].items():
        print(kind, {k: (v["median"], v["total"]) if isinstance(v, dict) else v for k, v in agg.items()})
    print("\n".join(result.get("mixed_launch_profile", [])))
    print("\n".join(result.get("update_profile", [])))
    for row in result.get("mixed_launch_torch_profile", []):
        print(row)
    for kind, agg in result.get("kernels_by_kind", {}).items():
        print("kernels", kind, json.dumps(agg, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
