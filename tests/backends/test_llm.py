"""The llm backend's service: a stalled or dead engine loop is reported for liveness."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from bitserve.backends.llm import LLMService, Overloaded
from bitserve.config import ModelConfig
from tests.llm.conftest import build_tokenizer, llama_config

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llm") / "1"
    path.mkdir()
    build_tokenizer(path)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(llama_config()).save_pretrained(path)
    return path


def service(folder, **parameters) -> LLMService:
    config = ModelConfig.model_validate(
        {"name": "m", "backend": "llm", "parameters": {"num_kv_blocks": 32, **parameters}}
    )
    return LLMService(config, folder)


def test_stall_and_death_are_reported(folder):
    async def go():
        svc = service(folder, stall_timeout_s=0.5)
        await svc.start()
        assert svc.healthy() is None
        svc.waiting = 1  # work queued, and no step has made progress for a while
        svc.last_progress = time.monotonic() - 2
        assert "stalled" in svc.healthy()
        svc.waiting = 0
        assert svc.healthy() is None  # idle is not stalled
        svc.engine._error = RuntimeError("boom")
        assert "died" in svc.healthy()
        svc.engine._error = None
        await svc.stop()

    asyncio.run(go())


def test_admission_bounds_the_waiting_queue(folder):
    svc = service(folder, max_queued_requests=2, max_queued_tokens=100)
    svc.admit(10)
    svc.waiting = 2
    with pytest.raises(Overloaded) as info:
        svc.admit(10)
    assert info.value.retry_after >= 1
    svc.waiting, svc.waiting_tokens = 0, 95
    with pytest.raises(Overloaded):
        svc.admit(10)


def test_unknown_parameters_are_refused(folder):
    from bitserve.backends.base import LoadError

    with pytest.raises(LoadError, match="unknown llm parameters"):
        service(folder, max_queue=3)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_queued_requests", "8"),
        ("max_queued_tokens", 2.5),
        ("stall_timeout_s", True),
        ("restart_backoff_s", float("inf")),
        ("tool_parser", 3),
        ("system_prompt", ["be brief"]),
        ("few_shot", "Q: hi A: hello"),
    ],
)
def test_a_service_parameter_of_the_wrong_type_is_refused_naming_it(folder, name, value):
    from bitserve.backends.base import LoadError

    with pytest.raises(LoadError, match=f"parameter '{name}' must be"):
        service(folder, **{name: value})


@pytest.mark.parametrize(
    ("name", "value"),
    [("max_num_seqs", "8"), ("block_size", 2.5), ("enable_prefix_caching", "yes"), ("seed", None)],
)
def test_an_engine_parameter_of_the_wrong_type_fails_the_load_naming_it(folder, name, value):
    """Not a TypeError from inside the engine: the load error names the field."""
    from bitserve.backends.base import LoadError

    with pytest.raises(LoadError, match=f"{name} must be"):
        asyncio.run(service(folder, **{name: value}).start())
