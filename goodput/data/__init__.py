"""The prepare stage as plain functions: sources, work units, tokenizer, token shards, manifest.

`goodput.data.prepare.prepare_dataset` runs the whole stage without Prefect; the Prefect
tasks in `tasks/prepare.py` wrap the same functions one by one.
"""
