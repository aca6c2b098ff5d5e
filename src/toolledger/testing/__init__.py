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

from toolledger.testing.check import Report, assert_conforms, check_tools, reference_of
from toolledger.testing.probe import effect, effect_in, seen
from toolledger.testing.verdicts import CRASH_POINTS, NO_CRASH, PointResult, Status
from toolledger.testing.workers import CheckError

__all__ = [
    "CRASH_POINTS",
    "NO_CRASH",
    "CheckError",
    "PointResult",
    "Report",
    "Status",
    "assert_conforms",
    "check_tools",
    "effect",
    "effect_in",
    "reference_of",
    "seen",
]
