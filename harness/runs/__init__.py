"""A run as a job: the typed config (`config`), reading a composed one (`access`), every check
made before compute (`validate`), the task wrapper and Slurm guard (`launch`), the pre-submission
check of a sweep (`presubmit`), the pre-registration schema (`prereg`) and the trackers
(`tracking`)."""
