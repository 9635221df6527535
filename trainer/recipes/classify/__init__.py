"""What the classification recipes (HAR, video) share: the recipe base (recipe.py), its metrics (metrics.py) and
the confusion-matrix figure (plots.py)."""
