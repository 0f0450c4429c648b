"""A calculator tool environment for `rollout run --env`: arithmetic problems the model solves by
calling the tool, then answering.

Every model turn gets an answer, so even an untrained model yields multi-turn episodes:
  - `<calc>EXPR</calc>` in the turn: the tool evaluates EXPR (integers, + - * // % ** and parentheses)
    and answers `<result>VALUE</result>`, or `<error>...</error>` for an expression it cannot evaluate;
  - `<answer>N</answer>`: the episode ends, reward 1.0 if N is the problem's answer, else 0.0;
  - anything else: an `<error>` saying what the model must write; reward 0.
Observations are written as a user turn of the ChatML template that the Qwen models and the
example model use (`<|im_start|>user ... <|im_end|>`, then the assistant's turn opened), after the
model's `<|im_end|>` (added here when the turn ended by length, without one).

Prompts (a `prompt` column of chat messages and an `answer` column):

    python recipes/envs/calculator.py prompts.parquet --count 64 --seed 0
"""

from __future__ import annotations

import argparse
import ast
import operator
import random
import re

from rollout_cli.episodes import EnvStep, ModelTurn

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
END_OF_TURN = "<|im_end|>"
INSTRUCTIONS = ("Use the calculator: write <calc>EXPRESSION</calc> and you get <result>VALUE</result>. "
                "When you know the result, write <answer>NUMBER</answer>.")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
              ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64


def evaluate(expression: str) -> int:
    """An integer expression's value; ValueError for anything else (names, calls, huge powers)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an expression: {err.msg}") from None

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent above {MAX_EXPONENT}")
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError("only integers, + - * // % ** and parentheses")

    return value(tree.body)


class CalculatorEnv:
    def __init__(self, answer: int):
        self.answer = answer

    def step(self, turn: ModelTurn) -> EnvStep:
        answered = ANSWER.search(turn.text)
        if answered:
            return EnvStep(reward=float(int(answered.group(1)) == self.answer), done=True)
        call = CALL.search(turn.text)
        if call:
            try:
                message = f"<result>{evaluate(call.group(1))}</result>"
            except ValueError as err:
                message = f"<error>{err}</error>"
        else:
            message = "<error>no tool call or answer: write <calc>EXPRESSION</calc> or <answer>NUMBER</answer></error>"
        close = "" if turn.finish_reason == "stop" else END_OF_TURN  # "stop": the model wrote <|im_end|>
        return EnvStep(observation=f"{close}\n<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n")


def make_env(row: dict) -> CalculatorEnv:
    """One episode's environment, from its prompt row (the `answer` column)."""
    return CalculatorEnv(int(row["answer"]))


def make_prompts(count: int, seed: int) -> list[dict]:
    """`count` problems a * b + c, as chat messages with their answers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b, c = rng.randrange(11, 99), rng.randrange(11, 99), rng.randrange(1, 999)
        question = f"What is {a} * {b} + {c}? {INSTRUCTIONS}"
        rows.append({"prompt": [{"role": "user", "content": question}], "answer": a * b + c})
    return rows


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    parser = argparse.ArgumentParser(description="Write calculator prompts for rollout run --env.")
    parser.add_argument("out", help="Parquet file to write")
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    pq.write_table(pa.Table.from_pylist(make_prompts(args.count, args.seed)), args.out)
    print(f"wrote {args.count} prompts to {args.out}")


if __name__ == "__main__":
    main()
