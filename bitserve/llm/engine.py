"""The engine loop: schedule -> execute -> update, and the offline `LLM` API.

`LLMEngine.step()` is vLLM v1's EngineCore step: the scheduler picks tokens under one
budget, the model runner computes them in one flattened batch, and the outputs
(new tokens, stop checks, freed blocks) are applied before the next step.

A step never dies of one request. Requests are checked at admission (token ids within
the vocabulary, sampling parameters by their own schema). If the forward pass still
raises, the step is run again one request at a time (each writes the same KV slots, so
that is safe): the requests that fail alone are failed, with the error, and the others
get their tokens. A row the sampler cannot sample fails its request only, and so does
one whose sampling raises (the sampler is then run one row at a time). What is not
attributable (the scheduler, tensor-parallel workers) propagates: the async engine's
supervisor rebuilds the engine.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bitserve.llm.block_manager import BlockManager
from bitserve.llm.config import EngineConfig
from bitserve.llm.detokenizer import IncrementalDetokenizer
from bitserve.llm.lora import AdapterNotFound, LoRAManager
from bitserve.llm.metrics import EngineMetrics, kv_slots
from bitserve.llm.model_runner import ModelOutput, ModelRunner
from bitserve.llm.outputs import CompletionOutput, RequestOutput
from bitserve.llm.parallel import SINGLE
from bitserve.llm.rope import derived_max_len
from bitserve.llm.sampler import Sampler, SamplingFailed
from bitserve.llm.sampling_params import SamplingError, SamplingParams
from bitserve.llm.scheduler import Scheduler, SchedulerOutput
from bitserve.llm.sequence import Sequence, SequenceStatus
from bitserve.llm.speculative import SpeculativeConfig, Speculator
from bitserve.llm.structured import Grammars, GuideError, mask_rows
from bitserve.llm.workers import WorkerDied, Workers
from bitserve.tensors import allow_tf32

Prompt = str | list[int]
log = logging.getLogger("bitserve.llm")
# A test hook called with each (sub-)batch's sequences just before the forward pass:
# what it raises is what a fault inside the step would raise.
FaultHook = Callable[[list[Sequence]], None]
# batch_wait: steps of at least this many tokens time a prompt token; no wait is longer
PREFILL_TOKENS = 32
MAX_BATCH_WAIT_S = 0.05


def load_tokenizer(folder: Path) -> Any | None:
    if (
        not (folder / "tokenizer.json").is_file()
        and not (folder / "tokenizer_config.json").is_file()
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def eos_token_ids(folder: Path, hf_config: dict) -> set[int]:
    """generation_config.json wins over config.json; either may hold an int or a list."""
    generation = folder / "generation_config.json"
    value = hf_config.get("eos_token_id")
    if generation.is_file():
        value = json.loads(generation.read_text()).get("eos_token_id", value)
    if value is None:
        return set()
    return set(value) if isinstance(value, list) else {int(value)}


@dataclass
class RequestState:
    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None
    first_token_time: float | None = None
    stop_reason: str | int | None = None
    stream: bool = True  # False: the caller wants only the finished output
    error: str | None = None  # why this request failed inside a step


class LLMEngine:
    def __init__(self, model: str | Path, **kwargs: Any):
        self.config = EngineConfig(model=model, **kwargs)
        allowed = derived_max_len(self.config.hf_config)
        log.log(
            logging.WARNING if self.config.max_model_len > allowed else logging.INFO,
            "%s: max_model_len %d (config.json and its rope scaling allow %d)",
            self.config.model,
            self.config.max_model_len,
            allowed,
        )
        torch.manual_seed(self.config.seed)
        allow_tf32(self.config.device)
        # tensor/pipeline parallelism: this process is rank 0, the others are workers
        self.workers = Workers(self.config) if self.config.world_size > 1 else None
        parallel = self.workers.parallel if self.workers is not None else SINGLE
        try:
            self.runner = ModelRunner(self.config, parallel)
        except BaseException as error:
            if self.workers is not None:
                self.workers.fail(error)
            raise
        self.speculator = None  # speculative decoding (speculative.py), when configured
        if self.config.speculative is not None:
            spec = SpeculativeConfig.parse(self.config.speculative, self.config.model)
            self.speculator = Speculator(spec, self.config, self.runner.num_blocks)
        self.reset()
        self.register_lora_modules()
        self.sampler = Sampler()
        self.tokenizer = load_tokenizer(self.config.model)
        self.eos_token_ids = eos_token_ids(self.config.model, self.config.hf_config)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_failed_total = 0
        self._ids = itertools.count()
        self.fault_hook: FaultHook | None = None
        self._grammars: Grammars | None = None
        self._masker = ThreadPoolExecutor(1, thread_name_prefix="bitserve-grammar")
        self.seconds_per_prompt_token: float | None = None  # measured on large steps

    def reset(self) -> None:
        """No request and every block free, over the loaded weights: the start, and a
        warm restart after the step loop died. The KV cache's contents need no clearing
        (blocks are rewritten before they are read)."""
        self.block_manager = BlockManager(self.config, self.runner.num_blocks)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.requests: dict[str, RequestState] = {}
        if self.speculator is not None:
            self.speculator.reset()

    # -- requests ---------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        params: SamplingParams | None = None,
        priority: int = 0,
        stream: bool = True,
    ) -> str:
        """Validate and queue a request; raises ValueError if it can never run."""
        return self.admit(self.prepare(request_id, prompt, params, priority, stream))

    def prepare(
        self,
        request_id: str | None,
        prompt: Prompt,
        params: SamplingParams | None = None,
        priority: int = 0,
        stream: bool = True,
    ) -> RequestState:
        """Tokenize and validate a request without touching the engine's state (raises
        ValueError if it can never run): safe on any thread while a step runs."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.encode(prompt)
        vocab = self.config.hf_config.get("vocab_size")
        if vocab and any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if vocab:
            params.check_vocab(vocab)
        seq = Sequence(request_id, token_ids, params, priority=priority, device=self.config.device)
        seq.lora_id = self.lora_uid(params.lora)
        if params.guide is not None:
            seq.matcher = self.grammars().matcher(params.guide)  # GuideError: a 400
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, token_ids, params)
        return RequestState(seq, text, detok, stream=stream)

    # -- LoRA adapters (lora.py) ---------------------------------------------------------
    @property
    def lora(self) -> LoRAManager | None:
        return self.runner.lora

    def register_lora_modules(self) -> None:
        for name, path in self.config.lora_modules.items():
            self.lora.register(name, self.config.model / Path(path).expanduser())

    def check_lora(self, name: str | None) -> None:
        """The request's adapter is registered (SamplingError naming `lora`: a 400)."""
        if name is None:
            return
        if self.lora is None:
            raise SamplingError("lora", "this model serves no LoRA adapters (max_loras is 0)")
        try:
            self.lora.get(name)
        except AdapterNotFound as e:
            raise SamplingError("lora", str(e)) from None

    def lora_uid(self, name: str | None) -> int:
        self.check_lora(name)
        return self.lora.uid(name) if name is not None else 0

    def admit(self, state: RequestState) -> str:
        """Queue a prepared request for the next step."""
        request_id = state.seq.request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        self.scheduler.add(state.seq)
        self.requests[request_id] = state
        self.prompt_tokens_total += state.seq.num_prompt_tokens
        return request_id

    def grammars(self) -> Grammars:
        """The structured-output grammars for this model's tokenizer (built on first use)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise GuideError("response_format", "this model folder has no tokenizer")
            vocab = int(self.config.hf_config.get("vocab_size") or len(self.tokenizer))
            self._grammars = Grammars(self.tokenizer, vocab, self.config.guided_max_string)
        return self._grammars

    def encode(self, prompt: Prompt) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass token ids")
        return self.tokenizer.encode(prompt)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks go back to the pool before this returns."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.finish(state.seq, SequenceStatus.FINISHED_ABORTED)
        self.release(state.seq)
        return self.make_output(state)

    def release(self, seq: Sequence) -> None:
        """A request ended: its draft model's KV (speculative decoding) goes back too."""
        if self.speculator is not None:
            self.speculator.release(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.speculator is not None:  # proposals first: the scheduler budgets them
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch:
            return []
        start = time.perf_counter()
        with self.runner.torch_threads(batch):
            outputs = self.run(batch)
        # a step that is mostly prompt tokens times them (decode rows cost another rate)
        prompt_tokens = sum(n for _, n in batch.scheduled if n > 1)
        if prompt_tokens >= PREFILL_TOKENS and 2 * prompt_tokens >= batch.num_tokens:
            rate = (time.perf_counter() - start) / batch.num_tokens
            last = self.seconds_per_prompt_token
            self.seconds_per_prompt_token = rate if last is None else 0.7 * last + 0.3 * rate
        return outputs

    def batch_wait(self, num_tokens: int) -> float:
        """How long new prompts of `num_tokens` in all wait before the step that starts
        them: config.batch_wait of their predicted prefill time, at most MAX_BATCH_WAIT_S
        (nothing before a large step was timed). Requests that arrive meanwhile (a burst
        that a client sends at once) share that step instead of waiting it out; everyone
        in it pays at most that share of its time."""
        if self.seconds_per_prompt_token is None:
            return 0.0
        predicted = num_tokens * self.seconds_per_prompt_token
        return min(self.config.batch_wait * predicted, MAX_BATCH_WAIT_S)

    def run(self, batch: SchedulerOutput) -> list[RequestOutput]:
        """One scheduled step: the forward pass, then sampling and the requests' update."""
        masks = self.start_masks(batch)
        if self.workers is not None:  # a failure here is the workers': not attributable
            with self.workers.collective():
                output = self.runner.execute(batch)
            return self.update(batch, output, masks)
        failed: list[RequestOutput] = []
        try:
            output = self.execute(batch)
        except Exception as error:
            log.warning(
                "a step of %d request(s) failed (%r): isolating", len(batch.scheduled), error
            )
            batch, output = self.isolate(batch, failed)
        return failed + self.update(batch, output, masks)

    def start_masks(self, batch: SchedulerOutput) -> Future | None:
        """Structured outputs: the grammar masks of the rows this step samples, computed
        on another thread while the forward pass runs (llguidance releases the GIL)."""
        guided = [
            seq
            for seq, n in batch.scheduled
            if seq.matcher is not None and seq.num_computed_tokens + n == seq.num_tokens
        ]
        if not guided:
            return None
        vocab = self.grammars().vocab_size

        def compute() -> tuple[dict[int, int], torch.Tensor]:
            bitmask = mask_rows([seq.matcher for seq in guided], vocab)
            return {id(seq): row for row, seq in enumerate(guided)}, bitmask

        return self._masker.submit(compute)

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        if self.fault_hook is not None:
            self.fault_hook([seq for seq, _ in batch.scheduled])
        return self.runner.execute(batch)

    def isolate(
        self, batch: SchedulerOutput, failed: list[RequestOutput]
    ) -> tuple[SchedulerOutput, ModelOutput]:
        """Run a failed step's requests one by one: those that fail alone are failed
        (appended to `failed`), the others' outputs are put back together in order."""
        kept, output = SchedulerOutput(preempted=batch.preempted), ModelOutput()
        rows, prompt_logits = [], {}
        for seq, n in batch.scheduled:
            try:
                alone = self.execute(SchedulerOutput([(seq, n)]))
            except Exception as error:
                out = self.fail(seq, f"{type(error).__name__}: {error}")
                failed += [out] if out is not None else []
                continue
            kept.scheduled.append((seq, n))
            output.sample_seqs += alone.sample_seqs
            if alone.logits is not None:
                rows.append(alone.logits)
            prompt_logits.update(alone.prompt_logits)
        output.logits = torch.cat(rows) if rows else None
        output.prompt_logits = prompt_logits
        return kept, output

    def fail(self, seq: Sequence, error: str) -> RequestOutput | None:
        """End one request with an error; its blocks return to the pool now."""
        state = self.requests.pop(seq.request_id, None)
        if state is None:  # it had finished already
            return None
        state.error = error
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
        self.release(seq)
        self.requests_failed_total += 1
        log.error("request %s failed inside a step: %s", seq.request_id, error)
        return self.make_output(state)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the grammar-mask thread and the worker processes of tensor/pipeline
        parallelism. `wait=False`: kill the workers at once (a step is stuck on them in
        another thread)."""
        self._masker.shutdown(wait=False)
        if self.workers is None:
            return
        if wait:
            self.workers.shutdown()
        else:
            self.workers.kill()

    def update(
        self, batch: SchedulerOutput, output: ModelOutput, masks: Future | None = None
    ) -> list[RequestOutput]:
        self.scheduler.update_from_output(batch)
        results = []
        for request_id, (first, logits) in output.prompt_logits.items():
            seq = self.requests[request_id].seq
            try:
                self.sampler.prompt_logprobs(seq, first, logits)
            except Exception as error:  # this request's numbers: it alone fails
                out = self.fail(seq, f"{type(error).__name__}: {error}")
                results += [out] if out is not None else []
        if not output.sample_seqs:
            return results
        output, speculative = self.split_speculative(output)
        tokens: list = self.sample(output, masks) if output.sample_seqs else []
        rows = list(zip(output.sample_seqs, tokens, strict=True)) + speculative
        now = time.monotonic()
        for seq, token in rows:
            try:
                if isinstance(token, SamplingFailed):
                    raise token
                out = self.apply(seq, token, now)
            except Exception as error:  # this request's numbers or text: it alone fails
                out = self.fail(seq, f"{type(error).__name__}: {error}")
            if out is not None:
                results.append(out)
        return results

    def split_speculative(self, output: ModelOutput) -> tuple[ModelOutput, list[tuple]]:
        """The rows of speculative decodes (1 + k each) verified apart: the plain rows'
        output, and (seq, tokens it emits or SamplingFailed) for each speculative one."""
        seqs = output.sample_seqs
        spec = [i for i, seq in enumerate(seqs) if seq.spec_token_ids]
        if not spec:
            return output, []
        plain = [i for i, seq in enumerate(seqs) if not seq.spec_token_ids]
        logits = spec_logits = output.logits
        kept = ModelOutput([seqs[i] for i in plain], prompt_logits=output.prompt_logits)
        if plain:
            kept.logits = logits.index_select(0, torch.tensor(plain, device=logits.device))
            spec_logits = logits.index_select(0, torch.tensor(spec, device=logits.device))
        ordered = list(dict.fromkeys(seqs[i] for i in spec))
        try:
            verified = self.speculator.verify(spec_logits, ordered)
        except Exception as error:  # (a grammar, a device): each row fails alone
            log.warning("verifying %d speculative row(s) failed (%r)", len(ordered), error)
            verified = [SamplingFailed(f"{type(error).__name__}: {error}")] * len(ordered)
        return kept, list(zip(ordered, verified, strict=True))

    def sample(self, output: ModelOutput, masks: Future | None) -> list[int | SamplingFailed]:
        """The sampler over the batch; if it raises (a grammar mask, a device), each row
        is sampled alone and those that fail alone fail their requests only."""
        seqs = output.sample_seqs
        try:
            ready = masks.result() if masks is not None else None
            return self.sampler(output.logits, seqs, self.eos_token_ids, ready)
        except Exception as error:
            log.warning("sampling %d row(s) failed (%r): isolating", len(seqs), error)
        tokens: list[int | SamplingFailed] = []
        for i, seq in enumerate(seqs):
            try:
                tokens += self.sampler(output.logits[i : i + 1], [seq], self.eos_token_ids)
            except Exception as error:
                tokens.append(SamplingFailed(f"{type(error).__name__}: {error}"))
        return tokens

    def apply(self, seq: Sequence, token: int | list[int], now: float) -> RequestOutput | None:
        """Append a sampled token (a speculative row: its verified tokens, one by one),
        check the stops; the output to deliver, if any."""
        state = self.requests[seq.request_id]
        state.first_token_time = state.first_token_time or now
        tokens, status, emitted = [token] if isinstance(token, int) else token, None, 0
        for token in tokens:
            emitted += 1
            seq.append_token(token)
            self.generation_tokens_total += 1
            if seq.matcher is not None and not seq.matcher.consume_token(token):
                error = seq.matcher.get_error()
                raise SamplingFailed(f"the grammar refused token {token}: {error}")
            status = self.check_stop(state, token)
            if status is not None:
                break
        if seq.spec_token_ids:  # the rejected proposals' KV is not the sequence's
            self.speculator.stats.emitted += emitted
            seq.spec_token_ids = []
            del seq.logprobs[seq.num_output_tokens :]  # those of tokens a stop cut off
            if status is None:
                self.scheduler.rollback(seq)
        if status is not None:
            self.scheduler.finish(seq, status)
            self.release(seq)
            del self.requests[seq.request_id]
        if state.stream or status is not None:  # building outputs costs per token
            return self.make_output(state)
        return None

    def check_stop(self, state: RequestState, token: int) -> SequenceStatus | None:
        seq, params = state.seq, state.seq.sampling_params
        past_min = seq.num_output_tokens > params.min_tokens
        stop_string = None
        if state.detokenizer is not None:
            stop_string = state.detokenizer.add_token(token, check_stop=past_min)
        if past_min and not params.ignore_eos and token in self.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if past_min and token in params.stop_token_ids:
            state.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        if stop_string is not None:
            state.stop_reason = stop_string
            return SequenceStatus.FINISHED_STOPPED
        if seq.matcher is not None and seq.matcher.is_stopped():  # the grammar is complete
            return SequenceStatus.FINISHED_STOPPED
        if (
            seq.num_output_tokens >= params.max_tokens
            or seq.num_tokens >= self.config.max_model_len
        ):
            return SequenceStatus.FINISHED_LENGTH
        return None

    def make_output(self, state: RequestState) -> RequestOutput:
        seq = state.seq
        finished = seq.is_finished
        text, delta = "", ""
        if state.detokenizer is not None:
            delta = state.detokenizer.new_text(finished)
            text = state.detokenizer.text[: state.detokenizer.num_emitted]
        params = seq.sampling_params
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=seq.output_token_ids,
            logprobs=list(seq.logprobs) if params.logprobs is not None else None,
            finish_reason=seq.status.value if finished else None,
            stop_reason=state.stop_reason,
            delta_text=delta,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=state.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            prompt_logprobs=seq.prompt_logprobs if params.prompt_logprobs is not None else None,
            num_cached_tokens=seq.num_cached_tokens,
            metrics={
                "arrival_time": seq.arrival_time,
                "first_scheduled_time": seq.first_scheduled_time,
                "first_token_time": state.first_token_time or 0.0,
            },
            error=state.error,
        )

    # -- metrics --------------------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        bm = self.block_manager
        allocated, used = kv_slots(self.scheduler.running, bm.block_size)
        return EngineMetrics(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            kv_num_blocks=bm.num_blocks,
            kv_block_size=bm.block_size,
            kv_cache_usage=bm.usage(),
            kv_slots_allocated=allocated,
            kv_slots_used=used,
            kv_waste=(allocated - used) / allocated if allocated else 0.0,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            requests_failed_total=self.requests_failed_total,
            tokens_per_expert=self.tokens_per_expert(),
            lora=self.lora.stats() if self.lora is not None else {},
            **self.spec_metrics(),
        )

    def spec_metrics(self) -> dict:
        if self.speculator is None:
            return {}
        stats = self.speculator.stats
        return dict(
            spec_proposed_tokens=stats.proposed,
            spec_accepted_tokens=stats.accepted,
            spec_emitted_tokens=stats.emitted,
            spec_proposed_per_position=list(stats.proposed_at),
            spec_accepted_per_position=list(stats.accepted_at),
        )

    def tokens_per_expert(self) -> list[int]:
        """The MoE load metric; with workers, asked of them (a failed worker: empty)."""
        if self.workers is None:
            return self.runner.tokens_per_expert()
        # the next step reports a failure (and a failed collective stops the workers)
        with contextlib.suppress(WorkerDied), self.workers.collective():
            return self.runner.tokens_per_expert()
        return []


class LLM:
    """Offline batch generation: `LLM(path).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | Path, **kwargs: Any):
        self.engine = LLMEngine(model, **kwargs)

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("pass one SamplingParams or one per prompt")
        ids = [self.engine.add_request(None, p, sp) for p, sp in zip(prompts, params, strict=True)]
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[i] for i in ids]

    def shutdown(self) -> None:
        self.engine.shutdown()
