"""Benchmarks of async_ckpt against torch.save, DCP and torchsnapshot, each figure against this
machine's floors measured in the same run: ``python -m bench``; method: docs/performance.md."""
