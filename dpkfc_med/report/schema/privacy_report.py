"""The privacy report contract (schema ``dpkfc_med.privacy_report/2``) and its validator.

The report is a plain, JSON-serialisable dict built by the training pipeline. Validation is
hand-written (no ``jsonschema`` dependency; the field rules are
:mod:`dpkfc_med.report.schema.rules`, the JSON view :mod:`dpkfc_med.report.schema.json_data`)
so that every problem reads as ``"<dotted.field>: <what is wrong>"`` and all problems are
reported at once.

Layout (version 1; keys not listed are allowed and kept)::

    schema: "dpkfc_med.privacy_report/2"
    status: "complete" | "incomplete"  (dpkfc_med.report.status.RunStatus)
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
:func:`~dpkfc_med.report.schema.custodian_report.validate_custodian_report`) under
``private_not_for_release/``.

Privacy-relevant fields (``privacy.*``, ``preconditioner.uses_private_data``) are checked
strictly, including their consistency with ``privacy.method``; display-only fields
(``metrics``, ``diagnostics``, ``training``) only need to be JSON-serialisable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from dpkfc_med.methods import METHODS, PRECONDITIONED_METHODS, Method
from dpkfc_med.privacy.accounting import Accountant
from dpkfc_med.report.schema.json_data import to_json_data
from dpkfc_med.report.schema.rules import (
    Check,
    boolean,
    curve_value,
    describe,
    fields,
    integer,
    is_int,
    is_number,
    list_of,
    mapping,
    mapping_of,
    nullable,
    number,
    one_of,
    present,
    sha256,
    sha256_field,
    string,
    timestamp,
)
from dpkfc_med.report.status import RunStatus

__all__ = [
    "ACCOUNTANTS",
    "COVERAGE_COLUMNS",
    "REPORT_SCHEMA",
    "STATUSES",
    "ReportSchemaError",
    "check_report",
    "validate_report",
]

REPORT_SCHEMA = "dpkfc_med.privacy_report/2"
"""Schema id written into (and required of) every report."""

STATUSES = tuple(s.value for s in RunStatus)
"""The values of ``status`` (:class:`~dpkfc_med.report.status.RunStatus`)."""
ACCOUNTANTS = tuple(a.value for a in Accountant)
"""The accountants every private report states epsilon by
(:class:`~dpkfc_med.privacy.accounting.Accountant`)."""
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


def _schema_id(value: Any, path: str, problems: list[str]) -> None:
    if value != REPORT_SCHEMA:
        problems.append(
            f"{path}: must be {REPORT_SCHEMA!r}, got {describe(value)}; the report was written by "
            "another version of dpkfc_med"
        )


# --------------------------------------------------------------------------- sections
_RUN = fields(
    {
        "name": string,
        "config_sha256": sha256,
        "config": mapping,
        "seed": nullable(integer()),
        "device": string,
    }
)
_TASK = fields(
    {
        "kind": one_of("classification", "segmentation"),
        "spatial_dims": one_of(2, 3),
        "num_classes": integer(1),
        "label_names": nullable(list_of(string, "a list of strings")),
    }
)
_DATA = fields(
    {
        "splits": mapping_of(integer(0), "a mapping split -> number of samples"),
        "num_train_units": integer(1),
        "privacy_unit": string,
        "max_samples_per_unit": nullable(integer(1)),
    }
)
_MODEL = fields(
    {
        "name": string,
        "num_params": integer(0),
        "fixes": list_of(mapping, "a list of mappings (one per fix)"),
    }
)
_HISTORY = fields(
    {
        "step": list_of(integer(0), "a list of integers"),
        "epsilon": list_of(curve_value, "a list of numbers"),
        "val_metric_name": string,
    }
)
_ENVIRONMENT = fields(
    {
        "python": string,
        "packages": mapping_of(nullable(string), "a mapping package -> version or null"),
        "git": nullable(fields({"commit": string, "dirty": boolean})),
    }
)
_REFRESH = fields(
    {
        "step": integer(0),
        "probe_seed": integer(),
        "seconds": number(0),
        "scale": nullable(number()),
    }
)


_COVERAGE_ROW = fields(dict.fromkeys(COVERAGE_KEYS, present))
_EXTERNAL = fields({"sha256": sha256_field, "note": string})  # path: custodian report

_PRIVACY_COMMON: dict[str, Check] = {
    "method": one_of(*METHODS),
    "private": boolean,
    "accountant": one_of(*ACCOUNTANTS),
    "steps": integer(0),
    "planned_steps": nullable(integer(0)),
    "epochs": number(0),
    "secure_rng": boolean,
    "neighbouring_relation": string,
    "guarantee": string,
    "hyperparameter_tuning": string,
    "ledger": mapping,
    "randomness": fields(
        {
            "source": one_of("os-entropy", "os-csprng", "seeded", "none"),
            "valid_dp_release": boolean,
        }
    ),
    "not_covered": list_of(string, "a list of sentences"),
}
_FOR_PRIVATE = " for a private run"
_PRIVACY_PRIVATE: dict[str, Check] = {
    "epsilon": fields({k: number(0) for k in (*ACCOUNTANTS, "max")}),
    "target_epsilon": nullable(number(0, low_open=True)),
    "delta": number(0, 1, low_open=True, high_open=True),
    "sampler": one_of("poisson"),
    "sample_rate": number(0, 1, low_open=True, context=_FOR_PRIVATE),
    "expected_batch_size": integer(1),
    "noise_multiplier": number(0, low_open=True, context=_FOR_PRIVATE),
    "max_grad_norm": number(0, low_open=True, context=_FOR_PRIVATE),
}
_PRIVACY_NONPRIVATE: dict[str, Check] = {
    "target_epsilon": nullable(number(0, low_open=True)),
    "delta": nullable(number(0, 1, low_open=True, high_open=True)),
    "sampler": nullable(one_of("poisson")),
    "sample_rate": nullable(number(0, 1, low_open=True)),
    "expected_batch_size": nullable(integer(1)),
    "noise_multiplier": nullable(number(0)),
    "max_grad_norm": nullable(number(0, low_open=True)),
}


def _check_privacy(privacy: Any, problems: list[str]) -> None:
    if not isinstance(privacy, Mapping):
        problems.append(f"privacy: must be a mapping, got {describe(privacy)}")
        return
    method, private = privacy.get("method"), privacy.get("private")
    # Which fields are mandatory depends on whether the run claims a guarantee; a run whose
    # ``private`` flag is missing or wrong is checked as private, the stricter reading.
    strict = private is not False or method != Method.NONPRIVATE.value
    spec = {**_PRIVACY_COMMON, **(_PRIVACY_PRIVATE if strict else _PRIVACY_NONPRIVATE)}
    fields(spec)(privacy, "privacy", problems)

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
        is_number(eps.get(k)) and math.isfinite(eps[k]) for k in (*ACCOUNTANTS, "max")
    ):
        largest = max(eps[k] for k in ACCOUNTANTS)
        if eps["max"] < largest:
            names = f"{', '.join(ACCOUNTANTS[:-1])} and {ACCOUNTANTS[-1]}"
            problems.append(
                f"privacy.epsilon.max: must be the largest of {names} ({largest!r}), "
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
    fields(
        {
            "uses_private_data": boolean,
            "external_data": nullable(_EXTERNAL),
            "probe_source": mapping,
            "refresh_every": integer(0),
            "refreshes": list_of(_REFRESH),
            "covered_layers": list_of(string, "a list of layer names"),
            "config": mapping,
            "coverage": list_of(_COVERAGE_ROW, "a list of coverage rows"),
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
        list_of(integer(1), "a list of integers >= 1")(listed, "history.epsilon_step", problems)
        n_listed = length("epsilon_step")
        if n_listed is not None and n_eps is not None and n_eps != n_listed:
            problems.append(
                f"history.epsilon: must have the length of history.epsilon_step ({n_listed}), "
                f"has {n_eps}"
            )
        if isinstance(listed, (list, tuple)) and all(is_int(v) for v in listed):
            if any(b <= a for a, b in zip(listed, listed[1:])):
                problems.append("history.epsilon_step: must be strictly increasing")
            _check_history_ends_at_the_report(history, privacy, problems)
    elif steps is not None and n_eps is not None and n_eps not in (steps, 0):
        problems.append(
            f"history.epsilon: must have the length of history.step or be empty ({steps}), "
            f"has {n_eps}"
        )
    if "epsilon_rdp" in history:
        list_of(curve_value, "a list of numbers")(
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
        is_number(final)
        and values
        and len(values) == len(listed)
        and is_number(values[-1])
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
    if isinstance(names, (list, tuple)) and is_int(k) and len(names) != k:
        problems.append(f"task.label_names: must have num_classes={k} entries, has {len(names)}")


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
        return [f"<report>: must be a mapping, got {describe(data)}"]
    # Walked in layout order so that the problem list reads like the report.
    sections: list[tuple[str, Callable[[Any], None]]] = [
        ("schema", lambda v: _schema_id(v, "schema", problems)),
        ("status", lambda v: one_of(*STATUSES)(v, "status", problems)),
        ("created", lambda v: timestamp(v, "created", problems)),  # a date when shared
        ("run", lambda v: _RUN(v, "run", problems)),
        ("task", lambda v: _check_task(v, problems)),
        ("data", lambda v: _DATA(v, "data", problems)),
        ("model", lambda v: _MODEL(v, "model", problems)),
        ("privacy", lambda v: _check_privacy(v, problems)),
        ("preconditioner", lambda v: _check_preconditioner(data, problems)),
        ("training", lambda v: mapping(v, "training", problems)),
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


_CUSTODIAN = fields({"path": string, "report": string, "items": mapping, "note": string})
_AUDIT = fields(
    {
        "epsilon_lower_bound": number(0),
        "epsilon_accounted": number(0),
        "delta": number(0, 1, low_open=True, high_open=True),
        "canaries": integer(1),
        "confidence": number(0, 1, low_open=True, high_open=True),
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


def check_report(report: Any) -> None:
    """Raise :class:`ReportSchemaError` listing every problem of ``report``, if any.

    Raises:
        ReportSchemaError: with one line per problem (see :func:`validate_report`).
    """
    problems = validate_report(report)
    if problems:
        raise ReportSchemaError(problems)
