"""A check's report: its exit code, what an assertion says, its JSON."""

from __future__ import annotations

import pytest

from toolledger.testing import PointResult, Report, Status


def result(tool: str, point: str, status: Status, *problems: str) -> PointResult:
    return PointResult(tool, "idempotent", point, status, problems, note="fine", seconds=1.25)


@pytest.mark.parametrize(
    ("statuses", "exit_code"),
    [
        ((Status.OK, Status.NOT_APPLICABLE), 0),
        ((Status.OK, Status.ERROR), 3),
        ((Status.ERROR, Status.CONTRADICTION), 1),
    ],
)
def test_report_exit_code__contradiction_first_then_failed_runs(
    statuses: tuple[Status, ...], exit_code: int
) -> None:
    report = Report(
        [result("send", point, s) for point, s in zip(("no_crash", "after_handler"), statuses, strict=True)]
    )

    assert report.exit_code == exit_code
    assert report.ok is (exit_code == 0)


def test_report__explains_contradictions_and_errors_and_groups_json_by_tool() -> None:
    report = Report(
        [
            result("send", "no_crash", Status.OK),
            result("send", "inside_handler", Status.CONTRADICTION, "two effects", "and more"),
            result("mail", "no_crash", Status.ERROR, "did not finish"),
        ],
        arguments={"send": {"cents": 1}},
        seconds=3.04,
    )

    assert report.explain() == (
        "send (idempotent) at inside_handler: contradiction: two effects; and more\n"
        "mail (idempotent) at no_crash: error: did not finish"
    )
    assert report.result("mail", "no_crash").problems == ("did not finish",)
    assert report.as_json() == {
        "ok": False,
        "exit_code": 1,
        "contradictions": 1,
        "errors": 1,
        "untested": [],
        "seconds": 3.0,
        "tools": [
            {
                "name": "send",
                "effect_class": "idempotent",
                "arguments": {"cents": 1},
                "points": [
                    {
                        "point": "no_crash",
                        "status": "ok",
                        "problems": [],
                        "note": "fine",
                        "seconds": 1.25,
                        "skipped": False,
                    },
                    {
                        "point": "inside_handler",
                        "status": "contradiction",
                        "problems": ["two effects", "and more"],
                        "note": "fine",
                        "seconds": 1.25,
                        "skipped": False,
                    },
                ],
            },
            {
                "name": "mail",
                "effect_class": "idempotent",
                "arguments": None,
                "points": [
                    {
                        "point": "no_crash",
                        "status": "error",
                        "problems": ["did not finish"],
                        "note": "fine",
                        "seconds": 1.25,
                        "skipped": False,
                    }
                ],
            },
        ],
    }
    assert Report([]).explain() == "every tool conforms to its effect class"


def skipped(tool: str, point: str) -> PointResult:
    return PointResult(
        tool, "idempotent", point, Status.NOT_APPLICABLE, ("skipped: no effect",), skipped=True
    )


def test_report__a_tool_whose_crash_runs_were_all_skipped__is_untested_and_exits_4_unless_allowed() -> None:
    results = [
        result("send", "no_crash", Status.OK),
        skipped("send", "after_claim_commit"),
        skipped("send", "inside_handler"),
        result("mail", "no_crash", Status.OK),
        result("mail", "after_claim_commit", Status.OK),
        # Run, but the point was not reached: tested elsewhere, not untested.
        result("mail", "inside_handler", Status.NOT_APPLICABLE, "the run never reached it"),
    ]

    refused, allowed = Report(results), Report(results, allow_untested=True)

    assert (refused.untested, refused.exit_code, refused.ok) == (["send"], 4, False)
    assert "send: untested: it reported no side effect" in refused.explain()
    assert (allowed.exit_code, allowed.ok) == (0, True)
    assert allowed.explain() == "every tool conforms to its effect class"
    failed = Report([*results, result("mail", "after_handler", Status.ERROR, "hung")])
    assert failed.exit_code == 3, "a failed run says more than an untested tool"
    broken = Report([result("send", "no_crash", Status.ERROR, "hung"), skipped("send", "after_handler")])
    assert (broken.untested, broken.exit_code) == ([], 3), "its baseline's error says it already"
