# The two commands that do everything on a fresh machine:
#   make pipeline   set up, then run prepare -> train -> evaluate on the built-in tiny config
#   make test       set up, then run the test suite (what CI runs)
# and the production Prefect stack on this machine (README, "Running on a cluster"):
#   make server     PostgreSQL, a Prefect server on it (API auth on), work pool, worker
.PHONY: setup pipeline test server

setup:
	@bash scripts/setup.sh

pipeline: setup
	.venv/bin/goodput pipeline --config configs/tiny.yaml

test: setup
	.venv/bin/python -m pytest -m "not slow" -q -n 2 --dist loadfile --no-loadscope-reorder

server: setup
	.venv/bin/goodput server
