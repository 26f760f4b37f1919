"""The ``hf-treespec train`` subcommands, one parser module per command group (registered by `..cli`)."""
