"""forgeflow: checkpoint — the one checkpoint format: snapshot, persist, commit, verify, list.

    engine    CheckpointEngine: host-memory snapshot (copied while the next step computes),
              background persist, manifest commit, verified load onto any layout,
              fallback to the previous good checkpoint; read_checkpoint, the read-only path
    sharded   global pieces (key, global shape, offset): balanced saving, reshard on load
    shard     one rank's shard file: tensors with their layout, pinned host buffers, the
              (deferrable) host copy
    plain     the JSON form of a state's structure (never a pickle: loading runs no code)
    legacy    format 2 (pickled), read only with FORGEFLOW_TRUST_LEGACY_CHECKPOINTS=1
    writer    background writers (thread, process) below the trainer's CPU priority, checksums
    host_copy a node's copy of its ranks' newest shards in host memory (tmpfs), read before S3 on a restart
    manifest  the commit point: manifest written last, committed_checkpoints (the one
              listing), CheckpointRef (root URL, step, format) and locate, the step-folder
              spelling, leases, retention

A checkpoint holds tensors and plain data only (format 3): reading one never unpickles.
A format-2 checkpoint (pickled skeletons and common state, whose loading runs code named
by the bytes) is refused with one error, unless the loading process sets
FORGEFLOW_TRUST_LEGACY_CHECKPOINTS=1, which says it trusts everyone who can write to the
checkpoint storage to run code as it; it then loads as before (see checkpoint.legacy).
"""
