"""Hosts on one machine: Linux network namespaces on a bridge, sharing nothing but the network.

Each host is a namespace with one veth link to a bridge in the root namespace;
the bridge holds the root namespace's own address (where the test itself and the
forwarders to the machine's PostgreSQL and Redis listen). Cutting a host's link
(``cut``/``restore``) is a network fault as a host would see it: connections
hang or are refused, processes keep running. Needs root; ``available()`` says
why not where it cannot work.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

SUBNET = "10.231.77"
BRIDGE = "tidemh-br"
ROOT_ADDRESS = f"{SUBNET}.1"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = "tidemh-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    address: str
    link: str  # the root-side end of its veth pair

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


class Network:
    """A bridge and one namespace per host; ``close`` removes them all."""

    def __init__(self, names: Sequence[str]) -> None:
        self.hosts: dict[str, Host] = {}
        self._forwarders: list[Forwarder] = []
        self.close()  # debris of an earlier run that died
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{ROOT_ADDRESS}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for index, name in enumerate(names, start=2):
            self._add(name, f"{SUBNET}.{index}", index)

    def _add(self, name: str, address: str, index: int) -> None:
        namespace, outside, inside = f"tidemh-{name}", f"tidemh{index}-h", f"tidemh{index}-n"
        _ip("netns", "add", namespace)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", namespace)
        _ip("link", "set", outside, "master", BRIDGE)
        _ip("link", "set", outside, "up")
        for argv in (
            ["addr", "add", f"{address}/24", "dev", inside],
            ["link", "set", inside, "up"],
            ["link", "set", "lo", "up"],
        ):
            _ip("netns", "exec", namespace, "ip", *argv)
        self.hosts[name] = Host(name, namespace, address, outside)

    def cut(self, name: str) -> None:
        """Take the host off the network (its link goes down; its processes live on)."""
        _ip("link", "set", self.hosts[name].link, "down")

    def restore(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].link, "up")

    def forward(self, port: int, target: tuple[str, int]) -> None:
        """Listen on the bridge address and relay to ``target`` (the machine's own services)."""
        self._forwarders.append(Forwarder((ROOT_ADDRESS, port), target))

    def close(self) -> None:
        for forwarder in getattr(self, "_forwarders", []):
            forwarder.stop()
        listed = _ip("netns", "list", check=False).stdout.split()
        for namespace in listed:
            if namespace.startswith("tidemh-"):
                # whatever still runs there (a service that did not stop) goes with it
                for pid in _ip("netns", "pids", namespace, check=False).stdout.split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), 9)
                _ip("netns", "del", namespace, check=False)
        _ip("link", "del", BRIDGE, check=False)


class Forwarder:
    """A TCP relay on a thread of its own (asyncio): hosts reach PostgreSQL and Redis by it."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.listen, self.target = listen, target
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"forwarder on {listen} did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._relay, *self.listen, reuse_address=True)
        )
        self._ready.set()
        with contextlib.suppress(RuntimeError):
            self._loop.run_forever()
        server.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(OSError):
                dst.close()

        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


@dataclasses.dataclass
class HostProcess:
    """A process started on a host, its output in a log file of that host's own directory."""

    host: Host
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, 15)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, 9)
                self.process.wait(timeout=10)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def spawn(
    host: Host, argv: Sequence[str], env: dict[str, str], cwd: Path, log: Path
) -> HostProcess:
    """Start ``argv`` on ``host`` in ``cwd`` with exactly ``env`` (plus PATH and HOME)."""
    cwd.mkdir(parents=True, exist_ok=True)
    base = {key: os.environ[key] for key in ("PATH", "HOME", "LANG") if key in os.environ}
    with log.open("ab") as handle:
        process = subprocess.Popen(
            host.command(argv),
            env={**base, "PYTHONUNBUFFERED": "1", **env},
            cwd=cwd,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return HostProcess(host, process, log)


def run_on(host: Host, argv: Sequence[str], env: dict[str, str], cwd: Path, timeout: float) -> str:
    """Run ``argv`` on ``host`` to completion; its output, or an error naming the host."""
    cwd.mkdir(parents=True, exist_ok=True)
    base = {key: os.environ[key] for key in ("PATH", "HOME", "LANG") if key in os.environ}
    result = subprocess.run(
        host.command(argv),
        env={**base, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} failed on {host.name} ({result.returncode}):\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result.stdout


def python_on(host: Host) -> list[str]:
    return [sys.executable]


@contextlib.contextmanager
def network(names: Sequence[str]) -> Iterator[Network]:
    net = Network(names)
    try:
        yield net
    finally:
        net.close()
