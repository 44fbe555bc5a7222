"""Start, stop and inspect the local stack (``tide stack up|down|status``).

Each service runs detached in its own process group; its pid file and log live
in the state directory, so a later ``tide`` invocation (or a test session) can
find, check and stop what an earlier one started. ``up`` is idempotent: a
healthy service is left alone, a dead one is restarted.
"""

from __future__ import annotations

__all__ = ["ServiceStatus", "StackError", "StackManager", "free_ports", "pid_alive"]

import dataclasses
import errno
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from tide_lib.config import TideConfig
from tide_lib.errors import TideError
from tide_lib.stack.secrets import ensure_stack_secrets
from tide_lib.stack.services import SERVICES, Service

logger = logging.getLogger(__name__)


class StackError(TideError, RuntimeError):
    """The stack could not be brought to the asked state; the message says why and what to do."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServiceStatus:
    name: str
    pid: int | None
    running: bool
    healthy: bool
    url: str
    log: Path


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False


def _socket_served(path: Path) -> bool:
    """Whether a process listens on unix socket ``path`` (a file left behind by one that
    stopped refuses the connection; one we may not connect to, or whose backlog is full,
    is served all the same)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        except (PermissionError, TimeoutError):
            return True
    return True


def free_ports(count: int, start: int, *, twin_offset: int = 0) -> list[int]:
    """The first ``count`` ports from ``start`` that a service could bind on 127.0.0.1.

    With ``twin_offset``, ``port + twin_offset`` must be free too (SeaweedFS binds
    its gRPC port there).
    """
    ports: list[int] = []
    port = start
    while len(ports) < count:
        twins = (port, port + twin_offset) if twin_offset else (port,)
        if not any(_port_in_use("127.0.0.1", candidate) for candidate in twins):
            ports.append(port)
        port += 1
    return ports


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie child of ours is reaped and counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child still answers kill(0); reap it
        waited, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return waited == 0


class StackManager:
    """The local S3 server and MLflow server, as configured."""

    def __init__(self, config: TideConfig, services: tuple[Service, ...] = SERVICES) -> None:
        # No secret has a default: those not given are generated once into the secrets dir.
        config = ensure_stack_secrets(config)
        self.config = config
        wanted = set(config.stack.services)
        unknown = wanted - {service.name for service in services}
        if unknown:
            raise StackError(
                f"stack.services names unknown services {sorted(unknown)}; "
                f"known: {[service.name for service in services]}"
            )
        self.services = tuple(
            service
            for service in services
            if service.enabled(config) and (not wanted or service.name in wanted)
        )
        # Absolute: services run with the state dir as their working directory.
        self.state_dir = Path(config.stack.state_dir).resolve()

    def _pid_file(self, service: Service) -> Path:
        return self.state_dir / f"{service.name}.pid"

    def log_file(self, service: Service) -> Path:
        """Where the service's stdout and stderr go."""
        return self.state_dir / f"{service.name}.log"

    def _pid(self, service: Service) -> int | None:
        try:
            pid = int(self._pid_file(service).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def status(self) -> list[ServiceStatus]:
        statuses = []
        for service in self.services:
            pid = self._pid(service)
            statuses.append(
                ServiceStatus(
                    name=service.name,
                    pid=pid,
                    running=pid is not None,
                    healthy=pid is not None and service.healthy(self.config),
                    url=service.url(self.config),
                    log=self.log_file(service),
                )
            )
        return statuses

    def up(self) -> list[ServiceStatus]:
        """Start every service not yet running; if one fails, stop those this call started."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        started: list[Service] = []
        try:
            for service in self.services:
                if self._start(service):
                    started.append(service)
        except BaseException:
            for service in reversed(started):
                self._stop(service)
            raise
        return self.status()

    def _start(self, service: Service) -> bool:
        """Start ``service`` unless it is already running and healthy; True when started."""
        pid = self._pid(service)
        if pid is not None:
            if service.healthy(self.config):
                logger.info("%s already running (pid %d)", service.name, pid)
                return False
            self._stop(service)
        busy = [
            port
            for port in service.ports(self.config)
            if _port_in_use(self.config.stack.host, port)
        ]
        if busy:
            raise StackError(
                f"cannot start {service.name}: port(s) {busy} on {self.config.stack.host} "
                "are taken by another process. Stop it (`ss -ltnp` shows which), "
                "or move TIDE's ports with TIDE_STACK__<NAME>_PORT"
            )
        served = [str(path) for path in service.sockets(self.config) if _socket_served(path)]
        if served:
            raise StackError(
                f"cannot start {service.name}: another process serves its unix socket(s) "
                f"{served}: a {service.name} on the same ports (in another network "
                "namespace, a container that shares /tmp, another user's, or one on "
                "another address of this host). Stop it, or move "
                "TIDE's ports with TIDE_STACK__<NAME>_PORT"
            )
        service.before_start(self.config)
        command = service.command(self.config, self.state_dir)
        log_path = self.log_file(service)
        logger.info("starting %s: %s", service.name, " ".join(command))
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **service.env(self.config)},
                cwd=self.state_dir,
                start_new_session=True,
            )
        self._pid_file(service).write_text(str(process.pid))
        deadline = time.monotonic() + self.config.stack.start_timeout_s
        while not service.healthy(self.config):
            if process.poll() is not None:
                raise StackError(
                    f"{service.name} exited with code {process.returncode} while starting; "
                    f"last lines of {log_path}:\n{_tail(log_path)}"
                )
            if time.monotonic() > deadline:
                self._stop(service)
                raise StackError(
                    f"{service.name} did not become healthy within "
                    f"{self.config.stack.start_timeout_s:.0f}s; see {log_path}:\n{_tail(log_path)}"
                )
            time.sleep(0.25)
        service.after_start(self.config)
        logger.info("%s is up at %s (pid %d)", service.name, service.url(self.config), process.pid)
        return True

    def down(self) -> None:
        for service in reversed(self.services):
            self._stop(service)

    def stop_service(self, name: str) -> None:
        self._stop(self._service(name))

    def start_service(self, name: str) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._start(self._service(name))

    def _service(self, name: str) -> Service:
        for service in self.services:
            if service.name == name:
                return service
        raise StackError(f"no service named {name!r}; known: {[s.name for s in self.services]}")

    def _stop(self, service: Service, grace_s: float = 15.0) -> None:
        pid = self._pid(service)
        self._pid_file(service).unlink(missing_ok=True)
        if pid is None:
            return
        logger.info("stopping %s (pid %d)", service.name, pid)
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if not pid_alive(pid):
                    return
                time.sleep(0.1)
        raise StackError(f"{service.name} (pid {pid}) did not stop after SIGKILL")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
