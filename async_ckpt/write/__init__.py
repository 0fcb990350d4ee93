"""The writer side: the writer process (never importing torch), the typed protocol the trainer
talks to it in, and the commit stage. See docs/ARCHITECTURE.md."""
