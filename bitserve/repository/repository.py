"""The model repository: find models on disk, choose versions, load them, look them up.

Triton's layout: `<repo>/<model>/config.toml` and numeric version folders (names that
are not numbers, or that start with "0", are ignored). A broken config or a version
that fails to load is recorded with an error naming the file and the cause; every
other model still serves.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from bitserve.backends.base import LoadError
from bitserve.repository.config import ConfigError, ModelConfig, load_config
from bitserve.repository.version import ModelVersion

log = logging.getLogger("bitserve.repository")

# A model folder holding this file is skipped (e.g. one whose backend is not built yet).
IGNORE_MARKER = ".bitserve-ignore"


class ModelNotFound(LookupError):
    """Unknown model or version (HTTP 404)."""


class ModelUnavailable(RuntimeError):
    """Known but not ready: loading, failed or unloaded (HTTP 503)."""


@dataclass
class ModelEntry:
    name: str
    config: ModelConfig | None = None
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    error: str | None = None  # a config error, or the first failed version's error


def version_numbers(model_dir: Path) -> list[int]:
    return sorted(
        int(p.name)
        for p in model_dir.iterdir()
        if p.is_dir() and p.name.isdigit() and not p.name.startswith("0")
    )


class Repository:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.models: dict[str, ModelEntry] = {}
        self.loaded = False  # every model has been tried (loaded or failed)

    def scan(self) -> None:
        """Read every config and choose versions; load nothing yet."""
        if not self.path.is_dir():
            raise ConfigError(f"{self.path}: model repository folder does not exist")
        for model_dir in sorted(p for p in self.path.iterdir() if p.is_dir()):
            if model_dir.name.startswith((".", "_")) or (model_dir / IGNORE_MARKER).exists():
                continue
            entry = self.models.setdefault(model_dir.name, ModelEntry(model_dir.name))
            config_path = model_dir / "config.toml"
            try:
                entry.config = load_config(config_path)
            except ConfigError as e:
                entry.error = str(e)
                log.error("refused model %s: %s", model_dir.name, e)
                continue
            chosen = entry.config.version_policy.select(version_numbers(model_dir))
            if not chosen:
                entry.error = f"{model_dir}: no numeric version folder matches version_policy"
                log.error("refused model %s: %s", model_dir.name, entry.error)
                continue
            for v in chosen:
                entry.versions[v] = ModelVersion(entry.config, v, model_dir / str(v))

    async def load_all(self) -> None:
        """Load every chosen version; failures are logged and recorded, never raised."""
        pending = [(e, v) for e in self.models.values() for v in e.versions.values()]
        await asyncio.gather(*(self._load(entry, version) for entry, version in pending))
        self.loaded = True

    async def _load(self, entry: ModelEntry, version: ModelVersion) -> None:
        try:
            await version.load()
        except LoadError as e:
            entry.error = entry.error or str(e)
            log.error("model %s version %d failed to load: %s", entry.name, version.version, e)
            return
        log.info(
            "loaded model %s version %d in %.2f s (%d instance%s, %d warmup request%s)",
            entry.name,
            version.version,
            version.load_seconds,
            len(version.instances),
            "" if len(version.instances) == 1 else "s",
            sum(w.count for w in version.config.model_warmup),
            "" if sum(w.count for w in version.config.model_warmup) == 1 else "s",
        )

    async def unload_all(self) -> None:
        for entry in self.models.values():
            for version in entry.versions.values():
                if version.state == "ready":
                    await version.unload()

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
            raise ModelNotFound(f"unknown version '{version}' of model '{name}'")
        if not found.ready:
            raise ModelUnavailable(f"model '{name}' version {version} is {found.state}")
        return found

    def _why_unavailable(self, entry: ModelEntry) -> str:
        if entry.error:
            return f"model '{entry.name}' is not available: {entry.error}"
        return f"model '{entry.name}' is not ready (loading)"

    def not_ready_reason(self) -> str | None:
        """Why the server is not ready (None when it is): loading, or which model failed."""
        for entry in self.models.values():
            if entry.error:
                return f"model '{entry.name}' failed: {entry.error}"
        if not self.all_ready():
            return "loading"
        return None

    def all_ready(self) -> bool:
        """Every model the repository asks for is loaded and warmed (strict readiness)."""
        return self.loaded and all(
            e.versions and all(v.ready for v in e.versions.values()) for e in self.models.values()
        )
