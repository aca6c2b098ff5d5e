"""A conformance check's report: every tool's verdict at every point."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from toolledger.testing.verdicts import PointResult, Status


@dataclass
class Report:
    """Every tool's verdict at every point, in the registry's order and a call's."""

    results: list[PointResult]
    arguments: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The arguments each tool was called with."""
    seconds: float = 0.0

    @property
    def contradictions(self) -> list[PointResult]:
        return [r for r in self.results if r.status is Status.CONTRADICTION]

    @property
    def errors(self) -> list[PointResult]:
        return [r for r in self.results if r.status is Status.ERROR]

    @property
    def ok(self) -> bool:
        """No contradiction, and every run that was meant to be made was."""
        return not self.contradictions and not self.errors

    @property
    def exit_code(self) -> int:
        """0: nothing wrong; 1: a contradiction; 3: no contradiction, but a run failed."""
        if self.contradictions:
            return 1
        return 3 if self.errors else 0

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
            "seconds": round(self.seconds, 1),
            "tools": list(tools.values()),
        }

    def explain(self) -> str:
        """The contradictions and errors, one line each (what an assertion says)."""
        lines = [
            f"{r.tool} ({r.effect_class}) at {r.point}: {r.text()}" for r in self.contradictions + self.errors
        ]
        return "\n".join(lines) if lines else "every tool conforms to its effect class"
