"""Fair share across tenants within a priority class: start-time fair queueing (SFQ) over tenants.

Without it a class is served in arrival order, so a tenant that queues 128 jobs ahead of another's
8 takes the pipeline until its backlog is gone. With it, tenants that are both waiting take turns,
each in proportion to its weight (`Settings.tenant.weights`, 1 by default), whatever their backlogs:

- every tenant has a virtual time, `share[tenant]`: the work dispatched for it (a job's cost is its
  prompt plus its max_tokens, the tokens its pipeline may hold for it), divided by its weight;
- a waiting job's tag is its tenant's virtual time plus the cost of the tenant's jobs queued before
  it (Goyal et al., SIGCOMM'96): within a class, `windows.plan` takes jobs in tag order, then arrival;
- a tenant that had nothing waiting re-enters at the smallest virtual time among the tenants that
  are waiting (`settle`): idle time banks no credit, so a returning tenant cannot take the pipeline
  back for as long as it was away;
- a tenant alone gets every seat (nothing is reserved for tenants with no work: the order changes,
  never the amount dispatched).

Pure: the batcher keeps `share` between rounds, calls `settle` before `windows.plan` and `charge`
after each dispatched batch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

Share = Mapping[str, float]  # tenant -> virtual time (weighted cost dispatched)


class Queued(Protocol):
    """What fair share reads of a waiting job (windows.Item)."""

    @property
    def tenant(self) -> str: ...

    @property
    def cost(self) -> int: ...

    @property
    def arrived(self) -> float: ...


def weight(weights: Mapping[str, float], tenant: str) -> float:
    return max(weights.get(tenant, 1.0), 1e-9)


def settle(share: Share, waiting: Collection[str]) -> dict[str, float]:
    """The virtual times for a round in which `waiting` tenants have jobs queued: one that was not
    waiting (new, or back from idle) starts at the smallest time among those that were, and the
    times are shifted so the smallest is 0 (they stay small); a tenant neither waiting nor ahead of
    that smallest time is forgotten."""
    known = [share[t] for t in waiting if t in share]
    floor = min(known) if known else 0.0
    settled = {t: max(share.get(t, floor), floor) - floor for t in waiting}
    for tenant, time in share.items():
        if tenant not in settled and time > floor:  # ahead of the rest: it keeps its debt
            settled[tenant] = time - floor
    return settled


def tags(
    items: Sequence[Queued], share: Share, weights: Mapping[str, float], *, order: Callable[[Any], Any]
) -> dict[int, float]:
    """id(item) -> its start tag. `order` is the key that ranks one tenant's own jobs (class, then
    arrival): each tag is the tenant's time plus the weighted cost of its jobs ranked before it."""
    by_tenant: dict[str, list[Queued]] = defaultdict(list)
    for it in items:
        by_tenant[it.tenant].append(it)
    out: dict[int, float] = {}
    for tenant, queued in by_tenant.items():
        queued.sort(key=order)
        time, w = share.get(tenant, 0.0), weight(weights, tenant)
        for it in queued:
            out[id(it)] = time
            time += it.cost / w
    return out


def charge(share: Share, dispatched: Iterable[Queued], weights: Mapping[str, float]) -> dict[str, float]:
    """The virtual times after `dispatched` jobs went out."""
    charged = dict(share)
    for it in dispatched:
        charged[it.tenant] = charged.get(it.tenant, 0.0) + it.cost / weight(weights, it.tenant)
    return charged
