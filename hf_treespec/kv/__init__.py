"""The KV caches of the loops: `TreeKV` (one sequence: committed rows + tree rows), `RaggedKV` (a batch whose rows
commit different lengths), stacked drafter rows (`Drafter.expand_rows`) and sliding-window layers."""
