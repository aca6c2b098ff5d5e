"""A conformance check's report: every tool's verdict at every point."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from toolledger.testing.verdicts import NO_CRASH, PointResult, Status


@dataclass
class Report:
    """Every tool's verdict at every point, in the registry's order and a call's."""

    results: list[PointResult]
    arguments: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The arguments each tool was called with."""
    seconds: float = 0.0
    allow_untested: bool = False
    """An untested tool (``untested``) does not fail the check."""

    @property
    def contradictions(self) -> list[PointResult]:
        return [r for r in self.results if r.status is Status.CONTRADICTION]

    @property
    def errors(self) -> list[PointResult]:
        return [r for r in self.results if r.status is Status.ERROR]

    @property
    def untested(self) -> list[str]:
        """Tools whose run without a crash was fine but none of whose crash runs was made
        (each skipped: the tool reported no side effect, see ``toolledger.testing.effect``),
        in the registry's order: nothing was checked of what they promise. (A tool whose
        baseline failed is an error already.)"""
        baseline_ok: set[str] = set()
        tools: dict[str, list[PointResult]] = {}
        for result in self.results:
            if result.point == NO_CRASH:
                if result.status is Status.OK:
                    baseline_ok.add(result.tool)
            else:
                tools.setdefault(result.tool, []).append(result)
        return [
            tool
            for tool, crashed in tools.items()
            if tool in baseline_ok and crashed and all(r.skipped for r in crashed)
        ]

    @property
    def ok(self) -> bool:
        """No contradiction, every run that was meant to be made was, and every tool was
        tested (unless ``allow_untested``)."""
        return self.exit_code == 0

    @property
    def exit_code(self) -> int:
        """0: nothing wrong; 1: a contradiction; 3: no contradiction, but a run failed; 4: no
        contradiction and no failed run, but a tool's crash runs were all skipped."""
        if self.contradictions:
            return 1
        if self.errors:
            return 3
        return 4 if self.untested and not self.allow_untested else 0

    def result(self, tool: str, point: str) -> PointResult:
        for found in self.results:
            if (found.tool, found.point) == (tool, point):
                return found
        raise KeyError(f"no result for {tool} at {point}")

    def as_json(self) -> dict[str, Any]:
        tools: dict[str, dict[str, Any]] = {}
        for result in self.results:
            entry = tools.setdefault(
                result.tool,
                {
                    "name": result.tool,
                    "effect_class": result.effect_class,
                    "arguments": self.arguments.get(result.tool),
                    "points": [],
                },
            )
            entry["points"].append(
                {k: v for k, v in result.as_json().items() if k not in ("tool", "effect_class")}
            )
        return {
            "ok": self.ok,
            "exit_code": self.exit_code,
            "contradictions": len(self.contradictions),
            "errors": len(self.errors),
            "untested": self.untested,
            "seconds": round(self.seconds, 1),
            "tools": list(tools.values()),
        }

    def explain(self) -> str:
        """The contradictions and errors, one line each (what an assertion says)."""
        lines = [
            f"{r.tool} ({r.effect_class}) at {r.point}: {r.text()}" for r in self.contradictions + self.errors
        ]
        if not self.allow_untested:
            lines += [f"{tool}: untested: {UNTESTED_REASON}" for tool in self.untested]
        return "\n".join(lines) if lines else "every tool conforms to its effect class"


UNTESTED_REASON = (
    "it reported no side effect, so no crash run was made (report each effect with "
    "toolledger.testing.effect in the tool or its fake; allow it with --allow-untested)"
)
