"""Cluster side: submitit submission (hpc/submit.py) and the local test cluster (hpc/cluster/)."""
