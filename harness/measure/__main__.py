"""`python -m harness.measure`: the main job (harness/measure/__init__.py)."""

import sys

from harness.measure import check_argv, main  # by reference: submitit pickles harness.measure.main

check_argv(sys.argv[1:])
main()
