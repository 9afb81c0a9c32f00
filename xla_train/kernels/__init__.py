"""The kernels: attention (flash, splash, flex and the mask path), the experts (dense and the
grouped matmul), the chunked head's loss, the routers' loss and generation with static shapes.
Part of the library: imports core/, parallel/ and io/ only, never the job."""
