"""Benchmarks of async_ckpt against torch.save, PyTorch DCP and torchsnapshot, measured against this
machine's floors in the same run. ``python -m bench`` (from the repository root) runs them all;
``--quick`` and ``--stall`` are smaller presets. The harness: ``measure``, ``rounds``, ``floors``,
``workloads``; the systems: ``systems`` (the interface), ``dcp``, ``tsnap``, ``registry`` (all by
name); the parts, each with its ``run`` (and ``render``): ``sweep``, ``training``, ``lazy``,
``ranks``, ``sharded``, ``incremental``, ``decode``, ``remote``, ``integrations_*``; the results:
``figures``, ``targets``, ``consistency`` (as ``records``), turned
into ``report`` (with ``markdown``) and ``plots``. ``bench_filters.py`` measures the C byte-shuffle.
"""
