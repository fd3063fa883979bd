"""The `inferd` command. Each subcommand is a few lines that call into the packages."""

from __future__ import annotations

import inspect
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from inferd.settings import environment

if TYPE_CHECKING:  # (imported where used: `inferd --help` stays quick)
    from inferd.api.gateway.tenants import Keyring
    from inferd.api.routing.served import ModelSpec
    from inferd.engine.async_engine import AsyncEngine
    from inferd.settings.config import Settings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="inferd: an LLM inference serving daemon.")

ConfigOption = Annotated[
    Optional[Path], typer.Option("--config", "-c", help="settings file (default: ./inferd.toml if present)")
]


@app.callback()
def _root() -> None:
    """inferd: an LLM inference serving daemon."""


def _fail(message: str) -> None:
    typer.echo(f"inferd: error: {message}", err=True)
    raise typer.Exit(1)


def _serve_settings(settings_file: Path | None, overrides: dict[str, dict[str, Any]], cli_keys: list[str]
                    ) -> tuple[Settings, frozenset[str], Callable[[], Keyring]]:
    """The settings, the plain keys' digests, and how SIGHUP reads the keys and tenants again
    (the same files and flags); a bad setting or keys file ends the command."""
    from inferd.api.gateway.keys import load_api_keys
    from inferd.api.gateway.tenants import Keyring
    from inferd.settings.config import load_settings
    from inferd.settings.values import SettingsError

    def read_keys(settings: Settings) -> frozenset[str]:
        return load_api_keys(cli_keys, environment.API_KEYS.get(), settings.server.api_keys_file)

    def reload_keys() -> Keyring:
        settings = load_settings(settings_file, overrides)
        return Keyring.build(settings, read_keys(settings))

    try:
        settings = load_settings(settings_file, overrides)
        return settings, read_keys(settings), reload_keys
    except SettingsError as e:
        _fail(str(e))


def _settings_file(config: Path | None) -> Path | None:
    if config is not None:
        return config
    default = Path("inferd.toml")
    return default if default.is_file() else None


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="the prompt (a chat user message with --chat)")],
    model: Annotated[Optional[str], typer.Option(help="GGUF file or Hugging Face folder")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="tokens to generate at most")] = 128,
    chat: Annotated[bool, typer.Option("--chat", help="wrap the prompt in the model's chat template")] = False,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 is greedy")] = 0.7,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="same seed, same tokens")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="float32, bfloat16 or float16 (default: settings)")] = None,
    config: ConfigOption = None,
) -> None:
    """Generate a completion offline and print it as it is produced."""
    from inferd.engine.config import EngineConfig
    from inferd.engine.llm_engine import LLMEngine
    from inferd.settings.config import load_settings
    from inferd.settings.flags import overrides
    from inferd.settings.values import SettingsError
    from inferd.text.errors import ModelLoadError
    from inferd.text.sampling_params import SamplingParams

    try:  # (--model and --dtype are serve's flags of the same names: the same keys)
        settings = load_settings(_settings_file(config), overrides({"model": model, "dtype": dtype}))
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    except (SettingsError, ValueError) as e:
        _fail(str(e))
    _configure_runtime(settings.runtime.threads)
    start = time.perf_counter()
    try:
        engine = LLMEngine.from_config(EngineConfig.from_settings(settings))
    except (ModelLoadError, ValueError) as e:
        _fail(str(e))
    loaded = time.perf_counter()
    try:
        tokenizer = engine.tokenizer
        if chat:  # the template writes BOS itself where the model wants one
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            prompt_ids = tokenizer.encode(prompt)
        n_tokens = 0
        for out in engine.stream(prompt_ids, params):
            n_tokens += len(out.new_token_ids)
            sys.stdout.write(out.text)
            sys.stdout.flush()
    except ValueError as e:
        _fail(str(e))
    done = time.perf_counter()
    sys.stdout.write("\n")
    typer.echo(
        f"[{n_tokens} tokens in {done - loaded:.2f} s, {n_tokens / max(done - loaded, 1e-9):.1f} tok/s; "
        f"model loaded in {loaded - start:.2f} s]",
        err=True,
    )


def serve(api_key: list[str] | None = None, config: Path | None = None, kv_events_config: str | None = None,
          **flags: Any) -> None:
    """Serve the OpenAI-compatible API (completions, chat completions, models) over HTTP."""
    from inferd.api.routing.registry import load_models, model_specs
    from inferd.api.server import run_server
    from inferd.settings.config import load_settings
    from inferd.settings.fleet import parse_kv_events_config
    from inferd.settings.flags import overrides as flag_overrides
    from inferd.text.errors import ModelLoadError

    overrides = flag_overrides(flags)
    if kv_events_config is not None:  # (vLLM's flag: its JSON keys are [kv_events]'s, over the file's)
        try:
            overrides["kv_events"] = parse_kv_events_config(kv_events_config)
        except ValueError as e:
            _fail(str(e))
    settings_file = _settings_file(config)
    settings, api_keys, reload_keys = _serve_settings(settings_file, overrides, api_key or [])
    _configure_runtime(settings.runtime.threads, serving=True, log_format=settings.server.log_format)
    try:  # (the last argument: SIGHUP reads the [models] tables again)
        run_server(settings, api_keys, lambda: load_models(settings, _model_loader(settings)), reload_keys,
                   lambda: model_specs(load_settings(settings_file, overrides)))
    except (ModelLoadError, ValueError, OSError) as e:
        _fail(str(e))


def _serve_options() -> None:
    """`serve`'s options: one per promoted setting (settings/flags.py: its type and help from the
    key's own field), the repeatable --api-key and --config."""
    from inferd.settings.flags import SERVE_FLAGS

    def option(flag: str, kind: type, help: str) -> Any:
        names = f"{flag}/--no-{flag[2:]}" if kind is bool else flag  # (booleans: --x/--no-x)
        return Annotated[Optional[kind], typer.Option(names, help=help)]

    params = [inspect.Parameter(f.param, inspect.Parameter.KEYWORD_ONLY, default=None,
                                annotation=option(f.flag, f.type, f.help)) for f in SERVE_FLAGS]
    params += [
        inspect.Parameter("api_key", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
            Optional[list[str]], typer.Option(help="an accepted API key (repeatable); also INFERD_API_KEYS and "
                                                   "server.api_keys_file")]),
        inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=ConfigOption),
        inspect.Parameter("kv_events_config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
            Optional[str], typer.Option(help="the kv_events settings as vLLM's JSON, e.g. '{\"enable_kv_cache_events\": true, "
                                             "\"publisher\": \"zmq\"}' (over the settings file's)")]),
    ]
    serve.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    serve.__annotations__ = {p.name: p.annotation for p in params}
    app.command()(serve)


_serve_options()


@app.command("config")
def config_command(
    defaults: Annotated[bool, typer.Option("--defaults", help="print every setting at its default, as TOML")] = False,
) -> None:
    """Print the settings: with --defaults, every key at its default, its description above it (a
    file `serve --config` reads; docs/configuration.md describes each key)."""
    if not defaults:
        _fail("give --defaults (every key at its default, as TOML)")
    from inferd.settings.defaults import defaults_toml

    sys.stdout.write(defaults_toml())


def _model_loader(settings: Settings) -> Callable[[ModelSpec], AsyncEngine]:
    """How `inferd serve` loads one revision of one model: [model], [cache] and [scheduler], with
    its [models.NAME] table's path, dtype and KV memory (reloads call it in a worker thread)."""
    from inferd.engine.async_engine import AsyncEngine
    from inferd.engine.builder import in_passing_thread
    from inferd.engine.config import EngineConfig
    from inferd.engine.llm_engine import LLMEngine

    from inferd.api.conversation.harmony import speaks_harmony
    from inferd.text.errors import ModelLoadError
    from inferd.text.o200k import harmony_encoding

    def load(spec: ModelSpec) -> AsyncEngine:
        config = EngineConfig.from_settings(settings)
        kv = config.cache.kv_cache_memory if spec.kv_cache_memory is None else spec.kv_cache_memory
        config = config.replace(model=spec.path, dtype=spec.dtype or config.model.dtype, kv_cache_memory=kv,
                                **spec.pooling)
        engine = in_passing_thread(LLMEngine.from_config, config)
        if speaks_harmony(engine.tokenizer):  # (its vocabulary file is read now, not at the first request)
            harmony_encoding()
            if config.output_filter is not None:  # (harmony answers are parsed from token ids, not the filtered text)
                raise ModelLoadError(f"{spec.path or spec.name}: [output_filter] does not cover gpt-oss's harmony "
                                     "answers yet: serve this model without it")
        return AsyncEngine(engine)

    return load


@app.command()
def status(
    url: Annotated[str, typer.Argument(help="the server: a base URL, or host:port")] = "http://127.0.0.1:8000",
    interval: Annotated[float, typer.Option(min=0.1, help="seconds between polls of /v1/status")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="print one frame and exit (for scripts)")] = False,
    api_key: Annotated[Optional[str], typer.Option(envvar=environment.API_KEY.name, help="sent as `Authorization: Bearer KEY`")] = None,
) -> None:
    """Show a live dashboard of a running server: queues per class, KV cache, throughput, requests."""
    from inferd.client.status import StatusError, run

    try:
        run(url, interval, once, api_key)
    except StatusError as e:
        _fail(str(e))


# ------------------------------------------------------------------------------ inferd bench


class _BenchGroup(typer.core.TyperGroup):
    """`inferd bench URL ...` runs `inferd bench run URL ...`; `inferd bench compare A B` compares."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


bench_app = typer.Typer(
    cls=_BenchGroup, no_args_is_help=True, rich_markup_mode=None,
    help="Load-test an OpenAI-compatible server (`inferd bench URL`, options: `inferd bench run --help`), "
         "or compare two results (`inferd bench compare A.json B.json`).",
)
app.add_typer(bench_app, name="bench")


BENCH_HELP = """Load-test an OpenAI-compatible server; report vLLM `bench serve`'s metrics per run and class.

    \b
    Definitions (per run, and per priority class when requests name one):
    - request throughput, input and output tokens/s (completed requests only);
    - TTFT: request sent -> first chunk carrying a token;
    - TPOT: (e2e - TTFT) / (output tokens - 1) per request, the first token excluded;
    - ITL: gaps between consecutive token-bearing chunks, pooled over requests;
    - e2e: request sent -> last token-bearing chunk (so TTFT + sum of ITLs = e2e);
    - mean, p50, p90, p95, p99 of each (linear interpolation, as numpy);
    - goodput: requests/s that met every --slo; errors by type and HTTP status;
    - token counts from the server's usage where sent, else counted chunks (token_source);
    - for inferd servers, preemptions, rejections, timeouts and prefix-cache hits (/metrics deltas);
    - with --retries, attempts per request, retries by cause; a retried request's TTFT and e2e count from its first send, backoff included;
    - with --workload conversation (chat, closed loop: --concurrency conversations at once, each turn sent when the last one's answer has streamed, --turns turns a conversation under one shared system prompt, each later turn adding the answer and a tool result), TTFT of first turns and of later turns apart, and later turns' mean prompt tokens;
    - with --workload agent (the same loop: --concurrency sessions of 6 turns under a ~1.2k-token system prompt of rules and tool schemas, each later turn adding a file read or a command's output, turns 4 and 6 asking for a file of the context back whole, edited; contexts to ~6k tokens), also TTFT of copy turns apart, decode tok/s of copy and other turns, cached prompt tokens (usage.prompt_tokens_details.cached_tokens) and speculation's accepted / drafted tokens (usage.speculative) where the server reports them.
    """


@bench_app.command("run", help=BENCH_HELP)
def bench_run(
    url: Annotated[str, typer.Argument(help="the server: a base URL, .../v1, or host:port")],
    endpoint: Annotated[str, typer.Option(help="completions or chat (always streamed, with usage)")] = "completions",
    api_key: Annotated[Optional[str], typer.Option(envvar=environment.API_KEY.name, help="sent as `Authorization: Bearer KEY`")] = None,
    model: Annotated[Optional[str], typer.Option(help="model name (default: the first of GET /v1/models)")] = None,
    concurrency: Annotated[Optional[int], typer.Option(help="closed loop: requests in flight (default 1); with --rate, the cap on them")] = None,
    rate: Annotated[Optional[str], typer.Option(help="open loop: requests/s; a list (1,2,4) sweeps rates")] = None,
    burstiness: Annotated[float, typer.Option(help="gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier")] = 1.0,
    sweep: Annotated[Optional[str], typer.Option(help="concurrencies to run one after another, e.g. 1,4,16")] = None,
    duration: Annotated[Optional[float], typer.Option(help="seconds per run (instead of --num-requests)")] = None,
    num_requests: Annotated[Optional[int], typer.Option(help="requests per run (default 100)")] = None,
    warmup: Annotated[int, typer.Option(help="requests sent first and not recorded")] = 0,
    input_len: Annotated[int, typer.Option(help="prompt tokens (synthetic prompts: 0.75 words per token)")] = 32,
    input_dist: Annotated[str, typer.Option(help="fixed, uniform or lognormal")] = "fixed",
    output_len: Annotated[int, typer.Option(help="max_tokens per request")] = 128,
    output_dist: Annotated[str, typer.Option(help="fixed, uniform or lognormal")] = "fixed",
    spread: Annotated[float, typer.Option(help="uniform: lengths in [L(1-s), L(1+s)]; lognormal: sigma of log length")] = 0.5,
    dataset: Annotated[Optional[Path], typer.Option(help="JSONL: prompt or messages, optional max_tokens, priority")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="send ignore_eos: every request makes max_tokens")] = False,
    priority_mix: Annotated[Optional[str], typer.Option(help="classes sent as `priority`, e.g. interactive=0.2,batch=0.8")] = None,
    seed: Annotated[int, typer.Option(help="same seed, same prompts, lengths, classes and arrivals")] = 0,
    slo: Annotated[Optional[str], typer.Option(help="goodput SLOs in seconds, e.g. ttft=0.5,tpot=0.1 (keys ttft, tpot, e2e)")] = None,
    json_file: Annotated[Optional[Path], typer.Option("--json", help="write every request's timings and the summary")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="write latency CDFs (and throughput vs latency) as PNG")] = None,
    timeout: Annotated[float, typer.Option(help="seconds a request may go without a byte")] = 600.0,
    retries: Annotated[int, typer.Option(help="resend after a connection refused or reset, HTTP 429/503, or a stream cut mid-way (from the start; the cut part is not counted), up to N times")] = 0,
    retry_base: Annotated[float, typer.Option(help="seconds: retry k waits uniform(0, min(30, base*2^k)) (full jitter), plus Retry-After (up to 30 s) when sent")] = 1.0,
    workload: Annotated[str, typer.Option(help="requests (independent prompts), conversation (multi-turn chats under one shared system prompt, the context growing each turn) or agent (coding-agent sessions: tool schemas, files, command output, copy-heavy edits; a fixed shape, the conversation options do not apply)")] = "requests",
    turns: Annotated[int, typer.Option(help="conversation: requests a conversation, each after the last one's answer")] = 7,
    system_tokens: Annotated[int, typer.Option(help="conversation: the shared system prompt's tokens")] = 1250,
    tool_tokens: Annotated[str, typer.Option(help="conversation: each later turn's tool result, MIN-MAX tokens (uniform)")] = "300-800",
    answer_tokens: Annotated[str, typer.Option(help="conversation: each turn's max_tokens, MIN-MAX (uniform)")] = "64-200",
) -> None:
    from inferd.client.bench import BenchConfig, BenchError, parse_list, run
    from inferd.client.bench_conversation import parse_range

    try:
        config = BenchConfig(
            url=url, endpoint=endpoint, api_key=api_key, model=model, concurrency=concurrency,
            rates=parse_list(rate, float, "--rate"), sweep=parse_list(sweep, int, "--sweep"), burstiness=burstiness,
            duration=duration, num_requests=num_requests, warmup=warmup, input_len=input_len, input_dist=input_dist,
            output_len=output_len, output_dist=output_dist, spread=spread,
            dataset=str(dataset) if dataset else None, ignore_eos=ignore_eos, priority_mix=priority_mix, seed=seed,
            slo=slo, json_path=str(json_file) if json_file else None, plot_path=str(plot) if plot else None,
            timeout=timeout, retries=retries, retry_base=retry_base, workload=workload, turns=turns,
            system_tokens=system_tokens, tool_tokens=parse_range(tool_tokens, "--tool-tokens"),
            answer_tokens=parse_range(answer_tokens, "--answer-tokens"),
        )
        run(config)
    except (BenchError, ValueError) as e:
        _fail(str(e))
    except KeyboardInterrupt:
        _fail("interrupted")


@bench_app.command("compare")
def bench_compare(
    a: Annotated[Path, typer.Argument(help="the baseline: a JSON from `inferd bench --json`")],
    b: Annotated[Path, typer.Argument(help="the other JSON; ratios are B/A")],
) -> None:
    """Print two benchmark results side by side, run by run, with B/A ratios."""
    from inferd.client.bench import BenchError, compare

    try:
        compare(str(a), str(b))
    except BenchError as e:
        _fail(str(e))


def _configure_runtime(threads: int, serving: bool = False, log_format: str = "text") -> None:
    import torch

    from inferd.api.telemetry.access_log import configure_logging

    configure_logging(logging.INFO if serving else logging.WARNING, log_format)
    # NOTE: all cores even when serving: measured on 2 cores with a busy event-loop thread in
    # the process, 2 torch threads gave 163 tok/s and 1 thread 72 (the GIL, not the cores, is
    # what the loop takes from the engine thread).
    torch.set_num_threads(threads or os.cpu_count() or 1)


@app.command("systemd-unit")
def systemd_unit(
    config: Annotated[Path, typer.Option("--config", "-c", help="settings file the service reads")] = Path("/etc/inferd/inferd.toml"),
    user: Annotated[str, typer.Option(help="account the service runs as (and its group)")] = "inferd",
) -> None:
    """Print a systemd unit that runs `inferd serve` from this install (docs/operations.md: Running under systemd)."""
    from inferd.api.systemd import exec_start, render_unit

    try:
        text = render_unit(exec_start(), str(config.absolute()), user)
    except ValueError as e:
        _fail(str(e))
    sys.stdout.write(text)


@app.command()
def plan(
    files: Annotated[list[Path], typer.Argument(help="`inferd bench --json` results of one box: a sweep over concurrency")],
    qps: Annotated[float, typer.Option(help="the target load, requests/s")],
    slo: Annotated[Optional[str], typer.Option(help="latency SLO in seconds, e.g. ttft=1,e2e=10 (keys ttft, tpot, e2e)")] = None,
    percentile: Annotated[int, typer.Option(help="the measured percentile that must meet the SLO: 50, 90, 95 or 99")] = 99,
    headroom: Annotated[float, typer.Option(help="percent more load than --qps to plan for, e.g. 20")] = 0.0,
    spare: Annotated[int, typer.Option(help="boxes beyond the load's need: 1 is N+1")] = 1,
    json_out: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
) -> None:
    """Replicas for --qps within the SLO, from one box's measured sweep, by Little's law (docs/scaling.md)."""
    from inferd.client.plan import PlanError, plan_files
    from inferd.client.plan_render import print_plan

    try:
        print_plan(plan_files(files, qps, slo, percentile, headroom, spare), json_out)
    except PlanError as e:
        _fail(str(e))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
