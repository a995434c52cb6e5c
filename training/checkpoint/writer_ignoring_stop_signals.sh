#!/bin/sh
# How DCP's checkpoint writer process starts in process mode (training.checkpoint.WRITER_LAUNCHER):
# with SIGTERM, SIGINT and SIGHUP ignored, so that the signal asking the worker for an
# emergency save does not kill the process that writes it. Ignored signals stay ignored
# across exec; the writer still ends when the worker's pipe to it closes, or by SIGKILL.
trap '' TERM INT HUP
exec "$GOODPUT_WRITER_PYTHON" "$@"
