"""Named crash points: inert unless a test arms them, then the process kills itself there.

Arm them with ``TOOLLEDGER_CRASH_AT=<point>[@<n>][,...]`` in the environment of a worker
process (the n-th time the point is reached, default the first). Each point is passed at
exactly one place, so a crash there means one precise moment of a call's life.

Recording a call and claiming it are one commit, so "after recording" and "after the claim
commit" are the same moment: ``after_claim_commit``.
"""

from __future__ import annotations

import os
import signal
import sys

CP_AFTER_CLAIM_COMMIT = "after_claim_commit"
"""The call is recorded and claimed (``running``); the handler has not started."""
CP_AFTER_HANDLER = "after_handler"
"""The handler returned; no result stored. A transactional tool's writes are not committed
(when it succeeded) or already rolled back (when it failed)."""
CP_AFTER_RESULT_COMMIT = "after_result_commit"
"""The result is stored (``succeeded``/``failed``); nothing was submitted."""
CP_AFTER_REQUEST_RECORD = "after_request_record"
"""The request a stored result goes out in (its Idempotency-Key; a batch's members) is
recorded; it has not been posted."""
CP_AFTER_SUBMIT_REFUSED = "after_submit_refused"
"""A request of stored results was not taken by the Agents API (refused, or failing past the
retries); the session has not been read to decide what became of its calls."""
CP_SUBMIT_ACCEPTED = "submit_accepted"
"""The Agents API answered a submission with 2xx (it applied it); the answer has not reached
the code that submitted."""
CP_AFTER_SUBMIT_RESPONSE = "after_submit_response"
"""The Agents API accepted the result; ``submitted`` is not yet written."""
CP_BATCH_SUBMIT_ACCEPTED = "batch_submit_accepted"
"""The Agents API answered a submission of several results (one session's batch) with 2xx;
the answer has not reached the code that submitted."""
CP_AFTER_BATCH_RESPONSE = "after_batch_response"
"""The Agents API accepted a batch of results; none of them is marked ``submitted`` yet."""
CP_AFTER_BATCH_RECORD = "after_batch_record"
"""Several delivered calls are recorded and claimed in one commit (a batch of the ledger's
writes); none of their handlers has started."""
CP_AFTER_BATCH_OUTCOMES = "after_batch_outcomes"
"""Several outcomes are stored in one commit (a batch of the ledger's writes); none of them
is submitted yet."""
CP_DURING_RECOVERY = "during_recovery"
"""Recovery has expired leases and is about to settle and submit."""
CP_DURING_RECONCILE = "during_reconcile"
"""The reconciler has read a session's open calls from the ledger; nothing is settled yet."""
CP_AFTER_APPROVAL = "after_approval"
"""An operator's approval is committed (the call ``pending``); nothing has claimed it yet."""
CP_INSIDE_HANDLER = "inside_handler"
"""Mid side effect: a tool has just reported one to ``toolledger.testing`` (its effect
probes pass this point, for the conformance check and for test tools); its handler has not
returned."""

ALL_POINTS = frozenset(
    {
        CP_AFTER_CLAIM_COMMIT,
        CP_AFTER_HANDLER,
        CP_AFTER_RESULT_COMMIT,
        CP_AFTER_REQUEST_RECORD,
        CP_AFTER_SUBMIT_REFUSED,
        CP_SUBMIT_ACCEPTED,
        CP_AFTER_SUBMIT_RESPONSE,
        CP_BATCH_SUBMIT_ACCEPTED,
        CP_AFTER_BATCH_RESPONSE,
        CP_AFTER_BATCH_RECORD,
        CP_AFTER_BATCH_OUTCOMES,
        CP_DURING_RECOVERY,
        CP_DURING_RECONCILE,
        CP_AFTER_APPROVAL,
        CP_INSIDE_HANDLER,
    }
)


def _parse(spec: str) -> dict[str, int]:
    armed: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, nth = item.partition("@")
        if name not in ALL_POINTS:
            raise ValueError(f"unknown crash point {name!r}; known: {', '.join(sorted(ALL_POINTS))}")
        armed[name] = int(nth) if nth else 1
    return armed


_armed = _parse(os.environ.get("TOOLLEDGER_CRASH_AT", ""))
_hits: dict[str, int] = {}


def armed() -> bool:
    return bool(_armed)


def arm(spec: str) -> None:
    """Arm crash points from now on, as ``TOOLLEDGER_CRASH_AT`` would have at start: for a
    process forked from one that imported this module unarmed (the conformance check's)."""
    parsed = _parse(spec)
    _armed.clear()
    _armed.update(parsed)
    _hits.clear()


def crash_point(name: str) -> None:
    if not _armed:
        return
    nth = _armed.get(name)
    if nth is None:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == nth:
        sys.stderr.write(f"toolledger: crash point {name} reached, killing pid {os.getpid()}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
