# The two commands that do everything on a fresh machine:
#   make pipeline   set up, then run prepare -> train -> evaluate on the built-in tiny config
#   make test       set up, then run the test suite (what CI runs)
.PHONY: setup pipeline test

setup:
	@bash scripts/setup.sh

pipeline: setup
	.venv/bin/goodput pipeline --config configs/tiny.yaml

test: setup
	.venv/bin/python -m pytest -m "not slow" -q -n 2 --dist loadfile
