"""The synchronous engine: requests in, one `step()` at a time, token and text deltas out.

    add_request -> Scheduler.schedule -> ModelRunner.execute -> Scheduler.update
                -> detokenize, check stops and lengths -> RequestOutput per request

The server (a later layer) drives `step()` from its engine loop; `generate()` drives it to
completion for offline use and tests.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from inferd.engine.admission import Admission
from inferd.engine.block_manager import BlockManager
from inferd.engine.cuda_graphs import DecodeGraphs
from inferd.engine.kv_cache import KVCache, auto_kv_cache_memory, host_blocks_for, num_blocks_for
from inferd.engine.policy import PriorityClass, SchedulingPolicy, Timeouts
from inferd.engine.request import Request, RequestStatus
from inferd.engine.runner import ModelRunner
from inferd.engine.scheduler import Scheduler
from inferd.model.attention import CudaAttention, select_attention
from inferd.model.detokenizer import IncrementalDetokenizer
from inferd.model.errors import ModelLoadError
from inferd.model.llama import LlamaModel
from inferd.model.loader import default_model_path, load_checkpoint
from inferd.model.sampling_params import SamplingParams
from inferd.model.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # a GGUF file or a Hugging Face folder; None: the embedded default
    dtype: str = "auto"  # auto: bfloat16 on CPU and CUDA
    device: str = "auto"  # auto: cuda when available
    block_size: int = 16
    kv_cache_memory: float | None = 2 * 1024**3  # bytes, a fraction (0, 1] of free memory, or None: auto
    cuda_graphs: bool = True  # on CUDA, replay decode steps from captured graphs
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's context length
    policy: SchedulingPolicy = SchedulingPolicy()
    enable_prefix_caching: bool = True
    swap_space: float = 2**30  # bytes of host memory for swapped-out blocks (preemption_mode "swap")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was asked for, but torch sees no CUDA device")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16
        return DTYPES[self.dtype]


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives, best first


@dataclass(frozen=True)
class RequestMetrics:
    """How a finished request went, in seconds from its arrival (None: it never got there)."""

    priority_class: str
    prompt_tokens: int
    cached_tokens: int  # of which the prefix cache supplied
    output_tokens: int
    queue_time: float | None
    ttft: float | None
    e2e: float
    preemptions: int

    @classmethod
    def of(cls, request: Request, now: float) -> RequestMetrics:
        arrival = request.arrival_time if request.arrival_time is not None else now

        def since(t: float | None) -> float | None:
            return None if t is None else t - arrival

        return cls(request.priority_class.name if request.priority_class else "-", len(request.prompt_ids),
                   request.num_cached_tokens, len(request.output_ids), since(request.first_scheduled_time),
                   since(request.first_token_time), now - arrival, request.num_preemptions)


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: int  # the id add_request returned
    new_token_ids: list[int]
    text: str  # new text (stop strings and held-back partial characters excluded)
    index: int = 0  # which of the request's n choices
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" or "timeout"
    stop_reason: str | int | None = None  # the stop string or token id that matched; the
    # timeout's kind ("queue", "ttft", "token", "total") with "timeout"; a message with "abort"
    logprobs: list[TokenLogprob] | None = None
    metrics: RequestMetrics | None = None  # with the finished output


@dataclass
class Completion:
    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


class RequestError(ValueError):
    """A request that can never run; `param` names the offending field (OpenAI's error body)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class LLMEngine:
    def __init__(self, model: LlamaModel, tokenizer: Tokenizer, config: EngineConfig) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.model_config = model.cfg
        self.max_model_len = min(config.max_model_len or model.cfg.max_position_embeddings,
                                 model.cfg.max_position_embeddings)
        memory = config.kv_cache_memory
        if memory is None:
            memory = auto_kv_cache_memory(model.cfg, model.dtype, model.device, config.max_num_batched_tokens,
                                          config.max_num_seqs, self.max_model_len)
        num_blocks = num_blocks_for(memory, model.cfg, config.block_size, model.dtype, model.device)
        num_host_blocks = 0
        if config.policy.preemption_mode == "swap":
            num_host_blocks = host_blocks_for(config.swap_space, model.cfg, config.block_size, model.dtype)
        self.kv_cache = KVCache(model.cfg, num_blocks, config.block_size, model.dtype, model.device,
                                num_host_blocks=num_host_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size, num_host_blocks=num_host_blocks,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.policy = config.policy
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.policy)
        # the door's bounded queues: the server admits into them, the engine thread releases
        self.admission = Admission(config.policy.classes)
        model.set_attention(select_attention(
            model.device, model.dtype, model.cfg.num_heads, model.cfg.num_kv_heads, model.cfg.head_dim,
            config.block_size, config.max_num_seqs, self.max_model_len))
        graphs = None
        if config.cuda_graphs and isinstance(model.attention, CudaAttention):
            graphs = DecodeGraphs(model, self.kv_cache, config.max_num_seqs, self.max_model_len)
            graphs.capture()
        self.runner = ModelRunner(model, self.kv_cache, graphs=graphs)
        self.last_step_tokens = 0  # tokens computed by the last step (0: it found nothing to run)
        self.requests: dict[int, Request] = {}  # every unfinished choice, by its own id
        self._groups: dict[int, Request] = {}  # request id (as returned by add_request) -> choice 0
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}  # per unfinished request
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        path = Path(config.model) if config.model else default_model_path()
        device, dtype = config.resolved_device(), config.resolved_dtype()
        start = time.perf_counter()
        checkpoint = load_checkpoint(path, dtype)
        tokenizer = load_tokenizer(path, gguf_metadata=checkpoint.gguf_metadata)
        weights = {name: t.to(device) for name, t in checkpoint.tensors.items()}
        try:
            model = LlamaModel(checkpoint.config, weights, dtype)
        except ModelLoadError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        log.info("loaded %s (%s, %s) in %.2f s", path, dtype, device, time.perf_counter() - start)
        return cls(model, tokenizer, config)

    # ------------------------------------------------------------------------------ requests

    def resolve_class(self, priority: str | int | PriorityClass | None) -> PriorityClass:
        """The class a request's `priority` names (name, number, or None for the default)."""
        if isinstance(priority, PriorityClass):
            return priority
        try:
            return self.policy.lookup(priority)
        except KeyError:
            known = ", ".join(f"{c.name!r} ({c.priority})" for c in self.policy.ranked)
            raise RequestError(f"unknown priority {priority!r}; the classes are {known}",
                               param="priority") from None

    def check_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, n: int = 1, priority_class: PriorityClass | None = None
    ) -> None:
        """Raise RequestError if the request can never run; reads only fixed facts, so any
        thread may call it before handing the request to the engine's owner."""
        cls = priority_class or self.resolve_class(None)
        vocab = self.model_config.vocab_size
        if not prompt_ids:
            raise RequestError("the prompt is empty", param="prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.max_model_len} tokens",
                param="prompt", code="context_length_exceeded",
            )
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
        if not 1 <= n <= self.config.max_num_seqs:
            raise RequestError(f"n must be in [1, {self.config.max_num_seqs}], got {n}", param="n")
        if params.max_tokens > cls.max_tokens:
            raise RequestError(f"max_tokens must be at most {cls.max_tokens} in the {cls.name!r} class, "
                               f"got {params.max_tokens}", param="max_tokens")
        total = min(self.max_model_len, len(prompt_ids) + params.max_tokens)
        num_blocks = self.block_manager.pool.num_blocks - self.scheduler.reserve_blocks(cls)
        capacity = num_blocks * self.config.block_size
        if total > capacity:
            # NOTE: it could never finish: it would preempt itself forever
            raise RequestError(
                f"the request needs up to {total} tokens of KV cache; the {cls.name!r} class may use "
                f"{capacity} (lower max_tokens, or raise kv_cache_memory)", param="max_tokens",
            )

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        n: int = 1,
        request_id: int | None = None,
        *,
        priority: str | int | PriorityClass | None = None,
        timeouts: Timeouts | None = None,
        arrival_time: float | None = None,
        admitted: bool = False,
    ) -> int:
        """Queue a request with n choices sharing the prompt; returns its id (`request_id` if
        given), which its outputs and `abort` use.

        `priority` names its class; `timeouts` tighten the class's; `arrival_time` (on the
        scheduler's clock) is when it reached the server; `admitted`: the door counted it in
        `self.admission`, which it leaves when first scheduled (or when it ends before).
        """
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        cls = self.resolve_class(priority)
        self.check_request(prompt_ids, params, n, cls)
        if request_id is not None and request_id in self._groups:
            raise ValueError(f"request id {request_id} is in use")
        root = Request(next(self._ids), prompt_ids, params, self.max_model_len, priority_class=cls,
                       timeouts=timeouts or Timeouts(), arrival_time=arrival_time,
                       admitted_tokens=len(prompt_ids) if admitted else 0)
        group_id = root.request_id if request_id is None else request_id
        root.group_id = group_id
        root.forks = [
            Request(next(self._ids), prompt_ids, params, self.max_model_len, index=i, group_id=group_id)
            for i in range(1, n)
        ]
        self._groups[group_id] = root
        for member in (root, *root.forks):
            self.requests[member.request_id] = member
            self._detokenizers[member.request_id] = IncrementalDetokenizer(self.tokenizer, params, prompt_ids)
        self.scheduler.add(root)
        return group_id

    def abort(self, request_id: int) -> None:
        """Abort a request and all its choices; unknown or finished ids are ignored."""
        root = self._groups.pop(request_id, None)
        if root is None:
            return
        for member in (root, *root.forks):
            if self.requests.pop(member.request_id, None) is not None:
                self._finish(member, RequestStatus.FINISHED_ABORTED)

    def request_ids(self) -> list[int]:
        """The ids of the requests not finished yet."""
        return list(self._groups)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---------------------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        for request in plan.started:
            self._leave_queue(request)
        outputs = [out for request in plan.timed_out for out in self._timed_out(request)]
        self.last_step_tokens = plan.num_tokens
        if not plan.chunks:
            return outputs
        start = time.perf_counter()
        result = self.runner.execute(plan)
        if plan.prefills:
            self.admission.record_prefill(plan.num_prefill_tokens, time.perf_counter() - start)
        sampled = result.sampled
        self.scheduler.update(plan, dict(zip(result.request_ids, sampled.token_ids)))
        for row, request_id in enumerate(result.request_ids):
            request = self.requests[request_id]
            token = sampled.token_ids[row]
            detokenizer = self._detokenizers[request_id]
            update = detokenizer.step(token)
            out = RequestOutput(request.group_id, [token], update.text, index=request.index)
            if request.params.logprobs is not None:
                out.logprobs = [TokenLogprob(token, sampled.logprobs[row], sampled.top_logprobs[row])]
            if update.finished:
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                out.stop_reason = update.stop_reason
            elif request.num_tokens >= request.max_total_tokens:
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                out.text += detokenizer.flush()
            if request.status.finished:
                out.finished, out.finish_reason = True, request.status.finish_reason
                out.metrics = RequestMetrics.of(request, self.scheduler.clock())
                self._retire(request)
            outputs.append(out)
        return outputs

    def _timed_out(self, request: Request) -> list[RequestOutput]:
        """The final outputs of a request the scheduler ended on a timeout, and of its forks
        that never started (they share its prompt and its fate)."""
        kind = request.timeout_kind
        members = [request, *request.forks_pending]
        outputs = []
        for member in members:
            if member.request_id not in self.requests:
                continue
            detokenizer = self._detokenizers.get(member.request_id)
            text = detokenizer.flush() if detokenizer is not None else ""
            self._finish(member, RequestStatus.FINISHED_TIMEOUT)
            member.timeout_kind = kind
            outputs.append(RequestOutput(member.group_id, [], text, index=member.index, finished=True,
                                         finish_reason="timeout", stop_reason=kind,
                                         metrics=RequestMetrics.of(member, self.scheduler.clock())))
            self._retire(member)
        return outputs

    def _retire(self, request: Request) -> None:
        """Forget a finished request; the group goes when all its choices have finished."""
        del self.requests[request.request_id]
        root = self._groups.get(request.group_id)
        if root is not None and all(m.status.finished for m in (root, *root.forks)):
            del self._groups[request.group_id]

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        self.runner.release(request.request_id)
        self._detokenizers.pop(request.request_id, None)
        if request.first_scheduled_time is None:
            self._leave_queue(request)

    def _leave_queue(self, request: Request) -> None:
        """It no longer counts against the door's queue bounds (scheduled, or ended first)."""
        if request.admitted_tokens:
            self.admission.leave(request.priority_class.name, 1, request.admitted_tokens)
            request.admitted_tokens = 0

    # ------------------------------------------------------------------------------- offline

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """Run every prompt to completion in one continuously batched run."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        texts: dict[int, list[str]] = {i: [] for i in ids}
        logprobs: dict[int, list[TokenLogprob]] = {i: [] for i in ids}
        finish: dict[int, str | None] = {}
        prompt_ids = {i: self.requests[i].prompt_ids for i in ids}
        while self.has_work():
            for out in self.step():
                tokens[out.request_id] += out.new_token_ids
                texts[out.request_id].append(out.text)
                logprobs[out.request_id] += out.logprobs or []
                if out.finished:
                    finish[out.request_id] = out.finish_reason
        return [
            Completion(i, prompt_ids[i], tokens[i], "".join(texts[i]), finish.get(i),
                       logprobs[i] if params_list[n].logprobs is not None else None)
            for n, i in enumerate(ids)
        ]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """One request's outputs as they are generated."""
        request_id = self.add_request(prompt, params)
        while self.has_work():
            for out in self.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return

