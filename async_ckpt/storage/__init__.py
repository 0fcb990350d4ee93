"""Where the bytes go: the ``Storage`` interface (``base``), the local POSIX directory behind it
(``local``), and the directory lock protocol (``locks``). See docs/ARCHITECTURE.md."""
