"""The transition catalogue is the one state machine: the README's diagram draws exactly its
edges, the state table is derived from it, and the SQL of each entry writes what it declares."""

from __future__ import annotations

import re

import pytest

from tests.support.paths import ROOT
from toolledger.domain.states import (
    ALLOWED_TRANSITIONS,
    FINAL_STATUSES,
    TRANSITIONS,
    CallStatus,
    Fencing,
    Transition,
    sources_of,
)
from toolledger.store.transitions import WRITES, changes, fenced

README = ROOT / "README.md"
START = "[*]"
_EDGE = re.compile(r"^\s*(\[\*\]|\w+)\s*-->\s*(\[\*\]|\w+)\s*(?::.*)?$")


def diagram_edges() -> set[tuple[str, str]]:
    """The edges of the README's ``stateDiagram-v2`` block."""
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```mermaid\n(stateDiagram-v2\n.*?)```", text, flags=re.DOTALL)
    assert len(blocks) == 1, "the README has one state diagram"
    edges = set()
    for line in blocks[0].splitlines()[1:]:
        if not line.strip():
            continue
        match = _EDGE.match(line)
        assert match is not None, f"not an edge: {line!r}"
        edges.add((match.group(1), match.group(2)))
    return edges


def test_every_edge_of_the_readme_diagram_is_a_transition_of_the_catalogue_and_back() -> None:
    drawn = {(a, b) for a, b in diagram_edges() if START not in (a, b)}
    declared = {(source.value, t.target.value) for t in TRANSITIONS for source in t.sources}

    assert drawn == declared


def test_the_diagram_starts_where_calls_are_created_and_ends_where_no_transition_leaves() -> None:
    edges = diagram_edges()
    created = {b for a, b in edges if a == START}
    ended = {a for a, b in edges if b == START}

    assert created == {t.target.value for t in TRANSITIONS if not t.sources}
    assert ended == {s.value for s in FINAL_STATUSES} == {"submitted", "abandoned"}


def test_the_state_table_is_the_catalogue() -> None:
    for status in CallStatus:
        assert ALLOWED_TRANSITIONS[status] == {t.target for t in TRANSITIONS if status in t.sources}
    assert set(sources_of(CallStatus.RUNNING)) == {CallStatus.PENDING, CallStatus.UNKNOWN}
    assert set(sources_of(CallStatus.ABANDONED)) == set(CallStatus) - FINAL_STATUSES


def test_each_transition_is_declared_once() -> None:
    identities = [(t.name, t.target) for t in TRANSITIONS]

    assert len(identities) == len(set(identities))


@pytest.mark.parametrize("transition", TRANSITIONS, ids=lambda t: f"{t.name}-{t.target}")
def test_each_transition_writes_the_columns_it_declares(transition: Transition) -> None:
    assert set(WRITES[transition.name]) == transition.writes
    assert set(changes(transition)) == {"status", "updated_at", *transition.writes}
    assert changes(transition)["status"] == transition.target.value


def test_a_worker_storing_its_outcome_or_its_doubt_is_fenced_by_its_lease_token() -> None:
    fenced_names = {t.name for t in TRANSITIONS if t.fencing is Fencing.LEASE_TOKEN}

    assert fenced_names == {"complete", "complete_late", "mark_unknown"}
    for transition in TRANSITIONS:
        if transition.fencing is Fencing.LEASE_TOKEN:
            assert len(fenced(transition)) == 1
        elif transition.fencing is Fencing.NONE:
            assert fenced(transition) == ()
