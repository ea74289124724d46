"""The `tandem` command line: `main` dispatches, `args` holds the shared flags, `run` is offline generation."""
