"""Dataset downloads, synthetic generators and format converters (`python -m trainer data ...`)."""
