"""Federated sites through Flower: ``dpkfc-med federated CONFIG --sites N --rounds R``.

Each site is a Flower client that trains privately on its own units with this package's full
training loop (DP-SGD or DP-KFC, its own Poisson sampling, ledger, checkpoints and privacy
report); a Flower server averages the sites' released models (FedAvg) and sends the average
back for the next round. On one machine (the demo and the tests) site ``k`` of ``N`` holds
every ``N``-th unit of the training split (``data.shard``), and the server and the sites talk
over loopback only.

Privacy, per site:
    A site's plan spreads its target epsilon over all its rounds: the noise is calibrated once
    for ``rounds * local_epochs`` epochs of its own units, and its ledger (written before each
    update, so a site that drops out never under-reports) composes every round. What leaves a
    site is its released model (post-processing of its mechanism) and figures of its ledger
    (epsilon, steps, its unit count); the global model it receives depends only on other
    sites' releases. A unit belongs to one site, so each site's guarantee is about its own
    units.

The server holds no site's data: it never loads a split, and the initial global model comes
from one site (built from the config's seed and data-free pretraining; its architecture
follows the data's public shape). After the last round every site evaluates the federated
model on its own test data, in its own process, and keeps the figures under its
``private_not_for_release/`` (:data:`SITE_EVALUATION`): they are un-noised and custodian-only,
so the server learns only that each site evaluated, and its files (``server/``) hold only
released parameters and the sites' ledger figures.

Probes are data-free: every site rebuilds its preconditioner from the same probes at the
global model it receives, so the sites' preconditioners agree at the start of each round; the
server checks their fingerprints.

Transport: Flower's ``start_server`` / ``start_client`` over gRPC on loopback (deprecated in
Flower 1.x in favour of SuperLink deployments, still shipped; its deprecation notices are
silenced here). Needs the ``federated`` extra (``pip install "dpkfc-med[federated]"``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

from dpkfc_med.report.custodian import PRIVATE_DIR
from dpkfc_med.report.numbers import format_epsilon
from dpkfc_med.training.config import ConfigError, RunConfig
from dpkfc_med.training.distributed import free_port
from dpkfc_med.utils import write_json

__all__ = ["SITE_EVALUATION", "run_federated"]

log = logging.getLogger(__name__)

ROUND_SEED = 1_000_003
"""Round ``r`` starts from probes of seed ``probes.seed + r * ROUND_SEED`` on every site."""

ROUND_TIMEOUT_S = 3600.0
"""A round whose sites have not all answered by then ends without them."""

SITE_EVALUATION = f"{PRIVATE_DIR}/evaluations/federated_test.json"
"""Where a site keeps its evaluation of the federated model, relative to its run directory."""

SITE_EVALUATION_NOTE = (
    "computed by this site from its own test data, which no privacy guarantee covers (the "
    "guarantees cover the released models only); for this site's data custodian: release "
    "these figures only if that test data may be released"
)


def _site_config(cfg: RunConfig, site: int, sites: int, rounds: int, local: int, out: Path) -> Any:
    return replace(
        cfg,
        name=f"site_{site}",
        data=replace(cfg.data, shard=[site, sites]),
        training=replace(cfg.training, epochs=rounds * local, eval_every=local, progress=False),
        # data-free pretraining happens once, for the initial global model (get_parameters)
        pretrain=replace(cfg.pretrain, steps=0),
        output=replace(cfg.output, dir=str(out / f"site_{site}")),
    )


def _quiet_flower() -> None:
    logging.getLogger("flwr").setLevel(logging.ERROR)


def _site_main(
    site: int, port: int, cfg: RunConfig, local: int, threads: int, pretrain: Any
) -> None:
    """One site: its own data, its private training, its custodian-only evaluation."""
    import flwr

    _quiet_flower()
    from dpkfc_med.tasks.build import build_task
    from dpkfc_med.training.pretrain import pretrain as _pretrain
    from dpkfc_med.training.run import train
    from dpkfc_med.training.setup import build_run_model

    torch.set_num_threads(threads)

    class Site(flwr.client.NumPyClient):  # type: ignore[misc]
        def __init__(self) -> None:
            self.round = 0
            self.pretrain: dict[str, Any] | None = None

        def _model(self) -> tuple[Any, Any]:
            task = build_task(cfg, public_probes=False)
            torch.manual_seed(cfg.training.seed)  # the initial model train() builds
            model, _ = build_run_model(cfg, task)
            return task, model

        def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
            # Asked of one site, once: the initial global model. Its architecture follows the
            # data's public shape (channels, classes, size), which the server never loads;
            # the parameters come from the seed and data-free pretraining only.
            task, model = self._model()
            if pretrain.steps:
                full = replace(cfg, pretrain=pretrain)
                self.pretrain = _pretrain(full, task, model, torch.device("cpu"))
            return [v.detach().cpu().numpy() for v in model.state_dict().values()]

        def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> Any:
            self.round += 1
            seen: dict[str, Any] = {}

            def start_from_global(engine: Any, popt: Any) -> None:
                model = engine.module._module
                keys = list(model.state_dict())
                model.load_state_dict(
                    {k: torch.as_tensor(a) for k, a in zip(keys, parameters, strict=True)}
                )
                if engine.method.value == "dp-kfc":
                    # probes at the global model, seeded by the round: the same on every site
                    pre = engine.refresh_preconditioner(
                        seed=cfg.probes.seed + ROUND_SEED * self.round
                    )
                    seen["fingerprint"] = pre.fingerprint()
                seen["keys"] = keys

            res = train(
                cfg, resume=self.round > 1, stop_after_epochs=local, instrument=start_from_global
            )
            ck = torch.load(res.run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
            out = [ck["model"][k].detach().cpu().numpy() for k in seen["keys"]]
            p = res.report.get("privacy", {})
            metrics = {
                "site": site,
                "epsilon": float(p.get("epsilon", {}).get("prv", math.nan)),
                "steps": int(p.get("steps", 0)),
                "status": res.status,
                "fingerprint": float(seen.get("fingerprint", 0.0)),
                "keys": json.dumps(seen["keys"]),
            }
            if self.pretrain is not None:  # data-free: the initial model's provenance
                metrics["pretrain"] = json.dumps(self.pretrain, default=str)
                self.pretrain = None
            # the FedAvg weight: the site's unit count, public like its ledger's N
            return out, int(res.report["data"]["num_train_units"]), metrics

        def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]) -> Any:
            # The federated model on this site's own test data: un-noised figures that only
            # this site's custodian sees; the server is told that it happened, nothing else.
            task, model = self._model()
            keys = list(model.state_dict())
            model.load_state_dict(
                {k: torch.as_tensor(a) for k, a in zip(keys, parameters, strict=True)}
            )
            metrics = task.evaluate(
                model.eval(), "test", torch.device("cpu"), cfg.training.eval_batch_size, full=True
            )
            write_json(
                cfg.run_dir() / SITE_EVALUATION,
                {
                    "model": "federated (FedAvg of the sites' released models after round "
                    f"{config.get('round')})",
                    "site": site,
                    "data": task.data_record,
                    "split": "test",
                    "metrics": metrics,
                    "not_dp": True,
                    "privacy_note": SITE_EVALUATION_NOTE,
                },
            )
            return 0.0, 0, {"site": site}

    flwr.client.start_client(server_address=f"127.0.0.1:{port}", client=Site().to_client())


def _server_main(port: int, sites: int, rounds: int, server_dir: str, base: dict[str, Any]) -> None:
    """The server: FedAvg of released site models; it never loads or sees a site's data."""
    import flwr

    _quiet_flower()
    folder = Path(server_dir)
    history: list[dict[str, Any]] = []
    latest: dict[str, Any] = {"pretrain": None}

    class Strategy(flwr.server.strategy.FedAvg):  # type: ignore[misc]
        def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
            if not results or failures:
                raise RuntimeError(f"round {server_round}: {len(failures)} site(s) failed")
            params, metrics = super().aggregate_fit(server_round, results, failures)
            rows = sorted((dict(r.metrics) for _, r in results), key=lambda m: m["site"])
            fps = [m["fingerprint"] for m in rows]
            if max(fps) - min(fps) > 1e-6 * max(1.0, abs(max(fps))):
                raise RuntimeError(
                    f"round {server_round}: the sites' preconditioners differ ({fps}); every "
                    "site must run the same code and config"
                )
            keys = {m.pop("keys") for m in rows}
            if len(keys) != 1:
                raise RuntimeError(
                    f"round {server_round}: the sites' models have different parameter names; "
                    "every site must run the same code and config"
                )
            for m in rows:
                if "pretrain" in m:
                    latest["pretrain"] = json.loads(m.pop("pretrain"))
            history.append({"round": server_round, "sites": rows})
            latest["params"], latest["keys"] = params, json.loads(keys.pop())
            return params, metrics

        def configure_evaluate(
            self, server_round: int, parameters: Any, client_manager: Any
        ) -> Any:
            # only the final model, each site on its own data (custodian-only results)
            if server_round < rounds:
                return []
            return super().configure_evaluate(server_round, parameters, client_manager)

        def aggregate_evaluate(self, server_round: int, results: Any, failures: Any) -> Any:
            if failures or len(results) < sites:
                raise RuntimeError(
                    f"the final evaluation: {len(failures)} site(s) failed, "
                    f"{len(results)} of {sites} answered"
                )
            latest["evaluated"] = sorted(int(r.metrics["site"]) for _, r in results)
            return None, {}  # no figure reaches the server

    flwr.server.start_server(
        server_address=f"127.0.0.1:{port}",
        config=flwr.server.ServerConfig(num_rounds=rounds, round_timeout=ROUND_TIMEOUT_S),
        strategy=Strategy(
            fraction_fit=1.0,
            fraction_evaluate=1.0,
            on_evaluate_config_fn=lambda r: {"round": r},
            min_fit_clients=sites,
            min_evaluate_clients=sites,
            min_available_clients=sites,
            initial_parameters=None,  # asked of one site: the server builds no model
            accept_failures=False,
        ),
    )
    if len(history) < rounds:
        raise RuntimeError(f"only {len(history)} of {rounds} rounds completed")
    if latest.get("evaluated") != list(range(sites)):
        raise RuntimeError("the sites did not all evaluate the federated model")
    final = flwr.common.parameters_to_ndarrays(latest["params"])
    keys = latest["keys"]
    state = {k: torch.as_tensor(a) for k, a in zip(keys, final, strict=True)}
    torch.save({"model": state, "keys": keys}, folder / "model.pt")
    record = {
        **base,
        "history": history,
        "pretrain": latest["pretrain"],
        "site_evaluations": [str(Path(d) / SITE_EVALUATION) for d in base["site_dirs"]],
        "note": "each site's guarantee covers its own units; see site_k/privacy_report.md. "
        "The federated model is evaluated by each site on its own data; those figures are "
        f"custodian-only (site_k/{SITE_EVALUATION}) and never reach the server",
    }
    write_json(folder / "federated.json", record)
    (folder / "federated.md").write_text(_markdown(record), encoding="utf-8")


def _watch(procs: list[Any], poll_s: float = 1.0) -> None:
    """Wait for the server (``procs[0]``) and the sites; any failure stops them all."""
    while any(p.is_alive() for p in procs):
        failed = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
        if failed:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            names = ["server" if p is procs[0] else f"site {procs.index(p) - 1}" for p in failed]
            raise RuntimeError(
                f"federated training stopped: {', '.join(names)} exited with code "
                f"{failed[0].exitcode}; each site's ledger covers every update it made"
            )
        procs[0].join(timeout=poll_s)
    if procs[0].exitcode != 0:
        raise RuntimeError(
            f"federated training stopped: the server exited with {procs[0].exitcode}"
        )


def run_federated(
    cfg: RunConfig, *, sites: int, rounds: int, local_epochs: int = 1
) -> dict[str, Any]:
    """Train ``cfg`` over ``sites`` Flower clients for ``rounds`` FedAvg rounds (loopback).

    Writes ``OUT/site_k/`` (each site's run directory: ledger, checkpoint, privacy report, and
    under ``private_not_for_release/`` its custodian report and its evaluation of the federated
    model on its own test data, :data:`SITE_EVALUATION`) and ``OUT/server/`` (the federated
    model ``model.pt`` and ``federated.json`` / ``federated.md``: per-round site epsilons,
    steps and preconditioner fingerprints -- released parameters and ledgers only, no
    metric), ``OUT`` being ``cfg.run_dir()``. Neither this process nor the server loads a
    site's data: only the sites do.

    Returns:
        The ``federated.json`` record.

    Raises:
        ConfigError: a non-private method, fewer than 2 sites, or fewer than 1 round.
        RuntimeError: a site or the server failed, the sites' preconditioners or models
            disagree, or a round got no results.
    """
    problems = []
    try:
        import flwr  # noqa: F401
    except ImportError:
        problems.append('federated training needs Flower: pip install "dpkfc-med[federated]"')
    if not cfg.method_enum.private:
        problems.append(
            f"method={cfg.method_enum.value}: federated sites train privately; use dp-sgd or dp-kfc"
        )
    if sites < 2:
        problems.append(f"--sites {sites}: use 2 or more")
    if rounds < 1 or local_epochs < 1:
        problems.append(f"--rounds {rounds} / --local-epochs {local_epochs}: must be >= 1")
    out = cfg.run_dir()
    taken = [d for d in [out / "server", *(out / f"site_{k}" for k in range(sites))] if d.exists()]
    if taken:
        problems.append(
            f"{taken[0]} exists: a federated run starts in a new folder; pass another --out "
            "(site ledgers are never overwritten)"
        )
    if problems:
        raise ConfigError(problems)
    server_dir = out / "server"
    server_dir.mkdir(parents=True, exist_ok=True)
    base = {
        "sites": sites,
        "rounds": rounds,
        "local_epochs": local_epochs,
        "method": cfg.method_enum.value,
        "target_epsilon_per_site": cfg.privacy.target_epsilon,
        "site_dirs": [f"site_{k}" for k in range(sites)],  # relative to the run's folder
    }
    port = free_port()
    threads = max(1, (cfg.training.threads or os.cpu_count() or 1) // sites)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_server_main,
            args=(port, sites, rounds, str(server_dir), base),
            name="federated-server",
        )
    ]
    procs += [
        ctx.Process(
            target=_site_main,
            args=(
                k,
                port,
                _site_config(cfg, k, sites, rounds, local_epochs, out),
                local_epochs,
                threads,
                cfg.pretrain,
            ),
            name=f"federated-site-{k}",
        )
        for k in range(sites)
    ]
    for proc in procs:
        proc.start()
    _watch(procs)
    record: dict[str, Any] = json.loads((server_dir / "federated.json").read_text(encoding="utf-8"))
    return record


def _markdown(record: dict[str, Any]) -> str:
    last = record["history"][-1]["sites"]
    lines = [
        f"# Federated run: {record['sites']} sites, {record['rounds']} rounds "
        f"({record['method']}, FedAvg)",
        "",
        "| site | epsilon spent (PRV) | target | noisy steps | status |",
        "|---|---|---|---|---|",
    ]
    for m in last:
        lines.append(
            f"| {m['site']} | {format_epsilon(m['epsilon'])} | "
            f"{record['target_epsilon_per_site']:g} | "
            f"{m['steps']} | {m['status']} |"
        )
    lines += ["", record["note"] + "."]
    return "\n".join(lines) + "\n"
