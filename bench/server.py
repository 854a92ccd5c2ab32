"""One way for every benchmark to run a server under test: bitserve or a peer.

The server runs in its own process session, so stopping the group leaves nothing behind
(LitServe's workers, vLLM's engine core), on errors and Ctrl-C too. Affinity is set in the
child before exec, so its children inherit it. The log goes to a file; `tail()` shows its
end when the server dies or never answers ready.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# One compute thread unless the benchmark says otherwise; nothing reaches the network.
THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "PYTHONUNBUFFERED": "1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bitserve_command(repository: Path, port: int, *args: str, threads: int = 1) -> list[str]:
    """`bitserve serve` on a repository, from this Python's environment."""
    command = [sys.executable, "-m", "bitserve.cli", "serve", "--repository", str(repository)]
    command += ["--port", str(port), "--threads", str(threads), *args]
    return command if "--grpc-port" in args else [*command, "--grpc-port", "0"]


def http_get(port: int, path: str, timeout: float = 2.0) -> int | None:
    """The status of GET 127.0.0.1:port/path, or None when nothing answers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


class Server:
    """A server process, ready once `ready_path` answers 200; a context manager.

    `cpus` pins it (None: anywhere); `threads` sets the OpenMP/MKL thread count;
    `env` adds variables; `fails_with`, a line in its log that means it will never be
    ready (a server that stays up, not ready). `url` is its base address.
    """

    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        ready_path: str = "/v2/health/ready",
        *,
        cpus: set[int] | None = None,
        threads: int = 1,
        env: dict[str, str] | None = None,
        timeout: float = 300.0,
        fails_with: str | None = None,
    ):
        self.name, self.cmd, self.port, self.ready_path = name, cmd, port, ready_path
        self.cpus, self.timeout, self.fails_with = cpus, timeout, fails_with
        self.url = f"http://127.0.0.1:{port}"
        count = str(threads)
        threads_env = {"OMP_NUM_THREADS": count, "MKL_NUM_THREADS": count}
        self.env = {**os.environ, **THREAD_ENV, **threads_env, **(env or {})}
        self.proc: subprocess.Popen | None = None
        fd, path = tempfile.mkstemp(prefix=f"bench-{name.replace(' ', '_')}-", suffix=".log")
        os.close(fd)
        self.log = Path(path)

    @classmethod
    def bitserve(cls, repository: Path, *args: str, threads: int = 1, **kwargs) -> Server:
        """A `bitserve serve` of `repository` on a free port (not started yet)."""
        port = free_port()
        cmd = bitserve_command(repository, port, *args, threads=threads)
        # a model that fails to load leaves bitserve up and not ready for good
        kwargs.setdefault("fails_with", "NOT ready")
        return cls("bitserve", cmd, port, threads=threads, **kwargs)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> Server:
        cpus = self.cpus
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}\n{self.tail()}")
            if http_get(self.port, self.ready_path) == 200:
                return
            if self.fails_with and self.fails_with in self.log.read_text(errors="replace"):
                raise RuntimeError(f"{self.name} will not be ready\n{self.tail()}")
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {self.timeout:.0f} s\n{self.tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, keep_log: bool = False) -> None:
        """SIGTERM the whole group, SIGKILL what is left after 10 s."""
        if self.proc is not None:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                if not group_alive(self.proc.pid):
                    break
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, sig)
                end = time.monotonic() + wait
                while self.proc.poll() is None or group_alive(self.proc.pid):
                    if time.monotonic() > end:
                        break
                    time.sleep(0.05)
        if not keep_log:
            self.log.unlink(missing_ok=True)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
