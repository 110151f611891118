"""forgeflow: checkpoint — the one checkpoint format: snapshot, persist, commit, verify, list.

    engine    CheckpointEngine: host-memory snapshot (copied while the next step computes),
              background persist, manifest commit, verified load onto any layout,
              fallback to the previous good checkpoint; read_checkpoint, the read-only path
    sharded   global pieces (key, global shape, offset): balanced saving, reshard on load
    shard     one rank's shard file: tensors with their layout, pinned host buffers, the
              (deferrable) host copy
    writer    background writers (thread, process) below the trainer's CPU priority, checksums
    manifest  the commit point: manifest written last, committed_checkpoints (the one
              listing), CheckpointRef (root URL, step, format) and locate, the step-folder
              spelling, leases, retention
"""
