"""`python -m harness.measure`: the main job (harness/measure/__init__.py)."""

import sys

from harness.measure import check_argv, main  # by reference: submitit pickles harness.measure.main
from harness.runs import plugins

check_argv(sys.argv[1:])
plugins.load(plugins.from_argv(sys.argv[1:]))  # before composition: objective=<a plugin's>
main()
