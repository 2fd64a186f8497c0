"""vLLM's logits adjustments, per sequence and on the device: the presence, frequency and repetition
penalties, min_tokens, logit_bias, allowed_token_ids and min_p.

The penalties depend on the tokens a sequence has produced, and with async scheduling the newest of
those is still on the device when the next step is queued.  So each penalized sequence has a row of
output-token counts on the device, and every step adds its own samples to the rows (`record`) without
the host reading anything.  Tensor-parallel ranks sample identically, so each keeps identical rows.
logit_bias and allowed_token_ids become one dense bias row per sequence, written once when the
sequence arrives.  min_tokens needs no device state: the plan says how many tokens each sequence has
out before a step, so the host names the (row, stop token) pairs to mask.

The rows come from a pool that holds a row per live sequence that needs one (preempted ones keep
theirs), allocated per kind of row on first use at `capacity` rows (the scheduler's max_num_seqs; the
start-up profile reserves that much) and doubled if more sequences need rows at once.

The order of application is vLLM's: allowed tokens and logit_bias, min_tokens, then the penalties
(all before greedy argmax); min_p after temperature, before top-k/top-p.  Logprobs stay those of the
model's raw distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from engine.core.plan import SamplingSpec

ToDevice = Callable[[np.ndarray], torch.Tensor]


@dataclass
class LogitsAdjustment:
    """One step's adjustments, as device tensors built from host data (no device reads)."""

    rows: torch.Tensor | None = None  # [R] batch rows that have a pool row ...
    slots: torch.Tensor | None = None  # [R] ... and which one
    presence: torch.Tensor | None = None  # [R, 1] float32 (None: no row is penalized)
    frequency: torch.Tensor | None = None  # [R, 1]
    repetition: torch.Tensor | None = None  # [R, 1]
    biased: bool = False  # some row has a bias row
    ban_rows: torch.Tensor | None = None  # min_tokens: logits[ban_rows, ban_ids] = -inf
    ban_ids: torch.Tensor | None = None
    min_p: torch.Tensor | None = None  # [S] float32, for random rows (None: no row uses it)
    record_rows: torch.Tensor | None = None  # penalized batch rows whose samples are counted ...
    record_slots: torch.Tensor | None = None  # ... into these pool rows


class SequenceRows:
    """The device rows of the sequences that need them (see the module docstring)."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.capacity = max(1, capacity)
        self.counts: torch.Tensor | None = None  # [capacity, V] int32: output tokens so far
        self.prompt_mask: torch.Tensor | None = None  # [capacity, V] bool: tokens in the prompt
        self.bias: torch.Tensor | None = None  # [capacity, V] float32: logit_bias, -inf outside allowed
        self._slot: dict[str, int] = {}
        self._free: list[int] = list(range(self.capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slot)

    def slot(self, seq_id: str) -> int | None:
        return self._slot.get(seq_id)

    def reserve(self) -> None:
        """Allocate every kind of row at full capacity now (the start-up profile counts them)."""
        for name in ("counts", "prompt_mask", "bias"):
            self._table(name)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.counts, self.prompt_mask, self.bias) if t is not None)

    def add(self, seq_id: str, spec: SamplingSpec, prompt_token_ids: list[int] | None, to_device: ToDevice) -> None:
        if not (spec.penalized or spec.biased):
            return
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._slot[seq_id] = slot
        if spec.penalized:
            self._table("counts")
        if spec.repetition_penalty != 1.0:
            self._table("prompt_mask")
        if spec.biased:
            self._table("bias")
        # A reused slot holds the previous sequence's values in every table: reset them all.
        for t in (self.counts, self.prompt_mask, self.bias):
            if t is not None:
                t[slot].zero_()
        if self.prompt_mask is not None and prompt_token_ids:
            ids = to_device(np.asarray(sorted(set(prompt_token_ids)), dtype=np.int64))
            self.prompt_mask[slot].index_fill_(0, ids, True)
        if spec.biased:
            assert self.bias is not None
            row = self.bias[slot]
            if spec.allowed_token_ids is not None:
                row.fill_(float("-inf"))
                row.index_fill_(0, to_device(np.asarray(spec.allowed_token_ids, dtype=np.int64)), 0.0)
            if spec.logit_bias:
                ids = to_device(np.asarray([t for t, _ in spec.logit_bias], dtype=np.int64))
                values = to_device(np.asarray([v for _, v in spec.logit_bias], dtype=np.float32))
                row.index_add_(0, ids, values)

    def remove(self, seq_id: str) -> None:
        slot = self._slot.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def _table(self, name: str) -> torch.Tensor:
        t = getattr(self, name)
        if t is None:
            dtype = {"counts": torch.int32, "prompt_mask": torch.bool, "bias": torch.float32}[name]
            t = torch.zeros((self.capacity, self.vocab_size), dtype=dtype, device=self.device)
            setattr(self, name, t)
        return t

    def _grow(self) -> None:
        old = self.capacity
        self.capacity = 2 * old
        for name in ("counts", "prompt_mask", "bias"):
            t = getattr(self, name)
            if t is not None:
                bigger = torch.zeros((self.capacity, self.vocab_size), dtype=t.dtype, device=self.device)
                bigger[:old].copy_(t)
                setattr(self, name, bigger)
        self._free.extend(range(self.capacity - 1, old - 1, -1))

    # -- a step ----------------------------------------------------------------------------------

    def adjustment(
        self, specs: list[SamplingSpec], seq_ids: list[str], num_out: list[int], to_device: ToDevice
    ) -> LogitsAdjustment | None:
        """The adjustments for a batch whose row i samples for `seq_ids[i]`, which has `num_out[i]`
        output tokens before this sample; None when no row needs any."""
        adj = LogitsAdjustment()
        rows, slots = [], []
        for i, sid in enumerate(seq_ids):
            slot = self._slot.get(sid)
            if slot is not None:
                rows.append(i)
                slots.append(slot)
        if rows:
            adj.rows = to_device(np.asarray(rows, dtype=np.int64))
            adj.slots = to_device(np.asarray(slots, dtype=np.int64))
            held = [specs[i] for i in rows]
            adj.biased = self.bias is not None and any(s.biased for s in held)
            pen = [k for k, s in enumerate(held) if s.penalized]
            if pen:

                def column(values: list[float]) -> torch.Tensor:
                    return to_device(np.asarray(values, dtype=np.float32).reshape(-1, 1))

                adj.presence = column([s.presence_penalty for s in held])
                adj.frequency = column([s.frequency_penalty for s in held])
                adj.repetition = column([s.repetition_penalty for s in held])
                adj.record_rows = to_device(np.asarray([rows[k] for k in pen], dtype=np.int64))
                adj.record_slots = to_device(np.asarray([slots[k] for k in pen], dtype=np.int64))
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, (spec, out) in enumerate(zip(specs, num_out)):
            if out < spec.min_tokens and spec.min_tokens_stop_ids:
                ban_rows.extend([i] * len(spec.min_tokens_stop_ids))
                ban_ids.extend(spec.min_tokens_stop_ids)
        if ban_rows:
            adj.ban_rows = to_device(np.asarray(ban_rows, dtype=np.int64))
            adj.ban_ids = to_device(np.asarray(ban_ids, dtype=np.int64))
        if any(s.min_p > 0 and s.temperature > 0 for s in specs):
            adj.min_p = to_device(np.asarray([s.min_p for s in specs], dtype=np.float32))
        if adj.rows is None and adj.ban_rows is None and adj.min_p is None:
            return None
        return adj

    def apply(self, logits: torch.Tensor, adj: LogitsAdjustment) -> torch.Tensor:
        """The adjusted logits (a new tensor: `logits` stays the model's, for logprobs)."""
        return self.apply_(logits.clone(), adj)

    def apply_(self, out: torch.Tensor, adj: LogitsAdjustment) -> torch.Tensor:
        """Adjust `out` in place."""
        if adj.rows is not None and adj.slots is not None and (adj.biased or adj.presence is not None):
            sub = out.index_select(0, adj.rows)
            if adj.biased:
                assert self.bias is not None
                sub += self.bias.index_select(0, adj.slots)
            if adj.presence is not None:
                sub = self._penalize(sub, adj)
            out.index_copy_(0, adj.rows, sub)
        if adj.ban_rows is not None:
            # the value is made on the device: a tensor from the host would wait for the queued kernels
            out.index_put_((adj.ban_rows, adj.ban_ids), torch.full((), float("-inf"), device=out.device))
        return out

    def _penalize(self, sub: torch.Tensor, adj: LogitsAdjustment) -> torch.Tensor:
        assert self.counts is not None and adj.slots is not None
        assert adj.frequency is not None and adj.repetition is not None and adj.presence is not None
        counts = self.counts.index_select(0, adj.slots)
        produced = counts > 0
        seen = produced
        if self.prompt_mask is not None:
            seen = produced | self.prompt_mask.index_select(0, adj.slots)
        # vLLM's repetition penalty: positive logits of seen tokens divided by it, negative ones multiplied.
        rep = torch.where(seen, adj.repetition, torch.ones_like(adj.repetition))
        sub = torch.where(sub > 0, sub / rep, sub * rep)
        return sub - adj.frequency * counts - adj.presence * produced

    def record(self, tokens: torch.Tensor, adj: LogitsAdjustment | None) -> None:
        """Count this step's samples into the penalized rows (on the device, nothing read)."""
        if adj is None or adj.record_rows is None or self.counts is None:
            return
        sampled = tokens.index_select(0, adj.record_rows)
        one = torch.ones_like(sampled, dtype=torch.int32)
        self.counts.index_put_((adj.record_slots, sampled), one, accumulate=True)


def apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability (after temperature) is under min_p times the most likely one's."""
    probs = torch.softmax(scaled, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return scaled.masked_fill(probs < threshold, float("-inf"))
