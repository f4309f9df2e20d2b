"""Rollouts: generate a worker's assigned groups, and score completions with the task verifier.

Shared by the inference worker (which adds proofs and signs), the validator (which recomputes the
rewards itself, never trusting the worker's), and the plain in-process GRPO loop. Prompts are
encoded and completions decoded and scored by the engine (the model's own tokenizer and chat
template, in the compute child), never here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from node.compute.engine import Engine, Generation, ScoreItem
from node.run import TaskSource
from node.tasks.suite import Task
from swarm.assignment import Assignment
from swarm.messages import RunParams


@dataclass(frozen=True)
class Rollout:
    """``group_size`` generations per assigned prompt, in assignment order."""

    assignment: Assignment
    prompts: list[list[int]]
    generations: list[list[Generation]]
    dtype: str = ""
    """The engine's precision, which the submission declares."""


def sample_index(prompt_position: int, member: int, group_size: int) -> int:
    """Sample ``j`` of a submission: member ``j % G`` of the group of prompt ``j // G``."""
    return prompt_position * group_size + member


def generate_groups(
    engine: Engine, suite: TaskSource, assignment: Assignment, params: RunParams
) -> Rollout:
    g = params.group_size
    prompts = engine.encode_prompts([suite.task(pid).prompt for pid in assignment.prompt_ids])
    flat_prompts = [p for p in prompts for _ in range(g)]
    indices = [sample_index(i, m, g) for i in range(len(prompts)) for m in range(g)]
    flat = engine.generate(
        flat_prompts,
        [assignment.seed] * len(flat_prompts),
        params.temperature,
        params.max_tokens,
        sample_indices=indices,
        sampler=params.sampler,
    )
    groups = [flat[i * g : (i + 1) * g] for i in range(len(prompts))]
    return Rollout(assignment, prompts, groups, engine.info.dtype)


def score_samples(
    engine: Engine,
    suite: TaskSource,
    prompt_ids: list[int],
    completions: list[list[int]],
    params: RunParams,
) -> list[float]:
    """Rewards of completions (one prompt id each): the task's verifier minus the length
    penalty, decoded and scored by the engine."""
    items = []
    for pid, tokens in zip(prompt_ids, completions, strict=True):
        task = suite.task(pid)
        items.append(score_item(task, tokens))
    return engine.score(items, params.length_penalty)


def score_item(task: Task, tokens: Sequence[int]) -> ScoreItem:
    """What the engine needs to score ``tokens`` as a completion of ``task``."""
    return ScoreItem(list(tokens), task.answer, task.verifier, task.target_len, task.entry)
