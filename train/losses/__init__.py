"""Training losses, one module per drafter family plus `common` (the frozen-target forward and the terms they share).

A recipe imports its own family's module (`from train.losses.eagle import eagle_loss_fn`), so a new drafter adds
one module here and edits no shared file. Each module's factories build a
`loss_fn(params, batch, rng[, frozen]) -> (scalar loss, metrics dict)` for train.loop from a model config. Batches
are int32 token windows [B, L + 1] (inputs w[:, :-1], next tokens w[:, 1:]). Losses with a frozen target take its
params as the 4th argument `frozen` (train.loop passes them into the jitted step instead of closing over them, so
they are neither baked into the program as constants nor un-sharded).
"""
