"""The Ray cluster a server joins with `bitserve serve --ray ADDRESS`.

One option, one meaning: ADDRESS is what `ray.init(address=...)` takes: `local` starts
a private Ray on this machine (development), `auto` joins the cluster this machine is
part of (`ray start` ran here), `HOST:PORT` joins that cluster's GCS. Anything that
places work on Ray (data-parallel replicas, tensor/pipeline workers) calls `connect()`,
which joins once, on first use. Ray is an optional extra: nothing here imports it
until a model asks for it.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("bitserve.ray")

_address: str | None = None
_lock = threading.Lock()
_connected = False


class RayUnavailable(RuntimeError):
    """Ray was asked for but is not configured or not installed."""


def configure(address: str | None) -> None:
    """Remember the cluster address (`--ray`); nothing connects until `connect()`.

    A cluster address also goes to RAY_ADDRESS, so code that calls a bare `ray.init()`
    joins the same cluster."""
    global _address
    _address = address or None
    if _address:
        # Ray's driver would install absl's failure handler for SIGTERM too: it printed
        # a stack and sometimes aborted (exit -6) the server's own SIGTERM drain (the
        # soak's `--ray` runs). Read when Ray is imported, so set before any import.
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    if _address and _address != "local":
        os.environ.setdefault("RAY_ADDRESS", _address)


def address() -> str | None:
    return _address


def connect() -> None:
    """Join the configured cluster once (thread-safe); raises RayUnavailable."""
    global _connected
    with _lock:
        if _connected:
            return
        if _address is None:
            raise RayUnavailable(
                'this model runs on Ray (isolation = "ray"): start the server with '
                "--ray ADDRESS (or --ray local for a Ray on this machine)"
            )
        try:
            import ray
        except ImportError:
            raise RayUnavailable("Ray is not installed: pip install 'bitserve[ray]'") from None
        if not ray.is_initialized():
            _init_on_a_lasting_thread(ray)
        resources = ray.cluster_resources()
        log.info(
            "joined Ray at %s: %g CPU, %g GPU",
            _address,
            resources.get("CPU", 0),
            resources.get("GPU", 0),
        )
        _connected = True


def _init_on_a_lasting_thread(ray) -> None:
    """ray.init on a thread that lives as long as the process. A `local` Ray's head
    processes (GCS, raylet) are started with PR_SET_PDEATHSIG = SIGKILL, which the
    kernel sends when the *thread* that forked them ends: called from a model
    instance's worker thread, replacing that instance (a replica killed) killed the
    whole Ray, and 60 s later Ray ended the server (found by `bench.soak --ray`)."""
    done, failed = threading.Event(), []

    def driver() -> None:
        try:
            ray.init(
                address=_address,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        except BaseException as e:  # raised again on the caller's thread
            failed.append(e)
        done.set()
        if not failed:
            threading.Event().wait()  # never ends: see above

    threading.Thread(target=driver, name="ray-driver", daemon=True).start()
    done.wait()
    if failed:
        raise failed[0]
