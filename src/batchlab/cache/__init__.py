"""The machine's caches, read and written as files by the calculator's callers (the calculator is given what
they hold)."""
