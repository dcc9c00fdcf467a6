"""Developer tools of the kvprobe checkout (not installed): the import-graph measure and the import-linter contract type it backs."""
