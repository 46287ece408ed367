"""dpkfc_bench.accuracy: learning-rate choice and the summary table (no training runs)."""

from __future__ import annotations

from pathlib import Path

from dpkfc_bench import accuracy as acc


def _run(phase, method, lr, seed, val_auroc=0.9, test_acc=0.8):
    m = {"accuracy": test_acc, "balanced_accuracy": test_acc, "auroc": val_auroc}
    return {
        "phase": phase,
        "method": method,
        "eps": 1.0,
        "lr": lr,
        "seed": seed,
        "val": m,
        "test": m,
        "epsilon": 0.99,
    }


def test_widened_grid_never_mixes_learning_rates():
    runs = [
        _run("tune", "dp-sgd", 0.05, 0, val_auroc=0.90),
        _run("tune", "dp-sgd", 0.2, 0, val_auroc=0.95),
        *[_run("eval", "dp-sgd", 0.2, s, test_acc=0.5) for s in (1, 2, 3)],
        # the grid was widened later and 0.1 won: only its evaluations may count
        _run("tune", "dp-sgd", 0.1, 0, val_auroc=0.97),
        *[_run("eval", "dp-sgd", 0.1, s, test_acc=0.8) for s in (1, 2)],
    ]
    data = {"runs": runs, "lrs": [0.05, 0.1, 0.2], "suite": "s", "seeds": [1, 2, 3]}
    assert acc._best_lr(data, "dp-sgd", 1.0) == 0.1
    row = next(line for line in acc.summarize(data).splitlines() if line.startswith("| dp-sgd"))
    assert "| 0.1 |" in row and "0.800 +- 0.000" in row and row.endswith("| 2 |")
    # a tuning run outside the current grid is ignored by the choice
    data["lrs"] = [0.05, 0.2]
    assert acc._best_lr(data, "dp-sgd", 1.0) == 0.2


def test_adam_variants_use_their_own_grid():
    data = {
        "runs": [
            _run("tune", "dp-kfc-adambc", 0.01, 0, val_auroc=0.96),
            _run("tune", "dp-kfc-adambc", 0.2, 0, val_auroc=0.99),  # not on the Adam grid
        ],
        "lrs": [0.02, 0.05, 0.1, 0.2, 0.5],
    }
    assert acc._grid(data["lrs"], "dp-kfc-adambc") == acc.ADAM_LRS
    assert acc._best_lr(data, "dp-kfc-adambc", 1.0) == 0.01
    assert "lrs" not in acc._config(
        "pneumonia_cnn", "dp-kfc-adambc", 1.0, 0.01, 0, False, Path("x")
    )
