"""The floor every other package stands on: the run's configuration (`config`), its parallel
layout (`layout`), the contract between the supervisor and the workers (`protocol`: the run
directory, failure classes, resume specs) and file primitives (`files`, `cpu_priority`).

It imports nothing of the project, and every other package may import it.
"""
