"""The step engine of a pipeline replica: a step scheduler over a paged KV cache's blocks.

Pure components the stage worker will drive (it does not yet): `scheduler.Scheduler` plans each
ragged step and applies its sampled tokens, `blocks.BlockPool` holds the KV blocks' tables and
prefix cache. The cache itself and the attention over it are `app.partitions.paged`.
"""
