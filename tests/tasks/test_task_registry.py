"""The task kinds and the registry of task builders."""

from __future__ import annotations

import json

import pytest

from dpkfc_med.tasks import TASK_KINDS, TaskKind
from dpkfc_med.tasks.build import TASK_BUILDERS, register_task, task_builder
from dpkfc_med.training.config import ConfigError


def test_a_task_kind_is_its_plain_string():
    assert TaskKind("segmentation") is TaskKind.SEGMENTATION
    assert TaskKind.CLASSIFICATION == "classification"
    assert f"{TaskKind.SEGMENTATION}" == "segmentation"
    assert json.dumps({"kind": TaskKind.SEGMENTATION}) == '{"kind": "segmentation"}'
    assert TASK_KINDS == ("classification", "segmentation")


def test_every_kind_has_one_builder_found_by_its_plain_string():
    assert set(TASK_BUILDERS) == set(TaskKind)
    assert task_builder("classification") is TASK_BUILDERS[TaskKind.CLASSIFICATION]
    assert TASK_BUILDERS["segmentation"] is task_builder(TaskKind.SEGMENTATION)


def test_an_unknown_kind_names_the_registered_ones():
    with pytest.raises(ConfigError, match="data.task='regression': no task builder registered; "
                       "known: 'classification', 'segmentation'"):  # fmt: skip
        task_builder("regression")


def test_a_kind_gets_one_builder_only():
    with pytest.raises(ValueError, match="'segmentation' already has a builder"):
        register_task("segmentation", TASK_BUILDERS[TaskKind.SEGMENTATION])
    with pytest.raises(ValueError):
        register_task("regression", TASK_BUILDERS[TaskKind.SEGMENTATION])


def test_a_task_keeps_its_kind_as_a_plain_string_for_pickled_and_yaml_records():
    import pickle

    import yaml

    from dpkfc_med.tasks.base import Task

    task = Task(TaskKind.SEGMENTATION, 2, 1, 2, (4, 4), None, [], {})  # type: ignore[arg-type]
    assert type(task.kind) is str and task.kind == TaskKind.SEGMENTATION
    assert yaml.safe_dump({"kind": task.kind}) == "kind: segmentation\n"
    assert b"TaskKind" not in pickle.dumps({"kind": task.kind})
    with pytest.raises(ValueError, match="'regression' is not a valid TaskKind"):
        Task("regression", 2, 1, 2, (4, 4), None, [], {})  # type: ignore[arg-type]
