"""`python -m infra.torchrun_agent ARGS`: torchrun (`python -m torch.distributed.run ARGS`,
the same arguments, the same agent), then an exit without Python's own teardown.

The agent imports all of torch; at its exit the interpreter's last garbage collection over
those modules took about 1 s on 2 cores, after every worker had ended, on the way of every
attempt's end (the launch task waits for the agent). A failed run ends as torchrun's does:
its error raised, exit status 1.
"""

from __future__ import annotations

if __name__ == "__main__":
    from torch.distributed.run import main

    from core.process_exit import exit_without_teardown

    main()
    exit_without_teardown(0)
