"""What a user runs: the `xla-train` command line (cli.py) and its train and predict commands."""
