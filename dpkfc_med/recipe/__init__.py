"""``training.recipe: auto``: training settings chosen from public facts only.

:mod:`.facts` says what the rule may look at, :mod:`.rule` is the rule, :mod:`.apply` fills a
run config's unset fields with it and records where each value came from.
"""

from dpkfc_med.recipe.apply import (
    BY_RULE,
    RECIPES,
    SET_BY_YOU,
    public_facts,
    recipe_after_task,
    recipe_before_task,
)
from dpkfc_med.recipe.facts import PublicFacts
from dpkfc_med.recipe.rule import RECIPE_FIELDS, Choice, choose

__all__ = [
    "BY_RULE",
    "RECIPES",
    "RECIPE_FIELDS",
    "SET_BY_YOU",
    "Choice",
    "PublicFacts",
    "choose",
    "public_facts",
    "recipe_after_task",
    "recipe_before_task",
]
