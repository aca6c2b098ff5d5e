"""What durability costs, measured against baselines in the same run.

    .venv/bin/python -m benchmarks [--quick] [--json out.json] [--database-url URL] [--only PARTS]

Parts: ``ceiling`` (the ledger path vs pgbench doing the same commits), ``latency`` (added per
call), ``peer`` (DBOS Transact, if installed), ``growth`` (costs at 10k..1M calls), ``e2e``
(toolledger serve vs the SDK's own tool runner, on the emulator), ``recovery`` (resubmitting
stored results after a crash), ``memory`` (serve watching many sessions), ``crash`` (crash
to answer: serve SIGKILLed holding calls mid-handler and stored results, restarted at once
with default settings; how long until the model has every answer). ``--quick`` runs every
part at toy sizes, for CI (a few minutes, most of it the crash part waiting out today's
leases): it fails on errors, never on timings. ``statements`` measures one hot write through
the store, through SQLAlchemy Core on a held connection, and through psycopg directly.
``intake`` serves N sessions x 1 call of one agent through signed webhooks (1 and 2 replicas)
and through watched streams (1 replica): ack and webhook-to-result times, calls/s, RSS.

The PostgreSQL database named by ``--database-url`` (its name must contain "bench") is
dropped and created again, more than once.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from rich.console import Console

from benchmarks import crash, intake, ledger_path, service, statements
from benchmarks.report import Figure, print_table, write_json

DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/toolledger_bench_suite"
LEDGER_PARTS = {"ceiling", "latency", "peer", "growth"}
SERVICE_PARTS = {"e2e", "recovery", "memory"}
STATEMENT_PARTS = {"statements"}
CRASH_PARTS = {"crash"}
INTAKE_PARTS = {"intake"}
ALL_PARTS = LEDGER_PARTS | SERVICE_PARTS | CRASH_PARTS | STATEMENT_PARTS | INTAKE_PARTS


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="Toy sizes, seconds: for CI.")
    parser.add_argument("--json", type=Path, default=None, help="Write the figures here.")
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    parser.add_argument(
        "--only",
        default=None,
        help=f"Comma-separated parts: {', '.join(sorted(ALL_PARTS))}.",
    )
    arguments = parser.parse_args(argv)
    wanted = set(arguments.only.split(",")) if arguments.only else ALL_PARTS
    unknown = wanted - ALL_PARTS
    if unknown:
        parser.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    arguments.parts = wanted
    return arguments


def main(argv: list[str] | None = None) -> None:
    arguments = parse_arguments(argv)
    console = Console(stderr=True)

    def progress(line: str) -> None:
        console.print(f"  {line}", highlight=False)

    skipped: dict[str, str] = {}
    figures: list[Figure] = []
    if arguments.parts & LEDGER_PARTS:
        measured = asyncio.run(
            ledger_path.run(arguments.database_url, arguments.quick, progress, skipped, arguments.parts)
        )
        figures += [figure for figure in measured if figure.part in arguments.parts]
    if arguments.parts & STATEMENT_PARTS:
        figures += asyncio.run(statements.run(arguments.database_url, arguments.quick, progress))
    if arguments.parts & SERVICE_PARTS:
        measured = asyncio.run(
            service.run(arguments.database_url, arguments.quick, progress, skipped, arguments.parts)
        )
        figures += measured
    if arguments.parts & CRASH_PARTS:
        figures += asyncio.run(
            crash.run(arguments.database_url, arguments.quick, progress, skipped, arguments.parts)
        )
    if arguments.parts & INTAKE_PARTS:
        figures += asyncio.run(intake.run(arguments.database_url, arguments.quick, progress))
    mode = "quick" if arguments.quick else "full"
    print_table(Console(), figures, f"toolledger benchmarks ({mode})")
    for part, reason in skipped.items():
        console.print(f"skipped {part}: {reason}")
    if arguments.json is not None:
        write_json(arguments.json, figures, mode, skipped)
    sys.exit(0)


if __name__ == "__main__":
    main()
