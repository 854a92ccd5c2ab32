"""The `python` backend: a class in `<version>/model.py`, as simple as LitServe's LitAPI.

    class Model:
        def setup(self, device):               # optional; may also take model_dir, config
            self.scale = 2.0

        def predict(self, inputs):             # a whole batch: {name: np.ndarray}
            return {"y": inputs["x"] * self.scale}

The class is the one named by `parameters.class` in config.toml, else the only class
defined in model.py that has a `predict` method.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from typing import Any

import numpy as np

from bitserve.backends.base import LoadError, Model


class PythonModel(Model):
    platform = "python"

    def load(self) -> None:
        path = self.require_file("model.py")
        module_name = f"bitserve_user_{self.config.name}_{self.version_dir.name}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise LoadError(f"{path}: import failed: {type(e).__name__}: {e}") from e
        cls = self._find_class(module, path)
        try:
            self.user = cls()
            setup = getattr(self.user, "setup", None)
            if setup is not None:
                offered = {
                    "device": self.device,
                    "model_dir": self.version_dir,
                    "config": self.config,
                }
                accepted = inspect.signature(setup).parameters
                setup(**{k: v for k, v in offered.items() if k in accepted})
        except Exception as e:
            raise LoadError(f"{path}: {cls.__name__}.setup failed: {type(e).__name__}: {e}") from e

    def _find_class(self, module: Any, path: Any) -> type:
        wanted = self.config.parameters.get("class")
        if wanted is not None:
            cls = getattr(module, wanted, None)
            if not inspect.isclass(cls):
                raise LoadError(f"{path}: parameters.class names {wanted!r}, not a class there")
            return cls
        candidates = [
            c
            for c in vars(module).values()
            if inspect.isclass(c) and c.__module__ == module.__name__ and hasattr(c, "predict")
        ]
        if len(candidates) != 1:
            raise LoadError(
                f"{path}: expected one class with a predict method, found "
                f"{[c.__name__ for c in candidates]}; set parameters.class"
            )
        return candidates[0]

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        return self.user.predict(inputs)

    def unload(self) -> None:
        teardown = getattr(self.user, "teardown", None)
        if teardown is not None:
            teardown()


BACKEND = PythonModel
