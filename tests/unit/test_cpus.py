"""CPU lists, and binding a process with every thread it has to some CPUs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from app.core.config import Settings
from app.core.cpus import format_cpus, parse_cpus


def test_cpu_lists_read_and_write_as_linux_writes_them():
    assert parse_cpus("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cpus("5") == {5}
    assert format_cpus([6, 0, 1, 2, 3]) == "0-3,6"
    assert format_cpus([1, 3]) == "1,3"
    assert parse_cpus(format_cpus([0, 2, 3, 4, 9])) == {0, 2, 3, 4, 9}


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "0,,1", "-1"])
def test_a_malformed_cpu_list_is_refused_when_the_settings_are_read(text: str):
    with pytest.raises(ValueError):
        parse_cpus(text)
    if text:  # empty is the setting's "wherever the OS puts it"
        with pytest.raises(ValueError, match="CPU list"):
            Settings(cpus=text)


BOUND = """
import os, threading
from app.core.cpus import bind, parse_cpus
started = threading.Event()
before = threading.Thread(target=started.wait)  # a thread that exists before the binding
before.start()
bind(parse_cpus(os.environ["CPUS"]))
after = {}
later = threading.Thread(target=lambda: after.update(cpus=os.sched_getaffinity(0)))
later.start(); later.join()
with open(f"/proc/self/task/{before.native_id}/status") as status:
    line = next(l for l in status if l.startswith("Cpus_allowed_list"))
started.set(); before.join()
print(sorted(os.sched_getaffinity(0)), line.split()[1], sorted(after["cpus"]))
"""


def test_binding_moves_every_thread_of_the_process_and_the_ones_it_starts_later():
    first = min(os.sched_getaffinity(0))
    out = subprocess.run(
        [sys.executable, "-c", BOUND], env={**os.environ, "CPUS": str(first)}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"[{first}]", str(first), f"[{first}]"]


def test_binding_to_a_cpu_this_process_may_not_use_is_refused():
    outside = max(os.sched_getaffinity(0)) + 1
    code = f"from app.core.cpus import bind; bind([{outside}])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert f"cannot run on CPUs {outside}" in out.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_process_started_on_one_cpu_can_move_to_another():
    """A stage worker inherits the CPUs `conveyor up` keeps for itself and moves to its own."""
    first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
    out = subprocess.run(
        [sys.executable, "-c", BOUND],
        env={**os.environ, "CPUS": str(first)},
        capture_output=True,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {last}),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"[{first}]", str(first), f"[{first}]"]
