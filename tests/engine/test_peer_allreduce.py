"""The symmetric-memory all-reduce's choices that hold without GPUs (engine/parallel/peer_allreduce.py): the mode
variable is checked, small sums take the peer path and large ones NCCL's, and the ranks agree on using it or not.
The sum itself runs on GPUs (tests/kernels/test_tensor_parallel_gpu.py: float32 tokens equal one GPU's)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.config import ConfigError
from engine.parallel.group import TPGroup
from engine.parallel.peer_allreduce import MODES, PeerAllReduce, _all_ranks, checked_mode, mode_from_env, set_up_for


def test_the_mode_variable_is_checked(monkeypatch):
    monkeypatch.delenv("PAGEKEEPER_TP_ALLREDUCE", raising=False)
    assert mode_from_env() == "auto"
    for mode in MODES:
        monkeypatch.setenv("PAGEKEEPER_TP_ALLREDUCE", mode)
        assert mode_from_env() == mode
    monkeypatch.setenv("PAGEKEEPER_TP_ALLREDUCE", "fast")
    with pytest.raises(ConfigError, match="PAGEKEEPER_TP_ALLREDUCE='fast': expected one of auto, nccl, require"):
        checked_mode(torch.device("cuda", 0))
    monkeypatch.setenv("PAGEKEEPER_TP_ALLREDUCE", "require")
    with pytest.raises(ConfigError, match="require needs CUDA GPUs"):
        checked_mode(torch.device("cpu"))
    assert checked_mode(torch.device("cuda", 0)) == "require"


def test_the_cpu_and_nccl_mode_never_set_it_up():
    assert set_up_for(None, torch.device("cpu"), "auto") == (None, None)
    assert set_up_for(None, torch.device("cuda", 0), "nccl") == (None, None)  # returns before touching the GPU


class _Recording(PeerAllReduce):
    """The real size rule over a plain buffer; the sum (a GPU kernel) replaced by a record of what it was asked."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(torch.empty(max_bytes, dtype=torch.uint8), "test", max_bytes)
        self.summed: list[int] = []

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        self.summed.append(x.numel())
        return x


@pytest.fixture
def one_rank_group():
    """A gloo group of one process: NCCL's place in TPGroup.all_reduce, an identity sum."""
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "store"), 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_sums_that_fit_the_buffer_take_the_peer_path_and_the_rest_the_collective(one_rank_group):
    peer = _Recording(max_bytes=4096)
    group = TPGroup(0, 2, None, 0, peer)
    small = torch.ones(1024)  # 4,096 bytes: fits
    assert group.all_reduce(small) is small and peer.summed == [1024]
    large = torch.ones(1025)  # one float over
    assert group.all_reduce(large) is large and peer.summed == [1024]
    strided = torch.ones(64, 2)[:, 0]  # not contiguous: the collective
    group.all_reduce(strided)
    timings = torch.ones(8, dtype=torch.float64)  # a dtype the kernel does not sum (the ranks' start-up timings)
    group.all_reduce(timings)
    assert peer.summed == [1024]
    group.all_reduce(torch.ones(8, dtype=torch.bfloat16))
    assert peer.summed == [1024, 8]
    assert group.start_all_reduce(torch.ones(8)).wait().tolist() == [1.0] * 8  # asynchronous: always the collective
    assert peer.summed == [1024, 8]
    assert TPGroup(0, 2, None, 0, peer) == TPGroup(0, 2, None, 0, None)  # the path is not part of the group's identity


def _agree(rank: int, store: str, cases: list[list[bool]], out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        results = [_all_ranks(oks[rank], None, torch.device("cpu")) for oks in cases]
        with open(f"{out}.{rank}", "w") as f:
            f.write(" ".join(map(str, results)))
    finally:
        dist.destroy_process_group()


def test_the_ranks_use_it_only_if_every_rank_set_it_up():
    cases = [[True, True], [True, False], [False, True], [False, False]]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out")
        # fork: nothing to import again in the children, and this process has no group of its own at this point
        mp.start_processes(_agree, args=(os.path.join(d, "store"), cases, out), nprocs=2, start_method="fork")
        assert [open(f"{out}.{r}").read() for r in range(2)] == ["True False False False"] * 2


def test_a_process_sets_it_up_once_and_later_groups_sum_through_nccl(monkeypatch):
    """A second symmetric-memory set-up in one process (a TP=4 engine made after a TP=2 one) hung on GPUs: the
    ranks agree before the rendezvous, and a process that did it once sums its later groups through NCCL."""
    from engine.parallel import peer_allreduce

    monkeypatch.setattr(peer_allreduce, "_SET_UP_IN_PROCESS", False)
    agreed: list[bool] = []
    monkeypatch.setattr(peer_allreduce, "_all_ranks", lambda ok, group, device: agreed.append(ok) or ok)
    made: list[_Recording] = []

    def set_up(group, device, max_bytes=peer_allreduce.MAX_BYTES):
        made.append(_Recording(64))
        made[-1].check = lambda group, device: None  # the GPU sum, here a stand-in that agrees
        return made[-1]

    monkeypatch.setattr(PeerAllReduce, "set_up", staticmethod(set_up))
    cuda = torch.device("cuda", 0)
    peer, why = set_up_for(None, cuda, "auto")
    assert peer is made[0] and why is None and peer_allreduce.set_up_in_process()
    assert agreed == [True, True, True]  # willing, set up, checked
    peer, why = set_up_for(None, cuda, "auto")
    assert peer is None and "already set up once in this process" in why and len(made) == 1
    assert agreed[3:] == [False]  # the ranks agreed not to start the rendezvous
    with pytest.raises(RuntimeError, match="require: symmetric memory was already set up once"):
        set_up_for(None, cuda, "require")


def test_a_misspelt_mode_stops_a_tensor_parallel_server_with_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    from tests.server.harness import REPO, free_port

    env = {**os.environ, "PAGEKEEPER_TP_ALLREDUCE": "fast", "PAGEKEEPER_CACHE_DIR": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "engine.server", "--tensor-parallel-size", "2", "--device", "cpu"]
        + ["--port", str(free_port())],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    line = "error: PAGEKEEPER_TP_ALLREDUCE='fast': expected one of auto, nccl, require"
    assert r.stderr.strip().splitlines()[-1] == line  # before any rank is spawned
