"""The model repository: find models on disk, choose versions, load, swap and unload them.

Triton's layout: `<repo>/<model>/config.toml` and numeric version folders (names that
are not numbers, or that start with "0", are ignored). A broken config or a version
that fails to load is recorded with an error naming the file and the cause; every
other model still serves.

Loading a model that already serves swaps atomically: the new versions load and warm
up beside the old ones, then lookups move to them, then the old ones drain (requests
already queued or running finish) and unload. A failed load leaves the old versions
serving.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from bitserve.backends.base import LoadError
from bitserve.config import ConfigError, ModelConfig, load_config, version_numbers
from bitserve.metrics import Metrics
from bitserve.repository.calls import ModelCalls
from bitserve.repository.version import ModelVersion

log = logging.getLogger("bitserve.repository")

# A model folder holding this file is skipped (e.g. one whose backend is not built yet).
IGNORE_MARKER = ".bitserve-ignore"


class ModelNotFound(LookupError):
    """Unknown model or version (HTTP 404)."""


class ModelUnavailable(RuntimeError):
    """Known but not ready: loading, failed, restarting, draining or unloaded (HTTP 503)."""

    retry_after = 1  # the Retry-After header: most of these pass within seconds


@dataclass
class ModelEntry:
    name: str
    config: ModelConfig | None = None
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    error: str | None = None  # a config error, or the first failed version's error
    wanted: bool = True  # False after an explicit unload

    def lazy(self) -> list[ModelVersion]:
        """Versions that load on the model's first request (--lazy-load)."""
        return [v for v in self.versions.values() if v.state == "lazy"]


class Repository:
    def __init__(self, path: Path, metrics: Metrics | None = None, drain_timeout: float = 30.0):
        self.path = Path(path)
        self.metrics = metrics or Metrics()
        self.drain_timeout = drain_timeout
        self.models: dict[str, ModelEntry] = {}
        self.loaded = False  # every model asked for at start has been tried
        self.calls = ModelCalls(self)  # how models call models: ensembles, BLS
        self._locks: dict[str, asyncio.Lock] = {}

    # --------------------------------------------------------------- discovery

    def model_names(self) -> list[str]:
        """Model folders on disk now."""
        if not self.path.is_dir():
            raise ConfigError(f"{self.path}: model repository folder does not exist")
        return sorted(
            p.name
            for p in self.path.iterdir()
            if p.is_dir() and not p.name.startswith((".", "_")) and not (p / IGNORE_MARKER).exists()
        )

    def scan(self, names: list[str] | None = None) -> None:
        """Read configs and choose versions for `names` (default: all); load nothing.
        An ensemble's steps are scanned with it (as Triton loads an ensemble's models)."""
        todo = list(self.model_names() if names is None else names)
        while todo:
            name = todo.pop(0)
            entry = self.models.setdefault(name, ModelEntry(name))
            entry.config, chosen, entry.error = self._read(name)
            for v in chosen:
                entry.versions[v] = self._new_version(entry.config, v)
            steps = entry.config.ensemble_scheduling if entry.config else None
            for step in steps.step if steps else ():
                wanted = step.model_name
                if wanted not in self.models and wanted not in todo and self._on_disk(wanted):
                    todo.append(wanted)

    def _on_disk(self, name: str) -> bool:
        return (self.path / name / "config.toml").is_file()

    def _read(self, name: str) -> tuple[ModelConfig | None, list[int], str | None]:
        model_dir = self.path / name
        try:
            config = load_config(model_dir / "config.toml")
        except ConfigError as e:
            log.error("refused model %s: %s", name, e)
            return None, [], str(e)
        chosen = config.version_policy.select(version_numbers(model_dir))
        if not chosen:
            error = f"{model_dir}: no numeric version folder matches version_policy"
            log.error("refused model %s: %s", name, error)
            return config, [], error
        problem = config.traffic and config.traffic.unserved(chosen)
        if problem:
            error = f"{model_dir / 'config.toml'}: {problem}"
            log.error("refused model %s: %s", name, error)
            return config, [], error
        return config, chosen, None

    def _new_version(self, config: ModelConfig, version: int) -> ModelVersion:
        folder = self.path / config.name / str(version)
        return ModelVersion(config, version, folder, self.metrics, self.calls)

    # ----------------------------------------------------------------- loading

    async def load_all(self) -> None:
        """Load every chosen version; failures are logged and recorded, never raised."""
        pending = [(e, v) for e in self.models.values() for v in e.versions.values()]
        await asyncio.gather(*(self._load(entry, version) for entry, version in pending))
        self.loaded = True

    def defer_all(self) -> None:
        """--lazy-load: every chosen version loads on its model's first request
        (`ensure_loaded`) instead of now; the repository counts as loaded."""
        for entry in self.models.values():
            for version in entry.versions.values():
                version.state = "lazy"
        self.loaded = True

    async def _load(self, entry: ModelEntry, version: ModelVersion, record: bool = True) -> bool:
        """Load one version; `record` marks the model failed (a reload that fails does
        not: the old versions keep serving)."""
        try:
            await version.load()
        except LoadError as e:
            if record:
                entry.error = entry.error or str(e)
            log.error("model %s version %d failed to load: %s", entry.name, version.version, e)
            return False
        detail = version.describe()
        log.info(
            "loaded model %s version %d in %.2f s (%s)",
            entry.name,
            version.version,
            version.load_seconds,
            detail,
        )
        return True

    async def load_model(self, name: str) -> None:
        """(Re)load one model from disk, swapping versions atomically; raises on failure."""
        if not (self.path / name / "config.toml").is_file():
            raise ModelNotFound(f"no model folder '{name}' with a config.toml in {self.path}")
        async with self._lock(name):
            entry = self.models.setdefault(name, ModelEntry(name))
            config, chosen, error = self._read(name)
            if error is not None:
                raise LoadError(error)
            assert config is not None
            fresh = {v: self._new_version(config, v) for v in chosen}
            results = await asyncio.gather(
                *(self._load(entry, mv, record=False) for mv in fresh.values())
            )
            if not all(results):
                failed = [mv for mv in fresh.values() if mv.state == "failed"]
                await asyncio.gather(*(mv.unload(0) for mv in fresh.values() if mv.ready))
                raise LoadError(failed[0].error or f"model '{name}' failed to load")
            old = entry.versions
            entry.config, entry.versions, entry.error, entry.wanted = config, fresh, None, True
            await self._retire(list(old.values()))

    async def unload_model(self, name: str) -> None:
        """Drain and unload every version of a model; it then answers 503."""
        entry = self.entry(name)
        async with self._lock(name):
            old = list(entry.versions.values())
            entry.versions, entry.wanted = {}, False
            await self._retire(old)

    async def _retire(self, versions: list[ModelVersion]) -> None:
        """Drain (in-flight requests finish) and unload versions no longer served."""
        await asyncio.gather(*(v.unload(self.drain_timeout) for v in versions if v.ready))

    async def unload_all(self) -> None:
        for entry in self.models.values():
            await self._retire(list(entry.versions.values()))

    async def poll(self) -> None:
        """One pass of --model-control poll: load new or changed models, drop removed ones."""
        on_disk = set(self.model_names())
        for name in sorted(on_disk):
            entry = self.models.get(name)
            if entry is None or self._changed(entry):
                try:
                    await self.load_model(name)
                except (LoadError, ModelNotFound) as e:
                    log.error("poll: model %s not (re)loaded: %s", name, e)
                    self.models.setdefault(name, ModelEntry(name)).error = str(e)
        for name in set(self.models) - on_disk:
            await self.unload_model(name)
            del self.models[name]

    def _changed(self, entry: ModelEntry) -> bool:
        config, chosen, error = self._read(entry.name)
        if error is not None:
            return error != entry.error
        return config != entry.config or sorted(entry.versions) != chosen

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    # --------------------------------------------------------------- lookups

    def entry(self, name: str) -> ModelEntry:
        entry = self.models.get(name)
        if entry is None:
            raise ModelNotFound(f"unknown model '{name}'")
        return entry

    def get(self, name: str, version: str | None = None) -> ModelVersion:
        """The version to serve: the given one, else the highest ready one."""
        entry = self.entry(name)
        if version is None:
            ready = [v for v in entry.versions.values() if v.ready]
            if ready:
                return max(ready, key=lambda v: v.version)
            raise ModelUnavailable(self._why_unavailable(entry))
        found = entry.versions.get(int(version)) if version.isdigit() else None
        if found is None:
            if entry.versions or entry.wanted:
                raise ModelNotFound(f"unknown version '{version}' of model '{name}'")
            raise ModelUnavailable(f"model '{name}' is unloaded")
        if not found.ready:
            state = found.restarting() or found.state
            raise ModelUnavailable(f"model '{name}' version {version} is {state}")
        return found

    def _why_unavailable(self, entry: ModelEntry) -> str:
        if entry.error:
            return f"model '{entry.name}' is not available: {entry.error}"
        if not entry.wanted:
            return f"model '{entry.name}' is unloaded"
        states = sorted(
            {("restarting" if v.restarting() else v.state) for v in entry.versions.values()}
        )
        return f"model '{entry.name}' is not ready ({', '.join(states) or 'loading'})"

    def not_ready_reason(self) -> str | None:
        """Why the server is not ready (None when it is): loading, failed or restarting."""
        for entry in self.models.values():
            if entry.error:
                return f"model '{entry.name}' failed: {entry.error}"
        if not self.loaded:
            return "loading"
        for entry in self.models.values():
            for v in entry.versions.values():
                # a restart that leaves it serving (Ray replicas: degraded) is ready
                if (why := v.restarting()) is not None and not v.ready:
                    return f"model '{entry.name}' version {v.version}: {why}"
            if entry.wanted and not any(
                v.ready or v.state == "lazy" for v in entry.versions.values()
            ):
                return self._why_unavailable(entry)
        return None

    def lazy_models(self) -> list[str]:
        """Models that will load on their first request (--lazy-load)."""
        return sorted(name for name, entry in self.models.items() if entry.lazy())

    async def ensure_loaded(self, name: str) -> None:
        """Load a lazy model's versions before its first request is looked up; requests
        that arrive meanwhile wait for the same load (scale-to-zero cold start)."""
        entry = self.models.get(name)
        if entry is None or not entry.lazy():
            return
        async with self._lock(name):  # the others wait here, then find nothing lazy
            await asyncio.gather(*(self._load(entry, v) for v in entry.lazy()))

    def all_ready(self) -> bool:
        """Every model the repository asks for is loaded and warmed (strict readiness)."""
        return self.not_ready_reason() is None

    def index(self) -> list[dict]:
        """The repository extension's index: every model and version with its state."""
        out = []
        for name in sorted(set(self.models) | set(self.model_names())):
            entry = self.models.get(name)
            if entry is None or (not entry.versions and not entry.error):
                state = "UNAVAILABLE" if entry is not None else "UNLOADED"
                out.append({"name": name, "state": state, "reason": "unloaded"})
                continue
            if entry.error and not entry.versions:
                out.append({"name": name, "state": "UNAVAILABLE", "reason": entry.error})
            for number, v in sorted(entry.versions.items()):
                state = "READY" if v.ready else v.state.upper()
                out.append(
                    {"name": name, "version": str(number), "state": state, "reason": v.error or ""}
                )
        return out
