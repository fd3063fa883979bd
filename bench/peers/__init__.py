"""compare.py's parts: the workload and targets, the servers it starts, CPU accounting, one point,
the report. (bench/ is on sys.path when a script there runs, so these import as `peers.*`.)"""
