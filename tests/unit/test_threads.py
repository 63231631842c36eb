"""The stage worker's torch thread count: its share, widened while the host's other CPUs idle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.workers import threads as threads_module
from app.workers.compute import ComputeThread
from app.workers.threads import Threads, busy_s, quota_cores


class Host:
    """A host's clocks, moved by hand: wall time, this process's CPU time, every CPU's busy time."""

    def __init__(self) -> None:
        self.now = self.own = self.busy = 0.0

    def threads(self, share: int = 1, cpus: int = 2) -> Threads:
        return Threads(
            share, range(cpus), clock=lambda: self.now, cpu_time=lambda: self.own, host_busy=lambda: self.busy
        )

    def step(self, threads: Threads, wall: float, ours: float, others: float) -> None:
        """A step of `wall` s: this process on `ours` cores, the other processes on `others`."""
        self.now += wall
        self.own += ours * wall
        self.busy += (ours + others) * wall
        threads.ran(wall, ours * wall)


@pytest.fixture(autouse=True)
def no_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads_module, "quota_cores", lambda: None)


def test_a_worker_on_its_share_widens_while_the_other_cores_idle() -> None:
    host = Host()
    threads = host.threads()
    assert threads.count == 1
    for _ in range(7):  # 7/8 s: not a whole window yet
        host.step(threads, 0.125, ours=1.0, others=0.5)  # e.g. another stage, busy half the time
    assert threads.count == 1
    host.step(threads, 0.125, ours=1.0, others=0.5)
    assert threads.count == 2


def test_a_worker_stays_on_its_share_while_another_process_is_busy() -> None:
    host = Host()
    threads = host.threads()
    for _ in range(50):
        host.step(threads, 0.1, ours=1.0, others=0.7)
    assert threads.count == 1 and threads.changes == 0


def test_the_idle_time_between_steps_counts_as_the_other_cores_idle_too() -> None:
    host = Host()
    threads = host.threads()
    host.now += 2.0  # no step for 2 s, nothing else running
    host.step(threads, 0.05, ours=1.0, others=0.0)
    assert threads.count == 2


def test_a_wide_team_that_waits_for_a_core_goes_back_to_its_share() -> None:
    host = Host()
    threads = host.threads()
    for _ in range(8):
        host.step(threads, 0.125, ours=1.0, others=0.0)
    assert threads.count == 2
    for _ in range(8):  # both threads run: it stays wide
        host.step(threads, 0.125, ours=1.95, others=0.0)
    assert threads.count == 2
    for _ in range(3):  # a busy process on the other core: the team ran on 1.3 cores
        host.step(threads, 0.125, ours=1.3, others=0.7)
    assert threads.count == 2  # under half a second of steps
    host.step(threads, 0.125, ours=1.3, others=0.7)
    assert threads.count == 1 and threads.changes == 2
    for _ in range(30):  # the busy process goes on: the worker keeps its share
        host.step(threads, 0.1, ours=1.0, others=1.0)
    assert threads.count == 1


def test_a_count_that_is_set_never_moves() -> None:
    host = Host()
    threads = Threads(
        1, range(2), fixed=True, clock=lambda: host.now, cpu_time=lambda: host.own, host_busy=lambda: 0.0
    )
    for _ in range(30):
        host.step(threads, 0.1, ours=1.0, others=0.0)
    assert threads.count == 1 and threads.describe() == "1"
    assert host.threads(share=4, cpus=4).describe() == "4"  # a share of every CPU has nothing to widen to
    assert host.threads(share=1, cpus=4).describe() == "1-4"


def test_a_cgroup_quota_bounds_the_widest_count(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert quota_cores(tmp_path / "cpu.max") == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert quota_cores(tmp_path / "cpu.max") is None
    assert quota_cores(tmp_path / "absent") is None
    monkeypatch.setattr(threads_module, "quota_cores", lambda: 2)
    assert Host().threads(share=1, cpus=8).most == 2


def test_busy_time_is_read_for_the_workers_cpus_only(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  300 0 30 900 10 0 0 0 0 0\n"
        "cpu0 100 0 10 300 5 0 0 0 0 0\n"
        "cpu1 200 0 20 600 5 1 2 3 0 0\n"
        "cpu10 1000 0 0 0 0 0 0 0 0 0\n"
        "intr 12345\n"
    )
    ticks = threads_module.os.sysconf("SC_CLK_TCK")
    assert busy_s([1], stat) == pytest.approx((200 + 20 + 1 + 2 + 3) / ticks)
    assert busy_s([0, 1], stat) == pytest.approx((110 + 226) / ticks)


def test_the_compute_thread_runs_each_item_on_the_count_it_is_given() -> None:
    host = Host()
    threads = host.threads(share=1, cpus=2)
    compute = ComputeThread(threads=threads)
    compute.start()
    before = torch.get_num_threads()
    try:
        assert compute.call(torch.get_num_threads) == 1
        threads.count = 2
        assert compute.call(torch.get_num_threads) == 2
    finally:
        compute.stop()
    assert torch.get_num_threads() == before  # the caller's own thread count is its own
