"""The training settings a private bundle run starts from: the rule's or the bundle's own.

``--recipe auto`` (the default) leaves batch, epochs, optimizer, lr, method and data-free
pretraining to the rule of ``training.recipe: auto`` (:mod:`dpkfc_med.recipe`): a bundle's
own non-private hyperparameters (a batch of 8, Adam at 3e-3, no pretraining) train badly under
DP. ``--recipe bundle`` keeps the bundle's own optimizer, lr, batch and epochs, as MONAI would
run them, and no pretraining. Either way the bundle's ``private_training`` section and
``--set`` come on top, as settings of yours. A bundle may state which it wants in
``private_training#training#recipe`` (``auto`` or ``bundle``); ``--recipe`` overrides it.
"""

from __future__ import annotations

from typing import Any

from dpkfc_med.bundle.zoo_task import config_value, has_id

__all__ = ["BUNDLE_RECIPES", "bundle_recipe", "bundle_training"]

BUNDLE_RECIPES = ("auto", "bundle")


def bundle_recipe(parser: Any, recipe: str | None) -> str:
    """``recipe`` if given, else the bundle's ``private_training#training#recipe``, else auto."""
    own = config_value(parser, "private_training#training#recipe")
    chosen = recipe if recipe is not None else own if own is not None else "auto"
    if chosen not in BUNDLE_RECIPES:
        where = "--recipe" if recipe is not None else "private_training#training#recipe"
        raise ValueError(f"{where}={chosen!r}: expected one of {list(BUNDLE_RECIPES)}")
    return str(chosen)


def bundle_training(parser: Any, recipe: str, replaced: list[str]) -> dict[str, Any]:
    """The ``method``, ``training`` and ``pretrain`` sections a bundle run starts from.

    Args:
        parser: The bundle's train config.
        recipe: ``auto`` or ``bundle`` (:data:`BUNDLE_RECIPES`).
        replaced: Where a component the engine replaces is noted (an optimizer it lacks).
    """
    if recipe not in BUNDLE_RECIPES:
        raise ValueError(f"recipe={recipe!r}: expected one of {list(BUNDLE_RECIPES)}")
    if recipe == "auto":
        return {"training": {"recipe": "auto", "select_epoch": "last"}}
    epochs = int(config_value(parser, "train#trainer#max_epochs", 1) or 1)
    batch = int(config_value(parser, "train#dataloader#batch_size", 2) or 2)
    lr = float(parser["optimizer#lr"]) if has_id(parser, "optimizer#lr") else 1e-3
    opt_target = str(parser["optimizer#_target_"]) if has_id(parser, "optimizer#_target_") else ""
    kind = opt_target.rsplit(".", 1)[-1].lower()
    if opt_target and kind not in ("adam", "sgd"):
        replaced.append(
            f"optimizer ({opt_target}): replaced by SGD with its lr (the private engine trains "
            "with SGD, Adam or DP-AdamBC; choose with --set training.optimizer=adam)"
        )
    extra = {
        k: float(parser[f"optimizer#{k}"])
        for k in ("momentum", "weight_decay")
        if has_id(parser, f"optimizer#{k}")
    }
    return {
        "method": "dp-kfc",
        "training": {
            "recipe": "manual",
            "epochs": epochs,
            "batch_size": batch,
            "lr": lr,
            "optimizer": "adam" if kind == "adam" else "sgd",
            "select_epoch": "last",
            **extra,
        },
        "pretrain": {"steps": 0},
    }
