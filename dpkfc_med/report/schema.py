"""The privacy report contract (schema ``dpkfc_med.privacy_report/2``) and its validator.

The report is a plain, JSON-serialisable dict built by the training pipeline. Validation is
hand-written (no ``jsonschema`` dependency) so that every problem reads as
``"<dotted.field>: <what is wrong>"`` and all problems are reported at once.

Layout (version 1; keys not listed are allowed and kept)::

    schema: "dpkfc_med.privacy_report/2"
    status: "complete" | "incomplete" | "failed"
    created: ISO-8601 date (shareable report) or date-time
    run: {name, config_sha256, config, seed, device}  (run_dir: custodian report)
    task: {kind, spatial_dims, num_classes, label_names}
    data: {splits, num_train_units, privacy_unit, max_samples_per_unit}  (path: custodian)
    model: {name, num_params, fixes}
    privacy: {method, private, accountant, epsilon, target_epsilon, delta, sampler,
              sample_rate, expected_batch_size, noise_multiplier, max_grad_norm, steps,
              planned_steps, epochs, secure_rng, randomness, neighbouring_relation, guarantee,
              hyperparameter_tuning, not_covered, ledger}
    preconditioner: null | {uses_private_data, external_data, probe_source, refresh_every,
                            refreshes, covered_layers, config, coverage}
    training: {...}
    history: {step, epsilon, val_metric_name; epsilon_step, epsilon_rdp, epsilon_accountant,
              epsilon_schedule}  epsilon[i] is the stated accountant's epsilon after
              epsilon_step[i] steps (without epsilon_step: after step[i]); epsilon_rdp the RDP
              epsilon after every step (dpkfc_med.report.history)
    custodian: {path, report, items, note}   what is kept in the custodian report instead
    audit: optional {epsilon_lower_bound, epsilon_accounted, delta, canaries, confidence, ...}
    environment: {python, packages, git, ...}

This is the *shareable* report: it must not hold any field of
:data:`~dpkfc_med.report.custodian.CUSTODIAN_ONLY` (un-noised statistics of the private
records: training losses, metrics, diagnostics, class counts, fingerprints, case splits); the
validator refuses them. They live in the custodian report (``dpkfc_med.custodian_report/1``,
:func:`validate_custodian_report`) under ``private_not_for_release/``.

Privacy-relevant fields (``privacy.*``, ``preconditioner.uses_private_data``) are checked
strictly, including their consistency with ``privacy.method``; display-only fields
(``metrics``, ``diagnostics``, ``training``) only need to be JSON-serialisable.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from datetime import datetime
from enum import Enum
from pathlib import PurePath
from typing import Any

from dpkfc_med.methods import METHODS, PRECONDITIONED_METHODS, Method
from dpkfc_med.utils import did_you_mean

__all__ = [
    "ACCOUNTANTS",
    "METHODS",
    "REPORT_SCHEMA",
    "STATUSES",
    "ReportSchemaError",
    "check_report",
    "to_json_data",
    "validate_custodian_report",
    "validate_report",
]

REPORT_SCHEMA = "dpkfc_med.privacy_report/2"
"""Schema id written into (and required of) every report."""

STATUSES = ("complete", "incomplete", "failed")
ACCOUNTANTS = ("prv", "rdp", "pld")
COVERAGE_COLUMNS = (
    "layer",
    "type",
    "adapter",
    "family",
    "groups",
    "A_dim",
    "G_dim",
    "A",
    "G",
    "scale",
    "params",
)
"""The preconditioner's covered-layers table, one row per layer or fallback parameter, in the
order the renderer shows it."""
COVERAGE_KEYS = tuple(k for k in COVERAGE_COLUMNS if k != "family")
"""The columns every coverage row must hold (``family`` is absent from reports of schema 2
written before the preconditioner families; such rows are K-FAC)."""

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")

Check = Callable[[Any, str, list[str]], None]
"""``check(value, dotted_path, problems)`` appends one line per problem to ``problems``."""


class ReportSchemaError(ValueError):
    """A privacy report does not follow :data:`REPORT_SCHEMA`.

    Attributes:
        problems: One ``"<dotted.field>: <problem>"`` line per problem.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = tuple(problems)
        super().__init__(
            f"privacy report does not follow {REPORT_SCHEMA}:\n  " + "\n  ".join(self.problems)
        )


# --------------------------------------------------------------------------- JSON view
def to_json_data(value: Any, *, finite: bool = False) -> tuple[Any, list[str]]:
    """Plain JSON data (dicts, lists, str, numbers, bools, ``None``) equivalent to ``value``.

    The pipeline may hand over enums, paths, tuples, dataclasses (e.g. ``Fix``), NumPy scalars
    or arrays and tensors; they are converted rather than rejected so that a report never fails
    on a representation detail at the end of a long run.

    Args:
        value: The report, or any part of it.
        finite: Replace NaN and infinities by ``None`` (JSON has no such numbers; ``null`` in a
            metric or curve marks an undefined value, e.g. the AUROC of a one-class split).

    Returns:
        The converted data and one problem line per value that has no JSON form.
    """
    problems: list[str] = []
    return _convert(value, "", problems, finite), problems


def _convert(value: Any, path: str, problems: list[str], finite: bool) -> Any:
    if isinstance(value, Enum):
        value = value.value
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return None if finite and not math.isfinite(value) else value
    if isinstance(value, PurePath):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if isinstance(key, Enum):
                key = key.value
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                problems.append(
                    f"{_join(path, str(key))}: key of type {type(key).__name__} has no JSON form"
                )
                continue
            out[str(key)] = _convert(item, _join(path, str(key)), problems, finite)
        return out
    if isinstance(value, (list, tuple)):
        return [_convert(item, f"{path}[{i}]", problems, finite) for i, item in enumerate(value)]
    tolist = getattr(value, "tolist", None)  # NumPy scalars/arrays, torch tensors
    if callable(tolist):
        return _convert(tolist(), path, problems, finite)
    problems.append(
        f"{path or '<report>'}: value of type {type(value).__name__} is not JSON-serialisable; "
        "store a number, string, list or dict"
    )
    return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# --------------------------------------------------------------------------- checks
def _kind(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fields(spec: dict[str, Check]) -> Check:
    """A mapping that must hold every key of ``spec``, each checked by its own check."""

    def check(value: Any, path: str, problems: list[str]) -> None:
        if not isinstance(value, Mapping):
            problems.append(f"{path or '<report>'}: must be a mapping, got {_kind(value)}")
            return
        for key, sub in spec.items():
            if key not in value:
                problems.append(f"{_join(path, key)}: missing")
            else:
                sub(value[key], _join(path, key), problems)

    return check


def _nullable(inner: Check) -> Check:
    def check(value: Any, path: str, problems: list[str]) -> None:
        if value is not None:
            inner(value, path, problems)

    return check


def _string(value: Any, path: str, problems: list[str]) -> None:
    if not isinstance(value, str) or not value.strip():
        problems.append(f"{path}: must be a non-empty string, got {_kind(value)}")


def _boolean(value: Any, path: str, problems: list[str]) -> None:
    if not isinstance(value, bool):
        problems.append(f"{path}: must be true or false, got {_kind(value)}")


def _mapping(value: Any, path: str, problems: list[str]) -> None:
    if not isinstance(value, Mapping):
        problems.append(f"{path}: must be a mapping, got {_kind(value)}")


def _one_of(*choices: Any) -> Check:
    def check(value: Any, path: str, problems: list[str]) -> None:
        if value not in choices or isinstance(value, bool):
            hint = did_you_mean(value, [str(c) for c in choices]) if isinstance(value, str) else ""
            allowed = ", ".join(repr(c) for c in choices)
            problems.append(f"{path}: must be one of {allowed}, got {_kind(value)}{hint}")

    return check


def _integer(minimum: int | None = None) -> Check:
    def check(value: Any, path: str, problems: list[str]) -> None:
        if not _is_int(value) or (minimum is not None and value < minimum):
            bound = f" >= {minimum}" if minimum is not None else ""
            problems.append(f"{path}: must be an integer{bound}, got {_kind(value)}")

    return check


def _number(
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    context: str = "",
) -> Check:
    """A finite number in an interval; the message states the interval in math notation."""
    if low is not None and high is not None:
        rng = f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
        rng = f" {'>' if low_open else '>='} {low:g}"
    else:
        rng = ""

    def check(value: Any, path: str, problems: list[str]) -> None:
        ok = _is_number(value) and math.isfinite(value)
        if ok and low is not None:
            ok = value > low if low_open else value >= low
        if ok and high is not None:
            ok = value < high if high_open else value <= high
        if not ok:
            problems.append(f"{path}: must be a number{rng}{context}, got {_kind(value)}")

    return check


def _list_of(item: Check, what: str = "a list") -> Check:
    def check(value: Any, path: str, problems: list[str]) -> None:
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}: must be {what}, got {_kind(value)}")
            return
        for i, entry in enumerate(value):
            item(entry, f"{path}[{i}]", problems)

    return check


def _mapping_of(item: Check, what: str = "a mapping") -> Check:
    def check(value: Any, path: str, problems: list[str]) -> None:
        if not isinstance(value, Mapping):
            problems.append(f"{path}: must be {what}, got {_kind(value)}")
            return
        for key, entry in value.items():
            item(entry, _join(path, str(key)), problems)

    return check


def _curve_value(value: Any, path: str, problems: list[str]) -> None:
    # null stands for a non-finite value (a diverged loss); see to_json_data(finite=True).
    if value is not None and not _is_number(value):
        problems.append(f"{path}: must be a number or null, got {_kind(value)}")


def _sha256(value: Any, path: str, problems: list[str]) -> None:
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        problems.append(f"{path}: must be a 64-character hex SHA-256 digest, got {_kind(value)}")


def _sha256_field(value: Any, path: str, problems: list[str]) -> None:
    """One digest, or a ``file -> digest`` mapping (a folder of external data)."""
    if isinstance(value, Mapping):
        _mapping_of(_sha256)(value, path, problems)
    else:
        _sha256(value, path, problems)


def _timestamp(value: Any, path: str, problems: list[str]) -> None:
    try:
        # Python < 3.11 does not read a trailing "Z"; it means UTC.
        datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith("Z") else value)
    except (TypeError, ValueError, AttributeError):
        problems.append(
            f"{path}: must be an ISO-8601 date or date-time such as '2024-05-01', "
            f"got {_kind(value)}"
        )


def _schema_id(value: Any, path: str, problems: list[str]) -> None:
    if value != REPORT_SCHEMA:
        problems.append(
            f"{path}: must be {REPORT_SCHEMA!r}, got {_kind(value)}; the report was written by "
            "another version of dpkfc_med"
        )


# --------------------------------------------------------------------------- sections
_RUN = _fields(
    {
        "name": _string,
        "config_sha256": _sha256,
        "config": _mapping,
        "seed": _nullable(_integer()),
        "device": _string,
    }
)
_TASK = _fields(
    {
        "kind": _one_of("classification", "segmentation"),
        "spatial_dims": _one_of(2, 3),
        "num_classes": _integer(1),
        "label_names": _nullable(_list_of(_string, "a list of strings")),
    }
)
_DATA = _fields(
    {
        "splits": _mapping_of(_integer(0), "a mapping split -> number of samples"),
        "num_train_units": _integer(1),
        "privacy_unit": _string,
        "max_samples_per_unit": _nullable(_integer(1)),
    }
)
_MODEL = _fields(
    {
        "name": _string,
        "num_params": _integer(0),
        "fixes": _list_of(_mapping, "a list of mappings (one per fix)"),
    }
)
_HISTORY = _fields(
    {
        "step": _list_of(_integer(0), "a list of integers"),
        "epsilon": _list_of(_curve_value, "a list of numbers"),
        "val_metric_name": _string,
    }
)
_METRICS = _fields({"val": _nullable(_mapping), "test": _nullable(_mapping)})
_ENVIRONMENT = _fields(
    {
        "python": _string,
        "packages": _mapping_of(_nullable(_string), "a mapping package -> version or null"),
        "git": _nullable(_fields({"commit": _string, "dirty": _boolean})),
    }
)
_REFRESH = _fields(
    {
        "step": _integer(0),
        "probe_seed": _integer(),
        "seconds": _number(0),
        "scale": _nullable(_number()),
    }
)


def _present(value: Any, path: str, problems: list[str]) -> None:
    """Any value: the key only has to be there (display-only columns)."""


_COVERAGE_ROW = _fields(dict.fromkeys(COVERAGE_KEYS, _present))
_EXTERNAL = _fields({"sha256": _sha256_field, "note": _string})  # path: custodian report

_PRIVACY_COMMON: dict[str, Check] = {
    "method": _one_of(*METHODS),
    "private": _boolean,
    "accountant": _one_of(*ACCOUNTANTS),
    "steps": _integer(0),
    "planned_steps": _nullable(_integer(0)),
    "epochs": _number(0),
    "secure_rng": _boolean,
    "neighbouring_relation": _string,
    "guarantee": _string,
    "hyperparameter_tuning": _string,
    "ledger": _mapping,
    "randomness": _fields(
        {
            "source": _one_of("os-entropy", "os-csprng", "seeded", "none"),
            "valid_dp_release": _boolean,
        }
    ),
    "not_covered": _list_of(_string, "a list of sentences"),
}
_FOR_PRIVATE = " for a private run"
_PRIVACY_PRIVATE: dict[str, Check] = {
    "epsilon": _fields({k: _number(0) for k in (*ACCOUNTANTS, "max")}),
    "target_epsilon": _nullable(_number(0, low_open=True)),
    "delta": _number(0, 1, low_open=True, high_open=True),
    "sampler": _one_of("poisson"),
    "sample_rate": _number(0, 1, low_open=True, context=_FOR_PRIVATE),
    "expected_batch_size": _integer(1),
    "noise_multiplier": _number(0, low_open=True, context=_FOR_PRIVATE),
    "max_grad_norm": _number(0, low_open=True, context=_FOR_PRIVATE),
}
_PRIVACY_NONPRIVATE: dict[str, Check] = {
    "target_epsilon": _nullable(_number(0, low_open=True)),
    "delta": _nullable(_number(0, 1, low_open=True, high_open=True)),
    "sampler": _nullable(_one_of("poisson")),
    "sample_rate": _nullable(_number(0, 1, low_open=True)),
    "expected_batch_size": _nullable(_integer(1)),
    "noise_multiplier": _nullable(_number(0)),
    "max_grad_norm": _nullable(_number(0, low_open=True)),
}


def _check_privacy(privacy: Any, problems: list[str]) -> None:
    if not isinstance(privacy, Mapping):
        problems.append(f"privacy: must be a mapping, got {_kind(privacy)}")
        return
    method, private = privacy.get("method"), privacy.get("private")
    # Which fields are mandatory depends on whether the run claims a guarantee; a run whose
    # ``private`` flag is missing or wrong is checked as private, the stricter reading.
    strict = private is not False or method != Method.NONPRIVATE.value
    spec = {**_PRIVACY_COMMON, **(_PRIVACY_PRIVATE if strict else _PRIVACY_NONPRIVATE)}
    _fields(spec)(privacy, "privacy", problems)

    if method in METHODS and isinstance(private, bool) and private != Method(method).private:
        want = "true" if Method(method).private else "false"
        problems.append(f"privacy.private: must be {want} for method {method!r}")
    if not strict:
        if privacy.get("epsilon") is not None:
            problems.append(
                "privacy.epsilon: must be null for a non-private run (there is no guarantee to "
                "state)"
            )
        return
    eps = privacy.get("epsilon")
    if isinstance(eps, Mapping) and all(
        _is_number(eps.get(k)) and math.isfinite(eps[k]) for k in (*ACCOUNTANTS, "max")
    ):
        largest = max(eps[k] for k in ACCOUNTANTS)
        if eps["max"] < largest:
            problems.append(
                f"privacy.epsilon.max: must be the largest of prv, rdp and pld ({largest!r}), "
                f"got {eps['max']!r}"
            )


def _check_preconditioner(report: Mapping[str, Any], problems: list[str]) -> None:
    privacy = report.get("privacy")
    method = privacy.get("method") if isinstance(privacy, Mapping) else None
    pre = report["preconditioner"]
    if pre is None:
        if method in PRECONDITIONED_METHODS:
            problems.append(
                f"preconditioner: must describe the preconditioner for method {method!r} "
                "(probe source, refreshes, coverage), got null"
            )
        return
    if method in METHODS and Method(method).private and not Method(method).preconditioned:
        problems.append(f"preconditioner: must be null for method {method!r} (no preconditioner)")
    _fields(
        {
            "uses_private_data": _boolean,
            "external_data": _nullable(_EXTERNAL),
            "probe_source": _mapping,
            "refresh_every": _integer(0),
            "refreshes": _list_of(_REFRESH),
            "covered_layers": _list_of(_string, "a list of layer names"),
            "config": _mapping,
            "coverage": _list_of(_COVERAGE_ROW, "a list of coverage rows"),
        }
    )(pre, "preconditioner", problems)
    if not isinstance(pre, Mapping):
        return
    public = method in METHODS and Method(method).public_data
    overridden = public and bool(
        (pre.get("probe_source") or {}).get("overlap_with_private_train")
        or (pre.get("probe_source") or {}).get("same_dataset_as_private")
    )
    if pre.get("uses_private_data") is True and not overridden:
        problems.append(
            "preconditioner.uses_private_data: must be false; the preconditioner may only be "
            "built from synthetic probes or external public data, never from the private data"
        )
    external = pre.get("external_data")
    if public and external is None:
        problems.append(
            "preconditioner.external_data: must name the external public data (path, sha256, "
            f"note) for method {method!r}"
        )
    elif method in PRECONDITIONED_METHODS and not public and external is not None:
        problems.append(
            f"preconditioner.external_data: must be null for method {method!r} (synthetic "
            f"probes only); use method {Method.DP_KFC_PUBLIC.value!r} for external data"
        )


def _check_history(history: Any, privacy: Any, problems: list[str]) -> None:
    _HISTORY(history, "history", problems)
    if not isinstance(history, Mapping):
        return
    private = not (isinstance(privacy, Mapping) and privacy.get("private") is False)

    def length(key: str) -> int | None:
        value = history.get(key)
        return len(value) if isinstance(value, (list, tuple)) else None

    steps, n_eps = length("step"), length("epsilon")
    if "epsilon_step" in history:
        # epsilon[i] is the stated accountant's epsilon after epsilon_step[i] steps.
        listed = history["epsilon_step"]
        _list_of(_integer(1), "a list of integers >= 1")(listed, "history.epsilon_step", problems)
        n_listed = length("epsilon_step")
        if n_listed is not None and n_eps is not None and n_eps != n_listed:
            problems.append(
                f"history.epsilon: must have the length of history.epsilon_step ({n_listed}), "
                f"has {n_eps}"
            )
        if isinstance(listed, (list, tuple)) and all(_is_int(v) for v in listed):
            if any(b <= a for a, b in zip(listed, listed[1:])):
                problems.append("history.epsilon_step: must be strictly increasing")
            _check_history_ends_at_the_report(history, privacy, problems)
    elif steps is not None and n_eps is not None and n_eps not in (steps, 0):
        problems.append(
            f"history.epsilon: must have the length of history.step or be empty ({steps}), "
            f"has {n_eps}"
        )
    if "epsilon_rdp" in history:
        _list_of(_curve_value, "a list of numbers")(
            history["epsilon_rdp"], "history.epsilon_rdp", problems
        )
        n_rdp = length("epsilon_rdp")
        if steps is not None and n_rdp is not None and n_rdp not in (steps, 0):
            problems.append(
                f"history.epsilon_rdp: must have the length of history.step or be empty "
                f"({steps}), has {n_rdp}"
            )
    if not private:
        for key in ("epsilon", "epsilon_step", "epsilon_rdp"):
            if length(key):
                problems.append(f"history.{key}: must be empty for a non-private run")


def _check_history_ends_at_the_report(
    history: Mapping[str, Any], privacy: Any, problems: list[str]
) -> None:
    """A private history's last listed step and value are the report's steps and epsilon."""
    if not isinstance(privacy, Mapping) or privacy.get("private") is False:
        return
    listed, values = history.get("epsilon_step") or [], history.get("epsilon") or []
    total, eps = privacy.get("steps"), privacy.get("epsilon")
    accountant = privacy.get("accountant")
    if isinstance(total, int) and total > 0 and (not listed or listed[-1] != total):
        problems.append(
            f"history.epsilon_step: must end at privacy.steps ({total}), the last step taken, "
            f"got {listed[-1] if listed else 'an empty list'}"
        )
    final = eps.get(accountant) if isinstance(eps, Mapping) else None
    if (
        _is_number(final)
        and values
        and len(values) == len(listed)
        and _is_number(values[-1])
        and values[-1] != final
    ):
        problems.append(
            f"history.epsilon: the last value ({values[-1]!r}) must be privacy.epsilon."
            f"{accountant} ({final!r}), the epsilon of all {total} steps"
        )


def _check_task(task: Any, problems: list[str]) -> None:
    _TASK(task, "task", problems)
    if not isinstance(task, Mapping):
        return
    names, k = task.get("label_names"), task.get("num_classes")
    if isinstance(names, (list, tuple)) and _is_int(k) and len(names) != k:
        problems.append(f"task.label_names: must have num_classes={k} entries, has {len(names)}")


def _check_metrics(metrics: Any, problems: list[str]) -> None:
    _METRICS(metrics, "metrics", problems)
    for split in ("val", "test"):
        values = metrics.get(split) if isinstance(metrics, Mapping) else None
        if not isinstance(values, Mapping) or "confusion_matrix" not in values:
            continue
        cm, path = values["confusion_matrix"], f"metrics.{split}.confusion_matrix"
        square = (
            isinstance(cm, (list, tuple))
            and all(isinstance(r, (list, tuple)) and len(r) == len(cm) for r in cm)
            and all(_is_number(x) for r in cm for x in r)
        )
        if not square:
            problems.append(f"{path}: must be a square list of lists of counts (rows: true class)")


def validate_report(report: Any) -> list[str]:
    """Every problem of ``report`` against :data:`REPORT_SCHEMA`, as human-readable lines.

    Args:
        report: The report dict built by the pipeline (enums, paths, NumPy numbers and
            dataclasses are accepted where a JSON value is expected; see :func:`to_json_data`).

    Returns:
        One ``"<dotted.field>: <problem>"`` line per problem, e.g.
        ``"privacy.epsilon.prv: missing"`` or
        ``"privacy.delta: must be a number in (0, 1), got 2.0"``; empty when valid.
    """
    data, problems = to_json_data(report)
    if not isinstance(data, Mapping):
        return [f"<report>: must be a mapping, got {_kind(data)}"]
    # Walked in layout order so that the problem list reads like the report.
    sections: list[tuple[str, Callable[[Any], None]]] = [
        ("schema", lambda v: _schema_id(v, "schema", problems)),
        ("status", lambda v: _one_of(*STATUSES)(v, "status", problems)),
        ("created", lambda v: _timestamp(v, "created", problems)),  # a date when shared
        ("run", lambda v: _RUN(v, "run", problems)),
        ("task", lambda v: _check_task(v, problems)),
        ("data", lambda v: _DATA(v, "data", problems)),
        ("model", lambda v: _MODEL(v, "model", problems)),
        ("privacy", lambda v: _check_privacy(v, problems)),
        ("preconditioner", lambda v: _check_preconditioner(data, problems)),
        ("training", lambda v: _mapping(v, "training", problems)),
        ("history", lambda v: _check_history(v, data.get("privacy"), problems)),
        ("custodian", lambda v: _CUSTODIAN(v, "custodian", problems)),
        ("environment", lambda v: _ENVIRONMENT(v, "environment", problems)),
    ]
    for key, check in sections:
        if key not in data:
            hint = " (null when there is none)" if key == "preconditioner" else ""
            problems.append(f"{key}: missing{hint}")
        else:
            check(data[key])
    _check_shareable(data, problems)
    if "audit" in data:
        _AUDIT(data["audit"], "audit", problems)
    return problems


_CUSTODIAN = _fields({"path": _string, "report": _string, "items": _mapping, "note": _string})
_AUDIT = _fields(
    {
        "epsilon_lower_bound": _number(0),
        "epsilon_accounted": _number(0),
        "delta": _number(0, 1, low_open=True, high_open=True),
        "canaries": _integer(1),
        "confidence": _number(0, 1, low_open=True, high_open=True),
    }
)


def _check_shareable(data: Mapping[str, Any], problems: list[str]) -> None:
    """The shareable report must hold no un-noised private statistic (custodian-only field)."""
    from dpkfc_med.report.custodian import CUSTODIAN_ONLY

    for dotted, what in CUSTODIAN_ONLY.items():
        node: Any = data
        for part in dotted.split("."):
            node = node.get(part, _ABSENT) if isinstance(node, Mapping) else _ABSENT
        if node is not _ABSENT:
            problems.append(
                f"{dotted}: must not be in the shareable report ({what}); it belongs in the "
                "custodian report (dpkfc_med.report.split_report)"
            )


_ABSENT = object()


def validate_custodian_report(report: Any) -> list[str]:
    """Every problem of a custodian report (schema ``dpkfc_med.custodian_report/1``)."""
    from dpkfc_med.report.custodian import CUSTODIAN_SCHEMA

    data, problems = to_json_data(report)
    if not isinstance(data, Mapping):
        return [f"<custodian report>: must be a mapping, got {_kind(data)}"]
    if data.get("schema") != CUSTODIAN_SCHEMA:
        problems.append(f"schema: must be {CUSTODIAN_SCHEMA!r}, got {_kind(data.get('schema'))}")
    _string(data.get("banner"), "banner", problems)
    history = data.get("history")
    if not isinstance(history, Mapping):
        problems.append("history: must be a mapping")
    else:
        steps, loss = history.get("step", []), history.get("loss", [])
        if isinstance(steps, list) and isinstance(loss, list) and len(loss) != len(steps):
            problems.append(
                f"history.loss: must have the length of history.step ({len(steps)}), "
                f"has {len(loss)}"
            )
        epochs, values = history.get("val_epoch", []), history.get("val_metric", [])
        if isinstance(epochs, list) and isinstance(values, list) and len(epochs) != len(values):
            problems.append(
                f"history.val_metric: must have the length of history.val_epoch ({len(epochs)}), "
                f"has {len(values)}"
            )
    _check_metrics(data.get("metrics"), problems)
    _nullable(_mapping)(data.get("diagnostics"), "diagnostics", problems)
    return problems


def check_report(report: Any) -> None:
    """Raise :class:`ReportSchemaError` listing every problem of ``report``, if any.

    Raises:
        ReportSchemaError: with one line per problem (see :func:`validate_report`).
    """
    problems = validate_report(report)
    if problems:
        raise ReportSchemaError(problems)
