"""Adapters that let a training framework save through async_ckpt with its own checkpoint entry
points and resume through its own resume call. One module per framework, each imported on demand
(``import async_ckpt.integrations.lightning``), so that the framework is needed only by whoever
uses its adapter (an optional extra of the package); nothing in the library imports this package.
"""
