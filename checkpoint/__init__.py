"""forgeflow: checkpoint — the one checkpoint format: snapshot, persist, commit, verify, list.

    engine    CheckpointEngine: host-memory snapshot, background persist, manifest commit, load
    shard     one rank's shard file: tensors with their layout, pinned host buffers
    writer    background writers (thread, process) and checksums
    manifest  the commit point: manifest written last, committed steps, leases, retention
"""
