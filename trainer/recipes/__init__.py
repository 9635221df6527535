"""Recipes: one folder per model family, registered by name (see base.py)."""
from trainer.recipes.base import Recipe, get_recipe_class, recipe_names, register_recipe

__all__ = ["Recipe", "get_recipe_class", "recipe_names", "register_recipe"]
