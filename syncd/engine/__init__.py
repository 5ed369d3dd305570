"""The engine: one source checkpoint to one published output.

Data flows one way through it: `convert` opens the source (`source`, over formats), gathers its surroundings
(`context`), asks the adapters for a plan, applies the store options (`options`), lets the target format shape
the specs (`targets`, `carry` for what the other format cannot hold), builds all of it once as a frozen
`Conversion`, writes everything in one pass over the source (`write/`), checks what was written, and publishes
it (`publish`: scratch file, fsync, no-replace link). `sets` writes a sharded safetensors output; `directions`
says which format a file converts to by default (and the daemon's direction choices); `inspect` describes a
checkpoint; `hashing` and `progress` serve the writer. Nothing here knows of the daemon.
"""
