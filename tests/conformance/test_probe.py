"""The effect probes: inert outside a check; inside one, kept durably, deduped by key."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select

from toolledger import testing
from toolledger.store.check_effects import check_effects
from toolledger.testing import probe
from toolledger.testing.world import World


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> World:
    """This process reporting to a run's world, as a check's worker does."""
    monkeypatch.setattr(probe, "_world", None)
    created = World(tmp_path / "world.sqlite3").create()
    probe.bind(created.path)  # undone by monkeypatch
    return created


def test_probes_outside_a_check__do_nothing_and_refuse_to_answer() -> None:
    assert testing.effect("charge", key="k") is True
    assert testing.effect_in(object()) is None  # a sync connection's: done, nothing written
    with pytest.raises(RuntimeError, match="only for a conformance check"):
        testing.seen("charge", key="k")


def test_effect_in__without_ctx_db__says_only_transactional_tools_have_one() -> None:
    with pytest.raises(TypeError, match="only transactional tools get one"):
        testing.effect_in(None)


def test_effect__keyed_repeat_is_dropped_as_a_deduping_downstream_would(world: World) -> None:
    assert testing.effect("charge", key="key-1") is True
    assert testing.effect("charge", key="key-1") is False
    assert testing.effect("charge", key="key-2") is True
    assert testing.effect("mail") is True
    assert testing.effect("mail") is True  # no key: every report is an effect

    assert world.effects() == Counter(charge=2, mail=2)
    assert testing.seen("charge", key="key-1")
    assert not testing.seen("charge", key="key-3")
    assert not testing.seen("mail", key="key-1")


def test_effect_in__commits_or_rolls_back_with_the_connection_s_transaction(
    world: World, tmp_path: Path
) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    check_effects.metadata.create_all(engine)
    try:
        with engine.connect() as connection:
            with connection.begin() as transaction:
                testing.effect_in(connection, "refund")
                transaction.rollback()
            with connection.begin():
                testing.effect_in(connection, "refund")
            rows = connection.execute(select(func.count()).select_from(check_effects)).scalar_one()
    finally:
        engine.dispose()

    assert rows == 1
    assert world.effects() == Counter(), "not in the outside world: in the ledger's transaction"
