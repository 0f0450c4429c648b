"""The example tool environment (recipes/envs/calculator.py): what it answers to each kind of model turn."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rollout_cli.episodes import ModelTurn

PATH = Path(__file__).resolve().parents[2] / "recipes" / "envs" / "calculator.py"
spec = importlib.util.spec_from_file_location("calculator_env", PATH)
calculator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calculator)


def _turn(text: str, finish_reason: str = "stop") -> ModelTurn:
    return ModelTurn(text=text, token_ids=[1, 2], finish_reason=finish_reason, turn=0)


def test_a_tool_call_gets_its_result_as_a_user_turn():
    env = calculator.make_env({"answer": 1000})
    step = env.step(_turn("let me compute <calc>37 * 27 + (1 - 0)</calc>"))
    assert not step.done and step.reward == 0.0
    assert step.observation == "\n<|im_start|>user\n<result>1000</result><|im_end|>\n<|im_start|>assistant\n"
    # a turn cut by length did not write its end-of-turn marker: the environment closes it
    assert env.step(_turn("<calc>2 ** 3</calc>", "length")).observation.startswith("<|im_end|>\n<|im_start|>user\n<result>8<")


@pytest.mark.parametrize("expression, error", [
    ("__import__('os')", "only integers"), ("2 ** 1000", "exponent above 64"), ("1 // 0", "division by zero"),
    ("1 +", "not an expression"), ("1.5 * 2", "only integers"), ("9" * 300, "expression longer than 200"),
])
def test_a_bad_expression_gets_an_error_not_an_exception(expression, error):
    step = calculator.make_env({"answer": 1}).step(_turn(f"<calc>{expression}</calc>"))
    assert f"<error>{error}" in step.observation and not step.done


def test_an_answer_ends_the_episode_with_its_reward():
    env = calculator.make_env({"answer": 42})
    assert (env.step(_turn("<answer>42</answer>")).reward, env.step(_turn("<answer> 41 </answer>")).reward) == (1.0, 0.0)
    assert env.step(_turn("<answer>42</answer>")).done
    nothing = env.step(_turn("no idea"))
    assert "no tool call or answer" in nothing.observation and not nothing.done


def test_prompts_carry_their_answers():
    rows = calculator.make_prompts(5, seed=1)
    assert len(rows) == 5 and rows == calculator.make_prompts(5, seed=1)
    for row in rows:
        question = row["prompt"][0]["content"]
        a, b, c = (int(x) for x in question.split("?")[0].replace("What is", "").replace("*", " ").replace("+", " ").split())
        assert row["answer"] == a * b + c and "<calc>" in question
