"""The step engine of a pipeline replica: a step scheduler over a paged KV cache's blocks.

`scheduler.Scheduler` plans each ragged step and applies its sampled tokens, `blocks.BlockPool`
holds the KV blocks' tables and prefix cache, `loop.EngineLoop` drives a pipeline's stages through
them, `runtime.EngineRuntime` is a one-stage worker on it (`CONVEYOR_ENGINE=step`). The cache and
the attention over it are `app.partitions.paged`, the step through a stage's layers
`app.partitions.ragged`.
"""
