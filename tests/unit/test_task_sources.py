"""Task sources the field trains on: reasoning-gym generators and local Hugging Face data sets,
bound by the genesis; and the held-out evaluation split, kept apart from the training items.

Every bad input the issue names is a one-line ConfigError before any work: a reasoning-gym
version or data set name the install lacks, built items whose digest differs from the genesis,
a data set folder missing a named column, an evaluation split that overlaps the training items.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from node.run import bind_tasks, create_genesis, eval_ids, suite_for
from node.run_assets import AssetDirs, local_data_set
from node.tasks import gym
from node.tasks.rewards import offline_filter, reward
from swarm.errors import ConfigError
from swarm.messages import RunGenesis, RunParams
from tests.netfactory import key_named

TWO_GYMS = "reasoning-gym:leg_counting,basic_arithmetic"
PARAMS = RunParams(eval_size=8)


def genesis_of(binding: object, params: RunParams = PARAMS) -> RunGenesis:
    owner = key_named("owner")
    return create_genesis(
        owner,
        name="tasks",
        trainers=[owner.peer_id],
        validators=[owner.peer_id],
        params=params,
        tasks=binding,  # type: ignore[arg-type]
        created_at=1,
    ).message


@pytest.fixture(scope="module")
def gym_genesis(tmp_path_factory: pytest.TempPathFactory) -> RunGenesis:
    cache = tmp_path_factory.mktemp("owner-cache")
    return genesis_of(bind_tasks(TWO_GYMS, seed=3, size=120, cache=cache))


def test_a_fresh_node_builds_the_same_reasoning_gym_items(
    gym_genesis: RunGenesis, tmp_path: Path
) -> None:
    spec = gym.GymSpec.from_text(gym_genesis.task_spec)
    assert [d.name for d in spec.datasets] == ["leg_counting", "basic_arithmetic"]
    assert spec.version == gym.installed_version() and len(spec.digest) == 64
    # A node with an empty cache builds the items in its own child and gets the same digest.
    fresh = gym.load(spec, tmp_path / "fresh")
    assert fresh.sha256 == spec.digest
    assert gym.items_path(tmp_path / "fresh", spec.digest).is_file()
    families = {fresh.task(i).family for i in range(fresh.size)}
    assert families == {"leg_counting", "basic_arithmetic"}


def test_the_data_sets_own_scorer_decides_the_reward(gym_genesis: RunGenesis) -> None:
    source = suite_for(gym_genesis)
    for family in ("leg_counting", "basic_arithmetic"):
        task = next(source.task(i) for i in source.ids() if source.task(i).family == family)
        assert task.verifier == "reasoning-gym"
        assert task.reward(task.answer) == 1.0
        assert task.reward(f"thinking... <answer>{task.answer}</answer>") == 1.0
        assert task.reward(f"<answer>{int(float(task.answer)) + 1}</answer>") == 0.0
        assert task.reward("no idea") == 0.0


def test_the_evaluation_split_is_held_out_of_training(gym_genesis: RunGenesis) -> None:
    source = suite_for(gym_genesis)
    held = eval_ids(gym_genesis, source)
    assert held == list(range(112, 120))
    assert not set(held) & set(source.ids())
    assert len(source.ids()) == 112
    off = genesis_of(bind_tasks("default"), RunParams(eval_every=0))
    assert eval_ids(off, suite_for(off)) == []


def test_a_reasoning_gym_version_this_node_lacks_is_one_line_naming_the_install(
    gym_genesis: RunGenesis, tmp_path: Path
) -> None:
    spec = gym.GymSpec.from_text(gym_genesis.task_spec)
    old = gym.GymSpec("0.1.3", spec.datasets, spec.seed, spec.size, spec.digest)
    with pytest.raises(
        ConfigError, match=r"reasoning-gym 0\.1\.3 .* pip install reasoning-gym==0\.1\.3"
    ):
        gym.load(old, tmp_path)


def test_an_unknown_reasoning_gym_data_set_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no data set 'leg_countin'") as info:
        bind_tasks("reasoning-gym:leg_countin", size=4, cache=tmp_path)
    assert "\n" not in str(info.value)
    assert not list((tmp_path / "reasoning-gym").glob("*"))  # nothing half-built is left


def test_built_items_that_differ_from_the_genesis_are_refused(
    gym_genesis: RunGenesis, tmp_path: Path
) -> None:
    spec = gym.GymSpec.from_text(gym_genesis.task_spec)
    other = gym.GymSpec(spec.version, spec.datasets, spec.seed + 1, spec.size, spec.digest)
    with pytest.raises(ConfigError, match=r"built items with sha256 .* where the genesis binds"):
        gym.load(other, tmp_path)
    assert not gym.items_path(tmp_path, spec.digest).exists()


def test_a_data_set_whose_scorer_refuses_its_own_answer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="boxnet: its own scorer gives item 0"):
        bind_tasks("reasoning-gym:boxnet", size=3, cache=tmp_path)


def test_task_config_sets_weights_and_configs(tmp_path: Path) -> None:
    config = tmp_path / "mix.yaml"
    config.write_text(
        "datasets:\n"
        "  - name: basic_arithmetic\n    weight: 3\n    config: {min_terms: 2, max_terms: 2}\n"
        "  - name: leg_counting\n    weight: 1\n"
    )
    binding = bind_tasks("reasoning-gym", task_config=config, size=40, cache=tmp_path)
    spec = gym.GymSpec.from_text(binding.spec)
    assert [(d.name, d.weight) for d in spec.datasets] == [
        ("basic_arithmetic", 3.0),
        ("leg_counting", 1.0),
    ]
    assert spec.scorer_config("basic_arithmetic")["max_terms"] == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("datasets: 3\n")
    with pytest.raises(ConfigError, match="expected 'datasets:'"):
        bind_tasks("reasoning-gym", task_config=bad, size=4, cache=tmp_path)


def test_offline_filter_and_length_penalty_work_on_reasoning_gym(tmp_path: Path) -> None:
    config = tmp_path / "mix.json"
    config.write_text(json.dumps({"datasets": [{"name": "leg_counting", "target_len": 6}]}))
    g = genesis_of(bind_tasks("reasoning-gym", task_config=config, size=30, cache=tmp_path))
    source = suite_for(g, cache=tmp_path)
    task = source.task(0)
    assert task.target_len == 6
    assert reward(task, task.answer, 6, length_coeff=0.01) == 1.0
    assert reward(task, task.answer, 10, length_coeff=0.01) == pytest.approx(0.96)
    # The offline filter drops what the starting policy always or never solves.
    rates = {i: (0.0 if i % 3 == 0 else 1.0 if i % 3 == 1 else 0.5) for i in source.ids()}
    kept, dropped = offline_filter(source.ids(), rates.__getitem__)
    assert kept == [i for i in source.ids() if i % 3 == 2]
    narrowed = source.with_excluded(set(dropped))
    assert narrowed.ids() == kept and narrowed.task(kept[0]).verifier == "reasoning-gym"


# -- local Hugging Face data sets ------------------------------------------------------------

ROWS = [
    {"question": f"{a}*{a}=", "solution": str(a * a), "check": "math" if a % 2 else "exact"}
    for a in range(40)
]


def parquet_dir(path: Path, rows: list[dict[str, str]] = ROWS) -> Path:
    import datasets

    datasets.disable_progress_bars()
    path.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(str(path / "train-00000.parquet"))
    return path


COLUMNS = {"prompt": "question", "answer": "solution", "verifier_column": "check"}


def test_a_parquet_folder_is_bound_file_by_file_and_loaded(tmp_path: Path) -> None:
    folder = parquet_dir(tmp_path / "squares")
    g = genesis_of(bind_tasks(str(folder), columns=COLUMNS))
    assert g.task_suite == "datasets" and [r.name for r in g.task_files] == ["train-00000.parquet"]
    source = suite_for(g, folder)
    assert source.size == 40 and len(source.ids()) == 32  # 8 held out
    task = source.task(3)
    assert (task.prompt, task.answer, task.verifier) == ("3*3=", "9", "math")
    assert task.reward("9") == 1.0 and task.reward("8") == 0.0
    # A node finds the bound files in its cache folder, and refuses a copy that differs.
    dirs = AssetDirs.under(tmp_path / "home")
    assert local_data_set(g, None, dirs) is None
    assert local_data_set(g, folder, dirs) == folder
    changed = parquet_dir(tmp_path / "changed", ROWS[:-1])
    with pytest.raises(ConfigError, match=r"train-00000\.parquet"):
        local_data_set(g, changed, dirs)


def test_a_saved_datasets_folder_loads_with_datasets(tmp_path: Path) -> None:
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    binding = bind_tasks(str(folder), columns={"prompt": "question", "answer": "solution"})
    assert json.loads(binding.spec)["layout"] == "saved"
    source = suite_for(genesis_of(binding), folder)
    assert source.task(0).prompt == "0*0=" and source.task(0).verifier == "exact"


def test_a_data_set_missing_a_named_column_is_one_line_listing_its_columns(
    tmp_path: Path,
) -> None:
    folder = parquet_dir(tmp_path / "squares")
    with pytest.raises(ConfigError, match="has no column 'prompt'") as info:
        genesis_of(bind_tasks(str(folder)))
    message = str(info.value)
    assert "question, solution, check" in message and "--prompt-column" in message
    assert "\n" not in message


def test_a_datasetdict_folder_asks_for_one_split(tmp_path: Path) -> None:
    parquet_dir(tmp_path / "dd" / "train")
    with pytest.raises(ConfigError, match="pass the split's folder"):
        bind_tasks(str(tmp_path / "dd"), columns=COLUMNS)


def test_an_evaluation_split_that_overlaps_training_is_refused(tmp_path: Path) -> None:
    rows = [*ROWS, ROWS[0]]  # the last (held-out) row repeats a training prompt
    folder = parquet_dir(tmp_path / "dup", rows)
    with pytest.raises(ConfigError, match="evaluation split overlaps the training items"):
        genesis_of(bind_tasks(str(folder), columns=COLUMNS))
    # A small data set keeps four fifths of its items for training: 9 rows hold out 1.
    small = genesis_of(bind_tasks(str(parquet_dir(tmp_path / "small", ROWS[:9])), columns=COLUMNS))
    assert eval_ids(small, suite_for(small, tmp_path / "small")) == [8]


def test_jsonl_keeps_its_line_reader(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [json.dumps({"prompt": f"p{i}", "answer": "1" if i % 2 else i}) for i in range(40)]
    path.write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n")
    g = genesis_of(bind_tasks(str(path)))
    assert g.task_suite == "jsonl" and g.task_data is not None
    source = suite_for(g, path)
    assert source.task(1).answer == "1" and source.task(3).prompt == "p3"  # blank line skipped
