"""Checkpointing inside the training job: a torch.distributed.checkpoint (DCP) directory per
step, committed by a manifest written last.

    component   Checkpointer: the trainer's narrow interface (load, before_update,
                maybe_save with the schedule inside, emergency_save, close)
    resume      which checkpoint a worker group starts from (rank 0 decides)
    saving      one save at a time, synchronous or in the background, then the commit
    writer      DCP's file writer hashing what it writes; the stager; the writer process
    replicas    ranks holding the same tensors split what they stage and write
    reader      loading, every file checked against the manifest; from disk or the store
    verify      `python -m training.checkpoint.verify`: a process apart from training judges a
                checkpoint, in bounded memory (or each of a stream of them: --serve)
    errors, state   what a save or load raises; the state DCP saves

The same save loads at any world size (DCP reshards). Paths, the commit marker and the
copy identity are the run directory's (core.protocol).
"""
