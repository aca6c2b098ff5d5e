"""`toolledger serve --agent A --listen HOST:PORT` replicas as subprocesses, behind the test
load balancer (tests/support/load_balancer.py): each on a port of its own that stays the same
across its restarts, so the balancer's list of backends never changes."""

from __future__ import annotations

from pathlib import Path

from tests.support.load_balancer import free_port
from tests.support.serve_process import ServeProcess
from tests.support.webhooks import SECRET
from toolledger.runtime.webhook_intake import PATH


class IntakeReplicas:
    """``count`` replica slots; ``start(i)`` (re)starts slot ``i``'s `serve`."""

    def __init__(
        self,
        database_url: str,
        base_url: str,
        agent_id: str,
        logs: Path,
        count: int,
        *,
        sweep_seconds: float,
        **environment: str,
    ) -> None:
        self.database_url = database_url
        self.base_url = base_url
        self.agent_id = agent_id
        self.logs = logs
        self.ports = [free_port() for _ in range(count)]
        self.sweep_seconds = sweep_seconds
        self.environment = environment
        self.running: list[ServeProcess | None] = [None] * count
        self._starts = [0] * count

    @property
    def backends(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def start(self, index: int, *, crash_at: str | None = None, label: str = "") -> ServeProcess:
        """Start slot ``index`` (not waiting for it to serve); its log is
        ``replica-<index>-<n>[-label].log``."""
        assert self.running[index] is None or self.running[index].process.poll() is not None  # type: ignore[union-attr]
        self._starts[index] += 1
        suffix = f"-{label}" if label else ""
        serve = ServeProcess(
            self.database_url,
            self.base_url,
            self.logs / f"replica-{index}-{self._starts[index]}{suffix}.log",
            crash_at=crash_at,
            extra_args=("--agent", self.agent_id, "--listen", f"127.0.0.1:{self.ports[index]}"),
            settings={
                "TOOLLEDGER_WEBHOOK_SECRET": SECRET,
                "TOOLLEDGER_SWEEP_SECONDS": str(self.sweep_seconds),
                **self.environment,
            },
        )
        self.running[index] = serve
        return serve

    def start_all(self, *, label: str = "") -> list[ServeProcess]:
        return [self.start(index, label=label) for index in range(len(self.ports))]

    def live(self) -> list[int]:
        return [
            i for i, serve in enumerate(self.running) if serve is not None and serve.process.poll() is None
        ]

    def kill(self, index: int) -> None:
        serve = self.running[index]
        if serve is not None:
            serve.kill()

    def kill_all(self) -> None:
        for index in range(len(self.ports)):
            self.kill(index)

    def __enter__(self) -> IntakeReplicas:
        return self

    def __exit__(self, *_: object) -> None:
        self.kill_all()


def webhook_url(balancer_url: str) -> str:
    return balancer_url + PATH


__all__ = ["IntakeReplicas", "webhook_url"]
