"""One owner for the job: `app/core/jobstore.py` (with its scripts, `app/core/jobscripts.py`) is the
only module of `app/` that writes a job's
record (`job:{id}`), its event stream (`job:{id}:events`), the `progress` set, the tenants' waiting
sets (kept in step with the status) or the batch record (`inflight:{model}`, `inflight_models`: the
batches out at a model's stages). Every other module calls its methods. This reads the source of
every other module and fails on:

- a Redis write command (hset, xadd, expire, delete, zadd, ...) on a job, event, progress or
  tenant-waiting key, built by `keys.job()` / `keys.events()` / `keys.progress()` /
  `keys.tenant_waiting()` / `keys.tenant_waiting_expiry()` / `keys.inflight()` /
  `keys.inflight_models()`, spelt as a `...:job:...` string, or
  held in a variable assigned from either;
- a script called with such a key (`script(keys=[keys.job(j)], ...)`);
- Lua text that writes a job's record or stream (a write command beside a record field name);
- a job script of the store (`*_LUA`, `*_FUNCTION`) imported, or registered, anywhere else.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from app.core.jobrecord import JobRecord

APP = Path(__file__).resolve().parents[2] / "app"
OWNER = "core/jobstore.py"
SCRIPTS = "core/jobscripts.py"  # the store's Lua, run by the store alone
BUILDERS = {
    "job",
    "events",
    "progress",
    "tenant_waiting",
    "tenant_waiting_expiry",
    "inflight",
    "inflight_models",
}
WRITES = {
    "hset", "hsetnx", "hmset", "hincrby", "hincrbyfloat", "hdel",
    "xadd", "xtrim", "xdel",
    "sadd", "srem", "smove", "spop",
    "zadd", "zrem", "zincrby", "zremrangebyscore", "zremrangebyrank", "zpopmin", "zpopmax",
    "set", "setex", "getdel", "getex", "delete", "unlink", "rename", "renamenx", "copy",
    "expire", "pexpire", "expireat", "pexpireat", "persist",
}  # fmt: skip
LUA_WRITE = re.compile(r"redis\.call\(\s*['\"](HSET|HSETNX|HMSET|HINCRBY|HINCRBYFLOAT|HDEL|XADD)['\"]", re.I)
# A record field (or the stream's `event` field) quoted in Lua: that script touches a job.
FIELDS = set(JobRecord.__dataclass_fields__) - {"other", "id"} | {"event"}
LUA_JOB_FIELD = re.compile(r"['\"](" + "|".join(sorted(FIELDS)) + r")['\"]")
SCRIPT_MODULES = {"app.core.jobstore", "app.core.jobscripts", "app.core.jobs"}


def _is_job_key(node: ast.AST, tainted: set[str]) -> bool:
    """Does this expression hold a job, event-stream or progress key?"""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in BUILDERS:
            if re.search(r"keys\b", ast.unparse(sub.func.value), re.I):
                return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and ":job:" in sub.value:
            return True
        if isinstance(sub, ast.Name) and sub.id in tainted:
            return True
    return False


def _tainted(tree: ast.AST) -> set[str]:
    """Names assigned a job key (directly or inside a list, dict, ...), to a fixed point."""
    names: set[str] = set()
    while True:
        before = len(names)
        for node in ast.walk(tree):
            value = getattr(node, "value", None)
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign) and value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if _is_job_key(value, names):
                    names |= {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)}
        if len(names) == before:
            return names


def job_writes(source: str) -> list[str]:
    """What in `source` (a module other than the store) writes a job; each as `line: code`."""
    tree = ast.parse(source)
    tainted = _tainted(tree)
    found: list[ast.AST] = []
    scripts: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in SCRIPT_MODULES:
            names = {a.asname or a.name for a in node.names if a.name.endswith(("_LUA", "_FUNCTION"))}
            scripts |= names
            if names:
                found.append(node)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Script":
            if any(isinstance(n, ast.Name) and n.id in scripts for a in node.args for n in ast.walk(a)):
                found.append(node)  # app/core/scripts.py's registration
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            args = [*node.args, *(k.value for k in node.keywords)]
            if node.func.attr in WRITES and any(_is_job_key(a, tainted) for a in args):
                found.append(node)
            elif any(k.arg == "keys" and _is_job_key(k.value, tainted) for k in node.keywords):
                found.append(node)
            elif node.func.attr == "register_script" and any(
                isinstance(n, ast.Name | ast.Attribute) and ast.unparse(n).split(".")[-1] in scripts
                for a in args
                for n in ast.walk(a)
            ):
                found.append(node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if LUA_WRITE.search(node.value) and LUA_JOB_FIELD.search(node.value):
                found.append(node)
    lines = source.splitlines()
    return sorted({f"{n.lineno}: {lines[n.lineno - 1].strip()}" for n in found if hasattr(n, "lineno")})


def test_only_the_job_store_writes_a_job() -> None:
    offenders = {}
    for path in sorted(APP.rglob("*.py")):
        relative = path.relative_to(APP).as_posix()
        if relative not in (OWNER, SCRIPTS) and (writes := job_writes(path.read_text())):
            offenders[relative] = writes
    assert offenders == {}, "write the job through app/core/jobstore.py"


def test_the_store_itself_is_what_the_scan_would_flag() -> None:
    """The scan sees the store's own writes: so it would see them anywhere else."""
    found = "\n".join(job_writes((APP / OWNER).read_text()) + job_writes((APP / SCRIPTS).read_text()))
    for call in ("_transition", "_end", "_step", "_recover", "_admit"):  # a script on a job's keys
        assert f"self.{call}(keys=keys" in found
    for write in (".zadd(", ".zrem(", ".hset(", ".hdel("):
        assert write in found
    # A TTL is a write too (the store sets its TTLs inside its scripts).
    assert job_writes("def f(r, keys, j):\n    r.expire(keys.job(j), 5)\n")
    assert "TRANSITION_FUNCTION =" in found  # and Lua text that writes a job's fields


@pytest.mark.parametrize(
    "source",
    [
        "redis.hset(keys.job(x), 'status', 'failed')",
        "await self.redis.hset(self.keys.job(job_id), mapping=record)",
        "pipe.xadd(self.keys.events(j), {'event': 'done'})",
        "self.jobs.redis.hset(self.jobs.keys.job(j), 'text', '')",
        "self.redis.zadd(self.keys.progress(), {j: 1.0})",
        "pipe.zrem(self.keys.tenant_waiting(), member)",
        "redis.delete(keys.tenant_waiting_expiry())",
        "redis.hset(self.keys.inflight(m), b, '[]')",
        "self.redis.hdel(self.keys.inflight(batch.model), batch_id)",
        "pipe.sadd(self.keys.inflight_models(), model)",
        "key = self.keys.job(j)\nself.redis.expire(key, 5)",
        "names = [self.keys.job(j)]\nredis.delete(*names)",
        "redis.delete(f'{ns}:job:{j}')",
        "self._script(keys=[self.keys.job(j), other], args=[])",
        "X = \"redis.call('HSET', KEYS[1], 'status', ARGV[1])\"",
        "X = \"redis.call('XADD', KEYS[2], '*', 'event', 'done', 'data', '{}')\"",
        "from app.core.jobstore import END_LUA\ns = redis.register_script(END_LUA)",
        "from app.core.jobscripts import STEP_LUA as X\ns = Script(redis, X)",
        "self._script(keys={'job': self.keys.job(j), 'other': k}, args={})",
    ],
)
def test_a_job_write_elsewhere_is_found(source: str) -> None:
    assert job_writes(source)


@pytest.mark.parametrize(
    "source",
    [
        "redis.hgetall(keys.job(x))",
        "pipe.hmget(self.keys.job(j), ['model'])",
        "redis.xrange(self.keys.events(j), '-', '+')",
        "redis.zrangebyscore(self.keys.progress(), '-inf', 1)",
        "redis.zadd(self.keys.workers(m, 0), {w: 1.0})",
        "X = \"redis.call('HSET', KEYS[1], 'state', 'open')\"",
        "s = redis.register_script(FORGET_LUA)",
        "s = Script(redis, RELEASE_IF_HELD)",
        "self._hold(keys={'lease': self.keys.webhook_lease()}, args={'holder': me})",
    ],
)
def test_reads_and_other_keys_are_not_job_writes(source: str) -> None:
    assert job_writes(source) == []
