"""The copy-heavy workload quotes code as a user would paste it: the speculation figures of `bench latency
--dataset copy` depend on how much of the answer can repeat the prompt."""
from __future__ import annotations

import ast

from pagedllm.bench.copy_workload import copy_heavy_workload

QUOTE_CODE = "Repeat this Python function exactly, in a code block:\n\n"


class CharacterTokenizer:
    """One id per character, so a prompt's text comes back from its ids."""

    @staticmethod
    def apply_chat_template(messages: list[dict]) -> list[int]:
        assert len(messages) == 1 and messages[0]["role"] == "user"
        return [ord(character) for character in messages[0]["content"]]


def test_quoted_functions_are_pasted_dedented_with_their_bodies_one_level_in():
    # At batch 1 every request quotes a function (the first of the workload's three kinds): 40 seeds, 40 functions.
    functions = []
    for seed in range(40):
        (request,) = copy_heavy_workload(CharacterTokenizer(), 1, 16, seed=seed)
        text = "".join(map(chr, request.prompt_token_ids))
        assert text.startswith(QUOTE_CODE)
        functions.append(text[len(QUOTE_CODE):])
    assert len(set(functions)) > 10
    for function in functions:
        (definition,) = ast.parse(function).body   # methods too: no indentation left from their class
        assert isinstance(definition, ast.FunctionDef) and definition.col_offset == 0
        assert definition.body[0].col_offset == 4, function   # as in the sources, not the class's 8 columns
