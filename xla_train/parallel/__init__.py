"""How the work is split: the mesh (one value of named axis sizes), the strategies that lay a
model and its batches on it, the launchers that start the processes, tensor-parallel plans and
the loads into shards. Part of the library: imports core/, kernels/ and io/ only, never the job."""
