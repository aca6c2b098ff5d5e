"""The ``toolledger`` command. Every flag can also be set as ``TOOLLEDGER_<COMMAND>_<FLAG>``.

This folder owns the commands (``serve``, ``reconcile``, ``migrate``, ``status``,
``sessions``, ``calls``, ``api``, ``config``, ``demo``, ``emulator``, ``check``): their flags, output
and exit codes. What they run on comes from the composition root
(``runtime.composition.Runtime``, through ``common.ledger_runtime``); nothing here builds an
engine, a gateway or a store. The top layer: nothing in toolledger imports it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import click

from toolledger.cli.api import api
from toolledger.cli.calls import calls
from toolledger.cli.check import check
from toolledger.cli.common import (
    LOG_LEVELS,
    base_url_option,
    configure_logging,
    database_option,
    first_line,
    iso,
    ledger_runtime,
    load_tools,
    masked_url,
    missing_sqlite_file,
    run,
    settings_from,
)
from toolledger.cli.config import config
from toolledger.cli.demo import demo
from toolledger.version import __version__

if TYPE_CHECKING:
    from fastapi import FastAPI

    from toolledger.domain.records import SessionRecord
    from toolledger.runtime.composition import Runtime
    from toolledger.runtime.registry import ToolRegistry
    from toolledger.settings import Settings

T = TypeVar("T")


@click.group(context_settings={"auto_envvar_prefix": "TOOLLEDGER", "help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="toolledger")
def main() -> None:
    """Durable, idempotent function tools for OpenAI Agents API sessions."""


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", default=0, show_default=True, type=click.IntRange(0, 65535), help="Port; 0 picks a free one."
)
@click.option("--api-key", default=None, help="Refuse requests without this bearer token (default: any).")
@click.option(
    "--script",
    "script_options",
    multiple=True,
    metavar="[NAME=]FILE",
    help="A script file (JSON). Without NAME: the default, for sessions that select none. "
    "With NAME: selected by the metadata emulator_script=NAME of a session or its agent. Repeatable.",
)
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="warning",
    show_default=True,
)
@click.option(
    "--webhook-url",
    default=None,
    metavar="URL",
    help="POST signed agent.session.* webhooks here, as the Agents API does (default: none).",
)
@click.option(
    "--webhook-secret",
    default=None,
    metavar="whsec_...",
    help="The secret webhooks are signed with (Standard Webhooks); needed with --webhook-url.",
)
def emulator(
    host: str,
    port: int,
    api_key: str | None,
    script_options: tuple[str, ...],
    log_level: str,
    webhook_url: str | None,
    webhook_secret: str | None,
) -> None:
    """Serve a local Agents API; prints the base URL to pass to OpenAI(base_url=...).

    The emulated model calls tools only as a script says. A script file, for an agent
    whose tools include send_receipt and charge_card:

    \b
      {"steps": [
         {"calls": [{"name": "send_receipt", "arguments": {"order_id": "A1"}}]},
         {"calls": [{"name": "charge_card", "arguments": {"cents": 500}}]}]}

    Each step's calls are made at once, the next step when they all have results; the
    turn then ends with a message listing the results. A session follows the script its
    metadata emulator_script selects (a NAME, or a script inline as JSON), else the one
    its agent's metadata selects, else the default; with no script it calls nothing.

    The script format, with examples: docs/emulator.md in the toolledger repository.
    """
    from pydantic import ValidationError

    from toolledger.emulator import Script, WebhookConfig, serve
    from toolledger.emulator.script import load_script, script_option

    default_script: Script | None = None
    scripts: dict[str, Script] = {}
    for value in script_options:
        name, path = script_option(value)
        try:
            script = load_script(path)
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="--script") from None
        if name is not None:
            scripts[name] = script
        elif default_script is not None:
            raise click.BadParameter(
                "give one default script; name the others as NAME=FILE", param_hint="--script"
            )
        else:
            default_script = script
    try:
        webhooks = WebhookConfig(url=webhook_url, secret=webhook_secret)
    except ValidationError as error:
        message = error.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
        raise click.BadParameter(message, param_hint="--webhook-url/--webhook-secret") from None
    serve(
        host=host,
        port=port,
        api_key=api_key,
        default_script=default_script,
        scripts=scripts,
        log_level=log_level,
        webhooks=webhooks,
    )


@main.command()
@click.option(
    "--database-url", default=None, help="Ledger database (default: TOOLLEDGER_DATABASE_URL or SQLite)."
)
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@click.option("--downgrade", is_flag=True, help="Go down to --revision (e.g. base) instead of up.")
def migrate(database_url: str | None, revision: str, downgrade: bool) -> None:
    """Bring the ledger's schema to a revision (idempotent; run once per release)."""
    from sqlalchemy.exc import SQLAlchemyError

    from toolledger.store import migrate as migrations

    settings = settings_from(database_url=database_url)
    url = settings.database_url
    try:
        before = migrations.current_revision(url)
        if downgrade:
            migrations.downgrade(url, revision)
        else:
            migrations.upgrade(url, revision)
        after = migrations.current_revision(url)
    except SQLAlchemyError as error:
        raise click.ClickException(f"cannot migrate {masked_url(url)}: {first_line(error)}") from None
    click.echo(f"ledger schema: {before or 'empty'} -> {after or 'empty'}")


# ----------------------------------------------------------------------- serve


@main.command()
@click.option(
    "--tools",
    "tools_reference",
    required=True,
    envvar="TOOLLEDGER_TOOLS",
    help="The application's tools: package.module:registry (a ToolRegistry or a function returning one).",
)
@click.option("--watch", "watch_ids", multiple=True, help="Also watch this session (repeatable).")
@click.option(
    "--agent",
    "agent_ids",
    multiple=True,
    metavar="AGENT_ID",
    help="Serve every session of this agent, registered or not (repeatable; default: "
    "TOOLLEDGER_AGENT_IDS, comma-separated). Found by a sweep of its sessions, and at once "
    "through webhooks with --listen.",
)
@click.option(
    "--listen",
    default=None,
    metavar="HOST:PORT",
    help="Take the Agents API's signed webhooks at http://HOST:PORT/webhooks/agents (needs "
    "TOOLLEDGER_WEBHOOK_SECRET and an agent; default: TOOLLEDGER_LISTEN). Every process of "
    "--processes listens on it.",
)
@database_option
@base_url_option
@click.option("--concurrency", type=click.IntRange(1), default=None, help="Handlers run at once.")
@click.option("--grace", type=click.FloatRange(0), default=None, help="Seconds running calls get on SIGTERM.")
@click.option("--api", "with_api", is_flag=True, help="Also serve the audit HTTP API and web view.")
@click.option("--api-host", default=None, help="Audit API address (default: TOOLLEDGER_API_HOST, 127.0.0.1).")
@click.option(
    "--api-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Audit API port; 0 picks a free one (default: TOOLLEDGER_API_PORT or 8700).",
)
@click.option(
    "--processes",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    envvar="TOOLLEDGER_PROCESSES",
    help="Serve processes on this machine, sharing the watched sessions (PostgreSQL; one per "
    "core uses them all).",
)
@click.option("--log-level", type=LOG_LEVELS, default="info", show_default=True)
def serve(
    tools_reference: str,
    watch_ids: tuple[str, ...],
    agent_ids: tuple[str, ...],
    listen: str | None,
    database_url: str | None,
    base_url: str | None,
    concurrency: int | None,
    grace: float | None,
    with_api: bool,
    api_host: str | None,
    api_port: int | None,
    processes: int,
    log_level: str,
) -> None:
    """Follow watched sessions and run their function calls durably, until SIGTERM/SIGINT."""
    if processes > 1:
        _serve_processes(
            processes,
            tools_reference,
            watch_ids,
            agent_ids=agent_ids,
            listen=listen,
            database_url=database_url,
            base_url=base_url,
            concurrency=concurrency,
            grace=grace,
            with_api=with_api,
            api_host=api_host,
            api_port=api_port,
            log_level=log_level,
        )
        return
    registry = load_tools(tools_reference)
    settings = settings_from(
        database_url=database_url,
        openai_base_url=base_url,
        agent_ids=",".join(agent_ids) if agent_ids else None,
        listen=listen,
        max_concurrent_calls=concurrency,
        shutdown_grace_seconds=grace,
        api_host=api_host,
        api_port=api_port,
    )
    missing = missing_sqlite_file(settings.database_url)
    if missing is not None:
        # Served, a mistyped path would look like a new, empty ledger with nothing to recover.
        raise click.ClickException(
            f"no ledger file at {missing}: run `toolledger migrate` first (it creates the ledger), "
            "or set TOOLLEDGER_DATABASE_URL to the existing one"
        )
    configure_logging(log_level, settings)
    started = logging.getLogger("toolledger.service")
    started.info("ledger: %s", masked_url(settings.database_url))
    started.info("%s", settings.agents_api_sources())
    api_app = _audit_app(settings, registry) if with_api else None
    failure = run(_serve(registry, settings, watch_ids, api_app, log_level))
    if failure is not None:
        raise click.ClickException(str(failure))


def _serve_processes(
    processes: int,
    tools_reference: str,
    watch_ids: tuple[str, ...],
    *,
    log_level: str,
    with_api: bool,
    agent_ids: tuple[str, ...],
    **options: Any,
) -> None:
    """``serve --processes N``: N serve processes, one of them with the audit API (each of
    them takes webhooks on ``--listen``: the kernel shares the port among them)."""
    from sqlalchemy.engine import make_url

    from toolledger.cli.supervisor import supervise

    settings = settings_from(database_url=options["database_url"], openai_base_url=options["base_url"])
    configure_logging(log_level, settings)
    if make_url(settings.database_url).get_backend_name() == "sqlite":
        raise click.UsageError(
            "--processes above 1 needs PostgreSQL: SQLite lets one serve process at a time write "
            "the ledger (run one serve, or point TOOLLEDGER_DATABASE_URL at PostgreSQL)"
        )
    load_tools(tools_reference)  # a bad reference is refused here, once, not by N children
    shared = ["--tools", tools_reference, "--log-level", log_level, "--processes", "1"]
    shared += [argument for agent_id in agent_ids for argument in ("--agent", agent_id)]
    for name, value in options.items():
        if value is not None:
            shared += [f"--{name.replace('_', '-')}", str(value)]
    first = [*shared, *(a for w in watch_ids for a in ("--watch", w)), *(["--api"] if with_api else [])]
    children = [first] + [_without_api_options(shared)] * (processes - 1)
    grace = options["grace"] if options.get("grace") is not None else settings.shutdown_grace_seconds
    code = supervise(children, grace=grace)
    if code:
        sys.exit(code)


def _without_api_options(arguments: list[str]) -> list[str]:
    """The audit API listens in the first process only (one port)."""
    kept: list[str] = []
    skip = False
    for argument in arguments:
        if skip:
            skip = False
            continue
        if argument in ("--api-host", "--api-port"):
            skip = True
            continue
        kept.append(argument)
    return kept


def _audit_app(settings: Settings, registry: ToolRegistry) -> FastAPI:
    """Built before the service starts, so a refused exposure (no token off loopback) stops
    `serve` at once with a usage error instead of after it has claimed work."""
    from toolledger.audit.api import create_app
    from toolledger.audit.auth import ApiConfigurationError

    try:
        # With the registry, an operator's re-run executes in this process, under its limits.
        return create_app(settings, registry=registry)
    except ApiConfigurationError as error:
        raise click.UsageError(str(error)) from None


async def _serve(
    registry: ToolRegistry,
    settings: Settings,
    watch_ids: tuple[str, ...],
    api_app: FastAPI | None = None,
    log_level: str = "info",
) -> BaseException | None:
    """Serve until a signal or a fatal failure; the failure, if any.

    Calls still running after the grace period are cut off, and the process ends at once
    (``_exit_now``), its handler threads with it: they cannot be stopped, and the default
    exit would wait for whatever they wait for. Its liveness lock goes with it, and the next
    replica takes its calls over as after a crash."""
    from toolledger.runtime.service import Service

    service = Service(registry, settings)
    await service.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    api_task = _start_api(api_app, settings, stop, log_level) if api_app is not None else None
    try:
        for session_id in watch_ids:
            await service.watch(session_id)
        signalled, failed = asyncio.create_task(stop.wait()), asyncio.create_task(service.failed.wait())
        await asyncio.wait([signalled, failed], return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        failed.cancel()
        if service.failure is None:
            logging.getLogger("toolledger.service").info("shutting down (signal received)")
    finally:
        cut_off = await service.stop(exiting=True)
        try:
            if api_task is not None:
                await _finish_api(api_task, settings)
        finally:
            threads = service.handler_threads_running()
            if cut_off or threads:
                _exit_now(service.failure, threads)
    return service.failure


def _exit_now(failure: BaseException | None, threads: list[str]) -> None:
    """End the process now: handler threads still running (cut off, or timed out earlier)
    would keep it alive for as long as they hang."""
    import os

    service_log = logging.getLogger("toolledger.service")
    for thread in threads:
        service_log.warning("exiting: handler thread cut off by the exit: %s", thread)
    if failure is not None:
        click.echo(f"Error: {failure}", err=True)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failure is not None else 0)


def _start_api(app: FastAPI, settings: Settings, stop: asyncio.Event, log_level: str) -> asyncio.Task[None]:
    from toolledger.audit.api import serve_api

    def listening(host: str, port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        # A log line like serve's others (JSON off a terminal), not a bare print among them.
        logging.getLogger("toolledger.api").info("audit API: http://%s:%d", shown, port)

    task = asyncio.create_task(
        serve_api(
            app, settings.api_host, settings.api_port, stop=stop, on_listening=listening, log_level=log_level
        )
    )
    # The API failing to listen (port taken) must not leave a service no one asked for half up.
    task.add_done_callback(lambda _: stop.set())
    return task


async def _finish_api(task: asyncio.Task[None], settings: Settings) -> None:
    try:
        await task
    except OSError as error:
        raise click.ClickException(
            f"cannot listen on {settings.api_host}:{settings.api_port}: {error.strerror or error}"
        ) from None


# -------------------------------------------------------------------- sessions


@main.group()
def sessions() -> None:
    """Watch, unwatch and list the sessions the service follows."""


@sessions.command("watch")
@click.argument("session_ids", nargs=-1, required=True)
@database_option
@base_url_option
def sessions_watch(session_ids: tuple[str, ...], database_url: str | None, base_url: str | None) -> None:
    """Have the service follow these sessions (a running `serve` picks them up within a second).

    Each one is looked up in the Agents API first, when one is configured: a session that does
    not exist is not watched (exit 1)."""
    settings = settings_from(database_url=database_url, openai_base_url=base_url)
    missing: list[str] = []

    async def watch(runtime: Runtime) -> None:
        unknown = await _sessions_not_found(runtime, session_ids)
        store = runtime.session_store()
        for session_id in session_ids:
            if session_id in unknown:
                missing.append(session_id)
                click.echo(f"{session_id}: no such session in the Agents API; not watched", err=True)
                continue
            added = await store.watch(session_id)
            click.echo(f"{session_id}: {'watched' if added else 'already watched'}")

    run(_with_sessions(settings, watch))
    if missing:
        sys.exit(1)


async def _sessions_not_found(runtime: Runtime, session_ids: tuple[str, ...]) -> set[str]:
    """The sessions the Agents API says do not exist; none when no API is configured (said
    once) or it cannot be reached (said, and the sessions are watched anyway)."""
    gateway = runtime.configured_gateway()
    if gateway is None:
        click.echo("(not checked with the Agents API: none is configured)", err=True)
        return set()
    from toolledger.errors import AgentsUnavailableError, SessionGoneError

    missing: set[str] = set()
    for session_id in session_ids:
        try:
            await gateway.retrieve(session_id)
        except SessionGoneError:
            missing.add(session_id)
        except AgentsUnavailableError as error:
            click.echo(f"(not checked with the Agents API: {error})", err=True)
            return set()
    return missing


@sessions.command("unwatch")
@click.argument("session_ids", nargs=-1, required=True)
@click.option("--reason", default="unwatched by an operator", show_default=True)
@database_option
def sessions_unwatch(session_ids: tuple[str, ...], reason: str, database_url: str | None) -> None:
    """Stop following these sessions (their calls stay in the ledger as they are)."""
    settings = settings_from(database_url=database_url)

    async def unwatch(runtime: Runtime) -> None:
        store = runtime.session_store()
        for session_id in session_ids:
            removed = await store.unwatch(session_id, reason)
            click.echo(f"{session_id}: {'unwatched' if removed else 'was not watched'}")

    run(_with_sessions(settings, unwatch))


@sessions.command("list")
@click.option("--all", "show_all", is_flag=True, help="Include sessions no longer watched.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@database_option
def sessions_list(show_all: bool, as_json: bool, database_url: str | None) -> None:
    """The watched sessions, who follows each, and when it was last reconciled."""
    settings = settings_from(database_url=database_url)

    async def listing(runtime: Runtime) -> None:
        found = await runtime.session_store().find(watched=None if show_all else True)
        if as_json:
            for record in found:
                click.echo(json.dumps(_session_json(record)))
            return
        if not found:
            click.echo("no sessions watched" if not show_all else "no sessions")
            return
        click.echo(f"{'SESSION':<34} {'WATCHED':<8} {'STATUS':<16} {'OWNER':<30} REASON")
        for r in found:
            click.echo(
                f"{r.session_id:<34} {'yes' if r.watched else 'no':<8} {r.status or '-':<16} "
                f"{r.owner or '-':<30} {r.reason or ''}"
            )

    run(_with_sessions(settings, listing))


@sessions.command("show")
@click.argument("session_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@database_option
def sessions_show(session_id: str, as_json: bool, database_url: str | None) -> None:
    """One session: watched or not (and why), who follows it under which lease, its last
    poll, and its calls with their status and outcome."""
    from toolledger.cli.calls import show_session

    show_session(session_id, as_json=as_json, database_url=database_url)


async def _with_sessions(settings: Settings, action: Callable[[Runtime], Coroutine[Any, Any, None]]) -> None:
    missing = missing_sqlite_file(settings.database_url)
    if missing is not None:
        # Run from another directory, a relative default would make a new, empty ledger.
        raise click.ClickException(
            f"no ledger file at {missing}: run this where the ledger is, or set TOOLLEDGER_DATABASE_URL "
            "(`toolledger migrate` creates one)"
        )
    async with ledger_runtime(settings) as runtime:
        await action(runtime)


def _session_json(record: SessionRecord) -> dict[str, Any]:
    return {
        "session_id": record.session_id,
        "watched": record.watched,
        "status": record.status,
        "owner": record.owner,
        "lease_expires_at": iso(record.lease_expires_at),
        "last_polled_at": iso(record.last_polled_at),
        "reason": record.reason,
    }


# ------------------------------------------------------------------- reconcile


@main.command()
@click.option(
    "--tools",
    "tools_reference",
    default=None,
    envvar="TOOLLEDGER_TOOLS",
    help="The application's tools; without them stored results are resubmitted and confirmed, "
    "but no call is run or settled (that is left to `serve`).",
)
@click.option("--session", "session_ids", multiple=True, help="Only this session (repeatable).")
@click.option("--concurrency", type=click.IntRange(1), default=8, show_default=True, help="Sessions at once.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@database_option
@base_url_option
@click.option("--log-level", type=LOG_LEVELS, default="warning", show_default=True)
def reconcile(
    tools_reference: str | None,
    session_ids: tuple[str, ...],
    concurrency: int,
    as_json: bool,
    database_url: str | None,
    base_url: str | None,
    log_level: str,
) -> None:
    """One reconciliation pass over every watched session (and every session with open calls),
    then a summary of what it did."""
    registry = load_tools(tools_reference)
    settings = settings_from(database_url=database_url, openai_base_url=base_url)
    configure_logging(log_level, settings)
    summary = run(
        _reconcile(
            registry, settings, list(session_ids), concurrency, run_handlers=tools_reference is not None
        )
    )
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        click.echo(f"reconciled {summary['sessions']} session(s); {summary['stopped']} stopped being watched")
        for action, count in summary["actions"].items():
            click.echo(f"  {action:<24} {count}")
        if summary["errors"]:
            click.echo(f"  {'errors':<24} {summary['errors']} (see the log)")
    if summary["errors"]:
        sys.exit(1)


async def _reconcile(
    registry: ToolRegistry,
    settings: Settings,
    session_ids: list[str],
    concurrency: int,
    *,
    run_handlers: bool,
) -> dict[str, Any]:
    from toolledger.runtime.reconciler import Reconciler, SessionReconciliation
    from toolledger.runtime.tool_ledger import ToolLedger

    # No serve lock: a pass decides nothing the ledger does not, so it may run beside `serve`.
    async with ToolLedger(registry, settings, run_handlers=run_handlers) as ledger:
        store = ledger.runtime.session_store()
        if not session_ids:
            await store.watch_new(await store.with_open_calls())
            session_ids = [record.session_id for record in await store.find(watched=True)]
        reconciler = Reconciler(ledger.executor, ledger.gateway, store)
        with click.progressbar(
            length=len(session_ids), label="reconciling", file=sys.stderr, show_pos=True
        ) as bar:

            def progress(_: SessionReconciliation | None) -> None:
                bar.update(1)

            summary = await reconciler.reconcile_many(session_ids, concurrency=concurrency, progress=progress)
        return summary.as_json()


# ---------------------------------------------------------------------- status


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option(
    "--replica-here",
    is_flag=True,
    help="Only: is a `serve` of this host alive (registered, its heartbeat current)? Exits 1 if "
    "not. A container's healthcheck: it checks the process, not only the database.",
)
@database_option
def status(as_json: bool, replica_here: bool, database_url: str | None) -> None:
    """Is the ledger reachable and current, which replicas are alive, what waits. Exits 1 when
    the database is unreachable or its schema is not current."""
    settings = settings_from(database_url=database_url)
    if replica_here:
        alive = run(_replicas_here(settings))
        click.echo(alive or f"no live replica of {socket.gethostname()}")
        sys.exit(0 if alive else 1)
    report = run(_status(settings))
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(f"database:   {'reachable' if report['database_reachable'] else 'UNREACHABLE'}")
        if report["database_reachable"]:
            click.echo(
                f"schema:     {report['schema_revision'] or 'empty'} "
                f"({'current' if report['schema_current'] else 'NOT CURRENT: run toolledger migrate'})"
            )
        if report.get("error"):
            click.echo(f"error:      {report['error']}")
        for replica in report.get("replicas", []):
            click.echo(
                f"replica:    {replica['replica_id']} (pid {replica['pid']} on {replica['hostname']}), "
                f"{replica['sessions']} session(s), heartbeat {replica['heartbeat_age_seconds']:.1f}s ago"
            )
            if replica.get("handlers"):
                click.echo(f"  handlers: {_handler_load_text(replica['handlers'])}")
        if report["database_reachable"] and report["schema_current"] and not report["replicas"]:
            click.echo("replicas:   none alive")
        if "watched_sessions" in report:
            click.echo(
                f"sessions:   {report['watched_sessions']} watched, {report['unowned_sessions']} unfollowed"
            )
            for line in _intake_lines(report["intake"]):
                click.echo(line)
            calls = ", ".join(f"{k} {v}" for k, v in sorted(report["calls"].items())) or "none"
            click.echo(f"calls:      {calls}")
            if report["unconfirmed_calls"]:
                unconfirmed = report["unconfirmed_calls"]
                click.echo(f"unconfirmed: {unconfirmed} call(s) accepted repeatedly but still awaited")
            oldest = report["oldest_unsubmitted_age_seconds"]
            if oldest is not None:
                click.echo(f"oldest unsubmitted result: {oldest:.1f}s")
            for call in report["unknown_calls"]:
                click.echo(
                    f"unknown:    {call['key']} ({call['tool']}, {call['effect_class']}) for "
                    f"{call['age_seconds']:.0f}s: toolledger calls resolve {call['key']} "
                    "--output TEXT | --error TEXT | --rerun --reason WHY"
                )
            for call in report["awaiting_calls"]:
                age = f"{call['age_seconds']:.0f}s"
                click.echo(f"awaiting:   {call['key']} ({call['tool']}) {call['status']} for {age}")
    if not (report["database_reachable"] and report["schema_current"]):
        sys.exit(1)


STATUS_CALLS_SHOWN = 20


def _intake_lines(intake: dict[str, Any]) -> list[str]:
    lines = [
        f"intake:     {' + '.join(intake['modes'])}"
        + (f" (agents {', '.join(intake['agent_ids'])})" if intake["agent_ids"] else "")
        + f"; {intake['intake_sessions']} session(s) served by looks, {intake['looks_due']} look(s) due"
    ]
    counts = intake["counts"]
    webhooks = {k.removeprefix("webhook_"): v for k, v in counts.items() if k.startswith("webhook_")}
    if webhooks or intake["webhooks_taken"]:
        shown = ", ".join(f"{name} {n}" for name, n in sorted(webhooks.items())) or "none since start"
        lines.append(f"webhooks:   {intake['webhooks_taken']} kept; live replicas: {shown}")
    for sweep in intake["sweeps"]:
        age = sweep["last_run_age_seconds"]
        when = "never" if age is None else f"{age:.0f}s ago"
        error = f", last error: {sweep['last_error']}" if sweep["last_error"] else ""
        mark = sweep["watermark"]
        watermark = (
            "none" if mark is None else datetime.fromtimestamp(mark, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        )
        lines.append(
            f"sweep:      {sweep['agent_id']}: last {when} (found {sweep['last_found'] or 0}), "
            f"{sweep['runs']} run(s), watermark {watermark}{error}"
        )
    return lines


async def _replicas_here(settings: Settings) -> str | None:
    """The live replicas this host registered, as a line; None when there is none."""
    from toolledger.runtime.composition import Runtime

    if missing_sqlite_file(settings.database_url) is not None:
        return None
    async with Runtime.from_settings(settings) as runtime:
        host = socket.gethostname()
        mine = [r for r in await runtime.session_store().live_replicas() if r.hostname == host]
    if not mine:
        return None
    return "alive: " + ", ".join(f"{r.replica_id} (pid {r.pid})" for r in mine)


def _handler_load_text(load: dict[str, int]) -> str:
    """A replica's handlers as its last heartbeat told them."""
    parts = [
        f"{load.get('running', 0)}/{load.get('slots', 0)} slots running",
        f"threads {load.get('threads_busy', 0)}/{load.get('threads', 0)} busy",
    ]
    if load.get("threads_timed_out"):
        parts.append(f"{load['threads_timed_out']} timed out and still running (each holds its thread)")
    if load.get("waiting_for_thread"):
        parts.append(f"{load['waiting_for_thread']} call(s) waiting for a thread")
    if load.get("waiting_for_slot"):
        parts.append(f"{load['waiting_for_slot']} call(s) waiting for a slot")
    return ", ".join(parts)


async def _status(settings: Settings) -> dict[str, Any]:
    from toolledger.audit.intake_report import intake_report
    from toolledger.domain.records import CallRecord
    from toolledger.domain.states import UNCONFIRMED_ALERT_AFTER, CallStatus
    from toolledger.runtime.composition import Runtime
    from toolledger.store import migrate as migrations

    url = settings.database_url
    report: dict[str, Any] = {"database_reachable": False, "schema_current": False, "replicas": []}
    missing = missing_sqlite_file(url)
    if missing is not None:
        # Opening it would create an empty file: a typo in the path would look like a new ledger.
        report["error"] = f"no ledger file at {missing} (`toolledger migrate` creates one)"
        return report
    try:
        revision = await asyncio.to_thread(migrations.current_revision, url)
        report["database_reachable"] = True
        report["schema_revision"] = revision
        report["schema_current"] = revision == migrations.HEAD
    except Exception as error:
        report["error"] = settings.redactor().text(
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        )
        return report
    if not report["schema_current"]:
        return report
    async with Runtime.from_settings(settings) as runtime:
        sessions_store = runtime.session_store()
        now = datetime.now(UTC)
        watched = await sessions_store.find(watched=True)
        owners: dict[str, int] = {}
        for record in watched:
            if record.owner and record.lease_expires_at and record.lease_expires_at > now:
                owners[record.owner] = owners.get(record.owner, 0) + 1
        report["replicas"] = [
            {
                "replica_id": r.replica_id,
                "hostname": r.hostname,
                "pid": r.pid,
                "sessions": owners.get(r.replica_id, 0),
                # The heartbeat is stamped by another clock: never report it from the future.
                "heartbeat_age_seconds": max(0.0, (now - r.heartbeat_at).total_seconds()),
                # Slots and threads as of that heartbeat; None from a replica that did not say.
                "handlers": dict(r.handler_load) if r.handler_load is not None else None,
                "intake": dict(r.intake_counts) if r.intake_counts is not None else None,
            }
            for r in await sessions_store.live_replicas()
        ]
        report["intake"] = await intake_report(
            settings,
            sessions_store,
            runtime.intake_store(),
            [replica["intake"] for replica in report["replicas"]],
        )
        report["watched_sessions"] = len(watched)
        report["unowned_sessions"] = len(watched) - sum(owners.values())
        ledger = runtime.ledger_store(actor="status")
        report["calls"] = await ledger.count_by_status()
        report["unconfirmed_calls"] = await ledger.count_unconfirmed(UNCONFIRMED_ALERT_AFTER)
        oldest = await ledger.oldest_unsubmitted()
        report["oldest_unsubmitted_age_seconds"] = (
            None if oldest is None else max(0.0, (now - oldest).total_seconds())
        )

        def listed(call: CallRecord) -> dict[str, Any]:
            since = {
                CallStatus.UNKNOWN: call.lease_expires_at,
                CallStatus.RUNNING: call.started_at,
                CallStatus.SUCCEEDED: call.finished_at,
                CallStatus.FAILED: call.finished_at,
            }.get(call.status)
            return {
                "key": str(call.key),
                "tool": call.tool_name,
                "effect_class": call.effect_class.value,
                "status": call.status.value,
                "age_seconds": max(0.0, (now - (since or call.created_at)).total_seconds()),
            }

        # What an operator may have to act on, and what is still on its way to the model.
        unknown = await ledger.in_states([CallStatus.UNKNOWN], limit=STATUS_CALLS_SHOWN)
        report["unknown_calls"] = [listed(c) for c in unknown]
        awaiting = await ledger.in_states(
            [CallStatus.PENDING, CallStatus.RUNNING, CallStatus.SUCCEEDED, CallStatus.FAILED],
            limit=STATUS_CALLS_SHOWN,
        )
        report["awaiting_calls"] = [listed(c) for c in awaiting]
    return report


main.add_command(calls)
main.add_command(api)
main.add_command(config)
main.add_command(demo)
main.add_command(check)
