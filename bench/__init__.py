"""Benchmarks of async_ckpt against torch.save, PyTorch DCP and torchsnapshot, measured against this
machine's floors in the same run. ``python -m bench`` (from the repository root) runs them all;
``--quick`` and ``--stall`` are its smaller presets.

Modules, one concern each: ``measure`` (timing, statistics, RSS sampling), ``rounds`` (the
interleaved rounds every part runs its systems in), ``floors`` (the physical limits),
``workloads`` (the states and the training loop's model), ``systems`` (the interface every
checkpointing system is driven through, async_ckpt and torch.save; ``dcp`` and ``tsnap`` for the
peers), ``registry`` (every system by name), ``sweep`` and ``training`` (the two main
benchmarks), ``consistency`` (bit-exact restores, damage detection), ``figures`` and ``targets``
(ratios to floors and best peers, as the typed ``records``), ``article`` and ``interval`` (the
article's table and the interval advice), ``report``, ``markdown`` and ``plots`` (markdown and
PNGs); ``ranks``, ``sharded``, ``lazy``, ``incremental``, ``remote`` and the ``integrations_*``
modules are the other parts, each with its ``run`` and ``render``. ``bench_filters.py`` measures
the C byte-shuffle.
"""
