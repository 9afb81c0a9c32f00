"""Storage and checkpoint IO: local folders and gs:// (storage), atomic writes (files), the
sharded checkpoint's reads and writes (checkpoint_io). Part of the library, never the job."""
