from __future__ import annotations

from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.model import tokenizer as byte_ids
from node.rl.inprocess import train_inprocess
from node.rl.rollout import generate_groups, sample_index, score_samples
from node.tasks.suite import default_suite
from swarm.assignment import assign
from swarm.messages import RunParams

PARAMS = RunParams(group_size=4, batch_prompts=2, max_tokens=8)


def test_groups_follow_the_assignment_and_replay_exactly() -> None:
    engine = TorchEngine.from_dir(DEFAULT_MODEL_DIR)
    suite = default_suite()
    assignment = assign("r", 0, "w", 0, n_prompts=2, suite_size=suite.size)
    rollout = generate_groups(engine, suite, assignment, PARAMS)
    assert [len(g) for g in rollout.generations] == [4, 4]
    # The engine encodes with the model's own tokenizer: for the embedded model, BOS + bytes.
    assert rollout.prompts[1] == byte_ids.encode(suite.task(assignment.prompt_ids[1]).prompt)
    # Sample j = (prompt 1, member 2) regenerated alone gives the same tokens.
    again = engine.generate(
        [rollout.prompts[1]],
        [assignment.seed],
        PARAMS.temperature,
        PARAMS.max_tokens,
        sample_indices=[sample_index(1, 2, 4)],
    )
    assert again[0].tokens == rollout.generations[1][2].tokens


def test_score_decodes_with_the_model_tokenizer_and_uses_the_task_verifier() -> None:
    engine = TorchEngine.from_dir(DEFAULT_MODEL_DIR)
    suite = default_suite()
    task = suite.task(3)
    right = [*byte_ids.encode(task.answer, bos=False), byte_ids.EOS_ID, *b"junk"]
    rewards = score_samples(engine, suite, [3, 3], [right, [byte_ids.EOS_ID]], PARAMS)
    assert rewards == [1.0, 0.0]


def test_inprocess_loop_reports_every_version() -> None:
    results = train_inprocess(PARAMS, steps=2)
    assert [r.version for r in results] == [0, 1, 2]
    assert all(0.0 <= r.mean_reward <= 1.0 for r in results)
    assert results[-1].stats is None and results[0].stats is not None
