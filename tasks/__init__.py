"""Prefect tasks: retry, cache, timeout and concurrency policy around library calls.

Tags. Only tasks that hold a resource a user may want to cap across flow runs with
Prefect's tag concurrency limits carry one (`prefect concurrency-limit create upload 2`):
`training` (launch-training), `upload` (upload-checkpoint) and `evaluate`
(evaluate-checkpoint, evaluate-validated). A tagged task asks the server for its tags'
slots before it starts, a database write; on the temporary server's SQLite such a write
meets the recorder's writes now and then, gets a 503 and waits out the client's 2 s
backoff. Quick tasks (checks, validation, retention, records, reports) paid that 2 s at
random: 6 s of the tiny pipeline's flow thread and 10 s of its task threads (py-spy).
"""
