"""The read side: reading and verifying committed snapshots, and those the memory tier's keeper
holds (``snapshot``), and loading them into the registered objects once all of it is checked
(``restore``). See docs/ARCHITECTURE.md."""
