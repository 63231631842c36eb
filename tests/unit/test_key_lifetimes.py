"""Every Redis key family is declared with how it stays bounded (`app/core/keys.py`), and a key's
name finds its family again (what the whole-stack audit in tests/conftest.py relies on)."""

from __future__ import annotations

import inspect

import pytest

from app.core.keys import Keys, Lifetime

NOT_KEYS = {"announce_pattern", "job_id_from_announce", "families", "lifetime_of"}
QUEUES = {"stage_queue", "callbacks_queue"}  # Celery's queues: kombu's names, not ours


def test_every_builder_declares_a_lifetime() -> None:
    builders = (
        {name for name, f in vars(Keys).items() if inspect.isfunction(f) and not name.startswith("_")}
        - NOT_KEYS
        - QUEUES
    )
    assert builders - set(Keys.families()) == set()


@pytest.mark.parametrize("family", sorted(Keys.families()))
def test_a_key_finds_its_own_family(family: str) -> None:
    keys = Keys("ns-1")
    builder = getattr(keys, family)
    arguments = ["tiny-model.v2", "0", "x"][: len(inspect.signature(builder).parameters)]
    assert keys.lifetime_of(builder(*arguments)) == (family, Keys.families()[family])


def test_a_key_no_builder_makes_is_unknown_and_a_lifetime_must_say_something() -> None:
    keys = Keys("ns")
    assert keys.lifetime_of("ns:something-new") is None
    assert keys.lifetime_of("other:job:1") is None  # another namespace's key is not ours
    with pytest.raises(ValueError, match="TTL, a cap or a stated bound"):
        Lifetime()
