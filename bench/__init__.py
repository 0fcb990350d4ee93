"""Benchmarks of async_ckpt against torch.save, PyTorch DCP and torchsnapshot, measured against this
machine's floors in the same run. ``python -m bench`` (from the repository root) runs them all.

Modules, one concern each: ``measure`` (timing, statistics, RSS sampling), ``floors`` (the
physical limits), ``workloads`` (the states and the training loop's model), ``systems`` (the
interface every checkpointing system is driven through, async_ckpt and torch.save; ``dcp`` and
``tsnap`` for the peers), ``sweep`` and ``training`` (the two benchmarks), ``consistency``
(bit-exact restores, damage detection), ``figures`` (ratios to floors and best peers),
``article`` and ``interval`` (the article's table and the interval advice), ``report`` and
``plots`` (markdown and PNGs). ``stall.py`` is the older stall benchmark, built from the same
pieces; ``bench_filters.py`` measures the C byte-shuffle.
"""
