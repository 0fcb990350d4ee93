"""The on-disk format that the writer and the reader share (docs/FORMAT.md): names, the staging
and shard layout, shard files, the manifest and the value encoding. Never imports torch."""
