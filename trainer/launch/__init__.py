"""Around the training processes: what an exit code says and each rank's record of it (exitcodes.py), the in-allocation
restart loop's decisions (restarts.py, run by slurm/common.sh), and `trainer doctor` (doctor.py)."""
