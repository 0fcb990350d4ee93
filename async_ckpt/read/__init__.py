"""The read side: reading and verifying committed snapshots (``snapshot``), and loading them into
the registered objects all or nothing (``restore``). See docs/ARCHITECTURE.md."""
