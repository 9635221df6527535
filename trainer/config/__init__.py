"""What a run is configured from: the typed settings with their YAML and overrides (settings.py), the ranges of their
numbers (bounds.py), the record a recipe fills (spec.py) and the recipes found by name (registry.py). Nothing here
imports torch."""
