"""A best-effort grammar (tool calls under tool_choice "auto") that breaks lets its choice go on
unconstrained, on either path a step fills masks by: llguidance's parallel fill, or one by one.
A plain one fails its choice, as before. (The default model's tokenizer; no model run.)"""

from __future__ import annotations

import numpy as np
import pytest

from inferd.engine.protocol import ConstraintError
from inferd.engine.structured.grammar import GrammarCompiler, regex_grammar
from inferd.engine.structured.masks import fill_masks


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    from inferd.text.errors import ModelLoadError
    from inferd.model.loading.loader import default_model_path
    from inferd.text.tokenizer_loader import load_tokenizer

    try:
        return GrammarCompiler(load_tokenizer(default_model_path()))
    except ModelLoadError as e:
        pytest.skip(str(e))


def refused_token(compiler: GrammarCompiler) -> int:
    """A token "yes|no" refuses at its start."""
    return compiler.lltokenizer.tokenize_str("zzz")[0]


def test_a_best_effort_grammar_lets_go_where_a_plain_one_fails(compiler: GrammarCompiler) -> None:
    grammar = regex_grammar("yes|no")
    bad = refused_token(compiler)
    plain, loose = compiler.compile(grammar), compiler.compile(grammar, best_effort=True)
    with pytest.raises(ConstraintError):
        plain.accept(bad)
    assert loose.accept(bad) is False and loose.matcher is None
    mask = np.zeros((compiler.vocab_size + 31) // 32, np.int32)
    loose.fill_mask(mask)
    assert (mask == -1).all()
    assert loose.fork().matcher is None


def test_the_parallel_fill_frees_the_row_of_a_grammar_that_broke(compiler: GrammarCompiler) -> None:
    import llguidance

    grammar = regex_grammar("yes|no")
    plain, loose = compiler.compile(grammar), compiler.compile(grammar, best_effort=True)
    for constraint in (plain, loose):  # break both matchers behind the constraints' backs
        assert constraint.matcher is not None and not constraint.matcher.consume_token(refused_token(compiler))
    masks = np.zeros((2, (compiler.vocab_size + 31) // 32), np.int32)
    failed = fill_masks([(0, plain), (1, loose)], masks, llguidance.LLExecutor(num_threads=1))
    assert list(failed) == [0] and isinstance(failed[0], ConstraintError)
    assert (masks[1] == -1).all() and loose.matcher is None
