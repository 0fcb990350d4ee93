"""The training side: what runs in the training process, on the training thread (capture of the
state, the staging pool, RNG states, heartbeats, the rank's session, the memory tier's held
slots). See docs/ARCHITECTURE.md."""
