"""The core: the Engine, the roles (accelerator, strategy, launcher), the devices, batching and
shapes, inference, signals and errors. With kernels/, parallel/ and io/ it is the library the job
is written on: it imports nothing of the job (tasks, run folders, options) or the commands."""
