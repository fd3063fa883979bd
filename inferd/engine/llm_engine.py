"""The synchronous engine: `EngineRequest`s in, one `step()` at a time, `StepOutputs` out.

    add_request -> Scheduler.schedule -> ModelRunner.execute -> Scheduler.update
                -> OutputProcessor (detokenize, stops, lengths) -> EngineOutput per choice

The server drives `step()` from its engine thread (async_engine.py); `generate()` drives it to
completion for offline use and tests. Requests arrive checked (the front door validated them
against `limits`): the engine asserts what it relies on and does not check again.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from inferd.engine.builder import build_execution, free_execution, load_model
from inferd.engine.config import EngineConfig
from inferd.engine.health import EngineHealth
from inferd.engine.kv.block_manager import BlockManager
from inferd.engine.kv.events import KVEventRecorder
from inferd.engine.kv.state_slots import StateSlots
from inferd.engine.output.blocklist import CONTENT_FILTER, output_filter
from inferd.engine.output.pooled import pooled_answers, pooler_info
from inferd.engine.output.processor import OutputProcessor
from inferd.engine.protocol import (ConstraintError, EngineLimits, EngineOutput, EngineRequest, EngineSnapshot,
                                    Histogram, StepOutputs, TokenLogprob)
from inferd.engine.sched.accounting import request_metrics
from inferd.engine.sched.request import Request, RequestStatus
from inferd.engine.sched.scheduler import Scheduler, SchedulerOutput
from inferd.engine.spec.speculator import Speculator
from inferd.engine.worker.executor import StepExecutor, StepFailed
from inferd.engine.worker.kv_cache import device_memory
from inferd.engine.worker.runner import StepResult
from inferd.engine.worker.speculation import rows_by_request
from inferd.engine.worker.faults import FaultInjector
from inferd.model.decoder import DecoderModel
from inferd.model.loading.loader import default_model_path
from inferd.model.pooling import load_pooler
from inferd.text.sampling_params import SamplingParams
from inferd.text.tokenizer import Tokenizer
from inferd.settings.policy import Timeouts

log = logging.getLogger(__name__)

STATUS_REQUESTS = 100  # requests listed in a snapshot at most
MIN_TOKEN_BUDGET = 16  # tokens per step that out-of-memory backoff never goes below
OOM_RECOVER_STEPS = 64  # clean steps before the token budget doubles back
ENDINGS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH,
           CONTENT_FILTER: RequestStatus.FINISHED_FILTERED}  # OutputProcessor's endings


@dataclass
class Completion:
    group_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # (params.prompt_logprobs) prompt tokens 1..


class LLMEngine:
    def __init__(self, model: DecoderModel, tokenizer: Tokenizer, config: EngineConfig) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.model_config = model.cfg
        self.max_model_len = min(config.model.max_model_len or model.cfg.max_position_embeddings,
                                 model.cfg.max_position_embeddings)
        execution = build_execution(model, config, self.max_model_len)
        self.kv_cache, self.runner = execution.kv_cache, execution.runner
        # (a hybrid model runs as many sequences at once as it has working state slots)
        self.max_num_seqs = min(config.scheduler.max_num_seqs, execution.num_working_slots or config.scheduler.max_num_seqs)
        state = (StateSlots(execution.num_state_slots, execution.num_host_state_slots, self.max_num_seqs)
                 if execution.num_state_slots else None)
        # ([kv_events] on) what the prefix cache files and evicts, handed out with each step
        self.kv_events = KVEventRecorder(config.cache.block_size, config.kv_events.tenant_token_ids) if (
            config.kv_events.enabled) else None
        self.block_manager = BlockManager(execution.num_blocks, config.cache.block_size,
                                          num_host_blocks=execution.num_host_blocks,
                                          # (bidirectional attention: a block's K/V depend on what follows it)
                                          enable_prefix_caching=config.cache.prefix_caching and not model.cfg.bidirectional,
                                          windows=self.kv_cache.layout.windows, state=state,
                                          num_tier_blocks=execution.num_tier_blocks, session_share=config.cache.session_share,
                                          events=self.kv_events)
        self.policy = config.policy
        self.scheduler = Scheduler(self.block_manager, self.max_num_seqs, config.scheduler.max_num_batched_tokens,
                                   config.policy)
        # how pooling requests (embeddings, scores) pool: None where the model answers none
        self.pooler = (load_pooler(config.model.path, model.cfg.hidden_size, config.model.pooling,
                                   config.model.normalize)
                       if config.model.task != "generate" or config.model.embeddings else None)
        self.runner.pooler = self.pooler
        # (a hybrid model's linear layers would need their state at every draft position)
        self.speculator = Speculator(config.speculative, "its linear-attention layers' state cannot take back rejected "
                                     "drafts" if state is not None else None)
        self.outputs = OutputProcessor(tokenizer, output_filter(config.output_filter))
        self.executor = StepExecutor(self.runner)
        self.executor.faults = FaultInjector.from_environ()
        self.health = EngineHealth(config.health.failure_window_seconds, config.health.recover_seconds)
        self._ok_steps_since_oom = 0
        self.limits = self._limits()
        self.last_step_tokens = 0  # tokens computed by the last step (0: it found nothing to run)
        self.requests: dict[int, Request] = {}  # every unfinished choice, by seq_id
        self._groups: dict[int, Request] = {}  # group_id -> its choice 0
        self._seq_ids = itertools.count()
        self._group_ids = itertools.count()  # for offline requests (the server hands out its own)

    @property
    def faults(self) -> FaultInjector | None:
        """Fault injection, for tests only (None: off; see engine/worker/faults.py)."""
        return self.executor.faults

    @faults.setter
    def faults(self, injector: FaultInjector | None) -> None:
        self.executor.faults = injector

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(*load_model(config), config)

    release_kv = free_execution  # sleep, level 1 (builder.py): the KV cache freed, the weights kept; its bytes

    def restore_kv(self) -> None:  # wake: all but the weights and tokenizer built again, as at start
        self.__init__(self.model, self.tokenizer, self.config)  # type: ignore[misc]

    def _limits(self) -> EngineLimits:
        num_blocks, bs = self.block_manager.pool.num_blocks, self.config.cache.block_size
        return EngineLimits(
            max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size,
            max_num_seqs=self.max_num_seqs, block_size=bs, num_kv_blocks=num_blocks,
            class_kv_tokens={c.name: self.kv_cache.layout.max_tokens(num_blocks - self.scheduler.reserve_blocks(c), bs,
                                                                     self.config.scheduler.max_num_batched_tokens)
                             for c in self.policy.classes},
            policy=self.policy, architecture=self.model_config.architecture, num_layers=self.model_config.num_layers,
            dtype=str(self.model.dtype).removeprefix("torch."), device=str(self.model.device),
            model_path=self.config.model.path or str(default_model_path()),
            output_filter=self.config.output_filter is not None,
            experts=(experts.num_experts, experts.top_k) if (experts := self.model_config.experts) else None,
            task=self.config.model.task,
            pooler=pooler_info(self.pooler, self.config.model.task, self.model_config.bidirectional,
                               self.max_model_len, self.config.scheduler.max_num_batched_tokens),
        )

    # ------------------------------------------------------------------------------ requests

    def add_request(self, request: EngineRequest) -> None:
        """Queue a group of n choices sharing one prompt (checked at the door already)."""
        prompt_ids, n = request.prompt_ids, request.n
        assert request.group_id not in self._groups, f"group id {request.group_id} is in use"
        assert 0 < len(prompt_ids) < self.max_model_len and 1 <= n <= self.max_num_seqs, \
            f"a request the door refuses: {len(prompt_ids)} prompt tokens, n={n}"
        cls = self.policy.lookup(request.priority_class)
        arrival = request.arrival_time if request.arrival_time is not None else self.scheduler.clock()
        group = request.group_id
        constraint = request.constraint
        shared = dict(tenant=request.tenant, tenant_weight=request.tenant_weight, cache_salt=request.cache_salt,
                      draft_history=request.draft_history, session=request.session)
        root = Request(next(self._seq_ids), prompt_ids, request.params, self.max_model_len, group_id=group,
                       priority_class=cls, timeouts=request.timeouts, arrival_time=arrival, constraint=constraint,
                       **shared)  # type: ignore[arg-type]
        root.forks = [Request(next(self._seq_ids), prompt_ids, request.params, self.max_model_len, index=i,
                              group_id=group, constraint=constraint.fork() if constraint else None,
                              **shared)  # type: ignore[arg-type]
                      for i in range(1, n)]
        if request.pooling is not None:
            assert n == 1 and (request.pooling.task == "score" or self.pooler is not None), "a pooling request the door refuses"
            root.pooling = request.pooling
            root.pools_every_token = request.pooling.task == "embed" and self.pooler.method != "last"
            root.one_chunk = self.model_config.bidirectional
        self._groups[group] = root
        if self.faults is not None:
            self.faults.on_add(group, self.tokenizer.decode(prompt_ids))
        for member in (root, *root.forks):
            self.requests[member.seq_id] = member
            self.outputs.add(member, self.outputs.hooks(request.segment))
        self.scheduler.add(root)

    def add(self, prompt: str | Sequence[int], params: SamplingParams, n: int = 1, *,
            priority: str | int | None = None, timeouts: Timeouts | None = None) -> int:
        """Offline use: queue a prompt (text or ids) in the class `priority` names, its timeouts
        tightened by `timeouts` (what the door does for a served request); its group id."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        group = next(self._group_ids)
        cls = self.policy.lookup(priority)
        self.add_request(EngineRequest(group, prompt_ids, params, cls.name, n,
                                       cls.timeouts.tightened(timeouts or Timeouts())))
        return group

    def abort(self, group_id: int) -> None:
        """Abort a group and all its choices; unknown or finished ids are ignored."""
        root = self._groups.pop(group_id, None)
        if root is None:
            return
        for member in (root, *root.forks):
            if self.requests.pop(member.seq_id, None) is not None:
                self._finish(member, RequestStatus.FINISHED_ABORTED)

    def pause(self, group_id: int, paused: bool) -> None:
        """Skip (or resume) a group's steps, keeping its KV blocks; unknown ids are ignored."""
        root = self._groups.get(group_id)
        if root is not None:
            for member in (root, *root.forks):
                self.scheduler.pause(member, paused)

    def group_ids(self) -> list[int]:
        """The groups not finished yet."""
        return list(self._groups)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---------------------------------------------------------------------------------- step

    def step(self) -> StepOutputs:
        step = self._step()
        if self.kv_events is not None:
            step.kv_events = self.kv_events.take()
        return step

    def _step(self) -> StepOutputs:
        if self.faults is not None:
            self.faults.before_step(self.model)
        self.speculator.draft(self.scheduler.running)
        plan = self.scheduler.schedule()
        step = StepOutputs(started=[r.group_id for r in plan.started if r.index == 0])
        for request in plan.timed_out:
            step.outputs += self._timed_out(request)
        self.last_step_tokens = plan.num_tokens
        if not plan.chunks:
            self.runner.apply_block_ops(plan)  # (copies a step may have without chunks: a swap-in, the host tier's)
            return step
        start = time.perf_counter()
        try:
            result = self.executor.run(plan)
        except StepFailed as e:
            # its requests fail (retryable); swapped-out victims too, whose copies may be partial
            self.health.forward_failed()
            failed = [c.request for c in plan.chunks] + [r for r in plan.preempted if r.swapped]
            for request in failed:
                step.outputs += self._fail_group(request.group_id, "engine_error", f"the engine step failed: {e}")
            return step
        self._after_run(plan, step)
        if plan.prefills:
            step.prefill_tokens, step.step_seconds = plan.num_prefill_tokens, time.perf_counter() - start
        self._note_prompt_logprobs(result.prompt_logprobs)
        last_row, accepted = rows_by_request(result.seq_ids, result.sampled.token_ids)
        self.scheduler.update(plan, {seq_id: result.sampled.token_ids[row] for seq_id, row in last_row.items()},
                              accepted)
        self.speculator.after_step(plan, accepted)
        if result.pooled:
            step.outputs += self._pooled(result.pooled)
        self._deliver(result, last_row, bool(accepted), step)
        return step

    def _deliver(self, result: StepResult, last_row: dict[int, int], merge: bool, step: StepOutputs) -> None:
        """Each sampled token through its choice's output processing, into the step's outputs
        (`merge`: a choice's tokens of the step in one output); a choice ends where they say."""
        sampled, faults = result.sampled, self.faults
        merged: dict[int, EngineOutput] = {}  # (speculation) each choice's one output of the step
        for row, seq_id in enumerate(result.seq_ids):
            request = self.requests.get(seq_id)
            if request is None:
                continue  # its group failed, or the choice ended, earlier in this loop
            try:
                if seq_id in result.failed:
                    raise result.failed[seq_id]
                if faults is not None:
                    faults.check_output(request.group_id)
                later = last_row[seq_id] - row  # its tokens after this one in this step
                out, ending = self.outputs.on_token(request, sampled.token_ids[row], sampled, row, later)
                if request.params.prompt_logprobs is not None and len(request.output_ids) == 1:
                    out.prompt_logprobs = request.prompt_logprobs  # (with the first token: all of them)
            except ConstraintError as e:  # the client's grammar met a limit: its fault, not the engine's
                log.info("request %d: its grammar could not go on: %s", request.group_id, e)
                step.outputs += self._fail_group(request.group_id, "invalid_grammar", str(e))
                continue
            except Exception as e:  # noqa: BLE001 - this request's own code failed: it fails alone
                log.exception("request %d failed in its output processing", request.group_id)
                self.health.request_failed()
                step.outputs += self._fail_group(request.group_id, "internal_error", f"{type(e).__name__}: {e}")
                continue
            if ending is not None:
                if later:  # ended before its last accepted tokens: they were never output
                    del request.output_ids[-later:]
                status = ENDINGS[ending]
                self._finish(request, status)
                out.finished, out.finish_reason = True, status.finish_reason
                out.metrics = request_metrics(request, self.scheduler.clock())
                self._retire(request)
            if merge and seq_id in merged:
                merged[seq_id].extend(out)
            else:
                merged[seq_id] = out
                step.outputs.append(out)

    def _pooled(self, pooled: dict[int, torch.Tensor | float]) -> list[EngineOutput]:
        """The final outputs of the pooling requests whose prompt this step finished."""
        requests = [self.requests[seq_id] for seq_id in pooled if seq_id in self.requests]
        answers = pooled_answers(requests, pooled, self.pooler)
        outputs = []
        for request in requests:
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            vector, score = answers[request.seq_id]
            outputs.append(EngineOutput(request.group_id, [], "", finished=True, finish_reason="stop", pooled=vector,
                                        score=score, metrics=request_metrics(request, self.scheduler.clock())))
            self._retire(request)
        return outputs

    def _note_prompt_logprobs(self, computed: dict[int, tuple[int, list[TokenLogprob]]]) -> None:
        """Add each prompt position's logprobs once: a prefill recomputed after a preemption
        computes some again."""
        for seq_id, (first, entries) in computed.items():
            request = self.requests.get(seq_id)
            if request is None:
                continue
            done = request.prompt_logprobs
            done += entries[max(0, len(done) - first):] if first <= len(done) else []

    def _after_run(self, plan: SchedulerOutput, step: StepOutputs) -> None:
        """Health and memory bookkeeping of a step whose forward ran (whole or in pieces)."""
        self.health.step_ok()
        executor, scheduler = self.executor, self.scheduler
        for _ in range(executor.out_of_memory_events):
            self.health.out_of_memory()
        for request in executor.no_room:  # did not fit even alone: out of the plan, then failed
            for chunks in (plan.prefills, plan.decodes):
                chunks[:] = [c for c in chunks if c.request is not request]
            step.outputs += self._fail_group(request.group_id, "out_of_memory",
                                             "the request did not fit in memory, even in a step of its own")
        # NOTE: after an out-of-memory step the next steps start smaller (half the tokens); the
        # budget doubles back after OOM_RECOVER_STEPS clean steps
        if executor.out_of_memory_events:
            scheduler.max_num_batched_tokens = max(MIN_TOKEN_BUDGET, scheduler.max_num_batched_tokens // 2)
            self._ok_steps_since_oom = 0
        elif scheduler.max_num_batched_tokens < self.config.scheduler.max_num_batched_tokens:
            self._ok_steps_since_oom += 1
            if self._ok_steps_since_oom >= OOM_RECOVER_STEPS:
                scheduler.max_num_batched_tokens = min(self.config.scheduler.max_num_batched_tokens,
                                                       2 * scheduler.max_num_batched_tokens)
                self._ok_steps_since_oom = 0

    def _fail_group(self, group_id: int, code: str, message: str) -> list[EngineOutput]:
        """End every unfinished choice of a group with finish_reason "error" and free its blocks."""
        root = self._groups.get(group_id)
        outputs: list[EngineOutput] = []
        for member in (root, *root.forks) if root is not None else ():
            if member.seq_id not in self.requests:
                continue
            self._finish(member, RequestStatus.FINISHED_ERROR)
            outputs.append(EngineOutput(group_id, [], "", member.index, True, "error", message,
                                        metrics=request_metrics(member, self.scheduler.clock()), error=code))
            self._retire(member)
        return outputs

    def _timed_out(self, request: Request) -> list[EngineOutput]:
        """The final outputs of a request the scheduler ended on a timeout, and of its forks
        that never started (they share its prompt and its fate)."""
        kind = request.timeout_kind
        outputs = []
        for member in (request, *request.forks_pending):
            if member.seq_id not in self.requests:
                continue
            text = self.outputs.flush(member.seq_id)
            self._finish(member, RequestStatus.FINISHED_TIMEOUT)
            member.timeout_kind = kind
            outputs.append(EngineOutput(member.group_id, [], text, index=member.index, finished=True,
                                        finish_reason="timeout", stop_reason=kind,
                                        metrics=request_metrics(member, self.scheduler.clock())))
            self._retire(member)
        return outputs

    def _retire(self, request: Request) -> None:
        """Forget a finished choice; the group goes when all its choices have finished."""
        del self.requests[request.seq_id]
        root = self._groups.get(request.group_id)
        if root is not None and all(m.status.finished for m in (root, *root.forks)):
            del self._groups[request.group_id]

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        self.runner.release(request.seq_id)
        self.speculator.release(request)
        self.outputs.remove(request.seq_id)

    # ---------------------------------------------------------------------------- publishing

    def snapshot(self, steps: int, step_seconds: float, step_hist: Histogram, batch_hist: Histogram) -> EngineSnapshot:
        """The engine's state now, as immutable data for other threads (O(requests))."""
        bm, scheduler = self.block_manager, self.scheduler
        classes = tuple(scheduler.snapshot())
        return EngineSnapshot(
            kv_blocks_total=bm.pool.num_blocks, kv_blocks_used=bm.num_used_blocks,
            kv_blocks_cached=bm.num_cached_blocks, running=len(scheduler.running), waiting=len(scheduler.waiting),
            steps=steps, preemptions=dict(scheduler.preemptions), timeouts=dict(scheduler.timeouts),
            prefix_queries=bm.prefix_queries, prefix_hits=bm.prefix_hits, shed_level=scheduler.shedder.level,
            shed_actions=dict(scheduler.shedder.actions), last_step_seconds=step_seconds, classes=classes,
            requests=tuple(scheduler.requests_snapshot(STATUS_REQUESTS)), step_seconds=step_hist,
            batch_tokens=batch_hist, device_memory=device_memory(self.model.device),
            healthy=self.health.healthy, consecutive_step_failures=self.health.consecutive,
            step_failures=dict(self.health.failures), oom_events_last_minute=self.health.ooms_last_minute(),
            token_budget=scheduler.max_num_batched_tokens, tenants=scheduler.tenants_snapshot(),
            experts_routed=tuple(tuple(m.routed.tolist()) for m in self.model.mixtures() if m is not None),
            state_slots=bm.state.snapshot(self.kv_cache.state_bytes_per_slot) if bm.state is not None else None,
            speculation=self.speculator.snapshot(), cache_tiers=bm.tiers.snapshot(),
        )

    # ------------------------------------------------------------------------------- offline

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """Run every prompt to completion in one continuously batched run."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [self.add(p, sp) for p, sp in zip(prompts, params_list)]
        prompt_ids = {i: self._groups[i].prompt_ids for i in ids}
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        texts: dict[int, list[str]] = {i: [] for i in ids}
        logprobs: dict[int, list[TokenLogprob]] = {i: [] for i in ids}
        prompt_logprobs: dict[int, list[TokenLogprob]] = {}
        finish: dict[int, str | None] = {}
        while self.has_work():
            for out in self.step().outputs:
                tokens[out.group_id] += out.new_token_ids
                texts[out.group_id].append(out.text)
                logprobs[out.group_id] += out.logprobs or []
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.group_id] = out.prompt_logprobs
                if out.finished:
                    finish[out.group_id] = out.finish_reason
        return [
            Completion(i, prompt_ids[i], tokens[i], "".join(texts[i]), finish.get(i),
                       logprobs[i] if params_list[n].logprobs is not None else None, prompt_logprobs.get(i))
            for n, i in enumerate(ids)
        ]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams) -> Iterator[EngineOutput]:
        """One request's outputs as they are generated."""
        group = self.add(prompt, params)
        while self.has_work():
            for out in self.step().outputs:
                if out.group_id == group:
                    yield out
                    if out.finished:
                        return
