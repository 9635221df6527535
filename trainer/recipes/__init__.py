"""Recipes: one folder per model family; each folder's spec.py fills a RecipeSpec (trainer/config/spec.py)."""
