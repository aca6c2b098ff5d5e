"""A conformance kit for an application's tools: does each behave as its effect class says?

    from toolledger import testing

    report = testing.check_tools("myapp.tools:registry", examples={"charge": {"cents": 500}})
    testing.assert_conforms("myapp.tools:registry")     # in a test: raises with the findings

Each tool is called through a throwaway ledger and the emulator, its worker SIGKILLed at the
named crash points and recovered by a fresh process; what its side effects did (reported by
the tool's own code with ``testing.effect``) is held against the declared effect class.
``toolledger check --tools myapp.tools:registry`` is the same on the command line.
See docs/conformance.md.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

# Imported on first use: a tools module importing the probes (effect, seen) does not pay for
# the check's machinery, nor the check for the runtime (its worker processes import that).
_EXPORTS = {
    "CRASH_POINTS": "toolledger.testing.verdicts",
    "NO_CRASH": "toolledger.testing.verdicts",
    "CheckError": "toolledger.testing.workers",
    "PointResult": "toolledger.testing.verdicts",
    "Report": "toolledger.testing.report",
    "Status": "toolledger.testing.verdicts",
    "assert_conforms": "toolledger.testing.check",
    "check_tools": "toolledger.testing.check",
    "checking": "toolledger.testing.probe",
    "effect": "toolledger.testing.probe",
    "effect_in": "toolledger.testing.probe",
    "reference_of": "toolledger.testing.check",
    "seen": "toolledger.testing.probe",
}

if TYPE_CHECKING:
    from toolledger.testing.check import assert_conforms, check_tools, reference_of
    from toolledger.testing.probe import checking, effect, effect_in, seen
    from toolledger.testing.report import Report
    from toolledger.testing.verdicts import CRASH_POINTS, NO_CRASH, PointResult, Status
    from toolledger.testing.workers import CheckError


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'toolledger.testing' has no attribute {name!r}")


__all__ = [
    "CRASH_POINTS",
    "NO_CRASH",
    "CheckError",
    "PointResult",
    "Report",
    "Status",
    "assert_conforms",
    "check_tools",
    "checking",
    "effect",
    "effect_in",
    "reference_of",
    "seen",
]
