"""Search: an Optuna study over a space of config keys, its trials run as the tasks of a job array (hpc/submit.py
--search), kept in journal storage on the shared file system (no database server): trainer/search/space.py reads the
space file, trainer/search/study.py opens the study, claims a task's trial and tells its result."""
