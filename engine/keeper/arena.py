"""A model's weights in one allocation per device, described so that another process can map them.

The keeper (engine/keeper/server.py) builds the model on the meta device, places every parameter and buffer in
one byte arena (`materialize`), and loads the checkpoint into it.  `export` then describes each tensor as a view
of a shared storage (name, storage index, byte offset, shape, stride, dtype), and `share` turns the storages into
handles another process can open: CUDA IPC handles on a GPU (torch.multiprocessing's own reduction, the same one
its queues use), file descriptors of shared memory on the CPU.  One allocation per device keeps that to one IPC
handle (one `cudaIpcOpenMemHandle` in the engine) however many tensors the model has.  Tensors a loader hook
replaced after `materialize` (a layer that quantizes at load) live in storages of their own; they are exported
as further storages, not copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ALIGN = 256  # bytes: every tensor starts at a multiple (cuBLAS and the Triton kernels like 16; 256 is free)


@dataclass(frozen=True)
class TensorView:
    """One parameter or buffer as a view of shared storage `storage`."""

    name: str
    is_param: bool
    storage: int
    byte_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def unique_tensors(model: nn.Module) -> list[tuple[str, bool, torch.Tensor]]:
    """(canonical name, is a parameter, tensor) for every parameter and buffer, each tensor once (a tied
    weight is named where `named_parameters` first meets it)."""
    out: list[tuple[str, bool, torch.Tensor]] = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, True, p))
    for name, b in model.named_buffers():
        if id(b) not in seen:
            seen.add(id(b))
            out.append((name, False, b))
    return out


def _slots(model: nn.Module) -> list[tuple[nn.Module, str, bool, int]]:
    """(owner module, attribute, is a parameter, id of the tensor) for every place a tensor is held, tied ones
    included: replacing a tied weight must replace it in every module that holds it."""
    slots = []
    for module in model.modules():
        for leaf, p in module._parameters.items():
            if p is not None:
                slots.append((module, leaf, True, id(p)))
        for leaf, b in module._buffers.items():
            if b is not None:
                slots.append((module, leaf, False, id(b)))
    return slots


def replace_tensors(model: nn.Module, new_by_id: dict[int, torch.Tensor]) -> None:
    """Put `new_by_id[id(old)]` wherever the model holds `old` (parameters stay parameters, without grad)."""
    params: dict[int, nn.Parameter] = {}  # one Parameter per tensor: a tied weight stays tied
    for module, leaf, is_param, key in _slots(model):
        new = new_by_id.get(key)
        if new is None:
            continue
        if is_param:
            if key not in params:
                params[key] = nn.Parameter(new, requires_grad=False)
            module._parameters[leaf] = params[key]
        else:
            module._buffers[leaf] = new


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def materialize(model: nn.Module, device: torch.device, shared_cpu: bool = False) -> torch.Tensor:
    """Give a meta-device model real tensors, all views of one uint8 arena on `device`, which it returns.
    `shared_cpu`: on the CPU, put the arena in shared memory first (so it can be handed to another process)."""
    tensors = unique_tensors(model)
    offsets, total = [], 0
    for _, _, t in tensors:
        offsets.append(total)
        total += _aligned(t.numel() * t.element_size())
    arena = torch.empty(max(total, ALIGN), dtype=torch.uint8, device=device)
    if shared_cpu and device.type == "cpu":
        arena.share_memory_()
    new_by_id = {}
    for (_, _, t), off in zip(tensors, offsets):
        nbytes = t.numel() * t.element_size()
        new_by_id[id(t)] = arena[off : off + nbytes].view(t.dtype).view(t.shape)
    replace_tensors(model, new_by_id)
    return arena


def export(model: nn.Module, arena: torch.Tensor) -> tuple[list[TensorView], list[torch.Tensor]]:
    """Describe every tensor of a loaded model as a view of shared storages: the arena first, then the storage of
    any tensor that lives elsewhere (a loader hook made it).  Returns (views, storages as uint8 tensors)."""
    storages = [arena]
    by_ptr = {arena.untyped_storage().data_ptr(): 0}
    views = []
    for name, is_param, t in unique_tensors(model):
        storage = t.untyped_storage()
        index = by_ptr.get(storage.data_ptr())
        if index is None:
            if t.device.type == "cpu" and not t.is_shared():
                t.share_memory_()
                storage = t.untyped_storage()
            index = by_ptr[storage.data_ptr()] = len(storages)
            storages.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
        views.append(
            TensorView(
                name,
                is_param,
                index,
                int(t.storage_offset()) * t.element_size(),
                tuple(t.shape),
                tuple(t.stride()),
                t.dtype,
            )
        )
    return views, storages


def view_of(storage: torch.Tensor, v: TensorView) -> torch.Tensor:
    """The tensor `v` describes, over an opened storage (a uint8 tensor)."""
    elem = torch.empty((), dtype=v.dtype).element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(v.shape, v.stride)) if all(n > 0 for n in v.shape) else 0
    raw = storage[v.byte_offset : v.byte_offset + span * elem]
    if raw.numel() != span * elem:
        raise ValueError(f"{v.name}: {span * elem} bytes at {v.byte_offset} lie past its storage's end")
    return raw.view(v.dtype).as_strided(v.shape, v.stride)


# -- handles another process can open -------------------------------------------------------------------------


def share(storages: list[torch.Tensor]) -> tuple[list[Any], list[int]]:
    """(picklable handles, file descriptors to pass with them): CUDA IPC arguments on a GPU, shared-memory fds
    (the i-th handle names fd i) on the CPU."""
    handles: list[Any] = []
    fds: list[int] = []
    for s in storages:
        if s.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            _rebuild, args = reduce_tensor(s)
            handles.append(("cuda", args))
        else:
            fd, size = s.untyped_storage()._share_fd_cpu_()
            handles.append(("cpu", len(fds), size, s.numel()))
            fds.append(fd)
    return handles, fds


def open_shared(handles: list[Any], fds: list[int]) -> list[torch.Tensor]:
    """The storages `share` described, opened in this process (uint8 tensors)."""
    opened = []
    for h in handles:
        if h[0] == "cuda":
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            opened.append(rebuild_cuda_tensor(*h[1]))
        else:
            _, index, size, numel = h
            storage = torch.UntypedStorage._new_shared_fd_cpu(fds[index], size)  # type: ignore[attr-defined]  # not in torch's stubs
            opened.append(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (numel,), (1,)))
    return opened
